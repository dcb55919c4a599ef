"""Trap environments whose state values are exactly computable.

They measure what the critic and the branching budget are for: how far critic values V̂(s) are from the true
V^π(s), whether TD(λ) advantages get the right sign, and whether branching spends its budget on the states
that matter. Each environment is a small finite-horizon MDP rendered as text:

* a state is an immutable, hashable value that includes the turn count, so the state graph is acyclic;
* an observation is a short text from which the state's value can be read off by a critic that has learned
  the environment (e.g. which dial symbols are right), but not by a trivial rule;
* every state offers a menu of 2-6 action texts, and an action costs as many generated tokens as it has
  words (the budget's cost unit);
* the reward is sparse: 0 or 1, and only on the transition that ends the episode.

A policy is a ``TabularPolicy``: action probabilities per state. Because menus are small and horizons short,
V^π(s) = Σ_a π(a|s) Σ_s' p(s'|s,a) (r + V^π(s')) is computed exactly by memoised recursion
(``ExactValueEnv.exact_values``); states whose value is known in closed form (a lock already doomed, a chain
already poisoned) are not expanded. Episodes are cut into segments every ``segment_every`` turns, the way
context compression cuts agent rollouts, and ``Episode`` reports per-segment rewards and token counts.

``TextSession`` wraps an environment in the reset/step text protocol of the agent harness. Each MDP is reached
through the one registry: ``focus_core/envs/trap_tools.py`` registers it as a pipeline environment, and
``make_trap_env(name)`` (``focus_core/envs/__init__.py``) builds the MDP itself.
"""

from __future__ import annotations

import abc
import bisect
import dataclasses
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

State = Hashable
Transition = tuple[float, Any, float, bool]
"""(probability, next state, reward, done) of one outcome of an action."""


class TabularPolicy:
    """A fixed stochastic policy: per-state probabilities over ``env.action_menu(state)``.

    ``probabilities(state)`` must return a vector with one non-negative entry per menu item, summing to 1.
    Each distribution is validated once and memoised under ``memo_key(state)`` (default: the state itself).
    Pass a coarser key when many states share one distribution, e.g. the dial index of a combination lock,
    so that the memo stays small; states with equal keys must get equal distributions.
    """

    def __init__(
        self,
        env: ExactValueEnv,
        probabilities: Callable[[State], Sequence[float] | np.ndarray],
        *,
        memo_key: Callable[[State], Hashable] | None = None,
        name: str = "policy",
    ) -> None:
        self.env = env
        self.name = name
        self._probabilities_of = probabilities
        self._memo_key = memo_key
        self._memo: dict[Hashable, tuple[np.ndarray, list[float]]] = {}

    @classmethod
    def uniform(cls, env: ExactValueEnv) -> TabularPolicy:
        """Every action of the menu equally likely."""

        def menu_size(state: State) -> int:
            return len(env.action_menu(state))

        def uniform_over_menu(state: State) -> np.ndarray:
            return np.full(menu_size(state), 1.0 / menu_size(state))

        return cls(env, uniform_over_menu, memo_key=menu_size, name="uniform")

    def probabilities(self, state: State) -> np.ndarray:
        """The (read-only) action distribution at a non-terminal state."""
        return self._distribution(state)[0]

    def sample_action(self, state: State, rng: np.random.Generator) -> int:
        """Draw an action index at ``state`` with one uniform number from ``rng``."""
        cumulative = self._distribution(state)[1]
        return bisect.bisect_right(cumulative, rng.random())

    def _distribution(self, state: State) -> tuple[np.ndarray, list[float]]:
        key = state if self._memo_key is None else self._memo_key(state)
        entry = self._memo.get(key)
        if entry is None:
            probabilities = self._validated_probabilities(state)
            # Scaled so the last entry is exactly 1: a uniform number in [0, 1) always lands on an action
            # with positive probability.
            cumulative = np.cumsum(probabilities)
            entry = (probabilities, (cumulative / cumulative[-1]).tolist())
            self._memo[key] = entry
        return entry

    def _validated_probabilities(self, state: State) -> np.ndarray:
        menu_size = len(self.env.action_menu(state))
        probabilities = np.array(self._probabilities_of(state), dtype=np.float64)
        valid = (
            menu_size > 0
            and probabilities.shape == (menu_size,)
            and bool(np.all(np.isfinite(probabilities)))
            and bool(np.all(probabilities >= 0.0))
            and abs(probabilities.sum() - 1.0) <= 1e-6
        )
        if not valid:
            raise ValueError(
                f"policy {self.name!r} gave {probabilities!r} at state {state!r} with a menu of {menu_size} "
                f"actions; expected one non-negative probability per action, summing to 1"
            )
        probabilities /= probabilities.sum()
        probabilities.setflags(write=False)
        return probabilities


