"""Code localization: a bug was injected into one function of a real Python repository; find it.

The repository is a slice of the CPython 3.11.7 standard library laid out as ``lib/<module>.py`` and
``tests/test_<module>.py``. ``code_mutations`` injects SWE-smith-style bugs into real functions and keeps a
mutant only when a real test of the module fails; the failing test becomes the issue, and the reward names the
mutated function.

Tasks. One task per (mutated function, failing test) pair, at most ``Tier.tasks_per_function`` per function (the
default tier: one per (mutant, failing test), since another mutant puts the bug on another line).
The split is decided by the target file (``split_of("lib/<module>.py")``), so held-out modules are never
train targets. Tiers (the tools differ, see ``tools_for``):

* ``default`` (the tiny from-scratch CPU model): crash bugs, read with argument-free tools, one short word each,
  because that model learns tool names and the order of steps in a few minutes of SFT but not to write the right
  digits, paths or names (measured with the previous small-integer tools ``open(fn, page)`` /
  ``submit(fn, page)``: it always wrote the most frequent function and page, 0.06-0.16 held-out). The reader's
  position is kept in the environment and is a function of the calls so far (a branch replays them,
  ``SegmentStart.calls``). ``test()`` shows the failing test and lists the functions it runs - those it calls
  by a name that resolves to one function of the module, then what they call, two levels deep, at most
  ``READER_FUNCTIONS``, in file order (sorting by file keeps the buggy one's place in the list from telling) -
  and puts any function away; ``trace()`` shows the traceback (innermost frame last; frames of listed functions
  marked '(fn k)') and puts any function away; ``next()`` opens the next listed function at page 1; ``page()``
  shows the next page (eight code lines; docstring, blank and comment lines left out; at most three pages);
  ``submit()`` submits the function and page in front and ends the episode. Every observation ends with where
  the reader is, "[fn 2 of 5, page 1/3]" or "[no function open; 5 listed]"; a call that makes no sense where
  the reader is (``next()`` before ``test()`` or after the last function, ``page()`` on a last page or with no
  function open) is an ``Error:`` observation. The line where the exception was raised (the traceback's
  innermost frame in the module) ends with "<- raised here" on its page, as a debugger marks it.
  Which tasks: the failing test errors inside the module (an exception, not a failed assertion) and the
  traceback passes through the page with the bug (a frame's line is on it); the buggy function is one the reader
  lists. In ~90% of them the bug is on the page that raised. A failed assertion leaves no trace in the module:
  which page computes a wrong value is beyond the tiny model (with them in the mix, SFT reached 0.09 held-out
  and submitted early), so those stay in the ``text`` and ``hard`` tiers. Tasks whose expert episode would be
  shorter than ``READER_TURNS`` (6 turns: the bug on page 1 or 2 of the first function, about half of the pairs)
  are not made, so episodes are long enough for segments and submitting at once is never right.
  Reward: 1 when the function in front is the mutated one and the page in front shows the mutated line.
  The page is kept in the answer (and ``submit()`` with no function open is a wrong answer, not an error) so
  that a guess stays rare: uniformly random calls reach a listed function and submit there often enough that
  the function alone pays a random agent ~0.07, the page brings it to ~0.04; an error instead of a wrong
  answer would only give it more tries. The expert's plan is fixed: test(), trace(), then next() / page()
  through the functions in order until the page with the bug is in front, then submit(); a stray move past
  that page starts over with test(). Its thoughts are fixed phrases naming nothing. The one decision is which
  page holds the bug (when to stop and submit). Expert episodes take 6-20 turns (median 9 on train, 7 held-out).
* ``text`` (real models, e.g. SmolLM2): free-text tools over a private copy of the repository, ``ls``, ``grep``,
  ``open``, ``search`` and ``submit(location="lib/textwrap.py::TextWrapper._wrap_chunks")`` (the file-level hit
  is reported in ``info``). The issue is the failing test's name and class plus its exception line; pages are
  short (8 lines, 5 grep hits, 3 search results, <= 350 characters). Only tasks whose failing test calls the
  buggy function by name in its first lines are kept, so a short algorithmic plan solves them: grep the test
  class -> grep the test method -> open the test until the call -> search the called name -> open the function
  (until the mutated line) -> submit. That is 6-10 turns.
* ``hard``: the ``text`` tools; any failing test, the full traceback as the issue, long pages (40 lines, 20
  hits, 8 results). The scripted expert there is an oracle for the last hop (it searches the buggy function's
  name).

Workspaces (``text`` and ``hard``) live under ``$FOCUS_DATA_DIR/code_localization/ws-v<version>/``: one pristine
base tree per module pool (copied from the interpreter's stdlib after the hash check) and one directory per task,
made lazily of hard links to the base tree plus the mutated file. Tools resolve every path inside the task
directory and refuse absolute paths, ``..``, symlinks and over-long paths, so the installed stdlib is never
reachable. The ``default`` tier needs no workspace: it only shows the test, the traceback and the listed
functions.
"""

from __future__ import annotations

import ast
import functools
import os
import posixpath
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from focus_core.agent.toolcall import ToolCall, ToolSpec
from focus_core.envs import code_mutations as cm
from focus_core.envs import register_env
from focus_core.envs.base import SPLITS, Task, ToolEnv, ToolFailure, ToolResult, cached_tasks, data_dir, split_of
from focus_core.envs.text import Bm25, cut, fit, identifier_words
from focus_core.ids import task_id

HELDOUT_FRACTION = 0.2
SPLIT_SALT = "code_localization-v1"
MAX_PATH_CHARS = 200
# Part of every task id: bump it when the tasks a tier generates change, so no cache keyed by task id is stale.
TASK_VERSION = "4"


