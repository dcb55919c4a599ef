"""The artifact store: commits round-trip, crash leftovers stay invisible, damage is detected by name.

Most tests run twice, against a local folder and against a real S3 server (SeaweedFS, started once per
pytest process by ``tests/conftest.py``), because the store promises one behaviour for both. Faults are
provoked for real (bytes overwritten, files truncated or swapped, a server stopped, a closed port); the
only injected fault is a crash between writing the parts and writing the manifest.
"""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import time
import uuid
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_core.artifacts import (
    MANIFEST_NAME,
    STORE_WRITE_TIMING,
    ArtifactError,
    ArtifactStore,
    Manifest,
    stage_version,
)
from focus_core.ids import canonical_json, content_id, derive_seed
from focus_core.schemas import SCHEMA_VERSION, SchemaError, validate_table

RUN = "run-a"


def rollouts(rows: int, *, iteration: int = 0, tokens: int = 16, seed: int = 0, run_id: str = RUN) -> pa.Table:
    """A rollouts table shaped like real ones: ``rows`` turns with ``tokens`` tokens each."""
    rng = np.random.default_rng(seed)
    turn = np.arange(rows, dtype=np.int32)
    episode = [content_id(run_id, iteration, seed, int(i) // 8) for i in turn]
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * tokens)
    roles = np.array(["context", "policy", "tool", "policy"])[turn % 4]
    mask = np.repeat((roles == "policy").astype(np.int8), tokens)
    logprobs = np.where(mask == 1, -rng.exponential(1.0, rows * tokens), 0.0).astype(np.float32)
    return pa.table(
        {
            "run_id": pa.array([run_id] * rows),
            "iteration": pa.array(np.full(rows, iteration, dtype=np.int32)),
            "episode_id": pa.array(episode),
            "segment_idx": pa.array((turn % 8) // 4),
            "state_id": pa.array([content_id(e, int(s)) for e, s in zip(episode, (turn % 8) // 4, strict=True)]),
            "branch_id": pa.nulls(rows, pa.string()),
            "policy_version": pa.array(np.full(rows, iteration, dtype=np.int32)),
            "turn_idx": pa.array(turn % 8),
            "role": pa.array(roles),
            "text": pa.array([f"turn {i} of a tool-using agent" for i in turn]),
            "token_ids": pa.ListArray.from_arrays(offsets, pa.array(rng.integers(0, 512, rows * tokens, np.int32))),
            "logprobs": pa.ListArray.from_arrays(offsets, pa.array(logprobs)),
            "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask)),
            "is_compression": pa.array(turn % 8 == 3),
            "generated_tokens": pa.array(np.where(roles == "policy", tokens, 0).astype(np.int64)),
        }
    )


def updates(steps: int, *, iteration: int = 0, run_id: str = RUN) -> pa.Table:
    step = np.arange(steps)
    return pa.table(
        {
            "run_id": [run_id] * steps,
            "iteration": np.full(steps, iteration, dtype=np.int32),
            "policy_version": np.full(steps, iteration, dtype=np.int32),
            "epoch": (step // 2).astype(np.int32),
            "step": step.astype(np.int32),
            "loss": 1.0 / (step + 1),
            "policy_loss": 0.5 / (step + 1),
            "kl": np.full(steps, 0.01),
            "clip_fraction": np.full(steps, 0.1),
            "entropy": np.full(steps, 2.0),
            "grad_norm": np.full(steps, 0.7),
            "lr": np.full(steps, 1e-5),
            "value_loss": pa.nulls(steps, pa.float64()),
        }
    )


@pytest.fixture(params=["local", "s3"])
def store_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty store root: a local folder, or a unique prefix on the session's S3 server."""
    if request.param == "local":
        return str(tmp_path / "store")
    return f"{request.getfixturevalue('s3_store_root')}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(store_root: str) -> ArtifactStore:
    return ArtifactStore(store_root, part_rows=40)


def listed(store: ArtifactStore, run_id: str, iteration: int, stage: str) -> list[str]:
    """Every object under a stage folder, as paths relative to it (whatever the manifest says)."""
    base = store.stage_url(run_id, iteration, stage).removeprefix("s3://")
    # (SeaweedFS may keep an empty folder's own entry after a delete; only what is inside counts.)
    return sorted(path.removeprefix(base + "/") for path in store.filesystem.find(base) if path.startswith(base + "/"))


def stored_path(store: ArtifactStore, run_id: str, iteration: int, stage: str, relative: str) -> str:
    return f"{store.stage_url(run_id, iteration, stage).removeprefix('s3://')}/{relative}"


# --- commit and read ---------------------------------------------------------------------------------------


def test_commit_and_read_round_trip(store: ArtifactStore) -> None:
    table = rollouts(100)
    manifest = store.commit(
        RUN,
        3,
        "rollout",
        version="v1",
        tables={"rollouts": table, "updates": updates(5, iteration=3)},
        upstream={"update": "ab" * 32},
        seeds={"rollout": derive_seed(7, 3, "rollout")},
        policy_version=3,
        timings={"compute_s": 1.5},
        figures={"mean_reward": 0.25},
    )

    assert store.read_table(RUN, 3, "rollout", "rollouts").equals(validate_table("rollouts", table))
    assert store.read_table(RUN, 3, "rollout", "updates").num_rows == 5
    assert manifest.rows == {"rollouts": 100, "updates": 5}
    assert [part.rows for part in manifest.tables["rollouts"]] == [40, 40, 20]  # part_rows=40
    assert manifest.timings["compute_s"] == 1.5 and manifest.timings[STORE_WRITE_TIMING] > 0
    assert store.manifest(RUN, 3, "rollout") == manifest
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert {manifest, store.manifest(RUN, 3, "rollout")} == {manifest}  # hashable, e.g. as a task input
    assert store.is_done(RUN, 3, "rollout", "v1") and not store.is_done(RUN, 3, "rollout", "v2")
    assert store.manifest(RUN, 4, "rollout") is None and not store.is_done(RUN, 4, "rollout", "v1")

    # Layout: {stage}/{table}/part-NNNNN-hash8.parquet and the manifest, nothing else.
    files = listed(store, RUN, 3, "rollout")
    assert files[0] == MANIFEST_NAME and len(files) == 1 + 3 + 1
    for part in manifest.tables["rollouts"]:
        assert part.path in files
        assert part.path.startswith("rollouts/part-") and part.path[-16:-8] == part.sha256[:8]
    assert store.stage_url(RUN, 3, "rollout").endswith(f"/{RUN}/iteration=0003/rollout")


def test_empty_table_round_trips_with_its_schema(store: ArtifactStore) -> None:
    store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(0)})
    table = store.read_table(RUN, 0, "rollout", "rollouts")
    assert table.num_rows == 0 and table.schema.names == rollouts(1).schema.names


def test_skipped_stage_commits_a_manifest_without_tables(store: ArtifactStore) -> None:
    store.commit(RUN, 0, "fit_critic", version="v", skipped="grpo has no critic")
    assert store.is_done(RUN, 0, "fit_critic", "v")
    with pytest.raises(ArtifactError, match="skipped: grpo has no critic"):
        store.read_table(RUN, 0, "fit_critic", "values")


def test_manifest_hash_ignores_time_but_not_content(store: ArtifactStore) -> None:
    first = store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(10)}, timings={"compute_s": 1})
    again = store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(10)}, timings={"compute_s": 2})
    other = store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(11)})
    assert first.created_at != again.created_at and first.hash == again.hash
    assert other.hash != first.hash


