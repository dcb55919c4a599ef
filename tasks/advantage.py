"""Stage 6 — advantage: one advantage per segment, by the method's estimator, dispatched through
``focus_core.advantages.ADVANTAGE_ESTIMATORS`` (one signature: an ``AdvantageBatch`` in, an
``AdvantageResult`` out).

The stage only gathers the batch: segment rewards in episode order, the values V̂ of the last fit_critic
round (FOCUS, VinePPO), the groups of the main episodes (GRPO family), and for ``gae`` (PPO+GAE) the
policy's value-head values at every token of the rollouts, computed here with the policy that sampled
them. A main episode the budget cut off is masked: it gets a group of its own and advantage 0, and the
update leaves it out. Writes ``advantages`` (one row per segment) and, for token-level estimators,
``token_advantages`` (per-token values, advantages and value targets the update trains on).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from focus_core.advantages import AdvantageBatch, get_advantage_estimator
from focus_core.artifacts import Manifest
from focus_core.rollouts import training_sequences
from focus_core.schemas import FLOATS, schema_for
from focus_core.value_head import token_values
from tasks.inputs import load_value_head, policy_at, read
from tasks.stage import RunContext, StageResult, run_stage

STAGE = "advantage"


def compute(ctx: RunContext, segment: Manifest, values: Manifest | None, rollout: Manifest, policy: Manifest,
            scratch: Path) -> StageResult:
    cfg = ctx.config
    states = read(ctx, segment, "states")
    # Segments of one episode in order; `lengths` segments per episode (the ragged-batch layout).
    order = np.lexsort((states.column("segment_idx").to_numpy(), states.column("episode_id").to_numpy(
        zero_copy_only=False)))
    states = states.take(order)
    episode = np.array(states.column("episode_id").to_pylist(), dtype=object)
    segment_idx = states.column("segment_idx").to_pylist()
    boundaries = np.flatnonzero(np.r_[True, episode[1:] != episode[:-1]])
    lengths = np.diff(np.r_[boundaries, len(episode)])
    episodes = read(ctx, rollout, "episodes")
    ids = list(episode[boundaries])
    column = {name: dict(zip(episodes.column("episode_id").to_pylist(), episodes.column(name).to_pylist(), strict=True))
              for name in ("group_id", "reward", "budget_cut")}
    cut = np.array([column["budget_cut"][e] for e in ids])
    groups = np.array([f"cut:{e}" if c else column["group_id"][e] for e, c in zip(ids, cut, strict=True)], dtype=object)
    batch = {"rewards": states.column("segment_reward").to_numpy(), "lengths": lengths,
             "outcomes": np.array([column["reward"][e] for e in ids], dtype=np.float64), "groups": groups,
             "segment_tokens": states.column("segment_generated_tokens").to_numpy()}
    method = cfg.method_row
    sequences = None
    if method.values in ("critic", "monte_carlo"):
        table = read(ctx, values, "values")
        value_of = dict(zip(zip(table.column("episode_id").to_pylist(), table.column("segment_idx").to_pylist(),
                                strict=True), table.column("value").to_pylist(), strict=True))
        batch["values"] = np.array([value_of[key] for key in zip(episode, segment_idx, strict=True)])
    elif method.values == "value_head":
        sequences = training_sequences(read(ctx, rollout, "rollouts"), episode_ids=ids)
        model = policy_at(ctx, policy)
        head = load_value_head(ctx, policy, model)
        batch["token_values"] = token_values(model.model, head, sequences)
        batch["token_masks"] = [s.loss_mask for s in sequences]
    result = get_advantage_estimator(cfg.advantage.estimator)(AdvantageBatch(**batch), cfg.advantage)
    masked = np.repeat(cut, lengths)
    advantage = np.where(masked, 0.0, result.advantage)
    delta = batch["rewards"] + cfg.advantage.gamma * result.next_value - result.value
    n = states.num_rows
    keys = {"run_id": states.column("run_id"), "iteration": states.column("iteration"),
            "episode_id": states.column("episode_id"), "segment_idx": states.column("segment_idx"),
            "state_id": states.column("state_id"), "policy_version": states.column("policy_version")}
    tables = {"advantages": pa.table({
        **keys, "reward": pa.array(batch["rewards"], pa.float64()), "value": pa.array(result.value, pa.float64()),
        "next_value": pa.array(result.next_value, pa.float64()), "delta": pa.array(delta, pa.float64()),
        "advantage": pa.array(advantage, pa.float64()), "lambda_return": pa.array(result.lambda_return, pa.float64()),
    }, schema=schema_for("advantages"))}
    if result.token_advantages is not None:
        zero = [np.zeros(len(a)) for a in result.token_advantages]
        token_adv = [z if m else a for a, z, m in zip(result.token_advantages, zero, masked, strict=True)]
        tables["token_advantages"] = pa.table({
            **keys, "values": pa.array([np.asarray(v, np.float32) for v in batch["token_values"]], FLOATS),
            "advantages": pa.array([np.asarray(a, np.float32) for a in token_adv], FLOATS),
            "returns": pa.array([np.asarray(r, np.float32) for r in result.token_returns], FLOATS),
        }, schema=schema_for("token_advantages"))
    figures = {"segments": n, "mean_advantage": float(np.mean(advantage)), "std_advantage": float(np.std(advantage)),
               "nonzero": int((np.abs(advantage) > 1e-9).sum()), "masked_episodes": int(cut.sum())}
    return StageResult(tables=tables, figures=figures, policy_version=segment.policy_version)


@task(name="advantage", retries=1, cache_policy=NO_CACHE)
def advantage(ctx: RunContext, iteration: int, segment: Manifest, values: Manifest | None,
              rollout: Manifest, policy: Manifest) -> Manifest:
    upstream = {"segment": segment, "rollout": rollout, "policy": policy,
                **({"values": values} if values is not None else {})}
    return run_stage(ctx, iteration, STAGE, depends_on=ctx.fields("method", "advantage"), upstream=upstream,
                     compute=lambda scratch: compute(ctx, segment, values, rollout, policy, scratch))
