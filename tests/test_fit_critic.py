"""Stage fit_critic on a real local store: the value a segment's advantage uses never sees its own episode's
return (cross-fitting over tasks or over episodes, leave-one-out Monte-Carlo means), and VinePPO's values follow the
paper."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from focus_core.artifacts import ArtifactStore
from focus_core.config import load_config
from focus_core.schemas import schema_for
from tasks import fit_critic
from tasks.stage import RunContext

TASKS, GROUP, SEGMENTS, FEATURES = 6, 2, 2, 5


def _commit_iteration(store: ArtifactStore, run: str, rewards: np.ndarray):
    """A rollout and segment manifest: TASKS tasks × GROUP episodes × SEGMENTS segments; s_0 is shared per task."""
    rng = np.random.default_rng(0)
    features = {f"t{t}-s0": rng.normal(size=FEATURES) for t in range(TASKS)}
    episodes, states = [], []
    for t in range(TASKS):
        for g in range(GROUP):
            episode, reward = f"t{t}-e{g}", float(rewards[t * GROUP + g])
            episodes.append({"run_id": run, "iteration": 0, "episode_id": episode, "branch_id": None,
                             "policy_version": 0, "task_id": f"task-{t}", "split": "train", "group_id": f"g{t}",
                             "reward": reward, "n_turns": 4, "n_segments": SEGMENTS, "generated_tokens": 20,
                             "is_branch": False, "parent_state_id": None, "truncated": False, "budget_cut": False})
            for k in range(SEGMENTS):
                state = f"t{t}-s0" if k == 0 else f"{episode}-s{k}"
                features.setdefault(state, rng.normal(size=FEATURES))
                states.append({"run_id": run, "iteration": 0, "episode_id": episode, "segment_idx": k,
                               "state_id": state, "branch_id": None, "policy_version": 0, "context_token_ids": [1, 2],
                               "remaining_generated_tokens": 20 - 10 * k, "own_return": reward,
                               "segment_reward": reward if k == SEGMENTS - 1 else 0.0,
                               "segment_generated_tokens": 10, "features": features[state].astype(np.float32).tolist()})
    rollout = store.commit(run, 0, "rollout", version="v", tables={
        "episodes": pa.Table.from_pylist(episodes, schema=schema_for("episodes"))})
    segment = store.commit(run, 0, "segment", version="v", tables={
        "states": pa.Table.from_pylist(states, schema=schema_for("states"))}, policy_version=0)
    return rollout, segment


def _values(tmp_path, method: str, rewards: np.ndarray, run: str, fold_unit: str = "task",
            column: str = "value") -> dict[tuple[str, int], float]:
    store = ArtifactStore(tmp_path / "store")
    rollout, segment = _commit_iteration(store, run, rewards)
    overrides = [f"method={method}"] + ([*CRITIC, f"critic.fold_unit={fold_unit}"] if method == "focus" else [])
    ctx = RunContext(store, run, load_config(None, overrides), tokens_per_iteration=1000)
    result = fit_critic.compute(ctx, 0, 0, segment, rollout, [], [], tmp_path)
    table = result.tables["values"]
    return {(e, k): v for e, k, v in zip(*(table.column(c).to_pylist() for c in ("episode_id", "segment_idx", column)),
                                         strict=True)}


CRITIC = ["critic.steps=50", "critic.hidden=8", "critic.folds=3"]


@pytest.mark.parametrize(("method", "fold_unit"), [("focus", "task"), ("focus", "episode"), ("vineppo", "task")])
def test_a_segments_value_never_sees_its_own_episodes_return(tmp_path, method, fold_unit):
    rewards = np.random.default_rng(1).integers(0, 2, size=TASKS * GROUP).astype(float)
    flipped = rewards.copy()
    flipped[0] = 1.0 - flipped[0]  # episode t0-e0's outcome changes, nothing else
    before = _values(tmp_path / "a", method, rewards, "a", fold_unit)
    after = _values(tmp_path / "b", method, flipped, "b", fold_unit)
    # Its own first-segment value is unchanged (the last segment of VinePPO without returns is r + 0, which is
    # the outcome itself by the paper's rule, not a baseline estimate, so only s_0 is checked there).
    assert after[("t0-e0", 0)] == pytest.approx(before[("t0-e0", 0)], abs=1e-12)
    if method == "focus":
        assert after[("t0-e0", 1)] == pytest.approx(before[("t0-e0", 1)], abs=1e-12)
    # ... while the other episode at the same s_0 does see it (its leave-one-out Monte-Carlo sample), so the
    # test would fail if values ignored returns altogether.
    assert after[("t0-e1", 0)] != pytest.approx(before[("t0-e1", 0)], abs=1e-6)


def test_vineppo_pools_s0_over_the_group_and_fills_states_without_returns(tmp_path):
    rewards = np.array([1.0, 0.0] * TASKS)
    values = _values(tmp_path, "vineppo", rewards, "v")
    # s_0 of task 0: the other episode's return (leave-one-out over the group of 2).
    assert values[("t0-e0", 0)] == 0.0 and values[("t0-e1", 0)] == 1.0
    # s_1 has no returns: V = r_1 + V(after the end) = the episode's outcome, so δ_1 = 0.
    assert values[("t0-e0", 1)] == 1.0 and values[("t0-e1", 1)] == 0.0


def test_episode_folds_let_a_states_critic_learn_from_the_other_episodes_of_its_task(tmp_path):
    """The point of critic.fold_unit: episode. With folds of tasks the critic prior of an episode never sees any
    return of its task, so it cannot learn how hard the task is; with folds of episodes it sees its siblings'."""
    seed = fit_critic.derive_seed(load_config(None, []).seed, 0, fit_critic.stage_name(0), "folds")
    # A task whose two episodes fall in different folds (the premise; the fold is a seeded hash of the id).
    t = next(t for t in range(TASKS) if fit_critic.episode_fold(f"t{t}-e0", 3, seed)
             != fit_critic.episode_fold(f"t{t}-e1", 3, seed))
    rewards = np.random.default_rng(1).integers(0, 2, size=TASKS * GROUP).astype(float)
    flipped = rewards.copy()
    flipped[t * GROUP + 1] = 1.0 - flipped[t * GROUP + 1]  # episode e0's sibling e1 changes, nothing else
    prior = {(unit, name): _values(tmp_path / f"{unit}-{name}", "focus", r, name, unit, "critic_mean")
             for unit in ("task", "episode") for name, r in (("a", rewards), ("b", flipped))}
    key = (f"t{t}-e0", 0)
    assert prior[("task", "a")][key] == pytest.approx(prior[("task", "b")][key], abs=1e-12)
    assert prior[("episode", "a")][key] != pytest.approx(prior[("episode", "b")][key], abs=1e-6)


