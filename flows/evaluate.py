"""``focus eval``: held-out success of a run's policy checkpoint, outside the training loop.

Evaluates the policy after a given iteration's update (default: the last committed one, or the
bootstrap policy of a run without updates) on the run's held-out tasks, with the same fixed task
sample and sampling seed as the in-run evaluations, so the numbers are comparable with
``focus sql RUN reward_trend``. Nothing is committed: this is a read-only query of a run.
"""

from __future__ import annotations

from prefect import flow

from flows.logs import to_prefect
from flows.train import default_store
from focus_core.artifacts import ArtifactStore
from focus_core.config import validate_config
from tasks import evaluate as evaluate_stage
from tasks.stage import RunContext


@flow(name="focus-eval", log_prints=False)
def evaluate_run(run_id: str, store: str | None = None, iteration: int | None = None,
                 tasks: int | None = None) -> dict:
    with to_prefect():
        return _evaluate_run(run_id, store, iteration, tasks)


def _evaluate_run(run_id: str, store: str | None, iteration: int | None, tasks: int | None) -> dict:
    artifacts = ArtifactStore(store or default_store())
    info = artifacts.run_info(run_id)
    if info is None:
        raise ValueError(f"no run {run_id!r} under {artifacts.root} (see `focus runs`)")
    cfg = validate_config(info["config"])
    if tasks is not None:
        cfg = cfg.model_copy(update={"env": cfg.env.model_copy(update={"eval_tasks": tasks})})
    ctx = RunContext(artifacts, run_id, cfg)
    updates = {i: m for i, stage, m in artifacts.committed(run_id) if stage == "update"}
    if iteration is not None and iteration not in updates:
        raise ValueError(f"run {run_id} has no committed update at iteration {iteration}; "
                         f"committed: {sorted(updates) or 'none'}")
    chosen = iteration if iteration is not None else max(updates, default=None)
    policy = updates[chosen] if chosen is not None else artifacts.manifest(run_id, 0, "bootstrap")
    if policy is None:
        raise ValueError(f"run {run_id} has no policy checkpoint yet (bootstrap not committed); resume it first")
    result = evaluate_stage.compute(ctx, policy.iteration, policy, scratch=None)
    return {"run_id": run_id, "policy_version": result.policy_version, "tasks": cfg.env.eval_tasks,
            **result.figures}
