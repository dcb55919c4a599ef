"""Critic error versus continuation budget on environments with exact state values.

For each environment and seed: a fixed stochastic policy plays N main trajectories; their
segment-start states are candidates for branching. For every budget ratio (continuation tokens
as a multiple of the main-rollout tokens) and every acquisition strategy, the budget is spent in R
rounds of acquire -> branch -> fit critic, exactly as the pipeline's stages 3-5 do. The final
critic and the value used for advantages are then compared with the exact V^π:

  critic_mse   mean (μ(s) − V^π(s))² over the non-initial segment starts of the main trajectories
  adv_mse      mean (A_k − A*_k)² over all segments, where A uses the value the pipeline would use
               (critic and branch returns combined, method.md §9.5) and A* uses V^π, both TD(λ)
  sign_acc     fraction of segments with A*_k ≠ 0 whose advantage sign is right

All strategies of one (env, seed) share the main trajectories, so their differences are paired. Per cell
(env × strategy × budget) the summary also has

  critic_mse_ratio     mean critic_mse / that of uniform_random (same seeds)
  oracle_gap_captured  mean(U − S) / mean(U − O) over seeds, U, S, O the critic_mse of uniform_random, the
                       strategy and the oracle (1 = the oracle's gain, 0 = none), ± its delta-method se
  spearman             per round, the Spearman correlation between the strategy's scores (how much it wants each
                       state) and the actual |μ − V^π| of the critic it read, averaged over rounds and seeds
                       (none for the uniform rules, whose scores are all equal)

and the JSON names the pipeline's ``default_strategy``. The error-predicting rules get the candidates'
features, the returns the critic was fitted on, and out-of-bag values: members whose Poisson bootstrap gave
a state's returns weight 0 (the pipeline cross-fits by task folds instead).

    python bench/critic_budget.py --quick --json bench/out/critic_budget.json --plot bench/out/critic_budget.png
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench import process_pool
from focus_core.acquisition import (
    STRATEGIES,
    Candidates,
    Observations,
    Request,
    advantage_sensitivity,
    allocate,
    combine_estimates,
    spearman,
)
from focus_core.advantages import segment_td_lambda_batch
from focus_core.config import AcquisitionConfig, AdvantageConfig, CriticConfig
from focus_core.critic import EnsembleCritic, PriorFunctionCritic, out_of_bag_mean
from focus_core.envs import make_trap_env
from focus_core.envs.traps import ExactValueEnv
from focus_core.features import hashed_text_features, with_scalar_features

FULL_GRID = {
    "envs": ["combination_lock", "lookup_chain"],
    "budget_ratios": [0.25, 0.5, 1.0, 2.0, 4.0],
    "seeds": 10,
    "strategies": sorted(STRATEGIES),
}
QUICK_GRID = {  # about 2.5 minutes on one core
    "envs": ["combination_lock", "lookup_chain"],
    "budget_ratios": [0.25, 0.5, 1.0, 2.0],  # 1-2 × the main tokens is the pipeline's operating point
    "seeds": 3,
    "strategies": sorted({"uniform_all", "uniform_random", "ivr_greedy", "residual_knn", "oracle",
                          AcquisitionConfig().strategy}),
}


@dataclass(frozen=True)
class Settings:
    main_trajectories: int = 64
    paraphrase: bool = True  # distinct texts for equal states, as agent summaries are (see Paraphrased)
    rounds: int = 4  # the toy default of method.md §9.7
    gamma: float = AdvantageConfig().gamma  # the pipeline defaults, from the one place they live
    lam: float = AdvantageConfig().lam
    feature_dim: int = 64
    # hidden 64 fits as well as 256 here (measured) and keeps the full grid within minutes
    critic: CriticConfig = field(default_factory=lambda: CriticConfig(hidden=64, steps=300, lr=1e-2))
    critic_prior_scale: float = 0.0  # > 0: PriorFunctionCritic (randomised prior functions), an issue-12 experiment
    # chunk 2, cap 8, ε = 0.2, VinePPO K = 9, jitter 1e-4: the method defaults (method.md §9.7)
    acquisition: AcquisitionConfig = field(default_factory=lambda: AcquisitionConfig(benchmark_only=True))


class StateTable:
    """Every state seen so far (main and branch), with features and the returns observed from it."""

    def __init__(self, env: ExactValueEnv, feature_dim: int):
        self.env, self.feature_dim = env, feature_dim
        self.index: dict[Hashable, int] = {}
        self.states: list[Hashable] = []
        self.features: list[np.ndarray] = []

    def add(self, state: Hashable) -> int:
        if state not in self.index:
            self.index[state] = len(self.states)
            self.states.append(state)
            text = self.env.observation(state)
            base = hashed_text_features([text], self.feature_dim)
            turn = self.env.turn(state)
            scalars = np.array([[turn // self.env.segment_every, turn / self.env.horizon]], dtype=np.float32)
            self.features.append(with_scalar_features(base, scalars)[0])
        return self.index[state]

    def feature_matrix(self, idx: np.ndarray | None = None) -> np.ndarray:
        all_features = np.stack(self.features)
        return all_features if idx is None else all_features[idx]


class ReturnCounts:
    """Sum and count of observed returns per StateTable index, growing with the table."""

    def __init__(self, size: int):
        self.total, self.count = np.zeros(size), np.zeros(size)

    def add(self, idx: np.ndarray | int, returns: np.ndarray | float) -> None:
        top = int(np.max(idx)) + 1
        if top > len(self.count):
            self.total = np.pad(self.total, (0, top - len(self.total)))
            self.count = np.pad(self.count, (0, top - len(self.count)))
        np.add.at(self.total, idx, returns)
        np.add.at(self.count, idx, 1.0)

    def padded(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        pad = (0, size - len(self.count))
        return np.pad(self.total, pad), np.pad(self.count, pad)


@dataclass
class MainBatch:
    """The main trajectories cut into segments, flat over all segments (ragged by `lengths`)."""

    lengths: np.ndarray  # segments per trajectory
    state_idx: np.ndarray  # StateTable index of each segment's start state
    segment_idx: np.ndarray  # k of each segment
    rewards: np.ndarray  # segment rewards
    own_return: np.ndarray  # return from each segment start on its own trajectory
    remaining_tokens: np.ndarray  # generated tokens from each segment start to the episode end
    tokens: int  # generated tokens of all main trajectories


def play_main(env: ExactValueEnv, policy, n: int, rng: np.random.Generator, table: StateTable) -> MainBatch:
    lengths, state_idx, segment_idx, rewards, own_return, remaining = [], [], [], [], [], []
    total_tokens = 0
    for _ in range(n):
        episode = env.sample_episode(policy, rng)
        turns = episode.boundary_turns()
        seg_rewards = np.asarray(episode.segment_rewards(), dtype=np.float64)
        tokens_after = np.cumsum(np.asarray(episode.tokens)[::-1])[::-1]  # tokens from turn t to the end
        lengths.append(len(turns))
        for k, t in enumerate(turns):
            state_idx.append(table.add(episode.states[t]))
            segment_idx.append(k)
            remaining.append(tokens_after[t])
        rewards.extend(seg_rewards)
        own_return.extend(np.cumsum(seg_rewards[::-1])[::-1])
        total_tokens += episode.total_tokens
    return MainBatch(np.array(lengths), np.array(state_idx), np.array(segment_idx), np.array(rewards),
                     np.array(own_return), np.array(remaining, dtype=np.float64), total_tokens)


def segment_values(batch: MainBatch, value_of_segment: np.ndarray) -> np.ndarray:
    """Per-segment values -> the K_i+1 layout with V(terminal) = 0 (every main episode ends)."""
    out, pos = [], 0
    for k in batch.lengths:
        out.extend(value_of_segment[pos:pos + k])
        out.append(0.0)
        pos += k
    return np.array(out)


def fit_critic(table: StateTable, data: ReturnCounts, settings: Settings) -> tuple[EnsembleCritic, np.ndarray]:
    """A fresh critic fitted on every return seen so far, and its members' predictions at every table state."""
    n_features = settings.feature_dim + 2  # + 2 scalar features
    critic = (PriorFunctionCritic(settings.critic, n_features, settings.critic_prior_scale)
              if settings.critic_prior_scale > 0 else EnsembleCritic(settings.critic, n_features))
    features = table.feature_matrix()
    critic.fit(features, *data.padded(len(table.states)))
    return critic, critic.predict_members(features)


