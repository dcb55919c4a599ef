"""Deep search: BrowseComp-style multi-constraint questions over a real local corpus of country fact sheets.

Task: name the country T that borders a hop country H (named by a fact no other country has) and fits a few
more facts, which only together rule out H's other neighbours; every question has exactly one answer. Data: one
sheet per country or territory (246), rendered from the JSON records of the PyPI package ``countryinfo==1.0.1``
(sha256-pinned), with BM25 search over them. Split by T's name; a train question never hops through a held-out
country.

Tiers (``TIERS``, each with its tool set): ``default``, a reader for the tiny CPU model, argument-free ``search()
open() neighbour() page() answer()`` with the position kept here; ``text``, ``search(query)``, ``get_document(docid,
page)`` and ``answer(text)`` over short pages; ``hard``, the same tools with paraphrased questions, more (also
numeric) facts and longer pages. Reward 1 when the answer names T (or an alias), else 0. The scripted expert
searches the hop, opens H and walks its neighbours until one fits every fact.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import random
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from focus_core.agent.toolcall import ToolCall, ToolSpec, parse_tool_call
from focus_core.envs import register_env
from focus_core.envs.base import Task, ToolEnv, ToolFailure, ToolResult, cached_tasks, ran_without_error, split_of
from focus_core.envs.text import Bm25, english_words
from focus_core.ids import task_id

DATA_PACKAGE = "countryinfo==1.0.1"
# sha256 over the ASCII-named data/*.json files (name, NUL, sha256 of content), sorted by name. Non-ASCII names
# (Curaçao twice in two letter cases, Saint Barthélemy, Åland) are skipped: they collide or are renamed on
# case-insensitive or normalising file systems, and would make the hash OS-dependent.
DATA_SHA256 = "fbd66a8d9e9c13c0f9802f46a1fe53f0c128015f7caa9dbf2ae8c0f1afc69bd4"
GENERATOR_VERSION = 1  # bump when tasks change; part of every task id
HELDOUT_FRACTION = 0.2
WITHDRAWN = {"SCG", "ANT"}  # Serbia and Montenegro, Netherlands Antilles: withdrawn codes duplicating current ones
MAX_QUERY_CHARS, MAX_ANSWER_CHARS = 200, 200


# -- the tiers: a tool set, search and page sizes, and the kind of questions each ----------------------------------

TEXT_TOOLS = (
    ToolSpec("search", "BM25 search over country sheets; top hits as 'docid | title | snippet'",
             (("query", "string", "keywords"),), ("query",)),
    ToolSpec("get_document", "read one page of a sheet (pages from 0; header [docid pN/last])",
             (("docid", "string", "a docid from search"), ("page", "integer", "page number, default 0")), ("docid",)),
    ToolSpec("answer", "give the final answer (a country name); ends the episode",
             (("text", "string", "the answer"),), ("text",)),
)
# The default tier's tools take no arguments: a reader with a position walks the hop's neighbours. A from-scratch
# tiny model learns a plan and the call format in minutes, but not to copy a name, docid or number out of its
# context (measured: 0% of such calls right after SFT), so at this tier the only thing left to decide is *when*
# to move on and when to answer - which is what the question's clues decide.
READER_TOOLS = (  # one short word each: the tiny tokenizer gives each its own token
    ToolSpec("search", "BM25 search with the question's first clue; shows the top hits", (), ()),
    ToolSpec("open", "open the top hit's sheet (page 0, with its Borders); starts its neighbours over", (), ()),
    ToolSpec("neighbour", "open page 0 of the top hit's next neighbour, in the order its Borders list", (), ()),
    ToolSpec("page", "read the next page of the sheet in front of you", (), ()),
    ToolSpec("answer", "answer with the country of the sheet in front of you; ends the episode", (), ()),
)


@dataclass(frozen=True)
class Tier:
    """One tier: the tool set it offers, what a search and a page show, and the kind of questions it asks."""

    tools: tuple[ToolSpec, ...]  # READER_TOOLS (argument-free, a position kept here) or TEXT_TOOLS
    hits: int  # hits a search shows
    snippet: int  # characters of a hit's snippet
    page: int  # page budget (characters)
    turns: tuple[int, int]  # the expert's turns a kept task takes
    # Templated questions and two short fact pages per sheet; else paraphrased questions with more (also redundant
    # and numeric) facts, all facts on page 0.
    paged: bool

    @property
    def reader(self) -> bool:
        """Whether this tier is the reader: its position is a function of the argument-free calls so far."""
        return self.tools is READER_TOOLS


TIERS = {
    "default": Tier(READER_TOOLS, hits=5, snippet=45, page=330, turns=(6, 20), paged=True),
    "text": Tier(TEXT_TOOLS, hits=3, snippet=60, page=330, turns=(6, 20), paged=True),
    "hard": Tier(TEXT_TOOLS, hits=5, snippet=160, page=1100, turns=(4, 40), paged=False),
}


class DataIntegrityError(RuntimeError):
    """The countryinfo data is missing or is not the pinned version."""


@dataclass(frozen=True)
class Country:
    docid: str
    name: str
    capital: str
    location: str  # intermediate region when given (e.g. "Western Africa"), else the UN subregion
    region: str
    population: int
    area: int
    borders: tuple[str, ...]  # neighbour names, sorted
    currencies: tuple[str, ...]
    languages: tuple[str, ...]
    calling_codes: tuple[str, ...]
    domains: tuple[str, ...]
    demonym: str
    timezones: tuple[str, ...]
    provinces: tuple[str, ...]
    aliases: tuple[str, ...]  # normalised accepted answers

    def fields(self) -> list[str]:
        """The fact sentences of the sheet, in page order (provinces last)."""
        def items(values: tuple[str, ...], prefix: str = "") -> str:
            return ", ".join(prefix + v for v in values) or "none"
        return [f"Capital: {self.capital or 'none'}.", f"Location: {self.location or 'unknown'}, {self.region}.",
                f"Population: {self.population:,}." if self.population else "Population: unknown.",
                f"Area: {self.area:,} km2." if self.area else "Area: unknown.",
                f"Borders: {items(self.borders)}.", f"Currency: {items(self.currencies)}.",
                f"Languages: {items(self.languages)}.", f"Calling code: {items(self.calling_codes, '+')}.",
                f"Internet domain: {items(self.domains)}.", f"Demonym: {self.demonym or 'unknown'}.",
                f"Time zones: {items(self.timezones)}.", f"Provinces: {items(self.provinces)}."]


@functools.lru_cache(maxsize=65536)
def normalise(text: str) -> str:
    """Answer normal form: accents stripped, lower case, punctuation to spaces, no leading 'the'."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    return re.sub(r"^the ", "", " ".join(re.sub(r"[^a-z0-9]+", " ", text).split()))


