"""Stage 1 — rollout: the policy plays the iteration's main episodes, groups of G per training task.

How a method fills the iteration's budget B_tok (``ctx.tokens_per_iteration``, measured at bootstrap):

* a branching method (FOCUS, VinePPO) plays P·G_main main episodes, P tasks × G_main; the rest of B_tok
  goes to continuations in the branch stages;
* the others (GRPO family, PPO+GAE) play whole groups of G_grpo, task after task, until the next group
  would not fit: waves of groups (half the expected groups, then half of what is left at the mean cost
  of the groups so far, ...), then single groups while the most expensive group seen still fits, so the
  spend ends within one group of B_tok and a main episode is never cut in practice.

Tasks are drawn from the training split without replacement in an order from the stage's derived seed.
Every generated token is charged to the iteration's ledger, which never lets the spend exceed B_tok; a
main episode it had to cut is marked ``budget_cut`` and masked downstream (left out of baselines, values
and the update), never scored as a failure. Writes ``rollouts`` (one row per turn), ``episodes`` and
``budget_ledger``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from focus_core.artifacts import Manifest
from focus_core.budget import BudgetLedger
from focus_core.config import FocusConfig
from focus_core.envs.base import Task
from focus_core.ids import content_id, episode_id
from focus_core.rollouts import episode_tables
from focus_core.schemas import schema_for
from tasks.fanout import play
from tasks.inputs import generator_at, tasks
from tasks.progress import GenerationBar
from tasks.stage import TOKENS_PER_ITERATION, RunContext, StageResult, run_stage, stage_task

STAGE = "rollout"
READS = ("seed", "method", "budget", "agent", "env.name", "env.tier", "env.options", "generation.backend",
         TOKENS_PER_ITERATION)
log = logging.getLogger("focus")


def compute(ctx: RunContext, iteration: int, policy_manifest: Manifest, scratch: Path) -> StageResult:
    cfg = ctx.config
    policy = generator_at(ctx, policy_manifest)
    seed = ctx.seed(iteration, STAGE)
    train = tasks(ctx, "train")
    order = [train[i] for i in np.random.default_rng(seed).permutation(len(train))]
    group = cfg.main_group_size
    ledger = BudgetLedger(ctx.tokens_per_iteration)
    batch, episodes, group_costs, timings = [], [], [], {}
    with GenerationBar(f"it {iteration} rollouts") as bar:
        for wave, chosen in enumerate(_waves(cfg, order, ledger, group_costs)):
            wave_tasks = [t for t in chosen for _ in range(group)]
            # A task's group: samples 0..G-1 of the task's seed, whichever wave or shard plays it.
            seeds = [(ctx.seed(iteration, STAGE, t.task_id), k % group) for k, t in enumerate(wave_tasks)]
            played = play(ctx, policy_manifest, policy, cfg.agent, tasks=wave_tasks, episode_seeds=seeds,
                          seed=seed + wave, ledger=ledger, progress=bar.callback(), timings=timings)
            group_costs += [sum(e.generated_tokens for e in played[k:k + group])
                            for k in range(0, len(played), group)]
            batch += wave_tasks
            episodes += played
    # Waves hold whole groups, so the k-th episode of the batch is episode k % G of its task's group.
    ids = [episode_id(ctx.run_id, iteration, t.task_id, "main", k % group) for k, t in enumerate(batch)]
    groups = [content_id(ctx.run_id, iteration, t.task_id, "group") for t in batch]
    rollouts, episode_table = episode_tables(episodes, run_id=ctx.run_id, iteration=iteration,
                                             policy_version=policy.version, episode_ids=ids, group_ids=groups)
    ledger_table = pa.Table.from_pylist(ledger.rows(run_id=ctx.run_id, iteration=iteration,
                                                    policy_version=policy.version), schema=schema_for("budget_ledger"))
    rewards = np.array([e.reward for e in episodes if not e.budget_cut] or [0.0])
    figures = {"episodes": len(episodes), "prompts": len(batch) // group, "success": float(rewards.mean()),
               "tokens": ledger.spent, "budget": ledger.budget, "spend_share": ledger.spent / ledger.budget,
               "budget_cut": sum(e.budget_cut for e in episodes),
               "mean_turns": float(np.mean([e.n_tool_calls for e in episodes]))}
    if figures["budget_cut"]:
        log.warning("[it %d] rollout: %d main episodes did not fit B_tok = %d and are masked (fix: a larger "
                    "budget.tokens_per_iteration, or fewer budget.prompts_per_iteration)", iteration,
                    figures["budget_cut"], ledger.budget)
    return StageResult(tables={"rollouts": rollouts, "episodes": episode_table, "budget_ledger": ledger_table},
                       figures=figures, policy_version=policy.version, seeds={"rollout": seed}, timings=timings)


def _waves(cfg: FocusConfig, order: list[Task], ledger: BudgetLedger, group_costs: list[int]) -> Iterator[list[Task]]:
    """The tasks of each wave of groups, in ``order``; ``group_costs`` grows as the caller plays them."""
    prompts = cfg.budget.prompts_per_iteration
    if cfg.uses_branches:  # P·G_main main episodes; the continuations spend the rest
        yield order[:prompts]
        return
    # First wave: half of the expected groups, so the cost estimate comes from this policy, not the bootstrap's.
    used = max(1, prompts // 2)
    yield order[:used]
    while used < len(order) and group_costs:
        mean, worst = float(np.mean(group_costs)), max(group_costs)
        # Each wave plans half of what is left at the mean cost, so its sum cannot overshoot; the last
        # groups go one at a time, each only while the most expensive group seen still fits.
        n = int(ledger.remaining / (2 * mean))
        if n < 1:
            if ledger.remaining < worst:
                return
            n = 1
        yield order[used:used + n]
        used += n


@stage_task("rollout")
def rollout(ctx: RunContext, iteration: int, policy: Manifest) -> Manifest:
    return run_stage(ctx, iteration, STAGE, depends_on=ctx.fields(*READS), upstream={"policy": policy},
                     compute=lambda scratch: compute(ctx, iteration, policy, scratch))
