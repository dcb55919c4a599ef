"""Stage 5 — fit_critic (round r): fit the critic on every return seen so far this iteration and write the
value V̂ each segment's advantage will use.

Data, per distinct state: the own returns of the main episodes that visited it and the returns of its
continuations from rounds 0..r, accumulated across rounds (episodes the budget cut off are left out: their
0 is not the policy's doing). With ``critic.continuation_states`` every later state of every continuation joins
the fit too, with the continuation's return (its features computed here with the sampling policy, as stage segment
computes the main states'): returns the continuations paid for, otherwise counted at their first state only. With
``critic.replay_iterations`` the ``critic_data`` of earlier iterations joins the fit (their features come from
older policies, hence a setting).

The value used for advantages must not have seen the return it is the baseline of. So it is
*cross-fitted*: tasks are split into ``critic.folds`` folds, and the states of a fold's tasks get their
critic prior from an ensemble fitted on the other folds only (all states of a task share s_0, so the fold
is the task, not the episode); those fold critics are checkpointed too (``critic_fold{k}``), so a continuation's
later states, which no fit saw, get their value from the critic that did not see their task either
(``out_of_fold_values``). That out-of-fold prior is combined by precision (method.md §9.5, T8) with
the state's Monte-Carlo returns that are independent of the row's episode: its continuations plus the own
returns of the *other* main episodes that visited it (s_0 pools its group, leave-one-out). A full ensemble
on all data is also fitted and checkpointed: it is what the next acquisition round reads.

Whether selective branching paid shows in two figures per round (``acquisition_check``): the error of the critic
acquisition read on the states it branched, against their new continuations (``critic_error_before``), and the
Spearman correlation of the acquisition score with that error (``score_error_spearman``); MLflow logs them as
``fit_critic_r{r}.critic_error_before`` and ``fit_critic_r{r}.score_error_spearman``.

VinePPO has no critic: its value is the same leave-one-out Monte-Carlo mean, and a state without any
return gets r_k + V̂(s_{k+1}), as the paper does beyond its value-estimation cap (δ = 0 there).
PPO+GAE takes its values from the policy's value head (stage advantage); the GRPO family has no values.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from focus_core.acquisition import calibrated_variance, combine_estimates, spearman
from focus_core.advantages import fill_missing_values
from focus_core.artifacts import Manifest
from focus_core.config import AcquisitionConfig
from focus_core.critic import EnsembleCritic
from focus_core.features import state_features
from focus_core.ids import derive_seed
from focus_core.schemas import FLOATS, schema_for
from tasks.inputs import (
    CRITIC_FOLDER,
    continuation_tables,
    floats_or_nulls,
    fold_critic_folder,
    policy_at,
    read,
    state_keys,
)
from tasks.stage import RunContext, StageResult, run_stage, stage_task

log = logging.getLogger("focus")
FLAT_PRIOR = (0.5, 0.25)  # mean and variance of V(s) ∈ [0, 1] when no critic could be fitted out of fold

# acquisition.jitter: the floor of the out-of-fold variance before it is combined with the returns.
READS = ("seed", "method", "critic", "critic.prior_variance", "critic.fold_unit", "critic.continuation_states",
         "acquisition.jitter")


def stage_name(round_idx: int) -> str:
    return f"fit_critic_r{round_idx}"


def branch_returns(ctx: RunContext, branches: Sequence[Manifest]) -> list[tuple[str, float, int, str]]:
    """(state id, return, generated tokens, episode id) of every continuation, leaving out those the budget cut
    off (their 0 is not the policy's doing, and they stopped early)."""
    rows = []
    for manifest in branches:
        if manifest.skipped:
            continue
        table, episodes = read(ctx, manifest, "branches"), read(ctx, manifest, "episodes")
        cut = {e for e, was_cut in zip(episodes.column("episode_id").to_pylist(),
                                       episodes.column("budget_cut").to_pylist(), strict=True) if was_cut}
        rows += [row for row in zip(*(table.column(c).to_pylist() for c in
                                      ("state_id", "return", "generated_tokens", "episode_id")), strict=True)
                 if row[3] not in cut]
    return rows


def continuation_states(ctx: RunContext, branches: Sequence[Manifest], policy: Manifest) -> dict[str, np.ndarray]:
    """The later states of every continuation the budget did not cut (each segment start after the state it started
    from, which the main episodes' states already hold): their features from the sampling policy, the continuation's
    return, episode id and task id, one row per state visit."""
    grown = continuation_tables(ctx, branches)
    if grown is None:
        return {"features": np.zeros((0, 0), np.float32), "returns": np.zeros(0), "episode_ids": [], "task_ids": []}
    states, episodes = grown
    episode_of = {e: row for row, e in enumerate(episodes.column("episode_id").to_pylist())}
    state_episode = states.column("episode_id").to_pylist()
    at = np.array([episode_of[e] for e in state_episode], dtype=np.int64)
    first = np.r_[True, np.array(state_episode[1:], dtype=object) != np.array(state_episode[:-1], dtype=object)]
    cut = np.array(episodes.column("budget_cut").to_pylist(), dtype=bool)
    later = np.flatnonzero(~first & ~cut[at])  # rows sorted by episode: a continuation's first is its parent state
    contexts = states.column("context_token_ids").take(pa.array(later, pa.int64())).to_pylist()
    segment_idx = states.column("segment_idx").to_numpy()[later]
    features = state_features(policy_at(ctx, policy).model, contexts, segment_idx) if later.size else np.zeros((0, 0))
    return {"features": np.asarray(features, np.float32),
            "returns": episodes.column("reward").to_numpy()[at[later]].astype(np.float64),
            "episode_ids": [state_episode[i] for i in later],
            "task_ids": np.array(episodes.column("task_id").to_pylist(), dtype=object)[at[later]].tolist()}


def branch_observations(ctx: RunContext, branches: Sequence[Manifest]) -> tuple[dict[str, list[float]],
                                                                                 dict[str, list[int]]]:
    """Per state id, the returns and the generated tokens of its continuations (``branch_returns``)."""
    returns: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for state, value, spent, _ in branch_returns(ctx, branches):
        returns.setdefault(state, []).append(value)
        tokens.setdefault(state, []).append(spent)
    return returns, tokens


def acquisition_check(ctx: RunContext, iteration: int, round_idx: int,
                      branches: Sequence[Manifest]) -> dict[str, float]:
    """Did this round's selective branching pay? Over the states branched in round r, with the critic predictions
    and scores acquisition made *before* their continuations were sampled (its ``acquisition`` table):

    * ``critic_error_before``: mean |V̂_before(s) − MC mean of the round's continuations from s|;
    * ``score_error_spearman``: Spearman correlation of the acquisition score with that error (> 0: the rule
      spent more where the critic was more wrong; absent when the scores are all equal, as a uniform rule's are).

    Nothing without a critic prediction (the first round of a run) or without continuations.
    """
    grown = [m for m in branches if m.stage == f"branch_r{round_idx}" and not m.skipped]
    if not grown:
        return {}
    plan = ctx.store.read_table(ctx.run_id, iteration, f"acquire_r{round_idx}", "acquisition")  # branch_r's upstream
    returns, _ = branch_observations(ctx, grown)
    score, error = [], []
    for state, mean, wish in zip(*(plan.column(c).to_pylist() for c in ("state_id", "critic_mean", "score")),
                                 strict=True):
        if mean is not None and returns.get(state):
            score.append(np.nan if wish is None else wish)
            error.append(abs(mean - float(np.mean(returns[state]))))
    if not error:
        return {}
    figures = {"critic_error_before": float(np.mean(error)), "critic_error_before_states": len(error)}
    rho = spearman(np.array(score), np.array(error))
    if np.isfinite(rho):
        figures["score_error_spearman"] = rho
    return figures


def task_folds(task_ids: Sequence[str], folds: int, seed: int) -> dict[str, int]:
    """Each distinct task's fold: a seeded shuffle dealt round-robin into min(folds, tasks) folds."""
    distinct = sorted(set(task_ids))
    order = np.random.default_rng(seed).permutation(len(distinct))
    k = max(1, min(folds, len(distinct)))
    return {distinct[j]: rank % k for rank, j in enumerate(order)}


def episode_fold(episode_id: str, folds: int, seed: int) -> int:
    """An episode's fold (``critic.fold_unit: episode``): a seeded hash of its id, so the advantage stage finds a
    continuation's fold from its id alone, without the set of episodes the fit saw."""
    return derive_seed(seed, 0, "episode_fold", episode_id) % folds


def return_folds(ctx: RunContext, iteration: int, task_ids: Sequence[str], episode_ids: Sequence[str],
                 iteration_tasks: Sequence[str]) -> np.ndarray:
    """The cross-fitting fold of each return, given its episode's task and id: its task's fold, dealt over the
    iteration's tasks (``critic.fold_unit: task``), or its own episode's (``episode``)."""
    critic, seed = ctx.config.critic, ctx.seed(iteration, stage_name(0), "folds")
    if critic.fold_unit == "episode":
        return np.array([episode_fold(e, critic.folds, seed) for e in episode_ids], dtype=np.int64)
    fold = task_folds(iteration_tasks, critic.folds, seed)
    return np.array([fold[t] for t in task_ids], dtype=np.int64)


def compute(ctx: RunContext, iteration: int, round_idx: int, segment: Manifest, rollout: Manifest,
            branches: Sequence[Manifest], replay: Sequence[Manifest], scratch: Path,
            policy: Manifest | None = None) -> StageResult:
    cfg = ctx.config
    if cfg.method_row.values not in ("critic", "monte_carlo"):
        return StageResult(skipped=f"{cfg.method} takes no state values from returns ({cfg.method_row.values})")
    states = read(ctx, segment, "states")
    episodes = read(ctx, rollout, "episodes")
    task_of = dict(zip(episodes.column("episode_id").to_pylist(), episodes.column("task_id").to_pylist(), strict=True))
    cut = dict(zip(episodes.column("episode_id").to_pylist(), episodes.column("budget_cut").to_pylist(), strict=True))
    state_ids = np.array(states.column("state_id").to_pylist(), dtype=object)
    episode_ids = states.column("episode_id").to_pylist()
    counted = ~np.array([cut[e] for e in episode_ids])  # a cut main episode's return is no return
    own = np.where(counted, states.column("own_return").to_numpy(), 0.0)

    distinct, first, inverse = np.unique(state_ids, return_index=True, return_inverse=True)
    # Each continuation's state (as an index into `distinct`) and return; one from a state no main episode of this
    # iteration visited has no row to value and is left out.
    visited = set(distinct)
    continuations = [c for c in branch_returns(ctx, branches) if c[0] in visited]
    at = np.searchsorted(distinct, np.array([c[0] for c in continuations], dtype=object)).astype(np.int64)
    branch_return = np.array([c[1] for c in continuations], dtype=np.float64)
    branch_sum = np.bincount(at, weights=branch_return, minlength=len(distinct))
    branch_n = np.bincount(at, minlength=len(distinct)).astype(np.float64)
    own_sum = np.bincount(inverse, weights=own, minlength=len(distinct))
    own_n = np.bincount(inverse, weights=counted.astype(float), minlength=len(distinct))
    # Per row: Monte-Carlo returns independent of the row's own episode (leave its own return out).
    n = branch_n[inverse] + own_n[inverse] - counted
    mc_sum = branch_sum[inverse] + own_sum[inverse] - own
    mc_mean = np.divide(mc_sum, n, out=np.full(len(n), np.nan), where=n > 0)
    figures: dict[str, float] = {"states": len(state_ids), "branched_states": int((branch_n > 0).sum()),
                                 "returns": int(branch_n.sum())}
    folders, tables = {}, {}
    critic_mean = critic_var = value_var = None
    if not cfg.uses_critic:  # VinePPO: Monte-Carlo values only
        value = _fill_from_next(states, mc_mean, n)
    else:
        features = np.array(states.column("features").to_pylist(), dtype=np.float32)
        tasks_of_state = [task_of[episode_ids[i]] for i in first]
        # The fold of every return: the main rows' own returns, and the continuations'.
        row_fold = return_folds(ctx, iteration, [task_of[e] for e in episode_ids], episode_ids, tasks_of_state)
        branch_fold = return_folds(ctx, iteration, [tasks_of_state[i] for i in at], [c[3] for c in continuations],
                                   tasks_of_state)
        replayed = _replay_data(ctx, replay, features.shape[1])
        figures["replay_states"] = len(replayed["trials"])
        if cfg.critic.continuation_states:
            if policy is None:
                raise ValueError("fit_critic: critic.continuation_states needs the sampling policy's manifest")
            later = continuation_states(ctx, branches, policy)
            later_fold = return_folds(ctx, iteration, later["task_ids"], later["episode_ids"], tasks_of_state)
            figures["continuation_states"] = len(later["returns"])
        else:
            later, later_fold = {"returns": np.zeros(0)}, np.zeros(0, np.int64)
        seed = cfg.critic.seed + ctx.seed(iteration, stage_name(round_idx)) % 1_000_000

        def fit(outside: int | None) -> EnsembleCritic | None:
            """The critic on every return whose fold is not ``outside`` (None: on all of them), per distinct state;
            a state visited only inside that fold is left out."""
            rows, more = row_fold != outside, branch_fold != outside
            keep = (np.bincount(inverse, weights=rows, minlength=len(distinct))
                    + np.bincount(at, weights=more, minlength=len(distinct))) > 0
            y = (np.bincount(inverse, weights=own * rows, minlength=len(distinct))
                 + np.bincount(at, weights=branch_return * more, minlength=len(distinct)))
            t = (np.bincount(inverse, weights=counted * rows, minlength=len(distinct))
                 + np.bincount(at, weights=more.astype(float), minlength=len(distinct)))
            beyond = later_fold != outside  # continuations' later states, one trial each
            x = np.concatenate([features[first][keep], *([later["features"][beyond]] if beyond.any() else []),
                                replayed["features"]])
            y = np.concatenate([y[keep], later["returns"][beyond], replayed["successes"]])
            t = np.concatenate([t[keep], np.ones(int(beyond.sum())), replayed["trials"]])
            if not (t > 0).any():
                return None
            critic = EnsembleCritic(cfg.critic.model_copy(update={"seed": seed}), features.shape[1])
            critic.fit(x, y, t)
            return critic

        full = fit(None)
        if full is None:  # nothing to fit, and nothing the update trains: every episode was masked
            log.warning("[it %d] fit_critic: no state has a return (the budget cut every main episode): the values "
                        "are the flat prior and the critic stays the last one fitted (fix: a larger "
                        "budget.tokens_per_iteration)", iteration)
            flat = np.full(len(state_ids), FLAT_PRIOR[0])
            figures["mean_value"] = FLAT_PRIOR[0]
            return StageResult(tables={"values": _values_table(states, None, None, mc_mean, n, flat, None)},
                               figures=figures, policy_version=segment.policy_version)
        # A method with a critic but no acquisition (ppo_gae) floors at the schema's default jitter.
        floor = (cfg.acquisition or AcquisitionConfig()).jitter
        # Out-of-fold prior of every row, from the critic fitted without its fold's returns.
        critic_mean, critic_var = np.full(len(state_ids), FLAT_PRIOR[0]), np.full(len(state_ids), FLAT_PRIOR[1])
        for k in np.unique(row_fold):
            held_out = row_fold == k
            critic = fit(int(k))
            if critic is not None:  # evaluated once per distinct state of the fold's rows
                fold_states = np.unique(inverse[held_out])
                mean, var = critic.predict(features[first][fold_states])
                slot = np.searchsorted(fold_states, inverse[held_out])
                critic_mean[held_out], critic_var[held_out] = mean[slot], var[slot]
                critic.save(scratch / fold_critic_folder(int(k)))
                folders[fold_critic_folder(int(k))] = scratch / fold_critic_folder(int(k))
        critic_var = np.maximum(critic_var, floor)
        if cfg.critic.prior_variance == "calibrated":
            critic_var, figures["prior_variance_scale"] = calibrated_variance(critic_mean, critic_var, mc_mean, n)
        value, value_var = combine_estimates(critic_mean, critic_var, mc_mean, n)
        full.save(scratch / CRITIC_FOLDER)
        folders[CRITIC_FOLDER] = scratch / CRITIC_FOLDER
        size = len(distinct)
        tables["critic_data"] = pa.table({
            "run_id": [ctx.run_id] * size, "iteration": pa.array([iteration] * size, pa.int32()),
            "state_id": list(distinct), "policy_version": pa.array([segment.policy_version] * size, pa.int32()),
            "task_id": tasks_of_state,
            # A state's fold is its task's; with folds of episodes a state has none (-1).
            "fold": pa.array(row_fold[first] if cfg.critic.fold_unit == "task" else np.full(size, -1), pa.int32()),
            "features": pa.array(list(features[first]), type=FLOATS),
            "successes": pa.array(own_sum + branch_sum, pa.float64()),
            "trials": pa.array(own_n + branch_n, pa.float64()),
        }, schema=schema_for("critic_data"))
        full_mean, full_var = full.predict(features[first])
        figures["critic_std"] = float(np.sqrt(full_var).mean())
        branched = branch_n > 0
        if branched.any():  # the honest error: out-of-fold prior against the continuations' mean
            branch_mean = branch_sum[branched] / branch_n[branched]
            figures["oof_critic_vs_mc_mae"] = float(np.abs(critic_mean[first][branched] - branch_mean).mean())
            figures["critic_vs_mc_mae"] = float(np.abs(full_mean[branched] - branch_mean).mean())
        figures |= acquisition_check(ctx, iteration, round_idx, branches)
    tables["values"] = _values_table(states, critic_mean, critic_var, mc_mean, n, value, value_var)
    figures["mean_value"] = float(np.mean(value))
    return StageResult(tables=tables, folders=folders, figures=figures, policy_version=segment.policy_version)


def _values_table(states: pa.Table, critic_mean: np.ndarray | None, critic_var: np.ndarray | None,
                  mc_mean: np.ndarray, n: np.ndarray, value: np.ndarray, value_var: np.ndarray | None) -> pa.Table:
    rows = states.num_rows
    return pa.table({
        **state_keys(states),
        "critic_mean": floats_or_nulls(critic_mean, rows), "critic_var": floats_or_nulls(critic_var, rows),
        "mc_mean": pa.array([None if k == 0 else float(m) for k, m in zip(n, mc_mean, strict=True)], pa.float64()),
        "n": pa.array(n.astype(np.int32), pa.int32()), "value": pa.array(value, pa.float64()),
        "value_var": floats_or_nulls(value_var, rows),
    }, schema=schema_for("values"))


def out_of_fold_values(ctx: RunContext, values: Manifest, task_ids: Sequence[str], episode_ids: Sequence[str],
                       features: np.ndarray) -> np.ndarray:
    """V̂ at new states (e.g. a continuation's later segment starts) of the given tasks and episodes, each from the
    fold critic fitted without its fold's returns (its task's or its episode's, ``critic.fold_unit``), so no value
    has seen the return of the episode it is the baseline of. A fold that had no critic (no returns outside it)
    gives the flat prior, as its rows' prior did in the fit."""
    known = read(ctx, values, "critic_data").column("task_id").to_pylist()  # the tasks of the fit's states
    missing = sorted(set(task_ids) - set(known))
    if missing:
        raise ValueError(f"{values.stage}: task {missing[0]} has no state in its critic_data; the states are not of "
                         f"this iteration's tasks")
    fold = return_folds(ctx, values.iteration, task_ids, episode_ids, known)
    out = np.full(len(fold), FLAT_PRIOR[0])
    for k in np.unique(fold):
        if fold_critic_folder(int(k)) in values.files:
            critic = EnsembleCritic.load(ctx.store.fetch_folder(ctx.run_id, values.iteration, values.stage,
                                                                fold_critic_folder(int(k))))
            out[fold == k] = critic.predict(np.asarray(features)[fold == k])[0]
    return out


def _fill_from_next(states: pa.Table, mc_mean: np.ndarray, n: np.ndarray) -> np.ndarray:
    """VinePPO's values: the MC mean where there is one, else r_k + V̂(s_{k+1}) from the episode's end."""
    order = np.lexsort((states.column("segment_idx").to_numpy(),
                        np.array(states.column("episode_id").to_pylist(), dtype=object)))
    episode = np.array(states.column("episode_id").to_pylist(), dtype=object)[order]
    lengths = np.diff(np.r_[np.flatnonzero(np.r_[True, episode[1:] != episode[:-1]]), len(episode)])
    filled = fill_missing_values(states.column("segment_reward").to_numpy()[order], mc_mean[order], n[order] > 0,
                                 lengths)
    value = np.empty_like(filled)
    value[order] = filled
    return value


def _replay_data(ctx: RunContext, replay: Sequence[Manifest], n_features: int) -> dict[str, np.ndarray]:
    """The ``critic_data`` of earlier iterations' last fits (empty arrays without replay)."""
    parts = [read(ctx, m, "critic_data") for m in replay if not m.skipped and "critic_data" in m.tables]
    if not parts:
        return {"features": np.zeros((0, n_features), np.float32), "successes": np.zeros(0), "trials": np.zeros(0)}
    table = pa.concat_tables(parts)
    return {"features": np.array(table.column("features").to_pylist(), dtype=np.float32),
            "successes": table.column("successes").to_numpy(), "trials": table.column("trials").to_numpy()}


@stage_task("fit_critic")
def fit_critic(ctx: RunContext, iteration: int, round_idx: int, segment: Manifest, rollout: Manifest,
               branches: Sequence[Manifest], replay: Sequence[Manifest] = (), policy: Manifest | None = None
               ) -> Manifest:
    # The sampling policy is an input only where it computes the continuations' features (older runs keep their hash).
    policy = policy if ctx.config.critic is not None and ctx.config.critic.continuation_states else None
    upstream = {"segment": segment, "rollout": rollout, **{f"branch_{k}": m for k, m in enumerate(branches)},
                **{f"replay_{k}": m for k, m in enumerate(replay)}, **({"policy": policy} if policy else {})}
    return run_stage(ctx, iteration, stage_name(round_idx), depends_on=ctx.fields(*READS),
                     upstream=upstream,
                     compute=lambda scratch: compute(ctx, iteration, round_idx, segment, rollout, branches, replay,
                                                     scratch, policy))
