"""`focus sql`: DuckDB views over one run's committed tables, plus the queries people ask for first.

Why views over the manifests and not a glob: a stage folder can hold parts a reader must not see (the
leftovers of a write that crashed before its manifest, a stray file someone copied in). The store's
rule is that a stage is what its ``_manifest.json`` lists, so every view here reads exactly the parts
the committed manifests name (``ArtifactStore.parquet_files`` semantics), over every iteration. A glob
would silently mix in the rest.

Each table of ``focus_core.schemas`` becomes one view with its own columns plus ``stage`` (which
stage wrote the row: ``rollout`` or ``branch_r1`` both write ``rollouts``); ``iteration`` is already a
column of every table. Hive partitioning is switched off on purpose: the ``iteration=0003`` folder name
would otherwise replace the integer column with the string ``'0003'``. A table with no committed part
yet (a young run, a method that skips the stage) still gets a view, empty and typed from the schema,
so the named queries run on any run. One more view, ``manifests``, has one row per committed stage
(timings, row counts, figures as JSON) for questions about time and progress.

S3 stores work without DuckDB's httpfs extension (it cannot be installed offline): the store's
fsspec filesystem is registered with the connection (reference/tooling.md §5).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import duckdb
import pyarrow as pa

from focus_core.artifacts import COMPUTE_TIMING, PARTS_OF_COMPUTE, ArtifactStore, Manifest
from focus_core.ids import canonical_json
from focus_core.schemas import TABLES, empty_table

# Each entry: name -> (one-line description, SQL). The main rollouts of an iteration are the rows the
# rollout stage wrote (stage = 'rollout'); branch stages add their own rollouts and episodes. Turns are
# ordered as focus_core.rollouts orders them: (segment, turn, role rank tool < context < policy/summary).
# Each main state's row of the last critic round's `values`, with the value its advantage used as `exact` (in an
# exact_values run, V^pi): what `value_error_exact` and bench/value_calibration.py compare. The last round is the
# highest round number: as text, 'fit_critic_r10' sorts before 'fit_critic_r9'.
EXACT_VALUE_ROWS = """
    WITH last_round AS (
        SELECT run_id, iteration, arg_max(stage, CAST(regexp_extract(stage, '[0-9]+$') AS INTEGER)) AS stage
        FROM "values" GROUP BY run_id, iteration)
    SELECT v.*, a.value AS exact
    FROM "values" v JOIN last_round USING (run_id, iteration, stage)
    JOIN advantages a ON a.run_id = v.run_id AND a.iteration = v.iteration AND a.episode_id = v.episode_id
        AND a.segment_idx = v.segment_idx
