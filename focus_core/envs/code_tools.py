"""The tools of the code-localization environments: a sandbox over a repository, and an argument-free reader.

``RepoSandbox`` runs ``ls``, ``grep``, ``open`` and ``search`` over one directory. Every path resolves inside it:
absolute paths, ``..``, symlinks and over-long paths are refused, so nothing outside (the installed stdlib, the
host) is reachable. ``MutantSandbox`` is ``code_localization``'s: a task's private copy of the mutated repository,
with ``submit(location)``.

``Reader`` runs ``READER_TOOLS``, the argument-free tools of ``code_localization``'s default tier: its position
(which listed function, which page) is kept here and is a function of the calls so far, which a branch replays
(``SegmentStart.calls``). Every reader observation ends with where the reader is.
"""

from __future__ import annotations

import ast
import functools
import os
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from focus_core.agent.toolcall import ToolCall, ToolSpec
from focus_core.envs import code_mutations as cm
from focus_core.envs.base import Task, ToolFailure, ToolResult
from focus_core.envs.code_corpus import (
    FunctionIndex,
    directory_index,
    entity_spans,
    mutated_text,
    pool_of,
    repo_of,
    task_workspace,
)
from focus_core.envs.text import cut, fit

MAX_PATH_CHARS = 200


@dataclass(frozen=True)
class Pages:
    """How much one observation shows."""

    page_lines: int  # lines of a page (open; a reader page counts code lines only)
    line_chars: int  # the widest line shown
    result_chars: int  # the widest search result
    grep_hits: int  # grep hits shown
    search_k: int  # search results shown
    max_chars: int  # an observation's length


# The reader's pages (the default tier's): eight code lines each.
READER_PAGES = Pages(page_lines=8, line_chars=56, result_chars=112, grep_hits=0, search_k=0, max_chars=400)


class ToolSession(Protocol):
    """One episode's tools: runs a parsed, argument-checked call (may raise ``ToolFailure``)."""

    def run(self, call: ToolCall) -> ToolResult: ...


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
READER_FOOTER = re.compile(
    r"\[(?:fn (\d+) of \d+, page (\d+)/\d+(?:; raised here)?|no function open(; \d+ listed)?)\]$")
# The header of an open() page: 'path:first-last/total qualname'.
PAGE_HEADER = re.compile(r"^(\S+):(\d+)-(\d+)/\d+")


# -- the sandbox --------------------------------------------------------------------------------------------------

def file_page(rel: str, text: str, start: int, pages: Pages) -> tuple[str, int]:
    """One page of a file from ``start`` and its last line: a header 'path:first-last/total qualname', numbered
    lines, a footer."""
    lines = text.splitlines()
    if not 1 <= start <= max(len(lines), 1):
        raise ToolFailure(f"start must be between 1 and {len(lines)} for {rel}")
    inside = [q for first, last, q in entity_spans(text) if first <= start <= last]
    where = f" {cut(inside[-1], 40)}" if inside else ""
    window = lines[start - 1: start - 1 + pages.page_lines]
    indent = min((len(s) - len(s.lstrip()) for s in window if s.strip()), default=0)
    budget = pages.max_chars - len(f"{rel}:{start}-{start + len(window)}/{len(lines)}{where}") - 24
    body = fit([cut(f"{start + i} {s[indent:].rstrip()}", pages.line_chars) for i, s in enumerate(window)], budget)
    end = start + len(body) - 1
    footer = f"next: start={end + 1}" if end < len(lines) else "end of file"
    return "\n".join([f"{rel}:{start}-{end}/{len(lines)}{where}", *body, footer]), end


def is_outside_path(raw: str) -> bool:
    """Whether a path names something outside any repository: absolute, home-relative, a drive, a NUL byte."""
    return raw.startswith(("/", "~", "\\")) or "\x00" in raw or re.match(r"[A-Za-z]:", raw) is not None