# --- commit protocol: manifest last, leftovers invisible -----------------------------------------------------


def test_manifest_is_written_after_every_part(store: ArtifactStore, monkeypatch: pytest.MonkeyPatch) -> None:
    seen_at_manifest_time = []
    write_atomic = store._write_atomic

    def spy(path: str, text: str) -> None:
        seen_at_manifest_time.extend(listed(store, RUN, 0, "rollout"))
        write_atomic(path, text)

    monkeypatch.setattr(store, "_write_atomic", spy)
    manifest = store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(100)})
    assert MANIFEST_NAME not in seen_at_manifest_time
    assert {part.path for part in manifest.tables["rollouts"]} <= set(seen_at_manifest_time)


def test_crash_before_manifest_leaves_stage_not_done_and_recommit_cleans_up(
    store: ArtifactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(path: str, text: str) -> None:
        raise RuntimeError("killed between parts and manifest")

    with monkeypatch.context() as patch:
        patch.setattr(store, "_write_atomic", crash)
        with pytest.raises(RuntimeError, match="killed"):
            store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(100, seed=1)})

    assert len(listed(store, RUN, 0, "rollout")) == 3  # the parts are there ...
    assert store.manifest(RUN, 0, "rollout") is None  # ... but the stage is not done
    assert not store.is_done(RUN, 0, "rollout", "v")
    assert store.parquet_files(RUN, "rollouts") == []
    with pytest.raises(ArtifactError, match="not committed"):
        store.read_table(RUN, 0, "rollout", "rollouts")

    manifest = store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(50, seed=2)})
    assert listed(store, RUN, 0, "rollout") == sorted([MANIFEST_NAME, *(p.path for p in manifest.tables["rollouts"])])
    assert store.read_table(RUN, 0, "rollout", "rollouts").num_rows == 50


