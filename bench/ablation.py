"""The acquisition ablation of docs/benchmarks.md: every strategy × both critic benchmarks × budget, from their JSON.

Each cell is the mean over the benchmark's environments of the per-environment figures that
``bench.critic_budget.summarise`` computed: critic MSE ÷ uniform_random's, the share of the oracle's gain over
uniform_random captured, and the Spearman correlation of the strategy's scores with the critic's actual error.
Per-environment cells with critic MSE ± se are in the benchmarks' own tables (``--markdown``). Below the table,
each strategy's critic MSE against ``--baseline``'s, paired by seed (``paired_difference``).

    python -m bench.ablation docs/critic_budget.json docs/results/critic_agent.json \
        --markdown docs/results/acquisition_ablation.md
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def cells(results: list[dict], budgets: Sequence[float]) -> dict[tuple[str, float], dict[str, float | None]]:
    """(strategy, budget) -> mean over environments of critic_mse_ratio, oracle_gap_captured and spearman."""
    out = {}
    for strategy in sorted({r["strategy"] for r in results} - {"none"}):
        for budget in budgets:
            rows = [r for r in results if r["strategy"] == strategy and r["budget_ratio"] == budget]
            if not rows:
                continue

            def mean(key: str, rows=rows) -> float | None:
                values = [r[key] for r in rows if r[key] is not None]
                return float(np.mean(values)) if values else None

            out[(strategy, budget)] = {"ratio": mean("critic_mse_ratio"), "gap": mean("oracle_gap_captured"),
                                       "spearman": mean("spearman"), "worst": max(
                                           (r["critic_mse_ratio"] for r in rows if r["critic_mse_ratio"] is not None),
                                           default=None)}
    return out


def paired_difference(rows: list[dict], strategy: str, baseline: str,
                      budgets: Sequence[float]) -> tuple[float, float, int]:
    """Mean over (env, budget, seed) of (MSE_strategy − MSE_baseline) / MSE_uniform_random, its standard error and
    the number of seed-cells: the strategies' difference paired on the same main trajectories (or states)."""
    by: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["budget_ratio"] in budgets:
            by.setdefault((r["env"], r["budget_ratio"], r["seed"]), {})[r["strategy"]] = r["critic_mse"]
    d = np.array([(v[strategy] - v[baseline]) / v["uniform_random"] for v in by.values()
                  if {strategy, baseline, "uniform_random"} <= set(v)])
    if len(d) < 2:
        return float("nan"), float("nan"), len(d)
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))), len(d)


def markdown(benchmarks: dict[str, list[dict]], budgets: Sequence[float], default: str) -> str:
    names = list(benchmarks)
    table = {name: cells(results, budgets) for name, results in benchmarks.items()}
    strategies = sorted({s for t in table.values() for s, _ in t})
    header = " | ".join(f"{name} ×{b:g}" for name in names for b in budgets)
    lines = [f"| strategy | {header} |", "|---" * (1 + len(names) * len(budgets)) + "|"]
    for strategy in strategies:
        parts = []
        for name in names:
            for b in budgets:
                c = table[name].get((strategy, b))
                if c is None:
                    parts.append("")
                    continue
                gap = f"{c['gap']:+.2f}" if c["gap"] is not None else "–"
                rho = f"{c['spearman']:.2f}" if c["spearman"] is not None else "–"
                parts.append(f"{c['ratio']:.2f} ({c['worst']:.2f}); {gap}; {rho}")
        label = f"**{strategy}**" if strategy == default else strategy
        lines.append(f"| {label} | " + " | ".join(parts) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ablation", description=__doc__.split("\n\n")[0])
    parser.add_argument("critic_budget", type=Path, help="JSON of focus bench critic-budget")
    parser.add_argument("critic_agent", type=Path, help="JSON of focus bench critic-agent")
    parser.add_argument("--budgets", nargs="+", type=float, default=[0.5, 1.0, 2.0])
    parser.add_argument("--baseline", default="ivr_greedy", help="the strategy the paired differences are against")
    parser.add_argument("--markdown", type=Path, help="write the table here (default: print it)")
    args = parser.parse_args(argv)
    from focus_core.config import AcquisitionConfig

    written = {"traps": json.loads(args.critic_budget.read_text()), "agent": json.loads(args.critic_agent.read_text())}
    default = AcquisitionConfig().strategy
    text = markdown({name: w["results"] for name, w in written.items()}, args.budgets, default)
    text += "\nPaired against " + args.baseline + ", (MSE − MSE_" + args.baseline + ") ÷ MSE_uniform_random over " \
        "seed-cells at these budgets (negative: better):\n\n| strategy | traps | agent |\n|---|---|---|\n"
    strategies = sorted({r["strategy"] for w in written.values() for r in w["rows"]} - {"none", args.baseline})
    for strategy in strategies:
        parts = []
        for w in written.values():
            mean, se, n = paired_difference(w["rows"], strategy, args.baseline, args.budgets)
            parts.append(f"{mean:+.3f} ± {se:.3f} (n = {n})" if n > 1 else "–")
        text += f"| {strategy} | " + " | ".join(parts) + " |\n"
    if args.markdown:
        args.markdown.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
