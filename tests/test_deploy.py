"""`focus serve` and `focus deploy --pool` against a real Prefect server, and runs started the way the Prefect UI
starts one.

The UI creates a flow run of a deployment over the server's REST API
(``POST /api/deployments/{id}/create_flow_run``) and the serving process picks it up; this test
does exactly that with a one-iteration GRPO config and checks the run committed and finished.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from focus_core.artifacts import ArtifactStore
from infra.services import focus_serve, wait_for
from infra.services import prefect_api as api
from tests.test_pipeline import write_config

pytestmark = pytest.mark.slow


def completed(base: str, flow_run_id: str) -> bool:
    state = api(base, f"/flow_runs/{flow_run_id}")["state_type"]
    assert state not in ("FAILED", "CRASHED", "CANCELLED"), state
    return state == "COMPLETED"


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process group (a server or worker shuts its flow runs down), SIGKILL after 30 s."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def test_served_deployment_runs_from_the_ui_api(tmp_path, prefect_server):
    server = prefect_server
    base = server.env["PREFECT_API_URL"]
    serving = focus_serve(server, tmp_path, str(tmp_path / "runs"))
    try:
        deployment = wait_for(lambda: api(base, "/deployments/name/focus-train/default"), 180, "the deployment")
        grid = wait_for(lambda: api(base, "/deployments/name/focus-compare/default"), 60, "the compare deployment")
        assert grid["parameters"]["store"] == str(tmp_path / "runs")
        config = write_config(tmp_path, method="grpo", iterations=1)
        form = deployment["parameter_openapi_schema"]["definitions"]["TrainSettings"]["properties"]
        assert "grpo" in form["method"]["anyOf"][0]["enum"]  # a drop-down, not a list of strings
        flow_run = api(base, f"/deployments/{deployment['id']}/create_flow_run",
                       {"parameters": {"settings": {"seed": 5, "iterations": 1}, "config_path": str(config),
                                       "run_id": "from-ui"}})
        wait_for(lambda: completed(base, flow_run["id"]), 600, "the flow run to complete")
        store = ArtifactStore(tmp_path / "runs")
        assert store.run_info("from-ui")["status"] == "finished"
        assert store.run_info("from-ui")["config"]["seed"] == 5  # the form's field reached the config
        assert store.manifest("from-ui", 1, "evaluate") is not None
        # The stage lines with their figures are in the flow run's logs (the UI's Logs tab).
        lines = wait_for(lambda: [entry["message"] for entry in api(base, "/logs/filter", {
            "logs": {"flow_run_id": {"any_": [flow_run["id"]]}}, "limit": 200})
            if "rollout" in entry["message"]], 60, "the stage lines in the flow run's logs")
        assert any(line.startswith("[it 0] rollout") and "episodes" in line for line in lines), lines
        # Beside the per-iteration tables, the learning curve, as a table and a sparkline.
        artifacts = api(base, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})
        by_key = {a["key"]: a for a in artifacts}
        assert {"iteration-0", "learning-curve", "learning-curve-line"} <= set(by_key), sorted(by_key)
        curve = json.loads(by_key["learning-curve"]["data"])
        assert [row["iteration"] for row in curve] == [0, 1] and all(0 <= r["heldout_success"] <= 1 for r in curve)
    finally:
        stop(serving)


def test_a_deployment_on_a_work_pool_runs_through_a_process_worker(tmp_path, prefect_server):
    server = prefect_server
    base = server.env["PREFECT_API_URL"]
    environ = {**os.environ, **server.env, "PREFECT_HOME": str(tmp_path / ".prefect-client"), "OMP_NUM_THREADS": "1",
               "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    worker = None
    try:
        deployed = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "--pool", "cpu-pool", "--store",
                                   str(tmp_path / "runs")], cwd=tmp_path, env=environ, capture_output=True, text=True,
                                  timeout=300)
        assert deployed.returncode == 0, deployed.stderr[-3000:]
        assert "deployment focus-train/cpu-pool on work pool cpu-pool" in deployed.stdout
        assert api(base, "/work_pools/cpu-pool")["type"] == "process"  # created, since it was missing
        worker = subprocess.Popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "cpu-pool"],
                                  cwd=tmp_path, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        deployment = api(base, "/deployments/name/focus-train/cpu-pool")
        config = write_config(tmp_path, method="grpo", iterations=1)
        flow_run = api(base, f"/deployments/{deployment['id']}/create_flow_run",
                       {"parameters": {"config_path": str(config), "run_id": "from-pool"}})
        wait_for(lambda: completed(base, flow_run["id"]), 900, "the pool's flow run to complete")
        assert api(base, f"/flow_runs/{flow_run['id']}")["work_pool_name"] == "cpu-pool"
        assert ArtifactStore(tmp_path / "runs").run_info("from-pool")["status"] == "finished"
    finally:
        if worker is not None:
            stop(worker)
