"""`focus compare SPEC.yaml`: every (environment, method, seed) of a spec as a `train` run, from one shared start.

A spec (``configs/compare/*.yaml``) names environments (each with its config file), methods (each a list of
overrides, so an ablation such as ``focus + acquisition.strategy=uniform_random`` is a row), seeds, and settings
for every run (``iterations``, ``set``). Per (environment, seed) the *first* method's run trains the bootstrap
(the SFT warm start and the measured budget B_tok); every other method's run starts from it (``bootstrap.init_from``,
as ``focus train --init``): the same weights, the same B_tok, the same held-out tasks and sampling seeds.

The ``focus-compare`` Prefect flow runs the grid on a Dask cluster through prefect-dask: by default a local
cluster of ``workers`` processes (one thread each), or an existing cluster by ``dask_address``. Each run is a
``focus-train`` flow run nested in the compare run's task. First the bootstraps (one task per environment and
seed), then every run as soon as its bootstrap is committed. A rerun of the same spec skips finished runs and
resumes partial ones (``train`` with the run id: committed stages are not recomputed). Progress: one line per
finished run and a progress bar over the grid. A run that fails does not stop the others: the grid goes on, and
the flow then fails with one line naming the failed runs (``focus compare`` exits 1).

The compare record ``{store}/_compare/{name}.json`` lists the runs with their env, method, seed and overrides;
``focus report NAME`` and ``focus sql --compare NAME`` read it. With MLflow, the compare is a parent run and every
training run its child (tag ``mlflow.parentRunId``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from distributed.diagnostics.plugin import WorkerPlugin
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from prefect_dask import DaskTaskRunner
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tqdm.auto import tqdm

from flows.forms import CompareSettings
from flows.logs import FOCUS_LOGGER, naming_run, quiet_cluster_close, quiet_terminal, to_prefect
from focus_core.artifacts import ArtifactStore
from focus_core.config import ConfigError, config_to_dict, load_config, validate_config
from focus_core.lease import hold

log = logging.getLogger("focus")
RECORD_FOLDER = "_compare"  # under the store root; not a run id, so `focus runs` passes it by


class CompareSpec(BaseModel):
    """A comparison grid. Every run's config is loaded (and so checked) before anything runs."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="the compare id")
    envs: dict[str, str | None] = Field(min_length=1, description="env name -> config file (null: defaults)")
    methods: dict[str, list[str]] = Field(
        min_length=1, description="row name -> overrides; the first row trains each (env, seed)'s bootstrap")
    seeds: list[int] = Field(min_length=1)
    iterations: int | None = Field(None, ge=1, description="every run's iterations (null: each config's own)")
    set: list[str] = Field(default_factory=list, description="overrides for every run")
    run_prefix: str | None = Field(
        None, description="run ids are {run_prefix}{env}-{method}-s{seed}; default '{name}-'. '' adopts the runs "
                          "of bench/trap_methods.py, which uses the same scheme")

    @field_validator("methods")
    @classmethod
    def _names(cls, methods: dict[str, list[str]]) -> dict[str, list[str]]:
        bad = [m for m in methods if not m.replace("_", "").isalnum()]
        if bad:
            raise ValueError(f"method row names must be letters, digits and '_': {bad}")
        return methods

    @property
    def bootstrap_method(self) -> str:
        return next(iter(self.methods))

    def run_id(self, env: str, method: str, seed: int) -> str:
        prefix = f"{self.name}-" if self.run_prefix is None else self.run_prefix
        return f"{prefix}{env}-{method}-s{seed}"

    def runs(self, envs: list[str] | None = None) -> list[dict[str, Any]]:
        """One row per run (of ``envs`` only, if given): ids, where its config comes from, its overrides and the
        run it starts from."""
        unknown = sorted(set(envs or ()) - set(self.envs))
        if unknown:
            raise ConfigError(f"compare spec {self.name}: no environment {', '.join(unknown)} in it (fix: one of "
                              f"{', '.join(self.envs)})")
        rows = []
        for env, config in self.envs.items():
            if envs is not None and env not in envs:
                continue
            for seed in self.seeds:
                for method, overrides in self.methods.items():
                    sets = [f"seed={seed}", *([] if config else [f"env.name={env}"]),
                            *([f"iterations={self.iterations}"] if self.iterations else []), *self.set, *overrides]
                    first = method == self.bootstrap_method
                    rows.append({"run_id": self.run_id(env, method, seed), "env": env, "method": method, "seed": seed,
                                 "config": config, "overrides": sets,
                                 "init_from": None if first else self.run_id(env, self.bootstrap_method, seed)})
        return rows