def test_a_full_disk_ends_the_commit_with_one_line_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ArtifactStore(tmp_path / "runs")

    def full(path: str, text: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "_write_atomic", full)  # the parts fit, the manifest does not
    with pytest.raises(ArtifactError, match=r"^no space left on the device committing .*free space there") as caught:
        store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(10)})
    assert "\n" not in str(caught.value)
    assert store.manifest(RUN, 0, "rollout") is None and store.committed(RUN) == []


def test_readers_ignore_parts_the_manifest_does_not_list(store: ArtifactStore) -> None:
    store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(30)})
    stray = pa.BufferOutputStream()
    pq.write_table(validate_table("rollouts", rollouts(7, seed=9)), stray)
    store.filesystem.pipe_file(
        stored_path(store, RUN, 0, "rollout", "rollouts/part-00001-deadbeef.parquet"), stray.getvalue().to_pybytes()
    )
    assert store.read_table(RUN, 0, "rollout", "rollouts").num_rows == 30
    assert [url.rsplit("/", 1)[-1] for _, _, url in store.parquet_files(RUN, "rollouts")] == [
        part.path.rsplit("/", 1)[-1] for part in store.manifest(RUN, 0, "rollout").tables["rollouts"]
    ]


def test_invalidate_removes_manifest_and_parts(store: ArtifactStore) -> None:
    store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(10)})
    store.invalidate(RUN, 0, "rollout")
    assert store.manifest(RUN, 0, "rollout") is None and listed(store, RUN, 0, "rollout") == []
    store.invalidate(RUN, 0, "rollout")  # idempotent


# --- nothing bad commits ---------------------------------------------------------------------------------------


def test_nan_table_is_rejected_and_nothing_is_written(store: ArtifactStore) -> None:
    table = rollouts(20)
    logprobs = table.column("logprobs").combine_chunks()
    values = logprobs.values.to_numpy(zero_copy_only=False).copy()
    values[5] = np.nan
    bad = table.set_column(
        table.schema.get_field_index("logprobs"), "logprobs", pa.ListArray.from_arrays(logprobs.offsets, values)
    )
    with pytest.raises(SchemaError, match=r"not committing .*rollout.*non-finite value nan"):
        store.commit(RUN, 0, "rollout", version="v", tables={"updates": updates(3), "rollouts": bad})
    assert listed(store, RUN, 0, "rollout") == []

    # A failed validation leaves an earlier commit of the stage untouched.
    store.commit(RUN, 0, "rollout", version="v1", tables={"rollouts": table})
    with pytest.raises(SchemaError):
        store.commit(RUN, 0, "rollout", version="v2", tables={"rollouts": bad})
    assert store.is_done(RUN, 0, "rollout", "v1")
    assert store.read_table(RUN, 0, "rollout", "rollouts").num_rows == 20


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("figures", {"mean_reward": math.inf}, "figures.mean_reward: non-finite"),
        ("seeds", {"rollout": object()}, "seeds.rollout: object is not JSON data"),
        ("timings", {"compute_s": -1.0}, "timings: values must be seconds"),
        ("upstream", {"segment": 3}, "upstream: values must be manifest hashes"),
    ],
)
def test_bad_manifest_fields_are_rejected_before_writing(tmp_path: Path, field: str, value, message: str) -> None:
    store = ArtifactStore(tmp_path)
    with pytest.raises(ArtifactError, match=message):
        store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(5)}, **{field: value})
    assert not (tmp_path / RUN).exists()


