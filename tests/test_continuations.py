"""Continuations as training data: their tokens train once, with their own advantages; worked examples of
their values (leave-one-out parent value, critic at their own states, VinePPO's fill) and TD(λ) advantages."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_core.acquisition import combine_estimates
from focus_core.advantages import AdvantageBatch, get_advantage_estimator
from focus_core.agent.harness import AgentEpisode, SegmentStart, TurnRecord
from focus_core.config import AdvantageConfig
from focus_core.continuations import continuation_values, observed_returns, update_sequences
from focus_core.envs.base import Task
from focus_core.ids import branch_id, episode_id
from focus_core.rollouts import episode_tables, states_table, token_advantages, training_sequences

RUN = "run-c"
TASK = Task("task-c", "synthetic", "train", "default", "Solve it.", "x", "x")
SYSTEM = "You are an agent."


def start(segment: int, context: list[int], calls: tuple[str, ...] = ()) -> SegmentStart:
    messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{TASK.prompt} {context}"})
    return SegmentStart(TASK, segment, 0, 0, messages, tuple(context), calls)


def turn(role: str, ids: list[int], segment: int, turn_idx: int) -> TurnRecord:
    generated = role in ("policy", "summary")
    return TurnRecord(role, role, ids, [-0.5 if generated else 0.0] * len(ids), [int(generated)] * len(ids),
                      segment, turn_idx)


def episode(starts: list[SegmentStart], body: dict[int, list[tuple[str, list[int]]]], *, reward: float,
            parent: SegmentStart | None = None, cut: bool = False) -> AgentEpisode:
    """An episode of the given segment starts: each segment is its context row, then ``body[segment]`` (a tool
    row counts one tool call, as the harness's ``turn_idx`` does)."""
    e = AgentEpisode(task=TASK, reward=reward, parent_state=parent, budget_cut=cut, truncated=cut)
    calls = 0
    for s in starts:
        e.starts.append(s)
        e.turns.append(turn("context", list(s.context_ids), s.segment_idx, calls))
        for role, ids in body.get(s.segment_idx, []):
            calls += role == "tool"
            e.turns.append(turn(role, ids, s.segment_idx, calls))
    return e


@pytest.fixture(scope="module")
def tree():
    """One main episode of two segments; from its s_0 a continuation of two segments of its own (s_0 and a
    new s'_1), and from its s_1 a continuation the budget cut after one token."""
    s0, s1 = start(0, [1, 2, 3]), start(1, [1, 2, 6], ("a",))
    main = episode([s0, s1], {0: [("policy", [10, 11]), ("tool", [4, 5])],
                              1: [("policy", [12, 13, 14]), ("tool", [7])]}, reward=1.0)
    c1 = start(1, [1, 2, 9], ("b",))
    grown = episode([s0, c1], {0: [("policy", [20, 21, 22]), ("tool", [8])], 1: [("policy", [23]), ("tool", [5])]},
                    reward=0.0, parent=s0)
    cut = episode([s1], {1: [("policy", [30])]}, reward=0.0, parent=s1, cut=True)
    main_id = episode_id(RUN, 0, TASK.task_id, "main", 0)
    main_tables = episode_tables([main], run_id=RUN, iteration=0, policy_version=0, episode_ids=[main_id],
                                 group_ids=["g"])
    ids = [episode_id(RUN, 0, TASK.task_id, "branch", s.state_id, 0, 0) for s in (s0, s1)]
    branch_tables = episode_tables([grown, cut], run_id=RUN, iteration=0, policy_version=0, episode_ids=ids,
                                   group_ids=[s0.state_id, s1.state_id],
                                   branch_ids=[branch_id(s.state_id, 0, 0) for s in (s0, s1)])
    return {"main": main_tables, "branches": branch_tables, "ids": [main_id, *ids], "episodes": [main, grown, cut]}


def test_continuation_tokens_train_once_with_their_own_advantages(tree):
    main_id, grown_id, cut_id = tree["ids"]
    sequences, part = update_sequences([tree["main"], tree["branches"]])
    assert [(q.episode_id, q.segment_idx) for q in sequences] == [(main_id, 0), (main_id, 1), (grown_id, 0),
                                                                   (grown_id, 1)]  # the cut continuation is out
    assert part.tolist() == [0, 0, 1, 1]
    by_key = {(q.episode_id, q.segment_idx): q for q in sequences}
    # The continuation's first sequence opens with its parent's context — the same ids as the main episode's
    # segment 0 — as a prompt (loss mask 0); only the tokens it generated are trained.
    parent, own = by_key[(main_id, 0)], by_key[(grown_id, 0)]
    assert own.token_ids[:3].tolist() == parent.token_ids[:3].tolist() == [1, 2, 3]
    assert own.loss_mask[:3].tolist() == parent.loss_mask[:3].tolist() == [0, 0, 0]
    trained = [q.token_ids[q.loss_mask == 1].tolist() for q in sequences]
    assert trained == [[10, 11], [12, 13, 14], [20, 21, 22], [23]]
    # Every generated token of the kept episodes is trained exactly once.
    main, grown, _ = tree["episodes"]
    assert sum(q.generated_tokens for q in sequences) == main.generated_tokens + grown.generated_tokens == 9
    # Each segment's advantage lands on its own policy tokens.
    states = pa.concat_tables([states_table(*tree["main"]), states_table(*tree["branches"])])
    advantage = {(main_id, 0): 0.1, (main_id, 1): 0.2, (grown_id, 0): -0.3, (grown_id, 1): 0.4, (cut_id, 1): 0.0}
    keys = list(zip(states.column("episode_id").to_pylist(), states.column("segment_idx").to_pylist(), strict=True))
    values = np.array([advantage[k] for k in keys])
    table = pa.table({**{c: states.column(c) for c in ("run_id", "iteration", "episode_id", "segment_idx", "state_id",
                                                       "policy_version")},
                      "reward": states.column("segment_reward"), "value": values * 0, "next_value": values * 0,
                      "delta": values, "advantage": values, "lambda_return": values})
    per_token = token_advantages(sequences, table)
    assert [a[q.loss_mask == 1].tolist() for q, a in zip(sequences, per_token, strict=True)] == [
        [0.1] * 2, [0.2] * 3, [-0.3] * 3, [0.4]]


def test_without_continuations_the_update_trains_the_main_episodes_as_before(tree):
    rollouts, episodes = tree["main"]
    sequences, part = update_sequences([tree["main"]])
    before = training_sequences(rollouts, episode_ids=[e for e, c in zip(episodes.column("episode_id").to_pylist(),
                                                                           episodes.column("budget_cut").to_pylist(),
                                                                           strict=True) if not c])
    assert part.tolist() == [0, 0] and len(sequences) == len(before)
    for q, r in zip(sequences, before, strict=True):
        assert (q.episode_id, q.segment_idx, q.state_id) == (r.episode_id, r.segment_idx, r.state_id)
        for name in ("token_ids", "old_logprobs", "loss_mask"):
            np.testing.assert_array_equal(getattr(q, name), getattr(r, name))
    nothing, parts = update_sequences([])
    assert nothing == [] and parts.size == 0


def test_observed_returns_count_every_uncut_return_at_a_state():
    main_states = pa.table({"state_id": ["s0", "s1", "s0", "s1", "s0"], "episode_id": ["a", "a", "b", "b", "x"],
                            "own_return": [1.0, 1.0, 0.0, 0.0, 1.0]})
    main_episodes = pa.table({"episode_id": ["a", "b", "x"], "budget_cut": [False, False, True]})
    continuations = pa.table({"parent_state_id": ["s0", "s0", "s1"], "reward": [1.0, 0.0, 1.0],
                              "budget_cut": [False, False, True]})
    # s0: mains a (1), b (0) and continuations 1, 0; main x was cut. s1: mains a, b; its continuation was cut.
    assert observed_returns(main_states, main_episodes, continuations) == {"s0": (2.0, 4), "s1": (1.0, 2)}


def test_worked_example_continuation_advantages():
    """A continuation from s_1 of three segments (s_1, s'_2, s'_3), rewards (0, 0, 1), γ = 0.9, λ = 0.5.

    At s_1: critic prior 0.5 ± 0.05 (precision 20); returns observed there Σ = 2 of n = 4, the continuation's
    own 1 among them, so leave-one-out ȳ' = 1/3 of n' = 3 (precision 3 / (0.5·0.5) = 12):
    V̂(s_1) = (0.5·20 + (1/3)·12) / 32 = 0.4375. The critic gives V̂(s'_2) = 0.6, V̂(s'_3) = 0.8, V̂(end) = 0.

        δ_3 = 1 − 0.8 = 0.2                    A_3 = 0.2
        δ_2 = 0.9·0.8 − 0.6 = 0.12              A_2 = 0.12 + 0.45·0.2 = 0.21
        δ_1 = 0.9·0.6 − 0.4375 = 0.1025         A_1 = 0.1025 + 0.45·0.21 = 0.197
    """
    rewards, lengths = np.array([0.0, 0.0, 1.0]), np.array([3])
    values = continuation_values(rewards, lengths, prior_mean=[0.5], prior_var=[0.05], return_sum=[2.0],
                                 return_n=[4], own_return=[1.0], counted=[True], later=[np.nan, 0.6, 0.8])
    np.testing.assert_allclose(values, [0.4375, 0.6, 0.8])
    batch = AdvantageBatch(rewards=rewards, lengths=lengths, outcomes=np.array([1.0]), groups=np.array(["g"]),
                           values=values, segment_tokens=np.array([3, 2, 4]))
    result = get_advantage_estimator("segment_td_lambda")(batch, AdvantageConfig(gamma=0.9, lam=0.5))
    np.testing.assert_allclose(result.advantage, [0.197, 0.21, 0.2])
    np.testing.assert_allclose(result.next_value, [0.6, 0.8, 0.0])


def test_worked_example_values_without_a_critic_and_cut_continuations():
    """VinePPO (no prior, no critic at later states), three continuations of two segments, rewards (0, R):

    * R = 0 from a state with Σ = 2, n = 4: ȳ' = 2/3; V̂(s'_2) = r_2 + 0 = 0 (δ_2 = 0 there).
    * cut (R = 0, not counted): its return is not among the four, so ȳ' = 2/4 = 0.5.
    * R = 1 from a state where it is the only return: no other return, so V̂(s_1) = r_1 + V̂(s'_2) = 0 + 1.
    """
    values = continuation_values(np.array([0.0, 0.0, 0.0, 0.0, 0.0, 1.0]), np.array([2, 2, 2]),
                                 prior_mean=[np.nan] * 3, prior_var=[np.nan] * 3, return_sum=[2.0, 2.0, 1.0],
                                 return_n=[4, 4, 1], own_return=[0.0, 0.0, 1.0], counted=[True, False, True],
                                 later=[np.nan] * 6)
    np.testing.assert_allclose(values, [2 / 3, 0.0, 0.5, 0.0, 1.0, 1.0])
    # With a prior and n' = 0 the value is the prior (combine_estimates ignores the missing mean).
    alone = continuation_values(np.array([1.0]), np.array([1]), prior_mean=[0.3], prior_var=[0.01], return_sum=[1.0],
                                return_n=[1], own_return=[1.0], counted=[True], later=[np.nan])
    np.testing.assert_allclose(alone, [0.3])
    with pytest.raises(ValueError, match="own return is missing"):
        continuation_values(np.array([1.0]), np.array([1]), prior_mean=[0.3], prior_var=[0.01], return_sum=[0.0],
                            return_n=[0], own_return=[1.0], counted=[True], later=[np.nan])


@st.composite
def continuation_batch(draw):
    b = draw(st.integers(1, 6))
    lengths = np.array(draw(st.lists(st.integers(1, 4), min_size=b, max_size=b)))
    n = int(lengths.sum())
    unit = st.floats(0.0, 1.0)
    counted = np.array(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
    own = np.array(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=b, max_size=b)))
    return_n = np.array(draw(st.lists(st.integers(0, 6), min_size=b, max_size=b))) + counted
    return_sum = np.minimum(np.array(draw(st.lists(unit, min_size=b, max_size=b))) * return_n, return_n - counted
                            ) + own * counted
    return dict(rewards=np.array(draw(st.lists(unit, min_size=n, max_size=n))), lengths=lengths,
                prior_mean=np.array(draw(st.lists(st.floats(0.05, 0.95), min_size=b, max_size=b))),
                prior_var=np.array(draw(st.lists(st.floats(0.001, 0.25), min_size=b, max_size=b))),
                return_sum=return_sum, return_n=return_n, own_return=own, counted=counted,
                later=np.array(draw(st.lists(unit, min_size=n, max_size=n))))


@settings(max_examples=80, deadline=None)
@given(continuation_batch())
def test_batch_values_equal_one_continuation_at_a_time(batch):
    values = continuation_values(**batch)
    start = 0
    for j, length in enumerate(batch["lengths"]):
        others = batch["return_n"][j] - batch["counted"][j]
        mean = (batch["return_sum"][j] - batch["counted"][j] * batch["own_return"][j]) / others if others else 0.0
        first = combine_estimates(batch["prior_mean"][j:j + 1], batch["prior_var"][j:j + 1], np.array([mean]),
                                  np.array([others]))[0][0]
        expected = [first, *batch["later"][start + 1:start + length]]
        np.testing.assert_allclose(values[start:start + length], expected, rtol=1e-12, atol=1e-12)
        start += length
