"""Episodes <-> artifact tables: real harness episodes (main, branches, branches of branches) round-trip
through rollouts/episodes/states, rebuilt starts continue exactly like the originals, and training
sequences are the stored turns; synthetic episodes of random shape check the reward and token bookkeeping."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_core.agent.harness import AgentEpisode, AgentRunner, SegmentStart, TurnRecord
from focus_core.agent.scripted import ScriptedActor
from focus_core.config import AgentConfig
from focus_core.envs.base import Task
from focus_core.ids import branch_id, content_id, episode_id
from focus_core.policy.models import tiny_policy
from focus_core.policy.tokenizer import train_tokenizer
from focus_core.rollouts import (
    SegmentSequence,
    episode_tables,
    segment_starts,
    states_table,
    token_advantages,
    training_sequences,
)
from focus_core.schemas import validate_table
from tests.test_agent_harness import LookupEnv

RUN, ITERATION, VERSION = "run-test", 3, 7
SYSTEM = LookupEnv().system_prompt()
TASKS = {task.task_id: task for task in LookupEnv().tasks("train")}
CONFIG = AgentConfig(max_turns=4, max_action_tokens=8, max_summary_tokens=8, compress_every_turns=1)


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [SYSTEM, 'look(key="alpha") answer(text="42") see card beta value 17 42 8 Wrong. Correct.']
    return train_tokenizer(corpus * 5, vocab_size=400)


@pytest.fixture(scope="module")
def runner(tokenizer):
    policy = tiny_policy(tokenizer, layers=1, hidden=32, heads=2, intermediate=64, max_context=1024)
    return AgentRunner(policy, LookupEnv, CONFIG)


@pytest.fixture(scope="module")
def recorded(runner, tokenizer):
    """Main episodes (two per task from the policy, plus expert episodes with mistakes for non-zero
    rewards), two branches from each of two states, and a branch from a state inside a branch."""
    tasks = list(TASKS.values())
    mains = runner.run([t for t in tasks for _ in range(2)], seed=1)
    expert = ScriptedActor(tokenizer, tokenizer.convert_tokens_to_ids("<|end|>"), mistake_rate=0.4, seed=2)
    mains += AgentRunner(expert, LookupEnv, AgentConfig(max_turns=5, compress_every_turns=1)).run(tasks * 2)
    assert {e.reward for e in mains} == {0.0, 1.0}
    chosen = [mains[0].starts[1], mains[2].starts[2]]
    round0 = runner.run(starts=[s for s in chosen for _ in range(2)], seed=2)
    round1 = runner.run(starts=[round0[0].starts[1]], seed=3)
    branches = [(b, 0, i % 2) for i, b in enumerate(round0)] + [(round1[0], 1, 0)]
    assert all(b.n_segments >= 2 for b, _, _ in branches)
    return mains, branches


def make_tables(mains, branches):
    episodes = [*mains, *(b for b, _, _ in branches)]
    ids = [episode_id(RUN, ITERATION, e.task.task_id, "main", i) for i, e in enumerate(mains)]
    ids += [episode_id(RUN, ITERATION, b.task.task_id, "branch", b.parent_state.state_id, r, i)
            for b, r, i in branches]
    bids = [None] * len(mains) + [branch_id(b.parent_state.state_id, r, i) for b, r, i in branches]
    groups = [e.task.task_id for e in mains] + [b.parent_state.state_id for b, _, _ in branches]
    rollouts, table = episode_tables(episodes, run_id=RUN, iteration=ITERATION, policy_version=VERSION,
                                     episode_ids=ids, group_ids=groups, branch_ids=bids)
    return episodes, ids, rollouts, table


@pytest.fixture(scope="module")
def tables(recorded):
    return make_tables(*recorded)


# --- ids -------------------------------------------------------------------------------------------------


def test_ids_are_pinned_stable_and_distinct():
    # Pinned: a resumed run must reproduce these; changing the scheme orphans every stored artifact.
    assert episode_id("run", 0, "t0", "main", 1) == content_id("episode", "run", 0, "t0", "main", [1])
    assert branch_id("abc", 1, 2) == content_id("branch", "abc", 1, 2)
    assert episode_id("run", 0, "t0", "main", 1) == "8e7d45192ba77753"
    assert branch_id("abc", 1, 2) == "a1b5bcc2d2fe86a0"
    assert episode_id("run", np.int64(0), "t0", "main", 1) == episode_id("run", 0, "t0", "main", 1)
    episodes = {episode_id(run, it, task, kind, *keys) for run in ("r1", "r2") for it in (0, 1)
                for task in ("t0", "t1") for kind in ("main", "branch") for keys in ((), (0,), (1,), (0, 1), ("01",))}
    assert len(episodes) == 2 * 2 * 2 * 2 * 5
    branches = {branch_id(state, r, i) for state in ("s0", "s1") for r in range(3) for i in range(3)}
    assert len(branches) == 18 and not branches & episodes


# --- episodes -> tables ----------------------------------------------------------------------------------


def test_tables_validate_and_hold_every_turn(tables):
    episodes, ids, rollouts, table = tables
    assert validate_table("rollouts", rollouts).equals(rollouts)
    assert validate_table("episodes", table).equals(table)
    assert rollouts.num_rows == sum(len(e.turns) for e in episodes) and table.num_rows == len(episodes)
    rows = rollouts.to_pylist()
    for episode, eid in zip(episodes, ids, strict=True):
        mine = [r for r in rows if r["episode_id"] == eid]
        bid = mine[0]["branch_id"]
        assert (bid is None) == (episode.parent_state is None) and all(r["branch_id"] == bid for r in mine)
        assert all(r["run_id"] == RUN and r["iteration"] == ITERATION and r["policy_version"] == VERSION
                   for r in mine)
        first_segment = episode.starts[0].segment_idx
        for row, turn in zip(mine, episode.turns, strict=True):
            assert (row["role"], row["text"], row["token_ids"], row["loss_mask"], row["segment_idx"],
                    row["turn_idx"], row["is_compression"], row["generated_tokens"]) == (
                turn.role, turn.text, turn.token_ids, turn.loss_mask, turn.segment_idx, turn.turn_idx,
                turn.is_compression, turn.generated_tokens)
            np.testing.assert_array_equal(np.float32(row["logprobs"]), np.float32(turn.logprobs))
            assert row["state_id"] == episode.starts[turn.segment_idx - first_segment].state_id
    for row, episode in zip(table.to_pylist(), episodes, strict=True):
        assert row["is_branch"] == (episode.parent_state is not None) == (row["branch_id"] is not None)
        assert row["parent_state_id"] == (episode.parent_state.state_id if episode.parent_state else None)
        assert (row["reward"], row["n_turns"], row["n_segments"], row["generated_tokens"], row["truncated"],
                row["task_id"], row["split"]) == (episode.reward, len(episode.turns), episode.n_segments,
                                                  episode.generated_tokens, episode.truncated,
                                                  episode.task.task_id, "train")


def test_states_one_row_per_segment_start(tables):
    episodes, ids, rollouts, table = tables
    states = states_table(rollouts, table)
    assert validate_table("states", states).equals(states)
    assert states.num_rows == sum(e.n_segments for e in episodes)
    assert states.column("features").null_count == states.num_rows
    by_key = {(r["episode_id"], r["segment_idx"]): r for r in states.to_pylist()}
    for episode, eid in zip(episodes, ids, strict=True):
        counts = episode.segment_token_counts()
        for j, (start, reward) in enumerate(zip(episode.starts, episode.segment_rewards(), strict=True)):
            row = by_key[(eid, start.segment_idx)]
            assert row["state_id"] == start.state_id and row["context_token_ids"] == list(start.context_ids)
            assert row["segment_reward"] == reward and row["own_return"] == episode.reward
            assert row["segment_generated_tokens"] == counts[j]
            assert row["remaining_generated_tokens"] == sum(counts[j:])
        assert sum(by_key[(eid, s.segment_idx)]["segment_reward"] for s in episode.starts) == episode.reward


# --- stored rows -> branchable starts ----------------------------------------------------------------------


def absolute_starts(mains, branches) -> dict[str, list[SegmentStart]]:
    """Every start each state was visited with, its budget counted from the main episode's start.

    (The harness counts a branch's later starts from the branch's own start instead; see the report.)
    """
    seen: dict[str, list[SegmentStart]] = {}  # SegmentStart holds dicts: equality, not hashing
    budget: dict[str, int] = {}
    for episode in [*mains, *(b for b, _, _ in branches)]:  # parents come before their branches
        offset = budget[episode.parent_state.state_id] if episode.parent_state else 0
        for j, start in enumerate(episode.starts):
            if episode.parent_state is not None and j == 0:
                continue  # the parent state itself, visited by its own episode
            before = sum(t.generated_tokens for t in episode.turns
                         if t.segment_idx < start.segment_idx)
            absolute = dataclasses.replace(start, generated_tokens=offset + before)
            if absolute not in seen.setdefault(start.state_id, []):
                seen[start.state_id].append(absolute)
            budget.setdefault(start.state_id, absolute.generated_tokens)
    return seen


def test_segment_starts_round_trip(recorded, tables, tokenizer):
    mains, branches = recorded
    episodes, _, rollouts, table = tables
    expected = absolute_starts(mains, branches)
    wanted = [s.state_id for e in episodes for s in e.starts]
    rebuilt = segment_starts(wanted, rollouts=rollouts, episodes=table, tasks_by_id=TASKS, system_prompt=SYSTEM,
                             tokenizer=tokenizer)
    assert [s.state_id for s in rebuilt] == wanted
    for start in rebuilt:
        assert start in expected[start.state_id]
    for episode in mains:  # main episodes: exactly the harness's objects
        for original in episode.starts:
            if len(expected[original.state_id]) == 1:
                assert rebuilt[wanted.index(original.state_id)] == original
    # Rows read in any physical order give the same starts.
    shuffled = rollouts.take(np.random.default_rng(0).permutation(rollouts.num_rows))
    assert segment_starts(wanted, rollouts=shuffled, episodes=table, tasks_by_id=TASKS,
                          system_prompt=SYSTEM) == rebuilt


def test_continuation_from_rebuilt_start_is_the_same(recorded, tables, runner):
    mains, branches = recorded
    _, _, rollouts, table = tables
    originals = [mains[0].starts[1], branches[0][0].starts[1]]  # a main state and one inside a branch
    rebuilt = segment_starts([s.state_id for s in originals], rollouts=rollouts, episodes=table,
                             tasks_by_id=TASKS, system_prompt=SYSTEM)
    for original, start in zip(originals, rebuilt, strict=True):
        (a,), (b,) = runner.run(starts=[original], seed=11), runner.run(starts=[start], seed=11)
        assert [(t.role, t.token_ids, t.logprobs, t.segment_idx, t.turn_idx) for t in a.turns] == [
            (t.role, t.token_ids, t.logprobs, t.segment_idx, t.turn_idx) for t in b.turns]
        assert b.starts[0].state_id == original.state_id and a.reward == b.reward


def test_segment_starts_name_what_is_wrong(tables, tokenizer):
    episodes, ids, rollouts, table = tables
    state = episodes[0].starts[1].state_id
    with pytest.raises(ValueError, match="not found in the rollouts"):
        segment_starts(["feedfeedfeedfeed"], rollouts=rollouts, episodes=table, tasks_by_id=TASKS,
                       system_prompt=SYSTEM)
    with pytest.raises(ValueError, match=f"state {state}: task .* not in tasks_by_id"):
        segment_starts([state], rollouts=rollouts, episodes=table, tasks_by_id={}, system_prompt=SYSTEM)
    other = {k: dataclasses.replace(t, task_id="other") for k, t in TASKS.items()}
    with pytest.raises(ValueError, match=f"state {state}: the rebuilt start hashes to"):
        segment_starts([state], rollouts=rollouts, episodes=table, tasks_by_id=other, system_prompt=SYSTEM)
    with pytest.raises(ValueError, match=f"state {state}: .* do not render"):
        segment_starts([state], rollouts=rollouts, episodes=table, tasks_by_id=TASKS, system_prompt="You are",
                       tokenizer=tokenizer)
    # A branch's start state without the episode that reached it cannot be priced or rebuilt.
    branch = episodes[-1]
    only_branch = [eid for e, eid in zip(episodes, ids, strict=True) if e is branch]

    def keep(t: pa.Table) -> pa.Table:
        return t.filter(pa.compute.is_in(t.column("episode_id"), pa.array(only_branch)))

    with pytest.raises(ValueError, match="only starts branch episodes"):
        segment_starts([branch.starts[0].state_id], rollouts=keep(rollouts), episodes=keep(table),
                       tasks_by_id=TASKS, system_prompt=SYSTEM)


# --- training sequences ----------------------------------------------------------------------------------


def test_training_sequences_are_the_stored_turns(tables):
    episodes, ids, rollouts, table = tables
    sequences = training_sequences(rollouts)
    assert [(q.episode_id, q.segment_idx) for q in sequences] == [
        (eid, s.segment_idx) for e, eid in zip(episodes, ids, strict=True) for s in e.starts]
    by_key = {(q.episode_id, q.segment_idx): q for q in sequences}
    for episode, eid in zip(episodes, ids, strict=True):
        for start in episode.starts:
            turns = [t for t in episode.turns if t.segment_idx == start.segment_idx]
            q = by_key[(eid, start.segment_idx)]
            assert q.state_id == start.state_id
            assert q.token_ids.tolist() == [i for t in turns for i in t.token_ids]
            assert q.loss_mask.tolist() == [m for t in turns for m in t.loss_mask]
            np.testing.assert_array_equal(q.old_logprobs, np.float32([x for t in turns for x in t.logprobs]))
            assert q.token_ids[: len(start.context_ids)].tolist() == list(start.context_ids)
    shuffled = rollouts.take(np.random.default_rng(1).permutation(rollouts.num_rows))
    picked = training_sequences(shuffled, episode_ids=[ids[3], ids[0]])
    assert [q.episode_id for q in picked] == [ids[3]] * episodes[3].n_segments + [ids[0]] * episodes[0].n_segments
    assert all(np.array_equal(q.token_ids, by_key[(q.episode_id, q.segment_idx)].token_ids) for q in picked)
    with pytest.raises(ValueError, match="not in the rollouts"):
        training_sequences(rollouts, episode_ids=["nope"])


def advantages_for(states: pa.Table, values: np.ndarray) -> pa.Table:
    n = states.num_rows
    keys = {k: states.column(k) for k in ("run_id", "iteration", "episode_id", "segment_idx", "state_id",
                                          "policy_version")}
    zeros = np.zeros(n)
    return pa.table({**keys, "reward": states.column("segment_reward"), "value": zeros, "next_value": zeros,
                     "delta": values, "advantage": values, "lambda_return": values})


def test_token_advantages_put_each_segment_value_on_its_policy_tokens(tables):
    _, _, rollouts, table = tables
    states = states_table(rollouts, table)
    values = np.random.default_rng(2).normal(size=states.num_rows)
    advantages = advantages_for(states, values)
    value_of = dict(zip(zip(states.column("episode_id").to_pylist(), states.column("segment_idx").to_pylist(),
                            strict=True), values, strict=True))
    sequences = training_sequences(rollouts)
    per_token = token_advantages(sequences, advantages.take(np.arange(states.num_rows)[::-1]))
    for q, a in zip(sequences, per_token, strict=True):
        np.testing.assert_array_equal(a, np.where(q.loss_mask == 1, value_of[(q.episode_id, q.segment_idx)], 0.0))
    assert token_advantages([], advantages) == []
    with pytest.raises(ValueError, match="no row for 1 segment"):
        token_advantages(sequences, advantages.slice(1))
    foreign = advantages.set_column(4, "state_id", pa.array(["x" * 16] * states.num_rows))
    with pytest.raises(ValueError, match="different runs"):
        token_advantages(sequences, foreign)
    with pytest.raises(ValueError, match="two rows"):
        token_advantages(sequences, pa.concat_tables([advantages, advantages]))


# --- bad input ---------------------------------------------------------------------------------------------


def test_bad_tables_raise_naming_the_problem(tables):
    episodes, ids, rollouts, table = tables
    role, segment = rollouts.column("role").to_pylist(), rollouts.column("segment_idx").to_numpy()
    eid = rollouts.column("episode_id").to_pylist()
    # Drop the context row of segment 1 of the first episode.
    drop = next(i for i in range(rollouts.num_rows) if eid[i] == ids[0] and segment[i] == 1 and role[i] == "context")
    holed = rollouts.take([i for i in range(rollouts.num_rows) if i != drop])
    with pytest.raises(ValueError, match=f"segment 1 of episode {ids[0]} has no context row"):
        states_table(holed, table)
    with pytest.raises(ValueError, match=f"episode {ids[0]} jumps from segment 0 to 2"):
        training_sequences(rollouts.take([i for i in range(rollouts.num_rows) if not (eid[i] == ids[0]
                                                                                     and segment[i] == 1)]))
    with pytest.raises(ValueError, match="missing columns"):  # a foreign table
        training_sequences(table)
    with pytest.raises(ValueError, match="holds an episode twice"):
        states_table(pa.concat_tables([rollouts, rollouts]), table)
    with pytest.raises(ValueError, match="absent from the episodes table"):
        states_table(rollouts, table.slice(1))
    with pytest.raises(ValueError, match="no rollouts rows"):
        states_table(rollouts.filter(pa.compute.not_equal(rollouts.column("episode_id"), ids[0])), table)
    wrong_count = table.set_column(table.schema.get_field_index("n_segments"), "n_segments",
                                          pa.array(np.ones(table.num_rows, np.int32)))
    with pytest.raises(ValueError, match="episodes.n_segments"):
        states_table(rollouts, wrong_count)
    other_run = table.set_column(0, "run_id", pa.array(["other"] * table.num_rows))
    with pytest.raises(ValueError, match="run_id differs"):
        states_table(rollouts, other_run)
    with pytest.raises(ValueError, match="is a branch episode but its branch id is None"):
        episode_tables(episodes[-1:], run_id=RUN, iteration=0, policy_version=0, episode_ids=["b"],
                       group_ids=["g"])
    with pytest.raises(ValueError, match="group_ids has 0 entries"):
        episode_tables(episodes[:1], run_id=RUN, iteration=0, policy_version=0, episode_ids=["a"], group_ids=[])


# --- synthetic episodes of random shape -----------------------------------------------------------------------

TASK = Task("task-s", "synthetic", "train", "default", "Solve it.", "x", "x")


def synthetic_turn(role: str, n: int, segment: int, turn: int) -> TurnRecord:
    policy = role in ("policy", "summary")
    return TurnRecord(role, role, list(range(n)), [-0.5 if policy else 0.0] * n, [int(policy)] * n, segment, turn,
                      is_compression=role == "summary")


@st.composite
def synthetic_episode(draw) -> AgentEpisode:
    """An episode with the harness's turn structure: per segment a context row, (policy, tool) pairs, and a
    compression request + summary before every restart; random token counts, reward and first segment."""
    episode = AgentEpisode(task=TASK, reward=draw(st.sampled_from([0.0, 1.0, 0.5, -1.0])))
    first, turn = draw(st.integers(0, 2)), draw(st.integers(0, 3))
    n_segments = draw(st.integers(1, 4))
    sizes = st.integers(0, 5)
    for segment in range(first, first + n_segments):
        ids = tuple(draw(st.lists(st.integers(0, 99), min_size=1, max_size=6)))
        user = f"{TASK.prompt} {segment}"
        messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": user})
        calls = tuple(t.text for t in episode.turns if t.role == "policy")  # what a branch replays
        episode.starts.append(SegmentStart(TASK, segment, turn, episode.generated_tokens, messages, ids, calls))
        episode.turns.append(TurnRecord("context", user, list(ids), [0.0] * len(ids), [0] * len(ids), segment, turn))
        for _ in range(draw(st.integers(1, 3))):
            episode.turns.append(synthetic_turn("policy", draw(sizes), segment, turn))
            turn += 1
            episode.turns.append(synthetic_turn("tool", draw(sizes), segment, turn))
        if segment < first + n_segments - 1 and draw(st.booleans()):  # policy summary, else deterministic notes
            episode.turns.append(synthetic_turn("context", draw(sizes), segment, turn))
            episode.turns.append(synthetic_turn("summary", draw(sizes), segment, turn))
    return episode


@settings(max_examples=60, deadline=None)
@given(st.lists(synthetic_episode(), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_synthetic_episodes_keep_reward_and_token_bookkeeping(episodes, rng):
    ids = [episode_id(RUN, 0, TASK.task_id, "main", i) for i in range(len(episodes))]
    rollouts, table = episode_tables(episodes, run_id=RUN, iteration=0, policy_version=0, episode_ids=ids,
                                     group_ids=["g"] * len(episodes))
    order = list(range(rollouts.num_rows))
    rng.shuffle(order)
    states = states_table(rollouts.take(order), table)
    assert states.num_rows == sum(e.n_segments for e in episodes)
    for episode, eid in zip(episodes, ids, strict=True):
        mine = [r for r in states.to_pylist() if r["episode_id"] == eid]
        assert [r["segment_idx"] for r in mine] == [s.segment_idx for s in episode.starts]
        assert sum(r["segment_reward"] for r in mine) == episode.reward
        assert all(r["own_return"] == episode.reward for r in mine)
        counts = [r["segment_generated_tokens"] for r in mine]
        assert counts == episode.segment_token_counts()
        assert [r["remaining_generated_tokens"] for r in mine] == [sum(counts[j:]) for j in range(len(counts))]
    sequences = training_sequences(rollouts.take(order))
    assert sum(q.generated_tokens for q in sequences) == sum(e.generated_tokens for e in episodes)
    assert all(isinstance(q, SegmentSequence) for q in sequences)
    wanted = [s.state_id for e in episodes for s in e.starts]
    rebuilt = segment_starts(wanted, rollouts=rollouts, episodes=table, tasks_by_id={TASK.task_id: TASK},
                             system_prompt=SYSTEM)
    originals = {s.state_id: s for e in episodes for s in e.starts}
    assert all(r.messages == originals[r.state_id].messages and r.context_ids == originals[r.state_id].context_ids
               for r in rebuilt)


def test_no_episodes_give_empty_valid_tables():
    rollouts, table = episode_tables([], run_id=RUN, iteration=0, policy_version=0, episode_ids=[], group_ids=[])
    assert rollouts.num_rows == table.num_rows == states_table(rollouts, table).num_rows == 0
    assert training_sequences(rollouts) == []
    assert segment_starts([], rollouts=rollouts, episodes=table, tasks_by_id=TASKS, system_prompt=SYSTEM) == []
