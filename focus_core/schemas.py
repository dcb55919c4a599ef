"""Arrow schemas of every artifact table FOCUS writes, and the validator every write goes through.

Each pipeline stage writes its output as Parquet parts of one table (DESIGN.md, "Artifacts"). This module
is the single place those tables are defined, so that DuckDB queries, resumed runs and later stages all
agree on column names and types.

Conventions shared by all tables:

* Join keys have the same name and type everywhere: ``run_id``, ``iteration``, ``episode_id``,
  ``segment_idx``, ``state_id``, ``branch_id``, ``policy_version``. A table carries a key only where the
  key means something for its rows. Keys are non-nullable unless a comment says for which rows the key
  does not apply.
* Ids are content-derived (``focus_core.ids.content_id``), never random, so that a resumed run produces the same ids.
* Token counts are int64; indices and small counts are int32; scalar statistics are float64; per-token
  lists (sampling logprobs, features) are float32 to keep rollout tables small.
* Non-finite floats never reach storage: ``validate_table`` rejects NaN and inf, also inside lists.

Every column's meaning is written next to it below and also stored in the field metadata under
``description``, so it travels with the Parquet files.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

# Bump whenever a column is added, removed, renamed or retyped; it feeds the stage version hash,
# so a schema change invalidates stored artifacts instead of silently mixing layouts.
SCHEMA_VERSION = 3

# Allowed values of categorical columns (checked by validate_table).
ROLLOUT_ROLES = ("context", "policy", "tool", "summary")
BUDGET_KINDS = ("main", "branch", "summary")
LOSS_MASK_VALUES = (0, 1)


def _column(name: str, dtype: pa.DataType, description: str, *, nullable: bool = False) -> pa.Field:
    """One column; the description is kept in the field metadata."""
    return pa.field(name, dtype, nullable=nullable, metadata={"description": description})


def _schema(table: str, row: str, fields: Iterable[pa.Field]) -> pa.Schema:
    metadata = {"focus.table": table, "focus.row": row, "focus.schema_version": str(SCHEMA_VERSION)}
    return pa.schema(list(fields), metadata=metadata)


# --- shared join keys --------------------------------------------------------------------------------

RUN_ID = _column("run_id", pa.string(), "id of the training run")
ITERATION = _column("iteration", pa.int32(), "training iteration, from 0")
EPISODE_ID = _column("episode_id", pa.string(), "content-derived id of one episode (main or branch)")
SEGMENT_IDX = _column("segment_idx", pa.int32(), "segment index k within its episode, from 0")
STATE_ID = _column("state_id", pa.string(), "content-derived id of the segment start state s_k")
BRANCH_ID = _column("branch_id", pa.string(), "content-derived id of one continuation from a state")
POLICY_VERSION = _column("policy_version", pa.int32(), "version of the policy that produced the data")
# A main (non-branch) episode has no branch id: these two columns are null for its rows.
BRANCH_ID_OR_NULL = _column(
    "branch_id", pa.string(), "continuation id; null for rows of main episodes", nullable=True
)

TOKEN_IDS = pa.list_(pa.int32())
FLOATS = pa.list_(pa.float32())


TABLES: dict[str, pa.Schema] = {
    "rollouts": _schema(
        "rollouts",
        "one row per turn of an episode",
        [
            RUN_ID,
            ITERATION,
            EPISODE_ID,
            SEGMENT_IDX,
            STATE_ID,  # the start state of the segment this turn belongs to
            BRANCH_ID_OR_NULL,
            POLICY_VERSION,
            _column("turn_idx", pa.int32(), "turn index within the episode, from 0"),
            _column(
                "role",
                pa.string(),
                "context (prompt or re-injected compressed context), policy (generated action), "
                "tool (environment observation) or summary (generated compression summary)",
            ),
            _column("text", pa.string(), "decoded text of the turn, for reading only; never re-tokenized"),
            _column("token_ids", TOKEN_IDS, "token ids of the turn, exactly as sampled or fed"),
            _column(
                "logprobs", FLOATS, "sampling logprob per token under the behaviour policy; 0 where mask=0"
            ),
            _column(
                "loss_mask", pa.list_(pa.int8()), "per token: 1 = policy-generated, 0 = env/tool/context"
            ),
            _column("is_compression", pa.bool_(), "true for the summary turn that closes a segment"),
            _column("generated_tokens", pa.int64(), "policy-generated tokens in this turn"),
        ],
    ),
    "episodes": _schema(
        "episodes",
        "one row per episode",
        [
            RUN_ID,
            ITERATION,
            EPISODE_ID,
            BRANCH_ID_OR_NULL,
            POLICY_VERSION,
            _column("task_id", pa.string(), "id of the task the episode solves"),
            _column("split", pa.string(), "task split, e.g. train or heldout"),
            _column(
                "group_id", pa.string(), "rollout group: main episodes of one prompt, or one state's branches"
            ),
            _column("reward", pa.float64(), "terminal outcome reward"),
            _column("n_turns", pa.int32(), "number of turns"),
            _column("n_segments", pa.int32(), "number of segments (compressions + 1)"),
            _column("generated_tokens", pa.int64(), "policy-generated tokens, summaries included"),
            _column("is_branch", pa.bool_(), "true for a continuation started from a segment state"),
            _column(
                "parent_state_id",
                pa.string(),
                "state a branch episode started from; null for main episodes",
                nullable=True,
            ),
            _column("truncated", pa.bool_(), "true if the episode hit a turn or token limit"),
            _column(
                "budget_cut",
                pa.bool_(),
                "true if the iteration's token budget ran out before the episode ended (then also truncated)",
            ),
        ],
    ),
    "states": _schema(
        "states",
        "one row per segment start state s_k (k < K; the terminal state has value 0 and no row)",
        [
            RUN_ID,
            ITERATION,
            EPISODE_ID,
            SEGMENT_IDX,
            STATE_ID,
            BRANCH_ID_OR_NULL,  # states visited by branch episodes carry their branch id
            POLICY_VERSION,
            _column("context_token_ids", TOKEN_IDS, "compressed working context at the state"),
            _column(
                "remaining_generated_tokens",
                pa.int64(),
                "policy tokens this episode generated from the state to its end",
            ),
            _column("own_return", pa.float64(), "return realised from this state by its own episode"),
            _column("segment_reward", pa.float64(), "reward r_k of the segment starting here"),
            _column("segment_generated_tokens", pa.int64(), "policy tokens L_k of the segment starting here"),
            _column(
                "features",
                FLOATS,
                "critic input features; null until a stage computes them",
                nullable=True,
            ),
        ],
    ),
    "acquisition": _schema(
        "acquisition",
        "one row per candidate state per acquisition round",
        [
            RUN_ID,
            ITERATION,
            EPISODE_ID,  # the episode the candidate state belongs to
            SEGMENT_IDX,
            STATE_ID,
            POLICY_VERSION,
            _column("round", pa.int32(), "acquisition round within the iteration, from 0"),
            # Strategies without a critic (uniform_all, uniform_random) have no critic output: null.
            _column("critic_mean", pa.float64(), "ensemble mean value; null without a critic", nullable=True),
            _column("critic_std", pa.float64(), "ensemble std; null without a critic", nullable=True),
            _column("cost_estimate", pa.float64(), "expected generated tokens of one continuation"),
            # Higher = the strategy wants more continuations there; uniform strategies score every state 1.
            _column("score", pa.float64(), "acquisition score when the state was ranked", nullable=True),
            _column("continuations", pa.int32(), "continuations allocated to the state in this round"),
            _column("reason", pa.string(), "why the state got (or did not get) continuations"),
        ],
    ),
    "branches": _schema(
        "branches",
        "one row per continuation sampled from a state",
        [
            RUN_ID,
            ITERATION,
            EPISODE_ID,  # the continuation's own episode (its turns are in rollouts)
            SEGMENT_IDX,  # segment index of the state the continuation started from
            STATE_ID,  # the state the continuation started from
            BRANCH_ID,
            POLICY_VERSION,
            _column("round", pa.int32(), "acquisition round that allocated the continuation"),
            _column("return", pa.float64(), "return of the continuation"),
            _column("generated_tokens", pa.int64(), "policy tokens the continuation generated"),
            _column("truncated", pa.bool_(), "true if the continuation hit a turn or token limit"),
        ],
    ),
    "values": _schema(
        "values",
        "one row per state: the value used for advantages and where it came from",
        [
            RUN_ID,
            ITERATION,
            EPISODE_ID,
            SEGMENT_IDX,
            STATE_ID,
            POLICY_VERSION,
            # Critic-free methods (vineppo) have no critic output: null.
            _column("critic_mean", pa.float64(), "ensemble mean value; null without a critic", nullable=True),
            _column("critic_var", pa.float64(), "epistemic variance; null without a critic", nullable=True),
            _column("mc_mean", pa.float64(), "mean of the n MC returns; null if n = 0", nullable=True),
            _column("n", pa.int32(), "number of Monte-Carlo returns combined"),
            _column("value", pa.float64(), "combined value V̂(s) used for advantages"),
            _column(
                "value_var",
                pa.float64(),
                "posterior variance of V̂(s); null when the combination gives none",
                nullable=True,
            ),
        ],
    ),
    "advantages": _schema(
        "advantages",
        "one row per segment (before any batch whitening)",
        [
            RUN_ID,
            ITERATION,
            EPISODE_ID,
            SEGMENT_IDX,
            STATE_ID,
            POLICY_VERSION,
            _column("reward", pa.float64(), "segment reward r_k"),
            _column("value", pa.float64(), "V̂(s_k)"),
            _column("next_value", pa.float64(), "V̂(s_{k+1}); 0 after the last segment"),
            _column("delta", pa.float64(), "TD error δ_k"),
            _column("advantage", pa.float64(), "segment advantage A_k"),
            _column("lambda_return", pa.float64(), "λ-return G^λ_k = A_k + V̂(s_k)"),
        ],
    ),
    "updates": _schema(
        "updates",
        "one row per optimizer step",
        [
            RUN_ID,
            ITERATION,
            POLICY_VERSION,  # the version being trained (the behaviour policy of the batch)
            _column("epoch", pa.int32(), "PPO epoch over the batch, from 0"),
            _column("step", pa.int32(), "optimizer step within the iteration, from 0"),
            _column("loss", pa.float64(), "total loss"),
            _column("policy_loss", pa.float64(), "clipped surrogate loss"),
            _column("kl", pa.float64(), "KL estimate to the reference policy"),
            _column("clip_fraction", pa.float64(), "fraction of policy tokens whose ratio was clipped"),
            _column("entropy", pa.float64(), "mean policy entropy per token"),
            _column("grad_norm", pa.float64(), "gradient norm before clipping"),
            _column("lr", pa.float64(), "learning rate of the step"),
            _column("value_loss", pa.float64(), "value-head loss (ppo_gae); null without a value head",
                    nullable=True),
        ],
    ),
    "critic_data": _schema(
        "critic_data",
        "one row per distinct state the critic was fitted on in this round (what a replay re-reads)",
        [
            RUN_ID,
            ITERATION,
            STATE_ID,
            POLICY_VERSION,
            _column("task_id", pa.string(), "task of the state: cross-fitting folds are made of tasks"),
            _column("fold", pa.int32(), "cross-fitting fold of the task"),
            _column("features", FLOATS, "critic input features"),
            _column("successes", pa.float64(), "sum of the returns observed at the state"),
            _column("trials", pa.float64(), "number of returns observed at the state"),
        ],
    ),
    "token_advantages": _schema(
        "token_advantages",
        "one row per segment of a token-level estimator (gae): per-token values, advantages, returns",
        [
            RUN_ID,
            ITERATION,
            EPISODE_ID,
            SEGMENT_IDX,
            STATE_ID,
            POLICY_VERSION,
            _column("values", FLOATS, "value-head V_t of the state each token is generated in (0 off policy tokens)"),
            _column("advantages", FLOATS, "GAE advantage A_t (0 off policy tokens)"),
            _column("returns", FLOATS, "value targets A_t + V_t (0 off policy tokens)"),
        ],
    ),
    "evaluation": _schema(
        "evaluation",
        "one row per held-out episode",
        [
            RUN_ID,
            ITERATION,
            EPISODE_ID,
            POLICY_VERSION,
            _column("task_id", pa.string(), "id of the evaluated task"),
            _column("split", pa.string(), "held-out split name"),
            _column("reward", pa.float64(), "terminal outcome reward"),
            _column("success", pa.bool_(), "true if the task was solved"),
            _column("n_turns", pa.int32(), "number of turns"),
            _column("generated_tokens", pa.int64(), "policy-generated tokens"),
            _column("exact_value", pa.float64(), "exact V^π(s_0) of the task under the evaluated policy at the "
                    "evaluation temperature (trap environments); null where the environment has no exact values",
                    nullable=True),
        ],
    ),
    "budget_ledger": _schema(
        "budget_ledger",
        "one row per (round, kind) with tokens charged",
        [
            RUN_ID,
            ITERATION,
            POLICY_VERSION,
            _column("round", pa.int32(), "acquisition round of the charge (0 for main rollouts)"),
            _column("kind", pa.string(), "main, branch or summary"),
            _column("tokens", pa.int64(), "generated tokens charged"),
            _column("budget", pa.int64(), "token budget of the iteration"),
        ],
    ),
}

# Columns whose values must come from a fixed set: (table, column) -> allowed values.
_ALLOWED_VALUES: dict[tuple[str, str], tuple[Any, ...]] = {
    ("rollouts", "role"): ROLLOUT_ROLES,
    ("rollouts", "loss_mask"): LOSS_MASK_VALUES,
    ("budget_ledger", "kind"): BUDGET_KINDS,
}

# Per-token list columns that must have the same length in every row.
_ALIGNED_LISTS: dict[str, tuple[str, ...]] = {
    "rollouts": ("token_ids", "logprobs", "loss_mask"),
    "token_advantages": ("values", "advantages", "returns"),
}


class SchemaError(ValueError):
    """A table does not match its schema; the message names the table, column and fix."""


def schema_for(table: str) -> pa.Schema:
    """The schema of a table; unknown names raise a ValueError listing the known tables."""
    try:
        return TABLES[table]
    except KeyError:
        raise ValueError(f"unknown table {table!r}; known tables: {', '.join(TABLES)}") from None


def empty_table(name: str) -> pa.Table:
    """A zero-row table with the table's schema."""
    return schema_for(name).empty_table()


