"""Adapters for the real benchmarks (BrowseComp-Plus, SWE-bench-style localization) on small fixtures in the real
formats: reading, tools, sandbox escapes, malformed calls, run files, Acc@k, the oracle experts, data errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_core.agent.toolcall import ToolCall
from focus_core.envs import ENVIRONMENTS, make_env
from focus_core.envs import browsecomp_plus as bcp
from focus_core.envs import swebench_loc as swe

FIXTURES = Path(__file__).resolve().parent / "fixtures"
QUERIES = FIXTURES / "browsecomp_plus" / "browsecomp_plus_decrypted.jsonl"
CORPUS = FIXTURES / "browsecomp_plus" / "corpus.jsonl"
DATASET = FIXTURES / "swebench" / "dataset.jsonl"
REPOS = FIXTURES / "swebench" / "repos"


def play(env, task, policy, max_turns: int = 12):
    """Run one episode; (reward, history of (action, observation), info of the last step)."""
    env.reset(task)
    history, info = [], {}
    for _ in range(max_turns):
        action = policy(task, history)
        observation, reward, done, info = env.step(action)
        history.append((action, observation))
        if done:
            return reward, history, info
    return 0.0, history, info


def expert(env):
    return lambda task, history: env.expert_action(task, history)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def to_parquet(source: Path, target: Path) -> Path:
    rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), target)
    return target


def test_fixtures_are_small():
    assert sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file()) < 200_000


# -- BrowseComp-Plus ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bc(tmp_path_factory) -> bcp.BrowseCompPlusEnv:
    return bcp.BrowseCompPlusEnv(QUERIES, CORPUS, cache_dir=tmp_path_factory.mktemp("bcp-cache"), page_chars=400)


def test_browsecomp_registered_and_made_by_name(tmp_path):
    assert ENVIRONMENTS["browsecomp_plus"] is bcp.BrowseCompPlusEnv
    env = make_env("browsecomp_plus", queries=str(QUERIES), corpus=str(CORPUS), cache_dir=str(tmp_path))
    assert len(env.tasks("heldout")) == 3


def test_browsecomp_reads_queries_all_heldout(bc):
    tasks = bc.tasks("heldout")
    assert bc.tasks("train") == []
    assert [t.facts["query_id"] for t in tasks] == ["101", "102", "103"]
    assert all(t.split == "heldout" and t.split_key == t.facts["query_id"] for t in tasks)
    assert tasks[0].answer == "1887" and tasks[0].prompt.startswith("A woman kept a lighthouse")
    assert tasks[0].facts["evidence_docids"] == ["10013", "10027"] and tasks[0].facts["gold_docids"] == ["10027"]
    with pytest.raises(ValueError):
        bc.tasks("heldout", tier="hard")


def test_browsecomp_tools_search_page_and_answer(bc):
    task = bc.tasks("heldout")[0]
    bc.reset(task)
    observation, reward, done, _ = bc.step('search(query="Carrow Botanical Society founded")')
    assert observation.split("\n")[0].startswith("10027 | ") and "Carrow Botanical Society" in observation
    assert (reward, done) == (0.0, False) and len(observation.split("\n")) <= bc.k
    first, *_ = bc.step('get_document(docid="10013")')
    assert first.startswith("[10013 p0/") and "Elsbeth Marrow" in first
    last = int(first.split("/")[1].split("]")[0])
    assert last >= 1 and bc.step(f'get_document(docid="10013", page={last})')[0].startswith(f"[10013 p{last}/{last}]")
    observation, reward, done, info = bc.step('answer(text="The 1887.")')
    assert (reward, done, info["correct"], info["query_id"]) == (1.0, True, True, "101")


@pytest.mark.parametrize("given,gold,correct", [
    ("1204", "1,204", True), ("Exact Answer: Oskar Lindqvist", "Oskar Lindqvist", True),
    ("Óskar lindqvist", "Oskar Lindqvist", True), ("Oskar", "Oskar Lindqvist", False),
    ("北京", "北京", True), ("上海", "北京", False), ("1887", "1878", False)])
def test_answer_normalisation(given, gold, correct):
    assert (bcp.normalise_answer(given) == bcp.normalise_answer(gold)) is correct
    assert bcp.normalise_answer(gold)  # no gold answer normalises to nothing (that would match everything)


def test_browsecomp_wrong_answer_scores_zero_with_f1(bc):
    bc.reset(bc.tasks("heldout")[1])
    _, reward, done, info = bc.step('answer(text="Marta Lindqvist")')
    assert (reward, done, info["correct"]) == (0.0, True, False) and info["f1"] == pytest.approx(0.5)


@pytest.mark.parametrize("call", [
    'get_document(docid="nope")', 'get_document(docid="10013", page=99)', 'get_document(docid="10013", page=-1)',
    'search(query="")', f'search(query="{"x" * 600}")', 'search(query="zzzqqq")', 'answer(text="")',
    "no call at all", '<tool_call>{"name": "search", "arguments": </tool_call>', 'search(query=1+)',
    'delete(path="x")', 'get_document(docid=["a"])', 'search(query="a", k=3)', f'get_document(docid="{"9" * 300}")'])
def test_browsecomp_bad_calls_are_error_observations(bc, call):
    bc.reset(bc.tasks("heldout")[0])
    observation, reward, done, _ = bc.step(call)
    assert observation.startswith("Error:") and (reward, done) == (0.0, False)


@settings(max_examples=40, deadline=None)
@given(tool=st.sampled_from(["search", "get_document", "answer"]), value=st.text(max_size=120),
       page=st.integers(-5, 5))
def test_browsecomp_arbitrary_arguments_never_raise(bc, tool, value, page):
    bc.reset(bc.tasks("heldout")[2])
    arguments = {"query": value} if tool == "search" else {"text": value} if tool == "answer" else {
        "docid": value, "page": page}
    observation, reward, _, _ = bc.step(ToolCall(tool, arguments).render())
    assert isinstance(observation, str) and reward in (0.0, 1.0)


def test_browsecomp_expert_solves_every_fixture_query(bc):
    for task in bc.tasks("heldout"):
        reward, history, _ = play(bc, task, expert(bc))
        assert reward == 1.0 and len(history) == 2


def test_browsecomp_run_files_are_what_the_official_evaluator_reads(bc, tmp_path):
    ground_truth = {json.loads(line)["query_id"]: json.loads(line) for line in QUERIES.read_text().splitlines()}
    for task in bc.tasks("heldout"):
        play(bc, task, expert(bc))
        bc.write_run(tmp_path / "runs")
    bc.reset(bc.tasks("heldout")[0])
    bc.step('search(query="lighthouse keeper")')
    incomplete = bc.run_record()
    assert incomplete["status"] == "incomplete" and incomplete["tool_call_counts"] == {"search": 1}
    files = sorted((tmp_path / "runs").glob("run_*.json"))  # evaluate_run.py reads input_dir/run_*.json
    assert [f.name for f in files] == ["run_101.json", "run_102.json", "run_103.json"]
    for path in files:
        run = json.loads(path.read_text())
        truth = ground_truth[str(run["query_id"])]
        assert run["status"] == "completed" and run["metadata"]["model"] == "focus"
        assert run["result"][-1]["type"] == "output_text"
        assert run["result"][-1]["output"] == f"Exact Answer: {truth['answer']}"
        assert run["tool_call_counts"] == {"get_document": 1, "answer": 1}
        assert set(run["retrieved_docids"]) <= {d["docid"] for d in truth["evidence_docs"]}
        assert run["result"][0]["type"] == "tool_call" and json.loads(run["result"][0]["arguments"])["docid"]


def test_browsecomp_trec_run_file(bc, tmp_path):
    path = bc.write_trec_run(tmp_path / "bm25.trec", k=5)
    rows = [line.split() for line in path.read_text().splitlines()]
    corpus = {json.loads(line)["docid"] for line in CORPUS.read_text().splitlines()}
    by_query: dict[str, list[tuple[int, float, str]]] = {}
    for qid, q0, docid, rank, score, tag in rows:
        assert (q0, tag) == ("Q0", "focus-bm25s") and docid in corpus
        by_query.setdefault(qid, []).append((int(rank), float(score), docid))
    assert sorted(by_query) == ["101", "102", "103"]
    for qid, hits in by_query.items():
        assert [rank for rank, _, _ in hits] == list(range(1, len(hits) + 1)) and len(hits) <= 5
        assert [score for _, score, _ in hits] == sorted((score for _, score, _ in hits), reverse=True)
        evidence = next(t for t in bc.tasks("heldout") if t.facts["query_id"] == qid).facts["evidence_docids"]
        assert hits[0][2] in evidence  # the fixture queries are easy for BM25


def test_browsecomp_index_is_cached_by_corpus_hash_and_parquet_reads_alike(tmp_path, monkeypatch):
    first = bcp.BrowseCompPlusEnv(QUERIES, CORPUS, cache_dir=tmp_path / "cache")
    first.index()
    folders = sorted((tmp_path / "cache").iterdir())
    assert len(folders) == 1 and (folders[0] / "docs.sqlite").is_file()
    shards = tmp_path / "corpus-shards"
    shards.mkdir()
    to_parquet(CORPUS, shards / "train-00000-of-00001.parquet")
    queries = to_parquet(QUERIES, tmp_path / "queries.parquet")
    monkeypatch.setattr(bcp, "build_index", lambda *_: pytest.fail("rebuilt an index for an unchanged corpus"))
    again = bcp.BrowseCompPlusEnv(QUERIES, CORPUS, cache_dir=tmp_path / "cache")
    assert again.index().search("chess problems bridge", 3) == first.index().search("chess problems bridge", 3)
    monkeypatch.undo()
    parquet = bcp.BrowseCompPlusEnv(queries, shards, cache_dir=tmp_path / "cache")
    assert [t.task_id for t in parquet.tasks("heldout")] == [t.task_id for t in first.tasks("heldout")]
    assert parquet.index().search("chess problems bridge", 3) == first.index().search("chess problems bridge", 3)
    assert len(list((tmp_path / "cache").iterdir())) == 2  # a different file is a different corpus hash


def _bc_error(tmp_path, queries=QUERIES, corpus=CORPUS) -> str:
    with pytest.raises(bcp.BrowseCompPlusDataError) as error:
        env = bcp.BrowseCompPlusEnv(queries, corpus, cache_dir=tmp_path / "cache")
        env.tasks("heldout")
        env.index()
    return str(error.value)


def test_browsecomp_data_errors_name_the_file_and_the_fix(tmp_path):
    rows = [json.loads(line) for line in QUERIES.read_text().splitlines()]
    docs = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    message = _bc_error(tmp_path, queries=tmp_path / "missing.jsonl")
    assert "missing.jsonl: no such file" in message and "decrypt_dataset.py" in message
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    assert f"{bad}:2: not valid JSON" in _bc_error(tmp_path, queries=bad)
    no_answer = write_jsonl(tmp_path / "no-answer.jsonl", [{k: v for k, v in rows[0].items() if k != "answer"}])
    assert "missing or empty field 'answer'" in _bc_error(tmp_path, queries=no_answer)
    encrypted = write_jsonl(tmp_path / "enc.jsonl", [{**rows[0], "query": "dGhpcyBpcyBvYmZ1c2NhdGVkIHRleHQgb2Y="}])
    assert "XOR-encrypted" in _bc_error(tmp_path, queries=encrypted)
    assert "appears twice" in _bc_error(tmp_path, queries=write_jsonl(tmp_path / "dup.jsonl", rows[:1] * 2))
    assert "Tevatron/browsecomp-plus-corpus" in _bc_error(tmp_path, corpus=tmp_path / "nothing-here")
    no_docid = write_jsonl(tmp_path / "c1.jsonl", [{"text": "x", "url": "u"}])
    assert f"{no_docid}:1: missing or empty field 'docid'" in _bc_error(tmp_path, corpus=no_docid)
    assert "docid '10013' appears twice" in _bc_error(tmp_path, corpus=write_jsonl(tmp_path / "c2.jsonl", docs[:1] * 2))
    corrupt = tmp_path / "corpus.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet")
    assert "not a readable parquet file" in _bc_error(tmp_path, corpus=corrupt)
    (tmp_path / "empty").mkdir()
    assert "holds no .jsonl, .json or .parquet file" in _bc_error(tmp_path, corpus=tmp_path / "empty")
    assert not list((tmp_path / "cache").glob("index-*"))  # failed builds leave no cache behind


# -- SWE-bench-style localization ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sw() -> swe.SWEBenchLocEnv:
    return swe.SWEBenchLocEnv(DATASET, REPOS)


def test_swebench_registered_and_made_by_name():
    assert ENVIRONMENTS["swebench_loc"] is swe.SWEBenchLocEnv
    env = make_env("swebench_loc", dataset=str(DATASET), repos_dir=str(REPOS))
    assert len(env.tasks("heldout")) == 3 and env.tasks("train") == []
    assert len(swe.SWEBenchLocEnv(DATASET, REPOS, split="train").tasks("train")) == 3


def test_swebench_gold_locations_from_patches(sw):
    """Hand-checked against the fixture patches: docs, tests and new files are not gold; a pure insertion inside
    a method, a property setter and a nested helper (which belongs to its outer function) are."""
    gold = {t.facts["instance_id"]: (t.facts["gold_files"], t.facts["gold_functions"]) for t in sw.tasks("heldout")}
    assert gold == {
        "toyorg__minicalc-12": (["minicalc/ops.py"], ["minicalc/ops.py::Calculator.divide",
                                                      "minicalc/ops.py::parse_number"]),
        "toyorg__minicalc-15": (["minicalc/ops.py"], ["minicalc/ops.py::Calculator.mean",
                                                      "minicalc/ops.py::Calculator.rounded"]),
        "acme__textkit-7": (["textkit/util.py", "textkit/wrap.py"], ["textkit/util.py::slugify",
                                                                     "textkit/wrap.py::wrap_lines"])}
    task = sw.tasks("heldout")[0]
    assert task.facts["def_lines"] == {"minicalc/ops.py::parse_number": 6, "minicalc/ops.py::Calculator.divide": 24}
    assert task.prompt.startswith("Repository: toyorg/minicalc\n\nparse_number does not accept")


def test_patch_parsing_and_application():
    patch = ("diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -2,0 +3,1 @@ def f():\n+    y = 1\n"
             "@@ -4,2 +5,2 @@ def g():\n-    return 2\n+    return 3\n \n\\ No newline at end of file\n")
    (file,) = swe.parse_patch(patch)
    assert (file.old_path, file.new_path, [h[:2] for h in file.hunks]) == ("m.py", "m.py", [(2, 0), (4, 2)])
    old = "def f():\n    x = 0\ndef g():\n    return 2\n\n"
    assert swe.apply_hunks(old, file.hunks) == "def f():\n    x = 0\n    y = 1\ndef g():\n    return 3\n\n"
    assert swe.gold_locations(patch, lambda path: old)[:2] == (["m.py"], ["m.py::f", "m.py::g"])
    with pytest.raises(swe.PatchMismatch):
        swe.apply_hunks(old.replace("return 2", "return 5"), file.hunks)
    class_only = ("diff --git a/w.py b/w.py\n--- a/w.py\n+++ b/w.py\n@@ -1,3 +1,3 @@\n class W:\n-    width = 70\n"
                  "+    width = 80\n \n")
    text = "class W:\n    width = 70\n\n    def wrap(self):\n        return self.width\n"
    assert swe.gold_locations(class_only, lambda path: text)[:2] == (["w.py"], [])
    tests_only = class_only.replace("w.py", "tests/w.py")
    assert swe.gold_locations(tests_only, lambda path: text)[:2] == ([], [])


@pytest.mark.parametrize("candidates,expected", [
    # gold files a.py, b.py; gold functions a.py::f, b.py::C.g
    (["c.py::h", "a.py::f", "b.py::C.g", "b.py"],
     {"file_hit@1": 0, "function_hit@1": 0, "file_acc@1": 0, "file_acc@5": 1, "function_acc@1": 0,
      "function_acc@5": 1, "function_acc@10": 1}),
    (["a.py::f"], {"file_hit@1": 1, "function_hit@1": 1, "file_acc@1": 0, "file_acc@5": 0, "function_acc@1": 0,
                   "function_acc@5": 0}),
    (["a.py::f", "b.py::C.g"], {"file_acc@1": 0, "file_acc@5": 1, "function_acc@1": 0, "function_acc@5": 1}),
    ([f"x{i}.py::z" for i in range(9)] + ["a.py::f", "b.py::C.g"],
     {"file_hit@1": 0, "file_acc@10": 0, "function_acc@10": 0, "function_hit@1": 0}),
    ([f"x{i}.py::z" for i in range(8)] + ["a.py::f", "b.py::C.g"], {"file_acc@10": 1, "function_acc@10": 1}),
    ([], {"file_hit@1": 0, "function_hit@1": 0, "file_acc@10": 0, "function_acc@10": 0}),
])
def test_acc_at_k_hand_checked(candidates, expected):
    metrics = swe.localization_metrics(candidates, ["a.py", "b.py"], ["a.py::f", "b.py::C.g"])
    assert {key: metrics[key] for key in expected} == expected


def test_acc_at_k_single_gold_and_no_function_gold():
    assert set(swe.localization_metrics(["a.py::f"], ["a.py"], ["a.py::f"]).values()) == {1.0}
    metrics = swe.localization_metrics(["a.py"], ["a.py"], [])
    assert metrics["file_acc@1"] == 1.0 and metrics["function_hit@1"] is None and metrics["function_acc@5"] is None


def test_submissions_are_parsed_leniently():
    text = "a.py::f(), ./b.py:C.g\n`c.py`; a.py::f  pkg/d.py::D.run"
    assert swe.parse_locations(text) == ["a.py::f", "b.py::C.g", "c.py", "pkg/d.py::D.run"]
    assert swe.parse_locations(" , ;\n") == []


def test_swebench_expert_solves_every_fixture_instance(sw):
    for task in sw.tasks("heldout"):
        reward, history, info = play(sw, task, expert(sw))
        assert reward == 1.0 and info["function_acc@5"] == 1.0 and info["file_acc@5"] == 1.0
        assert 3 <= len(history) <= 9


def test_swebench_reward_is_function_hit_at_1(sw):
    task = next(t for t in sw.tasks("heldout") if t.facts["instance_id"] == "acme__textkit-7")
    sw.reset(task)
    _, reward, done, info = sw.step('submit(locations="textkit/wrap.py::Wrapper.wrap, textkit/wrap.py::wrap_lines")')
    assert (reward, done, info["file_hit@1"], info["function_acc@5"], info["file_acc@5"]) == (0.0, True, 1.0, 0, 0)
    sw.reset(task)
    _, reward, _, info = sw.step('submit(locations="textkit/wrap.py:wrap_lines")')
    assert (reward, info["function_acc@1"], info["candidates"]) == (1.0, 0.0, ["textkit/wrap.py::wrap_lines"])


def test_swebench_tools_read_the_checkout(sw):
    sw.reset(sw.tasks("heldout")[0])
    assert sw.step('ls(path=".")')[0] == "./: README.md docs/ minicalc/ tests/"
    observation = sw.step('grep(pattern="def divide(")')[0]
    assert observation == "1 hits:\nminicalc/ops.py:24: def divide(self, value: float) -> float:"
    assert sw.step('open(path="minicalc/ops.py", start=24)')[0].startswith("minicalc/ops.py:24-40/40 Calculator.divide")
    assert "minicalc/ops.py::Calculator.divide L24" in sw.step('search(query="divide the total")')[0]


@pytest.fixture()
def sandbox(tmp_path):
    """A copy of the fixture checkouts with a link out of the checkout, a linked file and a worktree .git file."""
    repos = tmp_path / "repos"
    shutil.copytree(REPOS, repos)
    root = repos / "toyorg__minicalc-12"
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("TOPSECRET\n")
    os.symlink(tmp_path / "outside", root / "link_out")
    os.symlink(tmp_path / "outside" / "secret.txt", root / "minicalc" / "secret.py")
    (root / ".git").write_text(f"gitdir: {tmp_path}/mirror/.git/worktrees/toyorg__minicalc-12\n")
    env = swe.SWEBenchLocEnv(DATASET, repos)
    env.reset(next(t for t in env.tasks("heldout") if t.facts["instance_id"] == "toyorg__minicalc-12"))
    return env, tmp_path


@pytest.mark.parametrize("call", [
    'open(path="../toyorg__minicalc-15/minicalc/ops.py")', 'open(path="minicalc/../../x")', 'open(path="/etc/passwd")',
    'ls(path="/")', 'open(path="~/.bashrc")', 'open(path="C:/x.py")', 'open(path="link_out/secret.txt")',
    'ls(path="link_out")', 'grep(pattern="TOP", path="link_out")', 'open(path="minicalc/secret.py")',
    f'open(path="{"a/" * 150}x.py")', 'open(path=".git")', 'ls(path=".git")', 'grep(pattern="gitdir", path=".git")',
    'open(path="minicalc\\x00.py")', 'open(path="minicalc")', 'ls(path="README.md")', 'open(path="nope.py")'])
def test_swebench_sandbox_escapes_are_error_observations(sandbox, call):
    env, host = sandbox
    observation, reward, done, _ = env.step(call)
    assert observation.startswith("Error:") and (reward, done) == (0.0, False)
    assert str(host) not in observation and "TOPSECRET" not in observation


def test_swebench_walks_do_not_follow_links_or_show_vcs(sandbox):
    env, host = sandbox
    assert ".git" not in env.step('ls(path=".")')[0] and "link_out" not in env.step('ls(path=".")')[0]
    for call in ['grep(pattern="TOPSEC")', 'grep(pattern="gitdir")', 'search(query="secret")']:
        observation = env.step(call)[0]
        assert "TOPSECRET" not in observation and str(host) not in observation and "No " in observation


@settings(max_examples=40, deadline=None)
@given(tool=st.sampled_from(["ls", "grep", "open", "search", "submit"]), value=st.text(max_size=250),
       number=st.integers(-3, 100))
def test_swebench_arbitrary_arguments_never_raise(sw, tool, value, number):
    sw.reset(sw.tasks("heldout")[2])
    arguments = {"ls": {"path": value, "start": number}, "grep": {"pattern": value, "path": value},
                 "open": {"path": value, "start": number}, "search": {"query": value},
                 "submit": {"locations": value}}[tool]
    observation, reward, _, _ = sw.step(ToolCall(tool, arguments).render())
    assert isinstance(observation, str) and reward in (0.0, 1.0)


@pytest.mark.parametrize("call", ["no call", 'submit(locations="")', 'submit()', 'grep(pattern="")',
                                  'search(query="   ")', 'open(path="minicalc/ops.py", start=0)', 'ls(".", 99)',
                                  'open(path="minicalc/ops.py", start="x")', 'frobnicate(x=1)'])
def test_swebench_malformed_calls_are_error_observations(sw, call):
    sw.reset(sw.tasks("heldout")[0])
    observation, reward, done, _ = sw.step(call)
    assert observation.startswith("Error:") and (reward, done) == (0.0, False)


def test_swebench_parquet_dataset_reads_alike(sw, tmp_path):
    parquet = swe.SWEBenchLocEnv(to_parquet(DATASET, tmp_path / "test-00000-of-00001.parquet"), REPOS)
    assert [t.task_id for t in parquet.tasks("heldout")] == [t.task_id for t in sw.tasks("heldout")]


def _swe_error(dataset=DATASET, repos=REPOS) -> str:
    with pytest.raises(swe.SWEBenchDataError) as error:
        swe.SWEBenchLocEnv(dataset, repos).tasks("heldout")
    return str(error.value)


def test_swebench_data_errors_name_the_file_and_the_fix(tmp_path):
    rows = [json.loads(line) for line in DATASET.read_text().splitlines()]
    message = _swe_error(dataset=tmp_path / "lite.jsonl")
    assert "lite.jsonl: no such file" in message and "princeton-nlp/SWE-bench_Lite" in message
    assert "no such folder" in _swe_error(repos=tmp_path / "no-repos")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{oops\n")
    assert f"{broken}:1: not valid JSON" in _swe_error(dataset=broken)
    no_patch = write_jsonl(tmp_path / "no-patch.jsonl", [{k: v for k, v in rows[0].items() if k != "patch"}])
    assert f"{no_patch}:1: missing or empty field 'patch'" in _swe_error(dataset=no_patch)
    sneaky = write_jsonl(tmp_path / "sneaky.jsonl", [{**rows[0], "instance_id": "../etc"}])
    assert "cannot name a folder" in _swe_error(dataset=sneaky)
    repos = tmp_path / "repos"
    shutil.copytree(REPOS, repos)
    shutil.rmtree(repos / "acme__textkit-7")
    message = _swe_error(repos=repos)
    assert f"{repos / 'acme__textkit-7'}: no checkout" in message and "github.com/acme/textkit" in message
    assert "worktree add --detach" in message and rows[2]["base_commit"] in message
    shutil.copytree(REPOS / "acme__textkit-7", repos / "acme__textkit-7")
    ops = repos / "toyorg__minicalc-12" / "minicalc" / "ops.py"
    ops.write_text(ops.read_text().replace("cleaned = text.strip()", "cleaned = text"))
    message = _swe_error(repos=repos)
    assert "differs from the gold patch's pre-image near line 8" in message and "not at base_commit" in message
    ops.unlink()
    assert "minicalc/ops.py, changed by the gold patch, is missing" in _swe_error(repos=repos)
