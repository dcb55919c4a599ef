"""`focus sql` and `focus runs` on a small hand-made run whose answers are known in advance.

``build_run`` commits a fake-but-valid run through ``ArtifactStore.commit`` (every table validated by
``focus_core.schemas``): bootstrap, then two iterations with the stages of ``flows/train.py`` (two
acquisition rounds), and a final evaluation at iteration 2. The numbers are small and chosen by hand so
each named query's result can be written down here. ``tests/test_tracking.py`` reuses the same run.

The SQL tests run against a local folder and against a real S3 server (SeaweedFS from
``tests/conftest.py``), because the views must read the same parts through either.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.runs import runs_report
from flows.sql import EXACT_VALUE_ROWS, NAMED_QUERIES, connect, describe_queries, format_table, run_query
from focus_core.artifacts import ArtifactStore, Manifest
from focus_core.schemas import TABLES, schema_for

RUN = "demo-run"
BUDGET = 1000
# Main episodes per iteration: two groups ("a", "b") of two episodes; rewards by iteration and group.
REWARDS = {0: {"a": [1.0, 1.0], "b": [0.0, 1.0]}, 1: {"a": [0.0, 0.0], "b": [1.0, 1.0]}}
# Round r branches two states; (episode suffix, segment) -> (critic prediction before the round, returns).
# None is a continuation the token budget cut off: stored with return 0, left out of Monte-Carlo means.
ROUNDS = {
    0: {("a0", 0): (0.7, [1.0, 0.0, None]), ("b0", 0): (0.6, [1.0, 1.0])},
    1: {("a0", 1): (0.1, [0.0, 0.0]), ("b0", 1): (0.4, [1.0, 0.0])},
}
OTHER_CRITIC = 0.5  # prediction for states nobody branches
BRANCH_TOKENS, CUT_TOKENS = 10, 5  # generated tokens per continuation, per cut-off continuation
VALUES = [0.9, 0.8, 0.6, 0.9, 0.2, 0.7, 0.5, 0.8]  # V̂ of the 8 states of an iteration (last fit)
ADVANTAGES = [0.5, -0.5, 0.25, -0.25, 0.0, 0.0, 1.0, -1.0]  # times (iteration + 1)
KL = {0: [0.01, 0.03], 1: [0.02, 0.04]}
HELDOUT = {0: [True, False, False, False], 2: [True, True, False, False]}  # eval_every = 2
LEDGER = {"rollout": [(0, "main", 400), (0, "summary", 40)], "branch_r0": [(0, "branch", 40)],
          "branch_r1": [(1, "branch", 40), (1, "summary", 8)]}
COMPUTE_S = {"rollout": 2.0, "update": 3.0}  # every other stage: 1.0


def table(name: str, rows: list[dict[str, Any]]) -> pa.Table:
    """A table of ``name`` from rows that give only the interesting columns; the rest get neutral values."""
    schema = schema_for(name)
    defaults = {}
    for field in schema:
        kind = field.type
        if field.nullable:
            defaults[field.name] = None
        elif pa.types.is_list(kind):
            defaults[field.name] = []
        elif pa.types.is_string(kind):
            defaults[field.name] = "x"
        elif pa.types.is_boolean(kind):
            defaults[field.name] = False
        else:
            defaults[field.name] = 0
    return pa.Table.from_pylist([{**defaults, **row} for row in rows], schema=schema)


def episodes_of(iteration: int) -> list[tuple[str, str, float]]:
    """(episode id, group id, reward) of an iteration's main episodes."""
    return [(f"e{iteration}{group}{k}", f"g{iteration}{group}", reward)
            for group, rewards in REWARDS[iteration].items() for k, reward in enumerate(rewards)]


def state_id(iteration: int, suffix: str, segment: int) -> str:
    return f"s-e{iteration}{suffix}-{segment}"