def test_names_are_checked(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    with pytest.raises(ValueError, match="run id"):
        store.manifest("../escape", 0, "rollout")
    with pytest.raises(ValueError, match="stage name"):
        store.manifest(RUN, 0, "Roll Out")
    with pytest.raises(ValueError, match="iteration"):
        store.manifest(RUN, -1, "rollout")
    with pytest.raises(SchemaError, match="unknown table"):
        store.commit(RUN, 0, "rollout", version="v", tables={"turns": rollouts(1)})


# --- damage is detected and named ------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["overwritten", "truncated", "swapped", "deleted"])
def test_damaged_part_is_detected(store: ArtifactStore, damage: str) -> None:
    manifest = store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(100)})
    other = store.commit(RUN, 1, "rollout", version="v", tables={"rollouts": rollouts(100, iteration=1)})
    part = manifest.tables["rollouts"][1]
    path = stored_path(store, RUN, 0, "rollout", part.path)
    data = store.filesystem.cat_file(path)
    if damage == "overwritten":
        store.filesystem.pipe_file(path, data[:100] + bytes(len(data) - 100))
    elif damage == "truncated":
        store.filesystem.pipe_file(path, data[: len(data) // 2])
    elif damage == "swapped":  # a valid part of the same table, from another iteration
        swapped = stored_path(store, RUN, 1, "rollout", other.tables["rollouts"][1].path)
        store.filesystem.pipe_file(path, store.filesystem.cat_file(swapped))
    else:
        store.filesystem.rm_file(path)
    expected = "missing" if damage == "deleted" else "is corrupt"
    with pytest.raises(ArtifactError, match=expected) as error:
        store.read_table(RUN, 0, "rollout", "rollouts")
    assert part.path in str(error.value) and "delete the stage folder and resume" in str(error.value)


def test_unverified_read_of_a_truncated_part_still_fails_clearly(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    manifest = store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(10)})
    path = Path(store.stage_url(RUN, 0, "rollout"), manifest.tables["rollouts"][0].path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ArtifactError, match="not readable Parquet"):
        store.read_table(RUN, 0, "rollout", "rollouts", verify=False)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is corrupt \\(not JSON"),
        (json.dumps({"hello": "world"}), "is not a FOCUS stage manifest"),
        (json.dumps([1, 2]), "is not a FOCUS stage manifest"),
        (None, f"written by schema version 0, this FOCUS reads {SCHEMA_VERSION}: start a new run"),
        ("malformed", "is malformed"),
    ],
)
def test_bad_manifest_is_reported(store: ArtifactStore, content: str | None, message: str) -> None:
    manifest = store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(5)})
    if content is None:
        content = json.dumps({**manifest.to_dict(), "schema_version": 0})
    elif content == "malformed":
        content = json.dumps({key: value for key, value in manifest.to_dict().items() if key != "tables"})
    store.filesystem.pipe_file(stored_path(store, RUN, 0, "rollout", MANIFEST_NAME), content.encode())
    with pytest.raises(ArtifactError, match=message) as error:
        store.manifest(RUN, 0, "rollout")
    assert MANIFEST_NAME in str(error.value)
    with pytest.raises(ArtifactError, match=message):
        store.is_done(RUN, 0, "rollout", "v")


