"""Benchmarks: each prints its figures as JSON (and may write them with --json PATH)."""

from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any


def emit_json(results: Any, path: Path | None) -> None:
    """Print ``results`` as JSON and, when ``path`` is given, write the same text there."""
    text = json.dumps(results, indent=2)
    print(text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def process_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` fresh ("spawn") processes. Not forks: a fork of a process that runs threads (torch's,
    Prefect's, pytest-xdist's) inherits locks that no thread of the child will release; seen, a forked critic-budget
    worker segfaulted in the garbage collector under CI. Workers set their own torch threads, so the figures are the
    same either way."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
