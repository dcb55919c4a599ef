"""The environment protocol every agent environment follows.

An environment offers read-only, deterministic tools over its data, so a tool's output is a pure
function of (data version, task, the calls so far): the state of an episode *is* its transcript, and
branching from a recorded state needs no environment snapshot: the harness replays the state's calls
(``SegmentStart.calls``) into a fresh environment. Most tools ignore earlier calls; a tool may keep a
position (like a reader's cursor) as long as it is a function of them. The reward is
sparse: 1 or 0 when the agent ends the episode (answer/submit), 0 on every other step.

    env = make_env("deep_search")
    task = env.tasks("train")[0]
    observation = env.reset(task)
    observation, reward, done, info = env.step('search(query="...")')

``step`` takes the policy's raw text. A malformed or unknown call, bad arguments, an over-long
message or a tool error all come back as an ``Error: ...`` observation (reward 0, not done): they
are feedback for the policy, never exceptions. Observations are cut to ``max_observation_chars``.

Tasks come from a deterministic generator over the environment's data. Each task records the key
that decides its split (the answer entity or target artifact, never the question text), so a
held-out answer never appears in training. Every environment ships a scripted ``expert``: the
upper bound of the benchmark and the source of SFT demonstrations.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from focus_core.agent.toolcall import ToolCall, ToolCallError, ToolSpec, parse_tool_call
from focus_core.ids import unit_fraction
from focus_core.locks import exclusive_file_lock

SPLITS = ("train", "heldout")


@dataclass(frozen=True)
class Task:
    """One episode's problem. ``answer`` and ``facts`` are hidden from the policy."""

    task_id: str  # content-derived, stable across processes
    env: str
    split: str  # "train" or "heldout"
    tier: str  # difficulty tier, e.g. "default" (tiny CPU model) or "hard" (real models)
    prompt: str  # what the agent is asked
    answer: str  # the gold answer (or target artifact id)
    split_key: str  # the answer entity / target artifact that decided the split
    facts: dict[str, Any] = field(default_factory=dict)  # what the task relies on (JSON-serialisable)


@dataclass(frozen=True)
class ToolResult:
    """What a tool returned: the observation text, and for the ending tools a reward."""

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def split_of(split_key: str, heldout_fraction: float, *, salt: str = "") -> str:
    """Deterministic split of a key: a stable hash puts ``heldout_fraction`` of keys in held-out."""
    return "heldout" if unit_fraction(f"{salt}\x00{split_key}") < heldout_fraction else "train"


def data_dir() -> Path:
    """Where environments keep derived data (caches): $FOCUS_DATA_DIR, default <repo>/.focus-data."""
    return Path(os.environ.get("FOCUS_DATA_DIR") or Path(__file__).resolve().parents[2] / ".focus-data")


def cached_tasks(env: str, tier: str, key: Sequence[object], generate: Callable[[], list[Task]]) -> list[Task]:
    """``generate()``'s tasks, kept on disk under ``data_dir()/env``. ``key`` holds everything they derive from
    (a generator's version and source, its data's hash), so a changed generator never reads a stale file. An
    unreadable file is regenerated; a read-only data dir only costs the generation time. Processes that ask at
    once (``pytest -n 2``, ``focus compare --workers 2``) generate once: the others wait and read the file."""
    digest = hashlib.sha256()
    for part in key:
        digest.update(hashlib.sha256(part if isinstance(part, bytes) else str(part).encode()).digest())
    path = data_dir() / env / f"tasks-{tier}-{digest.hexdigest()[:16]}.json"
    tasks = _read_tasks(path)
    if tasks is not None:
        return tasks
    with exclusive_file_lock(path.with_name(f"{path.name}.lock"), required=False):
        tasks = _read_tasks(path)  # written by the process this one waited for
        if tasks is not None:
            return tasks
        tasks = generate()
        temp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            temp.write_text(json.dumps([asdict(t) for t in tasks], ensure_ascii=False), encoding="utf-8")
            os.replace(temp, path)  # atomic: a reader sees no file or the whole one
        except OSError:
            with contextlib.suppress(OSError):
                temp.unlink(missing_ok=True)  # a full disk leaves no partial file behind
    return tasks


def _read_tasks(path: Path) -> list[Task] | None:
    try:
        return [Task(**row) for row in json.loads(path.read_text(encoding="utf-8"))]
    except (OSError, ValueError, TypeError):
        return None


