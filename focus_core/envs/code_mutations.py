"""Bug injection for the code-localization environment: real functions, real mutations, real failing tests.

The source is the CPython 3.11.7 standard library installed with this interpreter (sha256-pinned): single-file,
pure-Python modules that have their own ``test.test_<module>``. For each module the generator

1. lists the *entities* a submission can name: top-level functions and (nested) class methods, by qualname;
2. runs the pristine test module once in a forked child, tracing which entities each passing test calls, and
   reads from each test's source which entities it calls *by name* near its start;
3. enumerates SWE-smith-style mutations with ``ast`` inside covered entities (flip a comparison, off-by-one
   constant, swap operands, invert a condition, drop a statement, change a default, and/or swap) and applies
   each as a minimal text edit of the original file (so formatting and comments stay; an edited file is
   not given away by being reformatted), checked by re-parsing against the intended AST;
4. runs the covering tests (those that name the entity first) against the mutant: a forked child imports
   the mutated text under the module's real name, re-imports the test module and runs them. A mutant is
   kept only if a test fails; the record lists up to MAX_FAILURES failing tests with their exception line,
   traceback (paths rewritten to the workspace layout ``lib/<module>.py``, ``tests/test_<module>.py``) and
   the entity names the test calls.

Records are cached per module and scope under ``$FOCUS_DATA_DIR/code_localization/raw-v<version>-<python>/``,
written atomically. Pre-generate with ``python -m focus_core.envs.code_mutations`` (scope "named", what the
default tier needs: about 5.5 minutes on 2 cores) or ``--scope all`` (the hard tier: every covered function).
A mutant that hangs is killed at its timeout and dropped, and the covering tests are filtered and ordered by
their measured durations, so a machine's load can change a few records and the failing tests others list
(measured in docs/environments.md: a few tasks of the default tier change).
Nothing here knows about tiers or splits; the environment module turns records into tasks.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import hashlib
import importlib
import json
import linecache
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
import unittest
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from focus_core.envs.base import data_dir
from focus_core.locks import exclusive_file_lock

GENERATOR_VERSION = "3"
PYTHON_VERSION = "3.11.7"
# Pure-Python modules whose tests run fast and import the module normally (modules masked by C accelerators
# or re-imported with import_fresh_module were left out), chosen for their yield of named-test tasks.
MODULES = (
    "aifc", "argparse", "base64", "calendar", "cgi", "colorsys", "configparser", "contextlib", "copy", "difflib",
    "filecmp", "fileinput", "fractions", "genericpath", "getpass", "gettext", "graphlib", "hmac", "imghdr",
    "ipaddress", "linecache", "mailbox", "mailcap", "mimetypes", "nntplib", "ntpath", "optparse", "pipes",
    "pkgutil", "plistlib", "posixpath", "pprint", "pstats", "quopri", "rlcompleter", "secrets", "shlex",
    "statistics", "string", "tabnanny", "textwrap", "timeit", "types", "uu", "weakref", "xdrlib", "zipapp",
)
# sha256 over (name, source, test source) of every module in MODULES, in order: see sources_digest().
SOURCES_SHA256 = "610020773a17888e7dfb594a06add0002764aeaef7c580cc1410df2ac47ad614"
MUTANTS_PER_ENTITY = 10  # mutants tried per covered entity (the tests decide which survive)
NAMED_WINDOW = 24  # a test "names" a function when it calls it within this many lines of its def line
SCOPES = ("named", "all")  # mutate only functions some test names (default tier), or every covered function
MAX_TESTS_PER_MUTANT = 30
MAX_TEST_SECONDS = 0.25  # slower tests are not run against mutants (they would make hung mutants costly)
MAX_FAILURES = 6  # failing tests recorded per mutant


class DataError(RuntimeError):
    """The installed source tree is not the pinned one."""


# -- sources ---------------------------------------------------------------------------------------------------

def stdlib_dir() -> Path:
    return Path(os.__file__).resolve().parent


def source_path(module: str) -> Path:
    return stdlib_dir() / f"{module}.py"


def test_path(module: str) -> Path:
    return stdlib_dir() / "test" / f"test_{module}.py"


def sources_digest(modules: tuple[str, ...] = MODULES) -> str:
    digest = hashlib.sha256()
    for module in modules:
        for path in (source_path(module), test_path(module)):
            data = path.read_bytes() if path.is_file() else b"<missing>"
            digest.update(f"{module}\x00{len(data)}\x00".encode() + data)
    return digest.hexdigest()


def check_sources(expected: str | None = None) -> None:
    """Fail clearly unless the stdlib sources are byte-identical to the pinned CPython release."""
    expected = SOURCES_SHA256 if expected is None else expected
    actual = sources_digest()
    if actual != expected:
        raise DataError(
            f"code_localization: the Python standard library sources (CPython {PYTHON_VERSION}: Lib/*.py and "
            f"Lib/test/test_*.py of {len(MODULES)} modules) have sha256 {actual[:16]}..., expected "
            f"{expected[:16]}... Run FOCUS with the CPython {PYTHON_VERSION} interpreter the project is set up "
            f"with (this one is {sys.version.split()[0]} at {sys.base_prefix}); its stdlib must include Lib/test."
        )


# -- entities and mutations ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Entity:
    qualname: str  # "dedent", "TextWrapper._wrap_chunks"
    def_line: int
    end_line: int


def entities(tree: ast.Module) -> list[tuple[Entity, ast.AST]]:
    """Top-level functions and class methods (classes nest); nested functions belong to their outer entity.

    A qualname defined twice (a property and its setter) is left out: a submission could not tell them apart.
    """
    found: list[tuple[Entity, ast.AST]] = []

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((Entity(prefix + node.name, node.lineno, node.end_lineno or node.lineno), node))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    counts = Counter(entity.qualname for entity, _ in found)
    return [(entity, node) for entity, node in found if counts[entity.qualname] == 1]


@dataclass(frozen=True)
class Mutant:
    qualname: str
    op: str
    line: int  # first line the edit touches
    start: int  # character offsets of the edit in the original text
    end: int
    replacement: str

    def apply(self, text: str) -> str:
        return text[: self.start] + self.replacement + text[self.end:]


_FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
         ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
_OP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
            ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}
_SWAPPABLE = (ast.Sub, ast.Add, ast.Div, ast.FloorDiv, ast.Mod, ast.LShift, ast.RShift)
_SIMPLE = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant)


class _Source:
    """Offsets in the original text from ast positions (which count UTF-8 bytes within a line)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col].decode(errors="ignore"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]


