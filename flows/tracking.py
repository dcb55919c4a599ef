"""MLflow tracking of a training run: config, per-iteration metrics, checkpoints, curves, the final model.

The artifact store is the ledger (DESIGN.md); MLflow is the window people look through. So the tracker
only *reads* what the stages committed (manifests and their tables) and never decides anything, and
tracking must never cost a training run: after construction every MLflow failure becomes one warning
and training goes on. Construction may fail loudly, since a wrong tracking URI is a set-up error.

One MLflow run per FOCUS run, found again by its tag ``focus.run_id``: ``focus resume`` re-attaches to
the run that ``focus train`` created, so one run holds one learning curve. Resume re-logs every
iteration, so each logged iteration leaves a marker metric (``focus.iteration``) and a marked iteration
is not logged twice.

Metrics of iteration i, all at step i:

* ``{stage}.{figure}`` for every numeric manifest figure, ``time.{stage}_s`` for each stage's compute;
* ``tokens.{main,branch,summary,total}`` from the iteration's ``budget_ledger`` tables, ``tokens.budget``
  (B_tok) and ``tokens.spend_share`` (total / B_tok: 0.9-1.0 for every method);
* ``critic.mc_mae`` and ``critic.rank_accuracy`` (per round too: ``..._r{r}``): out-of-sample critic
  error. The acquisition table of round r holds the critic's predictions made *before* round r's
  branches were sampled, so comparing them with the Monte-Carlo means of ``branch_r{r}`` at the same
  states (continuations cut off by the budget left out, as ``fit_critic`` does) measures
  generalisation, unlike the in-sample ``fit_critic`` figure. Ranking accuracy is the
  share of state pairs with different MC means that the critic orders the same way (ties count half);
  ordering is what acquisition needs;
* ``values.explained_variance``: 1 - Var(own return - V̂) / Var(own return) over the iteration's states;
* ``advantage.{mean,std,abs_mean}`` from the advantages table; ``success.{train,heldout}``, and on trap
  environments ``success.heldout_exact``.

Defaults follow reference/tooling.md §6: ``sqlite:///<cwd>/mlruns.db`` with artifacts in
``<cwd>/mlruns-artifacts`` (any sqlite database gets a ``mlruns-artifacts`` folder beside it, not
MLflow's ``./mlruns`` relative to wherever the process happens to run). The final model is logged with
explicit ``pip_requirements`` (else MLflow adds a torchvision that cannot import beside the CPU torch)
and a ``model_config`` for generation, and registered as ``focus-{env}-{method}``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from focus_core.artifacts import COMPUTE_TIMING, Manifest
from focus_core.config import config_to_dict
from focus_core.locks import exclusive_file_lock
from tasks.stage import RunContext

log = logging.getLogger("focus")

RUN_TAG = "focus.run_id"
DONE_MARKER = "focus.iteration"  # logged last for each iteration: "this step is complete"
PARENT_RUN_ENV = "FOCUS_MLFLOW_PARENT_RUN_ID"  # set by `focus compare`: the MLflow run its training runs nest under
COMPARE_TAG = "focus.compare"
POLICY_FOLDER, CRITIC_FOLDER = "policy", "critic"  # as in tasks/inputs.py
MAX_PARAM_VALUE = 6000  # MLflow's limits
MAX_KEY = 250
CURVES = (("success.heldout", "held-out success"), ("success.train", "train success"), ("update.kl", "KL"),
          ("critic.mc_mae", "critic vs MC error (out of sample)"))


@contextlib.contextmanager
def first_use(tracking_uri: str) -> Iterator[None]:
    """Where a client first touches its tracking store. MLflow creates and migrates a fresh sqlite database on
    first use, and processes doing that at once crash ("duplicate column name: step") or leave it half-migrated,
    so for sqlite the block holds an exclusive file lock beside the database (``mlruns.db.lock``): concurrent
    runs then migrate it one after another. Also hides SQLAlchemy's deprecation notices from MLflow's store code."""
    with contextlib.ExitStack() as stack:
        if tracking_uri.startswith("sqlite:///"):
            database = Path(tracking_uri.removeprefix("sqlite:///")).resolve()
            stack.enter_context(exclusive_file_lock(f"{database}.lock"))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


class Tracker:
    """The MLflow side of one FOCUS run (see the module docstring); ``flows/train.py`` drives it."""

    def __init__(self, ctx: RunContext) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        import mlflow  # deferred: importing MLflow costs over a second

        if "MLFLOW_LOGGING_LEVEL" not in os.environ:  # no INFO lines about database migrations
            logging.getLogger("mlflow").setLevel(logging.WARNING)
        self.ctx = ctx
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlruns.db'}"
        mlflow.set_tracking_uri(self.tracking_uri)  # the model logging in finish() uses the fluent API
        self.registered_model: tuple[str, int] | None = None  # (name, version) once finish() registered it
        with first_use(self.tracking_uri):
            self.client = mlflow.MlflowClient(self.tracking_uri)
            self.mlflow_run_id = self._attach_or_create(self._experiment())
            self._done = {int(m.step) for m in self.client.get_metric_history(self.mlflow_run_id, DONE_MARKER)}
            self._log_params()

    # --- set-up

    def _experiment(self) -> str:
        name = os.environ.get("FOCUS_MLFLOW_EXPERIMENT", "focus")
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = None  # a tracking server decides where artifacts go
        if self.tracking_uri.startswith("sqlite:///"):  # a local database: its artifacts go next to it
            database = Path(self.tracking_uri.removeprefix("sqlite:///")).resolve()
            location = (database.parent / "mlruns-artifacts").as_uri()
        try:
            return self.client.create_experiment(name, artifact_location=location)
        except Exception:  # another process created it in the meantime
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _attach_or_create(self, experiment_id: str) -> str:
        run_id = self.ctx.run_id
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'",
                                        max_results=1, order_by=["attributes.start_time DESC"])
        if found:
            run = found[0]
            if run.info.status != "RUNNING":
                self.client.update_run(run.info.run_id, status="RUNNING")
            log.info("MLflow: re-attached to run %s of %s", run.info.run_id, run_id)
            return run.info.run_id
        cfg = self.ctx.config
        tags = {RUN_TAG: run_id, "focus.method": cfg.method, "focus.env": cfg.env.name,
                "focus.store": self.ctx.store.root}
        parent = os.environ.get(PARENT_RUN_ENV)
        if parent:  # a run of `focus compare`: MLflow nests it under the comparison's run
            tags["mlflow.parentRunId"] = parent
        return self.client.create_run(experiment_id, run_name=run_id, tags=tags).info.run_id

    def _log_params(self) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.mlflow_run_id).data.params
        params = []
        for key, value in _flatten(config_to_dict(self.ctx.config)).items():
            if len(key) > MAX_KEY:
                continue
            value = value[:MAX_PARAM_VALUE]
            if key not in existing:
                params.append(Param(key, value))
            elif existing[key] != value:  # MLflow params cannot change; resume keeps the stored config anyway
                log.warning("MLflow: param %s is %r in run %s, not %r; kept", key, existing[key],
                            self.mlflow_run_id, value)
        for start in range(0, len(params), 100):
            self.client.log_batch(self.mlflow_run_id, params=params[start:start + 100])

    # --- what flows/train.py calls

    def log_stage(self, iteration: int, stage: str, manifest: Manifest) -> None:
        """Figures and time of one stage (train.py: the bootstrap), at step ``iteration``."""
        with self._guard(f"logging stage {stage} of iteration {iteration}"):
            logged = self.client.get_metric_history(self.mlflow_run_id, f"time.{stage}_s")
            if any(m.step == iteration for m in logged):
                return  # logged before this resume
            self._log_metrics(iteration, _stage_metrics(stage, manifest))

    def log_iteration(self, i: int, stages: Mapping[str, Manifest]) -> None:
        """Everything about iteration ``i`` (see the module docstring); missing tables are skipped."""
        with self._guard(f"logging iteration {i}"):
            if i in self._done:
                return
            metrics: dict[str, float] = {}
            for stage, manifest in stages.items():
                metrics |= _stage_metrics(stage, manifest)
            for part in (self._token_metrics, self._critic_metrics, self._value_metrics, self._advantage_metrics):
                with self._guard(f"{part.__name__.strip('_')} of iteration {i}"):
                    metrics |= part(stages)
            self._log_metrics(i, metrics)
            with self._guard(f"checkpoints of iteration {i}"):
                self._log_checkpoints(i, stages)
            with self._guard("learning curves"):
                self._log_curves()
            self._log_metrics(i, {DONE_MARKER: float(i)})
            self._done.add(i)

    def finish(self, policy: Manifest | None, status: str) -> None:
        """End the MLflow run; on FINISHED first register ``policy`` as ``focus-{env}-{method}``."""
        if status == "FINISHED" and policy is not None:
            with self._guard("registering the final policy"):
                self._register(policy)
        with self._guard(f"ending the MLflow run as {status}"):
            self.client.set_terminated(self.mlflow_run_id, status)

    # --- metrics from tables

    def _read(self, manifest: Manifest | None, table: str):
        """A committed table, or None where the stage did not run, was skipped or wrote no such table."""
        if manifest is None or table not in manifest.tables:
            return None
        return self.ctx.store.read_table(self.ctx.run_id, manifest.iteration, manifest.stage, table)

    def _token_metrics(self, stages: Mapping[str, Manifest]) -> dict[str, float]:
        spent: dict[str, float] = {}
        for stage, manifest in stages.items():
            if stage != "rollout" and not stage.startswith("branch_r"):
                continue
            ledger = self._read(manifest, "budget_ledger")
            for row in [] if ledger is None else ledger.select(["kind", "tokens"]).to_pylist():
                key = f"tokens.{row['kind']}"
                spent[key] = spent.get(key, 0.0) + row["tokens"]
        if not spent:
            return {}
        total = sum(spent.values())
        budget = self.ctx.tokens_per_iteration
        return {**spent, "tokens.total": total, "tokens.budget": float(budget), "tokens.spend_share": total / budget}

    def _critic_metrics(self, stages: Mapping[str, Manifest]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        errors, correct, pairs = [], 0.0, 0
        for r in sorted(int(name.removeprefix("acquire_r")) for name in stages if name.startswith("acquire_r")):
            plan = self._read(stages[f"acquire_r{r}"], "acquisition")
            grown = self._read(stages.get(f"branch_r{r}"), "branches")
            if plan is None or grown is None:
                continue
            predicted: dict[str, list[float]] = {}
            for state, value in zip(plan["state_id"].to_pylist(), plan["critic_mean"].to_pylist(), strict=True):
                if value is not None:
                    predicted.setdefault(state, []).append(value)
            episodes = self._read(stages[f"branch_r{r}"], "episodes")
            cut = set() if episodes is None else {  # as in fit_critic: a cut-off return is not a sample
                e for e, was_cut in zip(episodes["episode_id"].to_pylist(), episodes["budget_cut"].to_pylist(),
                                        strict=True) if was_cut}
            returns: dict[str, list[float]] = {}
            for state, value, episode in zip(grown["state_id"].to_pylist(), grown["return"].to_pylist(),
                                             grown["episode_id"].to_pylist(), strict=True):
                if episode not in cut:
                    returns.setdefault(state, []).append(value)
            states = sorted(set(predicted) & set(returns))
            if not states:
                continue  # no critic yet (first round), or nothing branched
            critic = np.array([np.mean(predicted[s]) for s in states])
            mc = np.array([np.mean(returns[s]) for s in states])
            round_correct, round_pairs = _ranking(critic, mc)
            metrics |= {f"critic.mc_mae_r{r}": float(np.abs(critic - mc).mean()), f"critic.mc_states_r{r}": len(states)}
            if round_pairs:
                metrics[f"critic.rank_accuracy_r{r}"] = round_correct / round_pairs
            errors += list(np.abs(critic - mc))
            correct, pairs = correct + round_correct, pairs + round_pairs
        if errors:
            metrics["critic.mc_mae"] = float(np.mean(errors))
        if pairs:
            metrics["critic.rank_accuracy"] = correct / pairs
        return metrics

    def _value_metrics(self, stages: Mapping[str, Manifest]) -> dict[str, float]:
        fits = sorted((int(name.removeprefix("fit_critic_r")), m) for name, m in stages.items()
                      if name.startswith("fit_critic_r") and "values" in m.tables)
        states = self._read(stages.get("segment"), "states")
        if not fits or states is None:
            return {}
        values = self._read(fits[-1][1], "values")  # the last fit's values are the ones advantages used
        own = {(e, k): g for e, k, g in zip(states["episode_id"].to_pylist(), states["segment_idx"].to_pylist(),
                                            states["own_return"].to_pylist(), strict=True)}
        keys = list(zip(values["episode_id"].to_pylist(), values["segment_idx"].to_pylist(), strict=True))
        metrics = {}
        for name, column in (("explained_variance", "value"), ("explained_variance_critic", "critic_mean")):
            pairs = [(own[key], v) for key, v in zip(keys, values[column].to_pylist(), strict=True)
                     if key in own and v is not None]
            if len(pairs) > 1 and np.var([g for g, _ in pairs]) > 0:
                returns, predicted = np.array(pairs).T
                metrics[f"values.{name}"] = float(1.0 - np.var(returns - predicted) / np.var(returns))
        return metrics

    def _advantage_metrics(self, stages: Mapping[str, Manifest]) -> dict[str, float]:
        table = self._read(stages.get("advantage"), "advantages")
        if table is None or table.num_rows == 0:
            return {}
        advantage = table["advantage"].to_numpy()
        return {"advantage.mean": float(advantage.mean()), "advantage.std": float(advantage.std()),
                "advantage.abs_mean": float(np.abs(advantage).mean())}

    # --- MLflow calls

    def _log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, float(value), now, step) for key, value in metrics.items()
                 if len(key) <= MAX_KEY and math.isfinite(value)]
        for start in range(0, len(batch), 1000):
            self.client.log_batch(self.mlflow_run_id, metrics=batch[start:start + 1000])

    def _log_checkpoints(self, i: int, stages: Mapping[str, Manifest]) -> None:
        store, run_id = self.ctx.store, self.ctx.run_id
        update = stages.get("update")
        if update is not None and POLICY_FOLDER in update.files:
            folder = store.fetch_folder(run_id, update.iteration, update.stage, POLICY_FOLDER)
            self.client.log_artifacts(self.mlflow_run_id, str(folder), f"checkpoints/iteration-{i:04d}/policy")
        fits = sorted((int(name.removeprefix("fit_critic_r")), m) for name, m in stages.items()
                      if name.startswith("fit_critic_r") and CRITIC_FOLDER in m.files)
        if fits:
            fit = fits[-1][1]
            folder = store.fetch_folder(run_id, fit.iteration, fit.stage, CRITIC_FOLDER)
            self.client.log_artifacts(self.mlflow_run_id, str(folder), f"checkpoints/iteration-{i:04d}/critic")

    def _log_curves(self) -> None:
        """``plots/learning_curves.png`` from the metric history, so a resumed run's plot covers all of it."""
        from matplotlib.figure import Figure  # the object API: no pyplot, no global backend switch

        figure = Figure(figsize=(10, 7), layout="constrained")
        for axes, (key, title) in zip(figure.subplots(2, 2).flat, CURVES, strict=True):
            points = {m.step: m.value for m in sorted(self.client.get_metric_history(self.mlflow_run_id, key),
                                                      key=lambda m: m.timestamp)}
            steps = sorted(points)
            axes.plot(steps, [points[s] for s in steps], marker="o")
            axes.set(title=title, xlabel="iteration")
            axes.grid(alpha=0.3)
        figure.suptitle(f"{self.ctx.run_id} ({self.ctx.config.method}, {self.ctx.config.env.name})")
        with tempfile.TemporaryDirectory(prefix="focus-plot-") as scratch:
            path = Path(scratch, "learning_curves.png")
            figure.savefig(path, dpi=100)
            self.client.log_artifact(self.mlflow_run_id, str(path), "plots")

    def _register(self, policy: Manifest) -> None:
        """Log the final checkpoint as a transformers model and register it (reference/tooling.md §6)."""
        import mlflow
        import torch
        import transformers

        cfg = self.ctx.config
        name = f"focus-{cfg.env.name}-{cfg.method}"
        tags = self.client.get_run(self.mlflow_run_id).data.tags
        if tags.get("focus.registered_policy") == policy.hash:  # a resumed finished run: registered already
            registered, version = tags["focus.registered_model"].rsplit("/", 1)
            self.registered_model = (registered, int(version))
            return
        folder = self.ctx.store.fetch_folder(self.ctx.run_id, policy.iteration, policy.stage, POLICY_FOLDER)
        captured = io.StringIO()  # progress bars and "Successfully registered" lines
        mlflow_logger = logging.getLogger("mlflow")
        level = mlflow_logger.level
        mlflow_logger.setLevel(logging.ERROR)  # model-card and licence warnings do not apply to our checkpoints
        try:
            with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
                tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
                mlflow.set_tracking_uri(self.tracking_uri)
                active = mlflow.active_run()
                if active is not None and active.info.run_id != self.mlflow_run_id:
                    raise RuntimeError(f"another MLflow run ({active.info.run_id}) is active in this process")
                with mlflow.start_run(run_id=self.mlflow_run_id) if active is None else contextlib.nullcontext():
                    info = mlflow.transformers.log_model(
                        {"model": model, "tokenizer": tokenizer}, name="policy", task="text-generation",
                        registered_model_name=name,
                        pip_requirements=[f"transformers=={transformers.__version__}",
                                          f"torch=={torch.__version__.split('+')[0]}"],
                        model_config={"max_new_tokens": cfg.agent.max_action_tokens, "do_sample": False},
                        tags={RUN_TAG: self.ctx.run_id, "focus.policy_version": str(policy.policy_version)},
                    )
        finally:
            mlflow_logger.setLevel(level)
            log.debug("MLflow model logging output:\n%s", captured.getvalue())
        self.registered_model = (name, int(info.registered_model_version))
        self.client.set_tag(self.mlflow_run_id, "focus.registered_model", f"{name}/{info.registered_model_version}")
        self.client.set_tag(self.mlflow_run_id, "focus.registered_policy", policy.hash)
        log.info("MLflow: registered the final policy as %s version %s", name, info.registered_model_version)

    @contextlib.contextmanager
    def _guard(self, what: str) -> Iterator[None]:
        """Tracking never fails training: an error becomes one warning."""
        try:
            yield
        except Exception as error:
            log.warning("MLflow tracking: %s failed (%s: %s); training continues", what, type(error).__name__,
                        error)