@dataclass
class Episode:
    """One sampled episode (or continuation from a given start state).

    ``states`` has one entry per turn plus the state reached last (terminal unless the episode was truncated);
    ``actions``, ``rewards`` and ``tokens`` have one entry per turn. ``truncated`` means the token budget ran
    out before the episode ended: the action that would have exceeded it was not taken, and ``done`` is False.
    """

    states: list[State]
    actions: list[int]
    rewards: list[float]
    tokens: list[int]
    done: bool
    truncated: bool
    start_turn: int
    segment_every: int

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)

    @property
    def episode_return(self) -> float:
        return float(sum(self.rewards))

    def boundary_turns(self) -> list[int]:
        """Indices into ``states`` (turns relative to the start) where a segment starts.

        A segment starts at the start state and at every state whose absolute turn is a multiple of
        ``segment_every``, as long as at least one turn follows it in this episode (never at the last state).
        """
        return [
            turn
            for turn in range(len(self.actions))
            if turn == 0 or (self.start_turn + turn) % self.segment_every == 0
        ]

    def boundary_states(self) -> list[State]:
        return [self.states[turn] for turn in self.boundary_turns()]

    def segment_rewards(self) -> list[float]:
        """Reward of each segment; they sum to ``episode_return``."""
        return [float(sum(part)) for part in self._split_by_segment(self.rewards)]

    def segment_token_counts(self) -> list[int]:
        """Generated tokens of each segment; they sum to ``total_tokens``."""
        return [sum(part) for part in self._split_by_segment(self.tokens)]

    def _split_by_segment(self, per_turn: list) -> list[list]:
        bounds = [*self.boundary_turns(), len(self.actions)]
        return [per_turn[begin:end] for begin, end in zip(bounds, bounds[1:], strict=False)]


class ExactValueEnv(abc.ABC):
    """A finite-horizon text MDP with exactly computable state values V^π(s).

    Subclasses define the MDP (``initial_state``, ``observation``, ``action_menu``, ``transitions``,
    ``is_terminal``, ``turn``, ``default_policy``) and may give closed-form values through ``known_value``.
    This base class adds exact evaluation of a policy and episode sampling.
    """

    name: str

    def __init__(self, horizon: int, segment_every: int) -> None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        if segment_every < 1:
            raise ValueError(f"segment_every must be >= 1, got {segment_every}")
        self.horizon = horizon
        self.segment_every = segment_every
        self._value_caches: weakref.WeakKeyDictionary[TabularPolicy, dict[State, float]] = (
            weakref.WeakKeyDictionary()
        )

    @abc.abstractmethod
    def initial_state(self) -> State: ...

    @abc.abstractmethod
    def observation(self, state: State) -> str:
        """Short text (< 300 characters) that identifies everything the state's value depends on."""

    @abc.abstractmethod
    def action_menu(self, state: State) -> list[str]:
        """The 2-6 action texts available at a non-terminal state; empty at a terminal state."""

    @abc.abstractmethod
    def transitions(self, state: State, action_index: int) -> list[Transition]:
        """All outcomes (probability, next state, reward, done) of an action; probabilities sum to 1."""

    @abc.abstractmethod
    def is_terminal(self, state: State) -> bool: ...

    @abc.abstractmethod
    def turn(self, state: State) -> int:
        """Turns taken to reach the state."""

    @abc.abstractmethod
    def default_policy(self, seed: int = 0) -> TabularPolicy:
        """A fixed stochastic benchmark policy: a few decisive steps, most easy; difficulty varies by seed."""

    def known_value(self, state: State) -> float | None:
        """V^π(s) when it is the same for every policy (e.g. a doomed state), else None."""
        return None

    def action_tokens(self, state: State, action_index: int) -> int:
        """Generated tokens the action costs: the number of words of its text."""
        return len(self.action_menu(state)[action_index].split())

    def exact_values(self, policy: TabularPolicy, states: Iterable[State]) -> np.ndarray:
        """V^π(s) of each state, computed exactly; values are cached per policy."""
        if policy.env is not self:
            raise ValueError(f"policy {policy.name!r} belongs to another environment")
        cache = self._value_caches.setdefault(policy, {})
        return np.array([self._value(policy, state, cache) for state in states], dtype=np.float64)

    def _value(self, policy: TabularPolicy, state: State, cache: dict[State, float]) -> float:
        if self.is_terminal(state):
            return 0.0
        known = self.known_value(state)
        if known is not None:
            return known
        if state in cache:
            return cache[state]
        value = 0.0
        for action_index, action_probability in enumerate(policy.probabilities(state)):
            if action_probability == 0.0:
                continue
            for probability, next_state, reward, done in self.transitions(state, action_index):
                future = 0.0 if done else self._value(policy, next_state, cache)
                value += action_probability * probability * (reward + future)
        cache[state] = value
        return value

    def sample_episode(
        self,
        policy: TabularPolicy,
        rng: np.random.Generator,
        start: State | None = None,
        max_tokens: int | None = None,
    ) -> Episode:
        """Roll out ``policy`` from ``start`` (default: the initial state) until the episode ends or the next
        action would take the generated tokens past ``max_tokens``."""
        state = self.initial_state() if start is None else start
        if self.is_terminal(state):
            raise ValueError(f"cannot start an episode at terminal state {state!r}")
        episode = Episode(states=[state], actions=[], rewards=[], tokens=[], done=False, truncated=False,
                          start_turn=self.turn(state), segment_every=self.segment_every)
        tokens_used = 0
        while not episode.done:
            action_index = policy.sample_action(state, rng)
            cost = self.action_tokens(state, action_index)
            if max_tokens is not None and tokens_used + cost > max_tokens:
                episode.truncated = True
                break
            _, state, reward, episode.done = _sample_outcome(self.transitions(state, action_index), rng)
            tokens_used += cost
            episode.states.append(state)
            episode.actions.append(action_index)
            episode.rewards.append(reward)
            episode.tokens.append(cost)
        return episode


