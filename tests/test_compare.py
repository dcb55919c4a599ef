"""`focus compare` and `focus report` on a 2 envs × 2 methods × 1 seed grid of one-iteration trap runs: the runs of
an (env, seed) share one bootstrap, a comparison killed halfway resumes without recomputing its finished runs, and
the report's numbers are a recomputation from the runs' evaluation tables."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest

from focus_core.artifacts import ArtifactStore
from focus_core.config import ConfigError
from tests.test_pipeline import focus
from tests.test_trap_pipeline import TRAP_CONFIG

SPEC = """
name: tiny
envs: {{combination_lock: {lock}, lookup_chain: {chain}}}
methods:
  focus: []
  grpo: [method=grpo, acquisition=null, critic=null]
seeds: [5]
"""


def _spec(tmp_path: Path) -> Path:
    for env in ("combination_lock", "lookup_chain"):
        (tmp_path / f"{env}.yaml").write_text(TRAP_CONFIG.format(env=env))
    spec = tmp_path / "tiny.yaml"
    spec.write_text(SPEC.format(lock=tmp_path / "combination_lock.yaml", chain=tmp_path / "lookup_chain.yaml"))
    return spec


# Stage lines ("[it N] rollout") in the Prefect logs of each flow, logged since argv[1] (the test's start: the
# server is this pytest process's, whose earlier tests logged there too).
PREFECT_LOGS_BY_FLOW = """
import json, sys
from datetime import datetime
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterTimestamp
since = LogFilter(timestamp=LogFilterTimestamp(after_=datetime.fromisoformat(sys.argv[1])))
with get_client(sync_client=True) as client:
    logs, more = [], True
    while more:
        more = client.read_logs(log_filter=since, limit=200, offset=len(logs))
        logs += more
    ids = sorted({log.flow_run_id for log in logs if log.flow_run_id})
    flows = {f.id: f.name for f in client.read_flows()}
    runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids)), limit=200)
    flow_of = {r.id: flows[r.flow_id] for r in runs}
    stage = [flow_of.get(log.flow_run_id) for log in logs if "] rollout" in log.message]
    print(json.dumps({name: stage.count(name) for name in ("focus-train", "focus-compare")}))