@dataclass(frozen=True)
class Tier:
    page_lines: int
    line_chars: int
    grep_hits: int
    search_k: int
    max_chars: int
    test_pages: int  # pages of the failing test the expert reads (text: the call must be on one of them)
    tasks_per_function: int = 6  # the most tasks with the same answer (the default tier counts each mutant)


TIERS = {  # the default tier: page_lines code lines a page, line_chars, max_chars
    "default": Tier(page_lines=8, line_chars=56, grep_hits=0, search_k=0, max_chars=400, test_pages=1,
                    tasks_per_function=15),
    "text": Tier(page_lines=8, line_chars=52, grep_hits=5, search_k=3, max_chars=350, test_pages=3),
    "hard": Tier(page_lines=40, line_chars=110, grep_hits=20, search_k=8, max_chars=4000, test_pages=1),
}
SCOPE = {"default": "named", "text": "named", "hard": "all"}  # the mutants a tier draws from (code_mutations.SCOPES)
INSTRUCTION = 'Find the buggy function. End with submit(location="path::qualname").'
INDEX_INSTRUCTION = "Find the bug: read the test, then its functions page by page. Submit the page with the bug."
INDEX_CANDIDATES = 6  # the most functions of the module the default tier's failing test may call by name
READER_FUNCTIONS = 8  # the most functions test() lists: those the test calls, then what they call (two levels)
INDEX_MAX_PAGES = 3  # pages of a function the default tier shows; the mutated line must be on one of them
# The default tier's expert episodes: test(), trace(), next(), a page() or next() per page before the bug, submit().
# A task whose bug the reader reaches sooner (page 1 or 2 of the first function) is not made: the episode would be
# too short to have segments, and a policy that submits at once would be right too often.
READER_TURNS = (6, 20)


# -- the repository: files, entity spans, BM25 over functions ---------------------------------------------------

def _spans(text: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualname) of every entity of a file; innermost last."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return sorted(((e.def_line, e.end_line, e.qualname) for e, _ in cm.entities(tree)), key=lambda s: (s[0], -s[1]))


class Repo:
    """The pristine files of a module pool and a BM25 index over its functions (names, parameters, docstrings).

    Parameter defaults are left out of the index on purpose: a ``change_default`` mutant must not show.
    """

    def __init__(self, modules: tuple[str, ...]) -> None:
        self.modules = modules
        self.files: dict[str, str] = {}
        for module in modules:
            self.files[f"lib/{module}.py"] = cm.source_path(module).read_text(encoding="utf-8")
            self.files[f"tests/test_{module}.py"] = cm.test_path(module).read_text(encoding="utf-8")
        self.entries: list[tuple[str, str, str]] = []  # (path, qualname, summary shown in search results)
        corpus = []
        for module in modules:
            path = f"lib/{module}.py"
            for entity, node in cm.entities(ast.parse(self.files[path])):
                params = ", ".join(a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs])
                doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
                self.entries.append((path, entity.qualname, f"({params}) {doc}".strip()))
                corpus.append(identifier_words(f"{module} {entity.qualname} {params} {doc}"))
        self.index = Bm25(corpus)
        self.position = {(path, qualname): i for i, (path, qualname, _) in enumerate(self.entries)}
        self.class_lines = [(path, number, line) for path, text in self.files.items() if path.startswith("tests/")
                            for number, line in enumerate(text.splitlines(), 1) if "class " in line]

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one Repo per pool, kept for the process)
    def class_hits(self, name: str) -> list[tuple[str, int]]:
        """Where grep(pattern="class <name>", path="tests") hits."""
        return [(path, number) for path, number, line in self.class_lines if f"class {name}" in line]

    @functools.lru_cache(maxsize=4096)  # noqa: B019
    def page(self, path: str, start: int, tier: str) -> tuple[str, int]:
        return _page(path, self.files[path], start, TIERS[tier])

    @functools.lru_cache(maxsize=4096)  # noqa: B019
    def search(self, query: str, k: int) -> list[int]:
        return self.index.top(identifier_words(query), k)


@functools.lru_cache(maxsize=4)
def _repo(modules: tuple[str, ...]) -> Repo:
    return Repo(modules)


# -- the environment --------------------------------------------------------------------------------------------

TEXT_TOOLS = (
    ToolSpec("ls", "list a directory of the repository", (
        ("path", "string", "a directory, e.g. 'lib' or 'tests'"), ("start", "integer", "skip this many entries")),
        ("path",)),
    ToolSpec("grep", "lines containing a fixed string, as path:line: text", (
        ("pattern", "string", "the text to find"), ("path", "string", "a file or directory (default '.')")),
        ("pattern",)),
    ToolSpec("open", "a page of a file from a line", (
        ("path", "string", "a file, e.g. 'lib/textwrap.py'"), ("start", "integer", "first line (default 1)")),
        ("path",)),
    ToolSpec("search", "functions by name, parameters and docstring, as path::qualname", (
        ("query", "string", "words or identifiers"),), ("query",)),
    ToolSpec("submit", "submit the buggy function; ends the episode", (
        ("location", "string", "path::qualname, e.g. 'lib/textwrap.py::TextWrapper.wrap'"),), ("location",)),
)
# The default tier's tools take no arguments: a reader walks the functions the failing test runs. A from-scratch
# tiny model learns the plan and the call format in minutes but not to write the right digits (measured with
# integer arguments: it always wrote the most frequent function and page), so at this tier what is left to decide
# is when to move on and when to submit - which is what the code on the page decides.
READER_TOOLS = (  # one short word each
    ToolSpec("test", "the failing test and the functions it runs, in file order; puts any function away", (), ()),
    ToolSpec("trace", "the failing test's traceback, innermost frame last; puts any function away", (), ()),
    ToolSpec("next", "open the next function test() listed, at its page 1", (), ()),
    ToolSpec("page", "the next page of the function in front of you", (), ()),
    ToolSpec("submit", "submit the function in front of you as the buggy one, pointing at this page; ends the "
             "episode", (), ()),
)
# Every reader observation ends with where the reader is: "[fn 2 of 5, page 1/3]" (with "; raised here" when the
# page shows where the exception was raised) or "[no function open; 5 listed]" ("[no function open]" before test()).
_READER_FOOTER = re.compile(
    r"\[(?:fn (\d+) of \d+, page (\d+)/\d+(?:; raised here)?|no function open(; \d+ listed)?)\]$")


