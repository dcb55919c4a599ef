"""Deep search environment: data integrity, task generation and splits, tools, expert and random baselines."""

from __future__ import annotations

import hashlib
import os
import random
import re
import subprocess
import sys

import pytest

from focus_core.envs import deep_search
from focus_core.envs.base import ENVIRONMENTS, split_of
from focus_core.envs.deep_search import (
    Constraint,
    DataIntegrityError,
    DeepSearchEnv,
    normalise,
    render_pages,
    world,
)

FINGERPRINT = (
    "import hashlib, sys; from focus_core.envs.deep_search import DeepSearchEnv; env = DeepSearchEnv(); "
    "rows = [t.task_id + t.prompt + t.answer for s in ('train', 'heldout') for t in env.tasks(s)]; "
    "sys.stdout.write(hashlib.sha256('|'.join(rows).encode()).hexdigest())"
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("focus-data")
    old = os.environ.get("FOCUS_DATA_DIR")
    os.environ["FOCUS_DATA_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("FOCUS_DATA_DIR")
    else:
        os.environ["FOCUS_DATA_DIR"] = old


@pytest.fixture(scope="module")
def env(data_dir):
    return DeepSearchEnv()  # the default tier: numbered calls


@pytest.fixture(scope="module")
def text_env(data_dir):
    return DeepSearchEnv("text")  # the same questions with free-text calls


def run_episode(env, task, policy, max_turns=40):
    observation = env.reset(task)
    history, reward = [], 0.0
    for _ in range(max_turns):
        action = policy(task, history, observation)
        observation, reward, done, _ = env.step(action)
        history.append((action, observation))
        if done:
            break
    return reward, history


def expert(env):
    return lambda task, history, _: env.expert_action(task, history)


def test_registered_and_data_is_verified(monkeypatch):
    assert ENVIRONMENTS["deep_search"] is DeepSearchEnv
    countries = deep_search.load_countries()
    assert len(countries) > 240 and len({c.docid for c in countries}) == len(countries)
    monkeypatch.setattr(deep_search, "DATA_SHA256", "0" * 64)
    with pytest.raises(DataIntegrityError, match=r"countryinfo==1\.0\.1.*expected 0{64}; fix: pip install"):
        deep_search.load_countries()
    monkeypatch.setattr(deep_search.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataIntegrityError, match=r"not installed; fix: pip install countryinfo==1\.0\.1"):
        deep_search.load_countries()


def test_counts_splits_and_prompts(env):
    train, heldout = env.tasks("train"), env.tasks("heldout")
    assert len(train) >= 500 and len(heldout) >= 100
    train_answers = {t.split_key for t in train}
    heldout_answers = {t.split_key for t in heldout}
    assert not train_answers & heldout_answers
    for task in train + heldout:
        assert task.split == split_of(task.answer, deep_search.HELDOUT_FRACTION, salt="deep_search")
        assert len(task.prompt) <= 300
        assert not any(re.search(rf"\b{re.escape(a)}\b", normalise(task.prompt)) for a in task.facts["aliases"])
    # held-out answers never serve as the hop of a training question
    assert not {t.facts["hop"] for t in train} & heldout_answers
    text = env.tasks("train", "text") + env.tasks("heldout", "text")
    assert len(text) >= 600
    assert not {t.split_key for t in text if t.split == "train"} & {t.split_key for t in text if t.split == "heldout"}
    hard = env.tasks("train", "hard") + env.tasks("heldout", "hard")
    assert len(hard) > 300 and all(len(t.facts["constraints"]) >= 4 for t in hard)
    countries = world().countries
    for task in train + heldout + text + hard:  # exactly one answer, and the hop is needed to find it
        facts = [Constraint(kind, value) for kind, value in task.facts["constraints"]]
        hop = world().by_name[task.facts["hop"]]
        assert [c.name for c in countries if c.name in hop.borders and all(f.holds(c) for f in facts)] == [task.answer]
        assert sum(all(f.holds(c) for f in facts) for c in countries) >= 2


def test_tasks_deterministic_across_processes_and_cache(env, data_dir, tmp_path):
    assert env.tasks("train") == DeepSearchEnv().tasks("train")  # the second env reads the on-disk cache
    assert list((data_dir / "deep_search").glob("*.json"))
    here = hashlib.sha256("|".join(t.task_id + t.prompt + t.answer for s in ("train", "heldout")
                                   for t in env.tasks(s)).encode()).hexdigest()
    fresh = subprocess.run([sys.executable, "-c", FINGERPRINT], capture_output=True, text=True, check=True,
                           env={**os.environ, "FOCUS_DATA_DIR": str(tmp_path), "PYTHONHASHSEED": "7"})
    assert fresh.stdout == here


@pytest.mark.parametrize("tier", ["default", "text"])
def test_expert_solves_heldout_with_short_observations(tier, env, text_env):
    env = env if tier == "default" else text_env
    tasks = env.tasks("heldout")[:100]
    results = [run_episode(env, task, expert(env)) for task in tasks]
    assert sum(reward for reward, _ in results) / len(tasks) >= 0.9
    for _, history in results:
        assert 6 <= len(history) <= 20
        assert all(len(observation) <= 350 for _, observation in history)
    hard_env = DeepSearchEnv("hard")
    hard = hard_env.tasks("heldout")[:40]
    assert sum(run_episode(hard_env, task, expert(hard_env))[0] for task in hard) / len(hard) >= 0.9


def test_default_tier_calls_are_numbers_and_reasons_name_no_entity(env):
    task = env.tasks("heldout")[0]
    _, history = run_episode(env, task, expert(env))
    entities = {c.name for c in world().countries} | {c.docid for c in world().countries}
    for action, _ in history:
        reason, call = action.split("\n")
        assert re.fullmatch(r"(search|get_document|answer)\((\w+=\d+(, )?)*\)", call), call
        assert not any(re.search(rf"\b{re.escape(e)}\b", reason) for e in entities), reason
    assert [a.split("\n")[1] for a, _ in history[:3]] == ["search()", "get_document(hit=1)",
                                                         "get_document(hit=1, neighbour=1)"]


def test_default_tier_tools_are_pure_functions_of_task_and_call(env):
    """Branches restart the environment mid-episode without replaying earlier calls: a call must return the same
    observation whatever came before it."""
    task = env.tasks("train")[3]
    _, history = run_episode(env, task, expert(env))
    for action, observation in history:
        fresh = DeepSearchEnv()
        fresh.reset(task)
        assert fresh.step(action)[0] == observation
    shuffled = DeepSearchEnv()
    shuffled.reset(task)
    for action, observation in reversed(history[:-1]):
        assert shuffled.step(action)[0] == observation


def test_tier_mismatch_is_refused(env, text_env):
    with pytest.raises(ValueError, match=r"tier 'text'.*make_env\('deep_search', tier='text'\)"):
        env.reset(text_env.tasks("train")[0])
    with pytest.raises(ValueError, match=r"tier 'default'.*make_env\('deep_search', tier='default'\)"):
        text_env.reset(env.tasks("train")[0])
    with pytest.raises(ValueError, match="deep_search has tiers"):
        DeepSearchEnv("easy")


def test_expert_recovers_from_injected_mistakes(env, text_env):
    rng = random.Random(0)
    wrong_numbers = ["get_document(hit=2)", "get_document(hit=1, neighbour=3, page=1)", "answer(hit=6)",
                     "get_document(hit=1, neighbour=40)", "search(1)", "get_document(page=1)", "search()"]

    def noisy_numbers(task, history, _):
        return rng.choice(wrong_numbers) if rng.random() < 0.3 else env.expert_action(task, history)

    tasks = env.tasks("heldout")[:40]
    results = [run_episode(env, task, noisy_numbers, max_turns=60) for task in tasks]
    # every wrong call is an error or a harmless read: search shows five hits, so answer(hit=6) does not end it
    assert sum(reward for reward, _ in results) / len(tasks) >= 0.9
    env = text_env
    wrong = ['search(query="Europe")', 'get_document(docid="d001", page=2)', 'get_document(docid="zzz")',
             'search(query="capital")', "get_document(d)", "not a call", 'get_document(docid="d100")']

    def noisy(task, history, _):
        return rng.choice(wrong) if rng.random() < 0.3 else env.expert_action(task, history)

    tasks = env.tasks("heldout")[:40]
    assert sum(run_episode(env, task, noisy, max_turns=60)[0] for task in tasks) / len(tasks) >= 0.9


def test_random_agent_mostly_fails(env, text_env):
    rng = random.Random(1)

    def random_numbers(task, history, observation):
        tool = rng.choice(["search", "get_document", "answer"])
        if tool == "search":
            return "search()"
        neighbour = f", neighbour={rng.randint(0, 5)}" if rng.random() < 0.7 else ""
        page = f", page={rng.randint(0, 3)}" if tool == "get_document" and rng.random() < 0.5 else ""
        return f"{tool}(hit={rng.randint(0, 4)}{neighbour}{page})"

    tasks = env.tasks("heldout")[:200]
    assert sum(run_episode(env, task, random_numbers, max_turns=20)[0] for task in tasks) / len(tasks) <= 0.05
    env = text_env

    def random_agent(task, history, observation):
        words = re.findall(r"[\w.+-]+", task.prompt + " " + observation) or ["x"]
        tool = rng.choice(["search", "get_document", "answer"])
        if tool == "search":
            return f'search(query="{" ".join(rng.sample(words, min(3, len(words))))}")'
        if tool == "get_document":
            return f'get_document(docid="{rng.choice(words)}", page={rng.randint(0, 3)})'
        return f'answer(text="{" ".join(rng.sample(words, rng.randint(1, min(2, len(words)))))}")'

    tasks = env.tasks("heldout")[:200]
    assert sum(run_episode(env, task, random_agent, max_turns=20)[0] for task in tasks) / len(tasks) <= 0.05


def test_bad_calls_are_error_observations(env, text_env):
    task = env.tasks("train")[0]
    env.reset(task)
    for action in ["search(query=\"Mali\")", "get_document()", "get_document(hit=0)", "get_document(hit=9)",
                   "get_document(hit=1, neighbour=0)", "get_document(hit=1, neighbour=99)", "answer(hit=1, page=2)",
                   "get_document(hit=1, page=99)", "get_document(hit=\"one\")", 'answer(text="Mali")', "x" * 10_000]:
        observation, reward, done, _ = env.step(action)
        assert observation.startswith("Error:") and reward == 0.0 and not done, action
    assert env.step("answer(hit=1)")[:3] == ("Incorrect.", 0.0, True)  # hit 1 is the hop, never the answer
    env = text_env
    task = env.tasks("train")[0]
    env.reset(task)
    bad = ["", "hello", "search(", 'search(query="a", k=3)', "search()", 'browse(url="x")', "search(query=[1])",
           f'search(query="{"word " * 100}")', 'search(query="qqqq zzzz")', 'get_document(docid="d999")',
           'get_document(docid="d001", page=99)', 'get_document(docid="d001", page=-1)', 'answer(text="  ")',
           'get_document(docid="d001", page="two")', "x" * 10_000, 'answer(text="' + "a" * 300 + '")']
    for action in bad:
        observation, reward, done, _ = env.step(action)
        assert observation.startswith("Error:") and reward == 0.0 and not done, action
    observation, reward, done, _ = env.step('<tool_call>{"name": "search", "arguments": {"query": "Bamako"}}'
                                            "</tool_call>")
    assert not observation.startswith("Error:") and len(observation) <= 350
    observation, reward, done, _ = env.step('answer(text="Atlantis")')
    assert (observation, reward, done) == ("Incorrect.", 0.0, True)
    assert env.step('search(query="Mali")')[0].startswith("Error:")


def test_corpus_pages_and_name_search():
    corpus = world()
    for country in corpus.countries:
        assert country in corpus.search(country.name, 3), country.name  # the plan's name search works
        pages = render_pages(country, "default")
        assert len(pages) >= 3 and all(len(page) <= 350 for page in pages)
        assert all(len(page) <= 1200 for page in render_pages(country, "hard"))
    answer = corpus.by_name["Ivory Coast"]
    assert normalise("Côte d'Ivoire") in answer.aliases and normalise("the Ivory Coast") in answer.aliases
