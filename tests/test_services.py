"""infra.services: each real server starts, answers its health check and a real client, and stops completely.

"Stops completely" is checked two ways: no live process is left in the server's process group, and no
process on the machine mentions the test's private state dir in its command line or environment (which
would catch a child that escaped the group). Prefect and MLflow take 10-25 s to start on 2 cores, so each
is started once, in a test marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from infra.services import Service, _group_members, load, start_mlflow, start_prefect, start_s3


def processes_mentioning(text: str) -> list[int]:
    """PIDs of live processes whose command line or environment contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z":
                continue  # a zombie is already dead; its parent just has not collected it yet
            blobs = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if text.encode() in blobs:
            found.append(int(entry.name))
    return found


def assert_stopped(service: Service, state_dir: Path) -> None:
    assert _group_members(service.pid) == []
    assert processes_mentioning(str(state_dir)) == []
    assert not (service.directory / "service.json").exists()
    assert load(service.name, state_dir) is None


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def test_s3_serves_signed_requests_and_stops(tmp_path: Path) -> None:
    import s3fs

    service = start_s3(tmp_path)
    try:
        assert service.healthy() and load("s3", tmp_path).pid == service.pid
        env = service.env
        assert env["FOCUS_STORE"] == "s3://focus/runs" and env["AWS_ENDPOINT_URL"] == service.url
        fs = s3fs.S3FileSystem(
            key=env["AWS_ACCESS_KEY_ID"],
            secret=env["AWS_SECRET_ACCESS_KEY"],
            endpoint_url=env["AWS_ENDPOINT_URL"],
            skip_instance_cache=True,
        )
        fs.pipe_file("focus/hello.txt", b"hello")
        assert fs.cat_file("focus/hello.txt") == b"hello"
        intruder = s3fs.S3FileSystem(
            key="anyone", secret="guess", endpoint_url=env["AWS_ENDPOINT_URL"], skip_instance_cache=True
        )
        with pytest.raises(PermissionError):
            intruder.cat_file("focus/hello.txt")
        assert (tmp_path / "s3" / "credentials.json").stat().st_mode & 0o077 == 0
    finally:
        service.stop()
    assert_stopped(service, tmp_path)
    assert list(Path("/tmp").glob(f"seaweedfs-*-{service.ports['s3.port']}.sock")) == []


def test_cli_up_is_idempotent_and_down_leaves_nothing(tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "infra.services", *args, "--state-dir", str(tmp_path)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    first = cli("up", "s3")
    assert first.returncode == 0, first.stderr
    record = json.loads((tmp_path / "s3" / "service.json").read_text())
    try:
        exports = dict(line.removeprefix("export ").split("=", 1) for line in first.stdout.splitlines())
        assert set(exports) == {
            "AWS_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "FOCUS_STORE",
        }
        again = cli("up", "s3")
        assert again.returncode == 0 and again.stdout == first.stdout
        assert json.loads((tmp_path / "s3" / "service.json").read_text())["pid"] == record["pid"]
        assert cli("env", "s3").stdout == first.stdout
        status = cli("status").stdout
        assert "s3       healthy" in status and "prefect  stopped" in status and "mlflow   stopped" in status
    finally:
        down = cli("down", "all")
    assert down.returncode == 0 and "s3: stopped" in down.stderr and "mlflow: not running" in down.stderr
    assert _group_members(record["pid"]) == [] and processes_mentioning(str(tmp_path)) == []
    assert cli("env", "s3").returncode == 1


def test_start_on_a_taken_port_fails_clearly(tmp_path: Path) -> None:
    import socket

    from infra.services import ServiceError

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(ServiceError, match="port .* is in use"):
            start_s3(tmp_path, port=sock.getsockname()[1])


@pytest.mark.slow
def test_prefect_server_starts_answers_and_stops(tmp_path: Path) -> None:
    service = start_prefect(tmp_path)
    try:
        assert get(f"{service.url}/api/health") == "true"
        assert service.env == {"PREFECT_API_URL": f"{service.url}/api"}
        request = urllib.request.Request(
            f"{service.url}/api/flows/filter", data=b"{}", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert json.loads(response.read()) == []
        assert (tmp_path / "prefect" / "home").is_dir()  # its own PREFECT_HOME, not ~/.prefect
    finally:
        service.stop()
    assert_stopped(service, tmp_path)


@pytest.mark.slow
def test_mlflow_server_logs_a_run_with_an_artifact_and_stops(tmp_path: Path) -> None:
    service = start_mlflow(tmp_path)
    try:
        assert get(f"{service.url}/health") == "OK"
        # A real client in a separate process (keeps MLflow's global state out of this pytest process).
        script = (
            "import mlflow, pathlib, sys\n"
            "mlflow.set_tracking_uri(sys.argv[1])\n"
            "with mlflow.start_run() as run:\n"
            "    mlflow.log_metric('reward', 0.5, step=1)\n"
            "    path = pathlib.Path(sys.argv[2]); path.write_text('hi')\n"
            "    mlflow.log_artifact(str(path))\n"
            "print(run.info.run_id)\n"
        )
        note = tmp_path / "note.txt"
        client = subprocess.run(
            [sys.executable, "-c", script, service.env["MLFLOW_TRACKING_URI"], str(note)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"},
        )
        assert client.returncode == 0, client.stderr
        stored = list((tmp_path / "mlflow" / "artifacts").rglob("note.txt"))
        assert len(stored) == 1 and stored[0].read_text() == "hi"
        assert len(_group_members(service.pid)) <= 2  # server + one uvicorn worker, no job runner
    finally:
        service.stop()
    assert_stopped(service, tmp_path)
