#!/usr/bin/env bash
# One short FOCUS iteration of configs/gpu/qwen.yaml on a GPU machine, then its throughput as JSON:
# generated tokens per second in rollout, branch and evaluate (vLLM) and trained tokens per second in the update
# (hf + LoRA), read from the run's manifests.
#
#   infra/gpu/check.sh /models/Qwen2.5-1.5B-Instruct [OUT.json]
#
# Needs: `make setup` done, a local model folder (nothing is downloaded), nvidia-smi working; builds the GPU vLLM
# venv once (infra/vllm/setup.sh). Without a GPU it stops at once, in one line.
set -euo pipefail
model="${1:?usage: infra/gpu/check.sh MODEL_FOLDER [OUT.json]}"
out="${2:-bench/out/gpu_check.json}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$here"
if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then
    echo "infra/gpu/check.sh: no GPU here (nvidia-smi -L failed); run it on a GPU machine" >&2
    exit 2
fi
[[ -f "$model/config.json" ]] || { echo "infra/gpu/check.sh: $model has no config.json (fix: a Hugging Face model folder)" >&2; exit 2; }
FOCUS_VLLM_TARGET=gpu infra/vllm/setup.sh
store="$(mktemp -d)/runs"
.venv/bin/focus train --config configs/gpu/qwen.yaml --store "$store" --run-id gpu-check \
    --set "model.source=$model" --set iterations=1 --set budget.prompts_per_iteration=8 \
    --set budget.measure_episodes=16 --set env.eval_tasks=16
mkdir -p "$(dirname "$out")"
.venv/bin/python - "$store" "$out" <<'PY'
import json, sys
from focus_core.artifacts import ArtifactStore

store, out = ArtifactStore(sys.argv[1]), sys.argv[2]
figures = {}
for iteration, stage, manifest in store.committed("gpu-check"):
    seconds = manifest.timings.get("compute_s", 0.0)
    tokens = manifest.figures.get("policy_tokens" if stage == "update" else "tokens")
    if tokens and seconds:
        figures[f"{iteration}:{stage}"] = {"tokens": tokens, "seconds": round(seconds, 2),
                                           "tokens_per_s": round(tokens / seconds, 1)}
result = {"model": store.run_info("gpu-check")["config"]["model"]["source"], "stages": figures}
print(json.dumps(result, indent=1))
open(out, "w").write(json.dumps(result, indent=1))
PY
