"""``focus serve`` and ``focus deploy --pool``: the train, eval and compare flows as deployments of a Prefect server.

Serving registers ``focus-train/default``, ``focus-eval/default`` and ``focus-compare/default`` with the server named by
``PREFECT_API_URL`` and then runs, in this process, every flow run the UI (or the REST API it uses)
starts: a run's parameters are the ``focus train`` options (the settings form, config path, overrides, run id,
store). Start a server with ``python -m infra.services up prefect``; it prints the ``PREFECT_API_URL`` line.

Deploying to a work pool registers ``focus-train/{pool}`` (and eval, compare) on the pool instead, and returns:
the pool's workers (``prefect worker start --pool NAME``, one per machine, e.g. per GPU node) pick the runs up.
The flows' source is this checkout's folder, so a worker on another machine needs the same checkout at the same
path, and every worker needs the same ``FOCUS_STORE`` (S3) and ``MLFLOW_TRACKING_URI``. A missing pool is
created as a ``process`` pool.
"""

from __future__ import annotations

import os
from pathlib import Path

from prefect import serve as prefect_serve

from flows.compare import compare
from flows.evaluate import evaluate_run
from flows.train import default_store, train

TRAIN_DEPLOYMENT = "focus-train/default"
EVAL_DEPLOYMENT = "focus-eval/default"
COMPARE_DEPLOYMENT = "focus-compare/default"


def deployments(store: str | None = None) -> list:
    root = store or default_store()
    return [
        train.to_deployment(name="default", parameters={"store": root},
                            description="Train a policy: the settings form (method, env, iterations, seed, budget), "
                                        "a config_path and overrides for the rest; with an existing run_id it "
                                        "resumes that run."),
        evaluate_run.to_deployment(name="default", parameters={"store": root},
                                   description="Held-out success of a run's policy (run_id, iteration, tasks)."),
        compare.to_deployment(name="default", parameters={"store": root},
                              description="A grid of training runs: a committed spec from the form, or a spec_path "
                                          "(a compare spec YAML); a rerun resumes it."),
    ]


def serve(store: str | None = None) -> None:
    if not os.environ.get("PREFECT_API_URL"):
        raise ValueError("focus serve needs a Prefect server: start one with `python -m infra.services up prefect` "
                         "and export the PREFECT_API_URL it prints")
    prefect_serve(*deployments(store))


SOURCE = Path(__file__).resolve().parents[1]  # the checkout the workers load the flows from
ENTRYPOINTS = {"focus-train": "flows/train.py:train", "focus-eval": "flows/evaluate.py:evaluate_run",
               "focus-compare": "flows/compare.py:compare"}


def deploy(pool: str, store: str | None = None) -> list[str]:
    """Register the three flows as deployments of work pool ``pool`` (created as a process pool if missing);
    returns the deployment names."""
    from prefect import Flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    if not os.environ.get("PREFECT_API_URL"):
        raise ValueError("focus deploy needs a Prefect server: start one with `python -m infra.services up prefect` "
                         "and export the PREFECT_API_URL it prints")
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
    names = []
    for made in deployments(store):
        source = Flow.from_source(str(SOURCE), ENTRYPOINTS[made.flow_name])
        source.deploy(name=pool, work_pool_name=pool, parameters=made.parameters, description=made.description,
                      build=False, push=False, print_next_steps=False)
        names.append(f"{made.flow_name}/{pool}")
    return names