def _sample_outcome(outcomes: list[Transition], rng: np.random.Generator) -> Transition:
    """Pick one outcome by its probability; a deterministic transition draws no random number."""
    if len(outcomes) == 1:
        return outcomes[0]
    remaining = rng.random()
    for outcome in outcomes:
        remaining -= outcome[0]
        if remaining < 0.0:
            return outcome
    return outcomes[-1]


class TextSession:
    """The text protocol of the agent harness around one environment: ``reset()`` then ``step(action_text)``.

    Observations list the action menu. An action text that is not on the menu (compared ignoring case and
    repeated spaces), or is not a string at all, gets an error observation that repeats the menu; it raises
    nothing and consumes no turn. ``info`` carries the state, its turn, the chosen action index and its token
    cost, and the error message if any.
    """

    def __init__(self, env: ExactValueEnv, seed: int | None = None) -> None:
        self.env = env
        self._rng = np.random.default_rng(seed)
        self._state: State | None = None

    @property
    def state(self) -> State:
        if self._state is None:
            raise RuntimeError("call reset() before using the session")
        return self._state

    def reset(self, seed: int | None = None) -> str:
        """Start a new episode; a seed reseeds the random outcomes of transitions."""
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._state = self.env.initial_state()
        return self._render()

    def step(self, action_text: Any) -> tuple[str, float, bool, dict[str, Any]]:
        state = self.state
        if self.env.is_terminal(state):
            return self._refuse("The episode is over; call reset().")
        menu = self.env.action_menu(state)
        action_index = _menu_index(action_text, menu)
        if action_index is None:
            shown = repr(action_text)[:80]
            return self._refuse(f"Unknown action {shown}. Reply with exactly one of the listed actions.")
        cost = self.env.action_tokens(state, action_index)
        _, self._state, reward, done = _sample_outcome(self.env.transitions(state, action_index), self._rng)
        return self._render(), reward, done, self._info(action_index=action_index, tokens=cost)

    def _render(self) -> str:
        lines = [self.env.observation(self.state)]
        menu = self.env.action_menu(self.state)
        if menu:
            lines.append("Actions:")
            lines.extend(f"- {action}" for action in menu)
        return "\n".join(lines)

    def _refuse(self, message: str) -> tuple[str, float, bool, dict[str, Any]]:
        done = self.env.is_terminal(self.state)
        return f"Error: {message}\n{self._render()}", 0.0, done, self._info(error=message)

    def _info(self, *, action_index: int | None = None, tokens: int = 0, error: str | None = None) -> dict:
        return {"state": self.state, "turn": self.env.turn(self.state), "action_index": action_index,
                "tokens": tokens, "error": error}


def _menu_index(action_text: Any, menu: list[str]) -> int | None:
    if not isinstance(action_text, str):
        return None
    wanted = " ".join(action_text.split()).lower()
    normalised_menu = [" ".join(action.split()).lower() for action in menu]
    return normalised_menu.index(wanted) if wanted in normalised_menu else None


def _seeded_rng(*keys: int) -> np.random.Generator:
    """A generator seeded by non-negative integer keys (env seed, policy seed, stream tag)."""
    if any(not isinstance(key, int | np.integer) or key < 0 for key in keys):
        raise ValueError(f"seeds must be non-negative integers, got {keys}")
    return np.random.default_rng([int(key) for key in keys])


# ------------------------------------------------------------------------------------------------------------
# Combination lock
# ------------------------------------------------------------------------------------------------------------

_LOCK_SYMBOLS = "ABCDEF"
_COMBINATION_STREAM, _LOCK_POLICY_STREAM, _KB_STREAM, _MENU_ORDER_STREAM, _CHAIN_POLICY_STREAM, _CLUE_STREAM = range(6)
# The clue variant (``CombinationLock(clues=True)``): each dial shows a clue word, and the word's family decides
# the right symbol - the same mapping for every seed (family i is symbol i), so a rule learned on some locks
# opens others. Seeds only choose which clues (hence which combination) a lock has.
CLUE_FAMILIES = (
    ("river", "rain", "lake", "tide"),  # A
    ("stone", "hill", "cliff", "sand"),  # B
    ("flame", "ember", "ash", "spark"),  # C
    ("wind", "cloud", "storm", "mist"),  # D
    ("oak", "pine", "moss", "fern"),  # E
    ("iron", "gold", "silver", "tin"),  # F
)


@dataclass(frozen=True, slots=True)
class LockState:
    """Symbols entered so far (indices into the symbol alphabet) and, once a symbol was wrong, the number of
    turns the doomed lock still plays on (None while every entered symbol is right)."""

    entered: tuple[int, ...]
    doomed_turns_left: int | None = None


