"""The trap MDPs as pipeline environments, and the exact held-out value of an LM policy on them.

Environments (``env.name``), each a ``ToolEnv`` around a trap of ``focus_core.envs.traps``, whose tabular MDP
(exact V^π of every state, for any ``TabularPolicy``) ``exact_value_model`` builds and ``make_trap_env(name)``
reaches through the registry:

* ``combination_lock`` - ``CombinationLock(clues=True)``: 6 dials, 3 symbols; each dial shows a clue word whose
  family decides the right symbol by a fixed mapping, the same for every lock (``Lock: dial 3 of 6. Set so far:
  1=A 2=B. Dial 3 shows ember.``). A wrong symbol silently dooms the lock, which plays on for ``delay`` (2) more
  dials before it ends with reward 0.
* ``lookup_chain`` - ``LookupChain(hops=3, turn_budget=10, noise=0, show_turn=False)``: a 3-hop question over
  made-up names; per hop a search, then a read, with detours, early answers, a look-alike read at hop 2 that
  poisons the chain (only the final answer fails) and a look-alike final answer. Its menus are listed in
  alphabetical order, so where the right search or read sits is a rule learnable across questions; which of
  two look-alike names is the right one must be read off the notes.

Tasks. One task per instance, drawn by the trap's structure seed: train seeds ``0 .. train_tasks-1``, held-out
seeds from 1,000,000 on (``heldout_tasks`` of them; a held-out instance equal to a train one is skipped). What
decides the right action is in the observation under a seed-independent rule (the clue families; the menus'
wording and order and the notes), so a policy trained on train seeds can solve held-out ones.

Protocol. An observation is the list of actions, each with its call, then the trap's text::

    Actions:
    - first(): set dial 3 to A
    - second(): set dial 3 to B
    - third(): set dial 3 to C
    Lock: dial 3 of 6. Set so far: 1=A 2=B. Dial 3 shows ember.

The first one follows the task prompt (``first_observation``). The calls are argument-free tools named by their
place in the list, so the first token the policy writes is its decision, and the decisive text is last, next
to where it writes; prompts are short, because a from-scratch tiny model finds the decisive word in a short
context and not in a long one. The message the harness decodes must equal a listed call. Anything else - a
malformed call, another spelling (``third( )``), a call not on the list - is an *off-menu* message: its
observation is the unchanged one followed by the fixed line ``Error: not one of the listed calls.``; it uses one
agent turn (``agent.max_turns``), no turn of the trap, and leaves the trap's state as it was. Transitions are
deterministic, so a branch replays its calls. The scripted expert plays the optimal action (the clue's symbol;
the advancing search, read or answer) from any history; SFT's injected mistakes are random calls among
``first()`` .. ``sixth()``, so some are wrong actions and some off-menu.

Exact evaluation (``ExactEvaluator``, ``exact_evaluation``). With ``agent.compression: observation`` (the Markov
context) the policy's context at a state is [system, task prompt + newline + the state's observation], a
function of (trap state, whether the last message was off-menu). For each such context reachable from s_0,
every listed call is scored by teacher forcing at the sampling temperature: its canonical token ids
(``tokenizer.encode(message)``, what the scripted expert writes and SFT teaches) followed by any of the
sampler's stop tokens, giving p(a|s); the rest, 1 - Σ_a p(a|s), is the probability of an off-menu message.
Scoring is one ``score_batch`` over all contexts (shared prefixes computed once). A memoised recursion over
(trap state, agent turns taken, off-menu flag) then gives V^π(s_0) exactly: an off-menu message repeats the
state one agent turn later, and an episode unfinished after ``agent.max_turns`` turns gets reward 0, as in the
harness. It needs ``top_p = 1`` (no nucleus) and contexts short enough that the harness's context-length cut
can never apply (checked). ``values_at`` runs the same recursion from any state of a sampled episode (its
messages replayed, its turns counted): the exact values the ``exact_values`` diagnostic puts in place of V̂.

The one assumption: a message counts as a listed action only through its canonical tokenization. A sample that
decodes (the harness strips whitespace and special tokens) to a listed call through other token ids is
accepted by the environment but counted as off-menu by the recursion (rare: e.g. a model that emits an extra
special token before the call).
"""

from __future__ import annotations