@register_env("code_localization")
class CodeLocalizationEnv(ToolEnv):
    tools = TEXT_TOOLS
    tiers = tuple(TIERS)

    @classmethod
    def tools_for(cls, tier: str) -> tuple[ToolSpec, ...]:
        # A subclass with its own toolset (swebench_loc) keeps it on every tier.
        return READER_TOOLS if tier == "default" and cls.tools is TEXT_TOOLS else cls.tools

    def __init__(self, modules: tuple[str, ...] | None = None, tier: str = "default") -> None:
        """``modules`` restricts the repository to a few modules (quick tasks for tests); default: cm.MODULES."""
        super().__init__(tier)
        self.modules = tuple(modules) if modules else None
        self._tasks: dict[tuple[str, str], list[Task]] = {}
        self.tier = TIERS[tier]  # the page sizes of the current task's tier (reset sets it)
        self.root: Path | None = None

    def pool(self) -> tuple[str, ...]:
        return self.modules or cm.MODULES

    # -- tasks ---------------------------------------------------------------------------------------------------

    def tasks(self, split: str, tier: str = "default") -> list[Task]:
        if split not in SPLITS or tier not in TIERS:
            raise ValueError(f"split must be one of {SPLITS} and tier one of {sorted(TIERS)}")
        if (split, tier) not in self._tasks:
            # Planning parses thousands of mutants (a minute or more): cached on disk, keyed by what the tasks derive
            # from - the mutant records' cache (generator version, Python) and the two generators' sources.
            cm.check_sources()  # the tasks quote these files: a cached copy is only as good as they are
            key = (TASK_VERSION, ",".join(self.pool()), cm.cache_dir().name, Path(__file__).read_bytes(),
                   Path(cm.__file__).read_bytes())
            every = cached_tasks(self.name, tier, key, lambda: self._generate(tier))
            for name in SPLITS:
                self._tasks[(name, tier)] = [task for task in every if task.split == name]
        return list(self._tasks[(split, tier)])

    def _generate(self, tier: str) -> list[Task]:
        pool = self.pool()
        records, repo, tasks = cm.load_records(pool, SCOPE[tier]), _repo(pool), []
        for module in pool:
            split = split_of(f"lib/{module}.py", HELDOUT_FRACTION, salt=SPLIT_SALT)
            used: set[tuple[str | int, ...]] = set()  # (function, test), plus the mutant at the default tier
            per_function: dict[str, int] = {}
            for record in records[module]:
                if per_function.get(record["qualname"], 0) >= TIERS[tier].tasks_per_function:
                    continue
                failures = record["failures"]
                if tier == "hard":  # prefer a test that does not call the function by name: a harder issue
                    name = _call_name(record["qualname"])
                    failures = sorted(failures, key=lambda f, n=name: any(c == n for c, _ in f["calls"] or ()))
                for failure in failures:
                    # The default tier keeps each (function, test) once per mutant: another mutant puts the bug on
                    # another line, which is another task for a reader.
                    seen = (record["qualname"], failure["test_id"]) + ((record["start"],) if tier == "default" else ())
                    if seen in used or per_function.get(record["qualname"], 0) >= TIERS[tier].tasks_per_function:
                        continue
                    plan = _reader_plan if tier == "default" else _plan
                    facts, prompt = plan(repo, record, failure, tier), _issue(record, failure, tier)
                    if facts is None or any(secret in prompt for secret in _host_paths()):
                        continue
                    used.add(seen)
                    per_function[record["qualname"]] = per_function.get(record["qualname"], 0) + 1
                    key = f"{record['path']}::{record['qualname']}"
                    tasks.append(Task(
                        task_id=task_id(self.name, TASK_VERSION, tier, ",".join(pool), key, record["start"],
                                        record["end"], record["replacement"], failure["test_id"]),
                        env=self.name, split=split, tier=tier, prompt=prompt, answer=key,
                        split_key=record["path"], facts=facts))
                    if tier != "default":  # one test per mutant; the default tier takes every test it can show
                        break
        return tasks

    # -- tools ---------------------------------------------------------------------------------------------------

    def reset(self, task: Task) -> str:
        observation = super().reset(task)  # rejects a task of a tier with other tools
        self.tier = TIERS[task.tier]
        self.max_observation_chars = self.tier.max_chars
        self.root = None  # the task's private copy is made on the first tool call
        self._listed, self._fn, self._page = False, 0, 0  # the default tier's reader: test() ran, function, page
        return observation

    def run_tool(self, call: ToolCall) -> ToolResult:
        args = call.arguments
        if self.tools is READER_TOOLS:
            return self._run_reader_tool(call)
        try:
            if call.name == "ls":
                return ToolResult(self._ls(args["path"], args.get("start", 0)))
            if call.name == "grep":
                return ToolResult(self._grep(args["pattern"], args.get("path", ".")))
            if call.name == "open":
                return ToolResult(self._open(args["path"], args.get("start", 1)))
            if call.name == "search":
                return ToolResult(self._search(args["query"]))
            return self._submit(args["location"])
        except OSError as exc:  # e.g. a name the file system rejects: never a crash, never a host path
            raise ToolFailure(f"cannot read that path ({exc.strerror or 'error'})") from None

    def _run_reader_tool(self, call: ToolCall) -> ToolResult:
        """Default tier: the reader's position is a function of the calls so far, which a branch replays."""
        f = self.task.facts
        if call.name == "submit":
            return _reader_submit(self.task, self._fn, self._page)
        if call.name == "test":
            self._listed, self._fn, self._page = True, 0, 0
            body = _reader_test(self.task)
        elif call.name == "trace":
            self._fn, self._page = 0, 0
            body = "\n".join(fit(f["trace"], self.tier.max_chars - 40))
        elif call.name == "next":
            if not self._listed:
                raise ToolFailure("no functions are listed yet; call test() first")
            if self._fn == len(f["candidates"]):
                raise ToolFailure("that was the last function; test() starts them over")
            self._fn, self._page = self._fn + 1, 1
            body = _reader_page(self.task, self._fn, self._page)
        else:
            if not self._fn:
                raise ToolFailure("no function is open; call next()")
            if self._page == f["pages"][self._fn - 1]:
                raise ToolFailure("this is the function's last page; next() opens the next function")
            self._page += 1
            body = _reader_page(self.task, self._fn, self._page)
        return ToolResult(f"{body}\n{self._footer()}")

    def _footer(self) -> str:
        n = len(self.task.facts["candidates"])
        if self._fn:
            raised = self.task.facts["raised"]
            here = "; raised here" if raised and raised[:2] == [self._fn, self._page] else ""
            return f"[fn {self._fn} of {n}, page {self._page}/{self.task.facts['pages'][self._fn - 1]}{here}]"
        return f"[no function open; {n} listed]" if self._listed else "[no function open]"

    def _resolve(self, path: str) -> tuple[Path, str]:
        raw = path.strip()
        if len(raw) > MAX_PATH_CHARS:
            raise ToolFailure(f"the path is longer than {MAX_PATH_CHARS} characters")
        if raw.startswith(("/", "~", "\\")) or "\x00" in raw or re.match(r"[A-Za-z]:", raw):
            raise ToolFailure("use a path inside the repository, such as 'lib' or 'tests/test_textwrap.py'")
        rel = posixpath.normpath(raw or ".")
        if rel == ".." or rel.startswith("../"):
            raise ToolFailure(f"{raw[:60]!r} is outside the repository")
        root = self._workspace()
        full = root
        for part in [] if rel == "." else rel.split("/"):
            full = full / part
            if full.is_symlink():
                raise ToolFailure(f"{rel[:60]!r} is a link; links are not followed")
        if not full.exists():
            raise ToolFailure(f"no such file or directory: {rel[:60]!r}")
        if os.path.commonpath([os.path.realpath(full), os.path.realpath(root)]) != os.path.realpath(root):
            raise ToolFailure(f"{raw[:60]!r} is outside the repository")
        return full, rel

    def _files(self, full: Path, rel: str) -> list[tuple[Path, str]]:
        if full.is_file():
            return [(full, rel)]
        found = []
        for dirpath, dirnames, filenames in os.walk(full):  # os.walk does not follow links
            dirnames[:] = sorted(d for d in dirnames if not os.path.islink(os.path.join(dirpath, d)))
            for name in sorted(filenames):
                path = Path(dirpath) / name
                if not path.is_symlink():
                    found.append((path, posixpath.normpath(posixpath.join(rel, os.path.relpath(path, full)))))
        return found

    def _ls(self, path: str, start: int) -> str:
        full, rel = self._resolve(path)
        if not full.is_dir():
            raise ToolFailure(f"{rel} is a file; use open(path={rel!r})")
        names = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(full) if not e.is_symlink())
        if not 0 <= start < max(len(names), 1):
            raise ToolFailure(f"start must be between 0 and {max(len(names) - 1, 0)}")
        shown, budget = [], self.tier.max_chars - 60
        for name in names[start:]:
            if sum(len(n) + 1 for n in shown) + len(name) > budget:
                break
            shown.append(name)
        more = len(names) - start - len(shown)
        tail = f"\n(+{more} more: ls(path={rel!r}, start={start + len(shown)}))" if more else ""
        return f"{rel}/: " + " ".join(shown) + tail

    def _grep(self, pattern: str, path: str) -> str:
        if not pattern or len(pattern) > 200:
            raise ToolFailure("the pattern must be 1 to 200 characters")
        full, rel = self._resolve(path)
        hits = []
        for file, name in self._files(full, rel):
            for number, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if pattern in line:
                    hits.append(f"{name}:{number}: {cut(line.strip(), self.tier.line_chars - 12)}")
        if not hits:
            return f"No line of {rel} contains {pattern!r}."
        shown = fit(hits[: self.tier.grep_hits], self.tier.max_chars - 40)
        more = f" (first {len(shown)}; narrow the path)" if len(shown) < len(hits) else ""
        return f"{len(hits)} hits{more}:\n" + "\n".join(shown)

    def _open(self, path: str, start: int) -> str:
        full, rel = self._resolve(path)
        if full.is_dir():
            raise ToolFailure(f"{rel} is a directory; use ls(path={rel!r})")
        return _page(rel, full.read_text(encoding="utf-8", errors="replace"), start, self.tier)[0]

    def _search(self, query: str) -> str:
        if not query.strip() or len(query) > 200:
            raise ToolFailure("the query must be 1 to 200 characters")
        repo = _repo(tuple(self.task.facts["pool"].split(",")))
        results = []
        for index in repo.search(query, self.tier.search_k):
            path, qualname, summary = repo.entries[index]
            line = self._def_lines(path).get(qualname, "?")
            results.append(cut(f"{path}::{qualname} L{line} {summary}", self.tier.line_chars * 2))
        if not results:
            return f"No function matches {query!r}."
        return f"{len(results)} results:\n" + "\n".join(fit(results, self.tier.max_chars - 20))

    def _def_lines(self, path: str) -> dict[str, int]:
        text = (self._workspace() / path).read_text(encoding="utf-8")  # the task's copy: the mutated file too
        return {qualname: first for first, _, qualname in reversed(_spans_of(text))}

    def _submit(self, location: str) -> ToolResult:
        path, sep, qualname = location.strip().partition("::")
        if not sep or not path.strip() or not qualname.strip():
            raise ToolFailure('the location must look like "lib/module.py::Class.method"')
        path = posixpath.normpath(path.strip())
        target_path, _, target = self.task.answer.partition("::")
        file_hit, hit = path == target_path, path == target_path and qualname.strip() == target
        verdict = "correct" if hit else "wrong"
        return ToolResult(f"Submitted {path}::{qualname.strip()}: {verdict}.", reward=float(hit), done=True,
                          info={"file_hit": file_hit, "function_hit": hit})

    def _workspace(self) -> Path:
        if self.root is None:
            self.root = _workspace(self.task)
        return self.root

    # -- the scripted expert -------------------------------------------------------------------------------------

    def expert_action(self, task: Task, history: list[tuple[str, str]]) -> str:
        if task.tier == "default":
            return _reader_expert(task, history)
        return self._text_expert(task, history)

    def _text_expert(self, task: Task, history: list[tuple[str, str]]) -> str:
        """Locate the test, read it up to the call, find the called function, read it, submit.

        Every step is checked against what the observations so far show (not against what the expert did),
        so the plan resumes correctly after any injected mistake: a step is skipped once its evidence is on
        screen, and a step whose call already ran twice without producing it is given up.
        """
        f, tier = task.facts, TIERS[task.tier]
        seen = "\n".join(observation for _, observation in history)
        actions = [action for action, _ in history]
        pages = [(m[1], int(m[2]), int(m[3])) for _, o in history if (m := _HEADER.match(o))]

        def fresh(call: ToolCall, times: int = 2) -> bool:
            return sum(a.strip().endswith(call.render()) for a in actions) < times

        def next_page(path: str, first: int, goal: int, limit: int) -> ToolCall | None:
            chain = [end for p, start, end in pages if p == path and first <= start <= goal]
            if any(p == path and start <= goal <= end for p, start, end in pages) or len(chain) >= limit:
                return None
            return ToolCall("open", {"path": path, "start": max(chain) + 1 if chain else first})

        steps: list[ToolCall | None] = []
        if task.tier == "text":
            steps.append(None if f"{f['test_file']}:{f['class_line']}: " in seen else
                         ToolCall("grep", {"pattern": f"class {f['test_class']}", "path": "tests"}))
        steps.append(None if f"{f['test_file']}:{f['test_def_line']}: " in seen else
                     ToolCall("grep", {"pattern": f"def {f['test_method']}(", "path": f["test_file"]}))
        goal = f["call_line"] if task.tier == "text" else f["test_def_line"]
        steps.append(next_page(f["test_file"], f["test_def_line"], goal, tier.test_pages))
        located = f"{task.answer} " in seen or f"{f['path']}:{f['def_line']}: " in seen
        search = ToolCall("search", {"query": f["query"]})
        if not located and not fresh(search, times=1):  # the search did not show it: grep for the definition
            steps.append(ToolCall("grep", {"pattern": f"def {f['qualname'].split('.')[-1]}(", "path": f["path"]}))
        else:
            steps.append(None if located else search)
        steps.append(next_page(f["path"], f["def_line"], f["mutated_line"], 3))
        for step in steps:
            if step is not None and fresh(step):
                return step.render()
        return ToolCall("submit", {"location": task.answer}).render()