class CombinationLock(ExactValueEnv):
    """Set ``horizon`` dials in order; one symbol per dial is right (the combination, drawn from ``seed``).

    MDP. State: the symbols entered so far plus a doom countdown; turn = number of dials set. Actions:
    "set dial d to X" for each of ``n_symbols`` symbols. Setting every dial right ends with reward 1. A wrong
    symbol dooms the lock: it keeps playing for ``delay`` more turns (or until the horizon), then ends with
    reward 0 whatever is entered. The observation shows the dial index and the symbols entered, so a doomed
    state looks like any other and is recognisable only by knowing the combination (the trap for a critic).

    Exact values. A doomed state is worth 0 (``known_value``), so only live states are expanded, and there is
    one live state per turn: V^π(live state at dial h) = Π_{t >= h} π(right symbol | live state at dial t).

    ``clues=True`` is the learnable variant: every dial shows a clue word from ``CLUE_FAMILIES`` and the right
    symbol is its family's (seed-independent), so a policy can open a lock it has never seen; the seed draws the
    clues. The observation shows the current dial's clue only (and the symbols set so far), so a doomed state
    still looks like any other unless one remembers the earlier clues.
    """

    name = "combination_lock"

    def __init__(self, horizon: int = 12, segment_every: int = 3, n_symbols: int = 3, delay: int = 3,
                 seed: int = 0, clues: bool = False) -> None:
        super().__init__(horizon, segment_every)
        if not 2 <= n_symbols <= len(_LOCK_SYMBOLS):
            raise ValueError(f"n_symbols must be in [2, {len(_LOCK_SYMBOLS)}], got {n_symbols}")
        if delay < 0:
            raise ValueError(f"delay must be >= 0, got {delay}")
        self.n_symbols = n_symbols
        self.delay = delay
        self.seed = seed
        self.clues: tuple[str, ...] | None = None
        if clues:
            words = [(word, family) for family in range(n_symbols) for word in CLUE_FAMILIES[family]]
            drawn = _seeded_rng(seed, _CLUE_STREAM).integers(len(words), size=horizon)
            self.clues = tuple(words[int(i)][0] for i in drawn)
            self.combination = tuple(words[int(i)][1] for i in drawn)
        else:
            combination_rng = _seeded_rng(seed, _COMBINATION_STREAM)
            self.combination = tuple(int(symbol) for symbol in combination_rng.integers(n_symbols, size=horizon))
        self._menus = [
            tuple(f"set dial {dial + 1} to {_LOCK_SYMBOLS[symbol]}" for symbol in range(n_symbols))
            for dial in range(horizon)
        ]

    def initial_state(self) -> LockState:
        return LockState(entered=())

    def is_terminal(self, state: LockState) -> bool:
        return len(state.entered) == self.horizon or state.doomed_turns_left == 0

    def is_doomed(self, state: LockState) -> bool:
        return state.doomed_turns_left is not None

    def turn(self, state: LockState) -> int:
        return len(state.entered)

    def observation(self, state: LockState) -> str:
        if self.clues is not None:
            return self._clue_observation(state)
        entered = " ".join(f"{dial + 1}={_LOCK_SYMBOLS[symbol]}" for dial, symbol in enumerate(state.entered))
        if self.is_terminal(state):
            status = "jammed" if self.is_doomed(state) else "open"
            return f"Lock: {status}. Set: {entered}."
        dial = len(state.entered) + 1
        return (f"Lock: dial {dial} of {self.horizon}. Set so far: {entered or 'nothing'}. "
                f"Choose a symbol for dial {dial}.")

    def _clue_observation(self, state: LockState) -> str:
        entered = " ".join(f"{dial + 1}={_LOCK_SYMBOLS[symbol]}" for dial, symbol in enumerate(state.entered))
        if self.is_terminal(state):
            return f"Lock: {'jammed' if self.is_doomed(state) else 'open'}. Set: {entered}."
        dial = len(state.entered)
        # Only the current dial's clue is shown: the one clue word in view decides the symbol.
        return (f"Lock: dial {dial + 1} of {self.horizon}. Set so far: {entered or 'nothing'}. "
                f"Dial {dial + 1} shows {self.clues[dial]}.")

    def action_menu(self, state: LockState) -> list[str]:
        return [] if self.is_terminal(state) else list(self._menus[len(state.entered)])

    def transitions(self, state: LockState, action_index: int) -> list[Transition]:
        dial = len(state.entered)
        entered = (*state.entered, action_index)
        last_dial = len(entered) == self.horizon
        if not self.is_doomed(state) and action_index == self.combination[dial]:
            return [(1.0, LockState(entered), 1.0 if last_dial else 0.0, last_dial)]
        turns_left = self.delay if state.doomed_turns_left is None else state.doomed_turns_left - 1
        return [(1.0, LockState(entered, turns_left), 0.0, last_dial or turns_left == 0)]

    def known_value(self, state: LockState) -> float | None:
        return 0.0 if self.is_doomed(state) else None

    def live_state(self, dial: int) -> LockState:
        """The state at ``dial`` (0-based) with every earlier dial set right."""
        return LockState(self.combination[:dial])

    def default_policy(self, seed: int = 0) -> TabularPolicy:
        """Per dial, the right symbol has probability p and the wrong ones share 1 - p at random.

        One dial (two when horizon >= 8) is critical with p in [0.45, 0.7]. The other dials are easy: together
        they succeed with probability f in [0.6, 0.9], split unevenly (typically p in 0.9-0.99), so V(s_0) =
        f * Π p_critical, typically 0.12-0.45. The distribution depends only on the dial, doomed or not.
        """
        rng = _seeded_rng(self.seed, seed, _LOCK_POLICY_STREAM)
        n_critical = 1 if self.horizon < 8 else 2
        critical = rng.choice(self.horizon, size=n_critical, replace=False)
        easy = np.setdiff1d(np.arange(self.horizon), critical)
        p_right = np.empty(self.horizon)
        p_right[critical] = rng.uniform(0.45, 0.7, size=n_critical)
        easy_success = rng.uniform(0.6, 0.9)
        shares = rng.uniform(0.5, 1.5, size=easy.size)
        p_right[easy] = easy_success ** (shares / shares.sum())
        table = []
        for dial, right_symbol in enumerate(self.combination):
            wrong_split = rng.dirichlet(np.ones(self.n_symbols - 1))
            probabilities = np.insert((1.0 - p_right[dial]) * wrong_split, right_symbol, p_right[dial])
            table.append(probabilities)
        return TabularPolicy(self, lambda state: table[len(state.entered)],
                             memo_key=lambda state: len(state.entered), name=f"{self.name}-default-{seed}")