def validate_table(table_name: str, table: pa.Table) -> pa.Table:
    """Check a table against its schema and return it cast to that schema, columns in schema order.

    Rejects: a column set that differs from the schema, casts that would lose information (integer
    overflow, truncated floats, strings parsed as numbers), nulls in non-nullable columns or inside
    lists, categorical values outside their allowed set, per-token lists of unequal length, and NaN or
    inf in any floating column, lists included. Errors raise ``SchemaError`` naming the table, the column
    and, for value errors, the first offending row.
    """
    schema = schema_for(table_name)
    _check_column_set(table_name, schema, table)
    for field in schema:
        _check_nulls(table_name, field, table.column(field.name))

    columns = [_cast_column(table_name, field, table.column(field.name)) for field in schema]
    validated = pa.Table.from_arrays(columns, schema=schema)

    for field in schema:
        column = validated.column(field.name).combine_chunks()
        _check_finite(table_name, field.name, column)
        allowed = _ALLOWED_VALUES.get((table_name, field.name))
        if allowed is not None:
            _check_allowed_values(table_name, field.name, column, allowed)
    _check_aligned_lists(table_name, validated)
    return validated


def _check_column_set(table_name: str, schema: pa.Schema, table: pa.Table) -> None:
    expected, actual = set(schema.names), set(table.column_names)
    if len(table.column_names) != len(actual):
        duplicates = sorted({name for name in table.column_names if table.column_names.count(name) > 1})
        raise SchemaError(f"table {table_name!r}: duplicate columns {duplicates}; keep one of each")
    missing = [name for name in schema.names if name not in actual]
    unexpected = sorted(actual - expected)
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing columns {missing}")
        if unexpected:
            problems.append(f"unexpected columns {unexpected}")
        raise SchemaError(
            f"table {table_name!r}: {'; '.join(problems)}. Fix: produce exactly the columns of "
            f"focus_core.schemas.TABLES[{table_name!r}]: {schema.names}"
        )