def build_run(store: ArtifactStore, policy_dir: Path, *, run_id: str = RUN) -> dict[int, dict[str, Manifest]]:
    """Commit the hand-made run; returns the manifests by iteration and stage (as flows/train.py has them)."""
    critic_dir = policy_dir.parent / "critic-folder"
    critic_dir.mkdir(exist_ok=True)
    (critic_dir / "critic.json").write_text('{"members": 2}')
    key = {"run_id": run_id}

    def commit(iteration: int, stage: str, tables: dict[str, list[dict]] | None = None, **kw: Any) -> Manifest:
        return store.commit(
            run_id, iteration, stage, version=f"v-{stage}", policy_version=iteration,
            tables={name: table(name, [{**key, "iteration": iteration, "policy_version": iteration, **row}
                                       for row in rows]) for name, rows in (tables or {}).items()},
            timings={"compute_s": COMPUTE_S.get(stage, 1.0)}, **kw)

    def evaluate(iteration: int) -> Manifest:
        rows = [{"episode_id": f"h{iteration}-{k}", "success": ok, "reward": float(ok), "split": "heldout"}
                for k, ok in enumerate(HELDOUT[iteration])]
        return commit(iteration, "evaluate", {"evaluation": rows},
                      figures={"heldout_success": sum(HELDOUT[iteration]) / len(HELDOUT[iteration])})

    manifests: dict[int, dict[str, Manifest]] = {0: {"bootstrap": commit(0, "bootstrap", folders={"policy": policy_dir},
                                                                          figures={"parameters": 1234})}}
    for i in (0, 1):
        stages = manifests.setdefault(i, {})
        if i in HELDOUT:
            stages["evaluate"] = evaluate(i)
        main = episodes_of(i)
        states = [(ep, k) for ep, _, _ in main for k in (0, 1)]
        turns = [{"episode_id": ep, "segment_idx": k, "state_id": f"s-{ep}-{k}", "turn_idx": 2 * k + t,
                  "role": role, "text": f"{role} turn {2 * k + t} of {ep}", "token_ids": [1, 2, 3],
                  "logprobs": [-0.5 if role == "policy" else 0.0] * 3, "loss_mask": [int(role == "policy")] * 3,
                  "generated_tokens": 3 if role == "policy" else 0}
                 for ep, k in states for t, role in enumerate(("policy", "tool"))]
        rewards = [reward for _, _, reward in main]
        stages["rollout"] = commit(i, "rollout", {
            "rollouts": turns,
            "episodes": [{"episode_id": ep, "group_id": g, "reward": r, "split": "train", "n_segments": 2}
                         for ep, g, r in main],
            "budget_ledger": [{"round": r, "kind": kind, "tokens": n, "budget": BUDGET}
                              for r, kind, n in LEDGER["rollout"]],
        }, figures={"episodes": 4, "success": sum(rewards) / 4, "tokens": 440, "budget": BUDGET})
        reward_of = {ep: r for ep, _, r in main}
        stages["segment"] = commit(i, "segment", {"states": [
            {"episode_id": ep, "segment_idx": k, "state_id": f"s-{ep}-{k}", "own_return": reward_of[ep],
             "segment_reward": reward_of[ep] if k == 1 else 0.0, "features": [0.1, 0.2]} for ep, k in states
        ]}, figures={"states": 8})
        for r, chosen in ROUNDS.items():
            plan = {state_id(i, suffix, k): (critic, returns) for (suffix, k), (critic, returns) in chosen.items()}
            no_critic = (i, r) == (0, 0)  # the first round of a run has no critic yet
            stages[f"acquire_r{r}"] = commit(i, f"acquire_r{r}", {"acquisition": [
                {"episode_id": ep, "segment_idx": k, "state_id": f"s-{ep}-{k}", "round": r,
                 "critic_mean": None if no_critic else plan.get(f"s-{ep}-{k}", (OTHER_CRITIC,))[0],
                 "cost_estimate": 10.0, "continuations": len(plan[f"s-{ep}-{k}"][1]) if f"s-{ep}-{k}" in plan else 0,
                 "reason": "chosen" if f"s-{ep}-{k}" in plan else "not chosen"} for ep, k in states
            ]}, figures={"chosen_states": 2, "continuations": 4})
            # (state, segment, index, return, tokens, budget cut, truncated) of every continuation
            branches = [(sid, k, n, 0.0 if ret is None else ret, CUT_TOKENS if ret is None else BRANCH_TOKENS,
                         ret is None, ret is None or (r == 1 and n == 1))
                        for (suffix, k), (_, returns) in chosen.items()
                        for sid in [state_id(i, suffix, k)] for n, ret in enumerate(returns)]
            stages[f"branch_r{r}"] = commit(i, f"branch_r{r}", {
                "branches": [{"episode_id": f"b-{sid}-{n}", "segment_idx": k, "state_id": sid,
                              "branch_id": f"{sid}/{r}/{n}", "round": r, "return": ret,
                              "generated_tokens": tokens, "truncated": truncated}
                             for sid, k, n, ret, tokens, _, truncated in branches],
                "episodes": [{"episode_id": f"b-{sid}-{n}", "branch_id": f"{sid}/{r}/{n}", "group_id": f"gb-{sid}",
                              "reward": ret, "is_branch": True, "parent_state_id": sid, "generated_tokens": tokens,
                              "budget_cut": cut, "truncated": truncated}
                             for sid, k, n, ret, tokens, cut, truncated in branches],
                "rollouts": [{"episode_id": f"b-{sid}-{n}", "segment_idx": k, "state_id": sid,
                              "branch_id": f"{sid}/{r}/{n}", "role": "policy", "token_ids": [4] * tokens,
                              "logprobs": [-1.0] * tokens, "loss_mask": [1] * tokens,
                              "generated_tokens": tokens} for sid, k, n, _, tokens, _, _ in branches],
                "budget_ledger": [{"round": rr, "kind": kind, "tokens": n, "budget": BUDGET}
                                  for rr, kind, n in LEDGER[f"branch_r{r}"]],
            }, figures={"continuations": 4, "tokens": 40})
            values = VALUES if r == 1 else [0.5] * 8  # the last fit's values are the ones that count
            stages[f"fit_critic_r{r}"] = commit(i, f"fit_critic_r{r}", {"values": [
                {"episode_id": ep, "segment_idx": k, "state_id": f"s-{ep}-{k}", "critic_mean": v, "value": v, "n": 0}
                for (ep, k), v in zip(states, values, strict=True)
            ]}, folders={"critic": critic_dir}, figures={"fit_loss": 0.3, "states": 8})
        advantages = [a * (i + 1) for a in ADVANTAGES]
        stages["advantage"] = commit(i, "advantage", {"advantages": [
            {"episode_id": ep, "segment_idx": k, "state_id": f"s-{ep}-{k}", "advantage": a, "value": v,
             "lambda_return": a + v} for (ep, k), a, v in zip(states, advantages, VALUES, strict=True)
        ]}, figures={"segments": 8, "mean_advantage": sum(advantages) / 8})
        stages["update"] = commit(i, "update", {"updates": [
            {"step": s, "kl": kl, "clip_fraction": 0.1 * (s + 1), "entropy": 1.0} for s, kl in enumerate(KL[i])
        ]}, folders={"policy": policy_dir},
            figures={"steps": 2, "kl": sum(KL[i]) / 2, "clip_fraction": 0.15, "entropy": 1.0})
    manifests[2] = {"evaluate": evaluate(2)}
    return manifests