def candidate_view(table: StateTable, critic: EnsembleCritic, members: np.ndarray, data: ReturnCounts,
                   candidates: np.ndarray) -> dict:
    """What the error-predicting rules read: the candidates' features, the returns the critic was fitted on, and
    out-of-bag values (members whose bootstrap left a state's returns out), at the candidates and at every
    observed state."""
    size = len(table.states)
    weight = np.pad(critic.bootstrap_weight, ((0, 0), (0, size - critic.bootstrap_weight.shape[1])))
    oob = out_of_bag_mean(members, weight)
    total, count = data.padded(size)
    observed = np.flatnonzero(count > 0)
    row = np.full(size, -1)
    row[observed] = np.arange(len(observed))
    features = table.feature_matrix()
    observations = Observations(features[observed], total[observed], count[observed],
                                members.mean(0)[observed], oob[observed])
    return {"features": features[candidates], "return_sum": total[candidates], "return_count": count[candidates],
            "oof_mean": oob[candidates], "observations": observations, "observation_row": row[candidates]}


def run_strategy(env, policy, table: StateTable, batch: MainBatch, truth: np.ndarray, strategy: str,
                 budget: float, settings: Settings, seed: int, first_fit: dict | None = None) -> dict[str, float]:
    """Spend `budget` continuation tokens with `strategy` in R rounds; score the final critic.

    ``first_fit`` caches the round-0 critic of a seed: it is fitted on the main trajectories' returns only, the
    same data and seed for every strategy and budget, so it is fitted once."""
    rng = np.random.default_rng(seed)
    n_main = len(table.states)
    critic_data = ReturnCounts(n_main)  # every return seen from a state: the critic's targets
    critic_data.add(batch.state_idx, batch.own_return)
    branch_data = ReturnCounts(n_main)  # returns of continuations started at a candidate state

    candidate_seg = batch.segment_idx > 0
    candidates = np.unique(batch.state_idx[candidate_seg])
    occurrences = np.bincount(batch.state_idx[candidate_seg], minlength=n_main)[candidates]
    seg_of_state = np.zeros(n_main, dtype=np.int64)
    seg_of_state[batch.state_idx] = batch.segment_idx
    weight = advantage_sensitivity(seg_of_state[candidates], gamma=settings.gamma, lam=settings.lam) * occurrences
    # Continuation cost estimate: mean remaining tokens of main trajectories at that segment index.
    mean_remaining = {k: batch.remaining_tokens[batch.segment_idx == k].mean() for k in np.unique(batch.segment_idx)}
    cost = np.array([max(mean_remaining[seg_of_state[s]], 1.0) for s in candidates])
    # The policy's exact next-action entropy at each candidate, for the entropy rule (ARPO/AEPO branch there).
    entropy = np.array([-np.sum(p * np.log(np.where(p > 0, p, 1.0)))
                        for p in (policy.probabilities(table.states[c]) for c in candidates)])

    spent = 0.0
    spearmans: list[float] = []
    for round_idx in range(settings.rounds + 1):
        if round_idx == 0 and first_fit is not None:
            if "critic" not in first_fit:
                first_fit["critic"] = fit_critic(table, critic_data, settings)[0]
            critic = first_fit["critic"]
            members = critic.predict_members(table.feature_matrix())  # the table grows with earlier runs' branches
        else:
            critic, members = fit_critic(table, critic_data, settings)
        if round_idx == settings.rounds or budget - spent <= 0:
            break
        already = branch_data.padded(n_main)[1][candidates]
        request = Request(budget_tokens=(budget - spent) / (settings.rounds - round_idx),
                          config=settings.acquisition.model_copy(update={"strategy": strategy}),
                          seed=seed * 1000 + round_idx)
        view = candidate_view(table, critic, members, critic_data, candidates)
        alloc = allocate(Candidates(members[:, candidates], cost, weight, already=already, entropy=entropy,
                                    true_value=truth[candidates], **view), request)
        # How well the strategy's wish list ranks the critic's actual error before this round's continuations.
        spearmans.append(spearman(alloc.score, np.abs(members[:, candidates].mean(0) - truth[candidates])))
        for pos in np.flatnonzero(alloc.counts):
            state = candidates[pos]
            for _ in range(int(alloc.counts[pos])):
                episode = env.sample_episode(policy, rng, start=table.states[state], max_tokens=int(budget - spent))
                spent += episode.total_tokens
                if episode.truncated:  # the budget ran out mid-continuation: tokens spent, no return
                    continue
                branch_data.add(state, episode.episode_return)
                # Every segment start the branch passes (its start included) is a critic target.
                seg_rewards = np.asarray(episode.segment_rewards(), dtype=np.float64)
                starts = [table.add(episode.states[t]) for t in episode.boundary_turns()]
                critic_data.add(np.array(starts), np.cumsum(seg_rewards[::-1])[::-1])
    assert spent <= budget + 1e-9, f"{strategy} spent {spent} tokens of a {budget} budget"

    features = table.feature_matrix(batch.state_idx)
    mean, var = critic.predict(features)
    critic_mse = float(np.mean((mean[candidate_seg] - truth[batch.state_idx][candidate_seg]) ** 2))
    # The value used for advantages: critic combined with branch returns; s_0 pools its group's returns.
    branch_sum, branch_n = branch_data.padded(n_main)
    own_sum, own_n = critic_data.padded(len(table.states))
    mc_n = np.where(candidate_seg, branch_n[batch.state_idx], own_n[batch.state_idx])
    mc_sum = np.where(candidate_seg, branch_sum[batch.state_idx], own_sum[batch.state_idx])
    value, _ = combine_estimates(mean, var + settings.acquisition.jitter, np.divide(mc_sum, np.maximum(mc_n, 1)), mc_n)
    adv, _ = segment_td_lambda_batch(batch.rewards, segment_values(batch, value), batch.lengths,
                                     gamma=settings.gamma, lam=settings.lam)
    adv_true, _ = segment_td_lambda_batch(batch.rewards, segment_values(batch, truth[batch.state_idx]),
                                          batch.lengths, gamma=settings.gamma, lam=settings.lam)
    decided = np.abs(adv_true) > 1e-9
    return {
        "critic_mse": critic_mse,
        "adv_mse": float(np.mean((adv - adv_true) ** 2)),
        "sign_acc": float(np.mean(np.sign(adv[decided]) == np.sign(adv_true[decided]))) if decided.any() else 1.0,
        "spent_tokens": spent,
        "branched_states": int((branch_n[candidates] > 0).sum()),
        "candidate_states": len(candidates),
        # Mean over rounds of the Spearman correlation between the strategy's scores and |μ − V^π| of the critic
        # it read (None for the uniform rules, whose scores are all equal).
        "spearman": nan_to_none(float(np.nanmean(spearmans)) if np.isfinite(spearmans).any() else float("nan")),
    }


