"""examples/one_iteration.py: it runs end to end, prints one line per step with sensible figures, stays small,
and uses only the library (no tasks/flows/infra, no Prefect or MLflow)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "one_iteration.py"
STEPS = ("bootstrap", "rollout", "segment", "acquire_r0", "branch_r0", "critic_r0", "advantage", "update", "evaluate")


def figures(line: str) -> dict[str, str]:
    """'name value, name value' after the step name -> {name: value}."""
    body = line.split("] ", 1)[1].split(None, 1)[1]
    return dict(part.strip().split(" ", 1) for part in body.split(", "))


def test_example_is_small_and_uses_only_the_library():
    source = EXAMPLE.read_text()
    assert len(source.splitlines()) < 250
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
            assert not any(alias.name.startswith("_") for alias in node.names)
    assert not imported & {"tasks", "flows", "infra", "prefect", "mlflow"}


def test_example_runs_one_iteration():
    done = subprocess.run([sys.executable, str(EXAMPLE)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {re.split(r"\s+", line.split("] ", 1)[1])[0]: line for line in done.stdout.splitlines() if "] " in line}
    assert set(STEPS) <= set(lines), done.stdout
    rollout = figures(lines["rollout"])
    assert int(rollout["episodes"]) > 0 and 0.0 <= float(rollout["success"]) <= 1.0 and int(rollout["tokens"]) > 0
    assert int(figures(lines["segment"])["states"]) > 0
    assert int(figures(lines["branch_r0"])["tokens_spent"]) > 0
    assert 0.0 <= float(figures(lines["critic_r0"])["oof_critic_vs_mc_mae"]) <= 1.0
    advantage = figures(lines["advantage"])
    assert int(advantage["segments"]) > 0 and abs(float(advantage["mean_advantage"])) <= 1.0
    update = figures(lines["update"])
    assert int(update["steps"]) > 0 and int(update["policy_tokens"]) > 0
    evaluate = figures(lines["evaluate"])
    assert 0.0 <= float(evaluate["heldout_exact_after"]) <= 1.0
    assert 0 < int(evaluate["tokens_spent"]) <= int(evaluate["budget"])