import abc
import functools
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from focus_core.agent.toolcall import ToolCall, ToolSpec
from focus_core.envs import register_env
from focus_core.envs.base import Task, ToolEnv, ToolFailure, ToolResult
from focus_core.envs.traps import CombinationLock, ExactValueEnv, LookupChain, Paraphrased
from focus_core.ids import task_id

GENERATOR_VERSION = 1  # bump when tasks change; part of every task id
HELDOUT_SEED_START = 1_000_000  # held-out structure seeds start here; train seeds are 0 .. train_tasks - 1
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth")  # one argument-free tool per menu place
PICK_TOOLS = tuple(ToolSpec(word, f"take the {word} listed action") for word in ORDINALS)
OFF_MENU = "Error: not one of the listed calls."  # fixed: the context after it is a function of the state


@functools.lru_cache(maxsize=64)
def choose_message(position: int) -> str:
    """The message that picks the action listed at ``position`` (1-based): ``second()`` for 2."""
    return ToolCall(ORDINALS[position - 1]).render()


@functools.lru_cache(maxsize=8192)
def _trap(kind: type[ExactValueEnv], options: tuple[tuple[str, Any], ...], seed: int) -> ExactValueEnv:
    return kind(**dict(options), seed=seed)


class TrapToolEnv(ToolEnv):
    """A trap MDP behind the tool protocol: one task per structure seed, menus picked by ``first()``, ..."""

    tools = PICK_TOOLS
    has_exact_values = True
    trap_class: ClassVar[type[ExactValueEnv]]
    defaults: ClassVar[dict[str, Any]]  # trap constructor arguments (all but the seed)
    prompt: ClassVar[str]

    def __init__(self, tier: str = "default", *, train_tasks: int = 512, heldout_tasks: int = 128,
                 **trap_options: Any) -> None:
        super().__init__(tier)
        unknown = sorted(set(trap_options) - set(self.defaults))
        if unknown:
            raise ValueError(f"{self.name}: unknown option(s) {', '.join(unknown)} (allowed: train_tasks, "
                             f"heldout_tasks, {', '.join(self.defaults)})")
        if train_tasks < 1 or heldout_tasks < 1:
            raise ValueError(f"{self.name}: train_tasks and heldout_tasks must be >= 1")
        self.train_tasks, self.heldout_tasks = train_tasks, heldout_tasks
        self.options = {**self.defaults, **trap_options}
        self._check_options()
        self._tasks: dict[str, list[Task]] = {}
        self._trap_now: ExactValueEnv | None = None
        self._state: Hashable = None

    @classmethod
    def exact_value_model(cls, *, paraphrase: bool = False, **trap_options: Any) -> ExactValueEnv:
        """The tabular MDP itself, with exact state values: ``trap_class`` built from ``trap_options`` over the trap's
        own constructor defaults (not ``defaults``, which are this environment's); ``paraphrase=True`` wraps it in
        ``Paraphrased``. ``make_trap_env(name)`` reaches it through the registry."""
        trap = cls.trap_class(**trap_options)
        return Paraphrased(trap) if paraphrase else trap

    # -- what each trap defines --------------------------------------------------------------------------------

    def _check_options(self) -> None:
        """Reject options the protocol cannot serve."""

    @abc.abstractmethod
    def instance_key(self, trap: ExactValueEnv) -> str:
        """The structure that makes an instance (its split key): two seeds with equal keys are the same task."""

    @abc.abstractmethod
    def answer_of(self, trap: ExactValueEnv) -> str: ...

    @abc.abstractmethod
    def expert_index(self, trap: ExactValueEnv, state: Hashable) -> int:
        """The trap action index the scripted expert plays (optimal where the state is not lost yet)."""

    def display_order(self, trap: ExactValueEnv, state: Hashable) -> list[int]:
        """Trap action indices in the order the menu lists them."""
        return list(range(len(trap.action_menu(state))))

    # -- the MDP as the agent sees it --------------------------------------------------------------------------

    def trap_of(self, task: Task) -> ExactValueEnv:
        return _trap(self.trap_class, tuple(sorted(self.options.items())), int(task.facts["seed"]))

    def render(self, trap: ExactValueEnv, state: Hashable) -> str:
        """The observation of a state: the listed actions with their calls, then the trap's text (no list once the
        episode is over). The text comes last, next to where the policy answers: a tiny model reads what is near."""
        if trap.is_terminal(state):
            return trap.observation(state)
        menu = trap.action_menu(state)
        lines = [f"- {choose_message(k)}: {menu[index]}" for k, index in enumerate(self.display_order(trap, state), 1)]
        return "\n".join(["Actions:", *lines, trap.observation(state)])

    def observation_of(self, trap: ExactValueEnv, state: Hashable, off_menu: bool) -> str:
        """What the agent is shown at ``state``; ``off_menu``: right after an off-menu message."""
        # After the menu: the context after an off-menu message extends the state's own (scoring shares it).
        return f"{self.render(trap, state)}\n{OFF_MENU}" if off_menu else self.render(trap, state)

    def menu_messages(self, trap: ExactValueEnv, state: Hashable) -> list[tuple[str, int]]:
        """(message, trap action index) of each listed action, in menu order."""
        return [(choose_message(k), index) for k, index in enumerate(self.display_order(trap, state), 1)]

    def action_of(self, trap: ExactValueEnv, state: Hashable, text: Any) -> int | None:
        """The trap action a message picks, or None for an off-menu message (not exactly a listed call)."""
        if not isinstance(text, str) or trap.is_terminal(state):
            return None
        return next((index for message, index in self.menu_messages(trap, state) if message == text), None)

    def transition(self, trap: ExactValueEnv, state: Hashable, index: int) -> tuple[Hashable, float, bool]:
        outcomes = trap.transitions(state, index)
        if len(outcomes) != 1:
            raise RuntimeError(f"{self.name}: a stochastic transition; branches replay calls, so the trap must be "
                               "deterministic")
        _, next_state, reward, done = outcomes[0]
        return next_state, float(reward), bool(done)

    def replay(self, task: Task, messages: Sequence[str]) -> Hashable:
        """The trap state after ``messages`` (off-menu ones change nothing)."""
        return self.position(task, messages)[0]

    def position(self, task: Task, messages: Sequence[str]) -> tuple[Hashable, bool]:
        """The trap state after ``messages``, and whether the last of them was off-menu (what the agent is shown)."""
        trap = self.trap_of(task)
        state, off_menu = trap.initial_state(), False
        for text in messages:
            index = self.action_of(trap, state, text)
            off_menu = index is None
            if index is not None:
                state = self.transition(trap, state, index)[0]
        return state, off_menu

    # -- ToolEnv -----------------------------------------------------------------------------------------------

    def system_prompt(self) -> str:
        # Short on purpose, like the prompts: a from-scratch tiny model finds the decisive word only in a short context.
        return "Reply with one of the listed calls."

    def tasks(self, split: str, tier: str | None = None) -> list[Task]:
        tier = tier or "default"
        if split not in ("train", "heldout") or tier not in self.tiers:
            raise ValueError(f"split must be train/heldout and tier one of {list(self.tiers)}")
        if split not in self._tasks:
            self._tasks[split] = self._generate(split, tier)
        return list(self._tasks[split])

    def _generate(self, split: str, tier: str) -> list[Task]:
        options = tuple(sorted(self.options.items()))
        train_keys = set() if split == "train" else {t.split_key for t in self.tasks("train", tier)}
        seeds = range(self.train_tasks) if split == "train" else range(HELDOUT_SEED_START, 2**31)
        tasks, wanted = [], self.train_tasks if split == "train" else self.heldout_tasks
        for seed in seeds:
            if len(tasks) == wanted:
                break
            trap = _trap(self.trap_class, options, seed)
            key = self.instance_key(trap)
            if split == "heldout" and key in train_keys:
                continue
            tasks.append(Task(task_id(self.name, GENERATOR_VERSION, tier, seed, options), self.name, split, tier,
                              self.prompt, self.answer_of(trap), key, {"seed": seed}))
        return tasks

    def first_observation(self, task: Task) -> str:
        trap = self.trap_of(task)
        return self.render(trap, trap.initial_state())

    def reset(self, task: Task) -> str:
        observation = super().reset(task)
        self._trap_now = self.trap_of(task)
        self._state = self._trap_now.initial_state()
        return observation

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.task is None:
            raise RuntimeError("call reset(task) before step()")
        if self.done:
            return self._error("the episode is over")
        trap, state = self._trap_now, self._state
        index = self.action_of(trap, state, action_text)
        if index is None:
            return self.observation_of(trap, state, True), 0.0, False, {"error": "off-menu message"}
        self._state, reward, self.done = self.transition(trap, state, index)
        return self.render(trap, self._state), reward, self.done, {"tool": action_text[:-2], "action_index": index}

    def run_tool(self, call: ToolCall) -> ToolResult:
        raise ToolFailure("trap environments read the message itself (step), not a parsed call")

    def expert_action(self, task: Task, history: list[tuple[str, str]]) -> str:
        trap = self.trap_of(task)
        state = self.replay(task, [action for action, _ in history])
        if trap.is_terminal(state):
            return choose_message(1)
        wanted = self.expert_index(trap, state)
        return next(message for message, index in self.menu_messages(trap, state) if index == wanted)


