"""Speed of the algorithm library on this machine, as JSON.

  segment_td_lambda   vectorised TD(λ) over 1M segments in 100k ragged trajectories (numpy, torch)
  ivr_greedy          allocating a budget over 5,000 candidate states (5-member ensemble)
  critic_fit          fitting the 5-member ensemble critic on 10k states × 64 features

Each figure is the best of `--repeats` runs (wall-clock seconds), next to its target.

    python bench/speed.py --json bench/out/speed.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench import emit_json
from focus_core.acquisition import Candidates, Request, allocate
from focus_core.advantages import segment_td_lambda_batch
from focus_core.config import AcquisitionConfig, AdvantageConfig, CriticConfig
from focus_core.critic import EnsembleCritic

ADVANTAGE = AdvantageConfig()  # γ and λ as the pipeline uses them by default


def td_lambda(rewards, values, lengths):  # noqa: ANN001, ANN202
    return segment_td_lambda_batch(rewards, values, lengths, gamma=ADVANTAGE.gamma, lam=ADVANTAGE.lam)


def best_of(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    results: dict[str, dict] = {}

    # 100k trajectories of 1..19 segments: ~1M segments.
    lengths = rng.integers(1, 20, size=100_000)
    n = int(lengths.sum())
    rewards, values = rng.random(n), rng.random(n + len(lengths))
    results["segment_td_lambda_numpy"] = {
        "segments": n, "trajectories": len(lengths), "target_s": 1.0,
        "seconds": best_of(lambda: td_lambda(rewards, values, lengths), args.repeats),
    }
    rewards_t, values_t = torch.from_numpy(rewards), torch.from_numpy(values)
    results["segment_td_lambda_torch"] = {
        "segments": n, "trajectories": len(lengths), "target_s": 1.0,
        "seconds": best_of(lambda: td_lambda(rewards_t, values_t, lengths), args.repeats),
    }

    # 5,000 candidates; costs ~ remaining tokens; budget = half the tokens of the states' trajectories.
    states = 5000
    cost = rng.integers(50, 2000, size=states).astype(float)
    candidates = Candidates(rng.beta(2, 2, size=(5, states)), cost=cost, weight=rng.uniform(1, 2, states))
    # ≈ 0.5 × main tokens at 2.5 states/trajectory
    request = Request(0.5 * cost.sum() / 2.5, AcquisitionConfig(strategy="ivr_greedy"))
    allocation = allocate(candidates, request)
    results["ivr_greedy"] = {
        "candidates": states, "budget_tokens": request.budget_tokens, "chunks_picked": len(allocation.picks),
        "states_branched": int((allocation.counts > 0).sum()), "target_s": 5.0,
        "seconds": best_of(lambda: allocate(candidates, request), args.repeats),
    }

    # The error-predicting rules on the same candidates, with what the acquire stage gives them: features,
    # the returns each state has, and the out-of-fold critic values.
    observed = rng.integers(0, 3, size=states).astype(float)
    inputs = {"features": rng.normal(size=(states, 64)).astype(np.float32), "return_count": observed,
              "return_sum": rng.binomial(observed.astype(int), 0.5).astype(float),
              "oof_mean": rng.beta(2, 2, size=states), "already": observed.astype(np.int64)}
    for strategy in ("residual_knn", "beta_posterior", "novelty"):
        rule = Candidates(candidates.member_predictions, cost=cost, weight=candidates.weight, **inputs)
        rule_request = Request(request.budget_tokens, AcquisitionConfig(strategy=strategy))
        results[strategy] = {"candidates": states, "budget_tokens": request.budget_tokens, "target_s": 5.0,
                             "seconds": best_of(lambda r=rule, q=rule_request: allocate(r, q), args.repeats)}

    x = rng.normal(size=(10_000, 64)).astype(np.float32)
    trials = rng.integers(1, 5, size=10_000)
    successes = rng.binomial(trials, 1 / (1 + np.exp(-x[:, 0])))
    config = CriticConfig()
    results["critic_fit"] = {
        "states": 10_000, "features": 64, "members": config.members, "hidden": config.hidden, "steps": config.steps,
        "seconds": best_of(lambda: EnsembleCritic(config, 64).fit(x, successes, trials), 1),
    }
    for entry in results.values():
        if "target_s" in entry:
            entry["meets_target"] = entry["seconds"] <= entry["target_s"]
    results["machine"] = {"torch_threads": torch.get_num_threads()}
    emit_json(results, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
