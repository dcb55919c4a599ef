"""The SFT warm start of the tiny default model, per environment: what the bootstrap stage produces.

For each environment: ``warm_start`` (tokenizer on expert text, tiny Llama from ``ModelConfig``, SFT on
expert demonstrations with injected mistakes, bounded by ``--seconds``), then the policy plays
``--episodes`` held-out and as many training tasks at the default sampling temperature through the
harness. Prints (and with ``--json`` writes) per environment: SFT steps, epochs, final loss, seconds
(demonstrations + SFT), held-out and train success, median turns. Issue 3's target is held-out
success in 0.15–0.7 within 5 minutes per environment.

    python bench/sft_warmstart.py --json bench/out/sft.json            # ~6 minutes per environment
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from bench import emit_json
from focus_core.agent.harness import AgentRunner
from focus_core.agent.sft import warm_start
from focus_core.config import AgentConfig, BootstrapConfig, ModelConfig
from focus_core.envs import make_env

ENVIRONMENTS = ("deep_search", "code_localization", "legal")


def measure(name: str, *, seconds: float, demonstrations: int, episodes: int, seed: int) -> dict:
    factory = functools.partial(make_env, name)
    env = factory()
    train, heldout = env.tasks("train"), env.tasks("heldout")
    agent = AgentConfig()
    started = time.perf_counter()
    policy, report = warm_start(factory, train, agent, ModelConfig(),
                                BootstrapConfig(demonstrations=demonstrations, max_seconds=seconds), seed=seed)
    bootstrap_s = time.perf_counter() - started
    rng = np.random.default_rng(seed)
    results = {}
    for split, tasks in (("heldout", heldout), ("train", train)):
        chosen = [tasks[i] for i in rng.choice(len(tasks), size=min(episodes, len(tasks)), replace=False)]
        played = AgentRunner(policy, factory, agent).run(chosen, seed=seed)
        results[f"{split}_success"] = float(np.mean([e.reward for e in played]))
        results[f"{split}_median_turns"] = float(np.median([e.n_tool_calls for e in played]))
    return {"env": name, "sft_steps": report.steps, "sft_epochs": report.epochs_done, "sft_loss": report.final_loss,
            "sft_seconds": report.seconds, "bootstrap_seconds": bootstrap_s, "episodes": episodes,
            "threads": torch.get_num_threads(), **results}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=list(ENVIRONMENTS), choices=ENVIRONMENTS)
    parser.add_argument("--seconds", type=float, default=240.0, help="SFT time limit per environment")
    parser.add_argument("--demonstrations", type=int, default=1000)
    parser.add_argument("--episodes", type=int, default=32, help="held-out (and train) tasks played")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = [measure(name, seconds=args.seconds, demonstrations=args.demonstrations, episodes=args.episodes,
                       seed=args.seed) for name in args.envs]
    emit_json({"results": results}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
