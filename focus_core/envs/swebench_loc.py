"""SWE-bench-style code localization adapter: find the functions that a real GitHub issue's fix edits.

Why. Code localization benchmarks (LocAgent's Loc-Bench, arXiv:2503.09089; RepoSearcher/ToolTrain,
arXiv:2508.03012) take SWE-bench instances, a real issue plus the pre-fix repository, and ask for the files and
functions that the merged fix changed. Our embedded ``code_localization`` env is the CPU stand-in with injected
bugs; this adapter runs real instances through the same tools, for users who have the data.

Data (paths are constructor arguments; nothing is downloaded):

* ``dataset``: SWE-bench Lite / Verified (HF ``princeton-nlp/SWE-bench_Lite``, ``princeton-nlp/SWE-bench_Verified``,
  split ``test``) or any dataset with the same columns (Loc-Bench ``czlll/Loc-Bench_V1``, SWE-Gym), saved as JSONL,
  a JSON list or parquet. Fields used: ``instance_id``, ``repo`` ("owner/name"), ``base_commit``,
  ``problem_statement`` (the issue) and ``patch`` (the gold fix as a unified git diff; tests are in ``test_patch``).
  Other fields (hints_text, test_patch, FAIL_TO_PASS, version, ...) are ignored.
* ``repos_dir``: one checkout per instance at ``<repos_dir>/<instance_id>``, at ``base_commit``. One folder per
  instance (not per repo@commit) so the lookup needs nothing but the id; git worktrees make them cheap:
  ``git clone https://github.com/<repo> mirror; git -C mirror worktree add --detach <repos_dir>/<instance_id>
  <base_commit>``. Each checkout is checked against the patch's pre-image lines (a clear error if it is not at
  ``base_commit``).

Gold locations. The patch is parsed into hunks and applied to the checkout's file; a function is gold when its
source differs between the pre- and the post-patch file (so pure insertions and edits of decorators count, and a
moved but unchanged function does not). Functions are top-level functions and methods of (nested) classes as
``path::Class.method``; nested functions belong to their outer function (LocAgent's function level); a getter and
its setter share one name. Gold files are the ``.py`` files the patch changes, except tests (``tests/``,
``test_*.py``, ``*_test.py``, ``conftest.py``) and files the patch creates, which the agent cannot find. Class-body
or module-level edits count at file level only. If a file does not parse, its functions come from the hunk headers
(best effort). Instances without a gold ``.py`` file are skipped (listed in ``skipped``).

Tools. ``ls``, ``grep``, ``open`` as in ``code_localization`` (its sandbox is inherited: paths are resolved inside
the checkout; absolute paths, ``..``, symlinks and over-long paths are refused) plus: VCS folders (``.git``,
``.hg``, ``.svn``; a worktree's ``.git`` file names a host path) are hidden, since history can hold the fix.
``search(query)`` is BM25 over the checkout's functions (name, parameters, docstring). Tools only read.
``submit(locations)`` takes ranked candidates, most likely first, separated by commas or new lines:
``"pkg/mod.py::Class.method, pkg/other.py::func, pkg/third.py"`` (LocAgent's ``file.py:Class.method`` is read too).

Metrics and reward. Files are ranked by first appearance among the candidates, functions are the candidates with
``::``. Acc@k (k = 1, 5, 10; LocAgent's definition) is 1 when *all* gold files (functions) are in the top k;
``info`` reports it at file and function level. Acc@1 is impossible when the fix edits two functions, so the
reward is the function-level hit@1: 1 when the top function candidate is a gold function (equal to Acc@1 for
single-function fixes). Instances whose fix edits no function are rewarded with the file-level hit@1.

Split. SWE-bench Lite/Verified are test sets: every task is held out by default; pass ``split="train"`` for a
training dataset (e.g. SWE-Gym). The expert is an oracle that reads the gold functions and submits them.
"""

from __future__ import annotations