@register_env("combination_lock")
class CombinationLockEnv(TrapToolEnv):
    trap_class = CombinationLock
    defaults = {"horizon": 6, "n_symbols": 3, "delay": 2, "clues": True}
    prompt = "Open the lock."

    def _check_options(self) -> None:
        if not self.options["clues"]:
            raise ValueError("combination_lock: clues=false leaves nothing in the observation that decides the "
                             "right symbol, so no held-out lock could be learned (fix: clues: true)")

    def instance_key(self, trap: CombinationLock) -> str:
        return " ".join(trap.clues)

    def answer_of(self, trap: CombinationLock) -> str:
        return "".join("ABCDEF"[symbol] for symbol in trap.combination)

    def expert_index(self, trap: CombinationLock, state) -> int:
        return trap.combination[len(state.entered)]  # the clue's symbol (also on a doomed lock, which looks live)


@register_env("lookup_chain")
class LookupChainEnv(TrapToolEnv):
    trap_class = LookupChain
    defaults = {"hops": 3, "turn_budget": 10, "noise": 0.0, "show_turn": False}
    prompt = "Answer the question."

    def _check_options(self) -> None:
        if self.options["noise"] != 0.0:
            raise ValueError("lookup_chain: noise must be 0: branches replay calls, so searches must be deterministic")

    def instance_key(self, trap: LookupChain) -> str:
        return " / ".join(trap.true_chain)

    def answer_of(self, trap: LookupChain) -> str:
        return trap.answer

    def display_order(self, trap: LookupChain, state) -> list[int]:
        menu = trap.action_menu(state)
        return sorted(range(len(menu)), key=lambda index: menu[index])

    def expert_index(self, trap: LookupChain, state) -> int:
        kinds = [trap.action_kind(state, index) for index in range(len(trap.action_menu(state)))]
        return kinds.index("advance")