"""


def _environ(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "PREFECT_HOME": str(tmp_path / ".prefect"), "OMP_NUM_THREADS": "1",
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}


@pytest.mark.slow
@pytest.mark.usefixtures("on_prefect_server")  # tests/conftest.py: the compare and its Dask workers share one server
def test_compare_shares_bootstraps_resumes_after_a_kill_and_reports_what_the_tables_say(tmp_path):
    started = datetime.now(UTC).isoformat()
    spec, root = _spec(tmp_path), tmp_path / "runs"
    store = ArtifactStore(root)
    runs = [f"tiny-{env}-{method}-s5" for env in ("combination_lock", "lookup_chain") for method in ("focus", "grpo")]
    # Kill the whole comparison (its Dask workers and their runs too) once its first run has finished.
    child = subprocess.Popen([sys.executable, "-m", "flows.cli", "compare", str(spec), "--store", str(root),
                              "--workers", "2"], cwd=tmp_path, env=_environ(tmp_path), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 900
        while time.time() < deadline and child.poll() is None:
            if any((store.run_info(r) or {}).get("status") == "finished" for r in runs):
                break
            time.sleep(1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    finished = [r for r in runs if (store.run_info(r) or {}).get("status") == "finished"]
    assert finished, "no run finished before the kill"
    before = {r: {(i, s): m.created_at for i, s, m in store.committed(r)} for r in runs}

    resumed = focus("compare", str(spec), "--store", str(root), "--workers", "2", cwd=tmp_path)
    assert all(store.run_info(r)["status"] == "finished" for r in runs)
    # Its terminal: every stage line names its run, no worker's progress bar draws, no closing kill is reported.
    stage_lines = [line for line in resumed.stderr.splitlines() if "[it " in line]
    assert stage_lines and all(any(f"{r} [it " in line for r in runs) for line in stage_lines)
    assert not [line for line in stage_lines if not re.match(r"\d\d:\d\d:\d\d \S+ \[it ", line)]  # the CLI's format
    assert "episode/s" not in resumed.stderr and "still alive" not in resumed.stderr
    # The workers' lines print in the CLI's process (above its bar); in Prefect each is in its own run's logs only.
    logs = subprocess.run([sys.executable, "-c", PREFECT_LOGS_BY_FLOW, started], env=_environ(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert logs.returncode == 0, logs.stderr
    by_flow = json.loads(logs.stdout)
    assert by_flow["focus-train"] and not by_flow["focus-compare"]
    for r in finished:  # not recomputed: every manifest is the one committed before the kill
        assert {(i, s): m.created_at for i, s, m in store.committed(r)} == before[r]
    for env in ("combination_lock", "lookup_chain"):  # one bootstrap per (env, seed), byte for byte shared
        first, other = (store.manifest(f"tiny-{env}-{m}-s5", 0, "bootstrap") for m in ("focus", "grpo"))
        assert other.figures["budget_tokens"] == first.figures["budget_tokens"]
        assert [f.sha256 for f in other.files["policy"]] == [f.sha256 for f in first.files["policy"]]
        assert store.run_info(f"tiny-{env}-grpo-s5")["config"]["bootstrap"]["init_from"] == f"tiny-{env}-focus-s5"

    out = tmp_path / "report"
    focus("report", "tiny", "--store", str(root), "--out", str(out), cwd=tmp_path)
    report = json.loads((out / "tiny.json").read_text())
    for row in report["summary"]["table"]:
        rid = f"tiny-{row['env']}-{row['method']}-s5"
        evaluation = store.read_table(rid, 1, "evaluate", "evaluation").to_pylist()
        per_task: dict[str, list[float]] = {}
        for e in evaluation:
            per_task.setdefault(e["task_id"], []).append(e["exact_value"])
        assert row["final"] == pytest.approx(np.mean([np.mean(v) for v in per_task.values()]))
        # The spend of every iteration, from the ledgers: the matched budget, visible.
        ledgers = sum(sum(store.read_table(rid, i, stage, "budget_ledger").column("tokens").to_pylist())
                      for i, stage, m in store.committed(rid) if "budget_ledger" in m.tables)
        spend = [r for r in report["spend"] if (r["env"], r["method"]) == (row["env"], row["method"])]
        assert [r["iteration"] for r in spend] == [0]
        assert sum(r["tokens_main"] + r["tokens_branch"] + r["tokens_summary"] for r in spend) == ledgers > 0
    versus = {v["env"]: v for v in report["summary"]["focus_vs_best"]}
    assert set(versus) == {"combination_lock", "lookup_chain"} and all(v["best_baseline"] == "grpo"
                                                                        for v in versus.values())
    assert (out / "tiny_curves.png").stat().st_size > 0 and "FOCUS − best baseline" in (out / "tiny.md").read_text()
    # The JSON alone makes the same report.
    again = tmp_path / "again"
    focus("report", "--from-json", str(out / "tiny.json"), "--out", str(again), cwd=tmp_path)
    assert json.loads((again / "tiny.json").read_text())["summary"] == report["summary"]
    # MLflow: the comparison is a parent run, every training run its child.
    import mlflow

    from flows.tracking import first_use

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    with first_use(uri):  # as the product opens a store: without SQLAlchemy's notices about MLflow's own code
        client = mlflow.MlflowClient(uri)
        experiment = client.get_experiment_by_name("focus").experiment_id
    parent = client.search_runs([experiment], filter_string="tags.`focus.compare` = 'tiny'")
    children = client.search_runs([experiment], filter_string="tags.`focus.run_id` LIKE 'tiny-%'")
    assert len(parent) == 1 and len(children) == 4
    assert {c.data.tags.get("mlflow.parentRunId") for c in children} == {parent[0].info.run_id}
    # DuckDB over every run of the grid, with run_meta to group by method.
    sql = focus("sql", "--compare", "tiny", "--store", str(root), "--query",
                "SELECT m.method, count(*) AS n FROM evaluation e JOIN run_meta m USING (run_id) GROUP BY 1 ORDER BY 1",
                cwd=tmp_path)
    assert "focus" in sql.stdout and "grpo" in sql.stdout


BROKEN_ROW = "broken: [env.options.hops=9]"  # passes the config check; the trap has relations for 5 hops at most


@pytest.mark.slow
@pytest.mark.usefixtures("on_prefect_server")
def test_a_failed_run_leaves_the_rest_of_the_grid_running_and_is_named_in_one_line(tmp_path):
    """A run that fails ends in its own error, and the other runs of the grid finish (one run's failure stopped the
    whole grid, its Dask workers and their runs with it). `focus compare` then exits 1 with one line naming the
    failed run; a rerun skips the finished runs and retries the failed one. When the failing row is the one that
    trains the (env, seed)'s bootstrap, the runs that start from it fail too, and none waits for ever."""
    (tmp_path / "lookup_chain.yaml").write_text(TRAP_CONFIG.format(env="lookup_chain"))
    root, store = tmp_path / "runs", ArtifactStore(tmp_path / "runs")
    grpo = "grpo: [method=grpo, acquisition=null, critic=null]"
    for name, rows in (("later", [grpo, BROKEN_ROW]), ("first", [BROKEN_ROW, grpo])):
        spec = tmp_path / f"{name}.yaml"
        spec.write_text(f"name: {name}\nenvs: {{lookup_chain: {tmp_path / 'lookup_chain.yaml'}}}\nmethods:\n"
                        + "".join(f"  {row}\n" for row in rows) + "seeds: [5]\n")
        done = focus("compare", str(spec), "--store", str(root), "--workers", "2", cwd=tmp_path, check=False)
        assert done.returncode == 1, done.stderr[-3000:]
        last = done.stderr.strip().splitlines()[-1]
        failed = [f"{name}-lookup_chain-broken-s5"] + ([f"{name}-lookup_chain-grpo-s5"] if name == "first" else [])
        assert last.startswith(f"focus compare: {len(failed)} of 2 runs of comparison {name} failed: ")
        assert all(run in last for run in failed)
        # Its own words: the broken row's start fails on the option; a run started from another start refuses it.
        assert ("hops must be in [2, 5], got 9" if name == "first" else "bootstrapped with other env.options") in last
        assert "Traceback" not in last
        record = json.loads((root / "_compare" / f"{name}.json").read_text())
        assert record["status"] == "failed"
        assert {r["run_id"] for r in record["results"] if r["status"] == "failed"} == set(failed)
    assert store.run_info("later-lookup_chain-grpo-s5")["status"] == "finished"
    finished = {(i, s): m.created_at for i, s, m in store.committed("later-lookup_chain-grpo-s5")}
    # The rerun: the finished run is skipped (not recomputed), the failed one is tried again and fails again.
    again = focus("compare", str(tmp_path / "later.yaml"), "--store", str(root), "--workers", "2", cwd=tmp_path,
                  check=False)
    assert again.returncode == 1 and "later-lookup_chain-grpo-s5 already finished" in again.stderr
    assert {(i, s): m.created_at for i, s, m in store.committed("later-lookup_chain-grpo-s5")} == finished


