"""Critic error versus continuation budget on real agent states (`focus bench critic-agent`).

The critic-budget benchmark has exact values but toy features; this one has the pipeline's own states. Per
embedded environment:

1. **States.** The pipeline's stages themselves: ``bootstrap`` (the SFT warm start, or ``--init`` a run's
   committed bootstrap), one ``rollout`` of P × G_main main episodes and ``segment``, whose ``states`` table
   holds every segment start with the critic features the pipeline computes (the policy's pooled hidden states
   and the segment index). They are committed to ``--store`` like any run's, so ``focus sql`` reads them.
2. **Dense Monte Carlo.** Every distinct state gets ``pool + reference`` continuations of the same policy through
   the harness (compression, tool calls, the lot). Per replay seed the draws of each state are shuffled and split:
   the first ``pool`` are what a strategy may buy, the rest are the reference ȳ_ref(s), which no strategy and no
   critic sees. Since the reference is noisy, the critic's MSE is corrected for it: with ȳ_ref independent of the
   critic, E[(μ − ȳ_ref)²] = (μ − V)² + σ²/n_ref, so ``critic_mse`` = mean[(μ − ȳ_ref)² − s²/n_ref] is unbiased
   for the mean (μ − V)². The draws are written as Parquet parts as they come (``dense_returns``), so an
   interrupted run resumes and a second run replays without generating.
3. **Offline replay.** For each strategy and budget ratio (continuation tokens as a multiple of the main
   episodes' tokens) the pipeline's stages 3–5 run as an iteration does, on these tables: R = acquisition.rounds
   rounds of acquire (``allocate`` with the pipeline's candidates: every distinct state, its occurrences times
   W_k as weight, ``continuation_cost`` as price, its returns so far, the entropy of its next action from the
   rollouts' log-probs) → branch (the next unused pool draws of the chosen states; a draw that no longer fits
   the budget spends what is left and returns nothing, as the ledger's cut does) → fit the critic
   (``EnsembleCritic`` with the config's ``critic`` settings on the main episodes' own returns plus the draws
   bought). The oracle reads ȳ_ref as its "true" value.

Reported with the same fields as critic-budget (``bench.critic_budget.summarise``): critic_mse (corrected, over
the non-initial states), adv_mse and sign_acc (TD(λ) segment advantages of the main episodes with the value the
pipeline would use, against those with ȳ_ref; both include the reference's own noise, which is the same for every
strategy), critic_mse_ratio, oracle_gap_captured, and the Spearman correlation of each strategy's scores with
|μ − ȳ_ref| before each round (attenuated by the reference's noise, equally for every strategy).

What the seeds vary: the pool/reference split, the critic's initialisation and bootstrap, and the strategies'
random choices; every seed replays the same states of one rollout of one policy, so the intervals do not cover
the sampling of the states themselves. The error-predicting rules get out-of-bag values (members whose Poisson
bootstrap gave a state's returns weight 0), as in critic-budget; the pipeline cross-fits by task folds instead.

    focus bench critic-agent --quick --json docs/results/critic_agent.json --plot docs/results/critic_agent.png
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench import process_pool
from bench.critic_budget import add_output_options, chosen_grid, nan_to_none, render, write_outputs
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
from focus_core.config import AcquisitionConfig, FocusConfig, config_to_dict
from focus_core.critic import EnsembleCritic, out_of_bag_mean

EMBEDDED_ENVS = ["deep_search", "code_localization", "legal"]
FULL_GRID = {"envs": EMBEDDED_ENVS, "budget_ratios": [0.5, 1.0, 2.0], "seeds": 5, "strategies": sorted(STRATEGIES)}
QUICK_GRID = {
    "envs": EMBEDDED_ENVS,
    "budget_ratios": [0.5, 1.0, 2.0],
    "seeds": 3,
    "strategies": sorted({"uniform_all", "uniform_random", "entropy", "ivr_greedy", "residual_knn", "oracle",
                          AcquisitionConfig().strategy}),
}
DENSE_TABLE = "dense_returns"
DENSE_SCHEMA = pa.schema([("state_id", pa.string()), ("draw", pa.int32()), ("return", pa.float64()),
                          ("generated_tokens", pa.int64())])


@dataclass(frozen=True)
class Settings:
    """How the states and their dense Monte-Carlo values are made (what the cached data depends on)."""

    prompts: int = 16  # P training tasks of the one rollout, G_main = budget.group_size_main episodes each
    pool: int = 9  # draws per state a strategy may buy (>= acquisition.vine_k and max_per_state)
    reference: int = 24  # draws per state held out as the reference value
    sft_seconds: float = 240.0  # bootstrap.max_seconds of the SFT warm start (ignored with --init)
    demonstrations: int = 1000  # bootstrap.demonstrations of the SFT warm start (ignored with --init)
    measure_episodes: int = 64  # budget.measure_episodes of the bootstrap
    states_per_chunk: int = 16  # states whose draws are generated (and written) together

    @property
    def draws(self) -> int:
        return self.pool + self.reference


# Quick: a smoke-sized version of the full run that fits 10 minutes on 2 cores from nothing: 4 tasks, a 90 s SFT on
# 300 demonstrations, 8 reference draws. (A fresh machine's first code_localization run also builds its mutants and
# plans its tasks, ~3.5 min of one core, then cached under FOCUS_DATA_DIR.)
QUICK_SETTINGS = Settings(prompts=4, pool=9, reference=8, sft_seconds=90.0, demonstrations=300, measure_episodes=16)


# ---------------------------------------------------------------------------------------------------------
# 1-2. States from the pipeline's own stages, and their dense Monte-Carlo returns
# ---------------------------------------------------------------------------------------------------------


def pipeline_config(env: str, settings: Settings, init: str | None) -> FocusConfig:
    from focus_core.config import load_config

    overrides = [f"env.name={env}", f"budget.prompts_per_iteration={settings.prompts}",
                 f"budget.measure_episodes={settings.measure_episodes}",
                 f"bootstrap.max_seconds={settings.sft_seconds}",
                 f"bootstrap.demonstrations={settings.demonstrations}"]
    if init:
        overrides.append(f"bootstrap.init_from={init}")
    return load_config(None, overrides)


def run_id_of(env: str, settings: Settings, init: str | None) -> str:
    from focus_core.ids import content_id

    return f"critic-agent-{env}-{content_id(env, repr(settings), init or '')[:8]}"


def agent_states(env: str, settings: Settings, store: str, init: str | None) -> dict:
    """The committed states of one rollout and the dense returns of every distinct state (generated where
    missing), as tables: ``states``, ``rollouts``, ``dense`` and the policy's bootstrap figures."""
    from focus_core.agent.harness import AgentRunner
    from focus_core.artifacts import ArtifactStore
    from focus_core.rollouts import segment_starts
    from tasks.bootstrap import bootstrap
    from tasks.inputs import env_factory, policy_at, read, tasks
    from tasks.rollout import rollout
    from tasks.segment import segment
    from tasks.stage import RunContext

    cfg = pipeline_config(env, settings, init)
    ctx = RunContext(ArtifactStore(store), run_id_of(env, settings, init), cfg)
    # A run's info, so `focus runs` lists it and `--init` can start a training run from its bootstrap.
    ctx.store.write_run_info(ctx.run_id, {"status": "running", "config": config_to_dict(cfg),
                                          "store": ctx.store.root})
    policy = bootstrap.fn(ctx)
    # An unbounded ledger: the benchmark's budget is applied in the replay, the rollout must not cut episodes.
    ctx = ctx.with_tokens_per_iteration(10**12)
    main = rollout.fn(ctx, 0, policy)
    seg = segment.fn(ctx, 0, main, policy)
    states, rollouts, episodes = read(ctx, seg, "states"), read(ctx, main, "rollouts"), read(ctx, main, "episodes")

    folder = Path(store) / ctx.run_id / DENSE_TABLE
    folder.mkdir(parents=True, exist_ok=True)
    distinct = sorted(set(states.column("state_id").to_pylist()))
    chunks = [distinct[k:k + settings.states_per_chunk] for k in range(0, len(distinct), settings.states_per_chunk)]
    missing = [k for k in range(len(chunks)) if not (folder / f"part-{k:04d}.parquet").exists()]
    if missing:
        loaded = policy_at(ctx, policy)
        by_id = {t.task_id: t for split in ("train", "heldout") for t in tasks(ctx, split)}
        runner = AgentRunner(loaded, env_factory(ctx), cfg.agent)
        system = env_factory(ctx)().system_prompt()
        started = time.perf_counter()
        for done, k in enumerate(missing, 1):
            ids = [s for s in chunks[k] for _ in range(settings.draws)]
            starts = segment_starts(ids, rollouts=rollouts, episodes=episodes, tasks_by_id=by_id, system_prompt=system)
            played = runner.run(starts=starts, seed=ctx.seed(0, DENSE_TABLE, str(k)), kind="branch")
            draw = pa.array([j % settings.draws for j in range(len(ids))], pa.int32())
            part = pa.table({"state_id": ids, "draw": draw,
                             "return": pa.array([e.reward for e in played], pa.float64()),
                             "generated_tokens": pa.array([e.generated_tokens for e in played], pa.int64())},
                            schema=DENSE_SCHEMA)
            scratch = folder / f".part-{k:04d}.parquet.tmp"
            pq.write_table(part, scratch)
            scratch.replace(folder / f"part-{k:04d}.parquet")  # atomic: a part is whole or absent
            print(f"  {env}: dense returns {done}/{len(missing)} chunks ({time.perf_counter() - started:.0f}s)",
                  flush=True)
    ctx.store.write_run_info(ctx.run_id, {"status": "finished"})
    dense = pa.concat_tables([pq.read_table(folder / f"part-{k:04d}.parquet") for k in range(len(chunks))])
    return {"states": states, "rollouts": rollouts, "dense": dense, "config": cfg, "run_id": ctx.run_id,
            "bootstrap": dict(policy.figures)}


