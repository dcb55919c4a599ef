"""How close does each advantage estimator come to the exact per-segment advantage? Read off an `exact_values` run.

On the 5-hop chain the exact values at λ = 0 beat GRPO, half the fitted critic's error still does, and the fitted
critic does not (benchmarks.md, critic_share_chain). This asks what the critic's error does to the advantages. The
target is the exact TD(0) advantage of every main segment, A*_k = r_k + V^π(s_{k+1}) − V^π(s_k) (what an
``exact_values: true``, ``advantage.lam: 0`` run trains on; the script checks that it recomputes the committed one).
From the same episodes it computes

* ``grpo``: the group-normalised return of each episode, (R − mean of the group) / std of the group
  (``focus_core.advantages.grpo_advantages``), on every segment of it;
* ``td0 F`` and ``td1 F``: r_k + V̂(s_{k+1}) − V̂(s_k) and R − V̂(s_k), with V̂ refitted as fit_critic does with
  ``critic.fold_unit: episode`` (an out-of-fold prior combined by precision with the state's leave-one-out returns),
  on feature map F: ``mean``, the pipeline's own features, or ``text``, hashed words of the context
  (bench/critic_features.py);
* ``td0 half F``: TD(0) with (V̂ + V^π) / 2, the values of ``exact_values_share: 0.5``;

and per estimator, over the segments the budget did not cut: ``correlation``, the correlation with A* weighted by the
segment's generated tokens (the update's token mean weighs them so), and ``sign``, the token share of the decisive
segments (|A*| > 0.1) whose sign it gets right; both after centring, as whitening does.

    python -m bench.advantage_agreement critic_share_chain-lookup_chain-td0_exact-s104 --store /work/store \\
        --iterations 0,3,6 --json docs/results/critic_features/advantage_agreement.json      # ~3 min a iteration
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from bench.critic_features import episode_folds, exact_iteration, exact_values_run, fitted_values, text_features
from focus_core.advantages import grpo_advantages, segment_td_lambda_batch
from focus_core.artifacts import ArtifactStore
from focus_core.policy.models import load_policy
from tasks.inputs import POLICY_FOLDER

DECISIVE = 0.1  # |A*| above which a segment's sign is counted


def segment_advantages(reward: np.ndarray, value: np.ndarray, episode_ids: np.ndarray, segment_idx: np.ndarray, *,
                       lam: float) -> np.ndarray:
    """TD(λ) advantages (γ = 1) of rows in any order, by ``focus_core.advantages.segment_td_lambda_batch``: the rows
    sorted by (episode, segment) for it, each episode's value after its last segment 0, and back in their order."""
    order = np.lexsort((segment_idx, episode_ids))
    sorted_ids = episode_ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    ends = np.r_[starts[1:], len(order)]
    values = np.insert(value[order], ends, 0.0)  # K_i + 1 values per episode
    advantages, _ = segment_td_lambda_batch(reward[order], values, ends - starts, gamma=1.0, lam=lam)
    out = np.empty(len(order))
    out[order] = advantages
    return out


def agreement(estimate: np.ndarray, exact: np.ndarray, weight: np.ndarray) -> dict[str, float]:
    """Weighted correlation with the exact advantage, and the weighted share of decisive segments of the right sign,
    both taken after centring each on its weighted mean, as whitening does (so neither depends on its shift or
    positive scale)."""
    a, b = estimate - np.average(estimate, weights=weight), exact - np.average(exact, weights=weight)
    correlation = np.average(a * b, weights=weight) / np.sqrt(np.average(a * a, weights=weight)
                                                              * np.average(b * b, weights=weight))
    decisive = np.abs(b) > DECISIVE
    right = np.sign(a[decisive]) == np.sign(b[decisive])
    sign = float(np.average(right, weights=weight[decisive])) if decisive.any() else float("nan")
    return {"correlation": float(correlation), "sign": sign}


def iteration_agreement(store: ArtifactStore, run_id: str, config, iteration: int, decode) -> dict:
    rows = exact_iteration(store, run_id, config, iteration)
    episodes, kept = rows.episodes, rows.counted
    reward = rows.states.column("segment_reward").to_numpy()
    weight = rows.states.column("segment_generated_tokens").to_numpy().astype(float)
    advantages = lambda value, lam: segment_advantages(reward, value, rows.episode_ids, rows.segment_idx,  # noqa: E731
                                                       lam=lam)
    target = advantages(rows.exact, 0.0)
    committed = store.read_table(run_id, iteration, "advantage", "advantages")
    committed_of = dict(zip(zip(committed.column("episode_id").to_pylist(), committed.column("segment_idx").to_pylist(),
                                strict=True), committed.column("advantage").to_pylist(), strict=True))
    committed_target = np.array([committed_of[k] for k in zip(rows.episode_ids, rows.segment_idx.tolist(),
                                                                  strict=True)])
    if not np.allclose(target[kept], committed_target[kept], atol=1e-9):
        raise ValueError(f"iteration {iteration}: the committed advantages are not TD(0) of the exact values (the run "
                         f"needs exact_values: true and advantage.lam: 0, gamma 1)")

    # GRPO's advantage of each episode the budget did not cut, on every one of its segments.
    whole = ~np.array(episodes.column("budget_cut").to_pylist())
    episode_ids = np.array(episodes.column("episode_id").to_pylist(), dtype=object)[whole]
    per_episode = grpo_advantages(episodes.column("reward").to_numpy()[whole],
                                  np.array(episodes.column("group_id").to_pylist(), dtype=object)[whole])
    grpo_of = dict(zip(episode_ids, per_episode, strict=True))
    estimates = {"grpo": np.array([grpo_of.get(e, 0.0) for e in rows.episode_ids])}
    contexts = rows.states.column("context_token_ids").take(rows.first).to_pylist()
    maps = {"mean": np.array(rows.states.column("features").take(rows.first).to_pylist(), dtype=np.float32),
            "text": text_features(contexts, decode, rows.segment_idx[rows.first])}
    errors = {}
    for name, x in maps.items():
        _, value = fitted_values(config, rows, x, episode_folds(config, rows))
        errors[name] = float(np.abs(value - rows.exact)[kept].mean())
        estimates[f"td0 {name}"] = advantages(value, 0.0)
        estimates[f"td1 {name}"] = advantages(value, 1.0)
        estimates[f"td0 half {name}"] = advantages((value + rows.exact) / 2, 0.0)
    out = {"segments": int(kept.sum()), "decisive": int((np.abs(target[kept]) > DECISIVE).sum()),
           "value_error": errors}
    for name, estimate in estimates.items():
        out[name] = agreement(estimate[kept], target[kept], weight[kept])
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    args, store, config, iterations = exact_values_run(__doc__.splitlines()[0], argv)
    decode = load_policy(store.fetch_folder(args.run_id, 0, "bootstrap", POLICY_FOLDER)).tokenizer.decode
    out = {"run_id": args.run_id, "iterations": {}}
    for i in iterations:
        out["iterations"][i] = iteration_agreement(store, args.run_id, config, i, decode)
        print(json.dumps({i: out["iterations"][i]}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
