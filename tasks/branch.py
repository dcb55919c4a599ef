"""Stage 4 — branch (round r): sample the allocated continuations from their states.

Each chosen state is rebuilt from the stored rows of the main rollouts (``rollouts.segment_starts``:
the compressed context's exact token ids, checked against the state id) and continued with the
current policy; continuations of one state share its prefix in one ``n > 1`` generation. Every
token is charged to the ledger as ``branch`` (or ``summary``); a continuation the budget cannot pay
for is cut off and marked ``budget_cut``, and is left out of the Monte-Carlo means downstream.
Writes ``branches`` (one row per continuation) plus the continuations' own ``rollouts`` and
``episodes`` (so ``focus sql`` sees every generated token) and ``budget_ledger``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from focus_core.artifacts import Manifest
from focus_core.budget import BudgetLedger
from focus_core.ids import branch_id, content_id, episode_id
from focus_core.rollouts import episode_tables, segment_starts
from focus_core.schemas import schema_for
from tasks.fanout import play
from tasks.inputs import env_factory, generator_at, read, spent_tokens, tasks
from tasks.progress import GenerationBar
from tasks.stage import TOKENS_PER_ITERATION, RunContext, StageResult, run_stage, stage_task

READS = ("seed", "budget", "agent", "env.name", "env.tier", "env.options", "generation.backend", TOKENS_PER_ITERATION)


def stage_name(round_idx: int) -> str:
    return f"branch_r{round_idx}"


def compute(ctx: RunContext, iteration: int, round_idx: int, acquisition: Manifest, rollout: Manifest,
            policy_manifest: Manifest, charged: Sequence[Manifest], scratch: Path) -> StageResult:
    cfg = ctx.config
    if acquisition.skipped:
        return StageResult(skipped=acquisition.skipped)
    plan = read(ctx, acquisition, "acquisition")
    counts = plan.column("continuations").to_numpy()
    chosen = [(state, int(n)) for state, n in zip(plan.column("state_id").to_pylist(), counts, strict=True) if n]
    state_ids = [state for state, n in chosen for _ in range(n)]
    estimates = dict(zip(plan.column("state_id").to_pylist(), plan.column("cost_estimate").to_pylist(), strict=True))
    index = [k for _, n in chosen for k in range(n)]
    policy = generator_at(ctx, policy_manifest)
    by_id = {t.task_id: t for split in ("train", "heldout") for t in tasks(ctx, split)} if chosen else {}
    starts = segment_starts(state_ids, rollouts=read(ctx, rollout, "rollouts"), episodes=read(ctx, rollout, "episodes"),
                            tasks_by_id=by_id, system_prompt=env_factory(ctx)().system_prompt()) if chosen else []
    ledger = BudgetLedger(max(0, ctx.tokens_per_iteration - spent_tokens(ctx, charged)))
    seed = ctx.seed(iteration, stage_name(round_idx))
    timings: dict[str, float] = {}
    with GenerationBar(f"it {iteration} branches r{round_idx}", len(starts), unit="branch") as bar:
        # A state's continuations: samples 0, 1, ... of the state's seed, whichever shard plays them.
        seeds = [(ctx.seed(iteration, stage_name(round_idx), s.state_id), k)
                 for s, k in zip(starts, index, strict=True)]
        episodes = play(ctx, policy_manifest, policy, cfg.agent, starts=starts, episode_seeds=seeds, seed=seed,
                        ledger=ledger, costs=[estimates[s] for s in state_ids], kind="branch", round_idx=round_idx,
                        progress=bar.callback(), timings=timings)
    branches = [branch_id(s.state_id, round_idx, k) for s, k in zip(starts, index, strict=True)]
    ids = [episode_id(ctx.run_id, iteration, s.task.task_id, "branch", s.state_id, round_idx, k)
           for s, k in zip(starts, index, strict=True)]
    groups = [content_id(ctx.run_id, iteration, s.state_id, "branches") for s in starts]
    rollouts, episode_table = episode_tables(episodes, run_id=ctx.run_id, iteration=iteration,
                                             policy_version=policy.version, episode_ids=ids, group_ids=groups,
                                             branch_ids=branches)
    n = len(episodes)
    branch_table = pa.table({
        "run_id": [ctx.run_id] * n, "iteration": pa.array([iteration] * n, pa.int32()), "episode_id": ids,
        "segment_idx": pa.array([s.segment_idx for s in starts], pa.int32()),
        "state_id": [s.state_id for s in starts], "branch_id": branches,
        "policy_version": pa.array([policy.version] * n, pa.int32()),
        "round": pa.array([round_idx] * n, pa.int32()),
        "return": pa.array([e.reward for e in episodes], pa.float64()),
        "generated_tokens": pa.array([e.generated_tokens for e in episodes], pa.int64()),
        "truncated": [e.truncated for e in episodes],
    }, schema=schema_for("branches"))
    rows = ledger.rows(run_id=ctx.run_id, iteration=iteration, policy_version=policy.version)
    for row in rows:
        row["budget"] = ctx.tokens_per_iteration  # the iteration's budget, not what was left of it
    planned = float(np.dot(counts, plan.column("cost_estimate").to_numpy()))
    figures = {"continuations": n, "states": len(chosen), "tokens": ledger.spent, "planned_tokens": round(planned),
               "mean_return": float(np.mean([e.reward for e in episodes])) if episodes else 0.0,
               "budget_cut": sum(e.budget_cut for e in episodes),
               "cut_share": sum(e.budget_cut for e in episodes) / n if n else 0.0}
    return StageResult(tables={"branches": branch_table, "rollouts": rollouts, "episodes": episode_table,
                               "budget_ledger": pa.Table.from_pylist(rows, schema=schema_for("budget_ledger"))},
                       figures=figures, policy_version=policy.version, seeds={"branch": seed}, timings=timings)


@stage_task("branch")
def branch(ctx: RunContext, iteration: int, round_idx: int, acquisition: Manifest, rollout: Manifest,
           policy: Manifest, charged: Sequence[Manifest]) -> Manifest:
    upstream = {"acquisition": acquisition, "rollout": rollout, "policy": policy,
                **{f"charged_{k}": m for k, m in enumerate(charged)}}
    return run_stage(ctx, iteration, stage_name(round_idx), depends_on=ctx.fields(*READS), upstream=upstream,
                     compute=lambda scratch: compute(ctx, iteration, round_idx, acquisition, rollout, policy,
                                                     charged, scratch))
