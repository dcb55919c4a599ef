"""Stage 6 — advantage: one advantage per segment, by the method's estimator (``focus_core.advantages``).

* ``segment_td_lambda`` (FOCUS) and ``gae`` (PPO+GAE): TD(λ) over the segments of each episode with
  the values of the last fit_critic round; V = 0 after the last segment. PPO+GAE here is GAE at the
  granularity where the critic lives — segment starts — with a critic fitted on own returns.
* ``vineppo``: TD(0) with the Monte-Carlo values (λ = 0, γ = 1).
* ``grpo``, ``dr_grpo``, ``rloo``: one outcome advantage per episode from its group (the G episodes of
  one task), given to every segment of the episode; ``value`` is then the group baseline r − A.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from focus_core.advantages import (
    grpo_advantages,
    lambda_for_halflife,
    rloo_advantages,
    segment_td_lambda_batch,
    token_length_trace,
    vineppo_advantages_batch,
)
from focus_core.artifacts import Manifest
from focus_core.schemas import schema_for
from tasks.inputs import read
from tasks.stage import RunContext, StageResult, run_stage

STAGE = "advantage"


def compute(ctx: RunContext, segment: Manifest, values: Manifest | None, rollout: Manifest,
            scratch: Path) -> StageResult:
    cfg = ctx.config
    states = read(ctx, segment, "states")
    # Segments of one episode in order; `lengths` segments per episode (the ragged-batch layout).
    order = np.lexsort((states.column("segment_idx").to_numpy(), states.column("episode_id").to_numpy(
        zero_copy_only=False)))
    states = states.take(order)
    episode = np.array(states.column("episode_id").to_pylist(), dtype=object)
    boundaries = np.flatnonzero(np.r_[True, episode[1:] != episode[:-1]])
    lengths = np.diff(np.r_[boundaries, len(episode)])
    rewards = states.column("segment_reward").to_numpy()
    estimator = cfg.advantage.estimator
    if estimator in ("grpo", "dr_grpo", "rloo"):
        episodes = read(ctx, rollout, "episodes")
        group_of = dict(zip(episodes.column("episode_id").to_pylist(), episodes.column("group_id").to_pylist(),
                            strict=True))
        reward_of = dict(zip(episodes.column("episode_id").to_pylist(), episodes.column("reward").to_pylist(),
                             strict=True))
        ids = list(episode[boundaries])
        outcome = np.array([reward_of[e] for e in ids])
        groups = np.array([group_of[e] for e in ids], dtype=object)
        if estimator == "rloo":
            per_episode = rloo_advantages(outcome, groups)
        else:
            per_episode = grpo_advantages(outcome, groups, scale="std" if estimator == "grpo" else "none",
                                          unbiased=cfg.advantage.grpo_std == "unbiased")
        advantage = np.repeat(per_episode, lengths)
        value_now = np.repeat(outcome - per_episode, lengths)
        value_next = np.zeros_like(advantage)
        returns = advantage + value_now
    else:
        value_table = read(ctx, values, "values")
        key = dict(zip(zip(value_table.column("episode_id").to_pylist(), value_table.column("segment_idx").to_pylist(),
                           strict=True), value_table.column("value").to_pylist(), strict=True))
        value_now = np.array([key[(e, k)] for e, k in zip(episode, states.column("segment_idx").to_pylist(),
                                                           strict=True)])
        # K_i + 1 values per episode: V(s_0..s_{K-1}) then 0 after the end.
        flat_values = np.insert(value_now, np.r_[boundaries[1:], len(episode)], 0.0)
        if estimator == "vineppo":
            advantage, returns = vineppo_advantages_batch(rewards, flat_values, lengths)
        else:
            trace = None
            if cfg.advantage.trace_mode == "token_length":
                trace = token_length_trace(states.column("segment_generated_tokens").to_numpy(),
                                           lambda_for_halflife(cfg.advantage.lambda_token_halflife))
            advantage, returns = segment_td_lambda_batch(rewards, flat_values, lengths, gamma=cfg.advantage.gamma,
                                                         lam=cfg.advantage.lam, trace=trace)
        value_next = np.delete(flat_values, boundaries + np.arange(len(boundaries)))
    delta = rewards + cfg.advantage.gamma * value_next - value_now
    n = states.num_rows
    table = pa.table({
        "run_id": states.column("run_id"), "iteration": states.column("iteration"),
        "episode_id": states.column("episode_id"), "segment_idx": states.column("segment_idx"),
        "state_id": states.column("state_id"), "policy_version": states.column("policy_version"),
        "reward": pa.array(rewards, pa.float64()), "value": pa.array(value_now, pa.float64()),
        "next_value": pa.array(value_next, pa.float64()), "delta": pa.array(delta, pa.float64()),
        "advantage": pa.array(advantage, pa.float64()), "lambda_return": pa.array(returns, pa.float64()),
    }, schema=schema_for("advantages"))
    figures = {"segments": n, "mean_advantage": float(np.mean(advantage)), "std_advantage": float(np.std(advantage)),
               "nonzero": int((np.abs(advantage) > 1e-9).sum())}
    return StageResult(tables={"advantages": table}, figures=figures, policy_version=segment.policy_version)


@task(name="advantage", retries=1, cache_policy=NO_CACHE)
def advantage(ctx: RunContext, iteration: int, segment: Manifest, values: Manifest | None,
              rollout: Manifest) -> Manifest:
    upstream = {"segment": segment, "rollout": rollout, **({"values": values} if values is not None else {})}
    return run_stage(ctx, iteration, STAGE, depends_on=ctx.fields("method", "advantage"), upstream=upstream,
                     compute=lambda scratch: compute(ctx, segment, values, rollout, scratch))