@pytest.mark.slow
@pytest.mark.usefixtures("on_prefect_server")
def test_compare_on_an_existing_dask_cluster_prints_its_workers_lines_and_leaves_the_workers_as_they_were(tmp_path):
    """``--dask ADDRESS``: a cluster the comparison does not own. Its workers' stage lines print in the CLI's
    process (its workers' own stderr is another machine's in practice), and after the comparison they log as before
    (the forwarding ends with it)."""
    import logging

    from distributed import Client, LocalCluster

    spec, root = _spec(tmp_path), tmp_path / "runs"
    worker_env = {key: value for key, value in _environ(tmp_path).items()
                  if key in ("PREFECT_HOME", "PREFECT_API_URL", "OMP_NUM_THREADS", "MLFLOW_TRACKING_URI")}
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                      scheduler_kwargs={"dashboard_address": "127.0.0.1:0"}, env=worker_env) as cluster, \
            Client(cluster) as client:
        done = focus("compare", str(spec), "--store", str(root), "--dask", cluster.scheduler_address,
                     "--env", "combination_lock", cwd=tmp_path)
        propagates = client.run(lambda: logging.getLogger("focus").propagate)
    store = ArtifactStore(root)
    runs = [f"tiny-combination_lock-{method}-s5" for method in ("focus", "grpo")]
    assert all(store.run_info(r)["status"] == "finished" for r in runs)
    for r in runs:
        assert re.search(rf"^\d\d:\d\d:\d\d {r} \[it 0\] update ", done.stderr, re.MULTILINE), done.stderr
    assert list(propagates.values()) == [True]