class ToolEnv(abc.ABC):
    """Base class: parses calls, enforces the protocol; subclasses provide tools, tasks and expert."""

    name: ClassVar[str]
    tools: ClassVar[tuple[ToolSpec, ...]]
    tiers: ClassVar[tuple[str, ...]] = ("default",)
    max_observation_chars: int = 1200
    has_exact_values: ClassVar[bool] = False  # True: exact V^pi(s_0) by dynamic programme (the trap environments)

    def __init__(self, tier: str = "default") -> None:
        if tier not in self.tiers:
            raise ValueError(f"{self.name} has tiers {', '.join(self.tiers)}, not {tier!r}")
        # Tools may differ by tier (the default tier's reader takes no arguments, see the environment modules);
        # the instance's ``tools`` are those of the tier it was made for, and only that tier's tasks are accepted.
        self.tools = self.tools_for(tier)
        self.tool_index = {spec.name: spec for spec in self.tools}
        self.task: Task | None = None
        self.done = False

    # -- subclasses implement ------------------------------------------------------------------

    @classmethod
    def tools_for(cls, tier: str) -> tuple[ToolSpec, ...]:
        """The tools of a tier; one set for every tier unless an environment overrides this."""
        return cls.tools

    @abc.abstractmethod
    def tasks(self, split: str, tier: str = "default") -> list[Task]:
        """All tasks of a split and tier, in a deterministic order."""

    @abc.abstractmethod
    def run_tool(self, call: ToolCall) -> ToolResult:
        """Execute a parsed, argument-checked call for ``self.task``. May raise ``ToolFailure``."""

    @abc.abstractmethod
    def expert_action(self, task: Task, history: list[tuple[str, str]]) -> str:
        """The scripted expert's next message, given the (action, observation) pairs so far.

        It must recover from any history (SFT data injects mistakes into its trajectories).
        """

    def first_observation(self, task: Task) -> str | None:
        """What the agent sees after the task prompt before its first call (its first context is the prompt, a
        newline and this), or None when the prompt says everything (the default). A pure function of the task."""
        return None

    def system_prompt(self) -> str:
        """The instructions shown before the task: what the tools are and how to call them."""
        lines = [f"You are an agent solving {self.name.replace('_', ' ')} tasks with tools.",
                 "End every message with exactly one tool call. Tools:"]
        lines += [f"- {spec.signature()}: {spec.description}" for spec in self.tools]
        return "\n".join(lines)

    # -- the protocol ----------------------------------------------------------------------------

    def reset(self, task: Task) -> str:
        if task.env != self.name:
            raise ValueError(f"task {task.task_id} belongs to environment {task.env!r}, not {self.name!r}")
        if self.tools_for(task.tier) != self.tools:
            raise ValueError(f"task {task.task_id} is of tier {task.tier!r}, whose tools this environment does not "
                             f"offer; fix: make_env({self.name!r}, tier={task.tier!r})")
        self.task, self.done = task, False
        return task.prompt

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.task is None:
            raise RuntimeError("call reset(task) before step()")
        if self.done:
            return self._error("the episode is over")
        parsed = parse_tool_call(action_text, self.tool_index)
        if isinstance(parsed, ToolCallError):
            return self._error(parsed.message)
        try:
            result = self.run_tool(parsed)
        except ToolFailure as failure:
            return self._error(str(failure), tool=parsed.name)
        self.done = result.done
        observation = _clip(result.observation, self.max_observation_chars)
        return observation, float(result.reward), result.done, {"tool": parsed.name, **result.info}

    def _error(self, message: str, **info: Any) -> tuple[str, float, bool, dict[str, Any]]:
        # Errors can echo the policy's own (possibly huge) arguments back: clip them like observations.
        message = _clip(message, self.max_observation_chars - len("Error: "))
        return f"Error: {message}", 0.0, False, {"error": message, **info}


class ToolFailure(Exception):
    """A tool could not do what was asked (no such document, path outside the sandbox, ...)."""


def ran_without_error(history: list[tuple[str, str]], name: str, tools: tuple[ToolSpec, ...]) -> bool:
    """Whether ``history`` holds a well-formed call of tool ``name`` whose observation is not an error: how a
    reader's expert tells that search() ran before any page shows where the reader is."""
    return any(_called_tool(action, tools) == name and not observation.startswith("Error")
               for action, observation in history)


@functools.lru_cache(maxsize=65536)
def _called_tool(action: str, tools: tuple[ToolSpec, ...]) -> str | None:
    call = parse_tool_call(action, {spec.name: spec for spec in tools})
    return call.name if isinstance(call, ToolCall) else None


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[: limit - 20].rstrip() + " ... [truncated]"
