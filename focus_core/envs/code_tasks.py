"""The tasks of ``code_localization``: which (mutant, failing test) pairs become tasks, and the scripted experts.

A task is kept only when its tier's expert plan works for it; the facts a plan records are what the tools show and
what the expert reads back. Three kinds of task (``TaskRules.kind``):

* ``reader`` (the default tier): a crash bug the reader walks to - the failing test errors inside the module, the
  traceback passes through the page with the bug, and the buggy function is one the reader lists;
* ``named`` (the ``text`` tier): the failing test calls the buggy function by name in its first lines;
* ``traceback`` (the ``hard`` tier): any failing test, its full traceback as the issue.
"""

from __future__ import annotations

import ast
import functools
import os
import posixpath
import re
import sys
from dataclasses import dataclass
from typing import Any

from focus_core.agent.toolcall import ToolCall
from focus_core.envs import code_mutations as cm
from focus_core.envs.base import Task, data_dir, split_of
from focus_core.envs.code_corpus import Repo, mutated_text, repo_of
from focus_core.envs.code_tools import PAGE_HEADER, READER_FOOTER, Pages, file_page, function_lines, reader_lines
from focus_core.envs.text import cut
from focus_core.ids import task_id

HELDOUT_FRACTION = 0.2
SPLIT_SALT = "code_localization-v1"
# Part of every task id: bump it when the tasks a tier generates change, so no cache keyed by task id is stale.
TASK_VERSION = "4"
INSTRUCTION = 'Find the buggy function. End with submit(location="path::qualname").'
INDEX_INSTRUCTION = "Find the bug: read the test, then its functions page by page. Submit the page with the bug."
INDEX_CANDIDATES = 6  # the most functions of the module the default tier's failing test may call by name
READER_FUNCTIONS = 8  # the most functions test() lists: those the test calls, then what they call (two levels)
INDEX_MAX_PAGES = 3  # pages of a function the default tier shows; the mutated line must be on one of them
# The default tier's expert episodes: test(), trace(), next(), a page() or next() per page before the bug, submit().
# A task whose bug the reader reaches sooner (page 1 or 2 of the first function) is not made: the episode would be
# too short to have segments, and a policy that submits at once would be right too often.
READER_TURNS = (6, 20)
KINDS = ("reader", "named", "traceback")


@dataclass(frozen=True)
class TaskRules:
    """Which tasks a tier makes."""

    kind: str  # one of KINDS (see the module docstring)
    scope: str  # the mutants drawn from (code_mutations.SCOPES)
    tasks_per_function: int  # the most tasks with the same answer (the reader kind counts each mutant)
    test_pages: int  # pages of the failing test the expert reads (named: the call must be on one of them)


# -- generating a tier's tasks ------------------------------------------------------------------------------------

def generate_tasks(env: str, tier: str, pool: tuple[str, ...], rules: TaskRules, pages: Pages) -> list[Task]:
    """Every task of a tier over a module pool, both splits, in a deterministic order. The split is decided by the
    target file (``split_of("lib/<module>.py")``), so held-out modules are never train targets."""
    records, repo, tasks = cm.load_records(pool, rules.scope), repo_of(pool), []
    for module in pool:
        split = split_of(f"lib/{module}.py", HELDOUT_FRACTION, salt=SPLIT_SALT)
        used: set[tuple[str | int, ...]] = set()  # (function, test), plus the mutant for the reader kind
        per_function: dict[str, int] = {}
        for record in records[module]:
            if per_function.get(record["qualname"], 0) >= rules.tasks_per_function:
                continue
            failures = record["failures"]
            if rules.kind == "traceback":  # prefer a test that does not call the function by name: a harder issue
                name = _call_name(record["qualname"])
                failures = sorted(failures, key=lambda f, n=name: any(c == n for c, _ in f["calls"] or ()))
            for failure in failures:
                # The reader keeps each (function, test) once per mutant: another mutant puts the bug on another
                # line, which is another task for a reader.
                seen = (record["qualname"], failure["test_id"]) + ((record["start"],) if rules.kind == "reader" else ())
                if seen in used or per_function.get(record["qualname"], 0) >= rules.tasks_per_function:
                    continue
                plan = plan_reader_task if rules.kind == "reader" else plan_text_task
                facts, prompt = plan(repo, record, failure, rules, pages), issue(record, failure, rules.kind)
                if facts is None or any(secret in prompt for secret in host_paths()):
                    continue
                used.add(seen)
                per_function[record["qualname"]] = per_function.get(record["qualname"], 0) + 1
                key = f"{record['path']}::{record['qualname']}"
                tasks.append(Task(
                    task_id=task_id(env, TASK_VERSION, tier, ",".join(pool), key, record["start"],
                                    record["end"], record["replacement"], failure["test_id"]),
                    env=env, split=split, tier=tier, prompt=prompt, answer=key,
                    split_key=record["path"], facts=facts))
                if rules.kind != "reader":  # one test per mutant; the reader takes every test it can show
                    break
    return tasks


