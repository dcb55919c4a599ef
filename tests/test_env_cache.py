"""The on-disk task cache every generated environment uses (``focus_core.envs.base.cached_tasks``)."""

from __future__ import annotations

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
