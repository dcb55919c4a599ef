"""The vLLM server of the ``vllm`` policy backend: ``setup.sh`` builds vLLM's own venv, ``server`` starts servers
from it (``python -m infra.vllm.server MODEL_FOLDER``, or ``VLLMServer`` from Python)."""
