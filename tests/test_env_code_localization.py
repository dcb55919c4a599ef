"""Code localization: mutants, tasks, splits, index and sandboxed tools, expert and random play, data integrity.

Most tests use a quick environment over three modules (generated in seconds, then cached under FOCUS_DATA_DIR):
``quick`` is the default (reader) tier, ``quick_text`` the free-text tools of the ``text`` and ``hard`` tiers.
The ``slow`` tests use the full default tier; its first generation takes a few minutes (then it is cached).
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import subprocess
import sys
from itertools import zip_longest
from pathlib import Path

import pytest

from focus_core.agent.toolcall import ToolCall
from focus_core.envs import ENVIRONMENTS, code_corpus, code_tasks, code_tools, make_env
from focus_core.envs import code_localization as cl
from focus_core.envs import code_mutations as cm
from focus_core.envs.text import cut

QUICK = ("textwrap", "colorsys", "pipes")  # pipes is a held-out module, the others train
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick() -> cl.CodeLocalizationEnv:
    return cl.CodeLocalizationEnv(modules=QUICK)


@pytest.fixture(scope="module")
def quick_text() -> cl.CodeLocalizationEnv:
    return cl.CodeLocalizationEnv(modules=QUICK, tier="text")


@pytest.fixture(scope="module")
def full() -> cl.CodeLocalizationEnv:
    return cl.CodeLocalizationEnv()


# The full tier's first generation takes minutes (processes that ask at once generate it once, on the cache's lock).
# One slow test generates it early in the run; the others are `late` (tests/conftest.py): they read it at the end of
# the run instead of waiting for it on the other worker. Run alone, each of them generates it.
READS_FULL_TIER = pytest.mark.late


def test_registered():
    assert ENVIRONMENTS["code_localization"] is cl.CodeLocalizationEnv


def play(env, task, policy, max_turns: int = 30):
    """Run one episode; return (reward, turns, transcript of (action, observation), info of the last step)."""
    observation, history, info = env.reset(task), [], {}
    for _ in range(max_turns):
        action = policy(task, history, observation)
        observation, reward, done, info = env.step(action)
        history.append((action, observation))
        if done:
            return reward, len(history), history, info
    return 0.0, len(history), history, info


def expert(env):
    return lambda task, history, _: env.expert_action(task, history)


def random_agent(env, seed: int):
    """A random tool with arguments made of random words from the prompt and the last observation."""
    rng = random.Random(seed)

    def act(task, history, observation):
        words = re.findall(r"[\w./:]+", task.prompt + " " + observation) or ["x"]
        spec = rng.choice(env.tools)
        args = {name: rng.randint(0, 50) if kind == "integer" else " ".join(rng.sample(words, min(2, len(words))))
                for name, kind, _ in spec.parameters if name in spec.required or rng.random() < 0.5}
        return ToolCall(spec.name, args).render()

    return act


# -- mutations --------------------------------------------------------------------------------------------------

SAMPLE = '''def f(a, b=2, flag=True):
    """Doc."""
    total = 0
    if a < b and flag:
        total = a - b
    else:
        total = b % 3
    return total
'''


def test_mutants_are_minimal_verified_edits():
    found = cm.mutants(SAMPLE, "f", seed="t", limit=100)
    ops = {m.op for m in found}
    assert ops == {"flip_comparison", "off_by_one", "swap_operands", "invert_condition", "drop_statement",
                   "change_default", "swap_and_or"}
    for mutant in found:
        mutated = mutant.apply(SAMPLE)
        assert ast.dump(ast.parse(mutated)) != ast.dump(ast.parse(SAMPLE))
        assert '"""Doc."""' in mutated  # the docstring is never dropped
        changed = [i for i, (x, y) in enumerate(zip_longest(SAMPLE.splitlines(), mutated.splitlines())) if x != y]
        assert changed and changed[0] + 1 == mutant.line
    assert [m.replacement for m in found] == [m.replacement for m in cm.mutants(SAMPLE, "f", seed="t", limit=100)]


def test_records_come_from_failing_real_tests(quick):
    records = cm.load_records(QUICK)["textwrap"]
    assert records
    for record in records[:20]:
        assert record["failures"] and all(f["test_id"].startswith("test.test_textwrap.") for f in record["failures"])
        text = json.dumps(record)
        assert str(cm.stdlib_dir()) not in text and sys.base_prefix not in text


# -- tasks and splits -------------------------------------------------------------------------------------------

def test_tasks_are_deterministic_across_processes(quick):
    here = [(t.task_id, t.prompt, t.answer, t.split) for t in quick.tasks("train") + quick.tasks("heldout")]
    code = ("import json; from focus_core.envs.code_localization import CodeLocalizationEnv as E; e = E(modules="
            f"{QUICK!r}); print(json.dumps([(t.task_id, t.prompt, t.answer, t.split) for t in "
            "e.tasks('train') + e.tasks('heldout')]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert [tuple(row) for row in json.loads(out.stdout)] == here
    assert here and len({row[0] for row in here}) == len(here)


def test_tasks_on_disk_are_the_generated_ones(quick, quick_text):
    # The env reads its tasks from the cache under FOCUS_DATA_DIR when there is one: they must be what a fresh
    # generation makes, field for field (facts included), in order.
    for env, tier in ((quick, "default"), (quick_text, "text")):
        every = env.tasks("train", tier) + env.tasks("heldout", tier)
        fresh = cl.CodeLocalizationEnv(modules=QUICK).generate_tasks(tier)
        assert sorted(every, key=lambda t: t.task_id) == sorted(fresh, key=lambda t: t.task_id)
        assert [t for t in fresh if t.split == "train"] == env.tasks("train", tier)


def test_quick_split_is_by_module(quick):
    train, heldout = quick.tasks("train"), quick.tasks("heldout")
    assert train and heldout
    assert {t.facts["module"] for t in heldout} == {"pipes"}
    assert not {t.answer for t in train} & {t.answer for t in heldout}


@pytest.mark.slow
def test_full_default_tier_counts_and_disjoint_splits(full):
    train, heldout = full.tasks("train"), full.tasks("heldout")
    assert len(train) >= 500 and len(heldout) >= 100
    assert not {t.split_key for t in train} & {t.split_key for t in heldout}
    assert not {t.answer for t in train} & {t.answer for t in heldout}
    assert all(len(t.prompt) <= 300 for t in train + heldout)


@pytest.mark.slow
@READS_FULL_TIER
def test_full_expert_solves_heldout_and_random_fails(full):
    heldout = full.tasks("heldout")
    sample = random.Random(0).sample(heldout, 100)
    results = [play(full, task, expert(full)) for task in sample]
    assert sum(r for r, *_ in results) / len(results) >= 0.9
    assert all(6 <= n <= 20 for _, n, *_ in results)  # every expert episode, not only the median
    for _, _, history, _ in results:
        assert all(len(obs) <= 400 for _, obs in history)
    random_wins = sum(play(full, task, random_agent(full, 100 * i + k), max_turns=20)[0]
                      for i, task in enumerate(sample) for k in range(5))
    assert random_wins / len(sample) / 5 <= 0.05


# -- expert, random agent, observations -------------------------------------------------------------------------

def test_text_expert_solves_quick_tasks_within_limits(quick_text):
    tasks = quick_text.tasks("heldout", tier="text") + quick_text.tasks("train", tier="text")[:20]
    for task in tasks:
        assert len(task.prompt) <= 300
        reward, turns, history, info = play(quick_text, task, expert(quick_text))
        assert reward == 1.0 and info["function_hit"] and info["file_hit"]
        assert 6 <= turns <= 20
        assert all(len(obs) <= 350 and not obs.startswith("Error") for _, obs in history)
        assert not any(secret in obs for _, obs in history for secret in code_tasks.host_paths())


@pytest.mark.parametrize("tier", ["default", "text"])
def test_expert_recovers_from_injected_mistakes(quick, quick_text, tier):
    env = quick if tier == "default" else quick_text
    rng, solved = random.Random(1), 0
    tasks = env.tasks("heldout", tier=tier)[:10] + env.tasks("train", tier=tier)[:10]
    for i, task in enumerate(tasks):
        noise = random_agent(env, i)

        def mistaken(task, history, observation, noise=noise):
            action = noise(task, history, observation) if rng.random() < 0.3 else env.expert_action(task, history)
            # Any default-tier submit is a final answer (no retry), so only the other mistakes can be recovered from.
            return env.expert_action(task, history) if tier == "default" and action.startswith("submit") else action

        reward, *_ = play(env, task, mistaken, max_turns=40)
        solved += reward
    assert solved / len(tasks) >= 0.9


@pytest.mark.parametrize("tier", ["default", "text"])
def test_random_agent_mostly_fails(quick, quick_text, tier):
    env = quick if tier == "default" else quick_text
    tasks = env.tasks("train", tier=tier) + env.tasks("heldout", tier=tier)
    runs = 10 if tier == "default" else 1  # the default tier's tools take no arguments: average over more runs
    wins = sum(play(env, task, random_agent(env, 100 * i + k), max_turns=20)[0]
               for i, task in enumerate(tasks) for k in range(runs))
    assert wins / len(tasks) / runs <= 0.05


def test_hard_tier_uses_tracebacks_and_is_solvable(quick_text):
    tasks = quick_text.tasks("train", tier="hard")
    assert tasks and all("Traceback" in t.prompt for t in tasks[:10])
    for task in tasks[:5]:
        reward, turns, *_ = play(quick_text, task, expert(quick_text))
        assert reward == 1.0 and turns >= 4


# -- the default tier: a reader with argument-free tools ------------------------------------------------------

THOUGHTS = ("Read the failing test.", "Read the traceback.", "Open the first function.", "The bug is on this page.",
            "The bug was behind us; start over.", "No bug yet. Read the next page.",
            "No bug here. Open the next function.")


def test_default_tier_expert_solves_quick_tasks(quick):
    tasks = quick.tasks("heldout") + quick.tasks("train")[:30]
    assert tasks and all(t.tier == "default" for t in tasks)
    for task in tasks:
        f = task.facts
        assert len(task.prompt) <= 300 and 1 <= f["gold"] <= len(f["candidates"]) <= code_tasks.READER_FUNCTIONS
        reward, turns, history, info = play(quick, task, expert(quick))
        assert reward == 1.0 and info["function_hit"] and info["page_hit"]
        assert 6 <= turns == code_tasks.reader_expert_turns(f) <= 20  # no task ends on the first two pages
        bug_page = history[-2][1]  # the page submitted shows the mutated line
        assert f"[fn {f['gold']} of {len(f['candidates'])}, page {f['gold_page']}/" in bug_page.split("\n")[-1]
        assert all(len(obs) <= 400 and not obs.startswith("Error") for _, obs in history)
        assert all(code_tools.READER_FOOTER.search(obs) for _, obs in history[:-1])  # every step says where it is
        assert not any(secret in obs for _, obs in history for secret in code_tasks.host_paths())
        for action, _ in history:  # one fixed thought line naming nothing, then a call without arguments
            thought, call = action.split("\n")
            assert thought in THOUGHTS and not any(q.split(".")[-1] in thought for q in f["candidates"])
            assert call in ("test()", "trace()", "next()", "page()", "submit()"), call


def test_default_tier_observations_are_a_function_of_the_calls(quick):
    """Replaying any prefix of an episode's calls in a fresh environment gives the same observations (the harness
    replays a branch's calls, SegmentStart.calls)."""
    rng = random.Random(3)
    calls = ["test()", "trace()", "next()", "page()", "next(1)", "open(fn=1, page=1)", "nonsense"]
    for task in quick.tasks("train")[:6] + quick.tasks("heldout")[:4]:
        quick.reset(task)
        sequence, observations = [], []
        for _ in range(14):
            history = list(zip(sequence, observations, strict=True))
            action = rng.choice(calls) if rng.random() < 0.6 else quick.expert_action(task, history)
            if action.endswith("submit()"):
                continue
            sequence.append(action)
            observations.append(quick.step(action)[0])
        for k in (1, 4, 9, len(sequence)):
            fresh = cl.CodeLocalizationEnv(modules=QUICK)
            fresh.reset(task)
            assert [fresh.step(a)[0] for a in sequence[:k]] == observations[:k]


