"""Stage 6 — advantage: one advantage per segment, by the method's estimator, dispatched through
``focus_core.advantages.ADVANTAGE_ESTIMATORS`` (one signature: an ``AdvantageBatch`` in, an
``AdvantageResult`` out).

The stage only gathers the batch: segment rewards in episode order, the values V̂ of the last fit_critic
round (FOCUS, VinePPO), the groups of the main episodes (GRPO family), and for ``gae`` (PPO+GAE) the
policy's value-head values at every token of the rollouts, computed here with the policy that sampled
them. A main episode the budget cut off is masked: it gets a group of its own and advantage 0, and the
update leaves it out. Writes ``advantages`` (one row per segment) and, for token-level estimators,
``token_advantages`` (per-token values, advantages and value targets the update trains on).

What trains: the segments of the main episodes, and with ``ppo.train_on_continuations`` (on for FOCUS, off
for VinePPO, refused for methods that do not branch) also every segment of every continuation of the
branch stages, keyed by its own episode id (``focus_core.continuations``). A continuation's first segment
starts at its parent state, whose value is the parent's leave-one-out value (its out-of-fold critic prior
and the state's other returns); its later states, new to the critic, get the last round's full critic
evaluated on their features (the policy's mean-pooled hidden states, as in stage segment); without a critic
VinePPO's r_k + V̂(s_{k+1}) rule. A continuation the budget cut is masked like a main episode.

``exact_values`` (a diagnostic on the trap environments): every V̂ above is replaced by the exact V^π of the
policy that sampled the iteration at that state (``ExactEvaluator.values_at``), so a run shows what a perfect
critic would buy at the same budget; the figure ``estimated_value_error`` is mean |V̂ − V^π| over the batch.
``exact_values_share`` s < 1 uses s·V^π + (1 − s)·V̂ instead, a critic whose error is (1 − s) times the fitted
one's, in the same direction (figure ``value_error``): how good a critic must be before its credit pays.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path

import numpy as np
import pyarrow as pa

from focus_core.advantages import AdvantageBatch, get_advantage_estimator
from focus_core.artifacts import Manifest
from focus_core.continuations import continuation_values, observed_returns
from focus_core.envs.trap_tools import ExactEvaluator
from focus_core.features import state_features
from focus_core.policy.hf import HFPolicy
from focus_core.rollouts import segment_starts, training_sequences
from focus_core.schemas import FLOATS, schema_for
from focus_core.value_head import token_values
from tasks.fit_critic import out_of_fold_values
from tasks.inputs import (
    CRITIC_FOLDER,
    STATE_KEYS,
    continuation_tables,
    env_factory,
    load_value_head,
    policy_at,
    read,
    state_keys,
    tasks,
)
from tasks.stage import RunContext, StageResult, run_stage, stage_task

STAGE = "advantage"
READS = ("method", "advantage", "ppo.train_on_continuations", "exact_values", "exact_values_share",
         "critic.fold_unit")
# The states columns the batch and the advantages table read (main and continuation states alike).
COLUMNS = (*STATE_KEYS, "segment_reward", "segment_generated_tokens")


def compute(ctx: RunContext, segment: Manifest, values: Manifest | None, rollout: Manifest, policy: Manifest,
            scratch: Path, branches: Sequence[Manifest] = ()) -> StageResult:
    cfg = ctx.config
    method = cfg.method_row
    main_states, episodes = read(ctx, segment, "states"), read(ctx, rollout, "episodes")
    states, value_of, n_continuations = main_states.select(COLUMNS), {}, 0
    # The sampling policy, loaded at most once: continuations' features, exact values and the value head all read it.
    sampler = cache(lambda: policy_at(ctx, policy))
    if method.values in ("critic", "monte_carlo"):
        table = read(ctx, values, "values")
        value_of = dict(zip(zip(table.column("episode_id").to_pylist(), table.column("segment_idx").to_pylist(),
                                strict=True), table.column("value").to_pylist(), strict=True))
        if cfg.ppo.train_on_continuations:
            more, more_episodes, more_values = _continuations(ctx, main_states, episodes, table, values, sampler,
                                                              branches)
            n_continuations = more.num_rows
            value_of |= more_values
            states = pa.concat_tables([states, more.select(COLUMNS)])
            episodes = pa.concat_tables([episodes, more_episodes])
    # Segments of one episode in order; `lengths` segments per episode (the ragged-batch layout).
    order = np.lexsort((states.column("segment_idx").to_numpy(), states.column("episode_id").to_numpy(
        zero_copy_only=False)))
    states = states.take(order)
    episode = np.array(states.column("episode_id").to_pylist(), dtype=object)
    segment_idx = states.column("segment_idx").to_pylist()
    boundaries = np.flatnonzero(np.r_[True, episode[1:] != episode[:-1]])
    lengths = np.diff(np.r_[boundaries, len(episode)])
    ids = list(episode[boundaries])
    column = {name: dict(zip(episodes.column("episode_id").to_pylist(), episodes.column(name).to_pylist(), strict=True))
              for name in ("group_id", "reward", "budget_cut")}
    cut = np.array([column["budget_cut"][e] for e in ids])
    groups = np.array([f"cut:{e}" if c else column["group_id"][e] for e, c in zip(ids, cut, strict=True)], dtype=object)
    batch = {"rewards": states.column("segment_reward").to_numpy(), "lengths": lengths,
             "outcomes": np.array([column["reward"][e] for e in ids], dtype=np.float64), "groups": groups,
             "segment_tokens": states.column("segment_generated_tokens").to_numpy()}
    exact_figures = {}
    if method.values in ("critic", "monte_carlo"):
        batch["values"] = np.array([value_of[key] for key in zip(episode, segment_idx, strict=True)])
        if cfg.exact_values:
            estimated, exact = batch["values"], _exact_values(ctx, states, rollout, sampler, branches)
            share = cfg.exact_values_share
            batch["values"] = exact if share == 1.0 else share * exact + (1.0 - share) * estimated
            exact_figures = {"estimated_value_error": float(np.mean(np.abs(estimated - exact))),
                             "value_error": float(np.mean(np.abs(batch["values"] - exact)))}
    elif method.values == "value_head":
        sequences = training_sequences(read(ctx, rollout, "rollouts"), episode_ids=ids)
        model = sampler()
        head = load_value_head(ctx, policy, model)
        batch["token_values"] = token_values(model.model, head, sequences)
        batch["token_masks"] = [s.loss_mask for s in sequences]
    result = get_advantage_estimator(cfg.advantage.estimator)(AdvantageBatch(**batch), cfg.advantage)
    masked = np.repeat(cut, lengths)
    advantage = np.where(masked, 0.0, result.advantage)
    delta = batch["rewards"] + cfg.advantage.gamma * result.next_value - result.value
    n, keys = states.num_rows, state_keys(states)
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
    if cfg.ppo.train_on_continuations:
        figures["continuation_segments"] = n_continuations
    figures |= exact_figures
    return StageResult(tables=tables, figures=figures, policy_version=segment.policy_version)


def _continuations(ctx: RunContext, main_states: pa.Table, main_episodes: pa.Table, value_table: pa.Table,
                   values: Manifest, sampler: Callable[[], HFPolicy], branches: Sequence[Manifest]
                   ) -> tuple[pa.Table, pa.Table, dict[tuple[str, int], float]]:
    """The continuations' states and episodes (every branch round), and V̂ at each of their segment starts."""
    grown = continuation_tables(ctx, branches)
    if grown is None:
        return main_states.slice(0, 0), main_episodes.slice(0, 0), {}
    states, episodes = grown
    episode = np.array(states.column("episode_id").to_pylist(), dtype=object)
    segment_idx = states.column("segment_idx").to_numpy()
    first = np.flatnonzero(np.r_[True, episode[1:] != episode[:-1]])
    lengths = np.diff(np.r_[first, len(episode)]).astype(np.int64)
    row = {e: i for i, e in enumerate(episodes.column("episode_id").to_pylist())}
    at = [row[e] for e in episode[first]]
    parent, reward, cut = (np.array(episodes.column(c).to_pylist(), dtype=object)[at]
                           for c in ("parent_state_id", "reward", "budget_cut"))
    starts = np.array(states.column("state_id").to_pylist(), dtype=object)[first]
    if (starts != parent).any():
        raise ValueError(f"advantage: continuation {episode[first][starts != parent][0]} does not start in its "
                         f"parent state; the branch tables are not the ones that produced it")
    prior = {}
    for state, mean, var in zip(*(value_table.column(c).to_pylist() for c in ("state_id", "critic_mean", "critic_var")),
                                strict=True):
        prior.setdefault(state, (np.nan if mean is None else mean, np.nan if var is None else var))
    seen = observed_returns(main_states, main_episodes, episodes)
    later = np.full(len(episode), np.nan)
    rest = np.setdiff1d(np.arange(len(episode)), first)
    if ctx.config.uses_critic and rest.size:
        if CRITIC_FOLDER not in values.files:
            raise ValueError(f"advantage: {values.stage} has no critic checkpoint for the continuations' states")
        contexts = states.column("context_token_ids").take(pa.array(rest)).to_pylist()
        features = state_features(sampler().model, contexts, segment_idx[rest])
        # From the fold critic that saw neither this continuation's return nor (critic.fold_unit: task) any other
        # of its task's.
        task = np.array(episodes.column("task_id").to_pylist(), dtype=object)[[row[e] for e in episode[rest]]]
        later[rest] = out_of_fold_values(ctx, values, list(task), list(episode[rest]), features)
    value = continuation_values(
        states.column("segment_reward").to_numpy(), lengths,
        prior_mean=np.array([prior[s][0] for s in parent], dtype=np.float64),
        prior_var=np.array([prior[s][1] for s in parent], dtype=np.float64),
        return_sum=np.array([seen.get(s, (0.0, 0))[0] for s in parent], dtype=np.float64),
        return_n=np.array([seen.get(s, (0.0, 0))[1] for s in parent], dtype=np.float64),
        own_return=reward.astype(np.float64), counted=~cut.astype(bool), later=later)
    return states, episodes, dict(zip(zip(episode, segment_idx.tolist(), strict=True), value.tolist(), strict=True))


