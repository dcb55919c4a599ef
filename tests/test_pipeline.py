"""End to end: `focus train` / `resume` / `runs` / `sql` as a user runs them, in subprocesses.

Real components throughout: the Prefect flow in its ephemeral mode, a local sqlite MLflow store,
DuckDB over the committed Parquet, and for the S3 case a real SeaweedFS server. The config is the
smallest that exercises every stage (one acquisition round, a 1-layer model, a few tasks). SFT is
bounded by epochs, not seconds, so two runs with the same seed produce the same tables.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.compute as pc
import pytest

import tasks.advantage
import tasks.update
from focus_core.artifacts import ArtifactStore
from focus_core.config import validate_config
from focus_core.rollouts import training_sequences
from tasks.stage import RunContext

# Every test here but the quick start's (which keeps Prefect's temporary server) runs its `focus` processes against
# one Prefect server per pytest process (tests/conftest.py): the temporary one costs each process 9-14 s.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("on_prefect_server")]

TINY = """
method: {method}
seed: 3
iterations: {iterations}
env: {{name: legal, eval_tasks: 3}}
model: {{layers: 1, hidden: 32, heads: 2, intermediate: 64, vocab_size: 400}}
bootstrap: {{demonstrations: 12, epochs: 1, max_seconds: 10000}}
agent: {{compression: notes, max_turns: 5, max_action_tokens: 40}}
budget: {{prompts_per_iteration: {prompts}, group_size_grpo: 4, group_size_main: 2, measure_episodes: 8}}
ppo: {{lr: 1.0e-4, epochs: 1}}
"""
CRITIC_EXTRA = "critic: {steps: 10, hidden: 16}\n"
FOCUS_EXTRA = "acquisition: {rounds: 1, chunk_size: 1}\n" + CRITIC_EXTRA
# Every stage of a one-iteration FOCUS run, in order, as "iteration:stage".
STAGES = ["0:bootstrap", "0:evaluate", "0:rollout", "0:segment", "0:acquire_r0", "0:branch_r0", "0:fit_critic_r0",
          "0:advantage", "0:update", "1:evaluate"]
TABLES = ("rollouts", "episodes", "states", "acquisition", "branches", "values", "advantages", "updates",
          "evaluation", "budget_ledger")


def write_config(tmp_path: Path, method: str = "focus", iterations: int = 1, prompts: int = 2) -> Path:
    path = tmp_path / f"{method}.yaml"
    path.write_text(TINY.format(method=method, iterations=iterations, prompts=prompts)
                    + {"focus": FOCUS_EXTRA, "focus_nobranch": CRITIC_EXTRA}.get(method, ""))
    return path


def focus(*args: str, cwd: Path, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run the `focus` CLI in a fresh process, isolated: its own Prefect home and MLflow store under cwd.

    The process gets its own process group, removed whole afterwards: a `focus` killed with SIGKILL
    leaves Prefect's temporary API server (its child) behind, which would hold the output pipes open.
    """
    environ = {key: value for key, value in os.environ.items() if key != "FOCUS_KILL_AT"}
    environ |= {"PREFECT_HOME": str(cwd / ".prefect"), "OMP_NUM_THREADS": "1",
                "MLFLOW_TRACKING_URI": f"sqlite:///{cwd / 'mlruns.db'}", **(env or {})}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=environ, stdout=out,
                                 stderr=err, text=True, start_new_session=True)
        try:
            returncode = child.wait(timeout=900)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(child.args, returncode, out.read(), err.read())
    if check and done.returncode != 0:
        raise AssertionError(f"focus {' '.join(args)} exited {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}")
    return done


def table_rows(store: ArtifactStore, run_id: str, table: str) -> list[dict]:
    rows = []
    for iteration, stage, manifest in store.committed(run_id):
        if table in manifest.tables:
            rows += store.read_table(run_id, iteration, stage, table).to_pylist()
    return rows