def test_default_tier_reader_walks_in_order_and_out_of_place_calls_are_errors(quick):
    task = next(t for t in quick.tasks("train") if len(t.facts["candidates"]) > 2)
    f, n = task.facts, len(task.facts["candidates"])
    quick.reset(task)
    for call in ("next()", "page()"):  # nothing listed or open yet
        observation, reward, done, _ = quick.step(call)
        assert observation.startswith("Error:") and (reward, done) == (0.0, False)
    assert quick.step("test()")[0].endswith(f"[no function open; {n} listed]")
    assert quick.step("page()")[0].startswith("Error:")
    for fn in range(1, n + 1):
        observation = quick.step("next()")[0]
        assert observation.split("\n")[0] == cut(f["candidates"][fn - 1], 40)
        assert observation.split("\n")[-1].startswith(f"[fn {fn} of {n}, page 1/{f['pages'][fn - 1]}")
        for page in range(2, f["pages"][fn - 1] + 1):  # the footer may add "; raised here"
            footer = quick.step("page()")[0].split("\n")[-1]
            assert footer.startswith(f"[fn {fn} of {n}, page {page}/{f['pages'][fn - 1]}")
        assert quick.step("page()")[0].startswith("Error:")  # past the last page
    assert quick.step("next()")[0].startswith("Error:")  # past the last function
    assert quick.step("trace()")[0].endswith(f"[no function open; {n} listed]")  # the traceback puts it away
    assert quick.step("next()")[0].split("\n")[-1].startswith(f"[fn 1 of {n}, page 1/{f['pages'][0]}")
    assert quick.step("test()")[0].endswith(f"[no function open; {n} listed]")  # and so does the test