def _edits(src: _Source, fn: ast.AST) -> Iterator[tuple[str, list[int], Callable[[ast.AST], None], int, int, Any]]:
    """Candidate edits inside one entity: (op, path to the node, AST change, start, end, replacement text(s)).

    The AST change is applied to a copy of the entity to get the intended tree; the text edit must reproduce it
    (when several replacement texts are given, the first that does is used).
    """
    docstring = ast.get_docstring(fn, clean=False) is not None
    for path, node in _walk_with_paths(fn):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIP:
            start, end = src.span(node.left)[1], src.span(node.comparators[0])[0]
            gap, old = src.text[start:end], _OP_TEXT[type(node.ops[0])]
            new = _OP_TEXT[_FLIP[type(node.ops[0])]]
            pattern = r"(?<![<>=!\w])" + re.escape(old).replace(r"\ ", r"\s+") + r"(?![<>=\w])"
            if len(re.findall(pattern, gap)) == 1:
                flip = _FLIP[type(node.ops[0])]
                yield "flip_comparison", path, lambda n, f=flip: n.ops.__setitem__(0, f()), start, end, \
                    re.sub(pattern, new, gap)
        if isinstance(node, ast.Constant) and type(node.value) is int and not _in_defaults(fn, path):
            new_value = node.value - 1 if node.value > 1 else node.value + 1
            yield "off_by_one", path, lambda n, v=new_value: setattr(n, "value", v), *src.span(node), str(new_value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, _SWAPPABLE):
            left, right = src.segment(node.left), src.segment(node.right)
            gap = src.text[src.span(node.left)[1]: src.span(node.right)[0]]
            swapped = (f"{right}{gap}{left}", f"({right}){gap}({left})")  # the first that parses as intended
            yield "swap_operands", path, _swap_binop, *src.span(node), swapped
        if isinstance(node, ast.If | ast.IfExp):
            test = src.segment(node.test)
            if isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not):
                yield "invert_condition", path, _invert, *src.span(node.test), src.segment(node.test.operand)
            else:
                text = f"not {test}" if isinstance(node.test, _SIMPLE) else f"not ({test})"
                yield "invert_condition", path, _invert, *src.span(node.test), text
        if isinstance(node, ast.BoolOp) and len(node.values) == 2:
            start, end = src.span(node.values[0])[1], src.span(node.values[1])[0]
            old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            gap = src.text[start:end]
            if len(re.findall(rf"\b{old}\b", gap)) == 1:
                yield "swap_and_or", path, _swap_boolop, start, end, re.sub(rf"\b{old}\b", new, gap)
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if not isinstance(body, list) or len(body) < 2:
                continue
            for index, stmt in enumerate(body):
                if (docstring and node is fn and field == "body" and index == 0) or isinstance(
                        stmt, ast.Pass | ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef | ast.Global):
                    continue
                start, end = src.starts[stmt.lineno - 1], src.starts[stmt.end_lineno]
                if src.text[start: src.offset(stmt.lineno, stmt.col_offset)].strip() or \
                        src.text[src.offset(stmt.end_lineno, stmt.end_col_offset): end].strip():
                    continue  # shares its lines with other code
                yield "drop_statement", path, lambda n, f=field, i=index: getattr(n, f).pop(i), start, end, ""
    for default in [*fn.args.defaults, *[d for d in fn.args.kw_defaults if d is not None]]:
        if isinstance(default, ast.Constant) and type(default.value) in (int, bool):
            value = (not default.value) if type(default.value) is bool else default.value + 1
            path = _path_to(fn, default)
            yield "change_default", path, lambda n, v=value: setattr(n, "value", v), *src.span(default), repr(value)