"""

NAMED_QUERIES: dict[str, tuple[str, str]] = {
    "reward_trend": (
        "per iteration: train success of the main rollouts, held-out success, budget tokens spent",
        """
        WITH train AS (
            SELECT iteration, count(*) AS train_episodes, avg(reward) AS train_reward,
                   avg(CASE WHEN reward > 0 THEN 1.0 ELSE 0.0 END) AS train_success
            FROM episodes WHERE stage = 'rollout' AND NOT is_branch GROUP BY iteration),
        heldout AS (
            SELECT iteration, count(*) AS heldout_episodes, avg(success::DOUBLE) AS heldout_success
            FROM evaluation GROUP BY iteration),
        spent AS (
            SELECT iteration, sum(tokens) AS tokens,
                   sum(tokens) FILTER (WHERE kind = 'main') AS main_tokens,
                   sum(tokens) FILTER (WHERE kind = 'branch') AS branch_tokens,
                   sum(tokens) FILTER (WHERE kind = 'summary') AS summary_tokens
            FROM budget_ledger GROUP BY iteration),
        iterations AS (
            SELECT iteration FROM train UNION SELECT iteration FROM heldout UNION SELECT iteration FROM spent)
        SELECT i.iteration, t.train_episodes, t.train_success, t.train_reward, h.heldout_episodes,
               h.heldout_success, s.tokens, s.main_tokens, s.branch_tokens, s.summary_tokens
        FROM iterations i
        LEFT JOIN train t USING (iteration) LEFT JOIN heldout h USING (iteration) LEFT JOIN spent s USING (iteration)
        ORDER BY i.iteration
        """,
    ),
    "critic_error": (
        "per iteration, round and segment index: critic prediction (made before the round's branches) "
        "vs the Monte-Carlo mean of those branches (budget-cut ones left out) — MAE, bias, states",
        """
        WITH predicted AS (
            SELECT iteration, "round", state_id, any_value(segment_idx) AS segment_idx, avg(critic_mean) AS critic
            FROM acquisition WHERE critic_mean IS NOT NULL GROUP BY iteration, "round", state_id),
        measured AS (
            SELECT b.iteration, b."round", b.state_id, avg(b."return") AS mc_mean, count(*) AS n
            FROM branches b LEFT JOIN episodes e
                ON e.stage = b.stage AND e.iteration = b.iteration AND e.episode_id = b.episode_id
            WHERE NOT coalesce(e.budget_cut, false)
            GROUP BY b.iteration, b."round", b.state_id)
        SELECT p.iteration, p."round", p.segment_idx, count(*) AS states, sum(m.n) AS continuations,
               avg(p.critic) AS mean_critic, avg(m.mc_mean) AS mean_mc,
               avg(abs(p.critic - m.mc_mean)) AS mae, avg(p.critic - m.mc_mean) AS bias
        FROM predicted p JOIN measured m USING (iteration, "round", state_id)
        GROUP BY p.iteration, p."round", p.segment_idx
        ORDER BY p.iteration, p."round", p.segment_idx
        """,
    ),
    "budget_per_state": (
        "per iteration and branched state: continuations allocated and run, tokens spent, MC mean return "
        "(without budget-cut continuations, whose tokens still count)",
        """
        WITH allocated AS (
            SELECT iteration, state_id, any_value(segment_idx) AS segment_idx, sum(continuations) AS allocated,
                   count(DISTINCT "round") FILTER (WHERE continuations > 0) AS rounds,
                   avg(cost_estimate) AS cost_estimate
            FROM acquisition GROUP BY iteration, state_id HAVING sum(continuations) > 0),
        spent AS (
            SELECT b.iteration, b.state_id, any_value(b.segment_idx) AS segment_idx, count(*) AS continuations,
                   sum(b.generated_tokens) AS tokens,
                   avg(b."return") FILTER (WHERE NOT coalesce(e.budget_cut, false)) AS mc_mean,
                   count(*) FILTER (WHERE e.budget_cut) AS budget_cut, count(*) FILTER (WHERE b.truncated) AS truncated
            FROM branches b LEFT JOIN episodes e
                ON e.stage = b.stage AND e.iteration = b.iteration AND e.episode_id = b.episode_id
            GROUP BY b.iteration, b.state_id)
        SELECT iteration, state_id, coalesce(a.segment_idx, s.segment_idx) AS segment_idx,
               coalesce(a.rounds, 0) AS rounds, coalesce(a.allocated, 0) AS allocated,
               coalesce(s.continuations, 0) AS continuations, coalesce(s.tokens, 0) AS tokens,
               a.cost_estimate, s.mc_mean, coalesce(s.budget_cut, 0) AS budget_cut,
               coalesce(s.truncated, 0) AS truncated
        FROM allocated a FULL OUTER JOIN spent s USING (iteration, state_id)
        ORDER BY iteration, tokens DESC, state_id
        """,
    ),
    "zero_variance_groups": (
        "per iteration: groups of main episodes whose rewards are all equal (no GRPO signal): count, share",
        """
        WITH groups AS (
            SELECT iteration, group_id, min(reward) AS lowest, max(reward) AS highest
            FROM episodes WHERE stage = 'rollout' AND NOT is_branch GROUP BY iteration, group_id)
        SELECT iteration, count(*) AS groups, count(*) FILTER (WHERE lowest = highest) AS zero_variance,
               count(*) FILTER (WHERE lowest = highest) / count(*) AS share,
               count(*) FILTER (WHERE lowest = highest AND lowest > 0) AS all_solved,
               count(*) FILTER (WHERE lowest = highest AND highest <= 0) AS all_failed
        FROM groups GROUP BY iteration ORDER BY iteration
        """,
    ),
    "stage_times": (
        "per iteration and stage: compute and overhead seconds, share of the iteration's compute, rows",
        """
        SELECT iteration, stage, compute_s, overhead_s,
               compute_s / nullif(sum(compute_s) OVER (PARTITION BY iteration), 0) AS compute_share,
               rows, skipped IS NOT NULL AS skipped
        FROM manifests ORDER BY iteration, created_at, stage
        """,
    ),
    "turns_with_advantages": (
        "every turn of the main rollouts with its episode reward, its segment's value and advantage, and "
        "the KL and clip fraction of that iteration's update",
        """
        WITH steps AS (
            SELECT iteration, avg(kl) AS kl, avg(clip_fraction) AS clip_fraction FROM updates GROUP BY iteration)
        SELECT r.iteration, r.episode_id, r.segment_idx, r.turn_idx, r.role, r.generated_tokens, e.reward,
               a.value, a.advantage, a.lambda_return, s.kl, s.clip_fraction, left(r.text, 60) AS text
        FROM rollouts r
        JOIN episodes e ON e.stage = 'rollout' AND e.iteration = r.iteration AND e.episode_id = r.episode_id
        LEFT JOIN advantages a
            ON a.iteration = r.iteration AND a.episode_id = r.episode_id AND a.segment_idx = r.segment_idx
        LEFT JOIN steps s ON s.iteration = r.iteration
        WHERE r.stage = 'rollout'
        ORDER BY r.iteration, r.episode_id, r.segment_idx, r.turn_idx,
                 CASE r.role WHEN 'tool' THEN 0 WHEN 'context' THEN 1 WHEN 'policy' THEN 2 ELSE 3 END
        """,
    ),
    "value_error_exact": (
        "runs with exact_values: per iteration, the last critic round's values (the critic's own, and combined "
        "with the state's returns) against the exact V^pi the advantages used, split by whether the state is "
        "worth nothing (a doomed lock, a poisoned chain) and whether it has returns of its own — MAE, states",
        f"""
        SELECT iteration, exact = 0 AS worth_nothing, n > 0 AS has_returns, count(*) AS states,
               avg(exact) AS exact, avg(critic_mean) AS critic, avg(value) AS combined,
               avg(abs(critic_mean - exact)) AS critic_mae, avg(abs(value - exact)) AS combined_mae
        FROM ({EXACT_VALUE_ROWS})
        GROUP BY ALL ORDER BY ALL
        """,
    ),
}
NAMED_QUERIES["join_example"] = ("the same as turns_with_advantages", NAMED_QUERIES["turns_with_advantages"][1])

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


def connect(store: ArtifactStore, run_id: str | Sequence[str]) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with one view per table over the run (or every run given), plus
    ``manifests``. Every table has a ``run_id`` column, so several runs share one view."""
    con = duckdb.connect()
    if store.root.startswith("s3://"):
        con.register_filesystem(store.filesystem)
    run_ids = [run_id] if isinstance(run_id, str) else list(run_id)
    committed = [(rid, *entry) for rid in run_ids for entry in store.committed(rid)]  # one listing per run
    for table in TABLES:
        # (url, stage) of each committed part, built as ArtifactStore.parquet_files builds it
        parts = [
            (f"{store.stage_url(rid, iteration, stage)}/{part.path}", stage)
            for rid, iteration, stage, manifest in committed
            for part in manifest.tables.get(table, ())
        ]
        _create_table_view(con, table, parts)
    con.register("_manifests", _manifest_rows([entry[1:] for entry in committed]))
    con.execute(
        "CREATE VIEW manifests AS SELECT * EXCLUDE (tables, figures, timings), tables::JSON AS tables, "
        "figures::JSON AS figures, timings::JSON AS timings FROM _manifests"
    )
    return con


