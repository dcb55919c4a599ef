"""Where FOCUS's log lines go: the terminal (one line per stage, nothing from libraries below WARNING) and,
inside a flow run, that run's logs in Prefect (the Logs tab of the UI).

``quiet_terminal`` is called once per process that runs FOCUS code: the CLI and each Dask worker of
``focus compare`` (whose lines the CLI's process prints: ``flows.compare.lines_to_the_client``). ``to_prefect``
wraps a flow's body: Prefect's API log handler is attached to the ``focus`` logger for that time, so the stage
lines and warnings reach the flow run without Prefect printing them twice.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator

FOCUS_LOGGER = "focus"


def _ours_or_warning(record: logging.LogRecord) -> bool:
    return record.name.startswith(FOCUS_LOGGER) or record.levelno >= logging.WARNING


class AboveTheBars(logging.StreamHandler):
    """Writes each line through ``tqdm.write``, so it lands above any progress bar instead of through it.
    (Public name on purpose: Prefect's logging set-up replaces root handlers whose class name starts with "_".)"""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)


def quiet_terminal() -> None:
    """FOCUS's lines at INFO on stderr; every library (httpx, mlflow, bm25s — which sets its logger to DEBUG on
    import) only from WARNING, filtered at the handlers so that no later import can undo it. One format, the
    CLI's, also where Prefect's console handler came first (a ``focus compare`` worker): its lines and the CLI's
    share one terminal."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(AboveTheBars())
    root.setLevel(logging.INFO)
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        if _ours_or_warning not in handler.filters:
            handler.addFilter(_ours_or_warning)


def _not_the_closing_kill(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Worker process still alive after")


def quiet_cluster_close() -> None:
    """For a local Dask cluster of ``focus compare``: it closes only after every worker has returned its results,
    so every run is committed. A worker whose interpreter is still tearing down torch and Prefect 4 s later (on a
    loaded machine) is killed; the nanny's warning about that means nothing lost. Its other warnings still print."""
    nanny = logging.getLogger("distributed.nanny")
    if _not_the_closing_kill not in nanny.filters:
        nanny.addFilter(_not_the_closing_kill)


def _from_this_process(record: logging.LogRecord) -> bool:
    return record.process == os.getpid()


_RUN_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("focus_run_id", default=None)


def _prefix_the_run(record: logging.LogRecord) -> bool:
    run_id = _RUN_ID.get()
    if run_id and run_id not in record.getMessage():
        record.msg = f"{run_id} {record.msg}"
    return True


@contextlib.contextmanager
def naming_run(run_id: str) -> Iterator[None]:
    """While the block runs, every ``focus`` line starts with ``run_id`` (unless it names it already): in a
    ``focus compare`` worker, so that the stage lines of runs that share a terminal say whose they are."""
    logger = logging.getLogger(FOCUS_LOGGER)
    if _prefix_the_run not in logger.filters:  # a logger's filter runs once per record, where it is logged
        logger.addFilter(_prefix_the_run)
    token = _RUN_ID.set(run_id)
    try:
        yield
    finally:
        _RUN_ID.reset(token)


@contextlib.contextmanager
def to_prefect() -> Iterator[None]:
    """Send the ``focus`` logger's records (INFO and up) to the current Prefect flow run while the block runs."""
    from prefect.logging.handlers import APILogHandler

    logger = logging.getLogger(FOCUS_LOGGER)
    if any(isinstance(handler, APILogHandler) for handler in logger.handlers):  # a nested flow: already sent
        yield
        return
    handler = APILogHandler()
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_from_this_process)  # a worker's forwarded lines: its own flow run has them already
    logger.addHandler(handler)
    level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:  # e.g. in a Prefect worker, whose root logs at WARNING
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