def load_spec(path: str | os.PathLike[str]) -> CompareSpec:
    """The spec at ``path``, every run's config validated; one line naming the problem otherwise."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError as error:
        raise ConfigError(f"compare spec {path}: no such file (fix: a path to a spec like "
                          f"configs/compare/traps.yaml)") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"compare spec {path}: not valid YAML ({error})") from error
    try:
        spec = CompareSpec.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        raise ConfigError(f"compare spec {path}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from error
    # A config path is relative to where focus runs, else to the spec's folder.
    beside = Path(path).resolve().parent
    spec.envs = {env: c if c is None or Path(c).exists() else str(beside / c) for env, c in spec.envs.items()}
    for row in spec.runs():
        try:
            cfg = load_config(row["config"], row["overrides"])
        except ConfigError as error:
            raise ConfigError(f"compare spec {path}: run {row['run_id']}: {error}") from error
        if cfg.env.name != row["env"]:
            raise ConfigError(f"compare spec {path}: env {row['env']!r} has config {row['config']} for env "
                              f"{cfg.env.name!r} (fix: the env key must name the config's env.name)")
    return spec


def write_record(store: ArtifactStore, spec: CompareSpec, **extra: Any) -> dict[str, Any]:
    path = f"{store.root.rstrip('/')}/{RECORD_FOLDER}/{spec.name}.json"
    old = read_record(store, spec.name) or {}
    record = {**old, "name": spec.name, "spec": spec.model_dump(), "runs": spec.runs(), **extra}
    store.filesystem.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with store.filesystem.open(tmp, "w") as out:
        out.write(json.dumps(record, indent=1))
    store.filesystem.mv(tmp, path)  # one rename: a reader sees the old record or the new one
    return record


def read_record(store: ArtifactStore, name: str) -> dict[str, Any] | None:
    path = f"{store.root.rstrip('/')}/{RECORD_FOLDER}/{name}.json"
    try:
        with store.filesystem.open(path) as handle:
            return json.loads(handle.read())
    except FileNotFoundError:
        return None


def check_existing(store: ArtifactStore, rows: list[dict[str, Any]]) -> None:
    """A run of the grid that already exists must have been started with the spec's settings: it is adopted
    (skipped when finished, resumed otherwise), never silently taken for something else."""
    for row in rows:
        info = store.run_info(row["run_id"])
        if not info or "config" not in info:
            continue
        init = [f"bootstrap.init_from={row['init_from']}"] if row["init_from"] else []
        wanted = config_to_dict(load_config(row["config"], [*row["overrides"], *init]))
        # validated again, so a section added since the run started holds its default (as a resume reads it)
        existing = config_to_dict(validate_config(info["config"]))
        if wanted != existing:
            differ = sorted(k for k in set(wanted) | set(existing) if wanted.get(k) != existing.get(k))
            raise ConfigError(f"run {row['run_id']} exists in {store.root} with other settings ({', '.join(differ)}); "
                              f"fix: another spec name or run_prefix, or delete that run")


def _one_thread() -> None:
    """Each Dask worker is one process with one core; the tiny model runs fastest single-threaded. Its log lines
    are the CLI's: FOCUS's own, and libraries' warnings."""
    quiet_terminal()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


@task(name="bootstrap-run", cache_policy=NO_CACHE)
def bootstrap_run(row: dict[str, Any], store_root: str) -> str:
    """Create the (env, seed)'s first run and commit its bootstrap, unless it has one: the start every method
    of that environment and seed shares."""
    from tasks.bootstrap import STAGE, bootstrap
    from tasks.stage import RunContext

    _one_thread()
    store = ArtifactStore(store_root)
    if store.manifest(row["run_id"], 0, STAGE) is not None:
        return row["run_id"]
    with hold(store, row["run_id"]), naming_run(row["run_id"]):
        started, cpu_started = time.perf_counter(), time.process_time()
        info = store.run_info(row["run_id"])
        cfg = load_config(row["config"], row["overrides"]) if info is None else validate_config(info["config"])
        store.write_run_info(row["run_id"], {"status": "running", "config": config_to_dict(cfg), "store": store.root})
        bootstrap.fn(RunContext(store, row["run_id"], cfg))
        # The run's own clock starts here (train adds to these), so its wall and CPU seconds include its SFT.
        store.write_run_info(row["run_id"], {"wall_s": time.perf_counter() - started,
                                             "cpu_s": time.process_time() - cpu_started})
    return row["run_id"]