_HEADER = re.compile(r"^(\S+):(\d+)-(\d+)/\d+")


# -- pages, plans and issues ------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def _spans_of(text: str) -> list[tuple[int, int, str]]:
    return _spans(text)


def _page(rel: str, text: str, start: int, tier: Tier) -> tuple[str, int]:
    """One page of a file from ``start``: a header 'path:first-last/total qualname', numbered lines, a footer."""
    lines = text.splitlines()
    if not 1 <= start <= max(len(lines), 1):
        raise ToolFailure(f"start must be between 1 and {len(lines)} for {rel}")
    inside = [q for first, last, q in _spans_of(text) if first <= start <= last]
    where = f" {cut(inside[-1], 40)}" if inside else ""
    window = lines[start - 1: start - 1 + tier.page_lines]
    indent = min((len(s) - len(s.lstrip()) for s in window if s.strip()), default=0)
    budget = tier.max_chars - len(f"{rel}:{start}-{start + len(window)}/{len(lines)}{where}") - 24
    body = fit([cut(f"{start + i} {s[indent:].rstrip()}", tier.line_chars) for i, s in enumerate(window)], budget)
    end = start + len(body) - 1
    footer = f"next: start={end + 1}" if end < len(lines) else "end of file"
    return "\n".join([f"{rel}:{start}-{end}/{len(lines)}{where}", *body, footer]), end


