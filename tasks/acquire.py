"""Stage 3 — acquire (round r): spend this round's share of the branch budget on the states whose
values the critic knows worst (``focus_core.acquisition``).

Candidates are the distinct states of the iteration's main episodes (every main episode of a task
starts in the same s_0, so a state id can occur several times): each is weighted by how much its
value error moves the advantages (W_k of its segment index, method.md §5.3) times its occurrences,
and priced at the generated tokens its own episode still needed from there. The round's budget is
what the ledger has left after the main rollouts and earlier rounds, split evenly over the rounds
still to run. Without a critic yet (FOCUS's first round of iteration 0) the states are drawn
uniformly at random, and the table says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from focus_core.acquisition import Candidates, Request, advantage_sensitivity, allocate
from focus_core.artifacts import Manifest
from focus_core.critic import EnsembleCritic
from focus_core.schemas import schema_for
from tasks.inputs import CRITIC_FOLDER, floats_or_nulls, read, spent_tokens
from tasks.stage import RunContext, StageResult, run_stage


def stage_name(round_idx: int) -> str:
    return f"acquire_r{round_idx}"


def distinct_states(states: pa.Table) -> tuple[pa.Table, np.ndarray]:
    """The first row of each distinct state id, and how often each occurs."""
    ids = np.array(states.column("state_id").to_pylist(), dtype=object)
    _, first, counts = np.unique(ids, return_index=True, return_counts=True)
    order = np.sort(first)
    return states.take(order), counts[np.argsort(first)]


def compute(ctx: RunContext, iteration: int, round_idx: int, segment: Manifest, critic: Manifest | None,
            charged: Sequence[Manifest], scratch: Path) -> StageResult:
    cfg = ctx.config
    if not cfg.uses_branches:
        return StageResult(skipped=f"{cfg.method} does not branch")
    states, occurrences = distinct_states(read(ctx, segment, "states"))
    rounds_left = cfg.acquisition.rounds - round_idx
    budget = max(0, cfg.budget.total_tokens - spent_tokens(ctx, charged)) / rounds_left
    features = np.array(states.column("features").to_pylist(), dtype=np.float32)
    acquisition = cfg.acquisition
    if critic is not None and not critic.skipped:
        members = EnsembleCritic.load(ctx.store.fetch_folder(ctx.run_id, critic.iteration, critic.stage,
                                                             CRITIC_FOLDER)).predict_members(features)
    else:
        members = None
        if acquisition.strategy not in ("uniform_all", "uniform_random"):
            acquisition = acquisition.model_copy(update={"strategy": "uniform_random"})
    segment_idx = states.column("segment_idx").to_numpy()
    candidates = Candidates(
        member_predictions=members if members is not None else np.full((2, states.num_rows), 0.5),
        cost=np.maximum(1.0, states.column("remaining_generated_tokens").to_numpy().astype(np.float64)),
        weight=advantage_sensitivity(segment_idx, gamma=cfg.advantage.gamma, lam=cfg.advantage.lam) * occurrences,
    )
    seed = ctx.seed(iteration, stage_name(round_idx))
    allocation = allocate(candidates, Request(budget, acquisition, seed=seed))
    reasons = [r or "not chosen" for r in allocation.reason]
    if members is None and acquisition is not cfg.acquisition:
        reasons = [f"{r} (no critic yet)" for r in reasons]
    n = states.num_rows
    table = pa.table({
        "run_id": states.column("run_id"), "iteration": states.column("iteration"),
        "episode_id": states.column("episode_id"), "segment_idx": states.column("segment_idx"),
        "state_id": states.column("state_id"), "policy_version": states.column("policy_version"),
        "round": pa.array([round_idx] * n, pa.int32()),
        "critic_mean": floats_or_nulls(None if members is None else candidates.mean, n),
        "critic_std": floats_or_nulls(None if members is None else np.sqrt(candidates.variance), n),
        "cost_estimate": pa.array(candidates.cost, pa.float64()),
        "score": pa.array([None if np.isnan(s) else float(s) for s in allocation.score], pa.float64()),
        "continuations": pa.array(allocation.counts, pa.int32()),
        "reason": reasons,
    }, schema=schema_for("acquisition"))
    figures = {"candidates": n, "chosen_states": int((allocation.counts > 0).sum()),
               "continuations": int(allocation.counts.sum()), "budget": round(budget),
               "estimated_tokens": round(allocation.estimated_tokens)}
    return StageResult(tables={"acquisition": table}, figures=figures, policy_version=segment.policy_version,
                       seeds={"acquire": seed})


@task(name="acquire", retries=1, cache_policy=NO_CACHE)
def acquire(ctx: RunContext, iteration: int, round_idx: int, segment: Manifest, critic: Manifest | None,
            charged: Sequence[Manifest]) -> Manifest:
    upstream = {"segment": segment, **{f"charged_{k}": m for k, m in enumerate(charged)}}
    if critic is not None:
        upstream["critic"] = critic
    return run_stage(ctx, iteration, stage_name(round_idx),
                     depends_on=ctx.fields("seed", "method", "budget", "acquisition", "advantage.gamma",
                                           "advantage.lam"),
                     upstream=upstream,
                     compute=lambda scratch: compute(ctx, iteration, round_idx, segment, critic, charged, scratch))
