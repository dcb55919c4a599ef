"""The run lease (focus_core/lease.py): one writer per run, and a dead writer's run taken over.

On a local store and on a real S3 server (SeaweedFS): the lease is a file of the store, so both must behave
the same. The end-to-end cases (a second `focus resume` refused, `kill -9` then resume) are in
tests/test_concurrency.py.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest

from focus_core.artifacts import ArtifactStore
from focus_core.lease import LEASE_NAME, Lease, LeaseHeld, current_holder, hold, refuse_if_held, ttl_from_env


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return ArtifactStore(tmp_path / "runs")
    root = request.getfixturevalue("s3_store_root")
    return ArtifactStore(f"{root}/lease-{request.node.name.replace('[', '-').rstrip(']')}-{time.time_ns()}")


def plant(store: ArtifactStore, run_id: str, owner: str, expires_in: float) -> None:
    now = time.time()
    store.write_run_file(run_id, LEASE_NAME, json.dumps(
        {"owner": owner, "token": "theirs", "heartbeat_at": now, "expires_at": now + expires_in}))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid  # exited and reaped: no process has this id (until the kernel reuses it, much later)


def test_a_held_run_refuses_a_second_holder_and_is_free_after_release(store):
    with hold(store, "r1", ttl_s=30) as lease:
        assert current_holder(store, "r1").token == lease.token
        with pytest.raises(LeaseHeld, match=r"run r1 is being written by .+:\d+ .*fix: wait"), hold(store, "r1", 30):
            pass
    assert store.read_run_file("r1", LEASE_NAME) is None
    with hold(store, "r1", ttl_s=30):  # free again
        pass


def test_a_live_lease_of_another_host_is_refused_and_an_expired_one_taken_over(store):
    plant(store, "r2", "elsewhere:12345", expires_in=60)
    with pytest.raises(LeaseHeld, match="elsewhere:12345"):
        refuse_if_held(store, "r2")
    plant(store, "r2", "elsewhere:12345", expires_in=-1)
    with hold(store, "r2", ttl_s=30) as lease:
        assert current_holder(store, "r2").owner == lease.owner


def test_a_dead_process_on_this_host_loses_its_lease_at_once(store):
    import socket

    plant(store, "r3", f"{socket.gethostname()}:{dead_pid()}", expires_in=600)
    refuse_if_held(store, "r3")  # not raised: the holder is gone, no need to wait 600 s
    with hold(store, "r3", ttl_s=30):
        pass


def test_the_heartbeat_keeps_a_lease_alive_past_its_ttl(tmp_path):
    store = ArtifactStore(tmp_path / "runs")
    with hold(store, "r4", ttl_s=0.4) as lease:
        first = current_holder(store, "r4").expires_at
        time.sleep(1.0)  # 2.5 ttls: without renewal it would have expired
        renewed = current_holder(store, "r4")
        assert renewed.token == lease.token and renewed.expires_at > first and renewed.alive(time.time())


def test_a_lease_taken_over_behind_a_holders_back_is_noticed(tmp_path, caplog):
    store = ArtifactStore(tmp_path / "runs")
    lease = Lease(store, "r5", ttl_s=0.4)
    lease.take(settle_s=0.0)
    plant(store, "r5", "elsewhere:1", expires_in=60)
    with caplog.at_level(logging.ERROR, logger="focus"):
        time.sleep(0.5)
    lease.release()
    assert lease.lost and "taken over by elsewhere:1" in caplog.text
    assert current_holder(store, "r5").owner == "elsewhere:1"  # release leaves another's lease alone


def test_a_torn_or_foreign_lease_file_is_no_lease(tmp_path, caplog):
    store = ArtifactStore(tmp_path / "runs")
    store.write_run_file("r6", LEASE_NAME, '{"owner": "x"')
    with caplog.at_level(logging.WARNING, logger="focus"), hold(store, "r6", ttl_s=30):
        pass
    assert "unreadable lease file" in caplog.text


def test_the_ttl_setting_names_a_bad_value(monkeypatch):
    monkeypatch.setenv("FOCUS_LEASE_TTL_S", "soon")
    with pytest.raises(ValueError, match="FOCUS_LEASE_TTL_S='soon' is not a number"):
        ttl_from_env()
    monkeypatch.setenv("FOCUS_LEASE_TTL_S", "5")
    assert ttl_from_env() == 5.0