def comparable(rows: list[dict]) -> list[str]:
    return sorted(json.dumps(row, sort_keys=True, default=str) for row in rows)


def test_train_two_iterations_local_then_inspect(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL")  # the quick start's path: Prefect's temporary server, started by `focus`
    config = write_config(tmp_path, iterations=2)
    focus("train", "--config", str(config), "--store", str(tmp_path / "runs"), "--run-id", "e2e", cwd=tmp_path)
    store = ArtifactStore(tmp_path / "runs")
    check_continuations_train(store, "e2e", monkeypatch)
    info = store.run_info("e2e")
    assert info["status"] == "finished"
    stages = {(i, s) for i, s, _ in store.committed("e2e")}
    assert (1, "update") in stages and (2, "evaluate") in stages
    # Segment rewards sum to the episode reward, for every main and branch episode.
    episodes = table_rows(store, "e2e", "episodes")
    states = table_rows(store, "e2e", "states")
    totals: dict[str, float] = {}
    for row in states:
        totals[row["episode_id"]] = totals.get(row["episode_id"], 0.0) + row["segment_reward"]
    main = [e for e in episodes if not e["is_branch"]]
    assert main and all(abs(totals[e["episode_id"]] - e["reward"]) < 1e-12 for e in main)
    # The ledger never goes over the budget.
    for iteration in (0, 1):
        spent = sum(r["tokens"] for r in table_rows(store, "e2e", "budget_ledger") if r["iteration"] == iteration)
        budget = {r["budget"] for r in table_rows(store, "e2e", "budget_ledger") if r["iteration"] == iteration}
        assert len(budget) == 1 and spent <= budget.pop()
    # Every named query runs on the finished run and prints a table with at least one row.
    from flows.sql import NAMED_QUERIES

    for name in NAMED_QUERIES:
        out = focus("sql", "e2e", name, "--store", str(tmp_path / "runs"), cwd=tmp_path).stdout
        lines = out.strip().splitlines()
        assert len(lines) >= 3 and set(lines[1]) <= {"-", " "} and "(0 rows)" not in out, (name, out)
    runs = focus("runs", "--store", str(tmp_path / "runs"), cwd=tmp_path).stdout
    row = next(line for line in runs.splitlines() if line.startswith("e2e "))
    assert "finished" in row and " focus " in row and "2/2" in row


def check_continuations_train(store: ArtifactStore, run_id: str, monkeypatch) -> None:
    """FOCUS trains its continuations (ppo.train_on_continuations): every segment of every continuation has its
    own advantage (0 if the budget cut it), the update trains each generated token of the uncut episodes once;
    with the setting off, the stages give today's main-episode advantages and train only the main sequences."""
    episodes, rollouts = table_rows(store, run_id, "episodes"), table_rows(store, run_id, "rollouts")
    advantages = {(a["iteration"], a["episode_id"], a["segment_idx"]): a
                  for a in table_rows(store, run_id, "advantages")}
    for iteration in (0, 1):
        branch = {e["episode_id"]: e for e in episodes if e["iteration"] == iteration and e["is_branch"]}
        segments = {(r["episode_id"], r["segment_idx"]) for r in rollouts if r["episode_id"] in branch}
        assert segments and all((iteration, *key) in advantages for key in segments)
        assert all(advantages[(iteration, e, k)]["advantage"] == 0.0 for e, k in segments if branch[e]["budget_cut"])
        first = {e: min(k for b, k in segments if b == e) for e in branch}
        assert all(advantages[(iteration, e, k)]["state_id"] == branch[e]["parent_state_id"] for e, k in first.items())
        figures = store.manifest(run_id, iteration, "update").figures
        tokens = {kind: sum(e["generated_tokens"] for e in episodes if e["iteration"] == iteration
                            and e["is_branch"] == kind and not e["budget_cut"]) for kind in (False, True)}
        assert figures["policy_tokens_main"] == tokens[False] and figures["policy_tokens_continuations"] == tokens[True]
        assert figures["policy_tokens"] == tokens[False] + tokens[True] and tokens[True] > 0

    # The same stages with the setting off, in this process, on the committed inputs of iteration 0.
    cfg = store.run_info(run_id)["config"]
    ctx = RunContext(store, run_id, validate_config({**cfg, "ppo": {**cfg["ppo"], "train_on_continuations": False}}))
    m = {stage: store.manifest(run_id, 0, stage) for stage in ("bootstrap", "rollout", "segment", "branch_r0",
                                                              "fit_critic_r0", "advantage")}
    with tempfile.TemporaryDirectory() as scratch:
        off = tasks.advantage.compute(ctx, m["segment"], m["fit_critic_r0"], m["rollout"], m["bootstrap"],
                                      Path(scratch), [m["branch_r0"]])
    main = {e["episode_id"] for e in episodes if e["iteration"] == 0 and not e["is_branch"]}
    assert comparable(off.tables["advantages"].to_pylist()) == comparable(
        [a for key, a in advantages.items() if key[0] == 0 and key[1] in main])
    trained = []
    real_update = tasks.update.policy_update
    monkeypatch.setattr(tasks.update, "policy_update",
                        lambda model, sequences, *args, **kwargs: trained.append(sequences) or real_update(
                            model, sequences, *args, **kwargs))
    with tempfile.TemporaryDirectory() as scratch:
        result = tasks.update.compute(ctx, 0, m["rollout"], m["advantage"], m["bootstrap"], m["bootstrap"],
                                      Path(scratch), [m["branch_r0"]])
    kept = [e["episode_id"] for e in episodes if e["episode_id"] in main and not e["budget_cut"]]
    today = training_sequences(store.read_table(run_id, 0, "rollout", "rollouts"), episode_ids=kept)
    assert [(q.episode_id, q.segment_idx, q.token_ids.tolist(), q.loss_mask.tolist()) for q in trained[0]] == [
        (q.episode_id, q.segment_idx, q.token_ids.tolist(), q.loss_mask.tolist()) for q in today]
    assert result.figures["policy_tokens"] == result.figures["policy_tokens_main"] == tokens_of(today)
    assert result.figures["policy_tokens_continuations"] == 0


def tokens_of(sequences) -> int:
    return sum(q.generated_tokens for q in sequences)


def test_train_against_seaweedfs_s3(tmp_path, s3_store_root):
    config = write_config(tmp_path, method="grpo", iterations=2)
    focus("train", "--config", str(config), "--store", s3_store_root, "--run-id", "s3run", cwd=tmp_path)
    store = ArtifactStore(s3_store_root)
    assert store.run_info("s3run")["status"] == "finished"
    skipped = store.manifest("s3run", 0, "acquire_r0")
    assert skipped is not None and skipped.skipped  # GRPO records that it does not branch
    out = focus("sql", "s3run", "--query", "SELECT count(DISTINCT iteration) AS n FROM episodes", "--store",
                s3_store_root, cwd=tmp_path).stdout
    assert out.split()[-3:] == ["2", "(1", "rows)"], out  # both iterations' episodes are read back from S3


def test_kill_during_every_stage_then_resume_equals_uninterrupted(tmp_path):
    config = write_config(tmp_path)
    reference_root, killed_root = tmp_path / "reference", tmp_path / "killed"
    focus("train", "--config", str(config), "--store", str(reference_root), "--run-id", "same", cwd=tmp_path)

    first = focus("train", "--config", str(config), "--store", str(killed_root), "--run-id", "same", cwd=tmp_path,
                  env={"FOCUS_KILL_AT": STAGES[0]}, check=False)
    assert first.returncode == -9, first.stderr[-2000:]
    store = ArtifactStore(killed_root)
    for target in STAGES[1:]:
        before = {(i, s): m.created_at for i, s, m in store.committed("same")}
        resumed = focus("resume", "same", "--store", str(killed_root), cwd=tmp_path, env={"FOCUS_KILL_AT": target},
                        check=False)
        assert resumed.returncode == -9, (target, resumed.stderr[-2000:])
        after = {(i, s): m.created_at for i, s, m in store.committed("same")}
        # Nothing committed before the kill was recomputed; the killed stage left no manifest.
        assert all(after[key] == created for key, created in before.items())
        iteration, stage = target.split(":")
        assert store.manifest("same", int(iteration), stage) is None
    focus("resume", "same", "--store", str(killed_root), cwd=tmp_path)
    info = store.run_info("same")
    assert info["status"] == "finished"
    # Wall seconds add up over the processes that worked on the run, as the iterations' walls do.
    assert info["wall_s"] >= sum(info["iteration_wall_s"].values()) > 0

    reference = ArtifactStore(reference_root)
    for table in TABLES:
        assert comparable(table_rows(store, "same", table)) == comparable(table_rows(reference, "same", table)), table


def test_bad_input_fails_clearly_and_commits_nothing(tmp_path):
    runs = tmp_path / "runs"
    out = focus("train", "--set", "ppo.learning_rate=1", "--store", str(runs), cwd=tmp_path, check=False)
    assert out.returncode == 2 and "ppo.learning_rate" in out.stderr and "valid keys" in out.stderr
    out = focus("train", "--set", "model.source=/no/such/model", "--store", str(runs), cwd=tmp_path, check=False)
    assert out.returncode != 0 and "/no/such/model" in out.stderr
    out = focus("train", "--store", "s3://focus/runs", cwd=tmp_path, check=False,
                env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"})
    assert out.returncode == 2 and "cannot reach S3 endpoint" in out.stderr
    out = focus("resume", "nope", "--store", str(runs), cwd=tmp_path, check=False)
    assert out.returncode == 2 and "no run 'nope'" in out.stderr
    # Every problem was caught before the run started: no run record, no manifest.
    assert not runs.exists() or ArtifactStore(runs).list_runs() == []


def test_corrupt_part_is_detected_on_resume(tmp_path):
    config = write_config(tmp_path, method="grpo")
    focus("train", "--config", str(config), "--store", str(tmp_path / "runs"), "--run-id", "c", cwd=tmp_path,
          env={"FOCUS_KILL_AT": "0:advantage"}, check=False)
    store = ArtifactStore(tmp_path / "runs")
    part = next((tmp_path / "runs" / "c" / "iteration=0000" / "rollout" / "rollouts").glob("part-*.parquet"))
    part.write_bytes(part.read_bytes()[:100])
    out = focus("resume", "c", "--store", str(tmp_path / "runs"), cwd=tmp_path, check=False)
    assert out.returncode == 2 and "part-" in out.stderr
    # The update, the first stage that reads the rollout turns, refused them and committed nothing.
    assert store.manifest("c", 0, "update") is None
    assert pc.sum(store.read_table("c", 0, "evaluate", "evaluation").column("n_turns")).as_py() > 0


# --- every method at one budget, from one start ------------------------------------------------------

METHODS = ["focus", "grpo", "dr_grpo", "rloo", "ppo_gae", "vineppo", "focus_nobranch"]


@pytest.fixture(scope="module")
def shared_start(tmp_path_factory, prefect_server):
    """One store with a 2-iteration FOCUS run whose bootstrap every other method starts from (--init)."""
    root = tmp_path_factory.mktemp("methods")
    config = write_config(root, "focus", iterations=2, prompts=12)
    focus("train", "--config", str(config), "--store", str(root / "runs"), "--run-id", "focus", cwd=root,
          env=prefect_server.env)
    return root


def _bootstrap_weights(store: ArtifactStore, run_id: str) -> bytes:
    folder = store.fetch_folder(run_id, 0, "bootstrap", "policy")
    return b"".join(path.read_bytes() for path in sorted(folder.glob("*")))


@pytest.mark.parametrize("method", METHODS)
def test_every_method_spends_the_same_budget_from_the_same_start(shared_start, method):
    root, store = shared_start, ArtifactStore(shared_start / "runs")
    if method != "focus":
        config = write_config(root, method, iterations=2, prompts=12)
        focus("train", "--config", str(config), "--init", "focus", "--store", str(root / "runs"), "--run-id", method,
              cwd=root)
    assert store.run_info(method)["status"] == "finished"
    # One start: byte-identical bootstrap weights and the same measured B_tok.
    assert _bootstrap_weights(store, method) == _bootstrap_weights(store, "focus")
    budget = store.manifest("focus", 0, "bootstrap").figures["budget_tokens"]
    assert store.manifest(method, 0, "bootstrap").figures["budget_tokens"] == budget
    ledger, episodes = table_rows(store, method, "budget_ledger"), table_rows(store, method, "episodes")
    for iteration in (0, 1):
        spent = sum(r["tokens"] for r in ledger if r["iteration"] == iteration)
        assert {r["budget"] for r in ledger if r["iteration"] == iteration} == {budget}
        # The ledger counts every generated token of the committed episodes, main and continuations, once.
        assert spent == sum(e["generated_tokens"] for e in episodes if e["iteration"] == iteration)
        assert 0.9 * budget <= spent <= budget, (method, iteration, spent, budget)
        main = [e for e in episodes if e["iteration"] == iteration and not e["is_branch"]]
        assert not any(e["budget_cut"] for e in main), "a main episode was cut by the budget"
    # The optimizer's state travels with the checkpoint (it continues across iterations).
    folder = store.fetch_folder(method, 1, "update", "policy")
    assert (folder / "optimizer.safetensors").is_file() and (folder / "optimizer.json").is_file()
    if method == "ppo_gae":
        assert (folder / "value_head.safetensors").is_file()
        assert table_rows(store, method, "token_advantages")
        assert all(row["value_loss"] is not None for row in table_rows(store, method, "updates"))
    if method == "focus_nobranch":  # the critic fits on the main rollouts' returns alone, GRPO's whole groups
        assert not any(e["is_branch"] for e in episodes)
        assert store.manifest(method, 1, "acquire_r0").skipped
        fit = store.manifest(method, 1, "fit_critic_r0").figures
        assert fit["branched_states"] == 0 and fit["returns"] == 0 and fit["states"] > 0
        groups = {}
        for e in episodes:
            groups.setdefault((e["iteration"], e["group_id"]), []).append(e)
        assert {len(g) for g in groups.values()} == {4}  # group_size_grpo
        assert all(r["critic_mean"] is not None for r in table_rows(store, method, "values")
                   if r["iteration"] == 1)


def test_a_committed_update_replays_exactly_and_with_overrides(shared_start):
    """bench/replay_update.py: FOCUS's iteration-1 update again on its committed inputs (its continuations train
    too) gives the committed figures exactly; with ``ppo.target_kl`` below any KL it stops on its second step."""
    from bench.replay_update import replay

    store = ArtifactStore(shared_start / "runs")
    committed = store.manifest("focus", 1, "update").figures
    again = replay(store, "focus", 1)
    assert committed["policy_tokens_continuations"] > 0
    for name in ("approx_kl", "clip_fraction", "steps"):
        assert again[name] == committed[name], name
    assert again["kl_stop_step"] is None and len(again["kls_before"]) == committed["steps"]
    stopped = replay(store, "focus", 1, ["ppo.target_kl=1e-9"])
    assert stopped["kl_stop_step"] == 1 and stopped["steps"] == 2  # on-policy before step 0, off it before step 1
    with pytest.raises(SystemExit, match="no committed update at iteration 5"):
        replay(store, "focus", 5)


def test_init_from_a_missing_run_fails_in_one_line(tmp_path):
    out = focus("train", "--init", "nope", "--store", str(tmp_path / "runs"), cwd=tmp_path, check=False)
    assert out.returncode == 2 and "--init nope: no committed bootstrap of run 'nope'" in out.stderr