def compare_parent_run(name: str, spec: Mapping[str, Any]) -> str | None:
    """The MLflow run of comparison ``name`` (created once, re-attached on a rerun), with the spec as parameters;
    None when MLflow cannot be reached (a comparison never fails for its tracking)."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    import mlflow

    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlruns.db'}"
    try:
        with first_use(uri):
            client = mlflow.MlflowClient(uri)
            name_of_experiment = os.environ.get("FOCUS_MLFLOW_EXPERIMENT", "focus")
            experiment = client.get_experiment_by_name(name_of_experiment)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(name_of_experiment)
            found = client.search_runs([experiment_id], filter_string=f"tags.`{COMPARE_TAG}` = '{name}'",
                                       max_results=1)
            if found:
                return found[0].info.run_id
            run = client.create_run(experiment_id, run_name=f"compare-{name}", tags={COMPARE_TAG: name})
            for key, value in _flatten(dict(spec)).items():
                client.log_param(run.info.run_id, key[:MAX_KEY], value[:MAX_PARAM_VALUE])
            return run.info.run_id
    except Exception as error:  # noqa: BLE001 - tracking is a convenience here
        log.warning("compare %s: no MLflow parent run (%s); the runs are tracked on their own", name, error)
        return None


def _stage_metrics(stage: str, manifest: Manifest) -> dict[str, float]:
    metrics = {f"{stage}.{name}": float(value) for name, value in manifest.figures.items()
               if isinstance(value, int | float) and not isinstance(value, bool)}
    if COMPUTE_TIMING in manifest.timings:
        metrics[f"time.{stage}_s"] = float(manifest.timings[COMPUTE_TIMING])
    aliases = {"rollout": ("success", "success.train"), "evaluate": ("heldout_success", "success.heldout")}
    if stage in aliases and aliases[stage][0] in manifest.figures:
        metrics[aliases[stage][1]] = float(manifest.figures[aliases[stage][0]])
    if stage == "evaluate" and "heldout_success_exact" in manifest.figures:  # trap environments: exact V^π(s_0)
        metrics["success.heldout_exact"] = float(manifest.figures["heldout_success_exact"])
    return metrics


def _ranking(critic: np.ndarray, mc: np.ndarray) -> tuple[float, int]:
    """(correctly ordered pairs, pairs) over state pairs with different MC means; critic ties count half."""
    upper = np.triu_indices(len(mc), k=1)
    mc_order = np.sign(mc[:, None] - mc[None, :])[upper]
    critic_order = np.sign(critic[:, None] - critic[None, :])[upper]
    informative = mc_order != 0
    agreement = np.where(critic_order == 0, 0.5, (critic_order == mc_order).astype(float))
    return float(agreement[informative].sum()), int(informative.sum())


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"ppo": {"lr": 1e-5}}`` -> ``{"ppo.lr": "1e-05"}``; lists, empty sections and None as JSON."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat |= _flatten(value, f"{name}.")
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return flat