def issue(record: dict[str, Any], failure: dict[str, Any], kind: str) -> str:
    """The task's prompt: the failing test and its exception line (the traceback for ``traceback`` tasks)."""
    test_class, test_method = failure["test_id"].split(".")[-2:]
    if kind == "traceback":
        return f"{failure['kind']}: {test_method} ({test_class})\n{failure['traceback'][-2500:]}\n{INSTRUCTION}"
    instruction = INDEX_INSTRUCTION if kind == "reader" else INSTRUCTION
    exception = failure["exception"].split("\n")[0]
    head = f"{failure['kind']}: {test_method} ({test_class})"
    return f"{head}\n{cut(exception, max(40, 298 - len(head) - len(instruction)))}\n{instruction}"


@functools.lru_cache(maxsize=1)
def host_paths() -> tuple[str, ...]:
    """Strings that would reveal the host (and the pristine sources) if an issue text contained them."""
    found = {str(cm.stdlib_dir()), sys.prefix, sys.base_prefix, str(data_dir()), os.path.expanduser("~")}
    return tuple(p for p in found if len(p) > 1) + ("focus-mutant",)


# -- the text tiers: named and traceback tasks ------------------------------------------------------------------

def plan_text_task(repo: Repo, record: dict[str, Any], failure: dict[str, Any], rules: TaskRules,
                   pages: Pages) -> dict[str, Any] | None:
    """The facts a task relies on, or None when the expert's plan would not work for this (mutant, test)."""
    module = record["module"]
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
    if rules.kind == "traceback":
        return facts
    call_line = next((line for called, line in failure["calls"] or () if called == name), None)
    if classes != [(test_file, classes[0][1])] or call_line is None or len(issue(record, failure, "named")) > 300:
        return None
    start, visible = defs[0], False
    for _ in range(rules.test_pages):  # is the call on one of the first pages the expert opens, and not cut off?
        if start > len(test_text.splitlines()):
            break
        page, end = _pool_page(repo.modules, test_file, start, pages)
        if start <= call_line <= end:
            visible = re.search(rf"\b{re.escape(name)}\(", page) is not None
        start = end + 1
    query = f"{module} {name}"
    if not visible or repo.position[(record["path"], record["qualname"])] not in repo.search(query, pages.search_k):
        return None
    return {**facts, "call_name": name, "call_line": call_line, "query": query}


@functools.lru_cache(maxsize=4096)
def _pool_page(pool: tuple[str, ...], path: str, start: int, pages: Pages) -> tuple[str, int]:
    return file_page(path, repo_of(pool).files[path], start, pages)


def _grep_lines(text: str, pattern: str) -> list[int]:
    return [number for number, line in enumerate(text.splitlines(), 1) if pattern in line]


def _call_name(qualname: str) -> str:
    """The name a test calls the function by: the class for ``Class.__init__``, else the function's name."""
    parts = qualname.split(".")
    return parts[-2] if parts[-1] == "__init__" and len(parts) > 1 else parts[-1]


def text_expert(task: Task, history: list[tuple[str, str]], rules: TaskRules) -> str:
    """Locate the test, read it up to the call, find the called function, read it, submit.

    Every step is checked against what the observations so far show (not against what the expert did),
    so the plan resumes correctly after any injected mistake: a step is skipped once its evidence is on
    screen, and a step whose call already ran twice without producing it is given up.
    """
    f = task.facts
    named = rules.kind == "named"
    seen = "\n".join(observation for _, observation in history)
    actions = [action for action, _ in history]
    pages = [(m[1], int(m[2]), int(m[3])) for _, o in history if (m := PAGE_HEADER.match(o))]

    def fresh(call: ToolCall, times: int = 2) -> bool:
        return sum(a.strip().endswith(call.render()) for a in actions) < times

    def next_page(path: str, first: int, goal: int, limit: int) -> ToolCall | None:
        chain = [end for p, start, end in pages if p == path and first <= start <= goal]
        if any(p == path and start <= goal <= end for p, start, end in pages) or len(chain) >= limit:
            return None
        return ToolCall("open", {"path": path, "start": max(chain) + 1 if chain else first})

    steps: list[ToolCall | None] = []
    if named:
        steps.append(None if f"{f['test_file']}:{f['class_line']}: " in seen else
                     ToolCall("grep", {"pattern": f"class {f['test_class']}", "path": "tests"}))
    steps.append(None if f"{f['test_file']}:{f['test_def_line']}: " in seen else
                 ToolCall("grep", {"pattern": f"def {f['test_method']}(", "path": f["test_file"]}))
    goal = f["call_line"] if named else f["test_def_line"]
    steps.append(next_page(f["test_file"], f["test_def_line"], goal, rules.test_pages))
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


# -- the default tier: a reader over the functions the failing test runs ----------------------------------------

