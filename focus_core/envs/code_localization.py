"""Code localization: a bug was injected into one function of a real Python repository; find it.

Data: a slice of the CPython 3.11.7 standard library (``lib/<module>.py``, ``tests/test_<module>.py``), in which
``code_mutations`` injects SWE-smith-style bugs and keeps a mutant only when a real test of the module fails; the
failing test is the issue. Tiers (``TIERS``: each one's tools, page sizes and tasks):

* ``default`` (the tiny from-scratch model): crash bugs, read with argument-free tools (``READER_TOOLS``:
  ``test()``, ``trace()``, ``next()``, ``page()``, ``submit()``). Reward 1 when the function in front is the
  mutated one and the page in front shows the mutated line.
* ``text`` (real models): ``ls``, ``grep``, ``open``, ``search`` over a private copy of the repository and
  ``submit(location="lib/textwrap.py::TextWrapper._wrap_chunks")``; the failing test calls the buggy function by
  name, short pages. Reward 1 for the mutated function.
* ``hard``: the ``text`` tools; any failing test, the full traceback as the issue, long pages.

Modules: ``code_corpus`` (the repository, BM25 over its functions, workspaces), ``code_tools`` (the tools),
``code_tasks`` (which tasks each tier makes, and the scripted experts). Design notes and measurements are in
docs/environments.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from focus_core.agent.toolcall import ToolCall, ToolSpec
from focus_core.envs import code_corpus, code_tasks, code_tools, register_env
from focus_core.envs import code_mutations as cm
from focus_core.envs.base import SPLITS, Task, ToolEnv, ToolResult, cached_tasks
from focus_core.envs.code_tasks import TaskRules, generate_tasks, reader_expert, text_expert
from focus_core.envs.code_tools import (
    READER_PAGES,
    READER_TOOLS,
    TEXT_TOOLS,
    MutantSandbox,
    Pages,
    Reader,
    ToolSession,
)

Expert = Callable[[Task, list[tuple[str, str]], TaskRules], str]


@dataclass(frozen=True)
class Tier:
    """One tier of the environment: what the agent may call, how much it sees, which tasks, and the expert."""

    tools: tuple[ToolSpec, ...]
    session: Callable[[Task, Pages], ToolSession]  # runs the tools for one episode
    pages: Pages
    tasks: TaskRules
    expert: Expert


TIERS = {
    "default": Tier(tools=READER_TOOLS, session=Reader, pages=READER_PAGES, expert=reader_expert,
                    tasks=TaskRules(kind="reader", scope="named", tasks_per_function=15, test_pages=1)),
    "text": Tier(tools=TEXT_TOOLS, session=MutantSandbox, expert=text_expert,
                 pages=Pages(page_lines=8, line_chars=52, result_chars=104, grep_hits=5, search_k=3, max_chars=350),
                 tasks=TaskRules(kind="named", scope="named", tasks_per_function=6, test_pages=3)),
    "hard": Tier(tools=TEXT_TOOLS, session=MutantSandbox, expert=text_expert,
                 pages=Pages(page_lines=40, line_chars=110, result_chars=220, grep_hits=20, search_k=8, max_chars=4000),
                 tasks=TaskRules(kind="traceback", scope="all", tasks_per_function=6, test_pages=1)),
}
# The tasks derive from these sources (and the mutant records): the on-disk task cache is keyed by them.
TASK_SOURCES = (code_corpus, code_tools, code_tasks, cm)


@register_env("code_localization")
class CodeLocalizationEnv(ToolEnv):
    tools = TIERS["default"].tools
    tiers = tuple(TIERS)

    @classmethod
    def tools_for(cls, tier: str) -> tuple[ToolSpec, ...]:
        return TIERS[tier].tools

    def __init__(self, modules: tuple[str, ...] | None = None, tier: str = "default") -> None:
        """``modules`` restricts the repository to a few modules (quick tasks for tests); default: cm.MODULES."""
        super().__init__(tier)
        self.modules = tuple(modules) if modules else None
        self._tasks: dict[tuple[str, str], list[Task]] = {}
        self.tier = TIERS[tier]  # the current task's tier (reset sets it)
        self.session: ToolSession | None = None

    def pool(self) -> tuple[str, ...]:
        return self.modules or cm.MODULES

    def tasks(self, split: str, tier: str = "default") -> list[Task]:
        if split not in SPLITS or tier not in TIERS:
            raise ValueError(f"split must be one of {SPLITS} and tier one of {sorted(TIERS)}")
        if (split, tier) not in self._tasks:
            # Planning parses thousands of mutants (a minute or more): cached on disk, keyed by what the tasks derive
            # from - the mutant records' cache (generator version, Python) and the generators' sources.
            cm.check_sources()  # the tasks quote these files: a cached copy is only as good as they are
            key = (code_tasks.TASK_VERSION, ",".join(self.pool()), cm.cache_dir().name, Path(__file__).read_bytes(),
                   *(Path(module.__file__).read_bytes() for module in TASK_SOURCES))
            every = cached_tasks(self.name, tier, key, lambda: self.generate_tasks(tier))
            for name in SPLITS:
                self._tasks[(name, tier)] = [task for task in every if task.split == name]
        return list(self._tasks[(split, tier)])

    def generate_tasks(self, tier: str) -> list[Task]:
        """The tier's tasks, both splits, planned afresh (``tasks`` reads them from the on-disk cache)."""
        return generate_tasks(self.name, tier, self.pool(), TIERS[tier].tasks, TIERS[tier].pages)

    def reset(self, task: Task) -> str:
        observation = super().reset(task)  # rejects a task of a tier with other tools
        self.tier = TIERS[task.tier]
        self.max_observation_chars = self.tier.pages.max_chars
        self.session = None  # made on the first tool call (the text tiers' private copy of the repository)
        return observation

    def run_tool(self, call: ToolCall) -> ToolResult:
        if self.session is None:
            self.session = self.tier.session(self.task, self.tier.pages)
        return self.session.run(call)

    @property
    def root(self) -> Path | None:
        """The task's private copy of the repository, once a text tier's tool made it."""
        return self.session.root if isinstance(self.session, MutantSandbox) else None

    def expert_action(self, task: Task, history: list[tuple[str, str]]) -> str:
        tier = TIERS[task.tier]
        return tier.expert(task, history, tier.tasks)
