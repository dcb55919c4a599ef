"""Deep search environment: data integrity, task generation and splits, tools, expert and random baselines."""

from __future__ import annotations

import hashlib
import os
import random
import re
import subprocess
import sys

import pytest

from focus_core.envs import ENVIRONMENTS, deep_search
from focus_core.envs.base import split_of
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


def test_default_tier_messages_are_bare_calls_without_arguments(env):
    task = env.tasks("heldout")[0]
    _, history = run_episode(env, task, expert(env))
    for action, _ in history:
        assert re.fullmatch(r"(search|open|neighbour|page|answer)\(\)", action), action
    assert [action for action, _ in history[:3]] == ["search()", "open()", "neighbour()"]
    answer = world().by_name[task.answer]
    assert history[-1][0].endswith("answer()") and history[-2][1].endswith(
        f"[{task.answer}: neighbour {task.facts['candidates'].index(task.answer) + 1} of "
        f"{len(task.facts['candidates'])}, page 1/{len(render_pages(answer, 'default')) - 1}; "
        "clues met: all]")  # by page 1 the answer confirms every clue


def test_default_tier_observations_are_a_function_of_the_calls_so_far(env):
    """Branches replay the calls before their state into a fresh environment: the same calls must give the same
    observations, and the reader's position must come from them alone."""
    task = env.tasks("train")[3]
    _, history = run_episode(env, task, expert(env))
    for end in range(len(history)):
        fresh = DeepSearchEnv()
        fresh.reset(task)
        assert [fresh.step(action)[0] for action, _ in history[: end + 1]] == [o for _, o in history[: end + 1]]
    fresh = DeepSearchEnv()
    fresh.reset(task)
    fresh.step("search()")
    assert fresh.step("page()")[0].startswith("Error: no sheet is open")
    first = fresh.step("open()")[0]
    fresh.step("neighbour()")
    assert fresh.step("open()")[0] == first  # starts the neighbours over
    first_neighbour = world().by_name[task.facts["candidates"][0]]
    clues = [Constraint(kind, value) for kind, value in task.facts["constraints"]]
    met = sum(f.page("default") == 0 and f.holds(first_neighbour) for f in clues)  # page 1 always holds a clue
    assert fresh.step("neighbour()")[0].endswith(
        f"[{first_neighbour.name}: neighbour 1 of {len(task.facts['candidates'])}, page 0/"
        f"{len(render_pages(first_neighbour, 'default')) - 1}; clues met: {met} of {len(clues)}]")


def test_tier_mismatch_is_refused(env, text_env):
    with pytest.raises(ValueError, match=r"tier 'text'.*make_env\('deep_search', tier='text'\)"):
        env.reset(text_env.tasks("train")[0])
    with pytest.raises(ValueError, match=r"tier 'default'.*make_env\('deep_search', tier='default'\)"):
        text_env.reset(env.tasks("train")[0])
    with pytest.raises(ValueError, match="deep_search has tiers"):
        DeepSearchEnv("easy")


def test_expert_recovers_from_injected_mistakes(env, text_env):
    rng = random.Random(0)
    moves = ["neighbour()", "page()", "open()", "search()", "page(2)", "answer(1)"]

    def noisy_moves(task, history, _):
        return rng.choice(moves) if rng.random() < 0.3 else env.expert_action(task, history)

    tasks = env.tasks("heldout")[:40]
    # stray moves may walk past the answer; the expert starts the neighbours over
    assert sum(run_episode(env, task, noisy_moves, max_turns=60)[0] for task in tasks) / len(tasks) >= 0.9
    env = text_env
    wrong = ['search(query="Europe")', 'get_document(docid="d001", page=2)', 'get_document(docid="zzz")',
             'search(query="capital")', "get_document(d)", "not a call", 'get_document(docid="d100")']

    def noisy(task, history, _):
        return rng.choice(wrong) if rng.random() < 0.3 else env.expert_action(task, history)

    tasks = env.tasks("heldout")[:40]
    assert sum(run_episode(env, task, noisy, max_turns=60)[0] for task in tasks) / len(tasks) >= 0.9


def test_random_agent_mostly_fails(env, text_env):
    rng = random.Random(1)

    def random_calls(task, history, observation):
        return rng.choice(["search()", "open()", "neighbour()", "page()", "answer()"])

    tasks = env.tasks("heldout")[:200]
    assert sum(run_episode(env, task, random_calls, max_turns=20)[0] for task in tasks) / len(tasks) <= 0.05
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
    for action in ["open()", "neighbour()", "page()", "answer()", 'search(query="Mali")',
                   "search(1)", "get_document()", 'answer(text="Mali")', "x" * 10_000]:
        observation, reward, done, _ = env.step(action)
        assert observation.startswith("Error:") and reward == 0.0 and not done, action
    env.step("search()")
    env.step("open()")
    for _ in range(40):
        observation = env.step("page()")[0]
    assert observation == "Error: this is the sheet's last page"
    for _ in range(40):
        observation = env.step("neighbour()")[0]
    assert observation.startswith("Error: ") and "no more neighbours" in observation
    last_is_answer = task.facts["candidates"][-1] == task.answer
    assert env.step("answer()")[1:3] == (float(last_is_answer), True)  # answers with the sheet in front
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


def test_default_tier_says_all_clues_met_only_on_the_answer(env):
    """The footer's "clues met: all" is the answer's cue: on page 1 of exactly the answer among the neighbours."""
    for task in env.tasks("heldout")[:30]:
        env.reset(task)
        env.step("search()")
        env.step("open()")
        all_met = []
        for _ in task.facts["candidates"]:
            page_0 = env.step("neighbour()")[0]
            page_1 = env.step("page()")[0]
            assert not page_0.endswith("clues met: all]")  # page 1 always holds a clue
            all_met.append(page_1.endswith("clues met: all]"))
        assert all_met == [name == task.answer for name in task.facts["candidates"]]
