"""Stage 3 — acquire (round r): spend this round's share of the branch budget on the states whose
values the critic knows worst (``focus_core.acquisition``).

Candidates are the distinct states of the iteration's main episodes (every main episode of a task
starts in the same s_0, so a state id can occur several times): each is weighted by how much its
value error moves the advantages (W_k of its segment index, method.md §5.3) times its occurrences,
and priced at the tokens one continuation is expected to cost (``continuation_cost``, raised by the
actual/planned spend of earlier rounds when they overspent). Each carries every return it already has
(own returns of its main episodes, earlier rounds' continuations), which the per-state cap and the
critic-driven strategies count. The round's budget is what the ledger has left after the main rollouts and
earlier rounds, split evenly over the rounds still to run; the last round plans
``acquisition.last_round_margin_sd`` standard deviations of its spend below that (``margin``,
``budget.spend_margin``), since no later round can absorb an overspend.

Without a critic yet (FOCUS's first round of iteration 0) the states are drawn uniformly at random,
and the table says so. ``entropy`` (ARPO/AEPO-style) reads the policy's next-action entropy at each
state from the rollouts' own log-probs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from focus_core.acquisition import CRITIC_FREE_STRATEGIES, Candidates, Request, advantage_sensitivity, allocate
from focus_core.artifacts import Manifest
from focus_core.budget import spend_margin
from focus_core.critic import EnsembleCritic
from focus_core.schemas import schema_for
from tasks.fit_critic import branch_observations
from tasks.inputs import CRITIC_FOLDER, floats_or_nulls, read, spent_tokens, state_keys
from tasks.stage import TOKENS_PER_ITERATION, RunContext, StageResult, run_stage, stage_task

READS = ("seed", "method", "budget", "acquisition", "advantage.gamma", "advantage.lam", TOKENS_PER_ITERATION)


def stage_name(round_idx: int) -> str:
    return f"acquire_r{round_idx}"


def distinct_states(states: pa.Table) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """The first row of each distinct state id, how often each occurs, and each row's distinct index."""
    ids = np.array(states.column("state_id").to_pylist(), dtype=object)
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return states.take(first[order]), np.bincount(rank[inverse]), rank[inverse]


def next_action_entropy(rollouts: pa.Table, states: pa.Table) -> np.ndarray:
    """Per states row, −mean log-prob of the first policy message of its segment: a one-sample estimate of
    the policy's per-token entropy of its next action there (ARPO/AEPO branch where it is high)."""
    first: dict[tuple[str, int], float] = {}
    for episode, segment, role, logprobs in zip(rollouts.column("episode_id").to_pylist(),
                                                rollouts.column("segment_idx").to_pylist(),
                                                rollouts.column("role").to_pylist(),
                                                rollouts.column("logprobs").to_pylist(), strict=True):
        if role == "policy" and (episode, segment) not in first and logprobs:
            first[(episode, segment)] = -float(np.mean(logprobs))
    return np.array([first.get(key, 0.0) for key in zip(states.column("episode_id").to_pylist(),
                                                         states.column("segment_idx").to_pylist(), strict=True)])


def continuation_cost(all_states: pa.Table, row_state: np.ndarray, occurrences: np.ndarray, states: pa.Table,
                      earlier: dict[str, list[int]]) -> np.ndarray:
    """Expected tokens of one continuation from each distinct state.

    Every observed cost from the state counts — the tokens its main episodes still generated from there and its
    earlier continuations — shrunk toward the mean at the same segment index by one pseudo-observation. A
    single own episode is a noisy price, and a strategy that divides by cost would pick the states whose noise
    happened to be low (then spend more than planned, and the budget cuts continuations).
    """
    remaining = all_states.column("remaining_generated_tokens").to_numpy().astype(np.float64)
    segment_idx = all_states.column("segment_idx").to_numpy()
    by_index = {k: remaining[segment_idx == k].mean() for k in np.unique(segment_idx)}
    total = np.bincount(row_state, weights=remaining, minlength=states.num_rows)
    for i, state in enumerate(states.column("state_id").to_pylist()):
        total[i] += sum(earlier.get(state, ()))
    count = observed_costs(occurrences, states, earlier).astype(np.float64)
    prior = np.array([by_index[k] for k in states.column("segment_idx").to_numpy()])
    return (total + prior) / (count + 1)


def observed_costs(occurrences: np.ndarray, states: pa.Table, earlier: dict[str, list[int]]) -> np.ndarray:
    """How many costs each distinct state's price rests on: its main visits and its earlier continuations."""
    return occurrences + np.array([len(earlier.get(s, ())) for s in states.column("state_id").to_pylist()],
                                  dtype=np.int64)