def _first_true(mask: pa.Array | pa.ChunkedArray) -> int:
    """Index of the first true value, or -1."""
    return pc.index(pc.fill_null(mask, False), True).as_py()


def _check_nulls(table_name: str, field: pa.Field, column: pa.ChunkedArray) -> None:
    if not field.nullable and column.null_count > 0:
        row = _first_true(pc.is_null(column))
        raise SchemaError(
            f"table {table_name!r}, column {field.name!r}: null at row {row}, but the column is not "
            f"nullable; fill it (keys and measurements always have a value)"
        )
    if _is_list(column.type):
        values, parents = _flatten_with_rows(column.combine_chunks())
        if values.null_count > 0:
            row = parents[_first_true(pc.is_null(values))].as_py()
            raise SchemaError(
                f"table {table_name!r}, column {field.name!r}: null element inside the list at row {row}; "
                f"lists hold one value per token"
            )


def _type_family(dtype: pa.DataType) -> str:
    if pa.types.is_dictionary(dtype):
        return _type_family(dtype.value_type)
    for family, predicate in (
        ("null", pa.types.is_null),
        ("boolean", pa.types.is_boolean),
        ("integer", pa.types.is_integer),
        ("floating", pa.types.is_floating),
        ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
        ("list", _is_list),
    ):
        if predicate(dtype):
            return family
    return str(dtype)


