"""The `focus` command line.

    focus train [--config PATH] [--set a.b=c ...] [--init RUN_ID] [--store ROOT] [--run-id ID]
                                                                         train (the Prefect flow)
    focus resume RUN_ID [--store ROOT]                                   continue a run from its last commit
    focus runs [--store ROOT]                                            runs with status, progress, overhead
    focus sql RUN_ID [NAME | --query SQL] [--store ROOT]                 DuckDB over a run's tables
    focus compare SPEC.yaml [--env NAME] [--workers N] [--dask ADDRESS] [--store ROOT]  a grid from shared starts
    focus report NAME [--out DIR] [--from-json PATH] [--keep JSON] [--store ROOT]  curves, paired differences
    focus sql --compare NAME [NAME | --query SQL]                        DuckDB over every run of a grid
    focus serve [--store ROOT]                                           deployments for the Prefect UI
    focus deploy --pool NAME [--store ROOT]                              the same on a work pool's workers
    focus eval RUN_ID [--iteration N] [--tasks N] [--store ROOT]         held-out success of a checkpoint
    focus bench critic-budget [--quick] [--json PATH] [--plot PATH]   critic error vs branch budget
    focus bench critic-agent [--quick] [--json PATH] [--plot PATH]    the same on real agent states
    focus bench speed [--json PATH]                                  speed of the algorithm library
    focus bench branching [--json PATH]                              prefix reuse when branching (hf)
    focus bench envs [--json PATH]                                   the embedded agent environments
    focus bench sft [--seconds S] [--json PATH]                      the SFT warm start per environment

Each benchmark's own options follow its name (`focus bench critic-budget --help`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from flows.logs import quiet_terminal

# Quiet, offline defaults for every command (reference/tooling.md): no telemetry, no hub access.
QUIET_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # One log line per stage comes from FOCUS itself; Prefect's per-task state lines would double them.
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "MLFLOW_LOGGING_LEVEL": "WARNING",  # no INFO lines about creating and migrating mlruns.db
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # Runs started together share PREFECT_HOME's sqlite database through their own ephemeral APIs; its lock
    # contention prints server tracebacks that Prefect retries past (PrefectHQ/prefect#18934). A server fault
    # that matters still reaches the run as a client error.
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
    # The ephemeral Prefect API starts in 4-9 s on an idle machine; allow for a loaded one.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


# Each benchmark is a module under bench/ with a main(argv) -> int, imported only when it runs (torch is slow to load).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "critic-budget": ("bench.critic_budget", "critic and advantage error vs continuation budget, per strategy"),
    "critic-agent": ("bench.critic_agent", "the same on real agent states with dense Monte-Carlo values"),
    "speed": ("bench.speed", "speed of TD(λ), IVR acquisition and critic fitting"),
    "envs": ("bench.envs", "expert and random success, turns and tokens of the embedded environments"),
    "branching": ("bench.branching", "continuations from a long vs a short state with the hf backend"),
    "sft": ("bench.sft_warmstart", "the tiny model's SFT warm start per environment: steps, loss, held-out success"),
    "fanout": ("bench.fanout", "one rollout stage serially and sharded over Dask workers: wall, generation share"),
}


def _store_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None,
                        help="artifact root: a local folder or s3://bucket/prefix (default $FOCUS_STORE or ./runs)")


def _train(args: argparse.Namespace) -> int:
    from focus_core.config import load_config

    # Fail fast on bad input, before Prefect starts: the config and the store are checked here.
    load_config(args.config, args.set)
    store = _store(args.store)
    if args.run_id and store.run_info(args.run_id) is not None:
        print(f"focus train: run {args.run_id!r} already exists under {store.root}; continue it with "
              f"`focus resume {args.run_id}` or choose another --run-id", file=sys.stderr)
        return 2
    if args.init:
        from tasks.bootstrap import STAGE, source_of

        source_store, source_run = source_of(args.init, store)
        if source_store.manifest(source_run, 0, STAGE) is None:
            print(f"focus train: --init {args.init}: no committed bootstrap of run {source_run!r} under "
                  f"{source_store.root} (fix: `focus runs` lists the runs; the run must be past its bootstrap)",
                  file=sys.stderr)
            return 2
    from flows.train import train

    overrides = list(args.set) + ([f"bootstrap.init_from={args.init}"] if args.init else [])
    run_id = train(config_path=args.config, overrides=overrides, run_id=args.run_id, store=store.root)
    print(f"run {run_id} finished. Inspect it: focus sql {run_id} reward_trend; focus runs; mlflow ui "
          f"--backend-store-uri sqlite:///mlruns.db")
    return 0


def _resume(args: argparse.Namespace) -> int:
    store = _store(args.store)
    if store.run_info(args.run_id) is None:
        print(f"focus resume: no run {args.run_id!r} under {store.root} (see `focus runs --store {store.root}`)",
              file=sys.stderr)
        return 2
    from focus_core.lease import refuse_if_held

    refuse_if_held(store, args.run_id)  # one line naming the holder, before Prefect starts
    from flows.train import train

    train(run_id=args.run_id, store=store.root)
    return 0


def _store(root: str | None):
    """The artifact store of --store, $FOCUS_STORE or ./runs (without importing Prefect)."""
    from focus_core.artifacts import ArtifactStore

    return ArtifactStore(root or os.environ.get("FOCUS_STORE", "runs"))


def _runs(args: argparse.Namespace) -> int:
    from flows.runs import runs_report

    print(runs_report(_store(args.store)))
    return 0


def _sql(args: argparse.Namespace) -> int:
    import duckdb

    from flows.sql import connect, describe_queries, format_table, run_query

    if args.query is None and args.name is None and not (args.compare and args.run_id):
        print(describe_queries())
        print("tables: " + ", ".join(_tables()) + " (focus sql RUN_ID --query 'SELECT ...')")
        return 0
    store = _store(args.store)
    if args.compare:
        from flows.sql import connect_compare

        if args.run_id is not None:  # `focus sql --compare NAME QUERY`: the positional is the query's name
            args.name, args.run_id = args.run_id, None
        con = connect_compare(store, args.compare)
    elif args.run_id is None:
        print("focus sql: name a run (focus sql RUN_ID ...) or a comparison (--compare NAME)", file=sys.stderr)
        return 2
    elif store.run_info(args.run_id) is None and not store.committed(args.run_id):
        print(f"focus sql: no run {args.run_id!r} under {store.root} (see `focus runs`)", file=sys.stderr)
        return 2
    else:
        con = connect(store, args.run_id)
    try:
        columns, rows = run_query(con, args.query or args.name)
    except duckdb.Error as error:
        print(f"focus sql: {error}", file=sys.stderr)
        return 2
    print(format_table(columns, rows, max_rows=None if args.all else 50))
    return 0


def _tables() -> list[str]:
    from focus_core.schemas import TABLES

    return list(TABLES)


def _compare(args: argparse.Namespace) -> int:
    from flows.compare import RunsFailedError, run_compare

    try:
        name = run_compare(args.spec, store=_store(args.store).root, workers=args.workers, dask_address=args.dask,
                           envs=args.env)
    except RunsFailedError as error:
        print(f"focus compare: {error}", file=sys.stderr)
        return 1
    print(f"comparison {name} finished. Report it: focus report {name}; query it: focus sql --compare {name} "
          "--query 'SELECT ...'")
    return 0


def _report(args: argparse.Namespace) -> int:
    import json as json_module
    from pathlib import Path

    from flows.report import collect, merge, update_readme, write_report

    if args.from_json:
        data = json_module.loads(Path(args.from_json).read_text())
        data.pop("summary", None)
    else:
        data = collect(_store(args.store), args.name)
    if args.keep:
        data = merge(data, json_module.loads(Path(args.keep).read_text()))
    out = Path(args.out or f"docs/results/{data['name']}")
    summary = write_report(data, out)
    for row in summary["focus_vs_best"]:
        print(f"{row['env']}: FOCUS − {row['best_baseline']} = {row['focus_minus_best']:+.3f} "
              f"({row['low']:+.3f} to {row['high']:+.3f})")
    print(f"report: {out / (data['name'] + '.md')}")
    if args.readme:  # the headline table, made from the JSON the report just wrote (or was rendered from)
        source = args.from_json or str(out / f"{data['name']}.json")
        update_readme(Path(args.readme), data["name"], source, summary)
        print(f"{args.readme}: headline of {data['name']} updated")
    return 0


def _deploy(args: argparse.Namespace) -> int:
    from flows.serve import deploy

    for name in deploy(args.pool, store=args.store):
        print(f"deployment {name} on work pool {args.pool}")
    print(f"start a worker on each machine of the pool: prefect worker start --pool {args.pool}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from flows.serve import serve

    serve(store=args.store)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from flows.evaluate import evaluate_run

    result = evaluate_run(args.run_id, store=args.store, iteration=args.iteration, tasks=args.tasks)
    print(json.dumps(result, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="focus", description="FOCUS: selective branching RL for LLM agents")
    verbs = parser.add_subparsers(dest="verb", required=True)

    train = verbs.add_parser("train", help="train a policy (runs the Prefect flow; the default needs no flags)",
                             description="Train: bootstrap, then the iterations of the configured method.")
    train.add_argument("--config", help="YAML config (default: built-in defaults; see configs/)")
    train.add_argument("--set", action="append", default=[], metavar="A.B=C", help="override a config field")
    train.add_argument("--run-id", help="run id (default: METHOD-TIME-HASH)")
    train.add_argument("--init", metavar="RUN_ID", help="start from that run's committed bootstrap (same weights "
                       "and B_tok; a run id in --store, or a run URL): how methods are compared")
    _store_option(train)
    train.set_defaults(run=_train)

    resume = verbs.add_parser("resume", help="continue a run: committed stages are skipped, the rest recomputed")
    resume.add_argument("run_id")
    _store_option(resume)
    resume.set_defaults(run=_resume)

    runs = verbs.add_parser("runs", help="list runs: status, iterations, last commit, overhead share")
    _store_option(runs)
    runs.set_defaults(run=_runs)

    sql = verbs.add_parser("sql", help="query a run's tables with DuckDB (named queries or --query)")
    sql.add_argument("run_id", nargs="?", help="the run (omit with --compare)")
    sql.add_argument("name", nargs="?", help="a named query; omit to list them")
    sql.add_argument("--compare", metavar="NAME", help="every run of a comparison, plus a run_meta view (env, "
                     "method, seed, overrides, status)")
    sql.add_argument("--query", help="SQL over the views rollouts, episodes, states, ... of every iteration")
    sql.add_argument("--all", action="store_true", help="print every row (default: the first 50)")
    _store_option(sql)
    sql.set_defaults(run=_sql)

    compare = verbs.add_parser("compare", help="run a grid of (env, method, seed) training runs from one shared "
                               "start per env and seed (a Prefect flow on a Dask cluster)")
    compare.add_argument("spec", help="compare spec YAML (see configs/compare/)")
    compare.add_argument("--workers", type=int, default=2, help="local Dask worker processes (one run each)")
    compare.add_argument("--dask", metavar="ADDRESS", help="an existing Dask scheduler, e.g. tcp://host:8786")
    compare.add_argument("--env", action="append", metavar="NAME",
                         help="run only this environment's part of the grid (repeatable); the rest another time")
    _store_option(compare)
    compare.set_defaults(run=_compare)

    report = verbs.add_parser("report", help="learning curves, final success and paired differences of a comparison")
    report.add_argument("name", nargs="?", help="the comparison's name (its spec's `name`)")
    report.add_argument("--out", help="folder for the markdown, JSON and PNGs (default docs/results/NAME)")
    report.add_argument("--from-json", help="render from a report's JSON instead of the runs' artifacts")
    report.add_argument("--keep", metavar="JSON", help="an earlier report's JSON of this comparison: its finished runs "
                        "that the store lacks are kept (a grid run part by part, `focus compare --env`)")
    report.add_argument("--readme", help="also replace this markdown file's block of the comparison (between its "
                                         "'<!-- focus report NAME: ... -->' and '<!-- end focus report NAME -->' "
                                         "lines) with the headline tables")
    _store_option(report)
    report.set_defaults(run=_report)

    serve = verbs.add_parser("serve", help="serve the train/eval deployments to a Prefect server for the UI")
    _store_option(serve)
    serve.set_defaults(run=_serve)
    deploy = verbs.add_parser("deploy", help="deploy the train/eval/compare flows to a Prefect work pool")
    deploy.add_argument("--pool", required=True, help="the work pool (created as a process pool if missing)")
    _store_option(deploy)
    deploy.set_defaults(run=_deploy)

    evaluate = verbs.add_parser("eval", help="held-out success of a run's policy checkpoint")
    evaluate.add_argument("run_id")
    evaluate.add_argument("--iteration", type=int, help="the policy after this iteration's update (default: last)")
    evaluate.add_argument("--tasks", type=int, help="held-out tasks (default: the run's env.eval_tasks)")
    _store_option(evaluate)
    evaluate.set_defaults(run=_eval)

    bench = verbs.add_parser("bench", help="run a benchmark (prints JSON / a table, writes plots)",
                             description="Run a benchmark; options after the name go to the benchmark.")
    bench.add_argument("name", choices=sorted(BENCHMARKS),
                       help="; ".join(f"{name}: {text}" for name, (_, text) in sorted(BENCHMARKS.items())))
    bench.add_argument("options", nargs=argparse.REMAINDER, help="options for the benchmark (see NAME --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    quiet_terminal()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb == "bench":
        import importlib

        module, _ = BENCHMARKS[args.name]
        return importlib.import_module(module).main(args.options)
    from focus_core.artifacts import ArtifactError
    from focus_core.config import ConfigError

    try:
        return args.run(args)
    except (ConfigError, ArtifactError, FileNotFoundError, ValueError) as error:
        # Bad input: say what is wrong and how to fix it, without a traceback; nothing was committed wrongly.
        print(f"focus {args.verb}: {type(error).__name__}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
