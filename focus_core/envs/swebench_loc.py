"""SWE-bench-style code localization: find the functions that a real GitHub issue's fix edits.

Data (constructor arguments; nothing is downloaded): ``dataset``, a SWE-bench-style file (JSONL, JSON list or
parquet with ``instance_id``, ``repo``, ``base_commit``, ``problem_statement``, ``patch``: SWE-bench Lite/Verified,
Loc-Bench, SWE-Gym), and ``repos_dir``, one checkout per instance at ``<repos_dir>/<instance_id>`` at its
``base_commit``. The gold functions are those whose source the patch changes (tests and new files left out).

Tools: ``ls``, ``grep``, ``open``, ``search`` over the checkout (``code_tools.RepoSandbox``; VCS folders hidden)
and ``submit(locations)``, ranked candidates ``path::Class.method`` or ``path``, most likely first. Reward: the
function-level hit@1 (the file-level hit@1 when the fix edits no function); ``info`` reports Acc@1/5/10 at file and
function level. One tier; every task is held out unless ``split="train"``. The expert is an oracle. The data
format and metric details are in docs/environments.md.
"""

from __future__ import annotations

import ast
import os
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from focus_core.agent.toolcall import ToolCall, ToolSpec
from focus_core.envs import register_env
from focus_core.envs.base import SPLITS, Task, ToolEnv, ToolFailure, ToolResult
from focus_core.envs.browsecomp_plus import read_records, record_files
from focus_core.envs.code_tools import Pages, RepoSandbox, is_outside_path
from focus_core.ids import task_id

VERSION = "swebench-loc-v1"  # part of every task id
HIDDEN = frozenset({".git", ".hg", ".svn"})
PAGES = Pages(page_lines=50, line_chars=160, result_chars=160, grep_hits=25, search_k=10, max_chars=6000)
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


# -- the tools ----------------------------------------------------------------------------------------------------

class CheckoutSandbox(RepoSandbox):
    """``ls``, ``grep``, ``open`` and ``search`` over a checkout, its VCS folders hidden (history can hold the fix,
    and a worktree's ``.git`` file names a host path)."""

    hidden = HIDDEN
    examples = "'.' or 'pkg/module.py'"
    ls_reserve = 80

    def resolve(self, path: str) -> tuple[Path, str]:
        if is_outside_path(path.strip()):  # refused as outside before any length check
            raise ToolFailure(f"use a path inside the repository, such as {self.examples}")
        return super().resolve(path)


# -- the environment -------------------------------------------------------------------------------------------------

@register_env("swebench_loc")
class SWEBenchLocEnv(ToolEnv):
    """Real issues over their pre-fix checkouts; the sandbox is ``code_tools.RepoSandbox`` with VCS folders hidden."""

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
        super().__init__(tier)
        self.dataset_path, self.repos_dir = Path(dataset), Path(repos_dir)
        record_files(self.dataset_path, FIX_DATASET, SWEBenchDataError)  # fail early on a wrong path
        if not self.repos_dir.is_dir():
            raise SWEBenchDataError(f"{self.repos_dir}: no such folder; fix: pass repos_dir=<a folder holding one "
                                    "checkout per instance, <repos_dir>/<instance_id>, at its base_commit>")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}")
        self.split = split
        self.max_observation_chars = PAGES.max_chars
        self.sandbox: CheckoutSandbox | None = None  # the current task's (reset makes it)
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

    # -- tools ---------------------------------------------------------------------------------------------------

    def reset(self, task: Task) -> str:
        observation = super().reset(task)
        facts = task.facts
        self.sandbox = CheckoutSandbox(self.checkout(facts["instance_id"], facts["repo"], facts["base_commit"]), PAGES)
        return observation

    def run_tool(self, call: ToolCall) -> ToolResult:
        if call.name == "submit":
            return self._submit(call.arguments["locations"])
        return self.sandbox.run(call)  # ls, grep, open, search

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