def _is_list(dtype: pa.DataType) -> bool:
    return pa.types.is_list(dtype) or pa.types.is_large_list(dtype) or pa.types.is_fixed_size_list(dtype)


def _cast_allowed(source: pa.DataType, target: pa.DataType) -> bool:
    """Whether a cast stays within compatible kinds (Arrow itself would parse '12' as an int, say)."""
    source_family, target_family = _type_family(source), _type_family(target)
    if source_family == "null":  # an all-null column (e.g. from an empty Python list) takes any type
        return True
    if source_family == "list" and target_family == "list":
        return _cast_allowed(source.value_type, target.value_type)
    numeric = {"integer", "floating"}
    return source_family == target_family or {source_family, target_family} <= numeric


def _cast_column(table_name: str, field: pa.Field, column: pa.ChunkedArray) -> pa.ChunkedArray:
    if not _cast_allowed(column.type, field.type):
        raise SchemaError(
            f"table {table_name!r}, column {field.name!r}: has type {column.type}, expected {field.type}; "
            f"produce {field.type} values (no cross-kind casts)"
        )
    try:
        # safe=True makes Arrow raise on integer overflow, truncated floats and inexact int->float.
        return column.cast(field.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
        raise SchemaError(
            f"table {table_name!r}, column {field.name!r}: cannot cast {column.type} to {field.type} "
            f"without losing information: {error}"
        ) from error


def _flatten_with_rows(column: pa.Array) -> tuple[pa.Array, pa.Array]:
    """The values of a list column and, for each value, the row it came from."""
    return pc.list_flatten(column), pc.list_parent_indices(column)


def _check_finite(table_name: str, column_name: str, column: pa.Array) -> None:
    if _is_list(column.type):
        if not pa.types.is_floating(column.type.value_type):
            return
        values, rows = _flatten_with_rows(column)
    elif pa.types.is_floating(column.type):
        values, rows = column, None
    else:
        return
    bad = pc.invert(pc.fill_null(pc.is_finite(values), True))
    position = _first_true(bad)
    if position >= 0:
        row = position if rows is None else rows[position].as_py()
        raise SchemaError(
            f"table {table_name!r}, column {column_name!r}: non-finite value {values[position].as_py()} "
            f"at row {row} (after casting to {column.type}); NaN/inf must never be stored, "
            f"fix the stage that computed it"
        )


def _check_allowed_values(table_name: str, column_name: str, column: pa.Array, allowed: tuple) -> None:
    values, rows = _flatten_with_rows(column) if _is_list(column.type) else (column, None)
    outside = pc.invert(pc.is_in(values, value_set=pa.array(allowed, type=values.type)))
    position = _first_true(outside)
    if position >= 0:
        row = position if rows is None else rows[position].as_py()
        raise SchemaError(
            f"table {table_name!r}, column {column_name!r}: value {values[position].as_py()!r} at row {row} "
            f"is not one of {list(allowed)}"
        )


def _check_aligned_lists(table_name: str, table: pa.Table) -> None:
    names = _ALIGNED_LISTS.get(table_name, ())
    if not names:
        return
    reference = pc.list_value_length(table.column(names[0]))
    for name in names[1:]:
        differs = pc.not_equal(pc.list_value_length(table.column(name)), reference)
        row = _first_true(differs)
        if row >= 0:
            raise SchemaError(
                f"table {table_name!r}: columns {names[0]!r} and {name!r} have different lengths at "
                f"row {row}; per-token lists must have one entry per token"
            )