@pytest.mark.parametrize("call", ["next(1)", "page(page=2)", "open(fn=1, page=1)", 'grep(pattern="def")',
                                  "test(fn=1)", "submit(fn=1, page=1)", "trace", "submit(1)", "nonsense"])
def test_default_tier_calls_take_no_arguments(quick, call):
    quick.reset(quick.tasks("train")[0])
    observation, reward, done, _ = quick.step(call)
    assert observation.startswith("Error:") and reward == 0.0 and not done


def test_default_tier_random_calls_never_raise(quick):
    rng = random.Random(5)
    calls = ["test()", "trace()", "next()", "page()", "next(x=1)", "page()", "()", "next() next()"]
    for task in quick.tasks("train")[:20]:
        quick.reset(task)
        for _ in range(25):
            observation, reward, done, _ = quick.step(rng.choice(calls))
            assert reward == 0.0 and not done and len(observation) <= 400


def test_default_tier_submit_rewards_the_buggy_page_of_the_mutated_function(quick):
    task = next(t for t in quick.tasks("train") if len(t.facts["candidates"]) > 1 and t.facts["pages"][
        t.facts["gold"] - 1] > 1)
    f = task.facts
    assert task.answer == f"{f['path']}::{f['candidates'][f['gold'] - 1]}"

    def submit_at(fn, page):
        quick.reset(task)
        quick.step("test()")
        for _ in range(fn):
            quick.step("next()")
        for _ in range(page - 1):
            quick.step("page()")
        return quick.step("submit()")

    other_page = 2 if f["gold_page"] == 1 else 1
    other_fn = 1 if f["gold"] != 1 else 2
    for fn, page, reward, function_hit in ((f["gold"], f["gold_page"], 1.0, True),
                                           (f["gold"], other_page, 0.0, True), (other_fn, 1, 0.0, False)):
        observation, got, done, info = submit_at(fn, page)
        assert (got, done, info["function_hit"]) == (reward, True, function_hit), observation
    quick.reset(task)
    observation, reward, done, info = quick.step("submit()")  # nothing open: a wrong answer, not a retry
    assert (reward, done, info["function_hit"]) == (0.0, True, False)


