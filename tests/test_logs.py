"""The terminal's log lines (flows/logs.py): FOCUS's own at INFO, libraries only from WARNING — also after Prefect
has set up its logging, which runs on import and replaces a root handler it does not take for the user's."""

from __future__ import annotations

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
