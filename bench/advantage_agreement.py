"""How close does each advantage estimator come to the exact per-segment advantage? Read off an `exact_values` run.

On the 5-hop chain the exact values at λ = 0 beat GRPO, half the fitted critic's error still does, and the fitted
critic does not (benchmarks.md, critic_share_chain). This asks what the critic's error does to the advantages. The
target is the exact TD(0) advantage of every main segment, A*_k = r_k + V^π(s_{k+1}) − V^π(s_k) (what an
``exact_values: true``, ``advantage.lam: 0`` run trains on; the script checks that it recomputes the committed one).
From the same episodes it computes

* ``grpo``: the group-normalised return, (R − mean of the group) / std of the group, on every segment;
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

from bench.critic_features import exact_values_run, out_of_fold, text_features
from focus_core.acquisition import combine_estimates
from focus_core.artifacts import ArtifactStore
from focus_core.ids import derive_seed
from focus_core.policy.models import load_policy
from tasks.fit_critic import episode_fold, stage_name
from tasks.inputs import POLICY_FOLDER

DECISIVE = 0.1  # |A*| above which a segment's sign is counted


def td0(reward: np.ndarray, value: np.ndarray, following: np.ndarray) -> np.ndarray:
    """r_k + V(s_{k+1}) − V(s_k) per row; ``following`` is the row of the episode's next segment, −1 after its last."""
    return reward + np.where(following >= 0, value[np.maximum(following, 0)], 0.0) - value


def following_rows(episode_ids: np.ndarray, segment_idx: np.ndarray) -> np.ndarray:
    """Per row, the row of the same episode's next segment, or −1 for its last segment."""
    order = np.lexsort((segment_idx, episode_ids))
    following = np.full(len(episode_ids), -1)
    same = episode_ids[order[:-1]] == episode_ids[order[1:]]
    following[order[:-1][same]] = order[1:][same]
    return following


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
    states = store.read_table(run_id, iteration, "segment", "states")
    episodes = store.read_table(run_id, iteration, "rollout", "episodes")
    committed = store.read_table(run_id, iteration, "advantage", "advantages")
    key = lambda table: zip(table.column("episode_id").to_pylist(), table.column("segment_idx").to_pylist(),  # noqa: E731
                            strict=True)
    exact_value = dict(zip(key(committed), committed.column("value").to_pylist(), strict=True))
    exact_advantage = dict(zip(key(committed), committed.column("advantage").to_pylist(), strict=True))
    episode_ids = np.array(states.column("episode_id").to_pylist(), dtype=object)
    segment_idx = states.column("segment_idx").to_numpy()
    row_of = {e: i for i, e in enumerate(episodes.column("episode_id").to_pylist())}
    rows = [row_of[e] for e in episode_ids]
    cut = np.array(episodes.column("budget_cut").to_pylist())[rows]
    episode_return = episodes.column("reward").to_numpy()[rows]
    group = np.array(episodes.column("group_id").to_pylist(), dtype=object)[rows]
    kept = ~cut
    reward, weight = states.column("segment_reward").to_numpy(), states.column("segment_generated_tokens").to_numpy()
    exact = np.array([exact_value[k] for k in key(states)])
    following = following_rows(episode_ids, segment_idx)
    target = td0(reward, exact, following)
    committed_target = np.array([exact_advantage[k] for k in key(states)])
    if not np.allclose(target[kept], committed_target[kept], atol=1e-9):
        raise ValueError(f"iteration {iteration}: the committed advantages are not TD(0) of the exact values (the run "
                         f"needs exact_values: true and advantage.lam: 0, gamma 1)")

    # fit_critic's values with episode folds: an out-of-fold prior per row, combined with its leave-one-out returns.
    own = np.where(kept, states.column("own_return").to_numpy(), 0.0)
    state_ids = np.array(states.column("state_id").to_pylist(), dtype=object)
    distinct, first, inverse = np.unique(state_ids, return_index=True, return_inverse=True)
    seed = derive_seed(config.seed, iteration, stage_name(0), "folds")
    fold = np.array([episode_fold(e, config.critic.folds, seed) for e in episode_ids])
    successes = np.bincount(inverse, weights=own, minlength=len(distinct))
    trials = np.bincount(inverse, weights=kept.astype(float), minlength=len(distinct))
    n = trials[inverse] - kept
    loo_mean = np.divide(successes[inverse] - own, n, out=np.full(len(n), np.nan), where=n > 0)
    contexts = states.column("context_token_ids").take(first).to_pylist()
    maps = {"mean": np.array(states.column("features").take(first).to_pylist(), dtype=np.float32),
            "text": text_features(contexts, decode, segment_idx[first])}
    floor = config.acquisition.jitter if config.acquisition else 1e-4

    mean_of = {g: episode_return[(group == g) & kept].mean() for g in set(group[kept])}
    std_of = {g: episode_return[(group == g) & kept].std(ddof=1) for g in set(group[kept])}
    grpo = np.array([(r - mean_of[g]) / (std_of[g] + 1e-6) if k else 0.0
                     for r, g, k in zip(episode_return, group, kept, strict=True)])
    estimates = {"grpo": grpo}
    errors = {}
    for name, x in maps.items():
        prior_mean, prior_var = out_of_fold(config, x, inverse, own, kept.astype(float), fold)
        value, _ = combine_estimates(prior_mean, np.maximum(prior_var, floor), loo_mean, n)
        errors[name] = float(np.abs(value - exact)[kept].mean())
        estimates[f"td0 {name}"] = td0(reward, value, following)
        estimates[f"td1 {name}"] = episode_return - value
        estimates[f"td0 half {name}"] = td0(reward, (value + exact) / 2, following)
    out = {"segments": int(kept.sum()), "decisive": int((np.abs(target[kept]) > DECISIVE).sum()),
           "value_error": errors}
    for name, estimate in estimates.items():
        out[name] = agreement(estimate[kept], target[kept], weight[kept].astype(float))
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
