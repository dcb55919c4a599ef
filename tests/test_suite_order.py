"""The order `make test` hands tests to its two workers (``tests/conftest.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Collects two modules with the suite's own conftest and prints, in run order, each test, whether it is slow and
# whether it uses the full code-localization tier (the `full` fixture), whose first generation takes minutes.
_COLLECT = """
import json, sys, pytest

class Order:
    def pytest_collection_finish(self, session):
        print("ORDER " + json.dumps([[item.nodeid, item.get_closest_marker("slow") is not None,
                                      "full" in item.fixturenames] for item in session.items]))

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Order()]))
"""


def test_one_full_tier_test_runs_first_and_the_others_after_every_other_test():
    """One of the full tier's tests generates its cache, among the first tests. The others read it at the end of the
    run, not side by side with the first on the other worker, where they would wait minutes for it (pytest-xdist
    3.8's `xdist_group` does not group under pytest 9.2: it sets an attribute pytest no longer reads)."""
    result = subprocess.run([sys.executable, "-c", _COLLECT, "tests/test_env_code_localization.py",
                             "tests/test_env_cache.py"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("ORDER ")]
    order = json.loads(line.removeprefix("ORDER "))
    uses_full = [full for _, _, full in order]
    first_quick = [slow for _, slow, _ in order].index(False)
    assert sum(uses_full) == 3
    assert sum(uses_full[:first_quick]) == 1, order  # the one that generates, among the slow tests that go first
    assert uses_full[-2:] == [True, True], order  # the two that read it, last