def test_default_tier_lists_what_the_test_runs_in_file_order(quick):
    marked = raised = 0
    for task in quick.tasks("train") + quick.tasks("heldout"):
        f = task.facts
        text = code_corpus.repo_of(QUICK).files[f["path"]]
        lines = [code_tasks.def_order(text)[q] for q in f["candidates"]]
        assert lines == sorted(lines) and len(set(f["candidates"])) == len(f["candidates"])
        assert f["candidates"][f["gold"] - 1] == f["qualname"]
        quick.reset(task)
        observation, *_ = quick.step("test()")
        assert observation.startswith(f"test {f['test_method']} runs {len(f['candidates'])} functions: ")
        observation, *_ = quick.step("trace()")
        assert observation.startswith("traceback:") and len(observation) <= 400
        for name, fn in re.findall(r" in (\S+) \(fn (\d)\)", observation):
            assert f["candidates"][int(fn) - 1].split(".")[-1] == name
            marked += 1
        shown = []  # "<- raised here" is on one line of one page at most: the page facts["raised"] names
        for fn, pages in enumerate(f["pages"], 1):
            for page in range(1, pages + 1):
                observation = quick.step("next()" if page == 1 else "page()")[0]
                assert ("<- raised here" in observation) == observation.endswith("; raised here]")
                if "<- raised here" in observation:
                    shown.append((fn, page))
        assert shown == ([tuple(f["raised"][:2])] if f["raised"] else [])
        raised += bool(f["raised"])
    assert marked and raised