def test_a_spec_with_a_bad_run_config_fails_before_anything_runs(tmp_path):
    from flows.compare import load_spec

    spec = _spec(tmp_path)
    spec.write_text(spec.read_text().replace("grpo: [method=grpo, acquisition=null, critic=null]",
                                             "grpo: [method=grpo]"))
    with pytest.raises(ConfigError, match="(?s)run tiny-combination_lock-grpo-s5: .*acquisition"):
        load_spec(spec)
    spec.write_text("name: x\nenvs: {}\n")
    with pytest.raises(ConfigError, match="compare spec .*envs"):
        load_spec(spec)


def test_an_existing_run_with_other_settings_is_refused(tmp_path):
    from flows.compare import check_existing, load_spec

    spec = load_spec(_spec(tmp_path))
    store = ArtifactStore(tmp_path / "runs")
    store.write_run_info("tiny-combination_lock-focus-s5", {"status": "finished", "config": {"method": "grpo"}})
    with pytest.raises(ConfigError, match="tiny-combination_lock-focus-s5 exists .* other settings"):
        check_existing(store, spec.runs())


def test_a_grid_runs_part_by_part_one_environment_at_a_time(tmp_path):
    from flows.compare import load_spec, run_compare

    spec = load_spec(_spec(tmp_path))
    part = spec.runs(["lookup_chain"])
    assert {r["env"] for r in part} == {"lookup_chain"} and part == [r for r in spec.runs() if r in part]
    assert len(part) == 2 and part[1]["init_from"] == part[0]["run_id"]  # the part keeps its shared bootstrap
    with pytest.raises(ConfigError, match="no environment legal in it .*fix: one of combination_lock, lookup_chain"):
        run_compare(_spec(tmp_path), store=str(tmp_path / "runs"), envs=["legal"])


def test_a_report_keeps_the_finished_runs_of_an_earlier_part_that_the_store_lacks():
    from flows.report import merge, summarise

    full = json.loads((Path(__file__).resolve().parents[1] / "docs/results/traps/traps.json").read_text())
    full.pop("summary")
    # This session's store holds the lock's part; the chain's runs ran in an earlier session, now gone.
    part = {**full, "runs": [r if r["env"] == "combination_lock" else {**r, "status": "missing"} for r in full["runs"]],
            "iterations": [r for r in full["iterations"] if r["env"] == "combination_lock"],
            "tasks": [r for r in full["tasks"] if r["env"] == "combination_lock"]}
    merged = merge(part, full)
    assert merged["runs"] == full["runs"]
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    assert sorted(map(key, merged["iterations"])) == sorted(map(key, full["iterations"]))
    assert sorted(map(key, merged["tasks"])) == sorted(map(key, full["tasks"]))
    assert summarise(merged) == summarise(full)
    assert merge(full, part) == full  # a run finished in the store is the store's
    with pytest.raises(ValueError, match="comparison 'other', not 'traps'"):
        merge(full, {**full, "name": "other"})


