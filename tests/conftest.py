"""Shared fixtures: a real S3 server (SeaweedFS) for the tests that talk to object storage.

The S3 tests run against the same kind of server a developer or CI uses (``infra.services``), not an
in-process mock, so endpoint configuration, signatures, listings and error translation are exercised for
real. The server starts lazily, once per pytest process: under ``pytest -n 2`` each xdist worker starts
its own on free ports (SeaweedFS answers in about a second), and it is stopped when the session ends.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Client variables that would redirect or re-sign the test's S3 requests; hidden while the server runs.
_OVERRIDING_AWS_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first, the ``late`` ones last. `make test` runs `pytest -n 2 --dist loadgroup`, which hands each
    worker one test at a time as it frees up, in this order: the long tests (minutes each) start side by side on both
    workers and the many short ones fill in after, instead of one long test running alone at the end while the other
    worker idles. A ``late`` test reads a cache that a slow test builds (the full code-localization tier): at the end
    it finds it built, where beside the builder on the other worker it would wait minutes on the cache's lock.
    (pytest-xdist's ``xdist_group`` would put such tests on one worker, but under pytest 9.2 it groups nothing: xdist
    3.8 renames the test through an attribute pytest no longer reads. With no groups, loadgroup schedules per test.)"""

    def place(item: pytest.Item) -> int:
        if item.get_closest_marker("late"):
            return 2
        return 0 if item.get_closest_marker("slow") else 1

    items.sort(key=place)  # stable: collection order otherwise


@pytest.fixture(scope="session")
def s3_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A SeaweedFS server on free ports; the AWS_* variables point at it for the rest of the session."""
    from infra.services import start_s3

    service = start_s3(tmp_path_factory.mktemp("s3-service"))
    client_env = {key: value for key, value in service.env.items() if key.startswith("AWS_")}  # not FOCUS_STORE
    saved = {key: os.environ.get(key) for key in (*client_env, *_OVERRIDING_AWS_VARIABLES)}
    for key in _OVERRIDING_AWS_VARIABLES:
        os.environ.pop(key, None)
    os.environ.update(client_env)
    try:
        yield service
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        service.stop()


@pytest.fixture(scope="session")
def s3_store_root(s3_service) -> str:
    """``s3://focus/<prefix>`` on the session's server; tests add their own sub-prefix to stay apart."""
    return f"s3://focus/tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A Prefect server for this pytest process (started on first use, stopped when the session ends).

    Where no PREFECT_API_URL is set, every ``focus`` process starts Prefect's temporary API server and stops it at
    exit: 9-14 s of each process (the more on a fresh PREFECT_HOME, whose database it migrates first; measured in
    docs/design.md). The tests that start many ``focus`` processes point them at this server instead, as a user with
    ``make services-up`` or a deployment does (the deployment tests use it too); the temporary server keeps its own
    tests (the quick start's path, processes started at once, its port choice)."""
    from infra.services import start_prefect

    service = start_prefect(tmp_path_factory.mktemp("prefect-service"))
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture
def on_prefect_server(prefect_server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``focus`` processes this test starts (they inherit the environment) talk to ``prefect_server``."""
    monkeypatch.setenv("PREFECT_API_URL", prefect_server.env["PREFECT_API_URL"])


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models decode fastest on one intra-op thread; more threads on a busy 2-core machine (pytest -n 2)
    spin against each other and run 10-50x slower. Model test modules use it for all their tests."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