def cost_spread(all_states: pa.Table) -> float:
    """Coefficient of variation of one continuation's cost: the spread of the remaining tokens among states of
    the same segment index, pooled (a state's price is known only up to it)."""
    remaining = all_states.column("remaining_generated_tokens").to_numpy().astype(np.float64)
    segment_idx = all_states.column("segment_idx").to_numpy()
    squares, count = 0.0, 0
    for k in np.unique(segment_idx):
        at_k = remaining[segment_idx == k]
        if len(at_k) > 1 and at_k.mean() > 0:
            squares += (at_k.var(ddof=1) / at_k.mean() ** 2) * (len(at_k) - 1)
            count += len(at_k) - 1
    return float(np.sqrt(squares / count)) if count else 0.0


def observed_returns(ctx: RunContext, iteration: int, critic: Manifest | None, all_states: pa.Table,
                     row_state: np.ndarray, counted: np.ndarray, states: pa.Table,
                     earlier: dict[str, list[float]]) -> tuple[np.ndarray, np.ndarray | None]:
    """Per distinct state, the sum of the returns it has (own returns of its uncut main episodes, earlier rounds'
    continuations) and the out-of-fold value of the critic acquisition reads, if it has seen them.

    A critic of this iteration was fitted on these returns, so its residuals are shrunk by its own fit; the
    ``values`` table of its fit_critic stage holds each state's cross-fitted prior (a critic fitted on the other
    task folds), which is out of fold. A critic of an earlier iteration has seen none of them: its own mean is out
    of fold, and None says so.
    """
    own = np.where(counted > 0, all_states.column("own_return").to_numpy().astype(np.float64), 0.0)
    ids = states.column("state_id").to_pylist()
    return_sum = (np.bincount(row_state, weights=own, minlength=states.num_rows)
                  + np.array([sum(earlier.get(s, ())) for s in ids], dtype=np.float64))
    if critic is None or critic.skipped or critic.iteration != iteration or "values" not in critic.tables:
        return return_sum, None
    values = read(ctx, critic, "values")
    prior: dict[str, float] = {}
    for state, mean in zip(values.column("state_id").to_pylist(), values.column("critic_mean").to_pylist(),
                           strict=True):
        if mean is not None:
            prior.setdefault(state, mean)
    if not prior:
        return return_sum, None
    return return_sum, np.array([prior.get(s, np.nan) for s in ids], dtype=np.float64)


