"""Continuations as training data (Tree-GRPO / TreeRL style): pure functions over the stored tables.

A continuation (stage ``branch_r{r}``) starts at a segment state s_k of a main episode and is stored like an
episode: its first ``rollouts`` row is s_k's context (role ``context``, loss mask 0, the same ids the main
episode's segment k starts with), then the tokens it generated itself (loss mask 1) and the tool output (0),
then its own later segments s'_{k+1}, s'_{k+2}, ... So training on a continuation's segments trains exactly
the tokens it generated: the shared prefix is a prompt in both sequences, never a trained token, and no
token of the main episode appears twice.

Its segments get TD(λ) advantages from the same kind of values as the main episodes (``continuation_values``):

* V̂(s_k), the parent state, is the parent's value *without the continuation's own return*: the state's
  out-of-fold critic prior combined by precision with the Monte-Carlo returns observed there (its main
  episodes' own returns and its continuations', ``observed_returns``) less this one — the leave-one-out rule
  ``fit_critic`` applies to the main episodes, so no baseline has seen the return it is the baseline of.
  Without a critic (VinePPO) it is that leave-one-out mean.
* V̂(s'_j) for its own later states, which no main episode visited: the prediction there of the fold critic
  that was fitted without the continuation's task (the caller's ``later``; the full ensemble had seen the
  continuation's own return at its parent); without a critic, VinePPO's rule r_j + V̂(s'_{j+1}) (δ = 0 there).

``update_sequences`` is the update's side: the training sequences of the main rollouts and the
continuations, budget-cut episodes left out, with the part each sequence came from.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from focus_core.acquisition import combine_estimates
from focus_core.advantages import fill_missing_values
from focus_core.rollouts import SegmentSequence, training_sequences
from focus_core.schemas import validate_table


def observed_returns(main_states: pa.Table, main_episodes: pa.Table,
                     continuations: pa.Table) -> dict[str, tuple[float, int]]:
    """Per state id, the sum and number of returns observed there this iteration: the own return of every
    main episode that visited it (a ``states`` row) and the return of every continuation started from it
    (an ``episodes`` row with ``parent_state_id``), leaving out episodes the budget cut, as fit_critic does."""
    cut = dict(zip(main_episodes.column("episode_id").to_pylist(), main_episodes.column("budget_cut").to_pylist(),
                   strict=True))
    seen: dict[str, tuple[float, int]] = {}

    def add(state: str, value: float) -> None:
        total, n = seen.get(state, (0.0, 0))
        seen[state] = (total + value, n + 1)

    for state, episode, value in zip(*(main_states.column(c).to_pylist() for c in
                                       ("state_id", "episode_id", "own_return")), strict=True):
        if not cut[episode]:
            add(state, value)
    for parent, value, was_cut in zip(*(continuations.column(c).to_pylist() for c in
                                        ("parent_state_id", "reward", "budget_cut")), strict=True):
        if not was_cut:
            add(parent, value)
    return seen


def continuation_values(rewards: np.ndarray, lengths: np.ndarray, *, prior_mean: np.ndarray, prior_var: np.ndarray,
                        return_sum: np.ndarray, return_n: np.ndarray, own_return: np.ndarray, counted: np.ndarray,
                        later: np.ndarray) -> np.ndarray:
    """V̂ at every segment start of a ragged batch of continuations (flat, one entry per segment).

    Per continuation b (arrays of length B): the parent state's critic prior ``prior_mean``/``prior_var``
    (NaN: no critic), the ``return_sum``/``return_n`` observed at the parent (``observed_returns``), its own
    return and whether it was ``counted`` there (not cut). Per segment (length N = sum(lengths)): ``rewards``
    and ``later``, the critic's V̂ at the segment's start (read for every segment but a continuation's first;
    NaN where there is none). The first segment's value is the parent's, leave-one-out:

        n' = n − c_b,  ȳ' = (Σ − c_b R_b) / n',  V̂(s_k) = combine(prior, ȳ', n')  (or ȳ' without a prior)

    Values still unknown (no prior and no other return; no critic at a later state) follow VinePPO's rule
    V̂(s_j) = r_j + V̂(s_{j+1}).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if (lengths < 1).any():
        raise ValueError("continuation_values: every continuation has at least one segment (its parent's)")
    counted = np.asarray(counted, dtype=bool)
    n_other = np.asarray(return_n, np.float64) - counted
    if (n_other < 0).any():
        raise ValueError("continuation_values: a counted continuation's own return is missing from return_n")
    other_sum = np.asarray(return_sum, np.float64) - np.where(counted, own_return, 0.0)
    mc = np.divide(other_sum, n_other, out=np.full(len(n_other), np.nan), where=n_other > 0)
    prior_mean, prior_var = np.asarray(prior_mean, np.float64), np.asarray(prior_var, np.float64)
    has_prior = np.isfinite(prior_mean)
    first_value = mc.copy()
    if has_prior.any():
        first_value[has_prior] = combine_estimates(prior_mean[has_prior], prior_var[has_prior], mc[has_prior],
                                                   n_other[has_prior])[0]
    values = np.array(later, dtype=np.float64, copy=True)
    values[np.cumsum(lengths) - lengths] = first_value
    known = np.isfinite(values)
    return fill_missing_values(rewards, np.where(known, values, 0.0), known, lengths)


def update_sequences(parts: Sequence[tuple[pa.Table, pa.Table]]) -> tuple[list[SegmentSequence], np.ndarray]:
    """The policy update's training sequences and, for each, the index of the part it came from.

    ``parts`` are (rollouts, episodes) pairs: the main rollouts first, then each branch stage's continuations.
    Every segment of every episode the budget did not cut is one sequence; parts in order, episodes in the
    order of their episodes table, segments in order (``rollouts.training_sequences``).
    """
    kept: list[str] = []
    part_of: dict[str, int] = {}
    for index, (_, episodes) in enumerate(parts):
        for episode, cut in zip(episodes.column("episode_id").to_pylist(), episodes.column("budget_cut").to_pylist(),
                                strict=True):
            if not cut:
                kept.append(episode)
                part_of[episode] = index
    if not parts:
        return [], np.zeros(0, np.int64)
    rollouts = pa.concat_tables([validate_table("rollouts", table) for table, _ in parts])
    sequences = training_sequences(rollouts, episode_ids=kept)
    return sequences, np.array([part_of[q.episode_id] for q in sequences], dtype=np.int64)