# ---------------------------------------------------------------------------------------------------------
# 3. Offline replay of acquisition → branch → fit_critic on those tables
# ---------------------------------------------------------------------------------------------------------


@dataclass
class AgentData:
    """One environment's states in the shapes the replay needs; S distinct states, rows = segment starts."""

    env: str
    config: FocusConfig
    features: np.ndarray  # [S, F] the pipeline's critic features
    segment_idx: np.ndarray  # [S]
    occurrences: np.ndarray  # [S] main rows per distinct state
    entropy: np.ndarray  # [S] next-action entropy from the rollouts' log-probs
    own_sum: np.ndarray  # [S] sum of the main episodes' own returns from the state
    all_states: pa.Table  # the segment stage's rows, for continuation_cost
    distinct: pa.Table  # first row per distinct state
    row_state: np.ndarray  # [rows] distinct index of each row
    draw_return: np.ndarray  # [S, D] dense returns
    draw_tokens: np.ndarray  # [S, D] their generated tokens
    lengths: np.ndarray  # segments per main episode, rows ordered by (episode, segment)
    order: np.ndarray  # row order of that layout
    rewards: np.ndarray  # segment rewards in that layout
    main_tokens: int


def agent_data(env: str, tables: dict, settings: Settings) -> AgentData:
    from tasks.acquire import distinct_states, next_action_entropy

    states = tables["states"]
    distinct, occurrences, row_state = distinct_states(states)
    ids = distinct.column("state_id").to_pylist()
    dense = tables["dense"]
    index = {s: i for i, s in enumerate(ids)}
    draw_return = np.full((len(ids), settings.draws), np.nan)
    draw_tokens = np.zeros((len(ids), settings.draws))
    rows = np.array([index[s] for s in dense.column("state_id").to_pylist()])
    draws = dense.column("draw").to_numpy()
    draw_return[rows, draws] = dense.column("return").to_numpy()
    draw_tokens[rows, draws] = dense.column("generated_tokens").to_numpy()
    if np.isnan(draw_return).any():
        raise ValueError(f"{env}: dense returns are missing for some states; delete {tables['run_id']}/{DENSE_TABLE} "
                         "in the store and rerun")
    entropy = np.bincount(row_state, weights=next_action_entropy(tables["rollouts"], states)) / occurrences
    episode = np.array(states.column("episode_id").to_pylist(), dtype=object)
    seg = states.column("segment_idx").to_numpy()
    order = np.lexsort((seg, episode))
    ordered = episode[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    first_rows = states.filter(pa.compute.equal(states.column("segment_idx"), 0))
    return AgentData(
        env=env, config=tables["config"],
        features=np.array(distinct.column("features").to_pylist(), dtype=np.float32),
        segment_idx=distinct.column("segment_idx").to_numpy(), occurrences=occurrences, entropy=entropy,
        own_sum=np.bincount(row_state, weights=states.column("own_return").to_numpy(), minlength=len(ids)),
        all_states=states, distinct=distinct, row_state=row_state, draw_return=draw_return, draw_tokens=draw_tokens,
        lengths=np.diff(np.r_[starts, len(ordered)]), order=order,
        rewards=states.column("segment_reward").to_numpy()[order],
        main_tokens=int(first_rows.column("remaining_generated_tokens").to_numpy().sum()))


def corrected_mse(estimate: np.ndarray, reference: np.ndarray) -> float:
    """Mean over states of (μ − ȳ)² − s²/n, ȳ and s² the mean and variance of each state's n reference draws
    ([S, n]): unbiased for the mean (μ − V)² when the draws are independent of μ, since E(μ − ȳ)² = (μ − V)² + σ²/n.
    """
    reference = np.asarray(reference, dtype=np.float64)
    n = reference.shape[1]
    return float(np.mean((np.asarray(estimate) - reference.mean(1)) ** 2 - reference.var(1, ddof=1) / n))


def fit(data: AgentData, successes: np.ndarray, trials: np.ndarray, seed: int) -> EnsembleCritic:
    cfg = data.config.critic
    critic = EnsembleCritic(cfg.model_copy(update={"seed": cfg.seed + seed}), data.features.shape[1])
    critic.fit(data.features, successes, trials)
    return critic


def replay(data: AgentData, strategy: str, budget: float, seed: int, split: np.ndarray, settings: Settings,
           first_fit: dict) -> dict[str, float]:
    """Spend ``budget`` tokens with ``strategy`` over the config's acquisition rounds; score the final critic."""
    from tasks.acquire import continuation_cost

    cfg = data.config
    rounds = cfg.acquisition.rounds
    acquisition = cfg.acquisition.model_copy(update={"strategy": strategy, "benchmark_only": True})
    s = len(data.segment_idx)
    pool = np.take_along_axis(data.draw_return, split[:, :settings.pool], 1)
    pool_tokens = np.take_along_axis(data.draw_tokens, split[:, :settings.pool], 1)
    reference = np.take_along_axis(data.draw_return, split[:, settings.pool:], 1)
    truth = reference.mean(1)
    weight = advantage_sensitivity(data.segment_idx, gamma=cfg.advantage.gamma, lam=cfg.advantage.lam) \
        * data.occurrences
    taken = np.zeros(s, dtype=np.int64)  # pool draws bought per state
    taken_sum = np.zeros(s)
    spent, cut, short = 0.0, 0, 0
    spearmans: list[float] = []
    rng = np.random.default_rng(seed)
    for round_idx in range(rounds + 1):
        successes, trials = data.own_sum + taken_sum, data.occurrences + taken
        if round_idx == 0:
            if "critic" not in first_fit:  # the main episodes' returns only: the same for every strategy and budget
                first_fit["critic"] = fit(data, successes, trials.astype(np.float64), seed)
            critic = first_fit["critic"]
        else:
            critic = fit(data, successes, trials.astype(np.float64), seed * 1000 + round_idx)
        members = critic.predict_members(data.features)
        if round_idx == rounds or budget - spent <= 0:
            break
        earlier_tokens = {state: list(pool_tokens[i, :taken[i]]) for i, state in
                          enumerate(data.distinct.column("state_id").to_pylist()) if taken[i]}
        cost = continuation_cost(data.all_states, data.row_state, data.occurrences, data.distinct, earlier_tokens)
        oob = out_of_bag_mean(members, critic.bootstrap_weight)
        features = data.features.astype(np.float64)
        candidates = Candidates(
            member_predictions=members, cost=np.maximum(1.0, cost), weight=weight, already=trials,
            entropy=data.entropy, true_value=truth, features=features, return_sum=successes,
            return_count=trials.astype(np.float64), oof_mean=oob,
            observations=Observations(features, successes, trials.astype(np.float64), members.mean(0), oob),
            observation_row=np.arange(s))
        request = Request((budget - spent) / (rounds - round_idx), acquisition,
                          seed=int(rng.integers(2**31)))
        alloc = allocate(candidates, request)
        spearmans.append(spearman(alloc.score, np.abs(members.mean(0) - truth)))
        for i in np.flatnonzero(alloc.counts):
            for _ in range(int(alloc.counts[i])):
                if taken[i] >= settings.pool:
                    short += 1  # the strategy wanted more draws than the pool holds
                    continue
                tokens = pool_tokens[i, taken[i]]
                if tokens > budget - spent:  # the ledger would cut it: the tokens are gone, no return
                    spent, cut = budget, cut + 1
                    continue
                spent += tokens
                taken_sum[i] += pool[i, taken[i]]
                taken[i] += 1
    mean, var = critic.predict(data.features)
    later = data.segment_idx > 0
    critic_mse = corrected_mse(mean[later], reference[later])
    # The value the pipeline's advantages use: the critic combined with the state's bought draws; s_0 also has
    # the main group's own returns (every main episode of a task starts there).
    mc_n = taken + np.where(later, 0, data.occurrences)
    mc_sum = taken_sum + np.where(later, 0.0, data.own_sum)
    value, _ = combine_estimates(mean, var + acquisition.jitter, np.divide(mc_sum, np.maximum(mc_n, 1)), mc_n)
    adv = advantages(data, value)
    adv_true = advantages(data, truth)
    decided = np.abs(adv_true) > 1e-9
    return {
        "critic_mse": critic_mse,
        "adv_mse": float(np.mean((adv - adv_true) ** 2)),
        "sign_acc": float(np.mean(np.sign(adv[decided]) == np.sign(adv_true[decided]))) if decided.any() else 1.0,
        "spent_tokens": spent, "budget_cut": cut, "pool_short": short,
        "branched_states": int((taken > 0).sum()), "candidate_states": s,
        "spearman": nan_to_none(float(np.nanmean(spearmans)) if np.isfinite(spearmans).any() else float("nan")),
    }


def advantages(data: AgentData, value_of_state: np.ndarray) -> np.ndarray:
    """TD(λ) segment advantages of the main episodes with one value per distinct state (terminal value 0)."""
    per_row = value_of_state[data.row_state][data.order]
    values, pos = [], 0
    for k in data.lengths:
        values.extend(per_row[pos:pos + k])
        values.append(0.0)
        pos += k
    cfg = data.config.advantage
    adv, _ = segment_td_lambda_batch(data.rewards, np.array(values), data.lengths, lam=cfg.lam, gamma=cfg.gamma)
    return adv


def replay_env(env: str, tables: dict, grid: dict, settings: Settings) -> list[dict]:
    import torch

    torch.set_num_threads(1)  # one worker per core
    data = agent_data(env, tables, settings)
    rows = []
    for seed in range(grid["seeds"]):
        split = np.argsort(np.random.default_rng(10_000 + seed).random(data.draw_return.shape), axis=1)
        first_fit: dict = {}
        for ratio in [0.0, *grid["budget_ratios"]]:
            for strategy in (["none"] if ratio == 0 else grid["strategies"]):
                started = time.perf_counter()
                metrics = replay(data, strategy if ratio else "uniform_random", ratio * data.main_tokens, seed, split,
                                 settings, first_fit)
                rows.append({"env": env, "strategy": strategy, "budget_ratio": ratio, "seed": seed,
                             "main_tokens": data.main_tokens, "seconds": time.perf_counter() - started, **metrics})
    return rows


def run_env(env: str, grid: dict, settings: Settings, store: str, init: str | None) -> tuple[list[dict], dict]:
    import torch

    torch.set_num_threads(1)
    logging.getLogger("focus").setLevel(logging.WARNING)  # the stages' own lines; this bench prints its own
    started = time.perf_counter()
    tables = agent_states(env, settings, store, init)
    made = time.perf_counter() - started
    rows = replay_env(env, tables, grid, settings)
    returns = tables["dense"].column("return").to_numpy()
    info = {"env": env, "run_id": tables["run_id"], "states": tables["states"].num_rows,
            "distinct_states": len(set(tables["states"].column("state_id").to_pylist())),
            "dense_draws": len(returns), "dense_mean_return": float(returns.mean()),
            "main_success": float(np.mean(tables["states"].column("own_return").to_numpy())),
            "bootstrap": {k: tables["bootstrap"].get(k) for k in ("sft_steps", "measured_success",
                                                                  "mean_episode_tokens")},
            "data_seconds": made, "replay_seconds": time.perf_counter() - started - made}
    return rows, info


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 seeds, 7 strategies, a 90 s SFT on 300 demonstrations, 4 prompts and 8 reference "
                             "draws (a rerun on its --store only replays)")
    parser.add_argument("--seeds", type=int, help="replay seeds (default 5, quick 3)")
    parser.add_argument("--envs", nargs="+", choices=EMBEDDED_ENVS, help="environments to run")
    parser.add_argument("--strategies", nargs="+", help="strategies to run")
    parser.add_argument("--budget-ratios", nargs="+", type=float, help="budgets as multiples of main tokens")
    parser.add_argument("--store", default="bench/out/critic_agent",
                        help="artifact store for the states and dense returns (reused by later runs)")
    parser.add_argument("--init", help="a run id (in --store) or run path whose committed bootstrap is the policy "
                                       "(must be of the same env; default: a fresh SFT warm start)")
    parser.add_argument("--workers", type=int, help="processes (default: one per environment; each runs torch on "
                                                    "one thread, so 3 on 2 cores finish sooner than 2)")
    add_output_options(parser)
    args = parser.parse_args(argv)
    if args.from_json:
        return render(args.from_json, args.markdown, args.plot)
    grid = chosen_grid(parser, args, QUICK_GRID if args.quick else FULL_GRID)
    if args.init and len(grid["envs"]) > 1:
        parser.error("--init names one run's bootstrap, which belongs to one env: pass --envs ENV too")
    settings = QUICK_SETTINGS if args.quick else Settings()

    started = time.perf_counter()
    rows: list[dict] = []
    infos: list[dict] = []
    with process_pool(min(args.workers or len(grid["envs"]), len(grid["envs"]))) as pool:
        futures = {env: pool.submit(run_env, env, grid, settings, args.store, args.init) for env in grid["envs"]}
        for env, future in futures.items():
            env_rows, info = future.result()
            rows += env_rows
            infos.append(info)
            print(f"{env}: {info['distinct_states']} states, {info['dense_draws']} dense draws (mean return "
                  f"{info['dense_mean_return']:.2f}), data {info['data_seconds']:.0f}s, replay "
                  f"{info['replay_seconds']:.0f}s ({time.perf_counter() - started:.0f}s)", flush=True)
    write_outputs(args, rows, {"grid": grid, "settings": asdict(settings), "envs": infos,
                               "seconds": time.perf_counter() - started})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
