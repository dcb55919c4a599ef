"""The one file lock the project's caches share (``focus_core.locks.exclusive_file_lock``)."""

from __future__ import annotations

import fcntl
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from focus_core.locks import exclusive_file_lock

# Holds the lock on argv[1], says so with the file argv[2], then sleeps argv[3] seconds and writes argv[4].
_HOLDER = """
import sys, time
from pathlib import Path
from focus_core.locks import exclusive_file_lock

with exclusive_file_lock(sys.argv[1]):
    Path(sys.argv[2]).touch()
    time.sleep(float(sys.argv[3]))
    Path(sys.argv[4]).touch()
"""


def _hold(tmp_path: Path, seconds: float) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "sub" / "x.lock"), str(tmp_path / "held"),
                               str(seconds), str(tmp_path / "released")])
    deadline = time.monotonic() + 60
    while not (tmp_path / "held").exists():
        assert holder.poll() is None and time.monotonic() < deadline, "the holder never took the lock"
        time.sleep(0.01)
    return holder


def test_a_second_process_waits_until_the_holder_releases(tmp_path):
    holder = _hold(tmp_path, 1.0)
    with exclusive_file_lock(tmp_path / "sub" / "x.lock") as locked:
        assert locked and (tmp_path / "released").exists()  # it got the lock only after the holder's block ended
    assert holder.wait(timeout=60) == 0


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = _hold(tmp_path, 600)
    try:
        with open(tmp_path / "sub" / "x.lock") as probe:
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held now
            holder.send_signal(signal.SIGKILL)
            holder.wait(timeout=60)
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free at once: the kernel released it with the process
    finally:
        holder.kill()  # a failed assertion above leaves no holder sleeping for 10 minutes
    assert not (tmp_path / "released").exists()


def test_where_no_lock_file_can_be_made_it_raises_or_runs_unlocked(tmp_path):
    (tmp_path / "file").write_text("a file where the lock's folder should be")
    with pytest.raises(OSError), exclusive_file_lock(tmp_path / "file" / "x.lock"):
        pass
    with exclusive_file_lock(tmp_path / "file" / "x.lock", required=False) as locked:
        assert locked is False
    with pytest.raises(RuntimeError) as raised, exclusive_file_lock(tmp_path / "file" / "x.lock", required=False):
        raise RuntimeError("the block's own error")
    assert raised.value.__context__ is None  # not 'raised while handling' the OSError of the lock file


def test_opening_the_lock_never_truncates_it(tmp_path):
    lock = tmp_path / "x.lock"
    lock.write_text("a note someone left")
    with exclusive_file_lock(lock):
        pass
    assert lock.read_text() == "a note someone left"
