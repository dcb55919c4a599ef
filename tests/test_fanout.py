"""Scale-out that must not change results: fan-out inside a stage (tasks/fanout.py: where shards are cut; a run
whose generating stages play on a real local Dask cluster of 2 workers) and the update on 2 processes
(tasks/update_dp.py) commit the tables of the same run played serially."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

from focus_core.artifacts import ArtifactStore
from tasks.fanout import shard_bounds
from tests.test_pipeline import TABLES, focus, table_rows, write_config


@given(st.lists(st.integers(0, 4), min_size=1, max_size=60), st.integers(1, 8))
def test_shards_are_contiguous_cover_everything_and_cut_where_the_seed_changes(runs, shards):
    seeds = [seed for k, seed in enumerate(runs) for _ in range(1 + k % 3)]  # runs of one seed, like groups
    bounds = shard_bounds(seeds, shards)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(seeds)
    assert all(low < high for low, high in bounds)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert len(bounds) <= min(shards, len(seeds))


def test_shard_bounds_worked_example():
    # 4 groups of 3 (a task's G episodes) in 2 shards: cut between groups, not inside one.
    assert shard_bounds([1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4], 2) == [(0, 6), (6, 12)]
    # a cut that would split a group moves to the nearest group edge within half a shard
    assert shard_bounds([1, 1, 1, 1, 2, 2, 3, 3, 3, 3], 2) == [(0, 4), (4, 10)]
    assert shard_bounds([7], 4) == [(0, 1)]


def test_threads_load_the_policy_one_at_a_time(tmp_path):
    # Regression: with generation.runner=threads two shards loading the checkpoint at once failed ("Cannot copy
    # out of meta tensor"): transformers builds models on the meta device process-wide.
    import threading

    from focus_core.policy import tiny_policy, train_tokenizer
    from tasks.fanout import worker_policy

    tiny_policy(train_tokenizer(["look up the answer"] * 20, vocab_size=300), layers=1, hidden=32, heads=2,
                intermediate=64, max_context=256).save(tmp_path / "policy")
    store = ArtifactStore(tmp_path / "runs")
    manifest = store.commit("r", 0, "bootstrap", version="v", folders={"policy": tmp_path / "policy"})
    start, loaded, errors = threading.Barrier(3), [], []

    def load() -> None:
        start.wait()
        try:
            loaded.append(worker_policy(store.root, manifest, threading.get_ident()))
        except Exception as error:  # noqa: BLE001 - the test reports it
            errors.append(error)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len({id(p) for p in loaded}) == 3  # each thread its own copy


def close_rows(mine: list[dict], theirs: list[dict], table: str) -> None:
    """Equal rows, floats within float-rounding of a batched forward of another shape (~1e-7 here)."""

    def key(row: dict) -> str:
        return json.dumps({k: v for k, v in row.items() if not isinstance(v, float | list)}, sort_keys=True,
                          default=str)

    assert len(mine) == len(theirs), table
    for a, b in zip(sorted(mine, key=key), sorted(theirs, key=key), strict=True):
        assert a.keys() == b.keys()
        for name in a:
            x, y = a[name], b[name]
            floats = (isinstance(x, float) and not math.isnan(x)) or (isinstance(x, list) and x
                                                                        and isinstance(x[0], float))
            if floats:
                assert x == pytest.approx(y, rel=1e-4, abs=1e-5), (table, name)
            else:
                assert x == y or (isinstance(x, float) and math.isnan(y)), (table, name, x, y)


@pytest.mark.slow
@pytest.mark.usefixtures("on_prefect_server")
def test_a_run_sharded_over_dask_and_updated_by_two_processes_commits_the_serial_tables(tmp_path):
    # One run played serially and updated in one process; the other with its generating stages on a real local
    # Dask cluster of 2 workers and its update on 2 processes (torchrun + accelerate, gloo): the same tables.
    config = write_config(tmp_path, iterations=1)
    focus("train", "--config", str(config), "--store", str(tmp_path / "serial"), "--run-id", "same", cwd=tmp_path)
    sharded = focus("train", "--config", str(config), "--store", str(tmp_path / "sharded"), "--run-id", "same",
                    "--set", "generation.shards=2", "--set", "generation.runner=dask",
                    "--set", "generation.dask_workers=2", "--set", "ppo.processes=2", cwd=tmp_path)
    assert "Traceback" not in sharded.stdout + sharded.stderr
    serial, fanned = ArtifactStore(tmp_path / "serial"), ArtifactStore(tmp_path / "sharded")
    for table in TABLES:
        close_rows(table_rows(fanned, "same", table), table_rows(serial, "same", table), table)
    # each generating stage reports its generation time inside its compute time (the longest shard's)
    for stage in ("evaluate", "rollout", "branch_r0"):
        timings = fanned.manifest("same", 0, stage).timings
        assert 0 < timings["generation_s"] <= timings["compute_s"]
    # the branch stage really had continuations to split, and the ledger came back whole
    assert len(table_rows(serial, "same", "branches")) >= 2
    spent = sum(r["tokens"] for r in table_rows(fanned, "same", "budget_ledger"))
    assert spent == sum(r["tokens"] for r in table_rows(serial, "same", "budget_ledger")) > 0
    # the 2-process update moved the weights as the 1-process one did (float summation order apart)
    weights = [load_file(store.fetch_folder("same", 0, "update", "policy") / "model.safetensors")
               for store in (serial, fanned)]
    start = load_file(serial.fetch_folder("same", 0, "bootstrap", "policy") / "model.safetensors")
    assert max((weights[0][n] - start[n]).abs().max().item() for n in start) > 1e-6
    for name in weights[0]:
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=1e-4, atol=2e-5, msg=name)
    # neither setting is part of a stage's version: the stages whose inputs are byte-equal have equal versions
    # (downstream of the rollout they differ with its float bits, which the version hashes through the tables)
    for stage in ("bootstrap", "evaluate", "rollout"):
        assert serial.manifest("same", 0, stage).version == fanned.manifest("same", 0, stage).version, stage