# -- data ----------------------------------------------------------------------------------------------------------


def _data_files() -> list[Path]:
    spec = importlib.util.find_spec("countryinfo")
    folder = Path(spec.origin).parent / "data" if spec and spec.origin else None
    if folder is None or not folder.is_dir():
        raise DataIntegrityError(f"deep_search needs the data of {DATA_PACKAGE}, which is not installed; "
                                 f"fix: pip install {DATA_PACKAGE}")
    return sorted((p for p in folder.glob("*.json") if p.name.isascii()), key=lambda p: p.name)


def data_digest(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def load_countries() -> list[Country]:
    """Read, verify and clean the records: one per ISO code, symmetric borders, docids by name order."""
    files = _data_files()
    if (found := data_digest(files)) != DATA_SHA256:
        raise DataIntegrityError(f"the data of {DATA_PACKAGE} in {files[0].parent if files else '?'} has sha256 "
                                 f"{found}, expected {DATA_SHA256}; fix: pip install --force-reinstall {DATA_PACKAGE}")
    records: dict[str, dict[str, Any]] = {}
    for path in files:
        rec = json.loads(path.read_text(encoding="utf-8"))
        code = (rec.get("ISO") or {}).get("alpha3")
        if not code or code in WITHDRAWN or not isinstance(rec.get("name"), str):
            continue
        if code not in records or len(rec) > len(records[code]):  # duplicates: keep the fuller record
            records[code] = rec
    neighbours: dict[str, set[str]] = {code: set() for code in records}
    for code, rec in records.items():  # the data has a few one-sided borders; a border is symmetric
        for other in rec.get("borders") or []:
            if other in records and other != code:
                neighbours[code].add(other)
                neighbours[other].add(code)
    names = {code: rec["name"].strip() for code, rec in records.items()}
    claims: dict[str, set[str]] = {}
    for code, rec in records.items():
        spellings = [rec["name"], *(rec.get("altSpellings") or []), *str(rec.get("nativeName") or "").split("/")]
        for alias in {normalise(s) for s in spellings if isinstance(s, str)}:
            if len(alias) >= 4 or alias == normalise(rec["name"]):
                claims.setdefault(alias, set()).add(code)
    countries = []
    for index, code in enumerate(sorted(records, key=lambda c: (names[c], c))):
        rec = records[code]
        capital = rec.get("capital")
        capital = capital[0] if isinstance(capital, list) and capital else capital if isinstance(capital, str) else ""

        def strings(key: str, rec: dict[str, Any] = rec) -> tuple[str, ...]:
            return tuple(str(v).strip() for v in rec.get(key) or [] if str(v).strip())
        countries.append(Country(
            docid=f"d{index:03d}", name=names[code], capital=capital.strip(),
            location=rec.get("intermediateregion") or rec.get("subregion") or "", region=rec.get("region") or "",
            population=int(rec.get("population") or 0), area=int(rec.get("area") or 0),
            borders=tuple(sorted(names[o] for o in neighbours[code])), currencies=strings("currencies"),
            languages=strings("languages"), calling_codes=strings("callingCodes"), domains=strings("tld"),
            demonym=str(rec.get("demonym") or ""), timezones=strings("timezones"), provinces=strings("provinces"),
            aliases=tuple(sorted({normalise(names[code])} | {a for a, who in claims.items() if who == {code}}))))
    return countries


# -- corpus: pages and BM25 search ---------------------------------------------------------------------------------


def render_pages(country: Country, tier: str) -> list[str]:
    """Pages of a sheet. Default and text tiers: facts of place (page 0), of people and money (page 1), then
    provinces; the hard tier: all facts on page 0."""
    fields = country.fields()
    budget = TIERS[tier].page - 40  # room for the "[d042 p0/3] Name." header
    bodies = [" ".join(fields[:5]), " ".join(fields[5:11])] if TIERS[tier].paged else [" ".join(fields[:11])]
    chunk = "Provinces:"
    for province in country.provinces:
        if len(chunk) + len(province) + 2 > budget and chunk != "Provinces:":
            bodies.append(chunk.rstrip(",") + " ...")
            chunk = "Provinces: ..."
        chunk += f" {province},"
    bodies.append(chunk.rstrip(",") + "." if country.provinces else "Provinces: none.")
    return [f"[{country.docid} p{i}/{len(bodies) - 1}] {country.name}. {body}" for i, body in enumerate(bodies)]


_words = functools.lru_cache(maxsize=65536)(english_words)  # snippets ask for the same texts again


class Corpus:
    """The country sheets with a BM25 index; the title counts five times so a name search finds its sheet in the
    top 3 (names inside other names, like Guinea in Guinea-Bissau, may rank second)."""

    def __init__(self, countries: list[Country]) -> None:
        self.countries = countries
        self.by_docid = {c.docid: c for c in countries}
        self.by_name = {c.name: c for c in countries}
        documents = [list(_words(" ".join([c.name] * 5 + c.fields()))) for c in countries]
        self.df = Counter(token for document in documents for token in set(document))  # for snippet anchors
        self.bm25 = Bm25(documents, decimals=4)  # rounded scores: the order is stable across platforms

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one corpus per process; search is pure
    def search(self, query: str, k: int) -> tuple[Country, ...]:
        return tuple(self.countries[i] for i in self.bm25.top(_words(query), k))

    def snippet(self, country: Country, query: str, width: int) -> str:
        """The fact sentence sharing most words with the query, cut around its rarest shared word."""
        words = set(_words(query))
        fields = country.fields()
        best = max(fields, key=lambda f: (len(words & set(_words(f))), -fields.index(f)))
        shared = sorted(words & set(_words(best)), key=lambda w: (self.df.get(w, 0), w))
        anchor = best.lower().find(shared[0]) if shared else 0
        start = anchor - 20 if anchor > width - 20 else 0
        text = ("..." if start else "") + best[start:]
        return text if len(text) <= width else text[: width - 3] + "..."


@functools.cache
def world() -> Corpus:
    return Corpus(load_countries())


# -- constraints ---------------------------------------------------------------------------------------------------

POP_STEPS = [1, 2, 5, 10, 20, 50, 100, 200]  # million people
AREA_STEPS = [1_000, 10_000, 50_000, 100_000, 300_000, 1_000_000, 3_000_000]  # km2
PHRASES = {  # kind -> default wording, then hard paraphrases
    "location": ["lies in {v}", "It is situated in {v}.", "Geographers place it in {v}."],
    "currency": ["uses the currency {v}", "Its money is {v}.", "Prices there are paid in {v}."],
    "language": ["has the language code {v}", "One of its language codes is {v}.", "It lists {v} among its languages."],
    "timezone": ["uses the time zone {v}", "Its clocks include {v}.", "One of its time zones is {v}."],
    "pop_over": ["", "More than {v} million people live there.", "Its population exceeds {v} million."],
    "pop_under": ["", "Fewer than {v} million people live there.", "Its population is below {v} million."],
    "area_over": ["", "It covers more than {v:,} km2.", "Its area is above {v:,} square kilometres."],
    "area_under": ["", "It covers less than {v:,} km2.", "Its area is under {v:,} square kilometres."],
    "neighbours": ["", "It has exactly {v} land neighbours.", "It borders {v} countries in all."],
    "initial": ["has a capital starting with {v}", "Its capital's name starts with {v}.",
                "The name of its capital begins with the letter {v}."],
}
HOPS = {  # how the hop country is named: query the expert types, default wording, hard paraphrases
    "capital": ("capital {v}", ["the country whose capital is {v}", "It shares a land border with the country "
                                "governed from {v}.", "One of its neighbours has {v} as its capital."]),
    "calling": ("calling code {v}", ["the country with calling code +{v}", "It borders the country whose phone "
                                     "numbers start with +{v}.", "A neighbour of it has the calling code +{v}."]),
    "province": ("province {v}", ["the country with a province named {v}", "It borders the country that has a "
                                  "province called {v}.", "One of its neighbours contains the province {v}."]),
    "demonym": ("demonym {v}", ["the country whose people are called {v}", "Its neighbours include the land "
                                "of the {v} people.", "It borders the country whose demonym is {v}."]),
    "domain": ("internet domain {v}", ["the country with internet domain {v}", "Websites of one of its "
                                       "neighbours end in {v}.", "It borders the country using the domain {v}."]),
}


def hop_values(c: Country) -> dict[str, list[str]]:
    """The facts that may name a country when it is the hop (kept only when no other country shares them)."""
    return {"capital": [c.capital] if c.capital else [], "calling": list(c.calling_codes),
            "province": list(c.provinces), "demonym": [c.demonym] if c.demonym else [], "domain": list(c.domains)}


@dataclass(frozen=True)
class Constraint:
    kind: str
    value: str | int

    def holds(self, c: Country) -> bool:
        kind, v = self.kind, self.value
        if kind in ("currency", "language", "timezone"):
            return v in {"currency": c.currencies, "language": c.languages, "timezone": c.timezones}[kind]
        if kind in ("pop_over", "pop_under"):
            return c.population > v * 1_000_000 if kind == "pop_over" else 0 < c.population < v * 1_000_000
        if kind in ("area_over", "area_under"):
            return c.area > v if kind == "area_over" else 0 < c.area < v
        return {"location": c.location, "neighbours": len(c.borders), "initial": c.capital[:1]}[kind] == v

    @property
    def mask(self) -> int:
        """The countries this fact fits, as a bit mask over the corpus order."""
        return _mask(self)

    def page(self, tier: str) -> int:
        return 1 if TIERS[tier].paged and self.kind in ("currency", "language", "timezone") else 0

    def phrase(self, tier: str, rng: random.Random) -> str:
        options = PHRASES[self.kind]
        return (options[0] if TIERS[tier].paged else rng.choice(options[1:])).format(v=self.value)

    def why_not(self) -> str:
        """Short reason a sheet fails this fact, for the expert's reasoning line."""
        return {"location": "not in {v}", "currency": "no {v}", "language": "no {v}", "timezone": "no {v}",
                "pop_over": "too few people", "pop_under": "too many people", "area_over": "too small",
                "area_under": "too large", "neighbours": "not {v} neighbours",
                "initial": "capital not {v}"}[self.kind].format(v=self.value)


@functools.cache
def _mask(fact: Constraint) -> int:
    return sum(1 << i for i, c in enumerate(world().countries) if fact.holds(c))


def facts_of(c: Country, tier: str) -> list[Constraint]:
    """Every true direct fact about a country that a question may use at this tier."""
    facts = [Constraint("location", c.location)] if c.location else []
    facts += [Constraint(kind, v) for kind, values in
              (("currency", c.currencies), ("language", c.languages), ("timezone", c.timezones)) for v in values]
    facts += [Constraint("initial", c.capital[0])] if c.capital[:1].isalpha() else []
    if not TIERS[tier].paged:
        if c.population:
            facts += [Constraint("pop_over", max(s for s in POP_STEPS if s * 1e6 < c.population))] \
                if c.population > 1e6 else []
            facts += [Constraint("pop_under", min(s for s in POP_STEPS if s * 1e6 > c.population))] \
                if c.population < 2e8 else []
        if c.area:
            facts += [Constraint("area_over", max(s for s in AREA_STEPS if s < c.area))] if c.area > 1_000 else []
            facts += [Constraint("area_under", min(s for s in AREA_STEPS if s > c.area))] if c.area < 3e6 else []
        facts += [Constraint("neighbours", len(c.borders))]
    return facts


def choose_constraints(target: Country, rivals: list[Country], tier: str, rng: random.Random,
                       attempts: int = 8) -> list[Constraint] | None:
    """Facts about ``target`` that rule out every rival (H's other neighbours), each one necessary.

    Only facts shared by at least two countries are used (each clue alone is vague, as in BrowseComp), and the
    chosen facts together must still fit at least two countries, so the hop has to be followed. Sets of
    countries are bit masks over the corpus order.
    """
    def fits(facts: list[Constraint]) -> int:
        return functools.reduce(lambda mask, f: mask & f.mask, facts, (1 << len(world().countries)) - 1)

    paged = TIERS[tier].paged
    rival_mask = sum(1 << int(r.docid[1:]) for r in rivals)
    pool = [f for f in facts_of(target, tier) if f.mask.bit_count() >= 2]
    for _ in range(attempts):
        rng.shuffle(pool)
        chosen, alive = [], rival_mask
        for fact in pool:
            if alive & ~fact.mask:
                chosen.append(fact)
                alive &= fact.mask
        if alive:
            return None  # no order of these facts separates the target from its rivals
        for fact in list(chosen):  # prune facts the others make redundant
            rest = [f for f in chosen if f != fact]
            if rest and not fits(rest) & rival_mask:
                chosen = rest
        extra = [f for f in pool if f not in chosen]
        if paged and not any(f.page(tier) == 1 for f in chosen):
            chosen += [f for f in extra if f.page(tier) == 1][:1]  # the plan always reads page 1 as well
        if not paged:
            chosen += extra[: max(0, 4 - len(chosen))]  # hard questions carry redundant facts too
        small = not paged or (len(chosen) <= 3 and any(f.page(tier) == 1 for f in chosen))
        if chosen and small and fits(chosen).bit_count() >= 2:
            return chosen
    return None


# -- the environment -----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=65536)
def _search_query(action: str) -> str | None:
    """The normalised query of a search action, else None."""
    call = parse_tool_call(action, {spec.name: spec for spec in TEXT_TOOLS})
    return normalise(call.arguments["query"]) if isinstance(call, ToolCall) and call.name == "search" else None


_PAGE_HEADER = re.compile(r"^\[(d\d{3}) p(\d+)/\d+\]", re.MULTILINE)
_HIT_LINE = re.compile(r"^(d\d{3}) \| (.+?) \| ", re.MULTILINE)


# Every reader observation ends with where the reader is and how many of the question's clues the pages read so
# far confirm (like a search engine's highlighting), e.g. "[Botswana: neighbour 1 of 4, page 1/2; clues met: 1 of 2]"
# or "...; clues met: all]".
_READER_FOOTER = re.compile(
    r"\[[^\[\]]+: (?:top hit|neighbour (\d+) of \d+), page (\d+)/\d+; clues met: (?:all|\d+ of \d+)\]$")


@register_env("deep_search")
class DeepSearchEnv(ToolEnv):
    """Multi-hop questions over country sheets; reward 1 when ``answer`` names the target (or an alias)."""

    max_observation_chars = 1200
    tools = TEXT_TOOLS
    tiers = tuple(TIERS)

    def __init__(self, tier: str = "default") -> None:
        super().__init__(tier)
        self.tier = tier
        self._tasks: dict[str, list[Task]] = {}

    @classmethod
    def tools_for(cls, tier: str) -> tuple[ToolSpec, ...]:
        return TIERS[tier].tools

    def reset(self, task: Task) -> str:
        self._searched = False  # the default tier's reader: whether search() ran, the open top hit,
        self._top: Country | None = None  # the neighbour in front of it (0: the top hit itself) and its page
        self._neighbour, self._page = 0, 0
        observation = super().reset(task)
        self.task_tier = TIERS[task.tier]  # the task's tier (a text-tools environment also plays hard tasks)
        return observation

    # -- tools ---------------------------------------------------------------------------------------------------

    def run_tool(self, call: ToolCall) -> ToolResult:
        tier = self.task_tier
        if tier.reader:
            return self._run_reader_tool(call)
        corpus = world()
        if call.name == "search":
            query = call.arguments["query"].strip()
            if not query or len(query) > MAX_QUERY_CHARS:
                raise ToolFailure(f"search needs a query of 1-{MAX_QUERY_CHARS} characters")
            hits = corpus.search(query, tier.hits)
            if not hits:
                raise ToolFailure(f"no sheet matches {query[:40]!r}; try other keywords")
            return ToolResult("\n".join(f"{c.docid} | {c.name} | {corpus.snippet(c, query, tier.snippet)}"
                                         for c in hits))
        if call.name == "get_document":
            docid = call.arguments["docid"].strip().lower()
            if docid not in corpus.by_docid:
                raise ToolFailure(f"no document {docid[:30]!r}; docids look like d042 and come from search")
            pages = render_pages(corpus.by_docid[docid], self.task.tier)
            page = call.arguments.get("page", 0)
            if not 0 <= page < len(pages):
                raise ToolFailure(f"{docid} has pages 0 to {len(pages) - 1}")
            return ToolResult(pages[page])
        text = call.arguments["text"]
        if not text.strip() or len(text) > MAX_ANSWER_CHARS:
            raise ToolFailure(f"answer needs a name of 1-{MAX_ANSWER_CHARS} characters")
        return self._judge(normalise(text))

    def _run_reader_tool(self, call: ToolCall) -> ToolResult:
        """Default tier: the reader's position is a function of the calls so far, which a branch replays."""
        corpus, query, tier = world(), self.task.facts["hop_query"], self.task.tier
        if call.name == "search":
            self._searched = True
            hits = corpus.search(query, self.task_tier.hits)
            return ToolResult("\n".join(f"{i}. {c.name} | {corpus.snippet(c, query, self.task_tier.snippet)}"
                                         for i, c in enumerate(hits, 1)))
        if call.name == "open":
            if not self._searched:
                raise ToolFailure("there is no hit yet; call search() first")
            self._top, self._neighbour, self._page = corpus.search(query, 1)[0], 0, 0
        elif self._top is None:
            raise ToolFailure("no sheet is open; call search() and open() first")
        elif call.name == "neighbour":
            if self._neighbour == len(self._top.borders):
                raise ToolFailure(f"{self._top.name} has no more neighbours; open() starts them over")
            self._neighbour, self._page = self._neighbour + 1, 0
        elif call.name == "page":
            if self._page + 1 == len(render_pages(self._sheet(), tier)):
                raise ToolFailure("this is the sheet's last page")
            self._page += 1
        else:
            return self._judge(normalise(self._sheet().name))
        sheet = self._sheet()
        pages = render_pages(sheet, tier)
        where = f"neighbour {self._neighbour} of {len(self._top.borders)}" if self._neighbour else "top hit"
        body = pages[self._page].split("] ", 1)[1].removeprefix(f"{sheet.name}. ")  # drop "[d042 p0/2] Name. "
        clues = self._constraints()
        met = sum(f.page(tier) <= self._page and f.holds(sheet) for f in clues)
        # "all" is one token right before the policy's turn: the cue a tiny model picks up first. Pages confirm a
        # clue only once read, so "all" appears on page 1 of the answer, and never on a sheet that fails a clue.
        tally = "all" if met == len(clues) else f"{met} of {len(clues)}"
        # The footer has a line of its own, as in the other readers. After a space instead, SFT held-out success
        # was 0.14-0.23 in five runs; on its own line 0.52 (240 s of SFT, 64 episodes each). The footer's tokens
        # are the same either way (" [" is one token, "\n" another); why the newline helps a 2-layer model this
        # much is not known.
        return ToolResult(f"{body}\n[{sheet.name}: {where}, page {self._page}/{len(pages) - 1}; clues met: {tally}]")

    def _constraints(self) -> list[Constraint]:
        return [Constraint(kind, value) for kind, value in self.task.facts["constraints"]]

    def _sheet(self) -> Country:
        return world().by_name[self._top.borders[self._neighbour - 1]] if self._neighbour else self._top

    def _judge(self, answer: str) -> ToolResult:
        correct = answer in self.task.facts["aliases"]
        return ToolResult("Correct." if correct else "Incorrect.", float(correct), True, {"correct": correct})

    # -- tasks ---------------------------------------------------------------------------------------------------

    def tasks(self, split: str, tier: str | None = None) -> list[Task]:
        tier = tier or self.tier
        if split not in ("train", "heldout") or tier not in TIERS:
            raise ValueError(f"split must be train/heldout and tier one of {sorted(TIERS)}")
        if tier not in self._tasks:
            # Generation replays the expert on every candidate task (seconds): cached on disk, keyed by the
            # generator's version, its data's hash and this file.
            self._tasks[tier] = cached_tasks(self.name, tier, (GENERATOR_VERSION, DATA_SHA256,
                                                               Path(__file__).read_bytes()),
                                             lambda: self._generate(tier))
        return [t for t in self._tasks[tier] if t.split == split]

    def _generate(self, tier: str) -> list[Task]:
        corpus = world()
        countries = corpus.countries
        split = {c.name: split_of(c.name, HELDOUT_FRACTION, salt="deep_search") for c in countries}
        owners: dict[tuple[str, str], int] = {}
        for c in countries:
            for kind, values in hop_values(c).items():
                for v in {normalise(v) for v in values}:
                    owners[kind, v] = owners.get((kind, v), 0) + 1
        taken = {normalise(c.name) for c in countries} | {normalise(c.capital) for c in countries}
        tasks = []
        for hop in countries:
            options = []  # ways to name the hop: a value no other country has, found by a top-1 search
            for kind, values in hop_values(hop).items():
                valid = sorted(v for v in values if owners[kind, normalise(v)] == 1 and normalise(v)
                               and (kind != "province" or normalise(v) not in taken)
                               and corpus.search(HOPS[kind][0].format(v=v), 1) == (hop,))
                if valid:
                    options.append((kind, random.Random(f"{hop.name}/{kind}").choice(valid)))
            for target_name in hop.borders:
                target = corpus.by_name[target_name]
                if split[target.name] == "train" and split[hop.name] == "heldout":
                    continue  # a held-out answer never serves as a hop in training
                rivals = [corpus.by_name[n] for n in hop.borders if n != target_name]
                for kind, value in options:
                    task = self._make_task(tier, target, hop, kind, value, rivals, split[target.name])
                    if task is not None:
                        tasks.append(task)
        return sorted(tasks, key=lambda t: t.task_id)

    def _make_task(self, tier: str, target: Country, hop: Country, kind: str, value: str, rivals: list[Country],
                   split: str) -> Task | None:
        rng = random.Random(f"{GENERATOR_VERSION}/{tier}/{target.name}/{hop.name}/{kind}")
        chosen = choose_constraints(target, rivals, tier, rng)
        if chosen is None:
            return None
        query, wordings = HOPS[kind]
        if TIERS[tier].paged:
            phrases = [f.phrase(tier, rng) for f in chosen]
            clues = f" and {phrases[0]}" if len(phrases) == 1 else f", {', '.join(phrases[:-1])} and {phrases[-1]}"
            prompt = f"Which country borders {wordings[0].format(v=value)}{clues}? Answer with its name."
        else:
            sentences = [rng.choice(wordings[1:]).format(v=value)] + [f.phrase(tier, rng) for f in chosen]
            rng.shuffle(sentences)
            prompt = "I am thinking of a country. " + " ".join(sentences) + " Which country is it?"
        if any(re.search(rf"\b{re.escape(a)}\b", normalise(prompt)) for a in target.aliases):
            return None  # the question must not contain the answer
        facts = {"target": target.name, "aliases": list(target.aliases), "hop": hop.name, "hop_docid": hop.docid,
                 "hop_query": query.format(v=value), "hop_kind": kind, "candidates": list(hop.borders),
                 "constraints": [[f.kind, f.value] for f in chosen]}
        task = Task(task_id(self.name, GENERATOR_VERSION, tier, target.name, hop.name, kind), self.name, split, tier,
                    prompt, target.name, target.name, facts)
        low, high = TIERS[tier].turns
        reward, turns = self.replay_expert(task)
        return task if reward == 1.0 and low <= turns <= high else None

    def replay_expert(self, task: Task, max_turns: int = 60) -> tuple[float, int]:
        """Run the expert on a fresh copy of this environment: (reward, turns)."""
        env = type(self)(task.tier)
        env.reset(task)
        history: list[tuple[str, str]] = []
        for turn in range(1, max_turns + 1):
            action = self.expert_action(task, history)
            observation, reward, done, _ = env.step(action)
            history.append((action, observation))
            if done:
                return reward, turn
        return 0.0, max_turns

    # -- expert --------------------------------------------------------------------------------------------------

    def expert_action(self, task: Task, history: list[tuple[str, str]]) -> str:
        if TIERS[task.tier].reader:
            return self._reader_expert(task, history)
        corpus, facts, tier = world(), task.facts, task.tier
        seen_pages = {(d, int(p)) for _, obs in history for d, p in _PAGE_HEADER.findall(obs)}
        hits = {title: d for _, obs in history for d, title in _HIT_LINE.findall(obs)}
        # a neighbour's docid counts as known once a search for its name listed it (or a page of it was read):
        # the plan always searches the name, even when an earlier result list happened to show it
        known_ids = {corpus.by_docid[d].name: d for d, _ in seen_pages}
        for action, obs in history:
            query = _search_query(action)
            known_ids.update({t: d for d, t in _HIT_LINE.findall(obs) if query and normalise(t) == query})

        def act(reason: str, name: str, **arguments: Any) -> str:
            return f"{reason}\n{ToolCall(name, arguments).render()}"

        hop = corpus.by_docid[facts["hop_docid"]]
        if (hop.docid, 0) not in seen_pages:
            if hop.name in hits:
                return act(f"Open {hop.name} to read its neighbours.", "get_document", docid=hop.docid)
            return act("Find the country the clue names.", "search", query=facts["hop_query"])
        constraints = [Constraint(kind, value) for kind, value in facts["constraints"]]
        pages = sorted({0} | {f.page(tier) for f in constraints})
        rejected = None
        for name in facts["candidates"]:  # H's neighbours in the order its sheet lists them
            c = corpus.by_name[name]
            failed = next((f for f in constraints if (c.docid, f.page(tier)) in seen_pages and not f.holds(c)), None)
            if failed is not None:
                rejected = f"{name} fails: {failed.why_not()}."
                continue
            missing = [p for p in pages if (c.docid, p) not in seen_pages]
            if not missing:
                return act(f"{name} matches every clue.", "answer", text=name)
            if name not in known_ids:
                reason = f"{rejected} Next: {name}." if rejected else f"First neighbour: {name}."
                return act(reason, "search", query=name)
            if missing[0] == 0:
                return act(f"Open {name}.", "get_document", docid=known_ids[name])
            return act(f"{name} passes page 0; read page {missing[0]}.", "get_document", docid=known_ids[name],
                       page=missing[0])
        return act("No neighbour fits; answer the best guess.", "answer", text=facts["candidates"][0])

    def _reader_expert(self, task: Task, history: list[tuple[str, str]]) -> str:
        """The plan with the default tier's reader: read pages 0 and 1 of each neighbour, then answer or move on.
        The message is the bare call: its first token is the decision, and there is no free text for a tiny model
        to derail in. After a stray move past the answer, it starts over."""
        corpus, facts = world(), task.facts
        positions = [m for _, obs in history if (m := _READER_FOOTER.search(obs))]
        if not positions:
            return "open()" if ran_without_error(history, "search", READER_TOOLS) else "search()"
        neighbour, page = int(positions[-1].group(1) or 0), int(positions[-1].group(2))
        if neighbour == 0:
            return "neighbour()"
        if neighbour > facts["candidates"].index(task.answer) + 1:
            return "open()"  # the answer was behind the reader: start the neighbours over
        if page == 0:
            return "page()"
        c = corpus.by_name[facts["candidates"][neighbour - 1]]
        return "answer()" if all(Constraint(k, v).holds(c) for k, v in facts["constraints"]) else "neighbour()"