def connect_compare(store: ArtifactStore, name: str) -> duckdb.DuckDBPyConnection:
    """``connect`` over every run of comparison ``name``, plus ``run_meta`` (run_id, env, method, seed,
    overrides, status): join it on run_id to group any table by method."""
    from flows.compare import compare_rows

    rows = compare_rows(store, name)
    present = [r for r in rows if store.run_info(r["run_id"]) is not None or store.committed(r["run_id"])]
    con = connect(store, [r["run_id"] for r in present])
    meta = pa.table({"run_id": [r["run_id"] for r in rows], "env": [r["env"] for r in rows],
                     "method": [r["method"] for r in rows], "seed": pa.array([r["seed"] for r in rows], pa.int32()),
                     "overrides": [" ".join(r["overrides"]) for r in rows],
                     "status": [(store.run_info(r["run_id"]) or {}).get("status", "not started") for r in rows]})
    con.register("_run_meta", meta)
    con.execute("CREATE VIEW run_meta AS SELECT * FROM _run_meta")
    return con


def _create_table_view(con: duckdb.DuckDBPyConnection, table: str, parts: list[tuple[str, str]]) -> None:
    if not parts:
        con.register(f"_empty_{table}", empty_table(table))
        con.execute(f'CREATE VIEW "{table}" AS SELECT *, NULL::VARCHAR AS stage FROM "_empty_{table}"')
        return
    con.register(f"_parts_{table}", pa.table({"filename": [url for url, _ in parts], "stage": [s for _, s in parts]}))
    urls = ", ".join(_literal(url) for url, _ in parts)
    con.execute(
        f'CREATE VIEW "{table}" AS SELECT t.* EXCLUDE (filename), p.stage '
        f"FROM read_parquet([{urls}], filename = true, hive_partitioning = false) AS t "
        f'JOIN "_parts_{table}" AS p ON p.filename = t.filename'
    )


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _manifest_rows(committed: Sequence[tuple[int, str, Manifest]]) -> pa.Table:
    rows = []
    for iteration, stage, manifest in committed:
        compute = float(manifest.timings.get(COMPUTE_TIMING, 0.0))
        rows.append({
            "run_id": manifest.run_id,
            "iteration": iteration,
            "stage": stage,
            "version": manifest.version,
            "policy_version": manifest.policy_version,
            "skipped": manifest.skipped,
            "created_at": manifest.created_at,
            "compute_s": compute,
            "overhead_s": float(sum(v for k, v in manifest.timings.items()
                                    if k != COMPUTE_TIMING and k not in PARTS_OF_COMPUTE)),
            "rows": sum(manifest.rows.values()),
            "tables": canonical_json(manifest.rows),
            "figures": canonical_json(dict(manifest.figures)),
            "timings": canonical_json(dict(manifest.timings)),
        })
    schema = pa.schema([
        ("run_id", pa.string()), ("iteration", pa.int32()), ("stage", pa.string()), ("version", pa.string()),
        ("policy_version", pa.int32()), ("skipped", pa.string()), ("created_at", pa.string()),
        ("compute_s", pa.float64()), ("overhead_s", pa.float64()), ("rows", pa.int64()),
        ("tables", pa.string()), ("figures", pa.string()), ("timings", pa.string()),
    ])
    return pa.Table.from_pylist(rows, schema=schema)


