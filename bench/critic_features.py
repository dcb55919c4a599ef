"""Which state features and which folds let the critic approach V^π? Read off an `exact_values` run.

The 5-hop chain's perfect-critic row beats GRPO by 7 points where FOCUS's own critic does not (benchmarks.md), and
that critic's error against V^π is 0.27. This asks where the error comes from. For every iteration of one run
trained with ``exact_values: true`` (whose ``advantages.value`` is the exact V^π of the sampling policy at each main
state) it refits the critic on that iteration's main returns as fit_critic does (the run's ``critic`` settings, an
out-of-fold prior per row, combined by precision with the state's leave-one-out returns), once per feature map and
per fold unit (``critic.fold_unit``: folds of tasks, so the critic must generalise across tasks, or of episodes, so
it also sees the other episodes of the row's task), and prints the mean |V̂ − V^π| over the iteration's segments of
the prior alone (``prior_mae``), of the combined value the advantage would use (``value_mae``), and of the same
critic fitted on V^π itself instead of returns (``fitted_on_exact_mae``: what the features can express at all).
Feature maps, from the sampling policy's last hidden states over the state's compressed context, plus the segment
index as the pipeline's features have it:

* ``mean``: the mean over every token of the context (the pipeline's ``policy_context_features``);
* ``last``: the last token's hidden state;
* ``tail_mean``: the mean over the tokens after the prefix every context of the iteration shares (the system
  prompt and the start of the user turn), so the part that differs between states is not averaged away;
* ``segment_only``: the segment index alone (what the critic knows without reading the context);
* ``text``: hashed word unigrams and bigrams (``focus_core.features.hashed_text_features``, 256 columns) of the
  context's text after the shared prefix: the tool outputs and notes themselves, read without the policy;
* ``mean+text``: ``mean`` and ``text`` side by side.

``constant_mae`` is the error of one constant (the iteration's mean return) for scale.

    python -m bench.critic_features RUN_ID --store /work/diag/runs --json docs/results/critic_features.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from focus_core.acquisition import combine_estimates
from focus_core.artifacts import ArtifactStore
from focus_core.config import AcquisitionConfig, validate_config
from focus_core.critic import EnsembleCritic
from focus_core.features import context_hidden_states, hashed_text_features
from focus_core.ids import derive_seed
from focus_core.policy.models import load_policy
from tasks.fit_critic import FLAT_PRIOR, episode_fold, stage_name, task_folds
from tasks.inputs import POLICY_FOLDER


def pooled_hidden_states(model, contexts: Sequence[Sequence[int]]) -> dict[str, np.ndarray]:
    """Per context, the last hidden states pooled three ways: over every token, at the last token, and over the
    tokens after the prefix all contexts share. Returns {map: float32 [len(contexts), hidden]}."""
    shared = _shared_prefix(contexts)
    out = {"mean": [], "last": [], "tail_mean": []}
    for hidden, mask in context_hidden_states(model, contexts):
        for h, length in zip(hidden.float(), mask.sum(1).tolist(), strict=True):
            h = h[:length]
            out["mean"].append(h.mean(0).numpy())
            out["last"].append(h[-1].numpy())
            out["tail_mean"].append(h[min(shared, length - 1):].mean(0).numpy())
    return {name: np.array(rows, dtype=np.float32) for name, rows in out.items()}


def _shared_prefix(contexts: Sequence[Sequence[int]]) -> int:
    first = list(contexts[0])
    length = len(first)
    for context in contexts[1:]:
        length = min(length, len(context))
        mismatch = np.flatnonzero(np.asarray(first[:length]) != np.asarray(list(context)[:length]))
        if mismatch.size:
            length = int(mismatch[0])
    return length


TEXT_DIM = 256


def feature_maps(model, contexts: Sequence[Sequence[int]], segment_idx: np.ndarray,
                 decode=None) -> dict[str, np.ndarray]:
    """Every feature map of the module doc; ``text`` and ``mean+text`` only with ``decode`` (token ids -> text)."""
    pooled = pooled_hidden_states(model, contexts)
    index = segment_idx.astype(np.float32)[:, None]
    maps = {name: np.concatenate([x, index], axis=1) for name, x in pooled.items()}
    maps["segment_only"] = index
    if decode is not None:
        maps["text"] = text_features(contexts, decode, segment_idx)
        maps["mean+text"] = np.concatenate([maps["mean"], maps["text"][:, :-1]], axis=1)
    return maps


def text_features(contexts: Sequence[Sequence[int]], decode, segment_idx: np.ndarray) -> np.ndarray:
    """Hashed words of each context's text after the prefix all of them share, and the segment index:
    float32 [len(contexts), TEXT_DIM + 1]."""
    shared = _shared_prefix(contexts)
    text = hashed_text_features([decode(list(c)[shared:]) for c in contexts], dim=TEXT_DIM)
    return np.concatenate([text, segment_idx.astype(np.float32)[:, None]], axis=1)


@dataclass(frozen=True)
class ExactIteration:
    """One iteration of an exact_values run, one entry per main segment (the segment stage's rows, in its order)."""

    states: pa.Table  # the segment stage's table
    episodes: pa.Table  # the rollout stage's table
    episode_ids: np.ndarray  # object [rows]
    segment_idx: np.ndarray  # [rows]
    exact: np.ndarray  # V^π of the row's state (the advantage stage's ``value``)
    counted: np.ndarray  # bool: the budget did not cut the row's episode
    own: np.ndarray  # the episode's return, 0 where cut
    first: np.ndarray  # a row of each distinct state
    inverse: np.ndarray  # each row's distinct state
    loo_n: np.ndarray  # the other returns at the row's state (fit_critic's leave-one-out; no continuations here)
    loo_mean: np.ndarray  # their mean, NaN without any
    fold_seed: int  # fit_critic's seed for the folds of round 0


def exact_iteration(store: ArtifactStore, run_id: str, config, iteration: int) -> ExactIteration:
    states = store.read_table(run_id, iteration, "segment", "states")
    episodes = store.read_table(run_id, iteration, "rollout", "episodes")
    exact_table = store.read_table(run_id, iteration, "advantage", "advantages")
    exact_of = dict(zip(zip(exact_table.column("episode_id").to_pylist(), exact_table.column("segment_idx").to_pylist(),
                            strict=True), exact_table.column("value").to_pylist(), strict=True))
    episode_ids = np.array(states.column("episode_id").to_pylist(), dtype=object)
    segment_idx = states.column("segment_idx").to_numpy()
    exact = np.array([exact_of[key] for key in zip(episode_ids, segment_idx.tolist(), strict=True)])
    cut = dict(zip(episodes.column("episode_id").to_pylist(), episodes.column("budget_cut").to_pylist(), strict=True))
    counted = ~np.array([cut[e] for e in episode_ids])
    own = np.where(counted, states.column("own_return").to_numpy(), 0.0)
    state_ids = np.array(states.column("state_id").to_pylist(), dtype=object)
    distinct, first, inverse = np.unique(state_ids, return_index=True, return_inverse=True)
    successes = np.bincount(inverse, weights=own, minlength=len(distinct))
    trials = np.bincount(inverse, weights=counted.astype(float), minlength=len(distinct))
    loo_n = trials[inverse] - counted
    loo_mean = np.divide(successes[inverse] - own, loo_n, out=np.full(len(loo_n), np.nan), where=loo_n > 0)
    return ExactIteration(states, episodes, episode_ids, segment_idx, exact, counted, own, first, inverse, loo_n,
                          loo_mean, derive_seed(config.seed, iteration, stage_name(0), "folds"))


def fitted_values(config, rows: ExactIteration, x: np.ndarray, row_fold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fit_critic's values offline: per row the out-of-fold prior on distinct-state features ``x``, and that prior
    combined by precision with the row's leave-one-out returns. Returns (prior mean, value)."""
    prior_mean, prior_var = out_of_fold(config, x, rows.inverse, rows.own, rows.counted.astype(float), row_fold)
    floor = (config.acquisition or AcquisitionConfig()).jitter
    value, _ = combine_estimates(prior_mean, np.maximum(prior_var, floor), rows.loo_mean, rows.loo_n)
    return prior_mean, value


def episode_folds(config, rows: ExactIteration) -> np.ndarray:
    """Each row's fold under ``critic.fold_unit: episode``."""
    return np.array([episode_fold(e, config.critic.folds, rows.fold_seed) for e in rows.episode_ids])


def iteration_errors(store: ArtifactStore, run_id: str, config, iteration: int) -> dict:
    """Refit the critic per feature map on one iteration's main returns; error of each against V^π."""
    rows = exact_iteration(store, run_id, config, iteration)
    exact, first = rows.exact, rows.first
    task_of = dict(zip(rows.episodes.column("episode_id").to_pylist(), rows.episodes.column("task_id").to_pylist(),
                       strict=True))
    task_fold = task_folds([task_of[e] for e in rows.episode_ids[first]], config.critic.folds, rows.fold_seed)
    row_folds = {"task": np.array([task_fold[task_of[e]] for e in rows.episode_ids]),
                 "episode": episode_folds(config, rows)}

    segment = store.manifest(run_id, iteration, "segment")
    policy = next(m for _, _, m in store.committed(run_id) if m.hash == segment.upstream["policy"])
    sampler = load_policy(store.fetch_folder(run_id, policy.iteration, policy.stage, POLICY_FOLDER))
    contexts = rows.states.column("context_token_ids").take(first).to_pylist()
    maps = feature_maps(sampler.model, contexts, rows.segment_idx[first], sampler.tokenizer.decode)
    pipeline = np.array(rows.states.column("features").take(first).to_pylist(), dtype=np.float32)
    if not np.allclose(maps["mean"], pipeline, atol=1e-4):
        raise ValueError(f"iteration {iteration}: the recomputed mean features differ from the stored ones; the "
                         f"policy found is not the one that segmented")
    out = {"segments": len(exact), "distinct_states": len(first), "mean_exact_value": float(exact.mean()),
           "constant_mae": float(np.abs(exact - rows.own.sum() / rows.counted.sum()).mean())}
    for name, x in maps.items():
        out[name] = {}
        for unit, row_fold in row_folds.items():
            prior_mean, value = fitted_values(config, rows, x, row_fold)
            # The features' own ceiling: the same critic fitted on V^π itself (a soft trial per row), out of fold.
            ceiling, _ = out_of_fold(config, x, rows.inverse, exact, np.ones(len(exact)), row_fold)
            out[name][unit] = {"prior_mae": float(np.abs(prior_mean - exact).mean()),
                               "value_mae": float(np.abs(value - exact).mean()),
                               "fitted_on_exact_mae": float(np.abs(ceiling - exact).mean())}
    return out


def out_of_fold(config, x: np.ndarray, inverse: np.ndarray, successes: np.ndarray, trials: np.ndarray,
                row_fold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the mean and variance of a critic fitted, per distinct state (features ``x``), on the rows of the
    other folds only, as fit_critic fits its fold critics."""
    mean, var = np.full(len(inverse), FLAT_PRIOR[0]), np.full(len(inverse), FLAT_PRIOR[1])
    for k in np.unique(row_fold):
        outside = row_fold != k
        keep = np.bincount(inverse, weights=outside, minlength=len(x)) > 0
        y = np.bincount(inverse, weights=successes * outside, minlength=len(x))
        t = np.bincount(inverse, weights=trials * outside, minlength=len(x))
        critic = EnsembleCritic(config.critic, x.shape[1])
        critic.fit(x[keep], y[keep], t[keep])
        mean[~outside], var[~outside] = critic.predict(x[inverse[~outside]])
    return mean, var


def exact_values_run(description: str, argv: Sequence[str] | None):
    """The command line of a bench that reads an exact_values run: (args, store, config, iterations)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("run_id", help="a run trained with exact_values: true")
    parser.add_argument("--store", default="runs")
    parser.add_argument("--iterations", default=None, help="comma-separated; default every committed one")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    store = ArtifactStore(args.store)
    info = store.run_info(args.run_id)
    if info is None:
        parser.error(f"no run {args.run_id} under {args.store} (fix: --store, or `focus runs` to list them)")
    config = validate_config(info["config"])
    if not config.exact_values:
        parser.error(f"run {args.run_id} was not trained with exact_values: true; its advantages hold no V^π")
    iterations = sorted({i for i, stage, _ in store.committed(args.run_id) if stage == "advantage"})
    if args.iterations is not None:
        iterations = [int(i) for i in args.iterations.split(",")]
    return args, store, config, iterations


def main(argv: Sequence[str] | None = None) -> dict:
    args, store, config, iterations = exact_values_run(__doc__.splitlines()[0], argv)
    out = {"run_id": args.run_id, "iterations": {i: iteration_errors(store, args.run_id, config, i)
                                                  for i in iterations}}
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
