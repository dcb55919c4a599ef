"""The update stage over ``ppo.processes`` processes: the same steps as one process (``focus_core.ppo.DataParallel``).

The stage writes its batch to its scratch folder (flat numpy arrays, no pickles) with a small JSON of what the
workers need to find the rest in the store (run, config, the policy and reference manifests, the seed), then
runs ``torchrun --nproc_per_node N -m tasks.update SCRATCH``: the update stage's own module, whose entry point
calls ``worker`` with its ``train`` (so this module does not import the stage back). Every process loads the
policy from the store, packs the same minibatches and trains its share of each (accelerate sets up the process
group: gloo on CPUs, NCCL on GPUs); the first process writes the new checkpoint and the update's report, which the
stage commits as if it had trained alone. A failed worker ends the stage with its last lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path

import numpy as np

from focus_core.artifacts import ArtifactStore, Manifest
from focus_core.config import config_to_dict, validate_config
from focus_core.ports import free_ports
from focus_core.ppo import SequenceLike, TrainingSequence, UpdateReport, accelerate_data_parallel
from tasks.inputs import POLICY_FOLDER
from tasks.stage import RunContext

BATCH, SPEC, REPORT = "batch.npz", "update.json", "report.json"


def train_in_processes(ctx: RunContext, policy: Manifest, reference: Manifest, sequences: Sequence[SequenceLike],
                       token_adv: Sequence[np.ndarray], value_returns: Sequence[np.ndarray] | None,
                       old_values: Sequence[np.ndarray] | None, seed: int, scratch: Path) -> UpdateReport:
    """``tasks.update.train`` on ``ctx.config.ppo.processes`` processes; the checkpoint lands in
    ``scratch/policy``."""
    lengths = np.array([len(s.token_ids) for s in sequences], dtype=np.int64)
    arrays = {"lengths": lengths, "token_ids": _flat([s.token_ids for s in sequences], np.int64),
              "old_logprobs": _flat([s.old_logprobs for s in sequences], np.float32),
              "loss_mask": _flat([s.loss_mask for s in sequences], np.int64),
              "advantages": _flat(token_adv, np.float64)}
    if value_returns is not None:
        arrays |= {"returns": _flat(value_returns, np.float64), "values": _flat(old_values, np.float64)}
    np.savez(scratch / BATCH, **arrays)
    (scratch / SPEC).write_text(json.dumps({
        "store": ctx.store.root, "run_id": ctx.run_id, "config": config_to_dict(ctx.config), "seed": seed,
        "policy": [policy.iteration, policy.stage], "reference": [reference.iteration, reference.stage]}))
    [port] = free_ports(1)  # for the processes' rendezvous
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ctx.config.ppo.processes),
               "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "tasks.update", str(scratch)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"update: the {ctx.config.ppo.processes}-process update failed (exit {done.returncode}); "
                           f"its last lines:\n{done.stderr[-3000:]}")
    report = json.loads((scratch / REPORT).read_text())
    return UpdateReport(**report, optimizer_state={})


def _flat(arrays: Sequence[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]) if arrays else np.zeros(0, dtype=dtype)


def _split(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []


def worker(scratch: Path, train: Callable[..., UpdateReport]) -> None:
    """One process of the update (run by torchrun): the batch from ``scratch``, the policy from the store, trained
    by ``train`` (``tasks.update.train``)."""
    import torch

    torch.set_num_threads(1)
    spec = json.loads((scratch / SPEC).read_text())
    ctx = RunContext(ArtifactStore(spec["store"]), spec["run_id"], validate_config(spec["config"]))
    policy = ctx.store.manifest(ctx.run_id, *spec["policy"])
    reference = ctx.store.manifest(ctx.run_id, *spec["reference"])
    with np.load(scratch / BATCH) as batch:
        lengths = batch["lengths"]
        sequences = [TrainingSequence(t, o, m) for t, o, m in zip(
            _split(batch["token_ids"], lengths), _split(batch["old_logprobs"], lengths),
            _split(batch["loss_mask"], lengths), strict=True)]
        token_adv = _split(batch["advantages"], lengths)
        returns = _split(batch["returns"], lengths) if "returns" in batch else None
        values = _split(batch["values"], lengths) if "values" in batch else None
    data_parallel = accelerate_data_parallel()
    try:
        report = train(ctx, policy, reference, sequences, token_adv, returns, values, spec["seed"],
                       scratch / POLICY_FOLDER, data_parallel=data_parallel)
        if data_parallel is None or data_parallel.rank == 0:
            figures = {f.name: getattr(report, f.name) for f in fields(report) if f.name != "optimizer_state"}
            (scratch / REPORT).write_text(json.dumps(figures, default=float))
    finally:
        if data_parallel is not None:
            data_parallel.close()