def test_manifest_copied_to_another_stage_is_rejected(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(5)})
    source = Path(store.stage_url(RUN, 0, "rollout"), MANIFEST_NAME)
    target = Path(store.stage_url(RUN, 1, "rollout"), MANIFEST_NAME)
    target.parent.mkdir(parents=True)
    target.write_bytes(source.read_bytes())
    with pytest.raises(ArtifactError, match="copied or moved here"):
        store.manifest(RUN, 1, "rollout")


# --- checkpoint folders ------------------------------------------------------------------------------------------


def make_checkpoint(folder: Path) -> dict[str, bytes]:
    files = {
        "config.json": b'{"hidden_size": 128}',
        "model.safetensors": np.random.default_rng(0).bytes(300_000),
        "tokenizer/vocab.json": b'{"a": 0}',
    }
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return files


def test_folder_round_trip_with_hash_check(store: ArtifactStore, tmp_path: Path) -> None:
    files = make_checkpoint(tmp_path / "checkpoint")
    manifest = store.commit(RUN, 0, "update", version="v", folders={"policy": tmp_path / "checkpoint"})
    assert sorted(entry.path for entry in manifest.files["policy"]) == sorted(f"files/policy/{n}" for n in files)

    fetched = store.fetch_folder(RUN, 0, "update", "policy", dest=tmp_path / "fetched")
    assert {name: (fetched / name).read_bytes() for name in files} == files
    default = store.fetch_folder(RUN, 0, "update", "policy")  # local: the stored folder; S3: the cache
    assert (default / "model.safetensors").read_bytes() == files["model.safetensors"]

    # Damage the stored copy: every fetch that reads it fails and names the file.
    path = stored_path(store, RUN, 0, "update", "files/policy/model.safetensors")
    store.filesystem.pipe_file(path, b"not the weights")
    with pytest.raises(ArtifactError, match="model.safetensors is corrupt"):
        store.fetch_folder(RUN, 0, "update", "policy", dest=tmp_path / "fetched-again")
    with pytest.raises(ArtifactError, match="no folder 'critic'"):
        store.fetch_folder(RUN, 0, "update", "critic")


