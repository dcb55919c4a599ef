"""The bridge between recorded agent episodes and the artifact tables (DESIGN.md, stages 1, 2, 4 and 7).

The harness records an episode as ``TurnRecord`` objects in memory; the pipeline stores them as rows of
the ``rollouts`` and ``episodes`` tables and later stages work only from the stored rows, never from a
live object or re-tokenized text. This module holds both directions, as pure functions over pyarrow:

* ``episode_tables``: episodes -> one ``rollouts`` row per turn and one ``episodes`` row per episode.
* ``states_table``: rollouts + episodes -> one ``states`` row per segment start s_k, with the sparse
  segment rewards (all of the episode reward on the last segment) and the token costs the
  acquisition stage prices continuations with.
* ``segment_starts``: stored rows -> branchable ``SegmentStart`` objects, so the branch stage can
  continue from a state of a finished (or resumed) run. The rebuilt start must hash to the stored
  ``state_id``; a mismatch means the rows do not describe that state, and raises.
* ``training_sequences`` / ``token_advantages``: the PPO update's input. Each segment is one training
  sequence, because the context restarts at every compression: its tokens are exactly the stored
  turns of the segment, and every policy token gets its segment's advantage A_k.

Row order. The harness's ``turn_idx`` counts the tool calls taken before a turn, so several rows share
it (the context row and the first policy turn of a segment; a tool observation, the compression
request and the summary). Rows are put in episode order by (segment_idx, turn_idx, role rank) with
tool < context < policy/summary, which is a total order for everything the harness writes, so no
function here depends on the physical order of rows in a table. The first row of every segment is the
context row that starts it (the full rendered [system, user] context), whose text is the user message.

Ids are content-derived (``focus_core.ids``), so a resumed run produces the same ids. A state id
covers (task, segment index, context tokens) only, so several episodes can visit one state (every main
episode of a task starts in the same s_0): ``state_id`` is not a row key of ``states``; the key is
(episode_id, segment_idx).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from focus_core.advantages import broadcast_segments
from focus_core.agent.harness import AgentEpisode, SegmentStart
from focus_core.envs.base import Task
from focus_core.policy.tokenizer import chat_ids
from focus_core.schemas import ROLLOUT_ROLES, schema_for, validate_table

# Rank of a role among rows sharing (segment_idx, turn_idx); see "Row order" above.
_ROLE_RANK = {"tool": 0, "context": 1, "policy": 2, "summary": 2}


# --- episodes -> rollouts + episodes tables ----------------------------------------------------------


def episode_tables(
    episodes: Sequence[AgentEpisode], *, run_id: str, iteration: int, policy_version: int,
    episode_ids: Sequence[str], group_ids: Sequence[str], branch_ids: Sequence[str | None] | None = None,
    splits: Sequence[str] | None = None,
) -> tuple[pa.Table, pa.Table]:
    """The validated ``rollouts`` (one row per turn) and ``episodes`` (one row per episode) tables.

    ``episode_ids``, ``group_ids`` and, where given, ``branch_ids`` and ``splits`` hold one entry per
    episode. A branch episode (``parent_state`` set) must have a branch id, a main episode None; the split
    defaults to the task's.
    """
    n = len(episodes)
    branch_ids = [None] * n if branch_ids is None else list(branch_ids)
    splits = [e.task.split for e in episodes] if splits is None else list(splits)
    for name, values in (("episode_ids", episode_ids), ("group_ids", group_ids), ("branch_ids", branch_ids),
                         ("splits", splits)):
        if len(values) != n:
            raise ValueError(f"episode_tables: {name} has {len(values)} entries for {n} episodes; give one each")
    if len(set(episode_ids)) != n:
        raise ValueError("episode_tables: episode_ids repeat; every episode needs its own id")

    common = {"run_id": run_id, "iteration": iteration, "policy_version": policy_version}
    turn_rows, episode_rows = [], []
    for episode, eid, gid, bid, split in zip(episodes, episode_ids, group_ids, branch_ids, splits, strict=True):
        parent = episode.parent_state
        if (parent is not None) != (bid is not None):
            raise ValueError(f"episode {eid} is {'a branch' if parent else 'a main'} episode but its branch id is "
                             f"{bid!r}; branch episodes (parent_state set) need a branch id, main episodes None")
        state_of_segment = _segment_state_ids(episode, eid)
        turn_rows += [
            {**common, "episode_id": eid, "segment_idx": t.segment_idx, "state_id": state_of_segment[t.segment_idx],
             "branch_id": bid, "turn_idx": t.turn_idx, "role": t.role, "text": t.text, "token_ids": t.token_ids,
             "logprobs": t.logprobs, "loss_mask": t.loss_mask, "is_compression": t.is_compression,
             "generated_tokens": t.generated_tokens}
            for t in episode.turns
        ]
        episode_rows.append(
            {**common, "episode_id": eid, "branch_id": bid, "task_id": episode.task.task_id, "split": split,
             "group_id": gid, "reward": float(episode.reward), "n_turns": len(episode.turns),
             "n_segments": episode.n_segments, "generated_tokens": episode.generated_tokens,
             "is_branch": parent is not None, "parent_state_id": parent.state_id if parent else None,
             "truncated": episode.truncated, "budget_cut": episode.budget_cut}
        )
    rollouts = pa.Table.from_pylist(turn_rows, schema=schema_for("rollouts"))
    table = pa.Table.from_pylist(episode_rows, schema=schema_for("episodes"))
    return validate_table("rollouts", rollouts), validate_table("episodes", table)


def _segment_state_ids(episode: AgentEpisode, eid: str) -> dict[int, str]:
    """Segment index -> state id of its start; checks that every segment opens with its context turn."""
    starts = {start.segment_idx: start for start in episode.starts}
    opened: set[int] = set()
    for turn in episode.turns:
        start = starts.get(turn.segment_idx)
        if start is None:
            raise ValueError(f"episode {eid}: a turn of segment {turn.segment_idx} has no SegmentStart")
        if turn.segment_idx not in opened:
            if turn.role != "context" or tuple(turn.token_ids) != start.context_ids:
                raise ValueError(f"episode {eid}: segment {turn.segment_idx} does not open with the context "
                                 f"turn of its SegmentStart (first turn is a {turn.role!r} turn)")
            opened.add(turn.segment_idx)
    return {k: start.state_id for k, start in starts.items()}


# --- reading stored rows: the segment view -----------------------------------------------------------


@dataclass(frozen=True)
class _Segments:
    """A rollouts table in episode order, cut into segments (arrays have one entry per segment)."""

    rows: pa.Table  # validated rollouts, sorted into episode order
    episode_names: list[str]  # episode code -> episode id, in order of first appearance in the input
    episode: np.ndarray  # episode code of each segment
    segment_idx: np.ndarray
    state_id: list[str]
    first: np.ndarray  # row of the segment's context row (its first row)
    end: np.ndarray  # one past the segment's last row
    generated: np.ndarray  # policy tokens of the segment
    before: np.ndarray  # policy tokens of the episode's rows before the segment
    total: np.ndarray  # policy tokens of the segment's whole episode
    is_first: np.ndarray  # the episode's first segment
    is_last: np.ndarray  # the episode's last segment


def _segments(rollouts: pa.Table) -> _Segments:
    rows = validate_table("rollouts", rollouts)
    encoded = rows.column("episode_id").combine_chunks().dictionary_encode()  # codes by first appearance
    codes = encoded.indices.to_numpy(zero_copy_only=False)
    ranks = np.array([_ROLE_RANK[r] for r in ROLLOUT_ROLES])[
        pc.index_in(rows.column("role"), value_set=pa.array(ROLLOUT_ROLES)).to_numpy(zero_copy_only=False)]
    segment = rows.column("segment_idx").to_numpy()
    turn = rows.column("turn_idx").to_numpy()
    order = np.lexsort((ranks, turn, segment, codes))
    rows, codes, ranks, segment, turn = rows.take(order), codes[order], ranks[order], segment[order], turn[order]
    names = encoded.dictionary.to_pylist()
    roles = rows.column("role").to_pylist()
    states = np.array(rows.column("state_id").to_pylist(), dtype=object)

    same = (codes[1:] == codes[:-1]) & (segment[1:] == segment[:-1]) & (turn[1:] == turn[:-1])
    clash = np.flatnonzero(same & (ranks[1:] == ranks[:-1]))
    if clash.size:
        i = clash[0] + 1
        raise ValueError(f"rollouts: episode {names[codes[i]]} has a {roles[i - 1]!r} and a {roles[i]!r} row in one "
                         f"place (segment {segment[i]}, turn {turn[i]}); the table holds an episode twice or mixes "
                         f"tables")
    boundary = _group_starts(codes, segment)
    first = np.flatnonzero(boundary)
    end = np.r_[first[1:], len(rows)].astype(np.int64)
    headless = first[ranks[first] != _ROLE_RANK["context"]]  # only context rows have the context rank
    if headless.size:
        i = headless[0]
        raise ValueError(f"rollouts: segment {segment[i]} of episode {names[codes[i]]} has no context row "
                         f"(its first row is a {roles[i]!r} turn); every segment starts with the context "
                         f"turn holding its full context tokens")
    seg_of_row = np.cumsum(boundary) - 1
    wrong = np.flatnonzero(states != states[first][seg_of_row])
    if wrong.size:
        i = wrong[0]
        raise ValueError(f"rollouts: episode {names[codes[i]]}, segment {segment[i]}: rows name state "
                         f"{states[i]} and {states[first[seg_of_row[i]]]}; one segment has one start state")

    episode, seg_idx = codes[first], segment[first]
    is_first = _group_starts(episode)
    is_last = _group_starts(episode[::-1])[::-1]
    gap = np.flatnonzero(~is_first[1:] & (np.diff(seg_idx) != 1)) + 1
    if gap.size:
        i = gap[0]
        raise ValueError(f"rollouts: episode {names[episode[i]]} jumps from segment {seg_idx[i - 1]} to "
                         f"{seg_idx[i]}; rows of the segments between are missing")

    per_row = rows.column("generated_tokens").to_numpy()
    generated = np.add.reduceat(per_row, first) if first.size else np.zeros(0, np.int64)
    upto = np.cumsum(generated)  # inclusive running sum over all segments
    episode_start = np.maximum.accumulate(np.where(is_first, np.arange(first.size), 0))
    episode_end = np.minimum.accumulate(np.where(is_last, np.arange(first.size), first.size)[::-1])[::-1]
    offset = upto[episode_start] - generated[episode_start]
    before = upto - generated - offset
    total = upto[episode_end] - offset
    return _Segments(rows, names, episode, seg_idx, list(states[first]), first, end, generated, before, total,
                     is_first, is_last)


def _group_starts(*keys: np.ndarray) -> np.ndarray:
    """True where a row starts a new run of equal keys (rows sorted by the keys)."""
    n = len(keys[0])
    same_as_previous = np.ones(max(n - 1, 0), dtype=bool)
    for key in keys:
        same_as_previous &= key[1:] == key[:-1]
    return np.r_[np.ones(min(n, 1), dtype=bool), ~same_as_previous]


def _episode_rows(episodes: pa.Table, segments: _Segments) -> tuple[pa.Table, np.ndarray]:
    """The validated episodes table, and for each episode code of ``segments`` its row in that table."""
    table = validate_table("episodes", episodes)
    ids = table.column("episode_id").to_pylist()
    row_of = {eid: i for i, eid in enumerate(ids)}
    if len(row_of) != len(ids):
        raise ValueError("episodes: an episode_id occurs twice; the table holds an episode twice or mixes tables")
    missing = [eid for eid in segments.episode_names if eid not in row_of]
    if missing:
        raise ValueError(f"rollouts hold {len(missing)} episode(s) absent from the episodes table, e.g. "
                         f"{missing[:3]}; pass the episodes table written with these rollouts")
    return table, np.array([row_of[eid] for eid in segments.episode_names], dtype=np.int64)


# --- stage 2: states -----------------------------------------------------------------------------------


def states_table(rollouts: pa.Table, episodes: pa.Table) -> pa.Table:
    """One validated ``states`` row per segment start of every episode in ``rollouts``.

    Rewards are sparse and undiscounted (γ = 1): ``own_return`` is the episode reward for every state of
    the episode, ``segment_reward`` is 0 except on the last segment, where it is the episode reward, so an
    episode's segment rewards sum to its reward. ``remaining_generated_tokens`` counts the policy tokens
    from the state to the episode's end (its own segment included); ``features`` are left null.
    """
    seg = _segments(rollouts)
    table, row_of = _episode_rows(episodes, seg)
    if len(row_of) != table.num_rows:
        extra = sorted(set(table.column("episode_id").to_pylist()) - set(seg.episode_names))
        raise ValueError(f"episodes table holds {len(extra)} episode(s) with no rollouts rows, e.g. {extra[:3]}; "
                         f"their states would be lost")
    ep_row = row_of[seg.episode]  # episodes-table row of each segment
    n_segments = np.bincount(seg.episode, minlength=len(row_of))
    for column, stored, found in (("n_segments", table.column("n_segments").to_numpy()[row_of], n_segments),
                                  ("generated_tokens", table.column("generated_tokens").to_numpy()[row_of],
                                   seg.total[seg.is_first])):
        bad = np.flatnonzero(stored != found)
        if bad.size:
            raise ValueError(f"episode {seg.episode_names[bad[0]]}: episodes.{column} is {stored[bad[0]]} but its "
                             f"rollouts rows give {found[bad[0]]}; the tables come from different episodes")
    starts = seg.rows.take(seg.first)
    for key in ("run_id", "iteration"):
        stored = np.array(table.column(key).to_pylist(), dtype=object)[ep_row]
        bad = np.flatnonzero(stored != np.array(starts.column(key).to_pylist(), dtype=object))
        if bad.size:
            raise ValueError(f"episode {seg.episode_names[seg.episode[bad[0]]]}: {key} differs between the rollouts "
                             f"and episodes tables; pass tables of one run and iteration")

    reward = table.column("reward").to_numpy()[ep_row]
    states = pa.table({
        "run_id": starts.column("run_id"), "iteration": starts.column("iteration"),
        "episode_id": starts.column("episode_id"), "segment_idx": starts.column("segment_idx"),
        "state_id": starts.column("state_id"), "branch_id": starts.column("branch_id"),
        "policy_version": starts.column("policy_version"), "context_token_ids": starts.column("token_ids"),
        "remaining_generated_tokens": pa.array(seg.total - seg.before, pa.int64()),
        "own_return": pa.array(reward, pa.float64()),
        "segment_reward": pa.array(np.where(seg.is_last, reward, 0.0), pa.float64()),
        "segment_generated_tokens": pa.array(seg.generated, pa.int64()),
        "features": pa.nulls(len(seg.first), pa.list_(pa.float32())),
    })
    return validate_table("states", states)


# --- stage 4: branchable starts from stored rows -------------------------------------------------------


def segment_starts(
    state_ids: Sequence[str], *, rollouts: pa.Table, episodes: pa.Table, tasks_by_id: Mapping[str, Task],
    system_prompt: str, tokenizer: Any = None,
) -> list[SegmentStart]:
    """One ``SegmentStart`` per requested state id (in order, repeats allowed), rebuilt from stored rows.

    ``rollouts`` and ``episodes`` are the tables that visited the states (e.g. an iteration's main and
    branch episodes); the task comes from ``episodes.task_id`` via ``tasks_by_id``, the system prompt is
    the environment's. The context is (system, user = the context row's text) with the stored token ids.
    When several episodes visited a state, the start is read from a main episode if any (else the first
    branch episode by id that reached it, not started from it). ``generated_tokens`` is the budget spent
    before the state counted from its main episode's start: for a state inside a branch episode, the
    branch's parent's count plus the branch's own tokens before it. With ``tokenizer``, the messages are
    also re-rendered and must give the stored ids (this catches a wrong system prompt).
    """
    seg = _segments(rollouts)
    table, row_of = _episode_rows(episodes, seg)
    task_of = np.array(table.column("task_id").to_pylist(), dtype=object)[row_of]
    parent_of = np.array(table.column("parent_state_id").to_pylist(), dtype=object)[row_of]
    is_branch = table.column("is_branch").to_numpy(zero_copy_only=False)[row_of]
    for s in np.flatnonzero(seg.is_first & is_branch[seg.episode]):
        if seg.state_id[s] != parent_of[seg.episode[s]]:
            raise ValueError(f"branch episode {seg.episode_names[seg.episode[s]]} starts in state {seg.state_id[s]}, "
                             f"not in its parent_state_id {parent_of[seg.episode[s]]}")

    # The segment each state is read from: not the first segment of a branch (a copy of its parent).
    home: dict[str, int] = {}
    for s in sorted(range(len(seg.first)), key=lambda s: (bool(is_branch[seg.episode[s]]),
                                                         seg.episode_names[seg.episode[s]])):
        if not (seg.is_first[s] and is_branch[seg.episode[s]]):
            home.setdefault(seg.state_id[s], s)

    def home_of(state: str) -> int:
        if state not in home:
            known = state in seg.state_id
            raise ValueError(f"state {state}: " + ("it only starts branch episodes here; pass the rollouts and "
                             "episodes tables of the episode that reached it" if known
                             else "not found in the rollouts table"))
        return home[state]

    def budget_before(s: int) -> int:  # recursion ends: a branch's parent has a smaller segment index
        code = seg.episode[s]
        return int(seg.before[s]) + (budget_before(home_of(parent_of[code])) if is_branch[code] else 0)

    texts = seg.rows.column("text")
    context_ids = seg.rows.column("token_ids")
    turn_idx = seg.rows.column("turn_idx")
    is_policy = np.asarray(seg.rows.column("role").to_pylist(), dtype=object) == "policy"
    episode_first = {int(seg.episode[s]): int(seg.first[s]) for s in np.flatnonzero(seg.is_first)}

    def calls_before(s: int) -> tuple[str, ...]:  # a branch's calls continue its parent's, like its budget
        code = seg.episode[s]
        rows = range(episode_first[int(code)], int(seg.first[s]))
        own = tuple(texts[r].as_py() for r in rows if is_policy[r])
        return (calls_before(home_of(parent_of[code])) if is_branch[code] else ()) + own

    built: dict[str, SegmentStart] = {}
    for state in dict.fromkeys(state_ids):
        s = home_of(state)
        row, task_id = int(seg.first[s]), task_of[seg.episode[s]]
        if task_id not in tasks_by_id:
            raise ValueError(f"state {state}: task {task_id!r} is not in tasks_by_id; pass the tasks of the run")
        messages = ({"role": "system", "content": system_prompt}, {"role": "user", "content": texts[row].as_py()})
        start = SegmentStart(tasks_by_id[task_id], int(seg.segment_idx[s]), turn_idx[row].as_py(),
                             budget_before(s), messages, tuple(context_ids[row].as_py()), calls_before(s))
        if start.state_id != state:
            raise ValueError(f"state {state}: the rebuilt start hashes to {start.state_id}; the stored rows or the "
                             f"task {task_id!r} differ from the ones that produced the state")
        rendered = None if tokenizer is None else tuple(chat_ids(tokenizer, messages, add_generation_prompt=True))
        if rendered is not None and rendered != start.context_ids:
            raise ValueError(f"state {state}: (system prompt, context text) do not render to the stored "
                             f"context ids; pass the environment's system prompt and the run's tokenizer")
        built[state] = start
    return [built[state] for state in state_ids]


# --- stage 7: training sequences ---------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class SegmentSequence:
    """One PPO training sequence: the stored turns of one segment, concatenated in order (read-only arrays)."""

    episode_id: str
    segment_idx: int
    state_id: str
    token_ids: np.ndarray  # int32
    old_logprobs: np.ndarray  # float32, sampling logprobs; 0 where loss_mask = 0
    loss_mask: np.ndarray  # int8, 1 = policy token

    @property
    def generated_tokens(self) -> int:
        return int(self.loss_mask.sum())


def training_sequences(rollouts: pa.Table, *, episode_ids: Sequence[str] | None = None) -> list[SegmentSequence]:
    """One sequence per segment, episodes in order of first appearance (or of ``episode_ids``, which
    selects them), segments in order. Segments without policy tokens are kept (one per advantages row)."""
    seg = _segments(rollouts)
    if episode_ids is None:
        chosen = np.arange(len(seg.first))
    else:
        code_of = {eid: c for c, eid in enumerate(seg.episode_names)}
        missing = [eid for eid in episode_ids if eid not in code_of]
        if missing:
            raise ValueError(f"training_sequences: {len(missing)} episode id(s) not in the rollouts, "
                             f"e.g. {missing[:3]}")
        rank = np.full(len(seg.episode_names), -1)
        rank[[code_of[eid] for eid in episode_ids]] = np.arange(len(episode_ids))
        chosen = np.flatnonzero(rank[seg.episode] >= 0)
        chosen = chosen[np.argsort(rank[seg.episode[chosen]], kind="stable")]

    def flat(column: str, dtype: type) -> np.ndarray:
        return pc.list_flatten(seg.rows.column(column)).to_numpy(zero_copy_only=False).astype(dtype, copy=False)

    ids, logprobs, mask = flat("token_ids", np.int32), flat("logprobs", np.float32), flat("loss_mask", np.int8)
    offsets = np.r_[0, np.cumsum(pc.list_value_length(seg.rows.column("token_ids")).to_numpy(zero_copy_only=False))]
    sequences = []
    for s in chosen:
        a, b = offsets[seg.first[s]], offsets[seg.end[s]]
        sequences.append(SegmentSequence(seg.episode_names[seg.episode[s]], int(seg.segment_idx[s]),
                                         seg.state_id[s], ids[a:b], logprobs[a:b], mask[a:b]))
    return sequences


def token_advantages(sequences: Sequence[SegmentSequence], advantages: pa.Table) -> list[np.ndarray]:
    """Per sequence, its segment's advantage A_k on every policy token and 0 elsewhere (float64).

    ``advantages`` is the advantage stage's table; each sequence's (episode_id, segment_idx) must have
    exactly one row, naming the same state.
    """
    table = validate_table("advantages", advantages)
    keys = zip(table.column("episode_id").to_pylist(), table.column("segment_idx").to_pylist(), strict=True)
    row_of: dict[tuple[str, int], int] = {}
    for i, key in enumerate(keys):
        if row_of.setdefault(key, i) != i:
            raise ValueError(f"advantages: two rows for episode {key[0]}, segment {key[1]}")
    missing = [(q.episode_id, q.segment_idx) for q in sequences if (q.episode_id, q.segment_idx) not in row_of]
    if missing:
        raise ValueError(f"advantages: no row for {len(missing)} segment(s), e.g. (episode, segment) {missing[:3]}; "
                         f"pass the advantages computed for these rollouts")
    rows = np.array([row_of[(q.episode_id, q.segment_idx)] for q in sequences], dtype=np.int64)
    states = table.column("state_id").to_pylist()
    for q, r in zip(sequences, rows, strict=True):
        if states[r] != q.state_id:
            raise ValueError(f"advantages: episode {q.episode_id}, segment {q.segment_idx} is state {states[r]} "
                             f"there but {q.state_id} in the rollouts; the tables come from different runs")
    if not sequences:
        return []
    values = table.column("advantage").to_numpy()[rows]
    mask = np.concatenate([q.loss_mask for q in sequences])
    counts = np.array([q.generated_tokens for q in sequences], dtype=np.int64)
    per_token = broadcast_segments(values, counts, mask)
    return np.split(per_token, np.cumsum([len(q.loss_mask) for q in sequences])[:-1])