def test_default_tier_tasks_are_crash_bugs_on_the_traceback_path(quick):
    """The default tier keeps a (mutant, test) pair only when the test errors inside the module and a frame of the
    traceback is on the bug's page; then the page that raised is the bug's page in most tasks."""
    tasks = quick.tasks("train") + quick.tasks("heldout")
    on_raised_page = 0
    for task in tasks:
        f = task.facts
        assert task.prompt.startswith("ERROR: "), task.prompt  # an exception, not a failed assertion
        frames = {int(line) for line in re.findall(rf"{f['module']}\.py:(\d+) in ", "\n".join(f["trace"]))}
        pages = cl.TIERS["default"].pages
        shown = {number for number, _ in code_tools.reader_lines(f, f["gold"], f["gold_page"], pages)}
        assert frames & shown or len(f["trace"]) == 8  # (the trace shows the six innermost frames only)
        on_raised_page += f["raised"] is not None and f["raised"][:2] == [f["gold"], f["gold_page"]]
    assert on_raised_page >= 0.8 * len(tasks)


@pytest.mark.slow
@READS_FULL_TIER
def test_default_tier_keeps_each_mutant_of_a_function_as_a_task(full):
    """Each mutant of a function puts the bug on another line: the default tier counts them as tasks, up to
    Tier.tasks_per_function per function; the text tier takes one test per function and mutant."""
    train = full.tasks("train")
    per_function = {}
    for task in train:
        per_function.setdefault(task.answer, set()).add(task.facts["start"])
    assert max(len(starts) for starts in per_function.values()) > 1
    assert all(sum(t.answer == answer for t in train) <= cl.TIERS["default"].tasks.tasks_per_function
               for answer in per_function)


def test_tier_tools_differ_and_mismatched_tasks_are_rejected(quick, quick_text):
    assert [s.name for s in quick.tools] == ["test", "trace", "next", "page", "submit"]
    assert all(not spec.parameters for spec in quick.tools)
    assert [s.name for s in quick_text.tools] == ["ls", "grep", "open", "search", "submit"]
    assert [s.name for s in make_env("code_localization", tier="text").tools] == [s.name for s in quick_text.tools]
    assert "submit()" in quick.system_prompt() and "next()" in quick.system_prompt()
    with pytest.raises(ValueError, match="tier"):
        quick.reset(quick_text.tasks("train", tier="text")[0])
    with pytest.raises(ValueError, match="tier"):
        quick_text.reset(quick.tasks("train")[0])
    default_ids = {t.task_id for t in quick.tasks("train") + quick.tasks("heldout")}
    assert not default_ids & {t.task_id for t in quick_text.tasks("train", tier="text")}


# -- tools: errors, sandbox, rewards ----------------------------------------------------------------------------

@pytest.fixture
def episode(quick_text, tmp_path, monkeypatch):
    # A planted link must not outlive the test.
    monkeypatch.setattr(code_corpus, "workspace_dir", lambda: tmp_path / "ws")
    task = quick_text.tasks("train", tier="text")[0]
    quick_text.reset(task)
    return quick_text, task


