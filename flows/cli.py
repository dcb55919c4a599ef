"""The `focus` command line.

    focus bench critic-budget [--quick] [--json PATH] [--plot PATH]   critic error vs branch budget
    focus bench speed [--json PATH]                                  speed of the algorithm library
    focus bench branching [--json PATH]                              prefix reuse when branching (hf)
    focus bench envs [--json PATH]                                   the embedded agent environments

Each benchmark's own options follow its name (`focus bench critic-budget --help`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

# Quiet, offline defaults for every command (reference/tooling.md): no telemetry, no hub access.
QUIET_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def _bench_critic_budget(argv: Sequence[str]) -> int:
    from bench.critic_budget import main

    return main(argv)


def _bench_speed(argv: Sequence[str]) -> int:
    from bench.speed import main

    return main(argv)


def _bench_envs(argv: Sequence[str]) -> int:
    from bench.envs import main

    return main(argv)


def _bench_branching(argv: Sequence[str]) -> int:
    from bench.branching import main

    return main(argv)


BENCHMARKS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "critic-budget": (_bench_critic_budget, "critic and advantage error vs continuation budget, per strategy"),
    "speed": (_bench_speed, "speed of TD(λ), IVR acquisition and critic fitting"),
    "envs": (_bench_envs, "expert and random success, turns and tokens of the embedded environments"),
    "branching": (_bench_branching, "continuations from a long vs a short state with the hf backend"),
}


def main(argv: Sequence[str] | None = None) -> int:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    parser = argparse.ArgumentParser(prog="focus", description="FOCUS: selective branching RL for LLM agents")
    verbs = parser.add_subparsers(dest="verb", required=True)
    bench = verbs.add_parser("bench", help="run a benchmark (prints JSON / a table, writes plots)",
                             description="Run a benchmark; options after the name go to the benchmark.")
    bench.add_argument("name", choices=sorted(BENCHMARKS),
                       help="; ".join(f"{name}: {text}" for name, (_, text) in sorted(BENCHMARKS.items())))
    bench.add_argument("options", nargs=argparse.REMAINDER, help="options for the benchmark (see NAME --help)")
    args = parser.parse_args(argv)
    if args.verb == "bench":
        run, _ = BENCHMARKS[args.name]
        return run(args.options)
    parser.error(f"unknown verb {args.verb}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