# --- fixtures ---------------------------------------------------------------------------------------------------


def open_store(kind: str, request: pytest.FixtureRequest, folder: Path) -> ArtifactStore:
    if kind == "local":
        return ArtifactStore(folder / "runs")
    return ArtifactStore(f"{request.getfixturevalue('s3_store_root')}/sql-{uuid.uuid4().hex[:12]}")


def fake_checkpoint(folder: Path) -> Path:
    """Stands in for a policy checkpoint folder; the SQL side never opens it."""
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ArtifactStore:
    return open_store(request.param, request, tmp_path)


@pytest.fixture
def policy_dir(tmp_path: Path) -> Path:
    return fake_checkpoint(tmp_path / "policy")


@pytest.fixture(scope="module", params=["local", "s3"])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ArtifactStore:
    """The hand-made run, built once per store kind; tests that change a store build their own."""
    folder = tmp_path_factory.mktemp("sql-run")
    store = open_store(request.param, request, folder)
    build_run(store, fake_checkpoint(folder / "policy"))
    return store


def query(store: ArtifactStore, name: str) -> list[dict[str, Any]]:
    columns, rows = run_query(connect(store, RUN), name)
    return [dict(zip(columns, row, strict=True)) for row in rows]


# --- views ------------------------------------------------------------------------------------------------------