class RepoSandbox:
    """Read-only ``ls``, ``grep``, ``open`` and ``search`` over the directory ``root``."""

    hidden: frozenset[str] = frozenset()  # names never listed, walked or opened
    examples = "'lib' or 'tests/test_textwrap.py'"  # paths named when a path is refused
    ls_reserve = 60  # characters of an ls page kept for its header and its 'more' line

    def __init__(self, root: Path, pages: Pages) -> None:
        self.root, self.pages = root, pages

    @property
    def index(self) -> FunctionIndex:
        """What ``search`` ranks: the functions of the files here (indexed on the first search)."""
        return directory_index(str(self.root), self.hidden)

    def run(self, call: ToolCall) -> ToolResult:
        args = call.arguments
        try:
            if call.name == "ls":
                return ToolResult(self.ls(args["path"], args.get("start", 0)))
            if call.name == "grep":
                return ToolResult(self.grep(args["pattern"], args.get("path", ".")))
            if call.name == "open":
                return ToolResult(self.open(args["path"], args.get("start", 1)))
            return ToolResult(self.search(args["query"]))
        except OSError as exc:  # e.g. a name the file system rejects: never a crash, never a host path
            raise ToolFailure(f"cannot read that path ({exc.strerror or 'error'})") from None

    def resolve(self, path: str) -> tuple[Path, str]:
        raw = path.strip()
        if len(raw) > MAX_PATH_CHARS:
            raise ToolFailure(f"the path is longer than {MAX_PATH_CHARS} characters")
        if is_outside_path(raw):
            raise ToolFailure(f"use a path inside the repository, such as {self.examples}")
        rel = posixpath.normpath(raw or ".")
        if rel == ".." or rel.startswith("../"):
            raise ToolFailure(f"{raw[:60]!r} is outside the repository")
        full = self.root
        for part in [] if rel == "." else rel.split("/"):
            full = full / part
            if full.is_symlink():
                raise ToolFailure(f"{rel[:60]!r} is a link; links are not followed")
        if not full.exists():
            raise ToolFailure(f"no such file or directory: {rel[:60]!r}")
        if os.path.commonpath([os.path.realpath(full), os.path.realpath(self.root)]) != os.path.realpath(self.root):
            raise ToolFailure(f"{raw[:60]!r} is outside the repository")
        if self.hidden & set(rel.split("/")):
            raise ToolFailure(f"no such file or directory: {rel[:60]!r}")
        return full, rel

    def files(self, full: Path, rel: str) -> list[tuple[Path, str]]:
        """The files under ``full`` (or ``full`` itself), with their repository paths; no links, nothing hidden."""
        if full.is_file():
            return [(full, rel)]
        found = []
        for dirpath, dirnames, filenames in os.walk(full):  # os.walk does not follow links
            dirnames[:] = sorted(d for d in dirnames if not os.path.islink(os.path.join(dirpath, d)))
            for name in sorted(filenames):
                path = Path(dirpath) / name
                if not path.is_symlink():
                    found.append((path, posixpath.normpath(posixpath.join(rel, os.path.relpath(path, full)))))
        return [(path, name) for path, name in found if not self.hidden & set(name.split("/"))]

    def ls(self, path: str, start: int) -> str:
        full, rel = self.resolve(path)
        if not full.is_dir():
            raise ToolFailure(f"{rel} is a file; use open(path={rel!r})")
        names = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(full)
                       if not e.is_symlink() and e.name not in self.hidden)
        if not 0 <= start < max(len(names), 1):
            raise ToolFailure(f"start must be between 0 and {max(len(names) - 1, 0)}")
        shown = fit(names[start:], self.pages.max_chars - self.ls_reserve)
        more = len(names) - start - len(shown)
        tail = f"\n(+{more} more: ls(path={rel!r}, start={start + len(shown)}))" if more else ""
        return f"{rel}/: " + " ".join(shown) + tail

    def grep(self, pattern: str, path: str) -> str:
        if not pattern or len(pattern) > 200:
            raise ToolFailure("the pattern must be 1 to 200 characters")
        full, rel = self.resolve(path)
        hits = []
        for file, name in self.files(full, rel):
            for number, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if pattern in line:
                    hits.append(f"{name}:{number}: {cut(line.strip(), self.pages.line_chars - 12)}")
        if not hits:
            return f"No line of {rel} contains {pattern!r}."
        shown = fit(hits[: self.pages.grep_hits], self.pages.max_chars - 40)
        more = f" (first {len(shown)}; narrow the path)" if len(shown) < len(hits) else ""
        return f"{len(hits)} hits{more}:\n" + "\n".join(shown)

    def open(self, path: str, start: int) -> str:
        full, rel = self.resolve(path)
        if full.is_dir():
            raise ToolFailure(f"{rel} is a directory; use ls(path={rel!r})")
        return file_page(rel, full.read_text(encoding="utf-8", errors="replace"), start, self.pages)[0]

    def search(self, query: str) -> str:
        if not query.strip() or len(query) > 200:
            raise ToolFailure("the query must be 1 to 200 characters")
        results = []
        for i in self.index.search(query, self.pages.search_k):
            path, qualname, indexed_line, summary = self.index.entries[i]
            line = self.def_line(path, qualname, indexed_line)
            results.append(cut(f"{path}::{qualname} L{line} {summary}", self.pages.result_chars))
        if not results:
            return f"No function matches {query!r}."
        return f"{len(results)} results:\n" + "\n".join(fit(results, self.pages.max_chars - 20))

    def def_line(self, path: str, qualname: str, indexed_line: int) -> int | str:
        """The line a search result shows: the index's, when the index was built from these files."""
        return indexed_line