# ------------------------------------------------------------------------------------------------------------
# Lookup chain
# ------------------------------------------------------------------------------------------------------------

# Phases of a hop, and the end of the episode.
SEARCH, READ, ANSWER, OVER = "search", "read", "answer", "over"

# What the last action produced (shown in the observation); for OVER states, how the episode ended.
_LAST_RESULT_TEXT = {
    "start": "Last: nothing yet.",
    "found": "Last: search found documents.",
    "noise": "Last: search found nothing useful.",
    "off_topic": "Last: results were off topic.",
    "noted": "Last: read a document, noted a name.",
    "irrelevant": "Last: document was irrelevant.",
    "reviewed": "Last: notes reviewed.",
    "right": "Episode over: the answer is right.",
    "wrong": "Episode over: the answer is wrong.",
    "early": "Episode over: answered before finishing the chain.",
    "timeout": "Episode over: out of turns.",
}


@dataclass(frozen=True, slots=True)
class LookupState:
    hop: int  # hops completed; notes hold one entity per completed hop
    phase: str  # SEARCH, READ, ANSWER or OVER
    turn: int
    poisoned: bool  # a wrong entity was noted at hop 2 (the delayed trap)
    last: str  # key of _LAST_RESULT_TEXT


class _Relation(NamedTuple):
    question: str  # noun phrase around the previous entity
    search: str  # the search that finds the next entity's document
    detour: str  # an off-topic search (wastes a turn)
    document: str  # title of the document naming the next entity


_RELATIONS = (
    _Relation("the town where {} was born", "search birthplace of {}", "search hobbies of {}",
              "{} (biography)"),
    _Relation("the bridge in {}", "search bridges in {}", "search weather in {}", "{} (town guide)"),
    _Relation("the company that built {}", "search builder of {}", "search length of {}", "{} (history)"),
    _Relation("the person who founded {}", "search founder of {}", "search logo of {}", "{} (profile)"),
    _Relation("the school that {} attended", "search schooling of {}", "search hobbies of {}",
              "{} (biography)"),
)
_ENTITY_KINDS = ("person", "town", "bridge", "company", "person", "school")
_SYLLABLES = ("ka", "lo", "mir", "ven", "dra", "sel", "tor", "bri", "nal", "quo",
              "fen", "ris", "zan", "pel", "gor", "thu", "mel", "dun", "har", "vos")
_TOWN_SUFFIXES = ("mere", "ford", "holm", "wick")


class _Action(NamedTuple):
    kind: str  # advance, detour, early_answer, wrong_read (the delayed trap) or wrong_answer
    text: str