def _walk_with_paths(root: ast.AST) -> Iterator[tuple[list[int], ast.AST]]:
    """Every node under ``root`` in ast.walk order, with its index path (stable across deep copies)."""
    stack: list[tuple[list[int], ast.AST]] = [([], root)]
    while stack:
        path, node = stack.pop(0)
        yield path, node
        stack.extend((path + [i], child) for i, child in enumerate(ast.iter_child_nodes(node)))


def _path_to(root: ast.AST, target: ast.AST) -> list[int]:
    return next(path for path, node in _walk_with_paths(root) if node is target)


def _node_at(root: ast.AST, path: list[int]) -> ast.AST:
    for index in path:
        root = list(ast.iter_child_nodes(root))[index]
    return root


def _in_defaults(fn: ast.AST, path: list[int]) -> bool:
    return bool(path) and _node_at(fn, path[:1]) is fn.args  # defaults are handled by change_default


def _swap_binop(node: ast.BinOp) -> None:
    node.left, node.right = node.right, node.left


def _invert(node: ast.If | ast.IfExp) -> None:
    test = node.test
    node.test = test.operand if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) else \
        ast.UnaryOp(op=ast.Not(), operand=test)


def _swap_boolop(node: ast.BoolOp) -> None:
    node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()


def mutants(text: str, qualname: str, seed: str, limit: int = MUTANTS_PER_ENTITY) -> list[Mutant]:
    """Up to ``limit`` verified mutants of one entity, in a deterministic (seeded) random order."""
    src, tree = _Source(text), ast.parse(text)
    fn = dict((e.qualname, node) for e, node in entities(tree))[qualname]
    rng, by_op = random.Random(f"{seed}\x00{qualname}"), {}
    for candidate in _edits(src, fn):
        by_op.setdefault(candidate[0], []).append(candidate)
    for group in by_op.values():
        rng.shuffle(group)
    # Operators take turns (in a seeded order), so statement drops, the most numerous edits, do not dominate.
    ops = sorted(by_op)
    rng.shuffle(ops)
    candidates = [group[i] for i in range(max(map(len, by_op.values()), default=0))
                  for group in (by_op[op] for op in ops) if i < len(group)]
    found: list[Mutant] = []
    seen: set[str] = set()
    for op, path, change, start, end, replacements in candidates:
        if len(found) >= limit:
            break
        expected = copy.deepcopy(fn)
        change(_node_at(expected, path))
        key = ast.dump(expected)
        if key in seen:
            continue
        for replacement in (replacements,) if isinstance(replacements, str) else replacements:
            mutant = Mutant(qualname, op, text.count("\n", 0, start) + 1, start, end, replacement)
            try:
                new_tree = ast.parse(mutant.apply(text))
            except SyntaxError:
                continue
            new_fn = dict((e.qualname, node) for e, node in entities(new_tree)).get(qualname)
            if new_fn is not None and ast.dump(new_fn) == key:  # else precedence or layout broke the edit
                seen.add(key)
                found.append(mutant)
                break
    return found


