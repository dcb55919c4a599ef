"""Evaluation: the policy entering an iteration plays the same held-out tasks every time.

The held-out tasks (``env.eval_tasks`` of them, a fixed seeded sample) and the sampling seed are the
same at every iteration, so successive evaluations differ only by the policy (common random numbers:
the comparison is much less noisy than independent samples would make it). Iteration i evaluates the
policy that iteration i's rollouts used; the flow adds one evaluation after the last update.

On a trap environment (``combination_lock``, ``lookup_chain``) with the Markov context
(``agent.compression: observation``) the stage also computes the exact held-out success of the same
policy at the same temperature, V^π(s_0) per task by teacher-forced scoring and dynamic programming
(``focus_core.envs.trap_tools``): column ``exact_value`` and figure ``heldout_success_exact``, next to
the sampled ``heldout_success``. Elsewhere the column is null.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pyarrow as pa

from focus_core.artifacts import Manifest
from focus_core.envs.trap_tools import exact_evaluation
from focus_core.ids import episode_id
from focus_core.schemas import schema_for
from tasks.fanout import play
from tasks.inputs import env_factory, generator_at, tasks
from tasks.progress import GenerationBar
from tasks.stage import RunContext, StageResult, run_stage, stage_task

STAGE = "evaluate"
READS = ("seed", "agent", "env", "generation.backend")
log = logging.getLogger("focus")


def eval_tasks(ctx: RunContext) -> list:
    heldout = tasks(ctx, "heldout")
    order = np.random.default_rng(ctx.seed(0, STAGE, "tasks")).permutation(len(heldout))
    return [heldout[i] for i in order[: ctx.config.env.eval_tasks]]


def compute(ctx: RunContext, iteration: int, policy_manifest: Manifest, scratch: Path) -> StageResult:
    cfg = ctx.config
    policy = generator_at(ctx, policy_manifest)
    chosen = eval_tasks(ctx)
    agent = cfg.agent.model_copy(update={"temperature": cfg.env.eval_temperature})
    seed = ctx.seed(0, STAGE, "sampling")  # every iteration the same draws: common random numbers
    timings: dict[str, float] = {}
    with GenerationBar(f"it {iteration} evaluation", len(chosen)) as bar:
        episodes = play(ctx, policy_manifest, policy, agent, tasks=chosen, seed=seed, progress=bar.callback(),
                        timings=timings,
                        episode_seeds=[(ctx.seed(0, STAGE, "sampling", t.task_id), 0) for t in chosen])
    n = len(episodes)
    exact = None
    env = env_factory(ctx)()
    if env.has_exact_values and agent.compression != "observation":
        log.warning("[it %d] evaluate: no exact held-out success on %s without the Markov context (fix: "
                    "agent.compression=observation)", iteration, cfg.env.name)
    elif env.has_exact_values:
        exact = exact_evaluation(policy, env, chosen, agent)  # its figures join the stage's one log line
    table = pa.table({
        "run_id": [ctx.run_id] * n, "iteration": pa.array([iteration] * n, pa.int32()),
        "episode_id": [episode_id(ctx.run_id, iteration, t.task_id, "eval") for t in chosen],
        "policy_version": pa.array([policy.version] * n, pa.int32()),
        "task_id": [t.task_id for t in chosen], "split": [t.split for t in chosen],
        "reward": pa.array([e.reward for e in episodes], pa.float64()),
        "success": [e.reward > 0 for e in episodes],
        "n_turns": pa.array([e.n_tool_calls for e in episodes], pa.int32()),
        "generated_tokens": pa.array([e.generated_tokens for e in episodes], pa.int64()),
        "exact_value": pa.nulls(n, pa.float64()) if exact is None else pa.array(exact.values, pa.float64()),
    }, schema=schema_for("evaluation"))
    figures = {"heldout_success": float(np.mean([e.reward > 0 for e in episodes])),
               "mean_turns": float(np.mean([e.n_tool_calls for e in episodes])),
               "tokens": int(sum(e.generated_tokens for e in episodes))}
    if exact is not None:
        figures |= {"heldout_success_exact": float(exact.values.mean()), "exact_contexts": exact.contexts,
                    "exact_off_menu_mass": exact.off_menu_mass}
    return StageResult(tables={"evaluation": table}, figures=figures, policy_version=policy.version,
                       timings=timings)


@stage_task("evaluate")
def evaluate(ctx: RunContext, iteration: int, policy: Manifest) -> Manifest:
    return run_stage(ctx, iteration, STAGE, depends_on=ctx.fields(*READS), upstream={"policy": policy},
                     compute=lambda scratch: compute(ctx, iteration, policy, scratch))
