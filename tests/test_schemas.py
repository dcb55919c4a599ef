"""Artifact schemas: every table accepts a realistic row and rejects each kind of bad data by name."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from focus_core.ids import content_id
from focus_core.schemas import SCHEMA_VERSION, TABLES, SchemaError, empty_table, schema_for, validate_table

JOIN_KEYS = {
    "run_id": pa.string(),
    "iteration": pa.int32(),
    "episode_id": pa.string(),
    "segment_idx": pa.int32(),
    "state_id": pa.string(),
    "branch_id": pa.string(),
    "policy_version": pa.int32(),
}

RUN = {"run_id": "run-a", "iteration": 3, "policy_version": 3}
EPISODE = content_id("run-a", 3, "task-7", 0)
STATE = content_id(EPISODE, 1)
BRANCH = content_id(STATE, 0)


def example_row(table: str) -> dict:
    """One realistic row per table, as a stage would produce it (Python types, not yet cast)."""
    rows = {
        "rollouts": {
            **RUN,
            "episode_id": EPISODE,
            "segment_idx": 1,
            "state_id": STATE,
            "branch_id": None,
            "turn_idx": 4,
            "role": "policy",
            "text": 'search("capital of Peru")',
            "token_ids": [101, 2054, 7, 9],
            "logprobs": [-0.11, -2.3, -0.01, -0.7],
            "loss_mask": [1, 1, 1, 1],
            "is_compression": False,
            "generated_tokens": 4,
        },
        "episodes": {
            **RUN,
            "episode_id": EPISODE,
            "branch_id": None,
            "task_id": "task-7",
            "split": "train",
            "group_id": content_id("run-a", 3, "task-7"),
            "reward": 1.0,
            "n_turns": 12,
            "n_segments": 3,
            "generated_tokens": 4311,
            "is_branch": False,
            "parent_state_id": None,
            "truncated": False,
            "budget_cut": False,
        },
        "states": {
            **RUN,
            "episode_id": EPISODE,
            "segment_idx": 1,
            "state_id": STATE,
            "branch_id": None,
            "context_token_ids": [1, 15, 99, 1203],
            "remaining_generated_tokens": 2900,
            "own_return": 1.0,
            "segment_reward": 0.0,
            "segment_generated_tokens": 1450,
            "features": [0.1, -0.4, 0.0],
        },
        "acquisition": {
            **RUN,
            "episode_id": EPISODE,
            "segment_idx": 1,
            "state_id": STATE,
            "round": 0,
            "critic_mean": 0.42,
            "critic_std": 0.13,
            "cost_estimate": 2100.0,
            "score": 3.2e-6,
            "continuations": 2,
            "reason": "ivr_greedy",
        },
        "branches": {
            **RUN,
            "episode_id": content_id("branch-episode", BRANCH),
            "segment_idx": 1,
            "state_id": STATE,
            "branch_id": BRANCH,
            "round": 0,
            "return": 0.0,
            "generated_tokens": 1980,
            "truncated": False,
        },
        "values": {
            **RUN,
            "episode_id": EPISODE,
            "segment_idx": 1,
            "state_id": STATE,
            "critic_mean": 0.4,
            "critic_var": 0.04,
            "mc_mean": 0.75,
            "n": 4,
            "value": 0.54,
            "value_var": 0.024,
        },
        "advantages": {
            **RUN,
            "episode_id": EPISODE,
            "segment_idx": 1,
            "state_id": STATE,
            "reward": 0.0,
            "value": 0.6,
            "next_value": 0.3,
            "delta": -0.3,
            "advantage": 0.0,
            "lambda_return": 0.6,
        },
        "updates": {
            **RUN,
            "epoch": 1,
            "step": 17,
            "loss": 0.031,
            "policy_loss": 0.03,
            "kl": 0.001,
            "clip_fraction": 0.04,
            "entropy": 1.7,
            "grad_norm": 0.8,
            "lr": 1e-6,
            "value_loss": None,
        },
        "critic_data": {
            **RUN,
            "state_id": STATE,
            "task_id": "task-7",
            "fold": 2,
            "features": [0.1, -0.2, 0.3],
            "successes": 2.0,
            "trials": 3.0,
        },
        "token_advantages": {
            **RUN,
            "episode_id": EPISODE,
            "segment_idx": 1,
            "state_id": STATE,
            "values": [0.0, 0.4, 0.5],
            "advantages": [0.0, 0.1, -0.2],
            "returns": [0.0, 0.5, 0.3],
        },
        "evaluation": {
            **RUN,
            "episode_id": content_id("eval", "task-99", 0),
            "task_id": "task-99",
            "split": "heldout",
            "reward": 0.0,
            "success": False,
            "n_turns": 20,
            "generated_tokens": 6100,
            "exact_value": 0.37,
        },
        "budget_ledger": {**RUN, "round": 1, "kind": "branch", "tokens": 19000, "budget": 80000},
    }
    return rows[table]


def table_of(table: str, **changes) -> pa.Table:
    """A one-row table of the example row with some columns replaced (by Python values)."""
    row = {**example_row(table), **changes}
    return pa.Table.from_pylist([row])


def test_all_design_tables_are_defined():
    assert set(TABLES) == {
        "rollouts",
        "episodes",
        "states",
        "acquisition",
        "branches",
        "values",
        "advantages",
        "updates",
        "evaluation",
        "budget_ledger",
        "critic_data",
        "token_advantages",
    }


@pytest.mark.parametrize("table", list(TABLES))
def test_realistic_row_validates_and_is_cast_to_the_schema(table):
    validated = validate_table(table, table_of(table))
    assert validated.schema.equals(schema_for(table), check_metadata=True)
    assert validated.num_rows == 1
    assert validated.to_pylist()[0].keys() == example_row(table).keys()


@pytest.mark.parametrize("table", list(TABLES))
def test_join_keys_have_one_name_and_type_everywhere(table):
    schema = schema_for(table)
    for name, dtype in JOIN_KEYS.items():
        if name in schema.names:
            assert schema.field(name).type == dtype, f"{table}.{name}"
    assert {"run_id", "iteration", "policy_version"} <= set(schema.names)


@pytest.mark.parametrize("table", list(TABLES))
def test_every_column_is_documented(table):
    for field in schema_for(table):
        assert field.metadata and field.metadata[b"description"], f"{table}.{field.name}"
    assert schema_for(table).metadata[b"focus.schema_version"] == str(SCHEMA_VERSION).encode()


def test_columns_are_reordered_to_schema_order():
    table = table_of("budget_ledger")
    shuffled = table.select(list(reversed(table.column_names)))
    assert validate_table("budget_ledger", shuffled).column_names == schema_for("budget_ledger").names


def test_unknown_table_lists_known_tables():
    with pytest.raises(ValueError, match="unknown table 'rollout'.*rollouts.*budget_ledger"):
        schema_for("rollout")


def test_empty_table_has_the_schema_and_validates():
    empty = empty_table("states")
    assert empty.num_rows == 0 and empty.schema.equals(schema_for("states"))
    assert validate_table("states", empty).num_rows == 0


def test_missing_and_unexpected_columns_are_both_named():
    table = table_of("episodes").drop_columns(["reward"]).append_column("rewrd", pa.array([1.0]))
    with pytest.raises(SchemaError) as error:
        validate_table("episodes", table)
    message = str(error.value)
    assert "missing columns ['reward']" in message
    assert "unexpected columns ['rewrd']" in message
    assert "Fix:" in message


def test_int_overflow_is_rejected_not_wrapped():
    table = table_of("updates", step=2**31)
    with pytest.raises(SchemaError, match=r"'updates', column 'step'.*not in range"):
        validate_table("updates", table)


def test_int_overflow_inside_a_list_is_rejected():
    table = table_of("rollouts", token_ids=[1, 2, 2**40, 4])
    with pytest.raises(SchemaError, match="column 'token_ids'"):
        validate_table("rollouts", table)


def test_truncating_float_to_int_is_rejected():
    table = table_of("values", n=2.5)
    with pytest.raises(SchemaError, match="column 'n'.*truncated"):
        validate_table("values", table)


def test_strings_are_not_parsed_as_numbers():
    table = table_of("updates", epoch="1")
    with pytest.raises(SchemaError, match="column 'epoch'.*no cross-kind casts"):
        validate_table("updates", table)


def test_null_in_a_key_is_rejected_with_its_row():
    rows = [example_row("states"), {**example_row("states"), "state_id": None}]
    with pytest.raises(SchemaError, match=r"column 'state_id': null at row 1"):
        validate_table("states", pa.Table.from_pylist(rows))


def test_null_where_the_key_does_not_apply_is_accepted():
    row = {**example_row("states"), "branch_id": None, "features": None}
    validated = validate_table("states", pa.Table.from_pylist([row]))
    assert validated.column("features").null_count == 1


def test_null_inside_a_list_is_rejected():
    table = table_of("rollouts", logprobs=[-0.1, None, -0.2, -0.3])
    with pytest.raises(SchemaError, match="column 'logprobs': null element inside the list at row 0"):
        validate_table("rollouts", table)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_float_is_rejected_with_its_row(bad):
    rows = [example_row("advantages")] * 2 + [{**example_row("advantages"), "advantage": bad}]
    with pytest.raises(SchemaError, match=r"table 'advantages', column 'advantage': non-finite .* at row 2"):
        validate_table("advantages", pa.Table.from_pylist(rows))


def test_nan_in_a_nullable_float_column_is_rejected_but_null_is_not():
    validate_table("values", table_of("values", mc_mean=None, n=0))
    with pytest.raises(SchemaError, match="column 'mc_mean': non-finite"):
        validate_table("values", table_of("values", mc_mean=math.nan))


def test_nan_inside_a_list_names_the_row():
    rows = [example_row("rollouts"), {**example_row("rollouts"), "logprobs": [-0.1, -0.2, math.nan, -0.3]}]
    expected = r"table 'rollouts', column 'logprobs': non-finite value nan at row 1"
    with pytest.raises(SchemaError, match=expected):
        validate_table("rollouts", pa.Table.from_pylist(rows))


def test_float32_overflow_is_caught_after_the_cast():
    table = table_of("states", features=[0.0, 1e300, 0.0])
    with pytest.raises(SchemaError, match="column 'features': non-finite value inf at row 0"):
        validate_table("states", table)


def test_categorical_values_are_checked():
    with pytest.raises(SchemaError, match=r"column 'role': value 'assistant' at row 0 is not one of"):
        validate_table("rollouts", table_of("rollouts", role="assistant"))
    with pytest.raises(SchemaError, match=r"column 'kind': value 'mainn'"):
        validate_table("budget_ledger", table_of("budget_ledger", kind="mainn"))
    with pytest.raises(SchemaError, match=r"column 'loss_mask': value 2 at row 0"):
        validate_table("rollouts", table_of("rollouts", loss_mask=[1, 2, 1, 1]))


def test_per_token_lists_must_align():
    with pytest.raises(SchemaError, match="'token_ids' and 'logprobs' have different lengths at row 0"):
        validate_table("rollouts", table_of("rollouts", logprobs=[-0.1, -0.2]))


def test_duplicate_columns_are_rejected():
    table = table_of("budget_ledger")
    table = pa.Table.from_arrays([*table.columns, table.column("kind")], names=[*table.column_names, "kind"])
    with pytest.raises(SchemaError, match=r"duplicate columns \['kind'\]"):
        validate_table("budget_ledger", table)


def test_multi_chunk_tables_report_global_row_indices():
    good = table_of("advantages")
    bad = table_of("advantages", delta=math.nan)
    combined = pa.concat_tables([good, good, bad])
    assert combined.column("delta").num_chunks == 3
    with pytest.raises(SchemaError, match="at row 2"):
        validate_table("advantages", combined)


# --- content ids --------------------------------------------------------------------------------------


def test_content_id_is_short_hex_and_deterministic():
    first = content_id("run-a", 3, "task-7", 0)
    assert len(first) == 16 and int(first, 16) >= 0
    assert first == content_id("run-a", 3, "task-7", 0)


def test_content_id_is_stable_across_processes():
    code = "from focus_core.ids import content_id; print(content_id('run-a', 3, {'b': 1.5, 'a': None}))"
    # Python's own hash() of strings differs between these two processes; content_id must not.
    outputs = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env, check=True)
        outputs.add(run.stdout.decode().strip())
    assert outputs == {content_id("run-a", 3, {"a": None, "b": 1.5})}


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (("ab", "c"), ("a", "bc")),
        ((1,), ("1",)),
        ((1,), (1.0,)),
        ((True,), (1,)),
        (([1], [2]), ([1, 2],)),
        (([],), (None,)),
        ((np.array([1, 2], dtype=np.int32),), (np.array([1, 2], dtype=np.int64),)),
        ((b"x",), ("x",)),
    ],
)
def test_content_id_separates_different_parts(left, right):
    assert content_id(*left) != content_id(*right)


def test_content_id_treats_numpy_scalars_like_python_numbers():
    assert content_id(np.int64(3), np.float32(0.5)) == content_id(3, 0.5)


def test_content_id_refuses_objects_without_a_stable_encoding():
    with pytest.raises(TypeError, match="cannot encode set"):
        content_id({1, 2})


def test_empty_lists_and_all_null_optional_columns_take_the_schema_types():
    row = {**example_row("rollouts"), "token_ids": [], "logprobs": [], "loss_mask": [], "generated_tokens": 0}
    table = pa.Table.from_pylist([row])
    assert table.schema.field("token_ids").type == pa.list_(pa.null())
    assert validate_table("rollouts", table).schema.field("token_ids").type == pa.list_(pa.int32())
