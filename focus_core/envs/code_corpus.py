"""The repositories the code-localization environments search: BM25 over functions, and task workspaces.

``FunctionIndex`` ranks the functions of some Python files (names, parameters, first docstring line) with BM25:
``Repo`` holds one over a pool of stdlib modules (``code_localization``), ``directory_index`` one over the Python
files of a folder (a ``swebench_loc`` checkout).

Workspaces (the ``text`` and ``hard`` tiers of ``code_localization``) live under
``$FOCUS_DATA_DIR/code_localization/ws-v<version>/``: one pristine base tree per module pool (copied from the
interpreter's stdlib after the hash check) and one directory per task, made lazily of hard links to the base tree
plus the mutated file.
"""

from __future__ import annotations

import ast
import functools
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from focus_core.envs import code_mutations as cm
from focus_core.envs.base import Task, data_dir
from focus_core.envs.text import Bm25, identifier_words
from focus_core.ids import task_id


@functools.lru_cache(maxsize=256)
def entity_spans(text: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualname) of every entity of a file; innermost last."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    return sorted(((e.def_line, e.end_line, e.qualname) for e, _ in cm.entities(tree)), key=lambda s: (s[0], -s[1]))


class FunctionIndex:
    """BM25 over the functions of some files; a function's words are its file's, qualname, parameters and first
    docstring line. Parameter defaults are left out on purpose: a ``change_default`` mutant must not show."""

    def __init__(self, files: Iterable[tuple[str, str, ast.Module]]) -> None:
        """``files``: (path, the words naming the file, parsed text), in the order results break ties."""
        self.entries: list[tuple[str, str, int, str]] = []  # (path, qualname, def line, summary shown in results)
        corpus = []
        for path, file_words, tree in files:
            for entity, node in cm.entities(tree):
                params = ", ".join(a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs])
                doc = (ast.get_docstring(node) or "").strip().split("\n")[0]
                self.entries.append((path, entity.qualname, entity.def_line, f"({params}) {doc}".strip()))
                corpus.append(identifier_words(f"{file_words} {entity.qualname} {params} {doc}") or ["_"])
        self.bm25 = Bm25(corpus)

    def search(self, query: str, k: int) -> list[int]:
        """The indices (into ``entries``) of the ``k`` best functions for ``query``, best first."""
        return self.bm25.top(identifier_words(query), k)


@functools.lru_cache(maxsize=8)
def directory_index(root: str, hidden: frozenset[str]) -> FunctionIndex:
    """A ``FunctionIndex`` over the ``.py`` files under ``root`` (no links; folders named in ``hidden`` skipped;
    files that do not parse left out)."""
    return FunctionIndex(_parsed_files(Path(root), hidden))


def _parsed_files(root: Path, hidden: frozenset[str]) -> Iterator[tuple[str, str, ast.Module]]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in hidden and not os.path.islink(os.path.join(dirpath, d)))
        for name in sorted(n for n in filenames if n.endswith(".py")):
            path = Path(dirpath) / name
            if path.is_symlink():
                continue
            rel = path.relative_to(root).as_posix()
            try:
                tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
            except (SyntaxError, ValueError):
                continue
            yield rel, rel.removesuffix(".py"), tree


class Repo:
    """The pristine files of a module pool, laid out as ``lib/<module>.py`` and ``tests/test_<module>.py``, and a
    ``FunctionIndex`` over its functions."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        self.modules = modules
        self.files: dict[str, str] = {}
        for module in modules:
            self.files[f"lib/{module}.py"] = cm.source_path(module).read_text(encoding="utf-8")
            self.files[f"tests/test_{module}.py"] = cm.test_path(module).read_text(encoding="utf-8")
        self.index = FunctionIndex((f"lib/{m}.py", m, ast.parse(self.files[f"lib/{m}.py"])) for m in modules)
        self.position = {(path, qualname): i for i, (path, qualname, _, _) in enumerate(self.index.entries)}
        self.class_lines = [(path, number, line) for path, text in self.files.items() if path.startswith("tests/")
                            for number, line in enumerate(text.splitlines(), 1) if "class " in line]

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one Repo per pool, kept for the process)
    def class_hits(self, name: str) -> list[tuple[str, int]]:
        """Where grep(pattern="class <name>", path="tests") hits."""
        return [(path, number) for path, number, line in self.class_lines if f"class {name}" in line]

    @functools.lru_cache(maxsize=4096)  # noqa: B019
    def search(self, query: str, k: int) -> list[int]:
        return self.index.search(query, k)


@functools.lru_cache(maxsize=4)
def repo_of(modules: tuple[str, ...]) -> Repo:
    """The pool's ``Repo``, built once per process."""
    return Repo(modules)


def pool_of(task: Task) -> tuple[str, ...]:
    """The modules of a code_localization task's repository (its facts keep them comma-joined)."""
    return tuple(task.facts["pool"].split(","))


@functools.lru_cache(maxsize=256)
def mutated_text(pool: str, path: str, start: int, end: int, replacement: str) -> str:
    """A file of the pool (modules comma-joined) with the characters ``start:end`` replaced: a mutant's file."""
    text = repo_of(tuple(pool.split(","))).files[path]
    return text[:start] + replacement + text[end:]


# -- workspaces -------------------------------------------------------------------------------------------------

def workspace_dir() -> Path:
    return data_dir() / "code_localization" / f"ws-v{cm.GENERATOR_VERSION}"


def base_tree(pool: tuple[str, ...]) -> Path:
    """The pristine files of a pool, written once (atomically); task copies hard-link to them."""
    base = workspace_dir() / f"base-{task_id('pool', *pool)}"
    if not base.is_dir():
        cm.check_sources()
        workspace_dir().mkdir(parents=True, exist_ok=True)
        tmp = Path(_tempdir(base))
        for rel, text in repo_of(pool).files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_text(text, encoding="utf-8")
            (tmp / rel).chmod(0o444)
        _publish(tmp, base)
    return base


def task_workspace(task: Task) -> Path:
    """The task's private copy of the mutated repository (made once, then reused read-only)."""
    root = workspace_dir() / f"task-{task.task_id}"
    if root.is_dir():
        return root
    pool, facts = pool_of(task), task.facts
    base = base_tree(pool)
    tmp = Path(_tempdir(root))
    for rel in repo_of(pool).files:
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        if rel == facts["path"]:
            text = repo_of(pool).files[rel]
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