def run_query(con: duckdb.DuckDBPyConnection, name_or_sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run a named query (``NAMED_QUERIES``) or any SQL; return column names and rows."""
    text = name_or_sql.strip()
    if text in NAMED_QUERIES:
        text = NAMED_QUERIES[text][1]
    elif _IDENTIFIER.fullmatch(text):
        raise ValueError(
            f"no named query {text!r}; named queries: {', '.join(NAMED_QUERIES)} (or pass SQL, e.g. "
            f"'SELECT * FROM {text} LIMIT 10')"
        )
    cursor = con.execute(text)
    if cursor.description is None:  # a statement without a result (CREATE, SET ...)
        return [], []
    return [column[0] for column in cursor.description], cursor.fetchall()


def describe_queries() -> str:
    """The named queries and the views, as `focus sql RUN_ID` prints them without a query."""
    width = max(len(name) for name in NAMED_QUERIES)
    lines = ["named queries:"] + [f"  {name:<{width}}  {text}" for name, (text, _) in NAMED_QUERIES.items()]
    lines += ["views: " + ", ".join([*TABLES, "manifests"]) + " (each table view adds a `stage` column)"]
    return "\n".join(lines)


def format_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, max_rows: int | None = 50,
                 max_width: int = 40) -> str:
    """Rows as an aligned text table (numbers right-aligned); ``max_rows=None`` prints every row."""
    if not columns:
        return "(no result)"
    shown = rows if max_rows is None else rows[:max_rows]
    cells = [[_cell(value, max_width) for value in row] for row in shown]
    numeric = [all(_is_number(row[k]) or row[k] is None for row in shown) for k in range(len(columns))]
    widths = [max([len(name), *(len(row[k]) for row in cells)]) for k, name in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            value.rjust(width) if right else value.ljust(width)
            for value, width, right in zip(values, widths, numeric, strict=True)
        ).rstrip()

    out = [line(list(columns)), line(["-" * width for width in widths]), *(line(row) for row in cells)]
    hidden = len(rows) - len(shown)
    out.append(f"({len(rows)} rows" + (f", {hidden} not shown)" if hidden else ")"))
    return "\n".join(out)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _cell(value: Any, max_width: int) -> str:
    if value is None:
        text = ""
    elif isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, list | dict):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= max_width else text[: max_width - 1] + "…"