def test_views_cover_every_table_with_iteration_and_stage(built: ArtifactStore) -> None:
    con = connect(built, RUN)
    for name in TABLES:
        columns = [row[0] for row in con.execute(f'DESCRIBE "{name}"').fetchall()]
        assert columns == [*schema_for(name).names, "stage"]
    counts = dict(con.execute("SELECT stage, count(*) FROM rollouts WHERE iteration = 1 GROUP BY stage").fetchall())
    assert counts == {"rollout": 16, "branch_r0": 5, "branch_r1": 4}
    assert con.execute("SELECT DISTINCT iteration FROM episodes ORDER BY 1").fetchall() == [(0,), (1,)]
    assert con.execute("SELECT count(*) FROM manifests").fetchone() == (1 + 1 + 2 * 10 + 1,)


def test_views_read_only_manifest_listed_parts(store: ArtifactStore, policy_dir: Path) -> None:
    """A stray part (a crashed writer's leftover, a copied file) in a stage folder is not part of the run."""
    build_run(store, policy_dir)
    (_, _, url), = [entry for entry in store.parquet_files(RUN, "episodes") if entry[:2] == (0, "rollout")]
    stray = f"{url.rsplit('/', 1)[0]}/part-99999-deadbeef.parquet".removeprefix("s3://")
    extra = table("episodes", [{"run_id": RUN, "iteration": 0, "episode_id": "stray", "reward": 1.0}])
    with store.filesystem.open(stray, "wb") as file:
        pq.write_table(extra, file)
    assert store.filesystem.exists(stray)
    con = connect(store, RUN)
    assert con.execute("SELECT count(*) FROM episodes WHERE episode_id = 'stray'").fetchone() == (0,)
    assert con.execute("SELECT count(*) FROM episodes WHERE stage = 'rollout'").fetchone() == (8,)


def test_young_run_has_every_view_and_every_named_query_runs(store: ArtifactStore, policy_dir: Path) -> None:
    store.commit(RUN, 0, "bootstrap", version="v", folders={"policy": policy_dir}, timings={"compute_s": 1.0})
    con = connect(store, RUN)
    for name in NAMED_QUERIES:
        columns, rows = run_query(con, name)
        assert columns and len(rows) == (name == "stage_times"), name  # stage_times: the bootstrap row
    assert run_query(con, "SELECT stage, compute_s FROM manifests") == (["stage", "compute_s"], [("bootstrap", 1.0)])
    assert run_query(connect(store, "never-started"), "SELECT count(*) FROM rollouts")[1] == [(0,)]


# --- named queries: the hand-computed answers -------------------------------------------------------------------


def test_reward_trend(built: ArtifactStore) -> None:
    rows = query(built, "reward_trend")
    picked = [(r["iteration"], r["train_episodes"], r["train_success"], r["heldout_success"], r["tokens"],
               r["branch_tokens"]) for r in rows]
    assert picked == [(0, 4, 0.75, 0.25, 528, 80), (1, 4, 0.5, None, 528, 80), (2, None, None, 0.5, None, None)]