def test_s3_fetch_reuses_a_verified_cache_and_repairs_a_damaged_one(
    s3_store_root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FOCUS_CACHE_DIR", str(tmp_path / "cache"))
    store = ArtifactStore(f"{s3_store_root}/{uuid.uuid4().hex[:12]}")
    files = make_checkpoint(tmp_path / "checkpoint")
    manifest = store.commit(RUN, 0, "update", version="v", folders={"policy": tmp_path / "checkpoint"})
    cached = store.fetch_folder(RUN, 0, "update", "policy")
    assert cached.is_relative_to(tmp_path / "cache") and manifest.hash[:16] in str(cached)
    (cached / "model.safetensors").write_bytes(b"damaged locally")
    assert store.fetch_folder(RUN, 0, "update", "policy") == cached
    assert (cached / "model.safetensors").read_bytes() == files["model.safetensors"]


# --- pure helpers ------------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)
configs = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
hashes = st.lists(st.text("0123456789abcdef", min_size=64, max_size=64), max_size=3, unique=True)
stage_inputs = st.tuples(st.sampled_from(["rollout", "segment", "acquire"]), configs, hashes, st.integers(1, 3))


@settings(max_examples=200, deadline=None)
@given(stage_inputs, stage_inputs, st.randoms())
def test_stage_version_changes_exactly_with_its_inputs(first, second, random) -> None:
    stage, config, upstream, schema = first
    version = stage_version(stage, config, upstream, schema)
    # Same inputs in another order (dict keys, upstream hashes): same version.
    shuffled_config = dict(random.sample(list(config.items()), len(config)))
    shuffled_upstream = random.sample(upstream, len(upstream))
    assert stage_version(stage, shuffled_config, shuffled_upstream, schema) == version
    # Different inputs: different version.
    other_stage, other_config, other_upstream, other_schema = second
    same = (
        stage == other_stage
        and canonical_json(config) == canonical_json(other_config)
        and sorted(upstream) == sorted(other_upstream)
        and schema == other_schema
    )
    assert (stage_version(other_stage, other_config, other_upstream, other_schema) == version) == same


def test_stage_version_defaults_to_the_current_schema_and_rejects_non_json() -> None:
    assert stage_version("rollout", {"lr": 1e-5}, []) == stage_version("rollout", {"lr": 1e-5}, [], SCHEMA_VERSION)
    assert stage_version("rollout", {"n": np.int64(3)}, []) == stage_version("rollout", {"n": 3}, [])
    assert stage_version("rollout", {"n": 1}, []) != stage_version("rollout", {"n": 1.0}, [])
    with pytest.raises(TypeError, match="config.path: PosixPath is not JSON data"):
        stage_version("rollout", {"path": Path("/x")}, [])
    with pytest.raises(ValueError, match="non-finite"):
        stage_version("rollout", {"lr": math.nan}, [])
    with pytest.raises(TypeError, match="list of manifest hashes"):
        stage_version("advantage", {}, {"segment": "ab" * 32})  # a dict would hash its keys, not the hashes


def test_derive_seed_is_stable_distinct_and_63_bit() -> None:
    assert derive_seed(1234, 3, "branch", "state-7", 0) == derive_seed(1234, 3, "branch", "state-7", 0)
    # Pinned: a change here silently changes every resumed run's randomness.
    assert derive_seed(0, 0, "rollout") == 5667958690085771876
    seeds = {
        derive_seed(run_seed, iteration, stage, state, branch)
        for run_seed in (0, 1)
        for iteration in range(10)
        for stage in ("rollout", "branch")
        for state in ("s0", "s1", "s2")
        for branch in range(20)
    }
    assert len(seeds) == 2 * 10 * 2 * 3 * 20
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert derive_seed(0, 0, "b", "ab", "c") != derive_seed(0, 0, "b", "a", "bc")
    assert derive_seed(0, 0, "b", 1) != derive_seed(0, 0, "b", "1")


# --- runs ---------------------------------------------------------------------------------------------------------


def test_list_runs_reports_status_progress_and_timing_totals(store: ArtifactStore) -> None:
    assert store.list_runs() == []
    first = store.write_run_info("run-a", {"status": "running", "config": {"method": "focus"}})
    for iteration in (0, 1):
        for stage in ("rollout", "segment"):
            store.commit("run-a", iteration, stage, version="v", timings={"compute_s": 2.0, "orchestration_s": 0.5})
    store.commit("run-b", 0, "rollout", version="v", timings={"compute_s": 1.0})
    final = store.write_run_info("run-a", {"status": "finished", "mlflow_run_id": "abc"})
    base = store.root.removeprefix("s3://")
    store.filesystem.pipe_file(f"{base}/not-a-run/notes.txt", b"hello")  # foreign folders are not runs ...
    store.filesystem.pipe_file(f"{base}/run-a/iteration=old/rollout/{MANIFEST_NAME}", b"?")  # ... nor iterations

    runs = {run.run_id: run for run in store.list_runs()}
    assert sorted(runs) == ["run-a", "run-b"]
    a, b = runs["run-a"], runs["run-b"]
    assert a.status == "finished" and a.info["config"] == {"method": "focus"} and a.info["mlflow_run_id"] == "abc"
    assert a.created_at == first["created_at"] and a.updated_at == final["updated_at"] > a.created_at
    assert a.stages == {0: ("rollout", "segment"), 1: ("rollout", "segment")}
    assert a.last_committed == (1, "segment")
    assert a.compute_s == pytest.approx(8.0)
    writes = sum(m.timings[STORE_WRITE_TIMING] for _, _, m in store.committed("run-a"))
    assert a.overhead_s == pytest.approx(4 * 0.5 + writes)
    assert b.status == "unknown" and b.stages == {0: ("rollout",)} and b.compute_s == 1.0
    with pytest.raises(ValueError, match="run status"):
        store.write_run_info("run-a", {"status": "crashed"})


def test_run_info_is_atomic_and_foreign_files_are_rejected(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path)
    assert store.run_info("run-a") is None
    store.write_run_info("run-a", {"status": "running"})
    assert [p.name for p in (tmp_path / "run-a").iterdir()] == ["_run.json"]  # no temporary file left
    (tmp_path / "run-a" / "_run.json").write_text('{"status": "running"}')
    with pytest.raises(ArtifactError, match="not a FOCUS run file"):
        store.run_info("run-a")


# --- DuckDB over the committed parts -----------------------------------------------------------------------------


def test_duckdb_reads_committed_parts(store: ArtifactStore) -> None:
    for iteration in (0, 1):
        store.commit(RUN, iteration, "rollout", version="v", tables={"rollouts": rollouts(60, iteration=iteration)})
        store.commit(RUN, iteration, "update", version="v", tables={"updates": updates(4, iteration=iteration)})
    files = store.parquet_files(RUN, "rollouts")
    assert [(iteration, stage) for iteration, stage, _ in files] == [(0, "rollout")] * 2 + [(1, "rollout")] * 2

    con = duckdb.connect()
    con.register_filesystem(store.filesystem)
    urls = [url for _, _, url in files]
    con.read_parquet(urls).create_view("rollouts")
    rows = con.sql("SELECT iteration, count(*), sum(generated_tokens) FROM rollouts GROUP BY 1 ORDER BY 1").fetchall()
    assert rows == [(0, 60, 30 * 16), (1, 60, 30 * 16)]
    assert con.sql("SELECT max(len(token_ids)) FROM rollouts").fetchall() == [(16,)]


# --- S3 failures -------------------------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_s3_endpoint_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    started = time.monotonic()
    with pytest.raises(ArtifactError, match="cannot reach S3 endpoint") as error:
        ArtifactStore("s3://focus/runs")
    assert time.monotonic() - started < 5
    assert endpoint in str(error.value) and "python -m infra.services up s3" in str(error.value)


def test_s3_server_that_goes_away_fails_within_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from infra.services import start_s3

    service = start_s3(tmp_path / "services")
    try:
        for key, value in service.env.items():
            monkeypatch.setenv(key, value)
        store = ArtifactStore("s3://focus/runs")
        store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(5)})
    finally:
        service.stop()
    started = time.monotonic()
    with pytest.raises(ArtifactError, match="cannot reach S3 endpoint .*infra.services up s3"):
        store.read_table(RUN, 0, "rollout", "rollouts")
    assert time.monotonic() - started < 15


def test_missing_bucket_and_bad_credentials_are_named(s3_store_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ArtifactError, match="S3 bucket 'no-such-bucket' does not exist"):
        ArtifactStore("s3://no-such-bucket/runs")

    secret = os.environ["AWS_SECRET_ACCESS_KEY"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(ArtifactError, match="permission denied .*AWS_SECRET_ACCESS_KEY") as error:
        ArtifactStore(s3_store_root)
    assert "wrong-secret" not in str(error.value) and secret not in str(error.value)

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ArtifactError, match="no S3 credentials"):
        ArtifactStore(s3_store_root)


def test_local_permission_error_is_named(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root ignores file permissions")
    (tmp_path / "locked").mkdir(mode=0o500)
    store = ArtifactStore(tmp_path / "locked")
    with pytest.raises(ArtifactError, match="permission denied"):
        store.commit(RUN, 0, "rollout", version="v", tables={"rollouts": rollouts(5)})


def test_unsupported_roots_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="unsupported scheme"):
        ArtifactStore("gs://bucket/runs")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ArtifactError, match="is a file"):
        ArtifactStore(tmp_path / "file")
    assert ArtifactStore(f"file://{tmp_path}").root == str(tmp_path)