def nan_to_none(x: float) -> float | None:
    return None if x is None or not np.isfinite(x) else float(x)


def run_seed(env_name: str, seed: int, budget_ratios: Sequence[float], strategies: Sequence[str],
             settings: Settings) -> list[dict]:
    import torch

    torch.set_num_threads(1)  # one worker per core
    env = make_trap_env(env_name, seed=seed, paraphrase=settings.paraphrase)
    policy = env.default_policy(seed)
    table = StateTable(env, settings.feature_dim)
    batch = play_main(env, policy, settings.main_trajectories, np.random.default_rng(seed), table)
    truth = env.exact_values(policy, list(table.states))  # exact V^π of the main trajectories' states
    rows = []
    first_fit: dict = {}
    for ratio in [0.0, *budget_ratios]:
        for strategy in (["none"] if ratio == 0 else strategies):
            started = time.perf_counter()
            metrics = run_strategy(env, policy, table, batch, truth, strategy if ratio else "uniform_random",
                                   ratio * batch.tokens, settings, seed, first_fit)
            rows.append({"env": env_name, "strategy": strategy, "budget_ratio": ratio, "seed": seed,
                         "main_tokens": batch.tokens, "seconds": time.perf_counter() - started, **metrics})
    return rows


def _mean_se(values: list[float]) -> tuple[float, float]:
    x = np.array(values)
    return float(x.mean()), float(x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else 0.0


def gap_captured(uniform: np.ndarray, strategy: np.ndarray, oracle: np.ndarray) -> tuple[float, float]:
    """Share of the oracle's improvement over uniform_random that a strategy captures, paired by seed:
    R = mean(U − S) / mean(U − O), with its standard error by the delta method, sqrt(var(D − R G) / n) / |mean G|
    for D = U − S and G = U − O per seed (1 = as good as the oracle, 0 = no better than uniform_random; a ratio
    of means, because one seed where the oracle barely beats uniform would blow up a mean of per-seed ratios)."""
    d, g = np.asarray(uniform) - np.asarray(strategy), np.asarray(uniform) - np.asarray(oracle)
    if len(d) == 0 or g.mean() == 0:
        return float("nan"), float("nan")
    ratio = d.mean() / g.mean()
    se = float(np.std(d - ratio * g, ddof=1) / np.sqrt(len(d)) / abs(g.mean())) if len(d) > 1 else 0.0
    return float(ratio), se


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["env"], row["strategy"], row["budget_ratio"]), []).append(row)
    out = []
    for (env, strategy, ratio), group in sorted(groups.items()):
        critic_mean, critic_se = _mean_se([g["critic_mse"] for g in group])
        adv_mean, adv_se = _mean_se([g["adv_mse"] for g in group])
        sign_mean, sign_se = _mean_se([g["sign_acc"] for g in group])
        cell = {"env": env, "strategy": strategy, "budget_ratio": ratio, "seed_count": len(group),
                "critic_mse_mean": critic_mean, "critic_mse_se": critic_se,
                "adv_mse_mean": adv_mean, "adv_mse_se": adv_se,
                "sign_acc_mean": sign_mean, "sign_acc_se": sign_se,
                "critic_mse_ratio": None, "oracle_gap_captured": None, "oracle_gap_captured_se": None,
                "spearman": None, "spearman_se": None}
        rhos = [g["spearman"] for g in group if g.get("spearman") is not None]
        if rhos:
            cell["spearman"], cell["spearman_se"] = _mean_se(rhos)
        by_seed = {g["seed"]: g["critic_mse"] for g in group}
        uniform = {g["seed"]: g["critic_mse"] for g in groups.get((env, "uniform_random", ratio), [])}
        oracle = {g["seed"]: g["critic_mse"] for g in groups.get((env, "oracle", ratio), [])}
        paired = sorted(set(by_seed) & set(uniform))
        if paired and strategy != "none":
            mse, base = np.array([by_seed[k] for k in paired]), np.array([uniform[k] for k in paired])
            cell["critic_mse_ratio"] = float(mse.mean() / base.mean())
            paired = sorted(set(paired) & set(oracle))
            if paired:
                gap, gap_se = gap_captured(np.array([uniform[k] for k in paired]),
                                           np.array([by_seed[k] for k in paired]),
                                           np.array([oracle[k] for k in paired]))
                cell["oracle_gap_captured"], cell["oracle_gap_captured_se"] = nan_to_none(gap), nan_to_none(gap_se)
        out.append(cell)
    return out


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = sorted({r["env"] for r in summary})
    metrics = [("critic_mse", "critic MSE vs exact V"), ("adv_mse", "advantage MSE"),
               ("sign_acc", "advantage sign accuracy")]
    fig, axes = plt.subplots(len(metrics), len(envs), figsize=(5.5 * len(envs), 3.6 * len(metrics)), squeeze=False)
    for col, env in enumerate(envs):
        rows = [r for r in summary if r["env"] == env]
        for row_i, (key, label) in enumerate(metrics):
            ax = axes[row_i][col]
            for strategy in sorted({r["strategy"] for r in rows} - {"none"}):
                pts = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["budget_ratio"])
                x = [p["budget_ratio"] for p in pts]
                y = np.array([p[f"{key}_mean"] for p in pts])
                se = np.array([p[f"{key}_se"] for p in pts])
                ax.errorbar(x, y, yerr=se, marker="o", capsize=2, label=strategy,
                            linewidth=2.5 if strategy == AcquisitionConfig().strategy else 1.2)
            for r in rows:
                if r["strategy"] == "none":
                    ax.axhline(r[f"{key}_mean"], color="grey", linestyle=":", label="no branches")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("continuation budget / main-rollout tokens")
            ax.set_title(f"{env}: {label}")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def print_table(summary: list[dict]) -> None:
    print(f"{'env':18} {'strategy':15} {'ratio':>5} {'critic_mse':>19} {'/uniform':>8} {'oracle gap':>14} "
          f"{'spearman':>8} {'adv_mse':>19} {'sign_acc':>8}")

    def fmt(value, spec):
        return format(value, spec) if value is not None else "-".rjust(len(format(0.0, spec)))

    for r in summary:
        gap = (f"{r['oracle_gap_captured']:+.2f} ± {r['oracle_gap_captured_se']:.2f}"
               if r["oracle_gap_captured"] is not None else "-")
        print(f"{r['env']:18} {r['strategy']:15} {r['budget_ratio']:5.2f} "
              f"{r['critic_mse_mean']:.5f} ± {r['critic_mse_se']:.5f} {fmt(r['critic_mse_ratio'], '8.3f')} {gap:>14} "
              f"{fmt(r['spearman'], '8.3f')} "
              f"{r['adv_mse_mean']:.5f} ± {r['adv_mse_se']:.5f} {r['sign_acc_mean']:8.3f}")