def test_critic_error_compares_predictions_made_before_the_round(built: ArtifactStore) -> None:
    rows = query(built, "critic_error")
    picked = [(r["iteration"], r["round"], r["segment_idx"], r["states"], r["continuations"]) for r in rows]
    # iteration 0, round 0 had no critic yet: no row; the continuation the budget cut off is not counted
    assert picked == [(0, 1, 1, 2, 4), (1, 0, 0, 2, 4), (1, 1, 1, 2, 4)]
    # round 0: |0.7 - 0.5| and |0.6 - 1.0|; round 1: |0.1 - 0| and |0.4 - 0.5|
    assert [r["mae"] for r in rows] == pytest.approx([0.1, 0.3, 0.1])
    assert [r["bias"] for r in rows] == pytest.approx([0.0, -0.1, 0.0])
    assert [r["mean_mc"] for r in rows] == pytest.approx([0.25, 0.75, 0.25])


def test_budget_per_state(built: ArtifactStore) -> None:
    rows = query(built, "budget_per_state")
    assert len(rows) == 8  # 4 branched states in each of 2 iterations
    by_state = {(r["iteration"], r["state_id"]): r for r in rows}
    picked = ["allocated", "continuations", "tokens", "rounds", "mc_mean", "budget_cut", "truncated"]
    assert [by_state[(1, "s-e1b0-0")][column] for column in picked] == [2, 2, 20, 1, 1.0, 0, 0]
    # three continuations, one cut off by the budget: its tokens count, its return does not
    assert [by_state[(1, "s-e1a0-0")][column] for column in picked] == [3, 3, 25, 1, 0.5, 1, 1]
    assert by_state[(0, "s-e0b0-1")]["truncated"] == 1
    assert sum(r["tokens"] for r in rows) == 2 * (8 * BRANCH_TOKENS + CUT_TOKENS)


def test_zero_variance_groups(built: ArtifactStore) -> None:
    rows = query(built, "zero_variance_groups")
    assert [(r["iteration"], r["groups"], r["zero_variance"], r["share"], r["all_solved"], r["all_failed"])
            for r in rows] == [(0, 2, 1, 0.5, 1, 0), (1, 2, 2, 1.0, 1, 1)]


def test_stage_times(built: ArtifactStore) -> None:
    rows = query(built, "stage_times")
    assert len(rows) == 23
    iteration_1 = [r for r in rows if r["iteration"] == 1]
    assert [r["stage"] for r in iteration_1][:3] == ["rollout", "segment", "acquire_r0"]
    assert sum(r["compute_s"] for r in iteration_1) == 2.0 + 3.0 + 8 * 1.0
    assert sum(r["compute_share"] for r in iteration_1) == pytest.approx(1.0)
    assert all(r["overhead_s"] >= 0 for r in rows)  # the store's own write time
    rollout = next(r for r in iteration_1 if r["stage"] == "rollout")
    assert rollout["rows"] == 16 + 4 + 2 and not rollout["skipped"]
    con = connect(built, RUN)
    assert con.execute("SELECT figures->>'success' FROM manifests WHERE stage = 'rollout' AND iteration = 0"
                       ).fetchone() == ("0.75",)


def test_turns_with_advantages(built: ArtifactStore) -> None:
    rows = query(built, "turns_with_advantages")
    assert len(rows) == 2 * 16  # the main rollouts' turns only, branches excluded
    turn = next(r for r in rows if r["iteration"] == 1 and r["episode_id"] == "e1a1" and r["turn_idx"] == 2)
    assert turn["segment_idx"] == 1 and turn["advantage"] == pytest.approx(-0.25 * 2)
    assert turn["value"] == VALUES[3] and turn["reward"] == 0.0 and turn["kl"] == pytest.approx(0.03)
    assert query(built, "join_example") == rows


