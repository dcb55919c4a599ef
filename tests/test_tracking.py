"""The MLflow tracker against a real local MLflow store (sqlite + file artifacts in a temporary folder).

The tracked run is the hand-made one of ``tests/test_sql.py`` (so the expected critic error, tokens and
advantage statistics are known), with a real tiny policy checkpoint so the registered model can be
loaded back. One module fixture drives the tracker the way ``flows/train.py`` does — including a second
``Tracker`` for the same run, as ``focus resume`` creates — and the tests inspect what MLflow holds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from flows.tracking import Tracker
from focus_core.artifacts import ArtifactStore
from focus_core.config import load_config
from focus_core.policy.models import tiny_policy
from focus_core.policy.tokenizer import train_tokenizer
from tasks.stage import RunContext
from tests.test_sql import ADVANTAGES, RUN, VALUES, build_run, fake_checkpoint

MODEL_NAME = "focus-deep_search-focus"


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory):
    """The hand-made run, tracked to the end; ``first``/``second`` are the MLflow run ids of both Trackers."""
    import mlflow

    folder = tmp_path_factory.mktemp("tracking")
    with pytest.MonkeyPatch.context() as patch:
        uri = f"sqlite:///{folder / 'mlflow.db'}"
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.setenv("FOCUS_MLFLOW_EXPERIMENT", "focus-tests")
        store = ArtifactStore(folder / "runs")
        policy = tiny_policy(train_tokenizer(["search the corpus", "answer: paris"] * 8, vocab_size=300),
                             layers=1, hidden=32, heads=2, intermediate=64)
        policy.save(folder / "policy")
        manifests = build_run(store, folder / "policy")
        ctx = RunContext(store, RUN, load_config(None, ["iterations=2"]), tokens_per_iteration=600)

        tracker = Tracker(ctx)
        tracker.log_stage(0, "bootstrap", manifests[0]["bootstrap"])
        tracker.log_iteration(0, {k: m for k, m in manifests[0].items() if k != "bootstrap"})
        resumed = Tracker(ctx)  # as after a crash: re-attach, then the flow logs every iteration again
        resumed.log_stage(0, "bootstrap", manifests[0]["bootstrap"])
        resumed.log_iteration(0, {k: m for k, m in manifests[0].items() if k != "bootstrap"})
        resumed.log_iteration(1, manifests[1])
        resumed.log_iteration(2, manifests[2])
        resumed.finish(manifests[1]["update"], "FINISHED")
        yield SimpleNamespace(uri=uri, client=mlflow.MlflowClient(uri), first=tracker.mlflow_run_id,
                              second=resumed.mlflow_run_id, registered=resumed.registered_model, store=store,
                              folder=folder)


def history(tracked, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in tracked.client.get_metric_history(tracked.first, key))


def test_one_mlflow_run_per_focus_run_with_params(tracked) -> None:
    assert tracked.first == tracked.second
    run = tracked.client.get_run(tracked.first)
    assert run.info.status == "FINISHED" and run.data.tags["focus.run_id"] == RUN
    assert run.info.run_name == RUN
    params = run.data.params
    assert params["method"] == "focus" and params["iterations"] == "2" and params["env.name"] == "deep_search"
    assert "ppo.lr" in params and all(len(value) <= 6000 for value in params.values())
    experiment = tracked.client.get_experiment(run.info.experiment_id)
    assert experiment.name == "focus-tests"
    assert experiment.artifact_location == (tracked.folder / "mlruns-artifacts").as_uri()


def test_metrics_per_iteration(tracked) -> None:
    assert history(tracked, "rollout.success") == [(0, 0.75), (1, 0.5)]  # not repeated by the resume
    assert history(tracked, "success.heldout") == [(0, 0.25), (2, 0.5)]
    assert history(tracked, "bootstrap.parameters") == [(0, 1234.0)]
    assert history(tracked, "time.update_s") == [(0, 3.0), (1, 3.0)]
    assert history(tracked, "tokens.total") == [(0, 528.0), (1, 528.0)]
    assert history(tracked, "tokens.branch") == [(0, 80.0), (1, 80.0)]
    assert history(tracked, "tokens.spend_share") == [(0, 528 / 600), (1, 528 / 600)]
    assert history(tracked, "update.kl") == [(0, pytest.approx(0.02)), (1, pytest.approx(0.03))]
    # out-of-sample critic error: iteration 0 has a critic only in round 1, iteration 1 in both rounds
    assert history(tracked, "critic.mc_mae_r1") == [(0, pytest.approx(0.1)), (1, pytest.approx(0.1))]
    assert history(tracked, "critic.mc_mae") == [(0, pytest.approx(0.1)), (1, pytest.approx(0.2))]
    assert history(tracked, "critic.rank_accuracy_r0") == [(1, 0.0)]  # 0.7 > 0.6 but MC says 0.5 < 1.0
    assert history(tracked, "critic.rank_accuracy") == [(0, 1.0), (1, 0.5)]
    returns = np.array([1, 1, 1, 1, 0, 0, 1, 1], dtype=float)  # own returns of iteration 0's states
    explained = 1 - np.var(returns - np.array(VALUES)) / np.var(returns)
    assert history(tracked, "values.explained_variance")[0] == (0, pytest.approx(explained))
    advantages = np.array(ADVANTAGES) * 2
    assert history(tracked, "advantage.std")[1] == (1, pytest.approx(advantages.std()))
    assert history(tracked, "advantage.abs_mean")[1] == (1, pytest.approx(np.abs(advantages).mean()))


def test_checkpoints_and_plot_are_artifacts(tracked) -> None:
    client = tracked.client
    paths = {f.path for f in client.list_artifacts(tracked.first, "checkpoints/iteration-0001/policy")}
    assert "checkpoints/iteration-0001/policy/config.json" in paths
    assert "checkpoints/iteration-0001/policy/model.safetensors" in paths
    assert [f.path for f in client.list_artifacts(tracked.first, "checkpoints/iteration-0000/critic")] == [
        "checkpoints/iteration-0000/critic/critic.json"]
    assert [f.path for f in client.list_artifacts(tracked.first, "plots")] == ["plots/learning_curves.png"]
    local = client.download_artifacts(tracked.first, "plots/learning_curves.png", str(tracked.folder))
    assert Path(local).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_final_policy_is_registered_and_loads(tracked) -> None:
    import mlflow

    assert tracked.registered == (MODEL_NAME, 1)
    mlflow.set_tracking_uri(tracked.uri)
    components = mlflow.transformers.load_model(f"models:/{MODEL_NAME}/1", return_type="components")
    assert components["model"].config.num_hidden_layers == 1
    assert components["tokenizer"].decode(components["tokenizer"].encode("answer: paris")) == "answer: paris"
    generated = mlflow.pyfunc.load_model(f"models:/{MODEL_NAME}/1").predict(["search the corpus"])
    assert len(generated) == 1 and isinstance(generated[0], str)


def test_missing_tables_and_mlflow_errors_do_not_stop_training(
    tracked, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracked.uri)
    monkeypatch.setenv("FOCUS_MLFLOW_EXPERIMENT", "focus-tests")
    store = ArtifactStore(tmp_path / "runs")
    rollout = store.commit("grpo-run", 0, "rollout", version="v", figures={"success": 0.5},
                           timings={"compute_s": 1.0})  # no tables at all
    skipped = {name: store.commit("grpo-run", 0, name, version="v", skipped="grpo has no critic")
               for name in ("acquire_r0", "branch_r0", "fit_critic_r0")}
    update = store.commit("grpo-run", 0, "update", version="v", folders={"policy": fake_checkpoint(tmp_path / "p")})
    tracker = Tracker(RunContext(store, "grpo-run", load_config(None, ["method=grpo"]), tokens_per_iteration=600))
    with caplog.at_level(logging.WARNING):
        tracker.log_iteration(0, {"rollout": rollout, **skipped, "update": update})
    assert [r.getMessage() for r in caplog.records if r.name.split(".")[0] in ("focus", "mlflow")] == []
    assert [(m.step, m.value) for m in tracked.client.get_metric_history(tracker.mlflow_run_id, "success.train")] == [
        (0, 0.5)]

    def broken(*args, **kwargs):
        raise ConnectionError("tracking server went away")

    monkeypatch.setattr(tracker.client, "log_batch", broken)
    monkeypatch.setattr(tracker.client, "set_terminated", broken)
    with caplog.at_level(logging.WARNING, logger="focus"):
        tracker.log_iteration(1, {"rollout": rollout})
        tracker.finish(update, "FINISHED")  # the policy folder is not a model: a warning, too
    messages = [record.getMessage() for record in caplog.records]
    assert any("logging iteration 1 failed (ConnectionError" in m for m in messages)
    assert any("registering the final policy failed" in m for m in messages)
    assert any("ending the MLflow run as FINISHED failed" in m for m in messages)


def test_default_store_is_sqlite_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("FOCUS_MLFLOW_EXPERIMENT", raising=False)
    monkeypatch.chdir(tmp_path)
    store = ArtifactStore(tmp_path / "runs")
    tracker = Tracker(RunContext(store, "first-run", load_config(None, []), tokens_per_iteration=600))
    tracker.finish(None, "FAILED")
    assert (tmp_path / "mlruns.db").is_file()
    run = tracker.client.get_run(tracker.mlflow_run_id)
    assert run.info.status == "FAILED"
    experiment = tracker.client.get_experiment(run.info.experiment_id)
    assert experiment.name == "focus" and experiment.artifact_location == (tmp_path / "mlruns-artifacts").as_uri()


def test_resumed_finished_run_does_not_register_the_policy_again(tracked, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracked.uri)
    monkeypatch.setenv("FOCUS_MLFLOW_EXPERIMENT", "focus-tests")
    again = Tracker(RunContext(tracked.store, RUN, load_config(None, ["iterations=2"]), tokens_per_iteration=600))
    again.finish(tracked.store.manifest(RUN, 1, "update"), "FINISHED")
    assert again.mlflow_run_id == tracked.first and again.registered_model == (MODEL_NAME, 1)
    assert [int(v.version) for v in tracked.client.search_model_versions(f"name='{MODEL_NAME}'")] == [1]
    assert tracked.client.get_run(tracked.first).info.status == "FINISHED"
