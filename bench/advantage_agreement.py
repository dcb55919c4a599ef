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
* ``td1 exact``: R − V^π(s_k), perfect values at λ = 1 (what λ alone costs);

and per estimator, over the segments the budget did not cut: ``correlation``, the correlation with A* weighted by the
segment's generated tokens (the update's token mean weighs them so), ``sign``, the token share of the decisive
segments (|A*| > 0.1) whose sign it gets right, and ``noise_share``, the share of its weighted variance that sits on
the other segments, where the exact advantage is about 0 (what the update gets as noise); all after centring, as
whitening does.

Is the critic's error a bias in the same kinds of state every iteration, which the policy would follow? On the lookup
chain a state's kind is what its observation says of progress: hops done and the last tool result. Per iteration,
``kind_bias`` has each kind's rows and mean signed error V̂ − V^π (map ``mean``); over consecutive iterations,
``kind_persistence`` correlates the kinds' biases (kinds with ≥ 20 rows in both).

    python -m bench.advantage_agreement critic_share_chain-lookup_chain-td0_exact-s104 --store /work/store \\
        --iterations 0,3,6 --json docs/results/critic_features/advantage_agreement.json      # ~3 min a iteration
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import numpy as np

from bench.critic_features import episode_folds, exact_iteration, exact_values_run, fitted_values, text_features
from focus_core.advantages import grpo_advantages, segment_td_lambda_batch
from focus_core.artifacts import ArtifactStore
from focus_core.policy.models import load_policy
from tasks.inputs import POLICY_FOLDER

DECISIVE = 0.1  # |A*| above which a segment's sign is counted
KIND_ROWS = 20  # rows a kind needs in both iterations to enter kind_persistence
# The lookup chain's progress line: "Hops done: 2 of 5. [Turn 6 of 14. ]Last: read a document, noted a name."
_PROGRESS = re.compile(r"Hops done: (\d+) of \d+\.(?: Turn \d+ of \d+\.)? (?:Last: )?([^.]*)\.")


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
    spread = weight * a * a
    return {"correlation": float(correlation), "sign": sign,
            "noise_share": float(spread[~decisive].sum() / spread.sum())}


def state_kind(text: str) -> str | None:
    """A lookup-chain state's kind, "hops|last tool result", from the last progress line of its context; None when
    the text has none (another environment)."""
    found = _PROGRESS.findall(text)
    return f"{found[-1][0]}|{found[-1][1]}" if found else None


def kind_bias(kinds: np.ndarray, error: np.ndarray) -> dict[str, dict]:
    """Per kind of state, its rows and mean signed error."""
    return {str(k): {"rows": int((kinds == k).sum()), "bias": float(error[kinds == k].mean())}
            for k in np.unique(kinds)}


def kind_persistence(before: dict[str, dict], after: dict[str, dict]) -> dict[str, float]:
    """How alike two iterations' kind biases are: their correlation and the share of kinds whose bias keeps its
    sign, over the kinds with ≥ KIND_ROWS rows in both; and the mean |bias| of those kinds in each."""
    shared = [k for k in before if k in after and min(before[k]["rows"], after[k]["rows"]) >= KIND_ROWS]
    x, y = (np.array([side[k]["bias"] for k in shared]) for side in (before, after))
    return {"kinds": len(shared), "correlation": float(np.corrcoef(x, y)[0, 1]) if len(shared) > 2 else float("nan"),
            "same_sign": float(np.mean(np.sign(x) == np.sign(y))) if shared else float("nan"),
            "mean_abs_bias": [float(np.abs(x).mean()), float(np.abs(y).mean())] if shared else []}


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
    errors, signed = {}, {}
    for name, x in maps.items():
        _, value = fitted_values(config, rows, x, episode_folds(config, rows))
        errors[name] = float(np.abs(value - rows.exact)[kept].mean())
        signed[name] = value - rows.exact
        estimates[f"td0 {name}"] = advantages(value, 0.0)
        estimates[f"td1 {name}"] = advantages(value, 1.0)
        estimates[f"td0 half {name}"] = advantages((value + rows.exact) / 2, 0.0)
    estimates["td1 exact"] = advantages(rows.exact, 1.0)
    out = {"segments": int(kept.sum()), "decisive": int((np.abs(target[kept]) > DECISIVE).sum()),
           "value_error": errors}
    # A state id covers its context tokens, so each distinct state's context is decoded once.
    kinds = np.array([state_kind(decode(list(c))) for c in contexts], dtype=object)[rows.inverse]
    if all(k is not None for k in kinds):
        out["kind_bias"] = kind_bias(kinds[kept], signed["mean"][kept])
    for name, estimate in estimates.items():
        out[name] = agreement(estimate[kept], target[kept], weight[kept])
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    args, store, config, iterations = exact_values_run(__doc__.splitlines()[0], argv)
    decode = load_policy(store.fetch_folder(args.run_id, 0, "bootstrap", POLICY_FOLDER)).tokenizer.decode
    out = {"run_id": args.run_id, "iterations": {}}
    for i in iterations:
        out["iterations"][i] = iteration_agreement(store, args.run_id, config, i, decode)
        print(json.dumps({i: {k: v for k, v in out["iterations"][i].items() if k != "kind_bias"}}), flush=True)
    biases = [(i, out["iterations"][i].get("kind_bias")) for i in iterations]
    if len(biases) > 1 and all(b is not None for _, b in biases):
        out["kind_persistence"] = {f"{i}->{j}": kind_persistence(a, b)
                                   for (i, a), (j, b) in zip(biases[:-1], biases[1:], strict=True)}
        print(json.dumps({"kind_persistence": out["kind_persistence"]}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
