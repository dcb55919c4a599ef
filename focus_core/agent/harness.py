"""The agent harness: runs episodes of a policy in a tool environment and records every token.

An episode alternates policy messages (one tool call each) and tool observations. The working
context is rendered through the tokenizer's chat template, and the token ids are built
incrementally — the sampled ids of each policy message are kept as sampled, and only the
environment's text is tokenized — so training later sees exactly the tokens the policy produced.
Every turn records its token ids, sampling log-probs, loss mask (1 = policy token, 0 = context or
tool token) and segment index.

The context manager keeps the working context short. When the context would exceed ``C_max``
tokens, or a segment has run ``M`` turns, the segment closes: the policy writes a summary (or, in
``notes`` mode, a deterministic compressor keeps the observations' first lines and the last turn)
and the context restarts as [system, task + summary]. Each restart begins a new segment, and its
start is a ``SegmentStart``: a branchable state from which ``run`` can sample fresh continuations.
The ``observation`` mode is the Markov context: after every turn the context restarts as
[system, task prompt + the last observation] (``observation_context``), so when observations show the
whole environment state, the policy's action distribution is a function of that state alone.

Episodes run in lockstep so each step is one batched generation; continuations that share a
prompt are generated with ``n > 1`` from one prompt, so the policy computes the prefix once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from focus_core.agent.notes import note, summarize_notes
from focus_core.budget import BudgetLedger
from focus_core.config import AgentConfig
from focus_core.envs.base import Task, ToolEnv
from focus_core.policy.base import Generation, Policy
from focus_core.policy.tokenizer import chat_ids, end_of_turn_ids

COMPRESS_REQUEST = "Context is full. Summarize what you have found so far in one short paragraph."
NOTES_HEADER = "Notes so far:"


@dataclass(frozen=True)
class RunProgress:
    """Where ``AgentRunner.run`` is, reported after every generation call: episodes in lockstep batches finish
    together, so the finished count alone stands still for minutes with a real model; steps and tokens move."""

    finished: int  # episodes done or cut off
    total: int  # episodes of this run call
    steps: int  # lockstep turns taken (each: one batched generation for every active episode)
    tokens: int  # tokens generated so far by this call


@dataclass(frozen=True)
class SegmentStart:
    """A branchable state: the compressed context at the start of segment ``segment_idx``."""

    task: Task
    segment_idx: int
    turn_idx: int  # turns taken before this state
    generated_tokens: int  # tokens generated before this state (the budget so far)
    messages: tuple[dict[str, str], ...]  # the context as chat messages
    context_ids: tuple[int, ...]  # the same context rendered, ending with the generation prompt
    # The messages the policy sent to the environment before this state. A branch replays them into a fresh
    # environment: tools are deterministic, so the transcript is the environment's whole state (a tool that
    # remembers, like a reading position, needs no snapshot).
    calls: tuple[str, ...] = ()

    @property
    def state_id(self) -> str:
        digest = hashlib.blake2b(digest_size=8)
        digest.update(self.task.task_id.encode())
        digest.update(str(self.segment_idx).encode())
        digest.update(np.asarray(self.context_ids, dtype="<u4").tobytes())
        for call in self.calls:  # the same context reached by other calls may be another environment state
            digest.update(b"\x00" + call.encode())
        return digest.hexdigest()


@dataclass
class TurnRecord:
    """One row of the rollouts table."""

    role: str  # context | policy | tool | summary
    text: str
    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    segment_idx: int
    turn_idx: int
    is_compression: bool = False

    @property
    def generated_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class AgentEpisode:
    task: Task
    turns: list[TurnRecord] = field(default_factory=list)
    starts: list[SegmentStart] = field(default_factory=list)  # one per segment, in order
    reward: float = 0.0
    done: bool = False  # the agent ended the episode (answer/submit)
    truncated: bool = False  # a turn or context limit cut it off
    n_tool_calls: int = 0
    parent_state: SegmentStart | None = None  # for continuations: where they started
    budget_cut: bool = False  # cut off because the iteration's token budget ran out (not the policy's doing)

    @property
    def generated_tokens(self) -> int:
        return sum(t.generated_tokens for t in self.turns)

    @property
    def n_segments(self) -> int:
        return len(self.starts)

    def segment_rewards(self) -> list[float]:
        """Sparse reward: all of it on the last segment; they sum to the episode reward."""
        return [0.0] * (self.n_segments - 1) + [self.reward]

    def segment_token_counts(self) -> list[int]:
        """Policy-generated tokens per segment (summaries count in the segment they close)."""
        first = self.starts[0].segment_idx
        counts = [0] * self.n_segments
        for turn in self.turns:
            counts[turn.segment_idx - first] += turn.generated_tokens
        return counts

    def transcript(self) -> str:
        return "\n".join(f"[{t.role}] {t.text}" for t in self.turns)


@runtime_checkable
class TranscriptActor(Protocol):
    """An actor that writes each message from the environment and the episode's transcript instead of sampling
    from the context's tokens: the scripted expert and the random agent (``scripted.ScriptedActor``). Everything
    else that writes the policy messages is a model, a ``Policy``, and generates from the context's ids."""

    tokenizer: Any

    def respond(self, env: ToolEnv, task: Task, history: Sequence[tuple[str, str]], notes: Sequence[str],
                summarizing: bool) -> Generation: ...


