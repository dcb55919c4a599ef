"""The on-disk task cache every generated environment uses (``focus_core.envs.base.cached_tasks``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from focus_core.envs.base import Task, cached_tasks


def _tasks(n: int) -> list[Task]:
    return [Task(f"t{i}", "x", "train" if i % 2 else "heldout", "default", f"p{i}", "a", "k",
                 {"path": ["a", "b"], "n": i, "nested": {"x": [1, 2]}}) for i in range(n)]


def test_tasks_are_generated_once_per_key_and_read_back_equal(tmp_path, monkeypatch):
    monkeypatch.setenv("FOCUS_DATA_DIR", str(tmp_path))
    calls = []

    def generate(n=3):
        calls.append(n)
        return _tasks(n)

    first = cached_tasks("x", "default", ("v1", b"source"), generate)
    again = cached_tasks("x", "default", ("v1", b"source"), generate)
    assert first == again == _tasks(3) and calls == [3]  # the second came from disk
    # Another generator version, source or tier is another file: never a stale read.
    cached_tasks("x", "default", ("v2", b"source"), generate)
    cached_tasks("x", "default", ("v1", b"edited"), generate)
    cached_tasks("x", "text", ("v1", b"source"), generate)
    assert len(calls) == 4 and len(list((tmp_path / "x").glob("tasks-*.json"))) == 4
    # The key's parts are hashed one by one, so moving text between parts changes the key.
    cached_tasks("x", "default", ("v1s", b"ource"), generate)
    assert len(calls) == 5


def test_an_unreadable_cache_is_regenerated_and_a_read_only_one_costs_only_time(tmp_path, monkeypatch):
    monkeypatch.setenv("FOCUS_DATA_DIR", str(tmp_path))
    cached_tasks("x", "default", ("v1",), lambda: _tasks(2))
    (path,) = (tmp_path / "x").glob("tasks-*.json")
    path.write_text("{not json")
    assert cached_tasks("x", "default", ("v1",), lambda: _tasks(2)) == _tasks(2)
    assert cached_tasks("x", "default", ("v1",), lambda: []) == _tasks(2)  # rewritten whole
    monkeypatch.setenv("FOCUS_DATA_DIR", str(tmp_path / "file"))
    (tmp_path / "file").write_text("a file where the data dir should be")
    assert cached_tasks("x", "default", ("v1",), lambda: _tasks(1)) == _tasks(1)


# Two processes that want the same tasks at once (pytest -n 2, `focus compare --workers 2`, rollout workers): each
# waits on a barrier of files so that both ask before either has written, then reads or generates. The generator
# logs each call to a file shared by both and takes long enough that the second asks while the first generates.
_RACE = """
import sys, time
from pathlib import Path
from focus_core.envs.base import Task, cached_tasks

shared, me = Path(sys.argv[1]), sys.argv[2]
(shared / f"ready-{me}").touch()
while len(list(shared.glob("ready-*"))) < 2:
    time.sleep(0.01)

def generate():
    with open(shared / "generations", "a") as log:
        log.write(me + "\\n")
    time.sleep(1.5)
    return [Task("t0", "x", "train", "default", "p", "a", "k", {"n": 0})]

print(len(cached_tasks("x", "default", ("v1",), generate)))
"""


def test_two_processes_asking_at_once_generate_the_tasks_once(tmp_path):
    script = tmp_path / "race.py"
    script.write_text(_RACE)
    env = {**os.environ, "FOCUS_DATA_DIR": str(tmp_path / "data")}
    racers = [subprocess.Popen([sys.executable, str(script), str(tmp_path), name], env=env, stdout=subprocess.PIPE,
                               text=True) for name in ("a", "b")]
    outputs = [racer.communicate(timeout=60)[0] for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0]
    assert outputs == ["1\n", "1\n"]  # both got the tasks
    assert len((tmp_path / "generations").read_text().split()) == 1  # one of them generated, the other read
    assert not list((tmp_path / "data" / "x").glob("*.tmp"))


def test_a_generators_error_comes_out_as_its_own(tmp_path, monkeypatch):
    """Where no lock can be made (a file where the data dir should be), a failing generator's error is the one
    raised, not one 'raised while handling' the lock's OSError."""
    monkeypatch.setenv("FOCUS_DATA_DIR", str(tmp_path / "file"))
    (tmp_path / "file").write_text("a file where the data dir should be")

    def generate():
        raise RuntimeError("the generator's own error")

    with pytest.raises(RuntimeError, match="own error") as raised:
        cached_tasks("x", "default", ("v1",), generate)
    assert raised.value.__context__ is None
