"""`focus runs`: one line per run under a store root — how far it got, how well it does, what it spent
(generated tokens / B_tok per iteration, min–max) and where time went.

Everything comes from the store itself (``_run.json`` and the committed manifests), so the table is
right for runs started on other machines, killed runs, and runs that never reached MLflow.

Overhead share is the part of the wall time not spent in stages' own compute: store IO, Prefect
orchestration, retries and the work lost by crashed attempts. ``flows/train.py`` writes each
iteration's wall seconds to ``_run.json`` (``iteration_wall_s``, summed over resumed attempts), so
the share is ``1 - Σ compute_s / Σ wall_s`` over those iterations (the bootstrap stage runs before the
first iteration's clock starts and is left out). A run without them (older, or killed during its first
iteration) falls back to the manifests' own timings: ``overhead_s / (compute_s + overhead_s)``, which
sees store IO only.
"""

from __future__ import annotations

from typing import Any

from flows.sql import format_table
from focus_core.artifacts import COMPUTE_TIMING, ArtifactStore, Manifest, RunSummary

COLUMNS = ["run", "status", "method", "iterations", "last_committed", "heldout_success", "spend/B_tok", "compute_s",
           "overhead_s", "overhead_share"]


def runs_report(store: ArtifactStore) -> str:
    """The `focus runs` table for every run under the store's root."""
    summaries = store.list_runs()
    if not summaries:
        return f"no runs under {store.root}"
    return format_table(COLUMNS, [_row(summary, store.committed(summary.run_id)) for summary in summaries],
                        max_rows=None)


def _row(summary: RunSummary, committed: list[tuple[int, str, Manifest]]) -> list[Any]:
    config = summary.info.get("config") or {}
    done = sum(1 for stages in summary.stages.values() if "update" in stages)
    planned = config.get("iterations")
    last = f"{summary.last_committed[0]}/{summary.last_committed[1]}" if summary.last_committed else "-"
    share = _overhead_share(summary, committed)
    return [
        summary.run_id,
        summary.status,
        config.get("method", "-"),
        f"{done}/{planned}" if planned else str(done),
        last,
        _latest_heldout_success(committed),
        _spend_share(committed),
        round(summary.compute_s, 1),
        round(summary.overhead_s, 1),
        "-" if share is None else f"{share:.0%}",
    ]


def _latest_heldout_success(committed: list[tuple[int, str, Manifest]]) -> float | None:
    evaluations = [manifest for _, stage, manifest in committed if stage == "evaluate"]
    if not evaluations:
        return None
    value = max(evaluations, key=lambda manifest: manifest.iteration).figures.get("heldout_success")
    return float(value) if isinstance(value, int | float) else None


def _spend_share(committed: list[tuple[int, str, Manifest]]) -> str:
    """Generated tokens / B_tok per iteration (rollout plus branch stages), as 'min–max%' over iterations."""
    spent: dict[int, float] = {}
    budget: dict[int, float] = {}
    for iteration, stage, manifest in committed:
        if stage == "rollout" or (stage.startswith("branch_r") and not manifest.skipped):
            spent[iteration] = spent.get(iteration, 0.0) + float(manifest.figures.get("tokens", 0.0))
        if stage == "rollout" and manifest.figures.get("budget"):
            budget[iteration] = float(manifest.figures["budget"])
    shares = [spent[i] / budget[i] for i in budget]
    if not shares:
        return "-"
    low, high = min(shares), max(shares)
    return f"{low:.0%}" if round(low, 2) == round(high, 2) else f"{low:.0%}–{high:.0%}"


def _overhead_share(summary: RunSummary, committed: list[tuple[int, str, Manifest]]) -> float | None:
    walls = summary.info.get("iteration_wall_s") or {}
    wall = sum(float(seconds) for seconds in walls.values())
    if wall > 0:
        timed = {int(iteration) for iteration in walls}
        compute = sum(float(manifest.timings.get(COMPUTE_TIMING, 0.0)) for iteration, stage, manifest in committed
                      if iteration in timed and stage != "bootstrap")
        return 1.0 - compute / wall
    total = summary.compute_s + summary.overhead_s
    return summary.overhead_s / total if total > 0 else None
