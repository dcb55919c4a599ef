"""Stage 1 — rollout: the policy plays G episodes on each of P training tasks.

P tasks are drawn from the training split with the stage's derived seed; each gets G episodes
(G_main for the branching methods, G_grpo for the others — method.md §9.2). Every generated token
is charged to the iteration's ledger, which cuts episodes off rather than exceed the budget.
Writes ``rollouts`` (one row per turn), ``episodes`` and ``budget_ledger``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from focus_core.agent.harness import AgentRunner
from focus_core.artifacts import Manifest
from focus_core.budget import BudgetLedger
from focus_core.rollouts import episode_id, episode_tables
from focus_core.schemas import content_id, schema_for
from tasks.inputs import env_factory, policy_at, tasks
from tasks.stage import RunContext, StageResult, run_stage

STAGE = "rollout"


def compute(ctx: RunContext, iteration: int, policy_manifest: Manifest, scratch: Path) -> StageResult:
    cfg = ctx.config
    policy = policy_at(ctx, policy_manifest)
    seed = ctx.seed(iteration, STAGE)
    train = tasks(ctx, "train")
    rng = np.random.default_rng(seed)
    chosen = [train[i] for i in rng.choice(len(train), size=min(cfg.budget.prompts_per_iteration, len(train)),
                                           replace=False)]
    group = cfg.main_group_size
    batch = [t for t in chosen for _ in range(group)]
    ledger = BudgetLedger(cfg.budget.total_tokens)
    with tqdm(total=len(batch), desc=f"it {iteration} rollouts", unit="episode", leave=False) as bar:
        episodes = AgentRunner(policy, env_factory(ctx), cfg.agent).run(
            batch, seed=seed, ledger=ledger, progress=lambda done: bar.update(done - bar.n))
    ids = [episode_id(ctx.run_id, iteration, t.task_id, "main", k % group) for k, t in enumerate(batch)]
    groups = [content_id(ctx.run_id, iteration, t.task_id, "group") for t in batch]
    rollouts, episode_table = episode_tables(episodes, run_id=ctx.run_id, iteration=iteration,
                                             policy_version=policy.version, episode_ids=ids, group_ids=groups)
    ledger_table = pa.Table.from_pylist(ledger.rows(run_id=ctx.run_id, iteration=iteration,
                                                    policy_version=policy.version), schema=schema_for("budget_ledger"))
    rewards = np.array([e.reward for e in episodes])
    figures = {"episodes": len(episodes), "success": float(rewards.mean()),
               "tokens": ledger.spent, "budget": ledger.budget,
               "budget_cut": sum(e.budget_cut for e in episodes),
               "mean_turns": float(np.mean([e.n_tool_calls for e in episodes]))}
    return StageResult(tables={"rollouts": rollouts, "episodes": episode_table, "budget_ledger": ledger_table},
                       figures=figures, policy_version=policy.version, seeds={"rollout": seed})


@task(name="rollout", retries=1, cache_policy=NO_CACHE)
def rollout(ctx: RunContext, iteration: int, policy: Manifest) -> Manifest:
    return run_stage(ctx, iteration, STAGE,
                     depends_on=ctx.fields("seed", "method", "budget", "agent", "env.name", "env.tier", "env.options"),
                     upstream={"policy": policy}, compute=lambda scratch: compute(ctx, iteration, policy, scratch))