class LookupChain(ExactValueEnv):
    """A K-hop question over a tiny synthetic knowledge base of made-up names, e.g. "name the person who
    founded the company that built the bridge in the town where Kalo Venris was born".

    MDP. State: hops completed, phase (search, read, or answer once all hops are done), turn, whether the
    notes are poisoned, and the last tool result. Each hop needs a search, then a read, each from a menu of:
    * advance: the right search (with probability ``noise`` it finds nothing useful and must be repeated) or
      the right document, which notes the next entity;
    * detour: an off-topic search or an irrelevant document; recoverable, wastes a turn;
    * early_answer: answering with the latest entity before the chain is done; ends the episode with 0;
    * wrong_read (hop 2 only, the delayed trap): the guide of a look-alike entity, which notes a plausible
      wrong entity; the chain then continues normally over wrong entities and only the final answer fails.
    After the last hop the menu offers answering with the last noted entity (reward 1 unless poisoned), a
    look-alike wrong answer (reward 0) and reviewing the notes (wastes a turn). Reaching ``turn_budget``
    turns ends the episode with 0. The observation shows the question, the noted names (a poisoned chain
    shows a wrong name), hops done, the turn count and the last tool result.

    Exact values by DP over (hop, phase, turn, poisoned, last result), a few thousand states; poisoned states
    and states without enough turns left to finish are worth 0 (``known_value``).
    """

    name = "lookup_chain"

    def __init__(self, hops: int = 4, turn_budget: int = 14, segment_every: int = 3, noise: float = 0.1,
                 seed: int = 0, show_turn: bool = True) -> None:
        super().__init__(turn_budget, segment_every)
        if not 2 <= hops <= len(_RELATIONS):
            raise ValueError(f"hops must be in [2, {len(_RELATIONS)}], got {hops}")
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"noise must be in [0, 1), got {noise}")
        self.hops = hops
        self.noise = noise
        self.seed = seed
        # False leaves the turn count out of the observation (it changes no right action), so states that differ
        # only by it look the same; the value still depends on it through the turn budget.
        self.show_turn = show_turn
        self._build_knowledge_base(_seeded_rng(seed, _KB_STREAM))

    def _build_knowledge_base(self, rng: np.random.Generator) -> None:
        """Draw distinct made-up names and set ``true_chain`` (the start entity, then one entity per hop),
        ``poisoned_chain`` (the same start and first hop, then the wrong entities the delayed trap leads to),
        ``lookalike_at_hop_2``, ``question``, ``answer`` and the menus of every (hop, phase, poisoned)."""
        used_names: set[str] = set()

        def fresh(name_of: Callable[[], str]) -> str:
            name = name_of()
            while name in used_names:
                name = name_of()
            used_names.add(name)
            return name

        def word() -> str:
            return "".join(rng.choice(_SYLLABLES, size=2)).capitalize()

        def entity(kind: str) -> Callable[[], str]:
            return {
                "person": lambda: f"{word()} {word()}",
                "town": lambda: (rng.choice(_SYLLABLES) + rng.choice(_TOWN_SUFFIXES)).capitalize(),
                "bridge": lambda: f"{word()} Bridge",
                "company": lambda: f"{word()} Works",
                "school": lambda: f"{word()} Academy",
            }[kind]

        def lookalike(name: str) -> Callable[[], str]:
            """The name with one vowel of its first word changed."""

            def variant() -> str:
                first, space, rest = name.partition(" ")
                position = int(rng.choice([i for i, letter in enumerate(first) if letter in "aeiou"]))
                vowel = rng.choice([v for v in "aeiou" if v != first[position]])
                return first[:position] + vowel + first[position + 1:] + space + rest

            return variant

        kinds = _ENTITY_KINDS[: self.hops + 1]
        self.true_chain = tuple(fresh(entity(kind)) for kind in kinds)
        poisoned_tail = tuple(fresh(entity(kind)) for kind in kinds[2:])
        self.poisoned_chain = (*self.true_chain[:2], *poisoned_tail)
        self.lookalike_at_hop_2 = fresh(lookalike(self.true_chain[1]))
        wrong_answers = {poisoned: fresh(lookalike(chain[-1]))
                         for poisoned, chain in ((False, self.true_chain), (True, self.poisoned_chain))}
        phrase = self.true_chain[0]
        for relation in _RELATIONS[: self.hops]:
            phrase = relation.question.format(phrase)
        self.question = f"Q: name {phrase}."
        self.answer = self.true_chain[-1]
        self._menus = {
            (hop, phase, poisoned): self._shuffled_menu(hop, phase, poisoned, wrong_answers[poisoned])
            for hop in range(self.hops + 1)
            for phase in ((ANSWER,) if hop == self.hops else (SEARCH, READ))
            for poisoned in (False, True)
        }

    def _shuffled_menu(self, hop: int, phase: str, poisoned: bool, wrong_answer: str) -> tuple[_Action, ...]:
        chain = self.poisoned_chain if poisoned else self.true_chain
        if phase == ANSWER:
            actions = [_Action("advance", f"answer {chain[-1]}"),
                       _Action("wrong_answer", f"answer {wrong_answer}"),
                       _Action("detour", "review notes")]
        else:
            relation, current = _RELATIONS[hop], chain[hop]
            if phase == SEARCH:
                actions = [_Action("advance", relation.search.format(current)),
                           _Action("detour", relation.detour.format(current))]
            else:
                actions = [_Action("advance", f"read {relation.document.format(current)}"),
                           _Action("detour", f"read {current} (trivia)")]
                if hop == 1:
                    lookalike_document = relation.document.format(self.lookalike_at_hop_2)
                    actions.append(_Action("wrong_read", f"read {lookalike_document}"))
            actions.append(_Action("early_answer", f"answer {current}"))
        # The order depends on (seed, hop, phase) only: a poisoned menu lists its actions like the clean one.
        order_rng = _seeded_rng(self.seed, _MENU_ORDER_STREAM, hop, (SEARCH, READ, ANSWER).index(phase))
        return tuple(actions[i] for i in order_rng.permutation(len(actions)))

    def initial_state(self) -> LookupState:
        return LookupState(hop=0, phase=SEARCH, turn=0, poisoned=False, last="start")

    def is_terminal(self, state: LookupState) -> bool:
        return state.phase == OVER

    def turn(self, state: LookupState) -> int:
        return state.turn

    def observation(self, state: LookupState) -> str:
        chain = self.poisoned_chain if state.poisoned else self.true_chain
        notes = ", ".join(chain[1: state.hop + 1]) or "none"
        turn = f"Turn {state.turn} of {self.horizon}. " if self.show_turn else ""
        return (f"{self.question} Notes: {notes}. Hops done: {state.hop} of {self.hops}. "
                f"{turn}{_LAST_RESULT_TEXT[state.last]}")

    def action_menu(self, state: LookupState) -> list[str]:
        if self.is_terminal(state):
            return []
        return [action.text for action in self._menus[(state.hop, state.phase, state.poisoned)]]

    def action_kind(self, state: LookupState, action_index: int) -> str:
        """What a menu action is: advance, detour, early_answer, wrong_read or wrong_answer."""
        return self._menus[(state.hop, state.phase, state.poisoned)][action_index].kind

    def transitions(self, state: LookupState, action_index: int) -> list[Transition]:
        kind = self._menus[(state.hop, state.phase, state.poisoned)][action_index].kind
        outcomes = self._outcomes(state, kind, dataclasses.replace(state, turn=state.turn + 1))
        return [self._ended_by_turn_budget(outcome) for outcome in outcomes]

    def _outcomes(self, state: LookupState, kind: str, later: LookupState) -> list[Transition]:
        """Outcomes of an action of the given kind; ``later`` is the state one turn on, else unchanged."""
        if kind == "early_answer":
            return [(1.0, dataclasses.replace(later, phase=OVER, last="early"), 0.0, True)]
        if kind == "wrong_answer":
            return [(1.0, dataclasses.replace(later, phase=OVER, last="wrong"), 0.0, True)]
        if kind == "detour":
            last = {SEARCH: "off_topic", READ: "irrelevant", ANSWER: "reviewed"}[state.phase]
            return [(1.0, dataclasses.replace(later, last=last), 0.0, False)]
        if state.phase == SEARCH:  # the right search
            found = (1.0 - self.noise, dataclasses.replace(later, phase=READ, last="found"), 0.0, False)
            nothing_useful = (self.noise, dataclasses.replace(later, last="noise"), 0.0, False)
            return [found, nothing_useful] if self.noise > 0.0 else [found]
        if state.phase == READ:  # the right document, or the look-alike one (wrong_read)
            next_hop = state.hop + 1
            next_phase = ANSWER if next_hop == self.hops else SEARCH
            noted = dataclasses.replace(later, hop=next_hop, phase=next_phase,
                                        poisoned=state.poisoned or kind == "wrong_read", last="noted")
            return [(1.0, noted, 0.0, False)]
        right = not state.poisoned  # answering with the last noted entity
        answered = dataclasses.replace(later, phase=OVER, last="right" if right else "wrong")
        return [(1.0, answered, float(right), True)]

    def _ended_by_turn_budget(self, outcome: Transition) -> Transition:
        probability, next_state, reward, done = outcome
        if done or next_state.turn < self.horizon:
            return outcome
        return probability, dataclasses.replace(next_state, phase=OVER, last="timeout"), 0.0, True

    def known_value(self, state: LookupState) -> float | None:
        if state.poisoned or state.turn + self._turns_to_finish(state) > self.horizon:
            return 0.0
        return None

    def _turns_to_finish(self, state: LookupState) -> int:
        """Fewest turns to a right answer: a search and a read per remaining hop, then the answer."""
        reads_left = self.hops - state.hop
        return 2 * reads_left + 1 - (state.phase == READ)

    def default_policy(self, seed: int = 0) -> TabularPolicy:
        """At each decision point (hop, phase) the advancing action has probability p; the rest is shared at
        random by the other actions. Two points are critical with p in [0.45, 0.7]: the hop-2 read, where most
        of the remaining mass goes to the delayed trap, and one more point drawn by seed; the others are easy
        with p in [0.9, 0.98]. The distribution depends only on (hop, phase)."""
        rng = _seeded_rng(self.seed, seed, _CHAIN_POLICY_STREAM)
        decision_points = [point for point in self._menus if not point[2]]  # (hop, phase, poisoned=False)
        others = [point for point in decision_points if point[:2] != (1, READ)]
        critical = {(1, READ), others[int(rng.integers(len(others)))][:2]}
        table = {}
        for hop, phase, _ in decision_points:
            kinds = [action.kind for action in self._menus[(hop, phase, False)]]
            p_advance = rng.uniform(0.45, 0.7) if (hop, phase) in critical else rng.uniform(0.9, 0.98)
            weights = rng.uniform(0.2, 1.0, size=len(kinds))
            weights[kinds.index("advance")] = 0.0
            if "wrong_read" in kinds:
                weights[kinds.index("wrong_read")] = 3.0 * weights.sum()
            probabilities = (1.0 - p_advance) * weights / weights.sum()
            probabilities[kinds.index("advance")] = p_advance
            table[(hop, phase)] = probabilities
        return TabularPolicy(self, lambda state: table[(state.hop, state.phase)],
                             memo_key=lambda state: (state.hop, state.phase),
                             name=f"{self.name}-default-{seed}")