def test_the_readme_headline_tables_are_the_ones_their_committed_json_makes(tmp_path):
    import re

    from flows.report import readme_block, summarise, update_readme

    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    for path in pages:
        page = path.relative_to(root).as_posix()
        text = path.read_text()
        blocks = re.findall(r"<!-- focus report (\S+): made by `focus report --from-json (\S+) --readme (\S+)` -->"
                            r".*?<!-- end focus report \1 -->", text, flags=re.S)
        if page == "README.md":
            assert blocks, "the README shows no comparison made by focus report"
        for name, source, named_page in blocks:
            assert named_page == page, f"{page}'s {name} block names the page {named_page} (fix: --readme {page})"
            data = json.loads((root / source).read_text())
            data.pop("summary", None)
            expected = readme_block(name, source, summarise(data), page)
            assert expected in text, f"{page}'s {name} table is stale (fix: focus report --from-json {source} " \
                                     f"--readme {page})"

    # The update replaces only its own block, and a file without one is refused in one line.
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- focus report x: old -->\nold table\n<!-- end focus report x -->\nafter\n")
    summary = {"table": [], "focus_vs_best": []}
    update_readme(page, "x", "x.json", summary)
    assert page.read_text() == f"before\n{readme_block('x', 'x.json', summary, page.as_posix())}\nafter\n"
    with pytest.raises(ValueError, match="no block for comparison 'y'"):
        update_readme(page, "y", "y.json", summary)


def test_the_report_pairs_every_focus_ablation_with_focus_and_with_the_best_baseline():
    from flows.report import markdown, summarise

    data = json.loads((Path(__file__).resolve().parents[1] / "docs/results/traps/traps.json").read_text())
    data.pop("summary")
    # A made-up ablation row: FOCUS's own runs with every final held-out value 0.1 higher.
    shifted = [{**r, "method": "focus_shifted", "value": r["value"] + 0.1}
               for r in data["tasks"] if r["method"] == "focus"]
    data = {**data, "tasks": data["tasks"] + shifted,
            "runs": data["runs"] + [{**r, "method": "focus_shifted"} for r in data["runs"] if r["method"] == "focus"],
            "iterations": data["iterations"] + [{**r, "method": "focus_shifted"} for r in data["iterations"]
                                                if r["method"] == "focus"]}
    summary = summarise(data)
    rows = {(a["env"], a["method"], a["versus"]): a for a in summary["ablations"]}
    best = {v["env"]: v for v in summary["focus_vs_best"]}
    for env in ("combination_lock", "lookup_chain"):
        versus_focus = rows[(env, "focus_shifted", "focus")]
        assert (versus_focus["difference"], versus_focus["low"], versus_focus["high"]) == pytest.approx((0.1,) * 3)
        versus_best = rows[(env, "focus_shifted", best[env]["best_baseline"])]
        assert versus_best["difference"] == pytest.approx(best[env]["focus_minus_best"] + 0.1)
        assert (env, "grpo", "focus") not in rows  # baselines are not ablations
    assert "| lookup_chain | focus_shifted | focus | +0.100 (+0.100 to +0.100) * | +0.100 to +0.100 † |" in markdown(
        data, summary, [])


def test_a_method_that_ablates_focus_is_an_ablation_row_not_a_baseline():
    """focus_nobranch is FOCUS without its continuations: however well it does, the report lists it with FOCUS's
    ablations and picks the best baseline among the other methods."""
    from flows.report import summarise

    data = json.loads((Path(__file__).resolve().parents[1] / "docs/results/traps/traps.json").read_text())
    data.pop("summary")
    best_before = {v["env"]: v["best_baseline"] for v in summarise(data)["focus_vs_best"]}
    # FOCUS's runs relabelled as a focus_nobranch row, every final held-out value 0.5 higher: the best row of all.
    data = {**data,
            "tasks": data["tasks"] + [{**r, "method": "nobranch", "value": r["value"] + 0.5}
                                      for r in data["tasks"] if r["method"] == "focus"],
            "runs": data["runs"] + [{**r, "method": "nobranch", "base_method": "focus_nobranch"}
                                    for r in data["runs"] if r["method"] == "focus"],
            "iterations": data["iterations"] + [{**r, "method": "nobranch"} for r in data["iterations"]
                                                if r["method"] == "focus"]}
    summary = summarise(data)
    assert {v["env"]: v["best_baseline"] for v in summary["focus_vs_best"]} == best_before
    rows = {(a["env"], a["method"], a["versus"]) for a in summary["ablations"]}
    for env, best in best_before.items():
        assert {(env, "nobranch", "focus"), (env, "nobranch", best)} <= rows