def compute(ctx: RunContext, iteration: int, round_idx: int, segment: Manifest, rollout: Manifest,
            critic: Manifest | None, charged: Sequence[Manifest], scratch: Path) -> StageResult:
    cfg = ctx.config
    if not cfg.uses_branches:
        return StageResult(skipped=f"{cfg.method} does not branch")
    all_states = read(ctx, segment, "states")
    states, occurrences, row_state = distinct_states(all_states)
    cut = dict(zip(*(read(ctx, rollout, "episodes").column(c).to_pylist() for c in ("episode_id", "budget_cut")),
                   strict=True))
    counted = np.array([not cut[e] for e in all_states.column("episode_id").to_pylist()], dtype=float)
    # Every return a state already has: its main episodes' own returns and earlier rounds' continuations.
    earlier, earlier_tokens = branch_observations(ctx, [m for m in charged if m.stage.startswith("branch_")])
    already = (np.bincount(row_state, weights=counted, minlength=states.num_rows)
               + np.array([len(earlier.get(s, ())) for s in states.column("state_id").to_pylist()]))
    rounds_left = cfg.acquisition.rounds - round_idx
    budget = max(0, ctx.tokens_per_iteration - spent_tokens(ctx, charged)) / rounds_left
    features = np.array(states.column("features").to_pylist(), dtype=np.float32)
    acquisition = cfg.acquisition
    if critic is not None and not critic.skipped:
        members = EnsembleCritic.load(ctx.store.fetch_folder(ctx.run_id, critic.iteration, critic.stage,
                                                             CRITIC_FOLDER)).predict_members(features)
    else:
        members = None
        if acquisition.strategy not in CRITIC_FREE_STRATEGIES:
            acquisition = acquisition.model_copy(update={"strategy": "uniform_random"})
    segment_idx = states.column("segment_idx").to_numpy()
    cost = continuation_cost(all_states, row_state, occurrences, states, earlier_tokens)
    # Earlier rounds show how far actual spend strays from plans (a strategy that divides by cost favours
    # states whose price was underestimated): later rounds raise their prices by that ratio. Never lower them:
    # an overestimate in one round does not carry to the next round's other states (measured: lowering prices
    # by 0.89 after one cheap round made the next round's plan overspend and lose 19% of its continuations),
    # and an overspend costs cut continuations while an underspend only leaves tokens unspent.
    earlier_rounds = [m for m in charged if m.stage.startswith("branch_") and not m.skipped]
    planned = sum(float(m.figures.get("planned_tokens", 0.0)) for m in earlier_rounds)
    calibration = float(np.clip(sum(float(m.figures["tokens"]) for m in earlier_rounds) / planned, 1.0, 2.0)
                        ) if planned > 0 else 1.0
    cost = cost * calibration
    return_sum, oof_mean = observed_returns(ctx, iteration, critic, all_states, row_state, counted, states, earlier)
    entropy = None
    if acquisition.strategy == "entropy":
        per_row = next_action_entropy(read(ctx, rollout, "rollouts"), all_states)
        entropy = np.bincount(row_state, weights=per_row) / occurrences
    candidates = Candidates(
        member_predictions=members if members is not None else np.full((2, states.num_rows), 0.5),
        cost=np.maximum(1.0, cost),
        weight=advantage_sensitivity(segment_idx, gamma=cfg.advantage.gamma, lam=cfg.advantage.lam) * occurrences,
        already=already.astype(np.int64), entropy=entropy,
        # A critic of an earlier iteration has seen none of these returns; this iteration's has seen them all.
        unseen=already if critic is None or critic.iteration != iteration else np.zeros_like(already),
        # What the error-predicting rules learn the critic's error from: every distinct state's returns, and the
        # values a critic not fitted on them predicts (None: the critic's own are, see observed_returns).
        features=features, return_sum=return_sum, return_count=already.astype(np.float64), oof_mean=oof_mean,
    )
    seed = ctx.seed(iteration, stage_name(round_idx))
    allocation = allocate(candidates, Request(budget, acquisition, seed=seed))
    margin = 0.0
    if rounds_left == 1:
        # The last round cannot hand an overspend on: a plan that fills the budget exactly overshoots half the
        # time, and the ledger then cuts continuations. Plan a few standard deviations of its spend below it
        # (measured: one sd left 2 of 24 last rounds of three default runs cutting 8.5% and 14%).
        # A price rests on few observed costs (its main visits, earlier continuations), and the error of a price
        # is shared by all of its state's continuations: the margin counts it (measured: without it, 2 sd
        # still let one of eight last rounds overspend by 15% and cut 12% of its continuations).
        margin = spend_margin(allocation.counts, candidates.cost, cost_spread(all_states),
                              acquisition.last_round_margin_sd,
                              price_observations=observed_costs(occurrences, states, earlier_tokens))
        allocation = allocate(candidates, Request(max(0.0, budget - margin), acquisition, seed=seed))
    reasons = [r or "not chosen" for r in allocation.reason]
    if members is None and acquisition is not cfg.acquisition:
        reasons = [f"{r} (no critic yet)" for r in reasons]
    n = states.num_rows
    table = pa.table({
        **state_keys(states), "round": pa.array([round_idx] * n, pa.int32()),
        "critic_mean": floats_or_nulls(None if members is None else candidates.mean, n),
        "critic_std": floats_or_nulls(None if members is None else np.sqrt(candidates.variance), n),
        "cost_estimate": pa.array(candidates.cost, pa.float64()),
        "score": pa.array([None if np.isnan(s) else float(s) for s in allocation.score], pa.float64()),
        "continuations": pa.array(allocation.counts, pa.int32()),
        "reason": reasons,
    }, schema=schema_for("acquisition"))
    figures = {"candidates": n, "chosen_states": int((allocation.counts > 0).sum()), "cost_calibration": calibration,
               "continuations": int(allocation.counts.sum()), "budget": round(budget), "margin": round(margin),
               "estimated_tokens": round(allocation.estimated_tokens)}
    return StageResult(tables={"acquisition": table}, figures=figures, policy_version=segment.policy_version,
                       seeds={"acquire": seed})


@stage_task("acquire")
def acquire(ctx: RunContext, iteration: int, round_idx: int, segment: Manifest, rollout: Manifest,
            critic: Manifest | None, charged: Sequence[Manifest]) -> Manifest:
    upstream = {"segment": segment, "rollout": rollout, **{f"charged_{k}": m for k, m in enumerate(charged)}}
    if critic is not None:
        upstream["critic"] = critic
    return run_stage(ctx, iteration, stage_name(round_idx), depends_on=ctx.fields(*READS), upstream=upstream,
                     compute=lambda scratch: compute(ctx, iteration, round_idx, segment, rollout, critic, charged,
                                                     scratch))
