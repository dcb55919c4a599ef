"""Data-parallel ``policy_update`` (``DataParallel``): two CPU processes under torchrun, their process group set
up by accelerate (gloo), take the same steps as one process alone — the same weights after two epochs, the same
logged loss and statistics — with token-mean and constant (Dr.GRPO) normalisers, and a minibatch of one
sequence, where one process has nothing to compute and still joins the reductions; with ``ppo.target_kl`` both
processes stop on the step one process alone stops on (the KL is reduced before either decides)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from focus_core.ports import free_ports
from tests.scripts.dp_update import problem, run

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("agg", "target_kl"), [("token_mean", None), ("constant", None), ("token_mean", 0.1)])
def test_two_processes_take_the_single_process_steps(tmp_path, agg, target_kl):
    out = tmp_path / "dp.pt"
    environ = {**os.environ, "OMP_NUM_THREADS": "1"}
    [port] = free_ports(1)  # for the processes' rendezvous
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                           "127.0.0.1", "--master_port", str(port), "-m", "tests.scripts.dp_update", str(out), agg,
                           *([] if target_kl is None else [str(target_kl)])],
                          env=environ, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    parallel = torch.load(out)
    torch.set_num_threads(1)
    model, report = run(agg, target_kl=target_kl)
    assert len(parallel["rows"]) == len(report.rows) >= 4
    assert parallel["kl_stop_step"] == report.kl_stop_step == (None if target_kl is None else 4)
    for mine, theirs in zip(report.rows, parallel["rows"], strict=True):
        for key in ("loss", "policy_loss", "entropy", "clip_fraction", "grad_norm"):
            assert theirs[key] == pytest.approx(mine[key], rel=1e-4, abs=1e-6), (key, mine["step"])
    assert parallel["gap"] == pytest.approx(report.behaviour_logprob_gap, abs=1e-6)
    assert parallel["approx_kl"] == pytest.approx(report.approx_kl, rel=1e-4, abs=1e-7)
    # Float sums in another order, then Adam: ~5e-6 apart, where the update moved the weights by ~1e-2.
    start = problem(agg)[0].state_dict()
    moved = max((w - start[n]).abs().max().item() for n, w in model.state_dict().items())
    assert moved > 5e-3
    for name, weights in model.state_dict().items():
        torch.testing.assert_close(parallel["state"][name], weights, rtol=1e-4, atol=2e-5, msg=name)