class ChatRenderer:
    """Token ids of a conversation, extended message by message without re-tokenizing the past."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[dict[str, str]], *, generation_prompt: bool) -> list[int]:
        return chat_ids(self.tokenizer, messages, add_generation_prompt=generation_prompt)

    def suffix(self, before: Sequence[dict[str, str]], new: Sequence[dict[str, str]]) -> list[int]:
        """The ids that ``new`` messages (then the generation prompt) add after ``before``.

        Requires a template whose rendering of a conversation starts with the rendering of any of
        its prefixes (true when messages are delimited by special tokens).
        """
        head = self.render(before, generation_prompt=False)
        full = self.render([*before, *new], generation_prompt=True)
        if full[: len(head)] != head:
            raise ValueError(
                "the chat template does not render conversations incrementally (a prefix renders "
                "differently inside a longer conversation); use a template whose messages are "
                "delimited by special tokens"
            )
        return full[len(head):]


@dataclass
class _Active:
    """An episode in progress."""

    episode: AgentEpisode
    env: ToolEnv
    messages: list[dict[str, str]]
    ids: list[int]  # rendered context, ending with the generation prompt
    segment_idx: int
    turn_idx: int
    turns_in_segment: int = 0
    history: list[tuple[str, str]] = field(default_factory=list)  # (action, observation)
    notes: list[str] = field(default_factory=list)
    summarizing: bool = False
    seed: int = 0  # the episode's sampling seed and its sample index under it (``AgentRunner.run``)
    sample: int = 0
    sampled: int = 0  # messages generated so far: with ``seed``, the seed of the next one


class AgentRunner:
    """Runs episodes of an actor in an environment, with the context manager and full recording."""

    def __init__(self, actor: Policy | TranscriptActor, env_factory: Callable[[], ToolEnv],
                 config: AgentConfig | None = None):
        self.actor, self.env_factory = actor, env_factory
        self.config = config or AgentConfig()
        self.renderer = ChatRenderer(actor.tokenizer)
        self.stop_ids = end_of_turn_ids(actor.tokenizer)
        self.trailer_ids = self._assistant_trailer()

    # -- starting points ----------------------------------------------------------------------

    def initial_state(self, task: Task, env: ToolEnv) -> SegmentStart:
        messages, ids = self.observation_context(task, env.system_prompt(), env.first_observation(task))
        return SegmentStart(task, 0, 0, 0, messages, tuple(ids))

    def observation_context(self, task: Task, system_prompt: str, observation: str | None
                            ) -> tuple[tuple[dict[str, str], ...], list[int]]:
        """[system, task prompt + newline + observation] and its ids ending with the generation prompt: the first
        context of every episode (with the environment's ``first_observation``), and in ``observation`` mode the
        context after every turn (with the turn's observation)."""
        content = task.prompt if observation is None else f"{task.prompt}\n{observation}"
        messages = ({"role": "system", "content": system_prompt}, {"role": "user", "content": content})
        return messages, self.renderer.render(messages, generation_prompt=True)

    def _begin(self, start: SegmentStart, env: ToolEnv, parent: SegmentStart | None) -> _Active:
        env.reset(start.task)
        history = []
        for call in start.calls:  # bring the environment to the state's point of the transcript
            observation, _, done, _ = env.step(call)
            if done:
                raise ValueError(f"state {start.state_id}: replaying its calls ended the episode at {call!r}; the "
                                 "environment is not deterministic, or the calls are not this task's")
            history.append((call, observation))
        episode = AgentEpisode(task=start.task, parent_state=parent)
        episode.starts.append(start)
        episode.turns.append(TurnRecord("context", _last_text(start.messages), list(start.context_ids),
                                        [0.0] * len(start.context_ids), [0] * len(start.context_ids),
                                        start.segment_idx, start.turn_idx))
        return _Active(episode, env, list(start.messages), list(start.context_ids), start.segment_idx,
                       start.turn_idx, history=history)

    # -- running ------------------------------------------------------------------------------

    def run(self, tasks: Sequence[Task] = (), *, starts: Sequence[SegmentStart] = (), seed: int = 0,
            episode_seeds: Sequence[tuple[int, int]] | None = None,
            progress: Callable[[RunProgress], None] | None = None, ledger: BudgetLedger | None = None,
            kind: str = "main", round_idx: int = 0) -> list[AgentEpisode]:
        """Play one episode per task from its initial state, and one continuation per given start.

        Each episode samples from its ``episode_seeds`` entry, a pair (seed, index): its messages are samples
        ``index`` of seeds derived from ``seed`` and the message count. By default the episodes that start
        from one context are indices 0, 1, ... of a seed derived from ``seed`` and the first one's position.
        So an episode draws the same tokens whichever other episodes share its batches: a stage may split its
        episodes over workers (``tasks/fanout.py``) and still write the serial tables. Episodes with one seed
        and the same prompt (a state's continuations, a task's group at its first turn) are drawn together,
        n samples of one prefix.

        With a ``ledger``, every generated token is charged to it (actions as ``kind``, compression
        summaries as ``summary``) and the budget is never exceeded, without reserving more than the tokens
        generation actually needs (``_step_within_budget``). An episode the budget truly cannot pay for is cut
        off (``truncated`` and ``budget_cut`` set, reward 0); which one is random, from ``seed``.
        """
        active = []
        for task in tasks:
            env = self.env_factory()
            active.append(self._begin(self.initial_state(task, env), env, None))
        for start in starts:
            active.append(self._begin(start, self.env_factory(), start))
        if episode_seeds is None:  # episodes that start from one context: samples 0, 1, ... of one seed
            first: dict[tuple[int, ...], list[int]] = {}  # context -> [first position, episodes so far]
            episode_seeds = []
            for k, a in enumerate(active):
                seen = first.setdefault(tuple(a.ids), [k, 0])
                episode_seeds.append((mix_seed(seed, seen[0]), seen[1]))
                seen[1] += 1
        if len(episode_seeds) != len(active):
            raise ValueError(f"episode_seeds: got {len(episode_seeds)} for {len(active)} episodes; give one each")
        for a, (episode_seed, index) in zip(active, episode_seeds, strict=True):
            a.seed, a.sample = int(episode_seed), int(index)
        episodes = [a.episode for a in active]
        step = 0

        def report(finished: int) -> None:
            if progress:
                progress(RunProgress(finished, len(episodes), step, sum(e.generated_tokens for e in episodes)))

        while active:
            for a in active:
                self._maybe_start_compression(a)
            if ledger is None:
                self._generate(active)
            else:
                self._step_within_budget(active, ledger, mix_seed(seed, step), kind, round_idx)
            active = [a for a in active if not (a.episode.done or a.episode.truncated)]
            step += 1
            report(len(episodes) - len(active))
        return episodes

    def _step_tokens(self, a: _Active) -> int:
        return self.config.max_summary_tokens if a.summarizing else self.config.max_action_tokens

    def _step_within_budget(self, active: list[_Active], ledger: BudgetLedger, seed: int, kind: str,
                            round_idx: int) -> None:
        """One step of every active episode, paid from ``ledger`` without ever overspending it.

        Episodes go in a random order (``seed``). Each sub-batch is the longest run of that order whose
        worst case (``max_action_tokens`` each) fits what is left; the ledger is then charged what was
        actually generated, so the next sub-batch sees the true remainder — a reservation never
        outlives its sub-batch. Once not even one worst case fits, the next episode generates alone
        with at most the tokens left; if it needed more (no end token within them), it is cut. When
        nothing is left, the rest are cut: the cut falls on random episodes, not on the last started.
        """
        if sum(self._step_tokens(a) for a in active) <= ledger.remaining:
            order = list(active)  # the whole step fits: generate it as an unbudgeted run would
        else:
            order = [active[i] for i in np.random.default_rng(seed).permutation(len(active))]
        while order:
            take, worst = 0, 0
            while take < len(order) and worst + self._step_tokens(order[take]) <= ledger.remaining:
                worst += self._step_tokens(order[take])
                take += 1
            cap = None
            if take == 0:
                if ledger.remaining == 0:
                    for a in order:
                        a.episode.truncated = a.episode.budget_cut = True
                    return
                take, cap = 1, ledger.remaining
            batch, order = order[:take], order[take:]
            before = [(a.episode.generated_tokens, a.summarizing) for a in batch]
            self._generate(batch, cap=cap)
            for a, (tokens, summary) in zip(batch, before, strict=True):
                spent = a.episode.generated_tokens - tokens
                ledger.charge("summary" if summary else kind, spent, round_idx=round_idx)
                if cap is not None and spent >= cap and not a.episode.done and not self._ended_turn(a):
                    a.episode.truncated = a.episode.budget_cut = True

    def _ended_turn(self, a: _Active) -> bool:
        """Whether the last generated message ended with an end-of-turn token (it was not cut short)."""
        generated = [t for t in a.episode.turns if t.role in ("policy", "summary")]
        return bool(generated) and bool(generated[-1].token_ids) and generated[-1].token_ids[-1] in self.stop_ids

    def _maybe_start_compression(self, a: _Active) -> None:
        cfg = self.config
        reserve = cfg.max_action_tokens + cfg.max_summary_tokens
        due = len(a.ids) + reserve > cfg.context_max_tokens or a.turns_in_segment >= cfg.compress_every_turns
        if cfg.compression == "observation":  # the Markov context: a new segment after every turn
            if a.turns_in_segment:
                self._restart_segment(a, a.history[-1][1])
            return
        if not due or a.turns_in_segment == 0:
            return
        if cfg.compression == "notes":
            self._restart_segment(a, summarize_notes(a.notes, a.history))
            return
        request = {"role": "user", "content": COMPRESS_REQUEST}
        ids = self.renderer.suffix(a.messages, [request])
        a.messages.append(request)
        a.ids += ids
        a.episode.turns.append(TurnRecord("context", COMPRESS_REQUEST, ids, [0.0] * len(ids), [0] * len(ids),
                                          a.segment_idx, a.turn_idx))
        a.summarizing = True

    def _generate(self, active: list[_Active], cap: int | None = None) -> None:
        if isinstance(self.actor, TranscriptActor):  # the expert reads the task and history, not tokens
            for a in active:
                sample = self.actor.respond(a.env, a.episode.task, a.history, a.notes, a.summarizing)
                if cap is not None and len(sample.token_ids) > cap:  # the budget's last tokens: cut like a model's
                    sample = Generation(sample.token_ids[:cap], sample.logprobs[:cap], "length")
                self._consume(a, sample)
            return
        # Episodes drawn together: the same prompt, seed and message count, consecutive sample indices — the
        # continuations of one state, a task's group at its first turn. One prefix, n samples.
        keyed: dict[tuple, list[_Active]] = {}
        for a in active:
            keyed.setdefault((tuple(a.ids), a.seed, a.sampled), []).append(a)
        groups: list[list[_Active]] = []
        for members in keyed.values():
            members.sort(key=lambda a: a.sample)
            run = [members[0]]
            for a in members[1:]:
                if a.sample == run[-1].sample + 1:
                    run.append(a)
                else:
                    groups.append(run)
                    run = [a]
            groups.append(run)
        by_size: dict[tuple[int, int], list[list[_Active]]] = {}
        for group in groups:
            budget = self.config.max_summary_tokens if group[0].summarizing else self.config.max_action_tokens
            budget = budget if cap is None else min(budget, cap)
            by_size.setdefault((budget, len(group)), []).append(group)
        # One call per (token budget, group size), so every group gets exactly as many samples as it has members.
        for (budget, n), batch in sorted(by_size.items()):
            outputs = self.actor.generate(
                [g[0].ids for g in batch], n=n, max_new_tokens=budget, temperature=self.config.temperature,
                top_p=self.config.top_p, stop_token_ids=self.stop_ids,
                seed=[mix_seed(g[0].seed, g[0].sampled) for g in batch], first_sample=[g[0].sample for g in batch],
            )
            for group, samples in zip(batch, outputs, strict=True):
                for a, sample in zip(group, samples, strict=True):
                    self._consume(a, sample)

    def _consume(self, a: _Active, sample: Generation) -> None:
        text = self.actor.tokenizer.decode(sample.token_ids, skip_special_tokens=True).strip()
        record = TurnRecord("summary" if a.summarizing else "policy", text, list(sample.token_ids),
                            list(sample.logprobs), [1] * len(sample.token_ids), a.segment_idx, a.turn_idx,
                            is_compression=a.summarizing)
        a.episode.turns.append(record)
        a.sampled += 1
        a.messages.append({"role": "assistant", "content": text})
        a.ids += list(sample.token_ids)
        # Template tokens after the message: what follows an end token ("\n" in ChatML), or the end
        # itself when the message was cut at the token limit. Recorded with the next tool turn (mask 0).
        stopped = bool(sample.token_ids) and sample.token_ids[-1] in self.stop_ids
        glue = self.trailer_ids if stopped else self._close_assistant_turn(a)
        if a.summarizing:
            a.summarizing = False
            self._restart_segment(a, text)
            return
        observation, reward, done, info = a.env.step(text)
        a.history.append((text, observation))
        a.notes.append(note(observation))
        a.turn_idx += 1
        a.turns_in_segment += 1
        a.episode.n_tool_calls += 1
        tool_message = {"role": "tool", "content": observation}
        ids = glue + self.renderer.suffix(a.messages, [tool_message])
        a.messages.append(tool_message)
        a.ids += ids
        a.episode.turns.append(TurnRecord("tool", observation, ids, [0.0] * len(ids), [0] * len(ids),
                                          a.segment_idx, a.turn_idx))
        if done:
            a.episode.done, a.episode.reward = True, float(reward)
        elif a.turn_idx >= self.config.max_turns or len(a.ids) + self.config.max_action_tokens > self._context_limit():
            a.episode.truncated = True

    def _assistant_trailer(self) -> list[int]:
        """Ids the chat template renders after the end token of an assistant message."""
        ids = self.renderer.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                   generation_prompt=False)
        ends = [i for i, token in enumerate(ids) if token in self.stop_ids]
        return ids[ends[-1] + 1:] if ends else []

    def _close_assistant_turn(self, a: _Active) -> list[int]:
        """Ids the template puts after an assistant message that was cut at the token limit."""
        full = self.renderer.render(a.messages, generation_prompt=False)
        without = self.renderer.render(a.messages[:-1], generation_prompt=True)
        text_ids = self.actor.tokenizer.encode(a.messages[-1]["content"], add_special_tokens=False)
        return full[len(without) + len(text_ids):] if full[: len(without)] == without else []

    def _restart_segment(self, a: _Active, summary: str) -> None:
        task = a.episode.task
        if self.config.compression == "observation":  # ``summary`` is the last observation
            messages, ids = self.observation_context(task, a.messages[0]["content"], summary)
        else:
            messages = (a.messages[0], {"role": "user", "content": f"{task.prompt}\n{NOTES_HEADER}\n{summary}"})
            ids = self.renderer.render(messages, generation_prompt=True)
        # Counted from the main episode's start: a continuation starts with its parent's count.
        generated = a.episode.starts[0].generated_tokens + a.episode.generated_tokens
        a.segment_idx += 1
        calls = a.episode.starts[0].calls + tuple(t.text for t in a.episode.turns if t.role == "policy")
        start = SegmentStart(task, a.segment_idx, a.turn_idx, generated, messages, tuple(ids), calls)
        a.episode.starts.append(start)
        a.episode.turns.append(TurnRecord("context", messages[-1]["content"], ids, [0.0] * len(ids),
                                          [0] * len(ids), a.segment_idx, a.turn_idx))
        a.messages, a.ids, a.turns_in_segment = list(messages), list(ids), 0
        a.notes.clear()

    def _context_limit(self) -> int:
        return getattr(self.actor, "max_context", 1 << 30)


def mix_seed(seed: int, index: int) -> int:
    """A 63-bit seed from (seed, index), the same in every process: episode ``index``'s seed of a ``run(seed=...)``,
    and an episode's seed for its ``index``-th message."""
    digest = hashlib.blake2b(f"focus.episode:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _last_text(messages: Sequence[dict[str, str]]) -> str:
    return messages[-1]["content"] if messages else ""
