"""An S3 server that goes away in the middle of a run and comes back (a full disk and a permission error on
the store are in tests/test_artifacts.py: they cannot be provoked without privileges, so they are injected).

Real: a SeaweedFS server of its own is stopped while `focus train` runs on it and restarted on the same port
and data 25 s later. The stage that met the outage is retried by Prefect (only that error is retried) from its
inputs' manifests, and the run's tables equal those of an undisturbed run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from focus_core.artifacts import ArtifactStore
from infra.services import start_s3
from tests.test_pipeline import TABLES, comparable, focus, table_rows, write_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("on_prefect_server")]  # tests/conftest.py: why


def test_an_s3_outage_mid_run_is_retried_and_the_tables_equal_an_undisturbed_run(tmp_path, monkeypatch):
    config = write_config(tmp_path, iterations=1)
    focus("train", "--config", str(config), "--store", str(tmp_path / "calm"), "--run-id", "same", cwd=tmp_path)

    service = start_s3(tmp_path / "s3")
    port = int(service.env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    aws = {key: value for key, value in service.env.items() if key.startswith("AWS_")}
    for key, value in aws.items():
        monkeypatch.setenv(key, value)
    environ = {**os.environ, **aws, "PREFECT_HOME": str(tmp_path / ".prefect"), "OMP_NUM_THREADS": "1",
               "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlruns.db'}"}
    environ.pop("FOCUS_KILL_AT", None)
    log = tmp_path / "stormy.txt"
    child = subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "--config", str(config), "--store",
                              "s3://focus/stormy", "--run-id", "same"], cwd=tmp_path, env=environ, text=True,
                             stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        store = ArtifactStore("s3://focus/stormy")
        deadline = time.monotonic() + 600
        while store.manifest("same", 0, "evaluate") is None:  # bootstrap done, the iteration under way
            assert child.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        service.stop()
        time.sleep(25)  # longer than botocore's own retries: the stage in flight fails and Prefect retries it
        service = start_s3(tmp_path / "s3", port=port)
        assert child.wait(timeout=900) == 0, log.read_text()[-4000:]
        text = log.read_text()
        assert "the store did not answer" in text and "Prefect retries the stage" in text, text[-4000:]
        assert "Traceback" not in text
        stormy, calm = ArtifactStore("s3://focus/stormy"), ArtifactStore(tmp_path / "calm")
        assert stormy.run_info("same")["status"] == "finished"
        for table in TABLES:
            assert comparable(table_rows(stormy, "same", table)) == comparable(table_rows(calm, "same", table)), table
    finally:
        if child.poll() is None:
            child.kill()
        service.stop()