def markdown_tables(summary: list[dict], default: str | None = None) -> str:
    """Per env, a strategy × budget table: critic MSE ± se (÷ uniform_random); oracle gap captured ± se; Spearman
    of the strategy's scores with the actual error. The default strategy is in bold."""
    default = default or AcquisitionConfig().strategy
    lines = []
    for env in sorted({r["env"] for r in summary}):
        rows = [r for r in summary if r["env"] == env]
        ratios = sorted({r["budget_ratio"] for r in rows if r["strategy"] != "none"})
        seeds = max(r["seed_count"] for r in rows)
        lines += [f"**{env}** ({seeds} seeds) — critic MSE ± se (÷ uniform_random); oracle gap captured ± se; "
                  "Spearman(score, |error|)", "",
                  "| strategy | " + " | ".join(f"×{x:g}" for x in ratios) + " |", "|---" * (len(ratios) + 1) + "|"]
        cell = {(r["strategy"], r["budget_ratio"]): r for r in rows}
        for strategy in sorted({r["strategy"] for r in rows} - {"none"}):
            parts = []
            for x in ratios:
                r = cell.get((strategy, x))
                if r is None:
                    parts.append("")
                    continue
                ratio = f" ({r['critic_mse_ratio']:.2f})" if r["critic_mse_ratio"] is not None else ""
                gap = (f"{r['oracle_gap_captured']:+.2f} ± {r['oracle_gap_captured_se']:.2f}"
                       if r["oracle_gap_captured"] is not None else "–")
                rho = f"{r['spearman']:.2f}" if r["spearman"] is not None else "–"
                parts.append(f"{r['critic_mse_mean']:.4f} ± {r['critic_mse_se']:.4f}{ratio}; {gap}; {rho}")
            name = f"**{strategy}**" if strategy == default else strategy
            lines.append(f"| {name} | " + " | ".join(parts) + " |")
        none = [r for r in rows if r["strategy"] == "none"]
        if none:
            lines += ["", f"no branches: critic MSE {none[0]['critic_mse_mean']:.4f} ± {none[0]['critic_mse_se']:.4f}"]
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="reduced grid (3 seeds, 4 budgets, 5 strategies)")
    parser.add_argument("--seeds", type=int, help="number of seeds (default 10, quick 3)")
    parser.add_argument("--envs", nargs="+", help="environments to run")
    parser.add_argument("--strategies", nargs="+", help="strategies to run")
    parser.add_argument("--budget-ratios", nargs="+", type=float, help="budgets as multiples of main tokens")
    parser.add_argument("--main-trajectories", type=int, default=Settings.main_trajectories)
    parser.add_argument("--rounds", type=int, default=Settings.rounds)
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds first..first+seeds-1 (the reported grids use 0..; settings are tuned on 100..)")
    parser.add_argument("--critic-members", type=int, default=Settings().critic.members,
                        help="ensemble members of the benchmark's critic")
    parser.add_argument("--critic-prior-scale", type=float, default=Settings.critic_prior_scale,
                        help="> 0: each member gets a fixed random prior function of this scale in logit units "
                             "(focus_core.critic.PriorFunctionCritic)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    add_output_options(parser)
    args = parser.parse_args(argv)
    if args.from_json:
        return render(args.from_json, args.markdown, args.plot)
    grid = chosen_grid(parser, args, QUICK_GRID if args.quick else FULL_GRID)
    settings = Settings(main_trajectories=args.main_trajectories, rounds=args.rounds,
                        critic=Settings().critic.model_copy(update={"members": args.critic_members}),
                        critic_prior_scale=args.critic_prior_scale)

    started = time.perf_counter()
    jobs = [(env, seed) for env in grid["envs"] for seed in range(args.first_seed, args.first_seed + grid["seeds"])]
    rows: list[dict] = []
    with process_pool(args.workers) as pool:
        futures = [pool.submit(run_seed, env, seed, grid["budget_ratios"], grid["strategies"], settings)
                   for env, seed in jobs]
        for done, future in enumerate(futures, 1):
            rows.extend(future.result())
            print(f"[{done}/{len(jobs)}] {jobs[done - 1][0]} seed {jobs[done - 1][1]} "
                  f"({time.perf_counter() - started:.0f}s)", flush=True)
    write_outputs(args, rows, {"grid": grid, "first_seed": args.first_seed, "critic_members": args.critic_members,
                               "critic_prior_scale": args.critic_prior_scale, "seconds": time.perf_counter() - started})
    return 0


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """--json, --plot, --markdown and --from-json, shared with bench/critic_agent.py."""
    parser.add_argument("--json", type=Path, help="write the summary (and per-seed rows) as JSON here")
    parser.add_argument("--plot", type=Path, help="write a PNG plot here")
    parser.add_argument("--markdown", type=Path, help="write the per-env strategy × budget tables here")
    parser.add_argument("--from-json", type=Path, help="do not run: render --markdown/--plot from this JSON")


def chosen_grid(parser: argparse.ArgumentParser, args: argparse.Namespace, base: dict) -> dict:
    """The grid of --quick or the full one, with the --seeds/--envs/--strategies/--budget-ratios given."""
    grid = dict(base)
    for key, value in (("seeds", args.seeds), ("envs", args.envs), ("strategies", args.strategies),
                       ("budget_ratios", args.budget_ratios)):
        if value is not None:
            grid[key] = value
    unknown = set(grid["strategies"]) - set(STRATEGIES)
    if unknown:
        parser.error(f"unknown strategies {sorted(unknown)}; known: {sorted(STRATEGIES)}")
    return grid


def write_outputs(args: argparse.Namespace, rows: list[dict], extra: dict) -> list[dict]:
    """Summarise per-seed rows, print the table, and write the JSON, plot and markdown asked for."""
    summary = summarise(rows)
    print_table(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"default_strategy": AcquisitionConfig().strategy, "results": summary,
                                         "rows": rows, **extra}, indent=1))
    if args.plot:
        plot(summary, args.plot)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown_tables(summary))
    return summary


def render(source: Path, markdown: Path | None, png: Path | None) -> int:
    """The tables and plot of an earlier run's JSON (either benchmark's), without running anything."""
    written = json.loads(source.read_text())
    if markdown:
        markdown.write_text(markdown_tables(written["results"], written.get("default_strategy")))
    if png:
        plot(written["results"], png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