# -- running tests in forked children --------------------------------------------------------------------------

def _fork_map(job: Callable[[Any], Any], args: list[Any], timeouts: list[float], workers: int) -> list[Any]:
    """``job(arg)`` for every arg, each in a forked child (isolated, killable); None for a crash or timeout.

    A child runs with /dev/null as stdio in its own empty working directory and process group, and sends
    its JSON result back through a pipe. Forking from a parent that already imported the test machinery
    makes a run cost milliseconds instead of a fresh interpreter.
    """
    results: list[Any] = [None] * len(args)
    pending = list(range(len(args)))
    running: dict[int, tuple[int, int, float, list[bytes], str]] = {}  # fd -> (index, pid, deadline, data, cwd)
    while pending or running:
        while pending and len(running) < workers:
            index = pending.pop(0)
            workdir = tempfile.mkdtemp(prefix="focus-mutant-")
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:  # child
                os.close(read_fd)
                _child(job, args[index], write_fd, workdir)
            os.close(write_fd)
            running[read_fd] = (index, pid, time.monotonic() + timeouts[index], [], workdir)
        ready, _, _ = select.select(list(running), [], [], 0.05)
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if chunk:
                running[fd][3].append(chunk)
                continue
            index, pid, _, data, workdir = running.pop(fd)
            _reap(fd, pid, workdir, kill=False)
            try:
                results[index] = json.loads(b"".join(data))
            except ValueError:
                results[index] = None
        now = time.monotonic()
        for fd in [fd for fd, entry in running.items() if now > entry[2]]:
            _, pid, _, _, workdir = running.pop(fd)
            _reap(fd, pid, workdir, kill=True)
    return results


