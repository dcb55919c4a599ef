"""The contract every stage follows: version, skip-if-committed, compute, commit, one log line.

A stage is a pure step from input artifacts to output artifacts. ``run_stage`` wraps its compute
function so that every stage behaves the same way:

1. Its *version* is a hash of the stage name, the config fields it reads (``depends_on``: each stage module
   declares them once, in ``READS``, and ``RunContext.fields(*READS)`` resolves them), the manifest hashes of its
   upstream stages and the schema version (``focus_core.artifacts.stage_version``).
2. If the store already holds a manifest with that version, the stage is done: it is skipped and
   its manifest returned. This — not Prefect's result cache — is what makes ``focus resume`` work,
   and a changed config invalidates exactly the stages that read the changed fields.
3. Otherwise it computes into a scratch folder, and the store commits tables and folders, then the
   manifest last. A crash before the manifest leaves nothing a reader would see.
4. It logs one line: iteration, stage, its figures, compute seconds.

The stage modules (``tasks/rollout.py`` ...) each define a plain function ``compute(...)`` (easy to
call from a notebook or a test) and a Prefect task (``stage_task``) that calls ``run_stage`` with it.

Retries: a stage's Prefect task is retried, with backoff, only when the store did not answer
(``StoreUnavailable``, raised after s3fs's and botocore's own retries) — every other error would happen again.
A retry calls the stage again with the same input manifests: it re-reads them, recomputes with the same
seeds and commits; whatever the failed attempt wrote is invisible without its manifest and is wiped.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE

from focus_core.artifacts import ArtifactStore, Manifest, StoreUnavailable, stage_version
from focus_core.config import FocusConfig, version_values
from focus_core.ids import derive_seed

log = logging.getLogger("focus")

# Prefect retries per stage for an unreachable store, and the waits before them (s): the stages that take
# minutes to recompute (the SFT warm start, the update) get fewer; together the waits outlast a server restart.
STAGE_RETRIES = {"bootstrap": 2, "evaluate": 3, "rollout": 3, "segment": 3, "acquire": 3, "branch": 3,
                 "fit_critic": 3, "advantage": 3, "update": 2}
RETRY_DELAYS_S = [5, 20, 60]

# Fault injection for the resume tests: "ITERATION:STAGE" makes the process SIGKILL itself halfway
# through that stage (after its compute, before the commit), the one crash a test cannot time from
# outside. Unset in normal use.
KILL_AT_ENV = "FOCUS_KILL_AT"


# B_tok as a stage reads it: a stage that spends the iteration's budget lists this name in its READS, and its version
# then covers ``RunContext.tokens_per_iteration``. The key is the name B_tok had in the versions of the first
# committed runs; another name would recompute them.
TOKENS_PER_ITERATION = "budget_tokens"


@dataclass(frozen=True)
class RunContext:
    """What every stage of one run knows: where artifacts live, which run, the resolved config, and
    B_tok (``budget.tokens_per_iteration``: generated tokens per iteration, the same for every method started from
    one bootstrap) once the bootstrap has measured it (``flows/train.py`` sets it with
    ``with_tokens_per_iteration``)."""

    store: ArtifactStore
    run_id: str
    config: FocusConfig
    tokens_per_iteration: int | None = None

    def with_tokens_per_iteration(self, tokens: int) -> RunContext:
        return RunContext(self.store, self.run_id, self.config, tokens)

    def seed(self, iteration: int, stage: str, *keys: Any) -> int:
        """A seed derived from (run seed, iteration, stage, keys): a resumed stage draws the same numbers."""
        return derive_seed(self.config.seed, iteration, stage, *keys)

    def fields(self, *names: str) -> dict[str, Any]:
        """What the version of a stage that reads ``names`` covers (``depends_on``): the config fields and sections
        among them as ``focus_core.config.version_values`` gives them, and B_tok if TOKENS_PER_ITERATION is one."""
        picked = version_values(self.config, [name for name in names if name != TOKENS_PER_ITERATION])
        if TOKENS_PER_ITERATION in names:
            if self.tokens_per_iteration is None:
                raise RuntimeError("B_tok is set after the bootstrap stage; call ctx.with_tokens_per_iteration(...) "
                                   "first")
            picked[TOKENS_PER_ITERATION] = self.tokens_per_iteration
        return picked


@dataclass
class StageResult:
    """What a stage's compute function hands back for the commit."""

    tables: dict[str, pa.Table] = field(default_factory=dict)
    folders: dict[str, Path] = field(default_factory=dict)  # name -> local folder (checkpoints)
    figures: dict[str, float] = field(default_factory=dict)  # the numbers of the log line and MLflow
    policy_version: int | None = None
    skipped: str | None = None  # why a stage had nothing to do (e.g. GRPO has no critic)
    seeds: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # seconds beside compute_s (e.g. generation_s)


def run_stage(ctx: RunContext, iteration: int, stage: str, *, depends_on: Mapping[str, Any],
              upstream: Mapping[str, Manifest], compute: Callable[[Path], StageResult]) -> Manifest:
    """Run ``compute`` unless the stage is already committed at its expected version; commit its result."""
    version = stage_version(stage, dict(depends_on), sorted(m.hash for m in upstream.values()))
    existing = ctx.store.manifest(ctx.run_id, iteration, stage)
    if existing is not None and existing.version == version:
        log.info("[it %d] %-12s committed earlier, skipped", iteration, stage)
        return existing
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"focus-{stage}-") as scratch:
        result = compute(Path(scratch))
        compute_s = time.perf_counter() - started
        if os.environ.get(KILL_AT_ENV) == f"{iteration}:{stage}":
            os.kill(os.getpid(), signal.SIGKILL)
        manifest = ctx.store.commit(
            ctx.run_id, iteration, stage, version=version, tables=result.tables, folders=result.folders,
            upstream={name: m.hash for name, m in upstream.items()}, seeds=result.seeds,
            policy_version=result.policy_version, timings={"compute_s": compute_s, **result.timings},
            figures=result.figures,
            skipped=result.skipped,
        )
    log.info("[it %d] %-12s %s (%.1f s)", iteration, stage, _describe(result), compute_s)
    return manifest


def _describe(result: StageResult) -> str:
    if result.skipped:
        return f"skipped: {result.skipped}"
    return ", ".join(f"{name} {_number(value)}" for name, value in result.figures.items()) or "done"


def _number(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:.3g}"


def stage_task(name: str) -> Callable:
    """The Prefect task decorator of stage ``name``: retried (``STAGE_RETRIES``) only for an unreachable store.
    No Prefect result cache: the committed manifests are the cache (``run_stage``)."""
    retries = STAGE_RETRIES[name]
    return task(name=name, retries=retries, retry_delay_seconds=RETRY_DELAYS_S[:retries],
                retry_condition_fn=_store_unavailable, cache_policy=NO_CACHE)


def _store_unavailable(task_, task_run, state) -> bool:
    error = state.result(raise_on_failure=False)
    if isinstance(error, StoreUnavailable):
        log.warning("%s: the store did not answer (%s); Prefect retries the stage (retry %d of %d)", task_.name,
                    str(error)[:200], task_run.run_count, task_.retries)
        return True
    return False