def test_run_query_rejects_unknown_names_and_runs_sql(built: ArtifactStore) -> None:
    con = connect(built, RUN)
    with pytest.raises(ValueError, match="no named query 'reward_trends'.*reward_trend"):
        run_query(con, "reward_trends")
    assert run_query(con, "SELECT count(*) AS n FROM branches") == (["n"], [(18,)])
    assert "critic_error" in describe_queries()


def test_format_table() -> None:
    text = format_table(["iteration", "stage", "value"], [(0, "rollout", 0.123456), (11, None, 2.0)])
    lines = text.splitlines()
    assert lines[0].split() == ["iteration", "stage", "value"]
    assert lines[2].split() == ["0", "rollout", "0.1235"] and lines[3].split() == ["11", "2"]
    assert lines[-1] == "(2 rows)"
    assert format_table(["n"], [(k,) for k in range(5)], max_rows=2).splitlines()[-1] == "(5 rows, 3 not shown)"
    assert format_table([], []) == "(no result)"


# --- focus runs --------------------------------------------------------------------------------------------------


def test_runs_report(tmp_path: Path, policy_dir: Path) -> None:
    store = ArtifactStore(tmp_path / "runs")
    assert "no runs" in runs_report(store)
    build_run(store, policy_dir)
    store.write_run_info(RUN, {"status": "finished", "config": {"method": "focus", "iterations": 2},
                               "iteration_wall_s": {"0": 28.0, "1": 26.0}})
    store.commit("young", 0, "bootstrap", version="v", timings={"compute_s": 3.0})
    lines = runs_report(store).splitlines()
    assert lines[0].split()[:3] == ["run", "status", "method"]
    demo = next(line for line in lines if line.startswith(RUN)).split()
    # iterations 0 and 1 hold 14 s and 13 s of compute (bootstrap excluded) in 54 s of wall time
    assert demo[1:5] == ["finished", "focus", "2/2", "2/evaluate"] and demo[5] == "0.5"
    assert demo[-1] == "50%"
    young = next(line for line in lines if line.startswith("young")).split()
    assert young[1] == "unknown" and young[3] == "0" and young[4] == "0/bootstrap"


def test_value_error_exact_compares_the_last_critic_round_with_the_values_the_advantages_used(built) -> None:
    # In this run the advantages used the last fit's values (no exact_values), so every error is 0; the first
    # round's values (0.5 everywhere) would give mean |0.5 - V| instead.
    rows = query(built, "value_error_exact")
    assert [(r["iteration"], r["worth_nothing"], r["has_returns"], r["states"]) for r in rows] == [
        (0, False, False, 8), (1, False, False, 8)]
    for r in rows:
        assert r["critic_mae"] == r["combined_mae"] == 0.0
        assert r["exact"] == pytest.approx(sum(VALUES) / 8) == r["critic"]


def test_the_last_critic_round_is_the_highest_round_number_not_the_last_name_in_text_order() -> None:
    # Regression: the last round was max(stage), and 'fit_critic_r10' sorts before 'fit_critic_r9' as text.
    con = duckdb.connect()
    con.execute('CREATE TABLE "values" (run_id TEXT, iteration INT, stage TEXT, episode_id TEXT, segment_idx INT, '
                'value DOUBLE)')
    con.execute("CREATE TABLE advantages (run_id TEXT, iteration INT, episode_id TEXT, segment_idx INT, "
                "value DOUBLE)")
    con.execute("""INSERT INTO "values" VALUES ('r', 0, 'fit_critic_r9', 'e', 0, 0.9),
                   ('r', 0, 'fit_critic_r10', 'e', 0, 0.1), ('r', 0, 'fit_critic_r2', 'e', 0, 0.2)""")
    con.execute("INSERT INTO advantages VALUES ('r', 0, 'e', 0, 0.0)")
    assert con.execute(f"SELECT stage, value FROM ({EXACT_VALUE_ROWS})").fetchall() == [("fit_critic_r10", 0.1)]
