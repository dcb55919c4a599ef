"""Does a more diverse ensemble's spread find the critic's errors? (issue 12, "a diverse, calibrated ensemble")

Reads critic-budget JSONs of the same grid and seeds made with different critics (``--critic-members``,
``--critic-prior-scale``) and prints, per critic, averaged over environments and the operating budgets ×0.5–2:
``uniform_random``'s critic MSE ÷ that of the first JSON's critic (does the critic itself get better?), each
strategy's MSE ÷ ``uniform_random``'s with the same critic (does spending by its score beat spending at random?),
and each strategy's Spearman between its score and the critic's actual |error| (does the score rank the error?).

    python -m bench.critic_diversity docs/results/critic_diversity/members5.json \\
        docs/results/critic_diversity/members16.json docs/results/critic_diversity/members16_prior1.json \\
        docs/results/critic_diversity/members16_prior3.json --markdown docs/results/critic_diversity/summary.md
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

OPERATING_BUDGETS = (0.5, 1.0, 2.0)


def mean_mse(rows: list[dict], strategy: str, env: str, ratio: float) -> float:
    return float(np.mean([r["critic_mse"] for r in rows if (r["strategy"], r["env"], r["budget_ratio"]) ==
                          (strategy, env, ratio)]))


def summary(reports: Sequence[dict]) -> list[dict]:
    """One row per critic (report), in the order given; the first report's critic is the reference."""
    reference = reports[0]["rows"]
    cells = sorted({(r["env"], r["budget_ratio"]) for r in reference if r["budget_ratio"] in OPERATING_BUDGETS})
    strategies = sorted({r["strategy"] for r in reference} - {"none", "uniform_random"})
    out = []
    for report in reports:
        rows = report["rows"]
        if sorted({r["seed"] for r in rows}) != sorted({r["seed"] for r in reference}):
            raise ValueError("the JSONs must share their seeds (critic-budget --first-seed/--seeds): the comparison "
                             "is paired by seed")
        row = {"critic": f"{report['critic_members']} members, prior scale {report['critic_prior_scale']:g}",
               "uniform_vs_reference": float(np.mean([mean_mse(rows, "uniform_random", e, b)
                                                      / mean_mse(reference, "uniform_random", e, b)
                                                      for e, b in cells]))}
        for strategy in strategies:
            row[f"{strategy}_vs_uniform"] = float(np.mean([mean_mse(rows, strategy, e, b)
                                                           / mean_mse(rows, "uniform_random", e, b) for e, b in cells]))
            rhos = [r["spearman"] for r in rows if r["strategy"] == strategy and r["budget_ratio"] in OPERATING_BUDGETS
                    and r["spearman"] is not None]
            row[f"{strategy}_spearman"] = float(np.mean(rhos)) if rhos else float("nan")
        out.append(row)
    return out


def markdown(rows: list[dict]) -> str:
    strategies = [k[: -len("_vs_uniform")] for k in rows[0] if k.endswith("_vs_uniform")]
    head = ["critic", "uniform_random MSE ÷ first critic's", *(f"{s}: MSE ÷ uniform; ρ" for s in strategies)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["critic"], f"{row['uniform_vs_reference']:.2f}",
                 *(f"{row[f'{s}_vs_uniform']:.2f}; {row[f'{s}_spearman']:+.2f}" for s in strategies)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="critic-budget JSONs; the first is the reference critic")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    table = markdown(summary([json.loads(path.read_text()) for path in args.reports]))
    print(table, end="")
    if args.markdown:
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
