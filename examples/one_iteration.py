"""One FOCUS iteration, top to bottom, in memory: no Prefect, no artifact store, no `focus` CLI.

What it shows: the stages of `focus train` (tasks/*.py) as plain library calls, in order, on the
`combination_lock` trap (configs/combination_lock.yaml): 0. bootstrap (tiny Llama, SFT warm start, B_tok
measured); 1. rollout (P tasks x G_main episodes, every token charged to the ledger); 2. segment (one state
per segment start, with the policy's pooled hidden states as critic features); 3. R rounds of acquire (the
config's strategy) -> branch (continuations) -> fit_critic (ensemble, cross-fitted by task folds);
4. advantage (segment TD(lambda)); 5. update (PPO-clip on main and continuation tokens). Before and after:
the exact held-out success V^pi(s_0) (teacher-forced scoring + dynamic programming, no sampling).
Every value comes from the config; OVERRIDES only shrink the run for a CPU. The pipeline adds bookkeeping
left out here (per-stage derived seeds, cost calibration, a last-round spend margin, budget-cut masking).
Run it from the repository root:  python examples/one_iteration.py
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from focus_core.acquisition import (
    CRITIC_FREE_STRATEGIES,
    Candidates,
    Request,
    advantage_sensitivity,
    allocate,
    combine_estimates,
)
from focus_core.advantages import AdvantageBatch, get_advantage_estimator, whiten
from focus_core.agent.harness import AgentRunner
from focus_core.agent.sft import warm_start
from focus_core.budget import BudgetLedger
from focus_core.config import load_config
from focus_core.continuations import continuation_values, observed_returns, update_sequences
from focus_core.critic import EnsembleCritic
from focus_core.envs import make_env
from focus_core.envs.trap_tools import exact_evaluation
from focus_core.features import policy_context_features, with_scalar_features
from focus_core.ids import branch_id, content_id, episode_id
from focus_core.ppo import policy_update
from focus_core.rollouts import episode_tables, segment_starts, states_table

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "combination_lock.yaml"
OVERRIDES = [  # smaller than the YAML so the example runs in well under a minute; drop them for the real sizes
    "model.layers=1", "model.hidden=64", "model.intermediate=128", "model.vocab_size=512",
    "bootstrap.demonstrations=64", "bootstrap.max_steps=8", "bootstrap.batch_tokens=1024",
    "budget.prompts_per_iteration=4", "budget.group_size_main=2", "budget.group_size_grpo=4",
    "budget.measure_episodes=4", "agent.max_action_tokens=8", "critic.steps=20", "critic.hidden=64",
    "critic.folds=2", "ppo.epochs=1", "env.eval_tasks=4",
]
RUN = "example"
started = time.perf_counter()
cfg = load_config(CONFIG, OVERRIDES)
make = functools.partial(make_env, cfg.env.name, tier=cfg.env.tier, **cfg.env.options)
env = make()
train, heldout = env.tasks("train", cfg.env.tier), env.tasks("heldout", cfg.env.tier)[: cfg.env.eval_tasks]
rng = np.random.default_rng(cfg.seed)


def say(step: str, **figures) -> None:
    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
    print(f"[{time.perf_counter() - started:5.1f}s] {step:<10} {shown}", flush=True)


def exact_success(policy) -> float:
    """Mean exact V^pi(s_0) over the held-out tasks at the evaluation temperature (tasks/evaluate.py)."""
    agent = cfg.agent.model_copy(update={"temperature": cfg.env.eval_temperature})
    return float(exact_evaluation(policy, env, heldout, agent).values.mean())


def features_of(table) -> np.ndarray:
    """Critic features of each states row: pooled policy hidden states + segment index (tasks/segment.py)."""
    return with_scalar_features(policy_context_features(policy.model, table.column("context_token_ids").to_pylist()),
                                table.column("segment_idx").to_numpy().astype(np.float32))


def keys(table) -> list[tuple[str, int]]:  # (episode_id, segment_idx) of each row: the key of a segment
    return list(zip(table.column("episode_id").to_pylist(), table.column("segment_idx").to_pylist(), strict=True))


def ordered(table):  # segments of one episode together and in order (the ragged-batch layout of the estimators)
    return table.sort_by([("episode_id", "ascending"), ("segment_idx", "ascending")])


# --- 0. bootstrap: the tiny policy and the iteration's token budget B_tok -------------------------------------
policy, sft = warm_start(make, train, cfg.agent, cfg.model, cfg.bootstrap, seed=cfg.seed)
runner = AgentRunner(policy, make, cfg.agent)
measured = runner.run([train[i] for i in rng.integers(0, len(train), cfg.budget.measure_episodes)], seed=cfg.seed)
mean_tokens = float(np.mean([e.generated_tokens for e in measured]))
budget = max(1, round(mean_tokens * cfg.budget.prompts_per_iteration * cfg.budget.group_size_grpo))
before = exact_success(policy)
say("bootstrap", sft_steps=sft.steps, sft_loss=sft.final_loss, mean_episode_tokens=mean_tokens, B_tok=budget,
    heldout_exact=before)

# --- 1. rollout: P tasks x G_main main episodes, charged to the ledger ----------------------------------------
ledger = BudgetLedger(budget)
G = cfg.main_group_size
chosen = [train[i] for i in rng.permutation(len(train))[: cfg.budget.prompts_per_iteration]]
batch = [t for t in chosen for _ in range(G)]
main = runner.run(batch, seed=cfg.seed, ledger=ledger)
rollouts, episodes = episode_tables(
    main, run_id=RUN, iteration=0, policy_version=policy.version,
    episode_ids=[episode_id(RUN, 0, t.task_id, "main", k % G) for k, t in enumerate(batch)],
    group_ids=[content_id(RUN, 0, t.task_id, "group") for t in batch])
say("rollout", episodes=len(main), success=float(np.mean([e.reward for e in main])), tokens=ledger.spent)

# --- 2. segment: one state per segment start, with critic features --------------------------------------------
states = states_table(rollouts, episodes)
features = features_of(states)
distinct, first, inverse = np.unique(states.column("state_id").to_pylist(), return_index=True, return_inverse=True)
occurrences = np.bincount(inverse)
own_return = states.column("own_return").to_numpy()
own_sum, own_n = np.bincount(inverse, weights=own_return), occurrences.astype(np.float64)
segment_idx = states.column("segment_idx").to_numpy()[first]
task_of = dict(zip(episodes.column("episode_id").to_pylist(), episodes.column("task_id").to_pylist(), strict=True))
task_of_state = [task_of[e] for e in np.array(states.column("episode_id").to_pylist(), dtype=object)[first]]
say("segment", states=states.num_rows, distinct_states=len(distinct), mean_segments=states.num_rows / len(main))

# Cross-fitting (tasks/fit_critic.py): a task's states get their value from critics fitted on the other folds.
task_names = sorted(set(task_of_state))
fold_of_task = {t: r % min(cfg.critic.folds, len(task_names))
                for r, t in zip(rng.permutation(len(task_names)), task_names, strict=True)}
fold = np.array([fold_of_task[t] for t in task_of_state])
branch_parts, critic, fold_critics = [], None, {}
branch_sum, branch_n = np.zeros(len(distinct)), np.zeros(len(distinct))  # returns of continuations per state


def fit(keep: np.ndarray) -> EnsembleCritic:
    model = EnsembleCritic(cfg.critic, features.shape[1])
    model.fit(features[first][keep], (own_sum + branch_sum)[keep], (own_n + branch_n)[keep])
    return model


# --- 3. rounds: acquire -> branch -> fit_critic ---------------------------------------------------------------
for r in range(cfg.acquisition.rounds):
    acquisition = cfg.acquisition
    if critic is None and acquisition.strategy not in CRITIC_FREE_STRATEGIES:  # no critic yet: uniform draws
        acquisition = acquisition.model_copy(update={"strategy": "uniform_random"})
    members = critic.predict_members(features[first]) if critic else np.full((2, len(distinct)), 0.5)
    remaining = states.column("remaining_generated_tokens").to_numpy().astype(np.float64)
    already = own_n + branch_n
    candidates = Candidates(
        member_predictions=members, cost=np.maximum(1.0, np.bincount(inverse, weights=remaining) / occurrences),
        weight=advantage_sensitivity(segment_idx, gamma=cfg.advantage.gamma, lam=cfg.advantage.lam) * occurrences,
        already=already.astype(np.int64), unseen=np.zeros(len(distinct), np.int64) if critic else
        already.astype(np.int64), features=features[first], return_sum=own_sum + branch_sum, return_count=already)
    round_budget = ledger.remaining / (cfg.acquisition.rounds - r)  # this round's share of what is left
    plan = allocate(candidates, Request(round_budget, acquisition, seed=cfg.seed + r))
    say(f"acquire_r{r}", strategy=acquisition.strategy, candidates=len(distinct), chosen_states=int(
        (plan.counts > 0).sum()), continuations=int(plan.counts.sum()), planned_tokens=round(plan.estimated_tokens))
    # branch: rebuild each chosen state from the stored rows and continue it with the policy
    picked = [(s, k) for s, n in zip(distinct, plan.counts, strict=True) for k in range(int(n))]
    starts = segment_starts([s for s, _ in picked], rollouts=rollouts, episodes=episodes,
                            tasks_by_id={t.task_id: t for t in train}, system_prompt=env.system_prompt())
    spent = ledger.spent
    grown = runner.run(starts=starts, seed=cfg.seed + 100 + r, ledger=ledger, kind="branch", round_idx=r)
    branch_parts.append(episode_tables(
        grown, run_id=RUN, iteration=0, policy_version=policy.version,
        episode_ids=[episode_id(RUN, 0, s.task.task_id, "branch", s.state_id, r, k)
                     for s, (_, k) in zip(starts, picked, strict=True)],
        group_ids=[content_id(RUN, 0, s.state_id, "branches") for s in starts],
        branch_ids=[branch_id(s, r, k) for s, k in picked]))
    for (s, _), e in zip(picked, grown, strict=True):
        if not e.budget_cut:  # a cut continuation's 0 is not the policy's doing
            branch_sum[np.searchsorted(distinct, s)] += e.reward
            branch_n[np.searchsorted(distinct, s)] += 1
    say(f"branch_r{r}", states_branched=len({s for s, _ in picked}), continuations=len(grown),
        tokens_spent=ledger.spent - spent, mean_return=float(np.mean([e.reward for e in grown] or [0.0])),
        budget_cut=sum(e.budget_cut for e in grown))
    # fit_critic: one critic per fold (for the values) and a full one (for the next acquisition round)
    prior_mean, prior_var = np.full(len(distinct), 0.5), np.full(len(distinct), 0.25)
    for k in np.unique(fold):
        fold_critics[k] = fit(fold != k)
        prior_mean[fold == k], prior_var[fold == k] = fold_critics[k].predict(features[first][fold == k])
    critic = fit(np.ones(len(distinct), dtype=bool))
    branched = branch_n > 0
    mae = float(np.abs(prior_mean - branch_sum / np.maximum(branch_n, 1))[branched].mean()) if branched.any() else 0.0
    say(f"critic_r{r}", members=cfg.critic.members, fitted_states=int((own_n + branch_n > 0).sum()),
        returns=int((own_n + branch_n).sum()), oof_critic_vs_mc_mae=mae)

# --- 4. advantage: values for every segment, then segment TD(lambda) ------------------------------------------
prior_var = np.maximum(prior_var, cfg.acquisition.jitter)
# Main rows: out-of-fold prior combined with the state's returns other than the row's own (leave one out).
n_other = (own_n + branch_n)[inverse] - 1
mc = np.divide((own_sum + branch_sum)[inverse] - own_return, n_other, out=np.full(len(n_other), np.nan),
               where=n_other > 0)
main_value, _ = combine_estimates(prior_mean[inverse], prior_var[inverse], mc, n_other)
value_of = dict(zip(keys(states), main_value, strict=True))
# Continuations train too (ppo.train_on_continuations, FOCUS's preset); their values: continuations.py.
b_rollouts, b_episodes = (pa.concat_tables([p[i] for p in branch_parts]) for i in (0, 1))
b_states = ordered(states_table(b_rollouts, b_episodes))
eps = np.array(b_states.column("episode_id").to_pylist(), dtype=object)
heads = np.flatnonzero(np.r_[True, eps[1:] != eps[:-1]])  # each continuation's first segment: its parent state
row_of = {e: i for i, e in enumerate(b_episodes.column("episode_id").to_pylist())}
head_rows = [row_of[e] for e in eps[heads]]
parent = np.array(b_episodes.column("parent_state_id").to_pylist(), dtype=object)[head_rows]
later = np.full(len(eps), np.nan)  # V at a continuation's later states: the fold critic that did not see its task
rest = np.setdiff1d(np.arange(len(eps)), heads)
if rest.size:
    rest_features = features_of(b_states.take(rest))
    b_task = b_episodes.column("task_id").to_pylist()
    rest_fold = np.array([fold_of_task[b_task[row_of[e]]] for e in eps[rest]])
    for k, model in fold_critics.items():
        if (rest_fold == k).any():
            later[rest[rest_fold == k]] = model.predict(rest_features[rest_fold == k])[0]
seen = observed_returns(states, episodes, b_episodes)  # per state: sum and number of returns seen there
at_parent = np.searchsorted(distinct, parent)
b_value = continuation_values(
    b_states.column("segment_reward").to_numpy(), np.diff(np.r_[heads, len(eps)]),
    prior_mean=prior_mean[at_parent], prior_var=prior_var[at_parent],
    return_sum=np.array([seen[p][0] for p in parent]), return_n=np.array([seen[p][1] for p in parent], np.float64),
    own_return=b_episodes.column("reward").to_numpy()[head_rows],
    counted=~np.array(b_episodes.column("budget_cut").to_pylist())[head_rows], later=later)
value_of |= dict(zip(keys(b_states), b_value, strict=True))
# The ragged batch the estimators take: episodes contiguous, segments in order.
segs = ordered(pa.concat_tables([states, b_states]))
both = pa.concat_tables([episodes, b_episodes])
ep = np.array(segs.column("episode_id").to_pylist(), dtype=object)
first_segment = np.flatnonzero(np.r_[True, ep[1:] != ep[:-1]])
ids = ep[first_segment]
info = {c: dict(zip(both.column("episode_id").to_pylist(), both.column(c).to_pylist(), strict=True))
        for c in ("reward", "group_id")}
result = get_advantage_estimator(cfg.advantage.estimator)(AdvantageBatch(
    rewards=segs.column("segment_reward").to_numpy(), lengths=np.diff(np.r_[first_segment, len(ep)]),
    outcomes=np.array([info["reward"][e] for e in ids], np.float64),
    groups=np.array([info["group_id"][e] for e in ids], dtype=object),
    values=np.array([value_of[key] for key in keys(segs)]),
    segment_tokens=segs.column("segment_generated_tokens").to_numpy()), cfg.advantage)
advantage_of = dict(zip(keys(segs), result.advantage, strict=True))
say("advantage", estimator=cfg.advantage.estimator, gamma=cfg.advantage.gamma, lam=cfg.advantage.lam, segments=len(ep),
    continuation_segments=b_states.num_rows, mean_advantage=float(result.advantage.mean()),
    std_advantage=float(result.advantage.std()))
# --- 5. update: PPO-clip on every policy token, each with its segment's (whitened) advantage ------------------
sequences, part = update_sequences([(rollouts, episodes), (b_rollouts, b_episodes)])
token_adv = [np.where(q.loss_mask > 0, advantage_of[(q.episode_id, q.segment_idx)], 0.0) for q in sequences]
if cfg.advantage.whiten:
    flat = whiten(np.concatenate(token_adv), np.concatenate([q.loss_mask for q in sequences]))
    token_adv = np.split(flat, np.cumsum([len(a) for a in token_adv])[:-1])
report = policy_update(policy.model, sequences, token_adv, cfg.ppo, seed=cfg.seed, temperature=cfg.agent.temperature)
policy.version += 1
say("update", steps=len(report.rows), sequences=report.sequences, policy_tokens=report.policy_tokens,
    main_sequences=int((part == 0).sum()), loss=float(np.mean([row["loss"] for row in report.rows])),
    clip_fraction=report.clip_fraction, approx_kl=report.approx_kl)
say("evaluate", heldout_exact_before=before, heldout_exact_after=exact_success(policy),
    tokens_spent=ledger.spent, budget=budget)