import ast
import functools
import os
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from focus_core.agent.toolcall import ToolCall, ToolSpec
from focus_core.envs import code_localization as cl
from focus_core.envs import code_mutations as cm
from focus_core.envs import register_env
from focus_core.envs.base import SPLITS, Task, ToolEnv, ToolFailure, ToolResult
from focus_core.envs.browsecomp_plus import read_records, record_files
from focus_core.envs.text import Bm25, cut, fit, identifier_words
from focus_core.ids import task_id

VERSION = "swebench-loc-v1"  # part of every task id
HIDDEN = frozenset({".git", ".hg", ".svn"})
TIER = cl.Tier(page_lines=50, line_chars=160, grep_hits=25, search_k=10, max_chars=6000, test_pages=1)
MAX_ISSUE_CHARS, MAX_CANDIDATES, KS = 12_000, 50, (1, 5, 10)
INSTRUCTION = ('Find the functions that must change to fix this issue. End with submit(locations="path/file.py::'
               'Class.method, path/other.py::function"), most likely first.')
FIX_DATASET = ("fix: save a SWE-bench-style dataset locally (e.g. datasets.load_dataset("
               "'princeton-nlp/SWE-bench_Lite', split='test').to_json('swe-bench-lite.jsonl')) and pass "
               "dataset=<that file>")
_TEST_PATH = re.compile(r"(^|/)(tests?|testing)/|(^|/)test_[^/]*\.py$|_tests?\.py$|(^|/)conftest\.py$")


class SWEBenchDataError(RuntimeError):
    """A data path is missing or not in the expected format; the message names the file and the fix."""


def _fix_checkout(root: Path, repo: str, commit: str) -> str:
    return (f"fix: git clone https://github.com/{repo} mirror && git -C mirror worktree add --detach "
            f"{root} {commit}")


# -- gold locations from the patch -----------------------------------------------------------------------------------

@dataclass
class FilePatch:
    old_path: str | None  # None: the patch creates the file
    new_path: str | None  # None: the patch deletes the file
    hunks: list[tuple[int, int, list[str], str]] = field(default_factory=list)  # (old start, old count, lines, header)


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@ ?(.*)$")


def _diff_path(text: str) -> str | None:
    path = text.split("\t")[0].strip()
    return None if path == "/dev/null" else re.sub(r"^[ab]/", "", path)


def parse_patch(patch: str) -> list[FilePatch]:
    """The files of a unified git diff, each with its hunks (lines keep their ' ', '-', '+' tag)."""
    files: list[FilePatch] = []
    lines = [line.removesuffix("\r") for line in patch.split("\n")]
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if line.startswith("diff --git "):
            match = re.match(r"diff --git a/(.+) b/(.+)$", line)
            files.append(FilePatch(match[1] if match else None, match[2] if match else None))
        elif files and not files[-1].hunks and line.startswith("--- "):
            files[-1].old_path = _diff_path(line[4:])
        elif files and not files[-1].hunks and line.startswith("+++ "):
            files[-1].new_path = _diff_path(line[4:])
        elif files and (match := _HUNK.match(line)):
            old_count, new_count = int(match[2] or 1), int(match[4] or 1)
            body, old_left, new_left = [], old_count, new_count
            while i < len(lines) and (old_left > 0 or new_left > 0):
                text, i = lines[i], i + 1
                if text.startswith("\\"):  # "\ No newline at end of file"
                    continue
                tag = text[:1] if text[:1] in "+-" else " "  # some tools strip the blank of an empty context line
                old_left -= tag != "+"
                new_left -= tag != "-"
                body.append(tag + text[1:])
            files[-1].hunks.append((int(match[1]), old_count, body, match[5]))
    return files


class PatchMismatch(ValueError):
    """The file does not hold the patch's pre-image at this line."""