def _child(job: Callable[[Any], Any], arg: Any, write_fd: int, workdir: str) -> None:
    try:
        os.setpgid(0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.chdir(workdir)
        os.environ["TMPDIR"] = tempfile.tempdir = workdir  # tests that use gettempdir() do not meet each other
        payload = json.dumps(job(arg)).encode()
        while payload:
            payload = payload[os.write(write_fd, payload):]
    finally:
        os._exit(0)


def _reap(fd: int, pid: int, workdir: str, *, kill: bool) -> None:
    if kill:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    os.close(fd)
    os.waitpid(pid, 0)
    shutil.rmtree(workdir, ignore_errors=True)


class _Recorder(unittest.TestResult):
    """Records per-test coverage of the target file (optional), durations, and failures (up to a maximum)."""

    def __init__(self, filename: str | None, max_failures: int) -> None:
        super().__init__()
        self.filename, self.max_failures = filename, max_failures
        self.current, self.started = "", 0.0
        self.covered: dict[str, set[str]] = {}
        self.seconds: dict[str, float] = {}
        self.bad: set[str] = set()
        self.failures_seen: list[dict[str, str]] = []

    def startTest(self, test: Any) -> None:
        super().startTest(test)
        self.current, self.started = test.id(), time.perf_counter()
        self.covered.setdefault(self.current, set())
        if self.filename:
            sys.settrace(self._trace)

    def stopTest(self, test: Any) -> None:
        sys.settrace(None)
        self.seconds[test.id()] = time.perf_counter() - self.started
        super().stopTest(test)

    def _trace(self, frame: Any, event: str, arg: Any) -> None:
        # Only "call" events reach a global trace function that returns None: cheap enough for a baseline run.
        if frame.f_code.co_filename == self.filename:
            self.covered[self.current].add(frame.f_code.co_qualname.split(".<locals>")[0])

    def _failed(self, test: Any, err: Any, kind: str) -> None:
        if test.id() in self.bad:
            return  # a second failing subtest of the same test
        self.bad.add(test.id())
        self.failures_seen.append({"test_id": test.id(), "kind": kind,
                                   "exception": traceback.format_exception_only(err[0], err[1])[0].strip(),
                                   "traceback": self._exc_info_to_string(err, test)})
        if len({f["test_id"] for f in self.failures_seen}) >= self.max_failures:
            self.stop()

    def addFailure(self, test: Any, err: Any) -> None:
        super().addFailure(test, err)
        self._failed(test, err, "FAIL")

    def addError(self, test: Any, err: Any) -> None:
        super().addError(test, err)
        self._failed(test, err, "ERROR")

    def addSubTest(self, test: Any, subtest: Any, err: Any) -> None:
        super().addSubTest(test, subtest, err)
        if err is not None:
            self._failed(test, err, "FAIL" if issubclass(err[0], test.failureException) else "ERROR")

    def addSkip(self, test: Any, reason: str) -> None:
        super().addSkip(test, reason)
        self.bad.add(test.id())

    def addExpectedFailure(self, test: Any, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self.bad.add(test.id())

    def addUnexpectedSuccess(self, test: Any) -> None:
        super().addUnexpectedSuccess(test)
        self.bad.add(test.id())


def _run_tests(arg: tuple[str, str, list[str] | None, bool]) -> dict[str, Any]:
    """In a child: import ``text`` as ``module``, re-import its test module, run tests (all if ``tests`` is None)."""
    module, text, tests, trace = arg
    filename = f"lib/{module}.py"
    warnings.simplefilter("ignore")
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    target = types.ModuleType(module)
    target.__file__ = str(source_path(module))
    sys.modules[module] = target
    exec(compile(text, filename, "exec"), target.__dict__)
    sys.modules.pop(f"test.test_{module}", None)
    test_module = importlib.import_module(f"test.test_{module}")
    loader = unittest.TestLoader()
    suite = loader.loadTestsFromModule(test_module) if tests is None else loader.loadTestsFromNames(tests)
    result = _Recorder(filename if trace else None, max_failures=MAX_FAILURES if tests else 10**9)
    suite.run(result)
    return {"passed": {test: {"covered": sorted(result.covered[test]), "seconds": result.seconds.get(test, 0.0)}
                       for test in result.covered if test not in result.bad},
            "failures": result.failures_seen}


# -- one module: baseline, mutants, records --------------------------------------------------------------------

def _test_methods(test_text: str) -> dict[str, list[tuple[int, list[tuple[str, int]]]]]:
    """Every method of a test file by name: [(def line, [(called name, line) in source order])]."""
    methods: dict[str, list[tuple[int, list[tuple[str, int]]]]] = {}
    for node in ast.walk(ast.parse(test_text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            calls = sorted((call.lineno, call.col_offset, getattr(call.func, "id", getattr(call.func, "attr", "")))
                           for call in ast.walk(node) if isinstance(call, ast.Call))
            methods.setdefault(node.name, []).append((node.lineno, [(name, line) for line, _, name in calls]))
    return methods


def generate_module(module: str, scope: str = "named", workers: int = 2, limit: int = MUTANTS_PER_ENTITY,
                    ) -> list[dict[str, Any]]:
    """Validated mutants of one module (see the module docstring). Must run in a process that may fork.

    Each record lists up to MAX_FAILURES failing tests, each with the lib calls its body makes in source order
    (names that resolve to an entity the test covers), so the environment can pick the test an issue shows.
    Scope "named" mutates only functions that some covering test calls by name near its start.
    """
    text = source_path(module).read_text(encoding="utf-8")
    found = [entity for entity, _ in entities(ast.parse(text))]
    by_name: dict[str, set[str]] = {}
    for entity in found:
        parts = entity.qualname.split(".")
        by_name.setdefault(parts[-1], set()).add(entity.qualname)
        if parts[-1] == "__init__":  # calling a class runs its __init__
            by_name.setdefault(parts[-2], set()).add(entity.qualname)
    importlib.import_module(f"test.test_{module}")  # warm the parent so children only re-run the test module
    baseline = _fork_map(_run_tests, [(module, text, None, True)], [300.0], 1)[0]
    if baseline is None:
        return []
    passed = {t: info for t, info in baseline["passed"].items() if info["seconds"] < MAX_TEST_SECONDS}
    methods = _test_methods(test_path(module).read_text(encoding="utf-8"))
    calls: dict[str, list[tuple[str, int]]] = {}  # test id -> [(lib name, line)] in its body, when defined once
    for test, info in passed.items():
        defs = methods.get(test.rsplit(".", 1)[-1], [])
        if len(defs) == 1:
            calls[test] = [(n, line) for n, line in defs[0][1] if by_name.get(n, set()) & set(info["covered"])
                           and line < defs[0][0] + NAMED_WINDOW]
    jobs, meta = [], []
    for entity in found:
        covering = [t for t, info in passed.items() if entity.qualname in info["covered"]]
        named = [t for t in covering if any(entity.qualname in by_name[n] for n, _ in calls.get(t, ()))]
        others = sorted(set(covering) - set(named), key=lambda t: (passed[t]["seconds"], t))
        tests = (named + others)[:MAX_TESTS_PER_MUTANT] if named or scope == "all" else []
        timeout = 1.0 + min(5.0, 20 * sum(passed[t]["seconds"] for t in tests))
        for mutant in mutants(text, entity.qualname, seed=module, limit=limit) if tests else ():
            jobs.append((module, mutant.apply(text), tests, False))
            meta.append((entity, mutant, timeout))
    results = _fork_map(_run_tests, jobs, [timeout for _, _, timeout in meta], workers)
    records = []
    for (entity, mutant, _), result in zip(meta, results, strict=True):
        failures = [f for f in (result or {}).get("failures", []) if f["test_id"] in passed]
        if failures:  # else it survived, crashed or hung: not a localization task
            records.append({"module": module, "path": f"lib/{module}.py", **asdict(entity), **asdict(mutant),
                            "failures": [{**f, "exception": _clean(f["exception"], module)[:400],
                                          "traceback": _clean(f["traceback"], module)[-2000:],
                                          "calls": calls.get(f["test_id"])} for f in failures]})
    return records


def _clean(text: str, module: str) -> str:
    """Rewrite paths to the workspace layout, so no host path (and no pristine file) is ever shown."""
    text = text.replace(str(test_path(module)), f"tests/test_{module}.py")
    text = re.sub(r'File "[^"]*/lib/python3\.\d+/([^"]+)"', r'File "<stdlib>/\1"', text)
    text = re.sub(re.escape(tempfile.gettempdir()) + r"/focus-mutant-\w+", "<tmp>", text)
    text = re.sub(r"focus-mutant-\w+?(?=@|\b)", "work", re.sub(r"@test_\d+_tmp", "@test_tmp", text))  # run-specific
    for prefix in sorted({str(stdlib_dir()), sys.prefix, sys.base_prefix, os.path.expanduser("~")}, key=len)[::-1]:
        text = text.replace(prefix, "<path>")
    return text


# -- cache -----------------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    return data_dir() / "code_localization" / f"raw-v{GENERATOR_VERSION}-{PYTHON_VERSION}"


def load_records(modules: tuple[str, ...], scope: str = "named") -> dict[str, list[dict[str, Any]]]:
    """Cached records of ``modules``; missing ones are generated first in a fresh interpreter (it forks)."""
    directory = cache_dir()
    if any(not (directory / f"{m}.{scope}.json").is_file() for m in modules):
        with exclusive_file_lock(directory / ".lock"):  # one generator at a time (pytest -n 2, rollout workers)
            missing = [m for m in modules if not (directory / f"{m}.{scope}.json").is_file()]
            if missing:
                command = [sys.executable, "-m", "focus_core.envs.code_mutations", "--scope", scope,
                           "--modules", ",".join(missing)]
                subprocess.run(command, check=True, cwd=Path(__file__).resolve().parents[2], stdout=subprocess.DEVNULL)
    return {m: json.loads((directory / f"{m}.{scope}.json").read_text()) for m in modules}


def _write_atomic(path: Path, data: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> None:
    """Pre-generate the mutant cache: ``python -m focus_core.envs.code_mutations [--scope all] [--workers 2]``."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--scope", choices=SCOPES, default="named", help="named: default tier; all: hard tier")
    parser.add_argument("--modules", help="comma-separated module names (default: all of MODULES)")
    parser.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    check_sources()
    cache_dir().mkdir(parents=True, exist_ok=True)
    for module in args.modules.split(",") if args.modules else MODULES:
        path = cache_dir() / f"{module}.{args.scope}.json"
        if path.is_file():
            continue
        started = time.time()
        records = generate_module(module, args.scope, workers=args.workers)
        _write_atomic(path, records)
        print(f"{module}: {len(records)} mutants in {time.time() - started:.1f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
