"""BrowseComp-Plus adapter: the real deep-search benchmark (Chen et al., arXiv:2508.06600), for those who have its data.

Task: the 830 BrowseComp-Plus queries over their fixed corpus of 100,195 web documents, every one held out (a test
set: ``tasks("train")`` is empty; train on ``deep_search``). Data: paths given to the constructor, nothing is
downloaded: the queries as the official decrypt script writes them, and the corpus (HF
``Tevatron/browsecomp-plus-corpus`` saved as JSONL or parquet); a BM25 index (``bm25s``, not the official Pyserini,
so rankings differ) and an SQLite store of the documents are built once into ``cache_dir``, named by a hash of the
corpus. One tier, ``default``, with free-text tools: ``search(query)``, ``get_document(docid, page)``,
``answer(text)``. Reward 1 when the normalised answer equals the gold one (a proxy for the official LLM judge),
else 0. ``write_run`` and ``write_trec_run`` write the files the official evaluators read.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import sqlite3
import tempfile
import unicodedata
from array import array
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from focus_core.agent.toolcall import ToolCall, ToolSpec
from focus_core.envs import register_env
from focus_core.envs.base import SPLITS, Task, ToolEnv, ToolFailure, ToolResult, data_dir
from focus_core.envs.text import english_words, ranked
from focus_core.ids import task_id

INDEX_VERSION = "bm25s-v1"  # bump when the tokeniser or the store changes: old caches are then ignored
MAX_QUERY_CHARS, MAX_ANSWER_CHARS = 500, 500
INSTRUCTION = ("Find the answer in the corpus: search(query=...) returns documents, get_document(docid=..., "
               "page=...) reads one page by page. End with answer(text=...) giving only the exact answer.")
FIX_QUERIES = ("fix: run the official decrypt script of github.com/texttron/BrowseComp-Plus (python "
               "scripts_build_index/decrypt_dataset.py --output data/browsecomp_plus_decrypted.jsonl) and pass "
               "queries=<that file>")
FIX_CORPUS = ("fix: save HF Tevatron/browsecomp-plus-corpus locally (datasets.load_dataset("
              "'Tevatron/browsecomp-plus-corpus', split='train').to_parquet('corpus.parquet')) and pass "
              "corpus=<that file or a folder of .parquet/.jsonl files>")


class BrowseCompPlusDataError(RuntimeError):
    """A data path is missing or not in the expected format; the message names the file and the fix."""


# -- reading records (shared with swebench_loc) ----------------------------------------------------------------------

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")


def record_files(path: Path, fix: str, error: type[Exception]) -> list[Path]:
    """``path`` itself, or the .jsonl/.json/.parquet files of a folder in name order."""
    if not path.exists():
        raise error(f"{path}: no such file or folder; {fix}")
    files = sorted(p for p in path.iterdir() if p.suffix in RECORD_SUFFIXES) if path.is_dir() else [path]
    if not files:
        raise error(f"{path}: the folder holds no .jsonl, .json or .parquet file; {fix}")
    return files


def read_records(path: Path, fix: str, error: type[Exception]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Rows of a JSONL file, a JSON list or a parquet file, as ("<file>:<row>", row); bad data raises ``error``."""
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            number = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=512):
                for row in batch.to_pylist():
                    number += 1
                    yield f"{path}:row {number}", row
        except (pa.ArrowException, OSError) as exc:
            raise error(f"{path}: not a readable parquet file ({exc}); {fix}") from None
        return
    def parse(text: str, where: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise error(f"{where}: not valid JSON ({exc}); {fix}") from None

    try:
        with path.open(encoding="utf-8") as handle:
            if handle.read(1 << 16).lstrip().startswith("["):  # a JSON list (json.dump of a whole dataset)
                handle.seek(0)
                rows = enumerate(parse(handle.read(), str(path)), 1)
            else:
                handle.seek(0)
                rows = ((n, parse(line, f"{path}:{n}")) for n, line in enumerate(handle, 1) if line.strip())
            for number, row in rows:
                if not isinstance(row, dict):
                    raise error(f"{path}:{number}: expected a JSON object, got {type(row).__name__}; {fix}")
                yield f"{path}:{number}", row
    except UnicodeDecodeError:
        raise error(f"{path}: not UTF-8 text (a .jsonl, .json or .parquet file is expected); {fix}") from None


def _field(where: str, row: dict[str, Any], name: str, fix: str) -> str:
    value = row.get(name)
    if value is None or (isinstance(value, str) and not value.strip()) or isinstance(value, dict | list):
        raise BrowseCompPlusDataError(f"{where}: missing or empty field {name!r}; {fix}")
    return str(value)


# -- answers ----------------------------------------------------------------------------------------------------------

def normalise_answer(text: str) -> str:
    """Lower case, accents and punctuation dropped (any script kept), articles and thousands separators removed."""
    text = re.sub(r"^\s*exact answer\s*:\s*", "", text, flags=re.IGNORECASE)
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    text = "".join(ch for ch in unicodedata.normalize("NFKD", text) if not unicodedata.combining(ch)).casefold()
    return " ".join(w for w in re.sub(r"[\W_]+", " ", text).split() if w not in ("a", "an", "the"))


def token_f1(prediction: str, gold: str) -> float:
    pred, ref = normalise_answer(prediction).split(), normalise_answer(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    return 0.0 if not common else 2 * common / (len(pred) + len(ref))


# -- the corpus: an SQLite store and a BM25 index, cached by corpus hash -----------------------------------------------

_FRONT_MATTER = re.compile(r"\A\s*---[ \t]*\n(.*?)\n---[ \t]*(?:\n|\Z)", re.DOTALL)


def split_front_matter(text: str) -> tuple[str, str]:
    """(title, body) of a corpus text: the YAML front matter's ``title:`` and the text after the block."""
    match = _FRONT_MATTER.match(text)
    if not match:
        return "", text
    titles = [line.split(":", 1)[1].strip().strip("'\"") for line in match[1].splitlines()
              if line.lower().startswith("title:")]
    return (titles[0] if titles else ""), text[match.end():]


def corpus_key(files: list[Path]) -> str:
    """A hash of the corpus bytes (files in name order): the cache folder's name."""
    digest = hashlib.blake2b(INDEX_VERSION.encode(), digest_size=12)
    for path in files:
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def build_index(files: list[Path], folder: Path) -> None:
    """Read the corpus once into ``folder``: docs.sqlite (row, docid, title, url, body) and the bm25s files."""
    import bm25s

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    try:
        db = sqlite3.connect(tmp / "docs.sqlite")
        db.execute("CREATE TABLE docs (row INTEGER PRIMARY KEY, docid TEXT UNIQUE, title TEXT, url TEXT, body TEXT)")
        vocab: dict[str, int] = {}
        token_ids: list[array] = []  # 4 bytes per token: the full corpus fits in memory while indexing
        for file in files:
            for where, row in read_records(file, FIX_CORPUS, BrowseCompPlusDataError):
                docid, text = _field(where, row, "docid", FIX_CORPUS), row.get("text")
                if not isinstance(text, str):
                    raise BrowseCompPlusDataError(f"{where}: field 'text' is missing or not text; {FIX_CORPUS}")
                title, body = split_front_matter(text)
                title = str(row.get("title") or title or body.strip().split("\n")[0][:100])
                try:
                    db.execute("INSERT INTO docs VALUES (?, ?, ?, ?, ?)",
                               (len(token_ids), docid, title, str(row.get("url") or ""), body))
                except sqlite3.IntegrityError:
                    raise BrowseCompPlusDataError(f"{where}: docid {docid!r} appears twice; {FIX_CORPUS}") from None
                words = english_words(f"{title} {body}")
                token_ids.append(array("I", (vocab.setdefault(t, len(vocab)) for t in words)))
        if not token_ids:
            raise BrowseCompPlusDataError(f"{files[0]}: the corpus has no documents; {FIX_CORPUS}")
        db.commit()
        db.close()
        bm25 = bm25s.BM25()
        bm25.index((token_ids, vocab), show_progress=False)
        bm25.save(str(tmp), show_progress=False)
        (tmp / "meta.json").write_text(json.dumps({"documents": len(token_ids), "files": [str(f) for f in files]}))
        try:
            os.rename(tmp, folder)  # atomic publish
        except OSError:
            if not (folder / "meta.json").is_file():  # not "another process published it first"
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Index:
    """A built corpus folder: BM25 scores (memory-mapped) and the document store (read-only)."""

    def __init__(self, folder: Path) -> None:
        import bm25s

        self.bm25 = bm25s.BM25.load(str(folder), mmap=True, show_progress=False)
        uri = (folder / "docs.sqlite").resolve().as_uri() + "?mode=ro"
        self.db = sqlite3.connect(uri, uri=True, check_same_thread=False)

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one Index per corpus, kept for the process)
    def search(self, query: str, k: int) -> tuple[tuple[int, float], ...]:
        """(row, score) of the top ``k`` documents; ties broken by corpus order, so results are deterministic."""
        ids = [self.bm25.vocab_dict[t] for t in english_words(query) if t in self.bm25.vocab_dict]
        if not ids:
            return ()
        scores = np.round(self.bm25.get_scores_from_ids(ids).astype(np.float64), 4)
        return tuple((i, float(scores[i])) for i in ranked(scores, k))

    def by_row(self, row: int) -> tuple[str, str, str, str]:
        return self.db.execute("SELECT docid, title, url, body FROM docs WHERE row = ?", (row,)).fetchone()

    def by_docid(self, docid: str) -> tuple[str, str, str, str] | None:
        return self.db.execute("SELECT docid, title, url, body FROM docs WHERE docid = ?", (docid,)).fetchone()


@functools.lru_cache(maxsize=2)
def open_index(folder: str) -> Index:
    return Index(Path(folder))


def _default_cache_dir() -> Path:
    return data_dir() / "browsecomp_plus"


# -- the environment --------------------------------------------------------------------------------------------------

TEXT_TOOLS = (  # the one tier's tools (its sizes are constructor arguments)
    ToolSpec("search", "BM25 search over the corpus; top hits as 'docid | score | title | snippet'",
             (("query", "string", "keywords"),), ("query",)),
    ToolSpec("get_document", "read one page of a document (pages from 0; header [docid pN/last])",
             (("docid", "string", "a docid from search"), ("page", "integer", "page number, default 0")),
             ("docid",)),
    ToolSpec("answer", "give the final, exact answer; ends the episode", (("text", "string", "the answer"),),
             ("text",)),
)


@register_env("browsecomp_plus")
class BrowseCompPlusEnv(ToolEnv):
    """The 830 BrowseComp-Plus queries over their fixed corpus; every task is held out (a test set)."""

    tools = TEXT_TOOLS

    def __init__(self, queries: str | os.PathLike, corpus: str | os.PathLike,
                 cache_dir: str | os.PathLike | None = None, k: int = 5, snippet_chars: int = 1000,
                 page_chars: int = 5000, tier: str = "default") -> None:
        if tier not in self.tiers:
            raise ValueError(f"browsecomp_plus has one tier, 'default' (got {tier!r}); size it with k, "
                             "snippet_chars and page_chars")
        super().__init__()
        self.queries_path, self.corpus_path = Path(queries), Path(corpus)
        record_files(self.queries_path, FIX_QUERIES, BrowseCompPlusDataError)  # fail early on a wrong path
        record_files(self.corpus_path, FIX_CORPUS, BrowseCompPlusDataError)
        self.cache_dir = Path(cache_dir) if cache_dir else _default_cache_dir()
        if min(k, snippet_chars, page_chars) < 1:
            raise ValueError("k, snippet_chars and page_chars must be positive")
        self.k, self.snippet_chars, self.page_chars = k, snippet_chars, page_chars
        self.max_observation_chars = max(page_chars, k * (snippet_chars + 120)) + 200
        self._tasks: list[Task] | None = None
        self._index: Index | None = None
        self._clear_episode()

    # -- data ------------------------------------------------------------------------------------------------------

    def index(self) -> Index:
        """The corpus index, built on first use (hashing the corpus, then indexing it if no cache matches)."""
        if self._index is None:
            files = record_files(self.corpus_path, FIX_CORPUS, BrowseCompPlusDataError)
            folder = self.cache_dir / f"index-{INDEX_VERSION}-{corpus_key(files)}"
            if not (folder / "meta.json").is_file():
                build_index(files, folder)
            self._index = open_index(str(folder))
        return self._index

    def tasks(self, split: str, tier: str = "default") -> list[Task]:
        if split not in SPLITS or tier not in self.tiers:
            raise ValueError(f"split must be one of {SPLITS} and tier 'default'")
        if self._tasks is None:
            self._tasks = self._load_tasks()
        return [task for task in self._tasks if task.split == split]

    def _load_tasks(self) -> list[Task]:
        tasks, seen = [], set()
        for file in record_files(self.queries_path, FIX_QUERIES, BrowseCompPlusDataError):
            for where, row in read_records(file, FIX_QUERIES, BrowseCompPlusDataError):
                qid, query = _field(where, row, "query_id", FIX_QUERIES), _field(where, row, "query", FIX_QUERIES)
                answer = _field(where, row, "answer", FIX_QUERIES)
                if re.fullmatch(r"[A-Za-z0-9+/]{24,}={0,2}", query.strip()):
                    raise BrowseCompPlusDataError(f"{where}: the query looks XOR-encrypted (base64), i.e. the raw "
                                                  f"HF file; {FIX_QUERIES}")
                if qid in seen:
                    raise BrowseCompPlusDataError(f"{where}: query_id {qid!r} appears twice; {FIX_QUERIES}")
                seen.add(qid)

                def docids(name: str, row: dict[str, Any] = row) -> list[str]:
                    return [str(d["docid"]) for d in row.get(name) or [] if isinstance(d, dict) and d.get("docid")]
                facts = {"query_id": qid, "evidence_docids": docids("evidence_docs"),
                         "gold_docids": docids("gold_docs")}
                tasks.append(Task(task_id(self.name, INDEX_VERSION, qid), self.name, "heldout", "default",
                                  f"{query}\n\n{INSTRUCTION}", answer, qid, facts))
        if not tasks:
            raise BrowseCompPlusDataError(f"{self.queries_path}: no queries; {FIX_QUERIES}")
        return tasks

    # -- tools -----------------------------------------------------------------------------------------------------

    def _clear_episode(self) -> None:
        self.trace: list[dict[str, Any]] = []  # the official run's "result" list
        self.tool_counts: Counter[str] = Counter()
        self.seen_docids: dict[str, None] = {}  # ordered set
        self.final_answer: str | None = None

    def reset(self, task: Task) -> str:
        observation = super().reset(task)
        self._clear_episode()
        return observation

    def run_tool(self, call: ToolCall) -> ToolResult:
        self.tool_counts[call.name] += 1
        result = self._run(call)
        if call.name != "answer":
            self.trace.append({"type": "tool_call", "tool_name": call.name, "arguments": json.dumps(call.arguments),
                               "output": result.observation})
        return result

    def _run(self, call: ToolCall) -> ToolResult:
        index, args = self.index(), call.arguments
        if call.name == "search":
            query = args["query"].strip()
            if not query or len(query) > MAX_QUERY_CHARS:
                raise ToolFailure(f"search needs a query of 1-{MAX_QUERY_CHARS} characters")
            hits = index.search(query, self.k)
            if not hits:
                raise ToolFailure(f"no document matches {query[:40]!r}; try other keywords")
            lines = []
            for row, score in hits:
                docid, title, _, body = index.by_row(row)
                self.seen_docids[docid] = None
                lines.append(f"{docid} | {score:.2f} | {title} | {' '.join(body.split())[: self.snippet_chars]}")
            return ToolResult("\n".join(lines))
        if call.name == "get_document":
            docid = args["docid"].strip().strip("[]")
            document = index.by_docid(docid) if len(docid) <= 100 else None
            if document is None:
                raise ToolFailure(f"no document {docid[:40]!r}; docids come from search results")
            _, title, url, body = document
            last = max(0, (len(body) - 1) // self.page_chars)
            page = args.get("page", 0)
            if not 0 <= page <= last:
                raise ToolFailure(f"{docid} has pages 0 to {last}")
            self.seen_docids[docid] = None
            text = body[page * self.page_chars: (page + 1) * self.page_chars]
            return ToolResult(f"[{docid} p{page}/{last}] {title}\n{url}\n{text}")
        text = args["text"].strip()
        if not text or len(text) > MAX_ANSWER_CHARS:
            raise ToolFailure(f"answer needs text of 1-{MAX_ANSWER_CHARS} characters")
        gold = normalise_answer(self.task.answer)
        correct = bool(gold) and normalise_answer(text) == gold
        self.final_answer = text
        self.trace.append({"type": "output_text", "tool_name": None, "arguments": None,
                           "output": f"Exact Answer: {text}"})
        return ToolResult("Answer recorded.", float(correct), True,
                          {"correct": correct, "f1": token_f1(text, self.task.answer),
                           "query_id": self.task.facts["query_id"]})

    # -- output ----------------------------------------------------------------------------------------------------

    def run_record(self, model: str = "focus") -> dict[str, Any]:
        """The current episode in the per-query JSON format of the official evaluate_run.py."""
        if self.task is None:
            raise RuntimeError("call reset(task) before run_record()")
        return {"metadata": {"model": model, "retriever": f"bm25s ({INDEX_VERSION})"},
                "query_id": self.task.facts["query_id"], "tool_call_counts": dict(self.tool_counts),
                "status": "completed" if self.final_answer is not None else "incomplete",
                "retrieved_docids": list(self.seen_docids), "result": list(self.trace)}

    def write_run(self, folder: str | os.PathLike, model: str = "focus") -> Path:
        """Write ``run_<query_id>.json`` into ``folder`` (the evaluator reads every run_*.json of a folder)."""
        record = self.run_record(model)
        path = Path(folder) / f"run_{re.sub(r'[^A-Za-z0-9_.-]', '_', record['query_id'])}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2, ensure_ascii=False), encoding="utf-8")
        return path

    def write_trec_run(self, path: str | os.PathLike, k: int = 1000, tag: str = "focus-bm25s") -> Path:
        """Retrieval-only run of every query: ``qid Q0 docid rank score tag`` lines (TREC run format)."""
        if not re.fullmatch(r"\S+", tag):
            raise ValueError("the run tag must be one word")
        index, lines = self.index(), []
        for task in self.tasks("heldout"):
            query = task.prompt.removesuffix(f"\n\n{INSTRUCTION}")
            for rank, (row, score) in enumerate(index.search(query, k), 1):
                lines.append(f"{task.facts['query_id']} Q0 {index.by_row(row)[0]} {rank} {score:.4f} {tag}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        return path

    # -- expert ----------------------------------------------------------------------------------------------------

    def expert_action(self, task: Task, history: list[tuple[str, str]]) -> str:
        """An oracle, not a search strategy: open the first gold (else evidence) document, then give the answer.

        It shows the format of a solved episode (the benchmark's own retrieval is the hard part it skips).
        """
        index = self.index()
        docid = next((d for d in task.facts["gold_docids"] + task.facts["evidence_docids"] if index.by_docid(d)), None)
        opened = docid is not None and any(obs.startswith(f"[{docid} p0/") for _, obs in history)
        tried = sum(f'"{docid}"' in action and action.lstrip().startswith("get_document") for action, _ in history)
        if docid is not None and not opened and tried < 2:
            return ToolCall("get_document", {"docid": docid}).render()
        return ToolCall("answer", {"text": task.answer}).render()