def apply_hunks(old_text: str, hunks: list[tuple[int, int, list[str], str]]) -> str:
    """The post-patch text; every context and removed line must match the old text."""
    old = old_text.split("\n")
    if old and old[-1] == "":
        old.pop()
    old = [line.removesuffix("\r") for line in old]
    new: list[str] = []
    pos = 0
    for start, count, body, _ in hunks:
        first = start - 1 if count else start  # an old count of 0 means "insert after line start"
        if not pos <= first <= len(old):
            raise PatchMismatch(start)
        new += old[pos:first]
        pos = first
        for line in body:
            tag, text = line[0], line[1:]
            if tag == "+":
                new.append(text)
                continue
            if pos >= len(old) or old[pos] != text:
                raise PatchMismatch(pos + 1)
            if tag == " ":
                new.append(text)
            pos += 1
    return "\n".join(new + old[pos:]) + "\n"


def function_spans(text: str) -> list[tuple[int, int, int, str]] | None:
    """(first line incl. decorators, def line, last line, qualname) of every function and method; None: no parse."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    spans: list[tuple[int, int, int, str]] = []

    def visit(body: list[ast.AST], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                spans.append((first, node.lineno, node.end_lineno or node.lineno, prefix + node.name))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
            else:  # functions defined under if/try/with/for at module or class level
                for name in ("body", "orelse", "finalbody", "handlers"):
                    if isinstance(getattr(node, name, None), list):
                        visit(getattr(node, name), prefix)

    visit(tree.body, "")
    return spans


def _sources(text: str) -> dict[str, list[str]] | None:
    spans, lines = function_spans(text), text.split("\n")
    if spans is None:
        return None
    sources: dict[str, list[str]] = {}
    for first, _, last, qualname in spans:
        sources.setdefault(qualname, []).append("\n".join(lines[first - 1: last]))
    return sources


def is_test_path(path: str) -> bool:
    return bool(_TEST_PATH.search(path))


def gold_locations(patch: str, read: Callable[[str], str]) -> tuple[list[str], list[str], dict[str, int]]:
    """(gold files, gold functions, def line of each gold function) of a patch; ``read(path)`` gives old text."""
    files, functions, def_lines = [], [], {}
    for file in parse_patch(patch):
        path = file.old_path
        if path is None or not path.endswith(".py") or is_test_path(path) or not file.hunks:
            continue
        old_text = read(path)
        new_text = apply_hunks(old_text, file.hunks) if file.new_path else ""
        files.append(path)
        before, after = _sources(old_text), _sources(new_text) if file.new_path else {}
        if before is None or after is None:  # unparsable: the names in the hunk headers
            names = [m[1] for *_, header in file.hunks if (m := re.search(r"\bdef\s+(\w+)", header))]
            functions += [f"{path}::{name}" for name in dict.fromkeys(names)]
            continue
        for _, def_line, _, qualname in function_spans(old_text):
            location = f"{path}::{qualname}"
            if before[qualname] != after.get(qualname) and location not in def_lines:
                functions.append(location)
                def_lines[location] = def_line
    return sorted(files), sorted(functions), def_lines


# -- submissions and metrics -------------------------------------------------------------------------------------------

def parse_locations(text: str) -> list[str]:
    """Ranked, de-duplicated candidates 'path' or 'path::qualname' from a submission."""
    found: list[str] = []
    for raw in re.split(r"[\s,;]+", text):
        raw = raw.strip("`'\"()[]")
        path, sep, qualname = raw.partition("::")
        if not sep and ":" in raw and raw.split(":", 1)[0].endswith(".py"):  # LocAgent: file.py:Class.method
            path, _, qualname = raw.partition(":")
        path = posixpath.normpath(path.removeprefix("./")) if path else ""
        qualname = qualname.strip().removesuffix("()")
        if path and path != ".":
            candidate = f"{path}::{qualname}" if qualname else path
            if candidate not in found:
                found.append(candidate)
    return found[:MAX_CANDIDATES]


def localization_metrics(candidates: list[str], gold_files: list[str], gold_functions: list[str],
                         ks: tuple[int, ...] = KS) -> dict[str, float | None]:
    """hit@1 and Acc@k (all gold within the top k) at file and function level; None where there is no gold."""
    files = list(dict.fromkeys(c.split("::")[0] for c in candidates))
    functions = list(dict.fromkeys(c for c in candidates if "::" in c))
    gold_f, gold_fn = set(gold_files), set(gold_functions)
    metrics: dict[str, float | None] = {
        "file_hit@1": float(bool(files) and files[0] in gold_f),
        "function_hit@1": float(bool(functions) and functions[0] in gold_fn) if gold_fn else None}
    for k in ks:
        metrics[f"file_acc@{k}"] = float(gold_f <= set(files[:k]))
        metrics[f"function_acc@{k}"] = float(gold_fn <= set(functions[:k])) if gold_fn else None
    return metrics


# -- search over a checkout's functions --------------------------------------------------------------------------------

class FunctionIndex:
    """BM25 over the functions of a checkout (names, parameters, first docstring line), as in code_localization."""

    def __init__(self, root: Path) -> None:
        self.entries: list[tuple[str, str, int, str]] = []  # (path, qualname, def line, summary)
        corpus = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames
                                 if d not in HIDDEN and not os.path.islink(os.path.join(dirpath, d)))
            for name in sorted(n for n in filenames if n.endswith(".py")):
                path = Path(dirpath) / name
                if path.is_symlink():
                    continue
                rel = path.relative_to(root).as_posix()
                try:
                    tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
                except (SyntaxError, ValueError):
                    continue
                for entity, node in cm.entities(tree):
                    params = ", ".join(a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs])
                    doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
                    self.entries.append((rel, entity.qualname, entity.def_line, f"({params}) {doc}".strip()))
                    words = identifier_words(f"{rel.removesuffix('.py')} {entity.qualname} {params} {doc}")
                    corpus.append(words or ["_"])
        self.bm25 = Bm25(corpus)

    def search(self, query: str, k: int) -> list[int]:
        return self.bm25.top(identifier_words(query), k)


@functools.lru_cache(maxsize=8)
def function_index(root: str) -> FunctionIndex:
    return FunctionIndex(Path(root))


# -- the environment -------------------------------------------------------------------------------------------------

@register_env("swebench_loc")
class SWEBenchLocEnv(cl.CodeLocalizationEnv):
    """Real issues over their pre-fix checkouts; the sandbox (ls/grep/open) is code_localization's."""

    tools = (
        ToolSpec("ls", "list a directory of the repository", (
            ("path", "string", "a directory, e.g. '.' or 'src'"), ("start", "integer", "skip this many entries")),
            ("path",)),
        ToolSpec("grep", "lines containing a fixed string, as path:line: text", (
            ("pattern", "string", "the text to find"), ("path", "string", "a file or directory (default '.')")),
            ("pattern",)),
        ToolSpec("open", "a page of a file from a line", (
            ("path", "string", "a file, e.g. 'pkg/module.py'"), ("start", "integer", "first line (default 1)")),
            ("path",)),
        ToolSpec("search", "functions by name, parameters and docstring, as path::qualname", (
            ("query", "string", "words or identifiers"),), ("query",)),
        ToolSpec("submit", "submit ranked locations, most likely first; ends the episode", (
            ("locations", "string", "comma-separated path::qualname or path, e.g. 'pkg/mod.py::Class.method'"),),
            ("locations",)),
    )

    def __init__(self, dataset: str | os.PathLike, repos_dir: str | os.PathLike, split: str = "heldout",
                 tier: str = "default") -> None:
        if tier != "default":
            raise ValueError(f"swebench_loc has one tier, 'default' (got {tier!r})")
        super().__init__()
        self.dataset_path, self.repos_dir = Path(dataset), Path(repos_dir)
        record_files(self.dataset_path, FIX_DATASET, SWEBenchDataError)  # fail early on a wrong path
        if not self.repos_dir.is_dir():
            raise SWEBenchDataError(f"{self.repos_dir}: no such folder; fix: pass repos_dir=<a folder holding one "
                                    "checkout per instance, <repos_dir>/<instance_id>, at its base_commit>")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}")
        self.split = split
        self.tier, self.max_observation_chars = TIER, TIER.max_chars
        self.skipped: list[tuple[str, str]] = []  # (instance_id, why)
        self._all: list[Task] | None = None

    # -- tasks -----------------------------------------------------------------------------------------------------

    def tasks(self, split: str, tier: str = "default") -> list[Task]:
        if split not in SPLITS or tier != "default":
            raise ValueError(f"split must be one of {SPLITS} and tier 'default'")
        if self._all is None:
            self._all = self._load()
        return [task for task in self._all if task.split == split]

    def checkout(self, instance_id: str, repo: str, commit: str) -> Path:
        root = self.repos_dir / instance_id
        if not root.is_dir():
            raise SWEBenchDataError(f"{root}: no checkout for {instance_id}; {_fix_checkout(root, repo, commit)}")
        return root

    def _load(self) -> list[Task]:
        tasks, self.skipped = [], []
        for file in record_files(self.dataset_path, FIX_DATASET, SWEBenchDataError):
            for where, row in read_records(file, FIX_DATASET, SWEBenchDataError):
                values = {}
                for name in ("instance_id", "repo", "base_commit", "problem_statement", "patch"):
                    if not isinstance(row.get(name), str) or not row[name].strip():
                        raise SWEBenchDataError(f"{where}: missing or empty field {name!r}; {FIX_DATASET}")
                    values[name] = row[name]
                iid, repo, commit = values["instance_id"], values["repo"], values["base_commit"]
                if not re.fullmatch(r"[A-Za-z0-9_.-]+", iid) or iid in (".", ".."):
                    raise SWEBenchDataError(f"{where}: instance_id {iid!r} cannot name a folder; {FIX_DATASET}")
                root = self.checkout(iid, repo, commit)

                def read(path: str, root: Path = root, repo: str = repo, commit: str = commit) -> str:
                    rel = posixpath.normpath(path)
                    if rel.startswith(("/", "../")) or not (root / rel).is_file():
                        raise SWEBenchDataError(f"{root}: {path}, changed by the gold patch, is missing: the checkout "
                                                f"is not at base_commit; {_fix_checkout(root, repo, commit)}")
                    return (root / rel).read_text(encoding="utf-8", errors="replace")
                try:
                    files, functions, def_lines = gold_locations(values["patch"], read)
                except PatchMismatch as exc:
                    raise SWEBenchDataError(f"{root}: a file differs from the gold patch's pre-image near line {exc}: "
                                            f"the checkout is not at base_commit; {_fix_checkout(root, repo, commit)}"
                                            ) from None
                if not files:
                    self.skipped.append((iid, "the patch changes no existing non-test .py file"))
                    continue
                facts = {"instance_id": iid, "repo": repo, "base_commit": commit, "gold_files": files,
                         "gold_functions": functions, "def_lines": def_lines}
                prompt = f"Repository: {repo}\n\n{values['problem_statement'][:MAX_ISSUE_CHARS]}\n\n{INSTRUCTION}"
                tasks.append(Task(task_id(self.name, VERSION, iid, commit), self.name, self.split, "default", prompt,
                                  ", ".join(functions or files), iid, facts))
        return tasks

    # -- tools: code_localization's sandbox, with VCS folders hidden ----------------------------------------------

    def reset(self, task: Task) -> str:
        observation = ToolEnv.reset(self, task)
        self.root = self._workspace()
        return observation

    def _workspace(self) -> Path:
        facts = self.task.facts
        return self.checkout(facts["instance_id"], facts["repo"], facts["base_commit"])

    def run_tool(self, call: ToolCall) -> ToolResult:
        if call.name == "submit":
            return self._submit(call.arguments["locations"])
        return super().run_tool(call)  # ls, grep, open, search (ours, below)

    def _resolve(self, path: str) -> tuple[Path, str]:
        raw = path.strip()
        if raw.startswith(("/", "~", "\\")) or "\x00" in raw or re.match(r"[A-Za-z]:", raw):
            raise ToolFailure("use a path inside the repository, such as '.' or 'pkg/module.py'")
        full, rel = super()._resolve(path)
        if HIDDEN & set(rel.split("/")):
            raise ToolFailure(f"no such file or directory: {rel[:60]!r}")
        return full, rel

    def _files(self, full: Path, rel: str) -> list[tuple[Path, str]]:
        return [(path, name) for path, name in super()._files(full, rel) if not HIDDEN & set(name.split("/"))]

    def _ls(self, path: str, start: int) -> str:
        full, rel = self._resolve(path)
        if not full.is_dir():
            raise ToolFailure(f"{rel} is a file; use open(path={rel!r})")
        names = sorted(e.name + ("/" if e.is_dir() else "") for e in os.scandir(full)
                       if not e.is_symlink() and e.name not in HIDDEN)
        if not 0 <= start < max(len(names), 1):
            raise ToolFailure(f"start must be between 0 and {max(len(names) - 1, 0)}")
        shown = fit(names[start:], self.tier.max_chars - 80) if names else []
        more = len(names) - start - len(shown)
        tail = f"\n(+{more} more: ls(path={rel!r}, start={start + len(shown)}))" if more else ""
        return f"{rel}/: " + " ".join(shown) + tail

    def _search(self, query: str) -> str:
        if not query.strip() or len(query) > 200:
            raise ToolFailure("the query must be 1 to 200 characters")
        index = function_index(str(self.root))
        results = [cut(f"{path}::{qualname} L{line} {summary}", self.tier.line_chars)
                   for path, qualname, line, summary in (index.entries[i] for i in index.search(query, TIER.search_k))]
        if not results:
            return f"No function matches {query!r}."
        return f"{len(results)} results:\n" + "\n".join(fit(results, self.tier.max_chars - 20))

    def _submit(self, locations: str) -> ToolResult:
        candidates = parse_locations(locations)
        if not candidates:
            raise ToolFailure('submit ranked locations, e.g. submit(locations="pkg/mod.py::Class.method, pkg/b.py")')
        facts = self.task.facts
        metrics = localization_metrics(candidates, facts["gold_files"], facts["gold_functions"])
        reward = metrics["function_hit@1"] if facts["gold_functions"] else metrics["file_hit@1"]
        verdict = "correct" if reward else "wrong"
        return ToolResult(f"Submitted {len(candidates)} locations: the top one is {verdict}.", reward, True,
                          {"candidates": candidates, **metrics})

    # -- the scripted expert (an oracle) ---------------------------------------------------------------------------

    def expert_action(self, task: Task, history: list[tuple[str, str]]) -> str:
        """Grep each gold function's definition, open the file there, then submit the gold locations.

        The plan is re-read from the observations, so injected mistakes are stepped over; a step whose call
        already ran twice without showing its evidence is given up.
        """
        seen = "\n".join(observation for _, observation in history)
        actions = [action.strip() for action, _ in history]
        for location in task.facts["gold_functions"]:
            path, _, qualname = location.partition("::")
            line = task.facts["def_lines"].get(location)
            if line is None:
                continue
            name = qualname.split(".")[-1]
            steps = [(f"{path}:{line}: ", ToolCall("grep", {"pattern": f"def {name}(", "path": path})),
                     (f"{path}:{line}-", ToolCall("open", {"path": path, "start": line}))]
            for evidence, call in steps:
                if evidence not in seen and sum(a.endswith(call.render()) for a in actions) < 2:
                    return call.render()
        functions = task.facts["gold_functions"]
        rest = [f for f in task.facts["gold_files"] if not any(fn.startswith(f"{f}::") for fn in functions)]
        return ToolCall("submit", {"locations": ", ".join(functions + rest)}).render()
