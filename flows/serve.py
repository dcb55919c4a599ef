"""``focus serve``: the train and eval flows as deployments of a Prefect server, for the Prefect UI.

Serving registers ``focus-train/default``, ``focus-eval/default`` and ``focus-compare/default`` with the server named by
``PREFECT_API_URL`` and then runs, in this process, every flow run the UI (or the REST API it uses)
starts: a run's parameters are the ``focus train`` options (config path, overrides, run id, store).
Start a server with ``python -m infra.services up prefect``; it prints the ``PREFECT_API_URL`` line.
"""

from __future__ import annotations

import os

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
                            description="Train a policy (parameters: config_path, overrides, run_id, store); "
                                        "with an existing run_id it resumes that run."),
        evaluate_run.to_deployment(name="default", parameters={"store": root},
                                   description="Held-out success of a run's policy (run_id, iteration, tasks)."),
        compare.to_deployment(name="default", parameters={"store": root},
                              description="A grid of training runs (spec_path: a compare spec YAML, e.g. "
                                          "configs/compare/traps.yaml); a rerun resumes it."),
    ]


def serve(store: str | None = None) -> None:
    if not os.environ.get("PREFECT_API_URL"):
        raise ValueError("focus serve needs a Prefect server: start one with `python -m infra.services up prefect` "
                         "and export the PREFECT_API_URL it prints")
    prefect_serve(*deployments(store))