@task(name="train-run", cache_policy=NO_CACHE)
def train_run(row: dict[str, Any], store_root: str) -> dict[str, Any]:
    """Train one run of the grid (or resume it, or skip it when finished); returns its id, status and seconds."""
    from flows.train import train

    _one_thread()
    store = ArtifactStore(store_root)
    started = time.perf_counter()
    info = store.run_info(row["run_id"])
    if info and info.get("status") == "finished":
        return {"run_id": row["run_id"], "status": "finished", "seconds": 0.0, "skipped": True}
    with naming_run(row["run_id"]):
        if info:  # partial (or only bootstrapped): continue from its last committed stage
            train(run_id=row["run_id"], store=store_root)
        else:
            init = [f"bootstrap.init_from={row['init_from']}"] if row["init_from"] else []
            train(config_path=row["config"], overrides=[*row["overrides"], *init], run_id=row["run_id"],
                  store=store_root)
    return {"run_id": row["run_id"], "status": "finished", "seconds": time.perf_counter() - started, "skipped": False}


class _FocusLinesOnTheClient(WorkerPlugin):
    """A Dask worker plugin: the worker's ``focus`` lines stop at its own logger (no print on its terminal); the
    client prints the forwarded copies (``lines_to_the_client``)."""

    name = "focus-lines-on-the-client"

    def setup(self, worker: Any) -> None:
        logging.getLogger(FOCUS_LOGGER).propagate = False

    def teardown(self, worker: Any) -> None:
        logging.getLogger(FOCUS_LOGGER).propagate = True


@contextlib.contextmanager
def lines_to_the_client(client: Any) -> Iterator[None]:
    """For ``focus compare`` on a Dask cluster: while the block runs, every worker's ``focus`` lines (INFO and up)
    are printed by this process, above its progress bar over the grid. Printed by the workers themselves, they
    landed after the bar's unfinished line, and the bar's next redraw wrote over them; on a remote cluster they
    were not seen at all. Each stays in its own flow run's logs, sent from its worker (``to_prefect``). After the
    block the workers print their own lines again (a cluster given by address outlives the comparison)."""
    client.forward_logging(FOCUS_LOGGER, logging.INFO)
    client.register_plugin(_FocusLinesOnTheClient())
    try:
        yield
    finally:
        client.unregister_worker_plugin(_FocusLinesOnTheClient.name)
        client.unforward_logging(FOCUS_LOGGER)


def local_cluster(workers: int) -> DaskTaskRunner:
    """A local Dask cluster of ``workers`` processes, one thread each: one training run per core."""
    quiet_cluster_close()
    # No progress bars in the workers (tqdm reads TQDM_DISABLE on import): several runs' bars would redraw over
    # each other on one terminal line. The compare's own bar over the grid stays.
    return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                                          "dashboard_address": None, "env": {"TQDM_DISABLE": "1"},
                                          # no dashboard, but the scheduler's HTTP routes (health, metrics) still
                                          # need a port: a free one on loopback, not 8787 (two grids at once warned)
                                          "scheduler_kwargs": {"dashboard_address": "127.0.0.1:0"}})


# From the Prefect UI (focus serve) the flow runs on a local cluster of $FOCUS_COMPARE_WORKERS (2) processes.
@flow(name="focus-compare", log_prints=False,
      task_runner=local_cluster(int(os.environ.get("FOCUS_COMPARE_WORKERS", "2"))))
def compare(settings: CompareSettings | None = None, spec_path: str | None = None, store: str | None = None,
            envs: list[str] | None = None) -> str:
    """Run (or resume) every run of the spec (``spec_path``, or the UI form's ``settings``); returns the compare id.
    ``envs`` runs only those environments' part of the grid (a grid too long for one sitting, run part by part).
    ``run_compare`` (``focus compare``) picks the task runner: a local Dask cluster of ``--workers`` processes or
    an existing cluster."""
    spec_path = spec_path or (settings or CompareSettings()).path()
    with to_prefect():
        return _compare(spec_path, store, envs)


