"""The training flow: bootstrap, then per iteration evaluate → rollout → segment → R × (acquire →
branch → fit_critic) → advantage → update, and a final evaluation (DESIGN.md, "The seven stages").

Every method is this flow with other settings: the GRPO family skips acquire/branch/fit_critic
(each commits a manifest that records the skip), PPO+GAE trains its value head and focus_nobranch fits
its critic without branching, VinePPO branches without a critic. All of them spend the same generated-token
budget per iteration.

Resume is the same call with the same ``run_id``: every stage whose manifest carries the expected
version is skipped (``tasks/stage.py``), so a killed run continues at the first stage it had not
committed and produces the tables an uninterrupted run would have. The flow passes only manifests
between tasks, never tensors.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import time
from datetime import UTC, datetime

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows.forms import TrainSettings
from flows.logs import to_prefect
from flows.tracking import Tracker
from focus_core.artifacts import ArtifactStore, Manifest, StoreUnavailable
from focus_core.config import FocusConfig, config_to_dict, load_config, validate_config
from focus_core.lease import hold
from tasks.acquire import acquire
from tasks.advantage import advantage
from tasks.bootstrap import bootstrap, tokens_per_iteration
from tasks.branch import branch
from tasks.evaluate import evaluate
from tasks.fit_critic import fit_critic
from tasks.inputs import CRITIC_FOLDER
from tasks.rollout import rollout
from tasks.segment import segment
from tasks.stage import RunContext
from tasks.update import update

DEFAULT_STORE = "runs"  # a local folder, relative to where `focus` runs; FOCUS_STORE overrides it
log = logging.getLogger("focus")


def temporary_api_on_a_port_the_os_gives() -> None:
    """Where no PREFECT_API_URL is set, Prefect starts a temporary API server for the process on first use, on a
    port it draws at random from 8000-8999 and finds free. Two processes starting at once can draw the same port;
    the one whose server then fails to bind finds the other's server answering and uses it, and when that process
    ends, its flow fails with "Connection refused" (seen in CI: two `focus train` started together, one's flow run
    in the other's database). Here the kernel picks the port (bind to port 0: one not in use, from its ~28,000
    ephemeral ports) and Prefect's server for this process is registered on it, as Prefect's own test harness
    does; should it be taken after all, Prefect draws another as before. Rarer, not impossible: the port is free
    from this probe until the server binds it."""
    if os.environ.get("PREFECT_API_URL"):
        return
    from prefect.server.api.server import SubprocessASGIServer

    if None in SubprocessASGIServer._instances:
        return  # this process has its temporary server already (running or registered)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    SubprocessASGIServer._instances[None] = SubprocessASGIServer(port=port)


temporary_api_on_a_port_the_os_gives()  # every process that runs a FOCUS flow imports this module first


def default_store() -> str:
    return os.environ.get("FOCUS_STORE", DEFAULT_STORE)


def new_run_id(cfg: FocusConfig) -> str:
    """``{method}-{UTC time}-{config hash}``: sortable, readable, and different for different configs."""
    digest = hashlib.sha256(repr(config_to_dict(cfg)).encode()).hexdigest()[:6]
    return f"{cfg.method}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{digest}"


def run_iteration(ctx: RunContext, i: int, policy: Manifest, reference: Manifest, critic: Manifest | None,
                  history: list[Manifest]) -> tuple[dict[str, Manifest], Manifest | None]:
    """One iteration's stages; returns their manifests by stage name and the critic to use next.

    ``history`` holds the last fit_critic manifest of every earlier iteration (the critic's replay).
    """
    cfg = ctx.config
    stages: dict[str, Manifest] = {}
    if i % cfg.env.eval_every == 0:
        stages["evaluate"] = evaluate(ctx, i, policy)
    stages["rollout"] = main = rollout(ctx, i, policy)
    stages["segment"] = seg = segment(ctx, i, main, policy)
    charged, branches, values = [main], [], None
    replay = history[-cfg.critic.replay_iterations:] if cfg.critic and cfg.critic.replay_iterations else []
    rounds = cfg.acquisition.rounds if cfg.acquisition is not None else 1
    for r in range(rounds):
        stages[f"acquire_r{r}"] = plan = acquire(ctx, i, r, seg, main, critic, list(charged))
        stages[f"branch_r{r}"] = grown = branch(ctx, i, r, plan, main, policy, list(charged))
        charged.append(grown)
        branches.append(grown)
        stages[f"fit_critic_r{r}"] = fit = fit_critic(ctx, i, r, seg, main, list(branches), list(replay), policy)
        if not fit.skipped:
            values = fit
            if CRITIC_FOLDER in fit.files:
                critic = fit
    if values is not None:
        history.append(values)
    # The branch stages' continuations train too with ppo.train_on_continuations (else they are not read).
    stages["advantage"] = adv = advantage(ctx, i, seg, values, main, policy, list(branches))
    stages["update"] = update(ctx, i, main, adv, policy, reference, list(branches))
    return stages, critic


@flow(name="focus-train", log_prints=False)
def train(settings: TrainSettings | None = None, config_path: str | None = None, overrides: list[str] | None = None,
          run_id: str | None = None, store: str | None = None) -> str:
    """Train (or resume, with an existing ``run_id``) and return the run id.

    ``settings`` are the UI form's typed fields (method, env, iterations, seed, budget), each an override;
    ``config_path`` is a YAML file (None: the built-in defaults), ``overrides`` are ``a.b=c`` strings (after
    the settings), ``store`` a local folder or ``s3://bucket/prefix`` (default ``$FOCUS_STORE`` or ``runs``).
    A resumed run uses the config stored with it; overrides are refused then, since they would
    silently change what the committed stages meant.
    """
    overrides = [*(settings.as_overrides() if settings else []), *(overrides or [])]
    artifacts = ArtifactStore(store or default_store())
    info = artifacts.run_info(run_id) if run_id else None
    if info is not None:
        if overrides or config_path:
            raise ValueError(f"run {run_id} exists: resume uses its stored config; start a new run to change it")
        cfg = validate_config(info["config"])
    else:
        cfg = load_config(config_path, overrides or [])
        run_id = run_id or new_run_id(cfg)
    with to_prefect(), hold(artifacts, run_id):  # one writer per run: a second `focus resume` of it refuses
        return _train(RunContext(artifacts, run_id, cfg), info)


def _train(ctx: RunContext, info: dict | None) -> str:
    artifacts, run_id, cfg = ctx.store, ctx.run_id, ctx.config
    tracker = Tracker(ctx)
    artifacts.write_run_info(run_id, {"status": "running", "config": config_to_dict(cfg),
                                      "mlflow_run_id": tracker.mlflow_run_id, "store": artifacts.root})
    log.info("run %s: method %s, %d iterations, env %s, store %s", run_id, cfg.method, cfg.iterations,
             cfg.env.name, artifacts.root)
    try:
        started, cpu_started = time.perf_counter(), time.process_time()
        # Wall and CPU seconds add up over the processes that worked on the run (resumes, compare's bootstrap).
        wall_before, cpu_before = (float(info.get(key, 0.0)) if info else 0.0 for key in ("wall_s", "cpu_s"))
        reference = policy = bootstrap(ctx)
        ctx = ctx.with_tokens_per_iteration(tokens_per_iteration(cfg, policy))
        tracker.ctx = ctx
        tracker.log_stage(0, "bootstrap", policy)
        log.info("run %s: B_tok = %d generated tokens per iteration (%s)", run_id, ctx.tokens_per_iteration,
                 "budget.tokens_per_iteration" if cfg.budget.tokens_per_iteration else
                 f"measured: {policy.figures['mean_episode_tokens']:.1f} per episode × P "
                 f"{cfg.budget.prompts_per_iteration} × G_grpo {cfg.budget.group_size_grpo}")
        critic, history = None, []
        walls = dict(info.get("iteration_wall_s", {})) if info else {}
        for i in range(cfg.iterations):
            iteration_started = time.perf_counter()
            stages, critic = run_iteration(ctx, i, policy, reference, critic, history)
            policy = stages["update"]
            walls[str(i)] = walls.get(str(i), 0.0) + time.perf_counter() - iteration_started
            try:  # bookkeeping, not results: a store that does not answer just now must not end the run
                artifacts.write_run_info(run_id, {"iteration_wall_s": walls,  # CPU: this process, all its threads
                                                  "wall_s": wall_before + time.perf_counter() - started,
                                                  "cpu_s": cpu_before + time.process_time() - cpu_started})
            except StoreUnavailable as error:
                log.warning("run %s: iteration %d's wall and CPU time not recorded (%s)", run_id, i, error)
            tracker.log_iteration(i, stages)
            _publish(ctx, i, stages)
        final = evaluate(ctx, cfg.iterations, policy)
        _publish_curve(ctx)
        tracker.log_iteration(cfg.iterations, {"evaluate": final})
        tracker.finish(policy, "FINISHED")
        artifacts.write_run_info(run_id, {"status": "finished", "wall_s": wall_before + time.perf_counter() - started,
                                          "cpu_s": cpu_before + time.process_time() - cpu_started})
    except BaseException:
        artifacts.write_run_info(run_id, {"status": "failed"})
        tracker.finish(None, "FAILED")
        raise
    log.info("run %s finished: held-out success %s", run_id, final.figures.get("heldout_success"))
    return run_id


def _publish(ctx: RunContext, i: int, stages: dict[str, Manifest]) -> None:
    """A small markdown table per iteration for the Prefect UI (stage, figures, compute seconds)."""
    lines = [f"### {ctx.run_id} — iteration {i}", "", "| stage | figures | compute s |", "|---|---|---|"]
    for name, manifest in stages.items():
        figures = manifest.skipped or ", ".join(f"{k} {_short(v)}" for k, v in manifest.figures.items())
        lines.append(f"| {name} | {figures} | {manifest.timings.get('compute_s', 0.0):.1f} |")
    try:
        create_markdown_artifact("\n".join(lines), key=f"iteration-{i}", description=f"{ctx.run_id} iteration {i}")
    except Exception as error:  # the UI table is a convenience; never fail a training run for it
        log.debug("no Prefect artifact for iteration %d: %s", i, error)


SPARKS = "▁▂▃▄▅▆▇█"


def _publish_curve(ctx: RunContext) -> None:
    """The learning curve for the Prefect UI: a table (held-out success and tokens per iteration) and a one-line
    sparkline, read from the committed evaluation and rollout manifests of the whole run (resumes included)."""
    heldout, train, tokens = {}, {}, {}
    for i, stage, manifest in ctx.store.committed(ctx.run_id):
        if stage == "evaluate" and "heldout_success" in manifest.figures:
            heldout[i] = float(manifest.figures["heldout_success"])
        elif stage == "rollout":
            train[i] = manifest.figures.get("success")
            tokens[i] = manifest.figures.get("tokens")
    rows = [{"iteration": i, "heldout_success": round(heldout[i], 4), "train_success": train.get(i),
             "main_tokens": tokens.get(i)} for i in sorted(heldout)]
    line = "".join(SPARKS[min(len(SPARKS) - 1, int(v * len(SPARKS)))] for v in (r["heldout_success"] for r in rows))
    try:
        create_table_artifact(rows, key="learning-curve", description=f"{ctx.run_id}: held-out success per iteration")
        create_markdown_artifact(
            f"### {ctx.run_id}: held-out success\n\n`{line}` {rows[0]['heldout_success']:.3f} → "
            f"{rows[-1]['heldout_success']:.3f} over iterations {rows[0]['iteration']}–{rows[-1]['iteration']}",
            key="learning-curve-line", description=f"{ctx.run_id} learning curve")
    except Exception as error:  # the UI's curve is a convenience; never fail a training run for it
        log.debug("no Prefect learning-curve artifact: %s", error)


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