# ------------------------------------------------------------------------------------------------------------
# Paraphrased observations
# ------------------------------------------------------------------------------------------------------------

_NOTE_WORDS = ("amber", "basalt", "cinder", "dapple", "ember", "fallow", "garnet", "hollow",
               "indigo", "juniper", "kestrel", "lumen", "marrow", "nettle", "ochre", "pewter")


@dataclass(frozen=True)
class ParaphrasedState:
    inner: State
    variant: int  # which value-irrelevant note the observation carries


class Paraphrased(ExactValueEnv):
    """A trap environment whose observations also carry a random, value-irrelevant note.

    Agent states are compressed contexts written by the policy, so no two are identical even when
    they are worth the same. Without this wrapper the trap environments repeat a handful of states
    many times, and a frequent state's own returns already form a large Monte-Carlo sample, which
    no real agent rollout offers. Every transition draws one of ``vocabulary ** words`` notes
    uniformly, so the same underlying state shows up under many texts; V^π is that of the inner
    state, and a critic must learn to ignore the note, as it must ignore wording in real summaries.
    """

    def __init__(self, inner: ExactValueEnv, *, words: int = 2, vocabulary: int = len(_NOTE_WORDS)) -> None:
        super().__init__(inner.horizon, inner.segment_every)
        if words < 1 or not 2 <= vocabulary <= len(_NOTE_WORDS):
            raise ValueError(f"need words >= 1 and 2 <= vocabulary <= {len(_NOTE_WORDS)}")
        self.inner, self.words, self.vocabulary = inner, words, vocabulary
        self.n_variants = vocabulary**words
        self.name = f"{inner.name}+paraphrased"
        self._inner_policy: weakref.WeakKeyDictionary[TabularPolicy, TabularPolicy] = weakref.WeakKeyDictionary()

    def note(self, variant: int) -> str:
        digits = [(variant // self.vocabulary**i) % self.vocabulary for i in range(self.words)]
        return " ".join(_NOTE_WORDS[d] for d in digits)

    def initial_state(self) -> ParaphrasedState:
        return ParaphrasedState(self.inner.initial_state(), 0)

    def observation(self, state: ParaphrasedState) -> str:
        return f"{self.inner.observation(state.inner)} Note: {self.note(state.variant)}."

    def action_menu(self, state: ParaphrasedState) -> list[str]:
        return self.inner.action_menu(state.inner)

    def action_tokens(self, state: ParaphrasedState, action_index: int) -> int:
        return self.inner.action_tokens(state.inner, action_index)

    def transitions(self, state: ParaphrasedState, action_index: int) -> list[Transition]:
        share = 1.0 / self.n_variants
        return [(probability * share, ParaphrasedState(next_state, variant), reward, done)
                for probability, next_state, reward, done in self.inner.transitions(state.inner, action_index)
                for variant in range(self.n_variants)]

    def is_terminal(self, state: ParaphrasedState) -> bool:
        return self.inner.is_terminal(state.inner)

    def turn(self, state: ParaphrasedState) -> int:
        return self.inner.turn(state.inner)

    def known_value(self, state: ParaphrasedState) -> float | None:
        return self.inner.known_value(state.inner)

    def default_policy(self, seed: int = 0) -> TabularPolicy:
        return self.wrap_policy(self.inner.default_policy(seed))

    def wrap_policy(self, inner_policy: TabularPolicy) -> TabularPolicy:
        """The same policy acting on paraphrased states (it never looks at the note)."""
        policy = TabularPolicy(self, lambda state: inner_policy.probabilities(state.inner),
                               memo_key=lambda state: state.inner, name=f"{inner_policy.name}+paraphrased")
        self._inner_policy[policy] = inner_policy
        return policy

    def exact_values(self, policy: TabularPolicy, states: Iterable[State]) -> np.ndarray:
        inner_policy = self._inner_policy.get(policy)
        if inner_policy is None:  # a policy that may read the note: evaluate the full MDP
            return super().exact_values(policy, states)
        return self.inner.exact_values(inner_policy, [state.inner for state in states])

    def sample_episode(self, policy: TabularPolicy, rng: np.random.Generator, start: State | None = None,
                       max_tokens: int | None = None) -> Episode:
        inner_policy = self._inner_policy.get(policy)
        if inner_policy is None:
            return super().sample_episode(policy, rng, start, max_tokens)
        start = self.initial_state() if start is None else start
        episode = self.inner.sample_episode(inner_policy, rng, start.inner, max_tokens)
        variants = rng.integers(self.n_variants, size=len(episode.states) - 1)
        later = (ParaphrasedState(s, int(v)) for s, v in zip(episode.states[1:], variants, strict=True))
        episode.states = [start, *later]
        return episode