def plan_reader_task(repo: Repo, record: dict[str, Any], failure: dict[str, Any], rules: TaskRules,
                     pages: Pages) -> dict[str, Any] | None:
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
    text = mutated_text(",".join(repo.modules), record["path"], record["start"], record["end"], record["replacement"])
    runs, frontier, callees = list(called), list(called), _callees(pristine)
    for _ in range(2):  # what the called functions call, and what that calls
        frontier = [q for caller in frontier for name in callees.get(caller, ())
                    if len(by_name.get(name, ())) == 1 and (q := by_name[name][0]) not in runs]
        for q in dict.fromkeys(frontier):
            if len(runs) < READER_FUNCTIONS and function_lines(text, q):
                runs.append(q)
    if record["qualname"] not in runs:  # the buggy function must be one the reader lists
        return None
    order = def_order(pristine)
    candidates = sorted(runs, key=order.__getitem__)
    facts = {"pool": ",".join(repo.modules), "module": module, "path": record["path"], "qualname": record["qualname"],
             "def_line": record["def_line"], "mutated_line": record["line"], "op": record["op"],
             "start": record["start"], "end": record["end"], "replacement": record["replacement"],
             "test_file": test_file, "test_class": test_class, "test_method": test_method, "test_def_line": defs[0],
             "call_lines": [line for _, line in calls], "candidates": candidates,
             "trace": _trace(failure, module, candidates, pages)}
    if any(secret in line for line in facts["trace"] for secret in host_paths()):
        return None
    page_lines = pages.page_lines
    page_counts, gold_page, raised = [], None, None
    frames = re.findall(rf'File "(?:[^"]*/)?{re.escape(module)}\.py", line (\d+), in ', failure["traceback"])
    raised_line = int(frames[-1]) if frames else None
    for fn, qualname in enumerate(candidates, 1):
        lines = function_lines(text, qualname)
        if not lines:
            return None
        numbers = [number for number, _ in lines]
        page_counts.append(min(INDEX_MAX_PAGES, -(-len(lines) // page_lines)))
        if raised_line in numbers and numbers.index(raised_line) < INDEX_MAX_PAGES * page_lines:
            raised = [fn, numbers.index(raised_line) // page_lines + 1, raised_line]
        if qualname == record["qualname"]:
            at = next((i for i, number in enumerate(numbers) if number >= record["line"]), None)
            gold_page = None if at is None else at // page_lines + 1
    if gold_page is None or gold_page > INDEX_MAX_PAGES:
        return None
    facts = {**facts, "pages": page_counts, "gold": candidates.index(record["qualname"]) + 1, "gold_page": gold_page,
             "raised": raised}
    if not READER_TURNS[0] <= reader_expert_turns(facts) <= READER_TURNS[1]:
        return None
    # The page must show the mutated line (and the raised line, for the mark), not lose it to the size limit.
    gold_numbers = [number for number, _ in reader_lines(facts, facts["gold"], gold_page, pages)]
    if not any(number >= record["line"] for number in gold_numbers[1:]):
        return None
    # A crash bug: the test errors inside the module and the traceback passes through the bug's page. A failed
    # assertion leaves no trace in the module, and which page holds a wrong value is beyond the tiny model.
    if failure["kind"] != "ERROR" or not {int(line) for line in frames} & set(gold_numbers[1:]):
        return None
    if raised and raised[2] not in [number for number, _ in reader_lines(facts, raised[0], raised[1], pages)]:
        facts["raised"] = None
    return facts


def reader_expert_turns(facts: dict[str, Any]) -> int:
    """The turns of the default tier's expert episode: test(), trace(), one call per page up to the bug's page
    (next() opens a function at page 1, page() turns), submit()."""
    return 3 + sum(facts["pages"][: facts["gold"] - 1]) + facts["gold_page"]


def reader_expert(task: Task, history: list[tuple[str, str]], rules: TaskRules) -> str:
    """test(), trace(), then next() through the listed functions in order, reading each page by page, until the
    page with the bug is in front: submit(). Its state is the latest footer, so it resumes after any mistake (a
    stray next() or page() past the bug starts over with test()). The thoughts are fixed phrases naming nothing."""
    f = task.facts
    where = next((m for _, observation in reversed(history) if (m := READER_FOOTER.search(observation))), None)
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
def def_order(text: str) -> dict[str, tuple[int, str]]:
    """Where each entity is defined: the order test() lists functions in (file order)."""
    return {entity.qualname: (node.lineno, entity.qualname) for entity, node in cm.entities(ast.parse(text))}


def _trace(failure: dict[str, Any], module: str, candidates: list[str], pages: Pages) -> list[str]:
    """The traceback as short lines, 'traceback:' then 'file:line in name' per frame (innermost last), then the
    exception line; at most the six innermost frames, so it fits a page. A frame of a listed function is marked
    with its number ('(fn 2)')."""
    frames = []
    for m in re.finditer(r'File "([^"]+)", line (\d+), in (\S+)', failure["traceback"]):
        file, name = posixpath.basename(m[1]), m[3]
        listed = [i for i, q in enumerate(candidates, 1) if q.split(".")[-1] == name] if file == f"{module}.py" else []
        frames.append(f"{file}:{m[2]} in {name}" + (f" (fn {listed[0]})" if len(listed) == 1 else ""))
    exception = cut(failure["exception"].split("\n")[0], pages.line_chars)
    return ["traceback:", *frames[-6:], exception]
