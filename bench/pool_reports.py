"""Pool the runs of several comparisons into one report's JSON: more seeds of the same rows, run later as a
comparison of their own (a grid's store does not outlive its session, and a finished comparison is not extended).

Every input is a JSON that `focus report` wrote. The pooled JSON keeps the rows (env, method) that every input
has, or ``--methods``; a (env, method, seed) found in two inputs is refused, so no seed counts twice. The rows
must have been run with the same settings; this checks that their runs' overrides agree, less the seed.
`focus report --from-json` then makes the report, its paired differences over all the pooled seeds:

    python -m bench.pool_reports docs/results/horizon_chain/horizon_chain.json \\
        docs/results/horizon_chain_seeds/horizon_chain_seeds.json --name horizon_chain_pooled \\
        --out /tmp/horizon_chain_pooled.json
    focus report --from-json /tmp/horizon_chain_pooled.json --out docs/results/horizon_chain_pooled
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PER_RUN = ("runs", "iterations", "tasks", "spend")  # the JSON's lists of rows, each row naming env, method, seed


def pool(reports: Sequence[dict[str, Any]], name: str, methods: Sequence[str] | None = None) -> dict[str, Any]:
    """One report's data from ``reports``: the rows they all have (or ``methods``), every seed of each."""
    rows_of = [{(r["env"], r["method"]) for r in report["runs"]} for report in reports]
    kept = set.intersection(*rows_of) if methods is None else {row for row in set.union(*rows_of)
                                                              if row[1] in methods}
    if not kept:
        raise ValueError("the reports share no (env, method) row (fix: pool reports of the same rows, or --methods)")
    seen: dict[tuple[str, str, int], str] = {}
    settings: dict[tuple[str, str], list[str]] = {}
    for report in reports:
        for run in report["runs"]:
            key = (run["env"], run["method"], run["seed"])
            if key[:2] not in kept:
                continue
            if key in seen:
                raise ValueError(f"{key} is in two reports ({seen[key]} and {report['name']}): a seed would count "
                                 "twice (fix: pool reports of other seeds)")
            seen[key] = report["name"]
            overrides = [o for o in run["overrides"] if not o.startswith("seed=")]
            if settings.setdefault(key[:2], overrides) != overrides:
                raise ValueError(f"row {key[:2]} has other settings in {report['name']}: {overrides} against "
                                 f"{settings[key[:2]]} (fix: pool only runs of the same settings)")
    data: dict[str, Any] = {"name": name}
    for field in PER_RUN:
        if all(field in report for report in reports):
            data[field] = [r for report in reports for r in report[field] if (r["env"], r["method"]) in kept]
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="JSONs written by focus report")
    parser.add_argument("--name", required=True, help="the pooled report's name")
    parser.add_argument("--methods", nargs="+", help="the method rows to keep (default: those every report has)")
    parser.add_argument("--out", required=True, help="where to write the pooled JSON")
    args = parser.parse_args(argv)
    data = pool([json.loads(Path(p).read_text()) for p in args.reports], args.name, args.methods)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))
    seeds = sorted({r["seed"] for r in data["runs"]})
    print(f"{args.out}: {len(data['runs'])} runs, rows {sorted({r['method'] for r in data['runs']})}, seeds {seeds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