def _compare(spec_path: str, store: str | None, envs: list[str] | None) -> str:
    from flows.train import default_store

    spec = load_spec(spec_path)
    artifacts = ArtifactStore(store or default_store())
    rows = spec.runs(envs)
    check_existing(artifacts, rows)
    status = "finished" if envs is None or set(spec.envs) <= set(envs) else "partial"
    write_record(artifacts, spec, status="running", spec_path=str(spec_path))
    runner = FlowRunContext.get().task_runner
    with lines_to_the_client(runner.client) if isinstance(runner, DaskTaskRunner) else contextlib.nullcontext():
        firsts = [r for r in rows if r["init_from"] is None]
        boots = {r["run_id"]: bootstrap_run.submit(r, artifacts.root) for r in firsts}
        results = _as_they_finish(boots, rows, lambda row: train_run.submit(row, artifacts.root), spec.name)
    failed = [r for r in results if r["status"] == "failed"]
    write_record(artifacts, spec, status="failed" if failed else status, results=results)
    if failed:
        raise RunsFailedError(f"{len(failed)} of {len(results)} runs of comparison {spec.name} failed: "
                              + "; ".join(f"{r['run_id']} ({r['error']})" for r in failed)
                              + ". The others are committed; rerun the same command to retry the failed ones "
                              "(finished runs are skipped)")
    return spec.name


class RunsFailedError(RuntimeError):
    """Some runs of a comparison failed; the others finished (``focus compare`` exits 1 with this one line)."""


def _as_they_finish(boots: dict[str, Any], rows: list[dict[str, Any]], start: Callable[[dict[str, Any]], Any],
                    name: str) -> list[dict[str, Any]]:
    """Start each run of ``rows`` as soon as the bootstrap it starts from (``boots``: run id -> future) has ended,
    and collect each run's result as it finishes, a failed run's too (with its error): a line per run and a progress
    bar over the grid. A run starts even when its bootstrap failed, and then fails in its own words, so one failure
    never stops the rest of the grid. (Prefect's ``wait_for`` leaves such a run NotReady, a pending state that never
    ends, with or without ``allow_failure``.)"""
    results: list[dict[str, Any]] = []
    waiting, running = dict(boots), {}
    with tqdm(total=len(rows), desc=f"compare {name}", unit="run") as bar:
        while waiting or running:
            for boot, future in list(waiting.items()):
                if future.state.is_final():
                    del waiting[boot]
                    running |= {k: start(row) for k, row in enumerate(rows)
                                if (row["init_from"] or row["run_id"]) == boot}
            for k, future in list(running.items()):
                if future.state.is_final():
                    try:
                        result = future.result()
                    except Exception as error:  # the run's own failure; the grid goes on without it
                        result = {"run_id": rows[k]["run_id"], "status": "failed", "seconds": None, "skipped": False,
                                  "error": f"{type(error).__name__}: {error}".splitlines()[0]}
                    results.append(result)
                    bar.update(1)
                    if result["status"] == "failed":
                        log.error("compare %s: %s failed: %s (%d/%d)", name, result["run_id"], result["error"],
                                  bar.n, len(rows))
                    else:
                        what = "already finished" if result["skipped"] else f"finished in {result['seconds']:.0f}s"
                        log.info("compare %s: %s %s (%d/%d)", name, result["run_id"], what, bar.n, len(rows))
                    del running[k]
            time.sleep(0.5)
    return results


def run_compare(spec_path: str, store: str | None = None, workers: int = 2, dask_address: str | None = None,
                envs: list[str] | None = None) -> str:
    """``focus compare``: the flow on a local Dask cluster of ``workers`` processes, or on ``dask_address``."""
    from flows.tracking import PARENT_RUN_ENV, compare_parent_run

    spec = load_spec(spec_path)  # fail fast, before a cluster starts: the spec, and the part of it asked for
    spec.runs(envs)
    runner = DaskTaskRunner(address=dask_address) if dask_address else local_cluster(workers)
    parent = compare_parent_run(spec.name, spec.model_dump())
    if parent:  # workers inherit the environment: each training run becomes the parent's child
        os.environ[PARENT_RUN_ENV] = parent
    try:
        return compare.with_options(task_runner=runner)(spec_path=str(spec_path), store=store, envs=envs)
    finally:
        os.environ.pop(PARENT_RUN_ENV, None)


def compare_rows(store: ArtifactStore, name: str) -> list[dict[str, Any]]:
    record = read_record(store, name)
    if record is None:
        raise ValueError(f"no comparison {name!r} under {store.root} (fix: run `focus compare SPEC.yaml --store "
                         f"{store.root}` first, or pass the store it ran in)")
    return record["runs"]