def test_cross_fitting_folds_are_tasks(tmp_path):
    folds = fit_critic.task_folds([f"task-{t % 5}" for t in range(20)], 3, seed=4)
    assert set(folds) == {f"task-{t}" for t in range(5)} and set(folds.values()) == {0, 1, 2}
    assert fit_critic.task_folds(["a", "b"], 4, seed=0).keys() == {"a", "b"}  # never more folds than tasks


@pytest.mark.parametrize("fold_unit", ["task", "episode"])
def test_fold_critics_value_a_tasks_new_states_without_its_returns(tmp_path, fold_unit):
    """A continuation's later states are valued by the fold critic of its task (or of its own episode), which never
    saw that task's returns (its own included); the full ensemble, which acquisition reads, did see them.
    Regression: later states used the full ensemble, so a continuation's baseline had been fitted on its own
    return."""
    rewards = np.random.default_rng(1).integers(0, 2, size=TASKS * GROUP).astype(float)
    flipped = rewards.copy()
    # Task 0's outcomes change (with folds of episodes, only t0-e0's: its siblings are other folds' returns).
    flipped[:GROUP if fold_unit == "task" else 1] = 1.0 - flipped[:GROUP if fold_unit == "task" else 1]
    new_states = np.random.default_rng(7).normal(size=(3, FEATURES)).astype(np.float32)
    seen = {}
    for name, r in (("a", rewards), ("b", flipped)):
        store = ArtifactStore(tmp_path / name)
        rollout, segment = _commit_iteration(store, name, r)
        ctx = RunContext(store, name, load_config(None, [*CRITIC, f"critic.fold_unit={fold_unit}"]),
                         tokens_per_iteration=1000)
        result = fit_critic.compute(ctx, 0, 0, segment, rollout, [], [], tmp_path / f"scratch-{name}")
        values = store.commit(name, 0, "fit_critic_r0", version="v", tables=result.tables, folders=result.folders,
                              policy_version=0)
        # The new states of an episode of task 0 (t0-e0 itself: what its fold critic saw is what matters) and of an
        # episode of another fold.
        episodes = [f"t{t}-e{g}" for t in range(TASKS) for g in range(GROUP)]
        fold = {e: f for e, f in zip(episodes, fit_critic.return_folds(
            ctx, 0, [e.split("-")[0].replace("t", "task-") for e in episodes], episodes,
            [f"task-{t}" for t in range(TASKS)]), strict=True)}
        other = next(e for e in episodes if fold[e] != fold["t0-e0"])
        seen[name] = (fit_critic.out_of_fold_values(ctx, values, ["task-0"] * 3, ["t0-e0"] * 3, new_states),
                      fit_critic.out_of_fold_values(ctx, values, [other.split("-")[0].replace("t", "task-")] * 3,
                                                    [other] * 3, new_states))
    assert seen["a"][0] == pytest.approx(seen["b"][0], abs=1e-12)  # task 0's fold critic never saw task 0
    # ... and a task in another fold is valued by a critic that did see task 0, so flipping it shows (the test
    # would pass trivially if the fold critics ignored returns).
    assert seen["a"][1] != pytest.approx(seen["b"][1], abs=1e-6)