class MutantSandbox(RepoSandbox):
    """``TEXT_TOOLS`` over a code_localization task's private copy of the mutated repository."""

    def __init__(self, task: Task, pages: Pages) -> None:
        super().__init__(task_workspace(task), pages)
        self.task = task

    @property
    def index(self) -> FunctionIndex:
        # The pristine pool's index, built once for every task of the pool (def_line reads this copy's lines).
        return repo_of(pool_of(self.task)).index

    def run(self, call: ToolCall) -> ToolResult:
        if call.name == "submit":
            return submit_location(self.task, call.arguments["location"])
        return super().run(call)

    def def_line(self, path: str, qualname: str, indexed_line: int) -> int | str:
        # The index is the pristine pool's: the line is read from the task's copy, where the mutant may shift it.
        text = (self.root / path).read_text(encoding="utf-8")
        return {name: first for first, _, name in reversed(entity_spans(text))}.get(qualname, "?")


def submit_location(task: Task, location: str) -> ToolResult:
    """``submit(location="path::qualname")``: reward 1 for the mutated function (``info`` has the file-level hit)."""
    path, sep, qualname = location.strip().partition("::")
    if not sep or not path.strip() or not qualname.strip():
        raise ToolFailure('the location must look like "lib/module.py::Class.method"')
    path = posixpath.normpath(path.strip())
    target_path, _, target = task.answer.partition("::")
    file_hit, hit = path == target_path, path == target_path and qualname.strip() == target
    verdict = "correct" if hit else "wrong"
    return ToolResult(f"Submitted {path}::{qualname.strip()}: {verdict}.", reward=float(hit), done=True,
                      info={"file_hit": file_hit, "function_hit": hit})


# -- the reader ---------------------------------------------------------------------------------------------------

class Reader:
    """``READER_TOOLS`` over one default-tier task. ``test()`` lists the functions and puts any away, ``trace()``
    shows the traceback and puts any away, ``next()`` opens the next listed function at page 1, ``page()`` turns,
    ``submit()`` submits the function and page in front. A call that makes no sense where the reader is is an
    ``Error:`` observation."""

    def __init__(self, task: Task, pages: Pages) -> None:
        self.task, self.pages = task, pages
        self.listed, self.fn, self.page = False, 0, 0  # test() ran; the function and page in front (0: none)

    def run(self, call: ToolCall) -> ToolResult:
        f = self.task.facts
        if call.name == "submit":
            return reader_submit(self.task, self.fn, self.page)
        if call.name == "test":
            self.listed, self.fn, self.page = True, 0, 0
            body = reader_test(self.task, self.pages)
        elif call.name == "trace":
            self.fn, self.page = 0, 0
            body = "\n".join(fit(f["trace"], self.pages.max_chars - 40))
        elif call.name == "next":
            if not self.listed:
                raise ToolFailure("no functions are listed yet; call test() first")
            if self.fn == len(f["candidates"]):
                raise ToolFailure("that was the last function; test() starts them over")
            self.fn, self.page = self.fn + 1, 1
            body = reader_page(self.task, self.fn, self.page, self.pages)
        else:
            if not self.fn:
                raise ToolFailure("no function is open; call next()")
            if self.page == f["pages"][self.fn - 1]:
                raise ToolFailure("this is the function's last page; next() opens the next function")
            self.page += 1
            body = reader_page(self.task, self.fn, self.page, self.pages)
        return ToolResult(f"{body}\n{self.footer()}")

    def footer(self) -> str:
        n = len(self.task.facts["candidates"])
        if self.fn:
            raised = self.task.facts["raised"]
            here = "; raised here" if raised and raised[:2] == [self.fn, self.page] else ""
            return f"[fn {self.fn} of {n}, page {self.page}/{self.task.facts['pages'][self.fn - 1]}{here}]"
        return f"[no function open; {n} listed]" if self.listed else "[no function open]"