BAD_CALLS = [
    "no call at all", "frobnicate(x=1)", "open(", 'open(path="lib/textwrap.py", start="two")', "grep()",
    'open(path="lib/textwrap.py", start=0)', 'open(path="lib/textwrap.py", start=99999)', 'open(path="lib")',
    'open(path="lib/nope.py")', 'ls(path="lib/textwrap.py")', 'ls(path="lib", start=500)', 'grep(pattern="")',
    'submit(location="textwrap.dedent")', 'search(query="   ")', 'open(path="' + "a/" * 300 + '")',
    'grep(pattern="' + "x" * 500 + '")', '<tool_call>{"name": "ls", "arguments": 3}</tool_call>',
    'open(path="lib/\\u0000x")', 'open(path="' + "b" * 150 + '/' + "c" * 150 + '")',
]


@pytest.mark.parametrize("call", BAD_CALLS)
def test_bad_calls_are_error_observations(episode, call):
    env, _ = episode
    observation, reward, done, _ = env.step(call)
    assert observation.startswith("Error:") and reward == 0.0 and not done
    assert len(observation) <= 350


def test_huge_outputs_are_paginated(episode):
    env, _ = episode
    for call in ('grep(pattern="e")', 'grep(pattern="self", path="tests")', 'ls(path="lib")', 'search(query="a")',
                 'open(path="tests/test_textwrap.py", start=1)'):
        observation, _, done, _ = env.step(call)
        assert not observation.startswith("Error") and len(observation) <= 350 and not done


ESCAPES = ["/etc/passwd", "../", "../../etc", "lib/../../x", "~/x", "lib/../..", "C:/Windows", "\\\\server\\x",
           "lib/escape", "lib/escape/os.py", "lib/escape_file"]


def test_paths_cannot_leave_the_private_copy(episode):
    env, task = episode
    env.step('ls(path=".")')  # makes the private copy
    root = env.root
    (root / "lib" / "escape").symlink_to(cm.stdlib_dir())  # a link planted inside the copy
    (root / "lib" / "escape_file").symlink_to(cm.source_path("textwrap"))
    secrets = [str(cm.stdlib_dir()), sys.base_prefix, str(root), "/root", os.path.expanduser("~")]
    for path in ESCAPES:
        for call in (ToolCall("open", {"path": path}), ToolCall("ls", {"path": path}),
                     ToolCall("grep", {"pattern": "import", "path": path})):
            observation, _, _, _ = env.step(call.render())
            assert observation.startswith("Error:"), (call, observation)
            assert not any(s in observation for s in secrets if len(s) > 1)
    for call in ('grep(pattern="import os", path=".")', 'ls(path="lib")'):
        observation, *_ = env.step(call)
        assert "escape" not in observation  # links are neither listed nor followed
    assert str(root) not in json.dumps(task.facts) and str(cm.stdlib_dir()) not in task.prompt


def test_private_copy_holds_the_mutant(episode):
    env, task = episode
    env.step('ls(path=".")')
    facts = task.facts
    mutated = (env.root / facts["path"]).read_text()
    pristine = cm.source_path(facts["module"]).read_text()
    assert mutated != pristine
    first = next(i for i, (a, b) in enumerate(zip_longest(mutated.splitlines(), pristine.splitlines())) if a != b)
    assert facts["def_line"] <= first + 1 <= facts["def_line"] + (facts["mutated_line"] - facts["def_line"]) + 1
    assert (env.root / "tests" / "test_textwrap.py").read_text() == cm.test_path("textwrap").read_text()
    observation, *_ = env.step('ls(path="lib")')
    assert observation.startswith("lib/:") and "textwrap.py" in observation and ":" not in observation[5:]


def test_submit_rewards_only_the_mutated_function(episode):
    env, task = episode
    path = task.answer.split("::")[0]
    observation, reward, done, info = env.step(f'submit(location="{path}::not_the_function")')
    assert (reward, done, info["file_hit"], info["function_hit"]) == (0.0, True, True, False)
    assert env.step(f'submit(location="{task.answer}")')[0].startswith("Error: the episode is over")
    env.reset(task)
    observation, reward, done, info = env.step(f'submit(location="./{task.answer}")')
    assert (reward, done, info["function_hit"]) == (1.0, True, True)


# -- data integrity ---------------------------------------------------------------------------------------------

def test_wrong_source_hash_fails_clearly(monkeypatch):
    monkeypatch.setattr(cm, "SOURCES_SHA256", "0" * 64)
    with pytest.raises(cm.DataError, match=r"CPython 3\.11\.7"):
        cl.CodeLocalizationEnv(modules=QUICK).tasks("train")