def _grep_lines(text: str, pattern: str) -> list[int]:
    return [number for number, line in enumerate(text.splitlines(), 1) if pattern in line]


def _plan(repo: Repo, record: dict[str, Any], failure: dict[str, Any], tier_name: str) -> dict[str, Any] | None:
    """The facts a task relies on, or None when the expert's plan would not work for this (mutant, test)."""
    tier, module = TIERS[tier_name], record["module"]
    test_file, (test_class, test_method) = f"tests/test_{module}.py", failure["test_id"].split(".")[-2:]
    test_text = repo.files[test_file]
    defs, classes = _grep_lines(test_text, f"def {test_method}("), repo.class_hits(test_class)
    if len(defs) != 1 or not classes:
        return None
    name = _call_name(record["qualname"])
    facts = {"pool": ",".join(repo.modules), "module": module, "path": record["path"], "qualname": record["qualname"],
             "def_line": record["def_line"], "mutated_line": record["line"], "op": record["op"],
             "start": record["start"], "end": record["end"], "replacement": record["replacement"],
             "test_file": test_file, "test_class": test_class, "test_method": test_method, "class_line": classes[0][1],
             "test_def_line": defs[0], "call_name": None, "call_line": None, "query": f"{module} {name}"}
    if tier_name == "hard":
        return facts
    call_line = next((line for called, line in failure["calls"] or () if called == name), None)
    if classes != [(test_file, classes[0][1])] or call_line is None or len(_issue(record, failure, "text")) > 300:
        return None
    start, visible = defs[0], False
    for _ in range(tier.test_pages):  # is the call on one of the first pages the expert opens, and not cut off?
        if start > len(test_text.splitlines()):
            break
        page, end = repo.page(test_file, start, tier_name)
        if start <= call_line <= end:
            visible = re.search(rf"\b{re.escape(name)}\(", page) is not None
        start = end + 1
    query = f"{module} {name}"
    if not visible or repo.position[(record["path"], record["qualname"])] not in repo.search(query, tier.search_k):
        return None
    return {**facts, "call_name": name, "call_line": call_line, "query": query}


