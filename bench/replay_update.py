"""Replay one committed update stage of a run, with config overrides, and print what it did as JSON.

The update stage is deterministic on CPU given its committed inputs (rollouts, advantages, the policy and its AdamW
state, the stage seed), so a replay without overrides reproduces the committed figures exactly, and a replay with
``ppo.lr=5e-5`` or ``advantage.whiten=false`` answers "would this update have gone otherwise?" without rerunning the
run. Nothing is committed: the new checkpoint goes to a temporary folder.

    python -m bench.replay_update critic_share_chain-lookup_chain-td0_critic-s105 2 --store /work/store \\
        --set ppo.target_kl=0.1 --set ppo.clip_ratio_c=3

Prints {"run_id", "iteration", "overrides", "approx_kl", "kls_before" (per step, before it), "kl_stop_step",
"clip_fraction", "max_grad_norm", "max_abs_policy_loss", "steps"}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import tasks.update
from focus_core.artifacts import ArtifactStore
from focus_core.config import validate_config, with_overrides
from focus_core.ppo import UpdateReport
from tasks.stage import RunContext


def replay(store: ArtifactStore, run_id: str, iteration: int, overrides: Sequence[str] = ()) -> dict:
    """The update of ``iteration`` again, on its committed inputs, with ``overrides`` (``section.field=value``)."""
    info = store.run_info(run_id)
    if info is None:
        raise SystemExit(f"no run {run_id} in this store (fix: --store, or `focus runs` to list them)")
    committed = list(store.committed(run_id))
    by_stage = {(i, stage): m for i, stage, m in committed}
    if (iteration, "update") not in by_stage:
        raise SystemExit(f"run {run_id} has no committed update at iteration {iteration}")
    config = with_overrides(validate_config(info["config"]), list(overrides))
    ctx = RunContext(store, run_id, config)
    by_hash = {m.hash: m for _, _, m in committed}
    upstream = by_stage[iteration, "update"].upstream  # the manifests the committed update read: {"policy": hash, ...}
    policy, reference = by_hash[upstream["policy"]], by_hash[upstream["reference"]]
    branches = [by_hash[upstream[f"branch_{k}"]] for k in range(len(upstream)) if f"branch_{k}" in upstream]
    reports: list[UpdateReport] = []
    real_train = tasks.update.train

    def keep_report(*args, **kwargs) -> UpdateReport:
        reports.append(real_train(*args, **kwargs))
        return reports[-1]

    tasks.update.train = keep_report
    try:
        with tempfile.TemporaryDirectory() as scratch:
            result = tasks.update.compute(ctx, iteration, by_stage[iteration, "rollout"],
                                          by_stage[iteration, "advantage"], policy, reference, Path(scratch),
                                          branches)
    finally:
        tasks.update.train = real_train
    rows = result.tables["updates"].to_pylist()
    report = reports[0] if reports else None
    return {"run_id": run_id, "iteration": iteration, "overrides": list(overrides),
            "approx_kl": result.figures.get("approx_kl"),
            "kls_before": report.kls_before if report else [], "kl_stop_step": report.kl_stop_step if report else None,
            "clip_fraction": result.figures.get("clip_fraction"),
            "max_grad_norm": max((r["grad_norm"] for r in rows), default=0.0),
            "max_abs_policy_loss": max((abs(r["policy_loss"]) for r in rows), default=0.0),
            "steps": result.figures["steps"]}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_id")
    parser.add_argument("iteration", type=int)
    parser.add_argument("--store", default="runs")
    parser.add_argument("--set", action="append", default=[], metavar="A.B=C", help="override a config field")
    args = parser.parse_args(argv)
    out = replay(ArtifactStore(args.store), args.run_id, args.iteration, args.set)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