def test_the_critic_diagnostics_show_the_exact_value_error_of_a_critic_that_never_branched():
    from flows.report import markdown, summarise

    data = json.loads((Path(__file__).resolve().parents[1] / "docs/results/traps/traps.json").read_text())
    data.pop("summary")
    # focus_nobranch with exact_values: V̂'s error against V^π, and no error before continuations (it has none).
    nobranch = [{key: value for key, value in r.items() if key not in ("critic_error_before", "score_error_spearman")}
                | {"method": "nobranch", "estimated_value_error": 0.25} for r in data["iterations"]
                if r["method"] == "focus"]
    data = {**data, "iterations": data["iterations"] + nobranch,
            "runs": data["runs"] + [{**r, "method": "nobranch", "base_method": "focus_nobranch"}
                                    for r in data["runs"] if r["method"] == "focus"],
            "tasks": data["tasks"] + [{**r, "method": "nobranch"} for r in data["tasks"] if r["method"] == "focus"]}
    assert "| lookup_chain | nobranch | – | – | 0.250 |" in markdown(data, summarise(data), [])


def test_the_t_interval_over_seeds_takes_each_seeds_mean_difference_as_one_value():
    from flows.report import paired_seed_t

    # Per-seed mean differences 0, +0.5, -0.5 (a task only one side has is left out): mean 0, sd 0.5, so the half
    # width is t(0.975, df 2) * 0.5 / sqrt(3) = 4.302653 * 0.288675 = 1.242069.
    a = {(1, "x"): 1.0, (1, "y"): 0.0, (2, "x"): 1.0, (2, "y"): 1.0, (3, "x"): 0.0, (3, "y"): 0.0, (3, "z"): 1.0}
    b = {key: 0.5 for key in a if key != (3, "z")}
    assert paired_seed_t(a, b) == pytest.approx((-1.242069, 1.242069), abs=1e-6)
    assert all(np.isnan(paired_seed_t({(1, "x"): 1.0}, {(1, "x"): 0.0})))  # one seed: no interval


def test_the_curves_of_a_grid_still_running_plot_without_warnings(tmp_path):
    """A run in flight has iterations whose held-out evaluation has not come yet: their points are left out of the
    curves, not averaged as empty columns (numpy's 'Mean of empty slice' on every interim report)."""
    import warnings

    from flows.report import plots, summarise

    data = json.loads((Path(__file__).resolve().parents[1] / "docs/results/traps/traps.json").read_text())
    data.pop("summary")
    summary = summarise(data)
    last = max(r["iteration"] for r in data["iterations"])
    data["iterations"] = [{**r, summary["value"]: None} if r["method"] == "grpo" and r["iteration"] == last else r
                          for r in data["iterations"]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        written = plots(data, summary, tmp_path)
    assert [Path(p).name for p in written] == ["traps_curves.png", "traps_tokens.png"]


def test_local_clusters_started_side_by_side_do_not_contend_for_one_port(recwarn):
    """A Dask scheduler serves HTTP (health, metrics) even without a dashboard, on port 8787 unless told otherwise:
    two comparisons at once (or two test workers) warned "Port 8787 is already in use". Each takes a free port."""
    from distributed import LocalCluster

    from flows.compare import local_cluster

    kwargs = {**local_cluster(1).cluster_kwargs, "n_workers": 0}
    with LocalCluster(**kwargs) as first, LocalCluster(**kwargs) as second:
        ports = {cluster.scheduler.http_server.port for cluster in (first, second)}
    assert len(ports) == 2 and 8787 not in ports
    assert not [w for w in recwarn if "already in use" in str(w.message)]
