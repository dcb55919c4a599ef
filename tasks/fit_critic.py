"""Stage 5 — fit_critic (round r): fit the critic ensemble on the returns seen so far this iteration
and write each state's value.

Training data, per distinct state: the own returns of the main episodes that visited it plus the
returns of its continuations from rounds 0..r (those cut off by the budget are left out: their 0 is
not the policy's doing). The ensemble (``focus_core.critic``) is refitted from scratch on the
policy's features of the state. The value used for advantages combines the critic's prior with the
state's continuation returns by precision (method.md §9.5, T8); a state's own episode return is not
in that mean, so its advantage is not pulled toward zero by its own outcome.

VinePPO has no critic: its values are the continuation means (the state's own return where the
budget left it without continuations). PPO+GAE fits on own returns only (no branches).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from focus_core.acquisition import combine_estimates
from focus_core.artifacts import Manifest
from focus_core.critic import EnsembleCritic
from focus_core.schemas import schema_for
from tasks.inputs import CRITIC_FOLDER, floats_or_nulls, read
from tasks.stage import RunContext, StageResult, run_stage


def stage_name(round_idx: int) -> str:
    return f"fit_critic_r{round_idx}"


def branch_returns(ctx: RunContext, branches: Sequence[Manifest]) -> dict[str, list[float]]:
    """Continuation returns per state id, leaving out continuations the budget cut off."""
    returns: dict[str, list[float]] = {}
    for manifest in branches:
        if manifest.skipped:
            continue
        table, episodes = read(ctx, manifest, "branches"), read(ctx, manifest, "episodes")
        cut = {e for e, was_cut in zip(episodes.column("episode_id").to_pylist(),
                                       episodes.column("budget_cut").to_pylist(), strict=True) if was_cut}
        for state, value, episode in zip(table.column("state_id").to_pylist(), table.column("return").to_pylist(),
                                         table.column("episode_id").to_pylist(), strict=True):
            if episode not in cut:
                returns.setdefault(state, []).append(value)
    return returns


def compute(ctx: RunContext, iteration: int, round_idx: int, segment: Manifest, branches: Sequence[Manifest],
            scratch: Path) -> StageResult:
    cfg = ctx.config
    if cfg.method in ("grpo", "dr_grpo", "rloo"):
        return StageResult(skipped=f"{cfg.method} has no critic and no continuations")
    states = read(ctx, segment, "states")
    state_ids = states.column("state_id").to_pylist()
    own = states.column("own_return").to_numpy()
    by_state = branch_returns(ctx, branches)
    n = np.array([len(by_state.get(s, ())) for s in state_ids])
    mc_mean = np.array([np.mean(by_state[s]) if s in by_state else np.nan for s in state_ids])
    figures: dict[str, float] = {"states": len(state_ids), "branched_states": int((n > 0).sum()),
                                 "returns": int(n.sum())}
    folders = {}
    if cfg.critic is None:  # VinePPO: Monte-Carlo values only
        critic_mean = critic_var = None
        value, value_var = np.where(n > 0, mc_mean, own), None
    else:
        features = np.array(states.column("features").to_pylist(), dtype=np.float32)
        # One training row per distinct state: all its own returns and continuation returns.
        distinct, first, inverse = np.unique(np.array(state_ids, dtype=object), return_index=True,
                                             return_inverse=True)
        successes = np.bincount(inverse, weights=own) + np.array([sum(by_state.get(s, ())) for s in distinct])
        trials = np.bincount(inverse).astype(float) + np.array([len(by_state.get(s, ())) for s in distinct])
        critic = EnsembleCritic(cfg.critic.model_copy(update={"seed": cfg.critic.seed + ctx.seed(iteration,
                                stage_name(round_idx)) % 1_000_000}), features.shape[1])
        report = critic.fit(features[first], successes, trials)
        critic_mean, critic_var = critic.predict(features)
        critic_var = np.maximum(critic_var, cfg.acquisition.jitter if cfg.acquisition else 1e-4)
        value, value_var = combine_estimates(critic_mean, critic_var, mc_mean, n)
        critic.save(scratch / CRITIC_FOLDER)
        folders[CRITIC_FOLDER] = scratch / CRITIC_FOLDER
        branched = n > 0
        figures |= {"fit_loss": report.final_loss, "critic_std": float(np.sqrt(critic_var).mean())}
        if branched.any():  # in-sample fit quality; the out-of-sample check is `focus sql critic_error`
            figures["critic_vs_mc_mae"] = float(np.abs(critic_mean[branched] - mc_mean[branched]).mean())
    rows = states.num_rows
    table = pa.table({
        "run_id": states.column("run_id"), "iteration": states.column("iteration"),
        "episode_id": states.column("episode_id"), "segment_idx": states.column("segment_idx"),
        "state_id": states.column("state_id"), "policy_version": states.column("policy_version"),
        "critic_mean": floats_or_nulls(critic_mean, rows), "critic_var": floats_or_nulls(critic_var, rows),
        "mc_mean": pa.array([None if k == 0 else float(m) for k, m in zip(n, mc_mean, strict=True)], pa.float64()),
        "n": pa.array(n, pa.int32()), "value": pa.array(value, pa.float64()),
        "value_var": floats_or_nulls(value_var, rows),
    }, schema=schema_for("values"))
    figures["mean_value"] = float(np.mean(value))
    return StageResult(tables={"values": table}, folders=folders, figures=figures,
                       policy_version=segment.policy_version)


@task(name="fit_critic", retries=1, cache_policy=NO_CACHE)
def fit_critic(ctx: RunContext, iteration: int, round_idx: int, segment: Manifest,
               branches: Sequence[Manifest]) -> Manifest:
    upstream = {"segment": segment, **{f"branch_{k}": m for k, m in enumerate(branches)}}
    return run_stage(ctx, iteration, stage_name(round_idx), depends_on=ctx.fields("seed", "method", "critic"),
                     upstream=upstream,
                     compute=lambda scratch: compute(ctx, iteration, round_idx, segment, branches, scratch))
