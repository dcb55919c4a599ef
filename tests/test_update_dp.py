"""The update stage over 2 processes (``ppo.processes=2``: torchrun, accelerate, gloo on the CPU) takes the steps
of the one-process update: two runs of one config, one trained each way, commit the same update rows and
checkpoints equal within float summation order; the setting is left out of the stage's version."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from focus_core.artifacts import ArtifactStore
from focus_core.config import load_config
from tasks.stage import RunContext
from tests.test_pipeline import focus, table_rows, write_config

pytestmark = pytest.mark.slow


def test_a_two_process_update_commits_the_one_process_update(tmp_path):
    config = write_config(tmp_path)  # FOCUS: critic baselines give nonzero advantages even where all rewards are 0
    focus("train", "--config", str(config), "--store", str(tmp_path / "one"), "--run-id", "same", cwd=tmp_path)
    focus("train", "--config", str(config), "--store", str(tmp_path / "two"), "--run-id", "same",
          "--set", "ppo.processes=2", cwd=tmp_path)
    one, two = ArtifactStore(tmp_path / "one"), ArtifactStore(tmp_path / "two")
    mine, theirs = table_rows(one, "same", "updates"), table_rows(two, "same", "updates")
    assert len(mine) == len(theirs) >= 1
    for a, b in zip(mine, theirs, strict=True):
        for key in ("loss", "policy_loss", "entropy", "clip_fraction", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    weights = [load_file(store.fetch_folder("same", 0, "update", "policy") / "model.safetensors")
               for store in (one, two)]
    start = load_file(one.fetch_folder("same", 0, "bootstrap", "policy") / "model.safetensors")
    assert max((weights[0][n] - start[n]).abs().max().item() for n in start) > 1e-6  # the update moved them
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-4, atol=2e-5, msg=name)
    assert one.manifest("same", 0, "update").version == two.manifest("same", 0, "update").version


def test_processes_are_left_out_of_stage_versions():
    one, two = (RunContext(None, "r", load_config(None, [f"ppo.processes={n}"])) for n in (1, 4))
    assert one.fields("ppo") == two.fields("ppo") and "processes" not in one.fields("ppo")["ppo"]
