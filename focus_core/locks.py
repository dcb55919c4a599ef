"""One machine's processes, one at a time: an exclusive lock on a file, for work that processes started together
would otherwise all do at once (``pytest -n 2``, ``focus compare --workers 2``, rollout workers).

Three places use it: the environments' task cache (``envs/base.py``), the code-localization mutant cache
(``envs/code_mutations.py``) and MLflow's first use of a fresh sqlite store (``flows/tracking.py``). The lock is
``flock`` on a file beside what it guards: the kernel releases it when the holder closes the file or dies, so a
killed process leaves no stale lock behind. It is local to one host; a run's artifact store across machines has
its lease instead (``lease.py``).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive_file_lock(path: str | Path, *, required: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (created with its folder) for the block; the block gets True.

    Where the file cannot be made (a read-only folder, a file where the folder should be), ``required`` raises
    the ``OSError``; otherwise the block runs without the lock and gets False, for callers whose lock only saves
    repeated work."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # noqa: SIM115 - closed below; "a": opening never truncates a holder's file
    except OSError:
        if required:
            raise
        handle = None  # (not yielding in here: an error of the block would print as raised while handling this one)
    with handle or contextlib.nullcontext():
        if handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield handle is not None