def _exact_values(ctx: RunContext, states: pa.Table, rollout: Manifest, sampler: Callable[[], HFPolicy],
                  branches: Sequence[Manifest]) -> np.ndarray:
    """``exact_values``: V^π of the policy that sampled the iteration at each state (trap environments only)."""
    env = env_factory(ctx)()
    if not env.has_exact_values:
        raise ValueError(f"exact_values: {ctx.config.env.name} has no exact values (fix: a trap environment, "
                         f"e.g. env.name=combination_lock, or remove exact_values)")
    parts = [rollout, *(m for m in branches if not m.skipped)]
    starts = segment_starts(states.column("state_id").to_pylist(),
                            rollouts=pa.concat_tables([read(ctx, m, "rollouts") for m in parts]),
                            episodes=pa.concat_tables([read(ctx, m, "episodes") for m in parts]),
                            tasks_by_id={t.task_id: t for t in tasks(ctx, "train")}, system_prompt=env.system_prompt())
    evaluator = ExactEvaluator(sampler(), env, ctx.config.agent)
    return evaluator.values_at([(start.task, start.calls, start.turn_idx) for start in starts])


@stage_task("advantage")
def advantage(ctx: RunContext, iteration: int, segment: Manifest, values: Manifest | None,
              rollout: Manifest, policy: Manifest, branches: Sequence[Manifest] = ()) -> Manifest:
    on = ctx.config.ppo.train_on_continuations
    upstream = {"segment": segment, "rollout": rollout, "policy": policy,
                **({"values": values} if values is not None else {}),
                **({f"branch_{k}": m for k, m in enumerate(branches)} if on else {})}
    return run_stage(ctx, iteration, STAGE, depends_on=ctx.fields(*READS), upstream=upstream,
                     compute=lambda scratch: compute(ctx, segment, values, rollout, policy, scratch, branches))
