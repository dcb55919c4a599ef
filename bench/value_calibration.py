"""Would a calibrated critic prior have given better values? Read off the `exact_values` runs of a comparison.

In an `exact_values` run the advantage stage used the exact V^π, and the last critic round's `values` table still
holds what FOCUS would have used: the out-of-fold critic's mean and variance, the state's own Monte-Carlo returns
and their precision-weighted combination. This recombines them with the variance `critic.prior_variance:
calibrated` would have used (``calibrated_variance``, per iteration as the fit_critic stage does it) and prints,
per environment, the mean |value − V^π| with the ensemble's variance and with the calibrated one: at the states
that have returns (where the two differ), at those worth nothing among them (a doomed lock, a poisoned chain),
and at every state; plus the calibration scales.

    python -m bench.value_calibration headroom --store /work/headroom/runs \\
        --json docs/results/headroom/value_calibration.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from flows.compare import compare_rows
from flows.sql import EXACT_VALUE_ROWS, connect
from focus_core.acquisition import calibrated_variance, combine_estimates
from focus_core.artifacts import ArtifactStore

LAST_ROUND_VALUES = f"""
    SELECT run_id, iteration, critic_mean, critic_var, coalesce(mc_mean, 'nan'::DOUBLE), n, value, exact
    FROM ({EXACT_VALUE_ROWS})
"""


def env_figures(store: ArtifactStore, run_ids: Sequence[str]) -> dict:
    rows = connect(store, list(run_ids)).execute(LAST_ROUND_VALUES).fetchall()
    keys = [(run, iteration) for run, iteration, *_ in rows]
    mean, var, mc, n, used, exact = (np.array([r[k] for r in rows], dtype=np.float64) for k in range(2, 8))
    calibrated, scales = np.empty(len(rows)), []
    for key in sorted(set(keys)):  # one calibration per fit, as the stage makes it
        at = np.array([k == key for k in keys])
        scaled, scale = calibrated_variance(mean[at], var[at], mc[at], n[at])
        calibrated[at] = combine_estimates(mean[at], scaled, mc[at], n[at])[0]
        scales.append(scale)
    has = n > 0
    kinds = {"with_returns": has, "worth_nothing_with_returns": has & (exact == 0.0), "all": np.ones(len(rows), bool)}
    return {**{kind: {"states": int(sel.sum()), "ensemble_mae": float(np.abs(used[sel] - exact[sel]).mean()),
                      "calibrated_mae": float(np.abs(calibrated[sel] - exact[sel]).mean())}
               for kind, sel in kinds.items()},
            "scale_median": float(np.median(scales)), "scale_min": float(min(scales)),
            "scale_max": float(max(scales)), "fits": len(scales)}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("compare", help="the comparison's name (its exact_values rows are read)")
    parser.add_argument("--store", default="runs")
    parser.add_argument("--method", default="focus_exact_values", help="the exact_values row")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    store = ArtifactStore(args.store)
    rows = [r for r in compare_rows(store, args.compare) if r["method"] == args.method]
    if not rows:
        parser.error(f"comparison {args.compare} has no {args.method} row (fix: --method, the exact_values row)")
    out = {env: env_figures(store, [r["run_id"] for r in rows if r["env"] == env])
           for env in sorted({r["env"] for r in rows})}
    text = json.dumps({"compare": args.compare, "method": args.method, "envs": out}, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return out


if __name__ == "__main__":
    main()
