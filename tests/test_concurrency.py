"""Runs at once on one machine, with the default stores: `focus train` × 3 from a fresh mlruns.db and one
Prefect home, and two writers of one run (the lease: a second `focus resume` refuses, a killed holder's run
is taken over). Real processes, a real sqlite MLflow store and Prefect's own ephemeral server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from focus_core.artifacts import ArtifactStore
from focus_core.lease import LEASE_NAME
from tests.test_pipeline import focus, write_config

pytestmark = pytest.mark.slow


def start(*args: str, cwd: Path, log: Path) -> subprocess.Popen:
    """`focus ARGS` in the background with the machine's default stores under cwd (./mlruns.db, ./.prefect)."""
    environ = {key: value for key, value in os.environ.items() if key not in ("FOCUS_KILL_AT", "MLFLOW_TRACKING_URI")}
    environ |= {"PREFECT_HOME": str(cwd / ".prefect"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=environ, text=True,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop(child: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def test_mlflow_first_use_by_processes_at_once_is_serialised(tmp_path):
    # Regression: two `focus train` on a fresh mlruns.db both ran MLflow's migrations and one died with
    # "duplicate column name: step". Four processes create runs on one fresh database at once.
    script = ("import sys, mlflow\nfrom flows.tracking import first_use\nwith first_use(sys.argv[1]):\n"
              "    client = mlflow.MlflowClient(sys.argv[1])\n"
              "    experiment = client.get_experiment_by_name('Default')\n"
              "client.create_run(experiment.experiment_id)\n")
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    children = [subprocess.Popen([sys.executable, "-c", script, uri], stderr=subprocess.PIPE, text=True)
                for _ in range(4)]
    errors = [child.communicate(timeout=300)[1] for child in children]
    assert [child.returncode for child in children] == [0] * 4, errors
    import mlflow

    assert len(mlflow.MlflowClient(uri).search_runs(["0"])) == 4


def test_three_runs_started_at_once_all_finish(tmp_path):
    config = write_config(tmp_path, method="grpo")
    children = [start("train", "--config", str(config), "--run-id", f"at-once-{k}", cwd=tmp_path,
                      log=tmp_path / f"log{k}.txt") for k in range(3)]
    try:
        codes = [child.wait(timeout=1200) for child in children]
    finally:
        for child in children:
            stop(child)
    logs = [(tmp_path / f"log{k}.txt").read_text() for k in range(3)]
    assert codes == [0, 0, 0], "\n\n".join(log[-3000:] for log in logs)
    tracebacks = [log[max(0, log.index("Traceback") - 1500):log.index("Traceback") + 3000]
                  for log in logs if "Traceback" in log]
    assert not tracebacks, tracebacks[0]
    store = ArtifactStore(tmp_path / "runs")
    assert all(store.run_info(f"at-once-{k}")["status"] == "finished" for k in range(3))
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    runs = client.search_runs([client.get_experiment_by_name("focus").experiment_id])
    assert sorted(r.data.tags["focus.run_id"] for r in runs) == [f"at-once-{k}" for k in range(3)]
    assert {r.info.status for r in runs} == {"FINISHED"}


@pytest.mark.usefixtures("on_prefect_server")  # three `focus` processes; the test above keeps temporary servers
def test_a_live_run_refuses_a_second_writer_and_a_killed_holders_run_resumes(tmp_path):
    config = write_config(tmp_path, method="grpo", iterations=2)
    store = ArtifactStore(tmp_path / "runs")
    holder = start("train", "--config", str(config), "--run-id", "held", cwd=tmp_path, log=tmp_path / "holder.txt")
    try:
        deadline = time.monotonic() + 600
        while store.manifest("held", 0, "bootstrap") is None:  # well inside the run, lease taken
            assert holder.poll() is None and time.monotonic() < deadline, (tmp_path / "holder.txt").read_text()
            time.sleep(0.5)
        assert store.read_run_file("held", LEASE_NAME) is not None
        second = focus("resume", "held", "--store", str(tmp_path / "runs"), cwd=tmp_path, check=False)
        assert second.returncode == 2
        message = second.stderr.strip().splitlines()
        assert len(message) == 1 and f"being written by {os.uname().nodename}:{holder.pid}" in message[0], message
        os.killpg(holder.pid, signal.SIGKILL)  # the holder dies without giving the lease back
        holder.wait()
    finally:
        stop(holder)
    assert store.read_run_file("held", LEASE_NAME) is not None
    focus("resume", "held", "--store", str(tmp_path / "runs"), cwd=tmp_path)
    assert store.run_info("held")["status"] == "finished"
    assert store.read_run_file("held", LEASE_NAME) is None  # given back


_TEMPORARY_API_PORT = """
import os, sys
if len(sys.argv) > 1:
    os.environ["PREFECT_API_URL"] = sys.argv[1]
import flows.train
from prefect.server.api.server import SubprocessASGIServer
print(SubprocessASGIServer().port)
"""


def test_each_process_gets_its_temporary_prefect_api_on_a_port_the_kernel_gives():
    """Regression: Prefect drew each process's temporary API port at random from 8000-8999, and two `focus train`
    started at once (the methods fixture on both xdist workers) drew the same one: one's flow ran on the other's
    server, and failed with "Connection refused" when that process ended. Importing the flows now registers the
    process's server on a port the kernel gives; with PREFECT_API_URL set, nothing is registered."""
    ports = [subprocess.run([sys.executable, "-c", _TEMPORARY_API_PORT], capture_output=True, text=True, check=True,
                            timeout=120).stdout.strip() for _ in range(2)]
    assert all(port.isdigit() and not 8000 <= int(port) < 9000 for port in ports), ports
    assert ports[0] != ports[1]
    given = subprocess.run([sys.executable, "-c", _TEMPORARY_API_PORT, "http://127.0.0.1:4200/api"],
                           capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    assert given == "None"  # Prefect's own behaviour when a server is configured: no temporary one
