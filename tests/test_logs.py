"""The terminal's log lines (flows/logs.py): FOCUS's own at INFO, libraries only from WARNING — also after Prefect
has set up its logging, which runs on import and replaces a root handler it does not take for the user's."""

from __future__ import annotations

import re
import subprocess
import sys


def test_focus_lines_print_and_library_info_does_not_after_prefect_sets_up_logging():
    script = """
import logging
from flows.logs import quiet_terminal
quiet_terminal()
import flows.compare  # imports Prefect, whose set-up rewrites the logging configuration
from prefect.logging.configuration import setup_logging
setup_logging(incremental=False)
logging.getLogger("focus").info("FOCUS-LINE")
logging.getLogger("distributed.scheduler").info("LIBRARY-INFO")
logging.getLogger("distributed.scheduler").warning("LIBRARY-WARNING")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "FOCUS-LINE" in done.stderr and "LIBRARY-WARNING" in done.stderr
    assert "LIBRARY-INFO" not in done.stderr


def test_a_compare_cluster_closing_does_not_warn_that_it_kills_finished_workers():
    # Each Dask worker of `focus compare` has returned every result (its runs' artifacts are committed) when the
    # cluster closes; a worker still tearing down torch and Prefect after 4 s on a busy machine is killed, and the
    # nanny's warning about it ended every loaded compare. Other nanny warnings still print.
    script = """
import logging
from flows.logs import quiet_terminal
quiet_terminal()
from flows.compare import local_cluster
local_cluster(2)
nanny = logging.getLogger("distributed.nanny")
nanny.warning("Worker process still alive after 4.0 seconds, killing")
nanny.warning("NANNY-OTHER-WARNING")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "NANNY-OTHER-WARNING" in done.stderr
    assert "still alive" not in done.stderr


def test_in_a_compare_worker_each_focus_line_names_its_run_and_no_progress_bar_draws():
    # Two runs share a compare's terminal: a bare "[it 0] rollout …" does not say whose it is, and two workers'
    # progress bars redraw over each other on one line.
    # A worker's root logger has Prefect's console handler before FOCUS sets up its terminal; its lines then came
    # in Prefect's format ("04:10:31.785 | INFO    | focus - …") beside the CLI's ("04:10:31 …").
    script = """
import logging
import flows.compare  # a worker has imported the task's module, and Prefect has set up its logging
from flows.logs import naming_run, quiet_terminal
quiet_terminal()
from flows.compare import local_cluster
log = logging.getLogger("focus")
with naming_run("tiny-legal-grpo-s5"):
    log.info("[it 0] rollout      episodes 4")
    log.info("run %s finished: held-out success 0.5", "tiny-legal-grpo-s5")
log.info("AFTER-THE-RUN")
print(local_cluster(2).cluster_kwargs["env"])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^\d\d:\d\d:\d\d tiny-legal-grpo-s5 \[it 0\] rollout", done.stderr, re.MULTILINE)
    assert "| INFO" not in done.stderr
    assert "tiny-legal-grpo-s5 run tiny-legal-grpo-s5" not in done.stderr  # a line that names it already
    assert "tiny-legal-grpo-s5 AFTER-THE-RUN" not in done.stderr and "AFTER-THE-RUN" in done.stderr
    assert "'TQDM_DISABLE': '1'" in done.stdout