def _call_name(qualname: str) -> str:
    """The name a test calls the function by: the class for ``Class.__init__``, else the function's name."""
    parts = qualname.split(".")
    return parts[-2] if parts[-1] == "__init__" and len(parts) > 1 else parts[-1]


def _issue(record: dict[str, Any], failure: dict[str, Any], tier: str) -> str:
    test_class, test_method = failure["test_id"].split(".")[-2:]
    if tier == "hard":
        return f"{failure['kind']}: {test_method} ({test_class})\n{failure['traceback'][-2500:]}\n{INSTRUCTION}"
    instruction = INDEX_INSTRUCTION if tier == "default" else INSTRUCTION
    exception = failure["exception"].split("\n")[0]
    head = f"{failure['kind']}: {test_method} ({test_class})"
    return f"{head}\n{cut(exception, max(40, 298 - len(head) - len(instruction)))}\n{instruction}"


# -- the default tier: a reader over the functions the failing test runs ----------------------------------------

def _reader_plan(repo: Repo, record: dict[str, Any], failure: dict[str, Any], tier_name: str) -> dict[str, Any] | None:
    """The default tier's facts: the functions the failing test runs (those it calls by a name that resolves to
    one function of the module, then what they call, two levels deep, at most READER_FUNCTIONS, in file order),
    their page counts, the buggy one's number and the page of its mutated line, and the page where the exception
    was raised (the innermost frame in the module, when it is in a listed function). None when the test calls
    no function or more than INDEX_CANDIDATES functions by a name that resolves to one, the buggy one is not
    listed, the mutated line is past the pages shown, the expert's episode would not take READER_TURNS, or the
    bug is not a crash on the traceback's path (see the module docstring)."""
    module, (test_class, test_method) = record["module"], failure["test_id"].split(".")[-2:]
    test_file = f"tests/test_{module}.py"
    defs = _grep_lines(repo.files[test_file], f"def {test_method}(")
    pristine = repo.files[record["path"]]
    by_name = _call_names(pristine)
    # A name several classes define (a method name) cannot be resolved from the test: it is left out.
    calls = [(name, line) for name, line in failure["calls"] or () if len(by_name.get(name, ())) == 1]
    called = list(dict.fromkeys(by_name[name][0] for name, _ in calls))
    if len(defs) != 1 or not called or len(called) > INDEX_CANDIDATES:
        return None
    text = _mutated_text(",".join(repo.modules), record["path"], record["start"], record["end"], record["replacement"])
    runs, frontier, callees = list(called), list(called), _callees(pristine)
    for _ in range(2):  # what the called functions call, and what that calls
        frontier = [q for caller in frontier for name in callees.get(caller, ())
                    if len(by_name.get(name, ())) == 1 and (q := by_name[name][0]) not in runs]
        for q in dict.fromkeys(frontier):
            if len(runs) < READER_FUNCTIONS and _function_lines(text, q):
                runs.append(q)
    if record["qualname"] not in runs:  # the buggy function must be one the reader lists
        return None
    order = _def_order(pristine)
    candidates = sorted(runs, key=order.__getitem__)
    facts = {"pool": ",".join(repo.modules), "module": module, "path": record["path"], "qualname": record["qualname"],
             "def_line": record["def_line"], "mutated_line": record["line"], "op": record["op"],
             "start": record["start"], "end": record["end"], "replacement": record["replacement"],
             "test_file": test_file, "test_class": test_class, "test_method": test_method, "test_def_line": defs[0],
             "call_lines": [line for _, line in calls], "candidates": candidates,
             "trace": _trace(failure, module, candidates)}
    if any(secret in line for line in facts["trace"] for secret in _host_paths()):
        return None
    page_lines = TIERS[tier_name].page_lines
    pages, gold_page, raised = [], None, None
    frames = re.findall(rf'File "(?:[^"]*/)?{re.escape(module)}\.py", line (\d+), in ', failure["traceback"])
    raised_line = int(frames[-1]) if frames else None
    for fn, qualname in enumerate(candidates, 1):
        lines = _function_lines(text, qualname)
        if not lines:
            return None
        numbers = [number for number, _ in lines]
        pages.append(min(INDEX_MAX_PAGES, -(-len(lines) // page_lines)))
        if raised_line in numbers and numbers.index(raised_line) < INDEX_MAX_PAGES * page_lines:
            raised = [fn, numbers.index(raised_line) // page_lines + 1, raised_line]
        if qualname == record["qualname"]:
            at = next((i for i, number in enumerate(numbers) if number >= record["line"]), None)
            gold_page = None if at is None else at // page_lines + 1
    if gold_page is None or gold_page > INDEX_MAX_PAGES:
        return None
    facts = {**facts, "pages": pages, "gold": candidates.index(record["qualname"]) + 1, "gold_page": gold_page,
             "raised": raised}
    if not READER_TURNS[0] <= reader_expert_turns(facts) <= READER_TURNS[1]:
        return None
    # The page must show the mutated line (and the raised line, for the mark), not lose it to the size limit.
    gold_numbers = [number for number, _ in _reader_lines(facts, facts["gold"], gold_page)]
    if not any(number >= record["line"] for number in gold_numbers[1:]):
        return None
    # A crash bug: the test errors inside the module and the traceback passes through the bug's page. A failed
    # assertion leaves no trace in the module, and which page holds a wrong value is beyond the tiny model.
    if failure["kind"] != "ERROR" or not {int(line) for line in frames} & set(gold_numbers[1:]):
        return None
    if raised and raised[2] not in [number for number, _ in _reader_lines(facts, raised[0], raised[1])]:
        facts["raised"] = None
    return facts


def reader_expert_turns(facts: dict[str, Any]) -> int:
    """The turns of the default tier's expert episode: test(), trace(), one call per page up to the bug's page
    (next() opens a function at page 1, page() turns), submit()."""
    return 3 + sum(facts["pages"][: facts["gold"] - 1]) + facts["gold_page"]


@functools.lru_cache(maxsize=64)
def _call_names(text: str) -> dict[str, list[str]]:
    """The entities a test can call by each name: its own name, or the class name for ``Class.__init__``."""
    found: dict[str, list[str]] = {}
    for entity, _ in cm.entities(ast.parse(text)):
        found.setdefault(_call_name(entity.qualname), []).append(entity.qualname)
    return found


@functools.lru_cache(maxsize=64)
def _callees(text: str) -> dict[str, tuple[str, ...]]:
    """The names each entity calls (``f(...)``, ``x.f(...)``), in order of first appearance."""
    found = {}
    for entity, node in cm.entities(ast.parse(text)):
        names = [call.func.id if isinstance(call.func, ast.Name) else call.func.attr for call in ast.walk(node)
                 if isinstance(call, ast.Call) and isinstance(call.func, (ast.Name, ast.Attribute))]
        found[entity.qualname] = tuple(dict.fromkeys(names))
    return found


@functools.lru_cache(maxsize=64)
def _def_order(text: str) -> dict[str, tuple[int, str]]:
    """Where each entity is defined: the order test() lists functions in (file order)."""
    return {entity.qualname: (node.lineno, entity.qualname) for entity, node in cm.entities(ast.parse(text))}


@functools.lru_cache(maxsize=256)
def _mutated_text(pool: str, path: str, start: int, end: int, replacement: str) -> str:
    text = _repo(tuple(pool.split(","))).files[path]
    return text[:start] + replacement + text[end:]


@functools.lru_cache(maxsize=16)
def _entity_nodes(text: str) -> dict[str, ast.AST]:
    """The first node of each entity of a module text. Parsed once per text: a plan asks for several of one
    mutant's functions, and parsing was nine tenths of generating the default tier's tasks."""
    found: dict[str, ast.AST] = {}
    for entity, node in cm.entities(ast.parse(text)):
        found.setdefault(entity.qualname, node)
    return found


@functools.lru_cache(maxsize=1024)
def _function_lines(text: str, qualname: str) -> list[tuple[int, str]]:
    """(line number, text) of the code lines of an entity: no docstring, blank or comment-only lines (they would
    fill the short pages), dedented to the ``def``."""
    node = _entity_nodes(text).get(qualname)
    if node is None:
        return []
    doc = node.body[0] if ast.get_docstring(node) is not None else None
    skip = set(range(doc.lineno, (doc.end_lineno or doc.lineno) + 1)) if doc else set()
    lines = text.splitlines()
    indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
    return [(number, lines[number - 1][indent:].rstrip()) for number in range(node.lineno, (node.end_lineno or 0) + 1)
            if number not in skip and lines[number - 1].strip() and not lines[number - 1].strip().startswith("#")]


def _trace(failure: dict[str, Any], module: str, candidates: list[str]) -> list[str]:
    """The traceback as short lines, 'traceback:' then 'file:line in name' per frame (innermost last), then the
    exception line; at most the six innermost frames, so it fits a page. A frame of a listed function is marked
    with its number ('(fn 2)')."""
    frames = []
    for m in re.finditer(r'File "([^"]+)", line (\d+), in (\S+)', failure["traceback"]):
        file, name = posixpath.basename(m[1]), m[3]
        listed = [i for i, q in enumerate(candidates, 1) if q.split(".")[-1] == name] if file == f"{module}.py" else []
        frames.append(f"{file}:{m[2]} in {name}" + (f" (fn {listed[0]})" if len(listed) == 1 else ""))
    exception = cut(failure["exception"].split("\n")[0], TIERS["default"].line_chars)
    return ["traceback:", *frames[-6:], exception]


def _reader_test(task: Task) -> str:
    """The failing test: the functions it runs, in file order, then its first code lines up to the last call."""
    f, width = task.facts, TIERS["default"].line_chars
    listed = ", ".join(cut(qualname, 30) for qualname in f["candidates"])
    text = _repo(tuple(f["pool"].split(","))).files[f["test_file"]]
    lines = text.splitlines()[f["test_def_line"] - 1: max(f["call_lines"])]
    indent = len(lines[0]) - len(lines[0].lstrip())
    body = [cut(line[indent:].rstrip(), width) for line in lines if line.strip() and not line.strip().startswith("#")]
    head = f"test {f['test_method']} runs {len(f['candidates'])} functions: {listed}"
    return "\n".join(fit([head, *body[:TIERS["default"].page_lines]], TIERS["default"].max_chars - 40))


def _reader_page(task: Task, fn: int, page: int) -> str:
    """A page of a listed function: its name, then up to eight code lines; the line where the exception was
    raised (the traceback's innermost frame in the module) ends with '<- raised here'."""
    return "\n".join(line for _, line in _reader_lines(task.facts, fn, page))


def _reader_lines(f: dict[str, Any], fn: int, page: int) -> list[tuple[int, str]]:
    """(line number, text) of what a page shows: the name (number 0), then the code lines that fit."""
    tier = TIERS["default"]
    text = _mutated_text(f["pool"], f["path"], f["start"], f["end"], f["replacement"])
    lines = _function_lines(text, f["candidates"][fn - 1])[(page - 1) * tier.page_lines: page * tier.page_lines]
    raised = f["raised"][2] if f.get("raised") and f["raised"][0] == fn else None
    shown = [(0, cut(f["candidates"][fn - 1], 40))]
    shown += [(number, cut(line, tier.line_chars) + ("  <- raised here" if number == raised else ""))
              for number, line in lines]
    return shown[:len(fit([line for _, line in shown], tier.max_chars - 40))]


def _reader_submit(task: Task, fn: int, page: int) -> ToolResult:
    """The answer, whatever is in front: with no function open it is a wrong one, not a retry, so that a guess
    stays a guess (an error there would give a random agent another try at the same position)."""
    f = task.facts
    function_hit = fn == f["gold"]
    hit = function_hit and page == f["gold_page"]
    what = f"fn {fn} page {page}" if fn else "no function"
    return ToolResult(f"Submitted {what}: {'correct' if hit else 'wrong'}.", reward=float(hit), done=True,
                      info={"function_hit": function_hit, "page_hit": hit})


def _reader_expert(task: Task, history: list[tuple[str, str]]) -> str:
    """test(), trace(), then next() through the listed functions in order, reading each page by page, until the
    page with the bug is in front: submit(). Its state is the latest footer, so it resumes after any mistake (a
    stray next() or page() past the bug starts over with test()). The thoughts are fixed phrases naming nothing."""
    f = task.facts
    where = next((m for _, observation in reversed(history) if (m := _READER_FOOTER.search(observation))), None)
    if where is None or (not where[1] and not where[3]):
        return "Read the failing test.\ntest()"
    if not where[1]:
        if not any(observation.startswith("traceback:") for _, observation in history):
            return "Read the traceback.\ntrace()"
        return "Open the first function.\nnext()"
    fn, page = int(where[1]), int(where[2])
    if (fn, page) == (f["gold"], f["gold_page"]):
        return "The bug is on this page.\nsubmit()"
    if (fn, page) > (f["gold"], f["gold_page"]):
        return "The bug was behind us; start over.\ntest()"
    if page < f["pages"][fn - 1]:
        return "No bug yet. Read the next page.\npage()"
    return "No bug here. Open the next function.\nnext()"


@functools.lru_cache(maxsize=1)
def _host_paths() -> tuple[str, ...]:
    """Strings that would reveal the host (and the pristine sources) if an issue text contained them."""
    found = {str(cm.stdlib_dir()), sys.prefix, sys.base_prefix, str(data_dir()), os.path.expanduser("~")}
    return tuple(p for p in found if len(p) > 1) + ("focus-mutant",)


# -- workspaces -------------------------------------------------------------------------------------------------

def _workspace_dir() -> Path:
    return data_dir() / "code_localization" / f"ws-v{cm.GENERATOR_VERSION}"


def _base_tree(pool: tuple[str, ...]) -> Path:
    """The pristine files of a pool, written once (atomically); task copies hard-link to them."""
    base = _workspace_dir() / f"base-{task_id('pool', *pool)}"
    if not base.is_dir():
        cm.check_sources()
        _workspace_dir().mkdir(parents=True, exist_ok=True)
        tmp = Path(_tempdir(base))
        for rel, text in _repo(pool).files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text, encoding="utf-8")
            (tmp / rel).chmod(0o444)
        _publish(tmp, base)
    return base


def _workspace(task: Task) -> Path:
    """The task's private copy of the mutated repository (made once, then reused read-only)."""
    root = _workspace_dir() / f"task-{task.task_id}"
    if root.is_dir():
        return root
    pool, facts = tuple(task.facts["pool"].split(",")), task.facts
    base = _base_tree(pool)
    tmp = Path(_tempdir(root))
    for rel in _repo(pool).files:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel == facts["path"]:
            text = _repo(pool).files[rel]
            text = text[: facts["start"]] + facts["replacement"] + text[facts["end"]:]
            (tmp / rel).write_text(text, encoding="utf-8")
            (tmp / rel).chmod(0o444)
            continue
        try:
            os.link(base / rel, tmp / rel)
        except OSError:
            shutil.copyfile(base / rel, tmp / rel)
    _publish(tmp, root)
    return root


def _tempdir(final: Path) -> str:
    return tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.")


def _publish(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)
    except OSError:  # another process published it first
        shutil.rmtree(tmp, ignore_errors=True)