def reader_test(task: Task, pages: Pages) -> str:
    """The failing test: the functions it runs, in file order, then its first code lines up to the last call."""
    f = task.facts
    listed = ", ".join(cut(qualname, 30) for qualname in f["candidates"])
    text = repo_of(pool_of(task)).files[f["test_file"]]
    lines = text.splitlines()[f["test_def_line"] - 1: max(f["call_lines"])]
    indent = len(lines[0]) - len(lines[0].lstrip())
    body = [cut(line[indent:].rstrip(), pages.line_chars) for line in lines
            if line.strip() and not line.strip().startswith("#")]
    head = f"test {f['test_method']} runs {len(f['candidates'])} functions: {listed}"
    return "\n".join(fit([head, *body[:pages.page_lines]], pages.max_chars - 40))


def reader_page(task: Task, fn: int, page: int, pages: Pages) -> str:
    """A page of a listed function: its name, then up to eight code lines; the line where the exception was
    raised (the traceback's innermost frame in the module) ends with '<- raised here'."""
    return "\n".join(line for _, line in reader_lines(task.facts, fn, page, pages))


def reader_lines(f: dict[str, Any], fn: int, page: int, pages: Pages) -> list[tuple[int, str]]:
    """(line number, text) of what a page shows: the name (number 0), then the code lines that fit."""
    text = mutated_text(f["pool"], f["path"], f["start"], f["end"], f["replacement"])
    lines = function_lines(text, f["candidates"][fn - 1])[(page - 1) * pages.page_lines: page * pages.page_lines]
    raised = f["raised"][2] if f.get("raised") and f["raised"][0] == fn else None
    shown = [(0, cut(f["candidates"][fn - 1], 40))]
    shown += [(number, cut(line, pages.line_chars) + ("  <- raised here" if number == raised else ""))
              for number, line in lines]
    return shown[:len(fit([line for _, line in shown], pages.max_chars - 40))]


def reader_submit(task: Task, fn: int, page: int) -> ToolResult:
    """The answer, whatever is in front: with no function open it is a wrong one, not a retry, so that a guess
    stays a guess (an error there would give a random agent another try at the same position)."""
    f = task.facts
    function_hit = fn == f["gold"]
    hit = function_hit and page == f["gold_page"]
    what = f"fn {fn} page {page}" if fn else "no function"
    return ToolResult(f"Submitted {what}: {'correct' if hit else 'wrong'}.", reward=float(hit), done=True,
                      info={"function_hit": function_hit, "page_hit": hit})


@functools.lru_cache(maxsize=16)
def _entity_nodes(text: str) -> dict[str, ast.AST]:
    """The first node of each entity of a module text. Parsed once per text: a plan asks for several of one
    mutant's functions, and parsing was nine tenths of generating the default tier's tasks."""
    found: dict[str, ast.AST] = {}
    for entity, node in cm.entities(ast.parse(text)):
        found.setdefault(entity.qualname, node)
    return found


@functools.lru_cache(maxsize=1024)
def function_lines(text: str, qualname: str) -> list[tuple[int, str]]:
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