# ----------------------------------------------------------------------------------------------------------------
# Exact evaluation
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExactEvaluation:
    """V^π(s_0) of each task, and what computing it took."""

    values: np.ndarray
    contexts: int  # distinct contexts scored
    nodes: int  # (trap state, agent turns, off-menu flag) nodes the recursion visited
    off_menu_mass: float  # mean over scored contexts of 1 - Σ_a p(a|s)
    score_seconds: float
    seconds: float


class ExactEvaluator:
    """Exact V^π of a policy on a trap environment through the agent harness (see the module docstring).

    ``agent`` is the harness configuration the sampled episodes use (its temperature is the one scored). The
    policy needs ``tokenizer`` and ``score`` (``score_batch`` when it has one, which is much faster).
    """

    def __init__(self, policy: Any, env: TrapToolEnv, agent: Any) -> None:
        from focus_core.agent.harness import AgentRunner  # the harness imports the environments' base

        if agent.compression != "observation":
            raise ValueError("exact evaluation needs the Markov context: agent.compression=observation (otherwise "
                             "the policy's context is not a function of the environment's state)")
        if agent.top_p != 1.0:
            raise ValueError(f"exact evaluation scores the sampling distribution without a nucleus; agent.top_p="
                             f"{agent.top_p} (fix: top_p=1)")
        self.policy, self.env, self.agent = policy, env, agent
        self.runner = AgentRunner(policy, lambda: env, agent)
        self.stop_ids = sorted(self.runner.stop_ids)
        self._message_ids: dict[str, list[int]] = {}
        self._system = env.system_prompt()
        self.scored_contexts = 0

    def message_ids(self, message: str) -> list[int]:
        """The canonical token ids of a menu message (without the stop token)."""
        ids = self._message_ids.get(message)
        if ids is None:
            ids = self.policy.tokenizer.encode(message, add_special_tokens=False)
            if len(ids) >= self.agent.max_action_tokens:
                raise ValueError(f"exact evaluation: {message!r} has {len(ids)} tokens, so with its stop token it "
                                 f"does not fit agent.max_action_tokens={self.agent.max_action_tokens}")
            self._message_ids[message] = ids
        return ids

    def context_ids(self, task: Task, state: Hashable, off_menu: bool) -> tuple[int, ...]:
        """The ids the harness feeds the policy at ``state`` (ending with the generation prompt)."""
        observation = self.env.observation_of(self.env.trap_of(task), state, off_menu)
        return tuple(self.runner.observation_context(task, self._system, observation)[1])

    def _live(self, trap: ExactValueEnv, state: Hashable) -> bool:
        return not trap.is_terminal(state) and trap.known_value(state) != 0.0

    def _moves(self, task: Task) -> dict[Hashable, list[tuple[Hashable, float, bool, bool]]]:
        """Every live state reachable from s_0, with (next state, reward, done, next is live) of each listed
        action in menu order. Off-menu messages add no states: they leave the trap's state as it was."""
        trap = self.env.trap_of(task)
        moves: dict[Hashable, list[tuple[Hashable, float, bool, bool]]] = {}
        frontier = [trap.initial_state()]
        while frontier:
            state = frontier.pop()
            if state in moves:
                continue
            row = []
            for _, index in self.env.menu_messages(trap, state):
                next_state, reward, done = self.env.transition(trap, state, index)
                live = not done and self._live(trap, next_state)
                row.append((next_state, reward, done, live))
                if live and next_state not in moves:
                    frontier.append(next_state)
            moves[state] = row
        return moves

    def action_probabilities(self, keyed: Sequence[tuple[Task, Hashable, bool]]) -> list[np.ndarray]:
        """p(a|s) per listed action of each (task, state, off-menu flag), scored in one batch."""
        contexts: dict[tuple[int, ...], int] = {}
        rendered: dict[tuple[str, str], tuple[int, ...]] = {}
        index_of, prompts, completions = [], [], []
        for task, state, off_menu in keyed:
            text = self.env.observation_of(self.env.trap_of(task), state, off_menu)
            ids = rendered.get((task.prompt, text))
            if ids is None:  # states that look the same share one rendering
                ids = rendered[(task.prompt, text)] = self.context_ids(task, state, off_menu)
            if ids not in contexts:
                contexts[ids] = len(prompts)
                trap = self.env.trap_of(task)
                prompts.append(list(ids))
                completions.append([[*self.message_ids(message), stop]
                                    for message, _ in self.env.menu_messages(trap, state) for stop in self.stop_ids])
            index_of.append(contexts[ids])
        self.scored_contexts = len(prompts)
        longest = max((len(p) for p in prompts), default=0)
        limit = getattr(self.policy, "max_context", None)
        # The harness checks the context length after appending the message and the observation, before it
        # restarts the context: keep that check from ever cutting an episode, which the recursion does not model.
        if limit is not None and 2 * longest + 2 * self.agent.max_action_tokens + 16 > limit:
            raise ValueError(f"exact evaluation: contexts of up to {longest} tokens could reach the policy's "
                             f"max_context={limit} inside a turn (fix: a larger model.max_context)")
        scored = self._score(prompts, completions)
        per_context = [np.exp(np.array([sum(lp) for lp in rows], dtype=np.float64))
                       .reshape(-1, len(self.stop_ids)).sum(axis=1) for rows in scored]
        return [per_context[i] for i in index_of]

    def _score(self, prompts: list[list[int]], completions: list[list[list[int]]]) -> list[list[list[float]]]:
        temperature = self.agent.temperature
        if hasattr(self.policy, "score_batch"):
            return self.policy.score_batch(prompts, completions, temperature=temperature)
        return [[self.policy.score(p, c, temperature=temperature) for c in options]
                for p, options in zip(prompts, completions, strict=True)]

    def evaluate(self, tasks: Sequence[Task]) -> ExactEvaluation:
        started = time.perf_counter()
        moves = [self._moves(task) for task in tasks]
        score_started = time.perf_counter()
        probabilities = self._probabilities(tasks, moves)
        score_seconds = time.perf_counter() - score_started
        values, nodes = [], 0
        for task, table, p in zip(tasks, moves, probabilities, strict=True):
            trap = self.env.trap_of(task)
            start = trap.initial_state()
            value, memo = self._value_function(task, table, p)
            values.append(value(start, 0, False) if self._live(trap, start) else 0.0)
            nodes += len(memo)
        off_mass = [max(0.0, 1.0 - float(row.sum())) for p in probabilities for row in p.values()]
        return ExactEvaluation(np.array(values), self.scored_contexts, nodes,
                               float(np.mean(off_mass)) if off_mass else 0.0, score_seconds,
                               time.perf_counter() - started)

    def values_at(self, points: Sequence[tuple[Task, Sequence[str], int]]) -> np.ndarray:
        """V^π at states of sampled episodes, each given as (task, the messages the policy sent before it, agent
        turns taken): the messages replay to the trap state and the off-menu flag, then the recursion of
        ``evaluate`` runs from there. A lost state (a doomed lock) is worth 0."""
        tasks = list({task.task_id: task for task, _, _ in points}.values())
        moves = [self._moves(task) for task in tasks]
        functions = {task.task_id: self._value_function(task, table, p)[0]
                     for task, table, p in zip(tasks, moves, self._probabilities(tasks, moves), strict=True)}
        table_of = {task.task_id: table for task, table in zip(tasks, moves, strict=True)}
        values = np.zeros(len(points))
        for i, (task, messages, turns) in enumerate(points):
            state, off_menu = self.env.position(task, messages)
            if state in table_of[task.task_id]:
                values[i] = functions[task.task_id](state, int(turns), off_menu)
            elif self._live(self.env.trap_of(task), state):
                raise ValueError(f"exact values: task {task.task_id} reaches a live state its move table lacks")
        return values

    def _probabilities(self, tasks: Sequence[Task], moves: Sequence[dict]
                       ) -> list[dict[tuple[Hashable, bool], np.ndarray]]:
        """p(a|s) of every (live state, off-menu flag) of each task's move table, scored in one batch."""
        keyed = [(task, state, off) for task, table in zip(tasks, moves, strict=True) for state in table
                 for off in (False, True)]
        per_task: dict[str, dict[tuple[Hashable, bool], np.ndarray]] = {task.task_id: {} for task in tasks}
        for (task, state, off), p in zip(keyed, self.action_probabilities(keyed), strict=True):
            per_task[task.task_id][(state, off)] = p
        return [per_task[task.task_id] for task in tasks]

    def _value_function(self, task: Task, moves: dict[Hashable, list[tuple[Hashable, float, bool, bool]]],
                        probabilities: dict[tuple[Hashable, bool], np.ndarray]
                        ) -> tuple[Callable[[Hashable, int, bool], float], dict]:
        """V^π(trap state, agent turns taken, off-menu flag) of a live state, by memoised recursion; and its memo."""
        max_turns = self.agent.max_turns
        memo: dict[tuple[Hashable, int, bool], float] = {}

        def value(state: Hashable, turns: int, off_menu: bool) -> float:
            key = (state, turns, off_menu)
            if key in memo:
                return memo[key]
            p = probabilities[(state, off_menu)]
            total, goes_on = 0.0, turns + 1 < max_turns  # the harness cuts an unfinished episode at max_turns
            for (next_state, reward, done, live), p_action in zip(moves[state], p, strict=True):
                if done:
                    total += p_action * reward
                elif live and goes_on:
                    total += p_action * value(next_state, turns + 1, False)
            off = max(0.0, 1.0 - float(p.sum()))
            if off > 0.0 and goes_on:
                total += off * value(state, turns + 1, True)
            memo[key] = total
            return total

        return value, memo


def exact_evaluation(policy: Any, env: ToolEnv, tasks: Sequence[Task], agent: Any) -> ExactEvaluation | None:
    """Exact V^π(s_0) of each task, or None when the environment has no exact values (not a trap environment)."""
    if not env.has_exact_values:
        return None
    return ExactEvaluator(policy, env, agent).evaluate(tasks)
