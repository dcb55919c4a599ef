"""`focus report COMPARE_ID`: a comparison's figures, from the committed artifacts alone.

``collect`` reads, for every finished run of the compare record (unfinished ones are listed, not scored): per
evaluated iteration the held-out success (and the exact value where the environment has one), the generated
tokens by kind (``budget_ledger``), the critic's diagnostics (``fit_critic_r*``: error on branched states before
it saw them, Spearman of the acquisition score with it), and per held-out task the final iteration's value; per
run its wall time and CPU seconds. That JSON is everything the report shows: ``--from-json`` renders the same
report without the store, and ``--keep`` adds the finished runs of an earlier JSON to what the store holds (a grid
run part by part, ``focus compare --env``, in sessions whose stores are gone).

The report (markdown + PNGs): learning curves per environment (mean and 95% t-interval over seeds), success
against cumulative generated tokens, a table of final success and area under the curve (the mean over evaluated
iterations) per method, and FOCUS against the best baseline per environment: the paired difference of final
success with a bootstrap interval that resamples seeds and then held-out tasks, the same resample for both
methods (every method of a seed shares its bootstrap, held-out tasks and sampling seeds).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from focus_core.artifacts import COMPUTE_TIMING, ArtifactStore
from focus_core.methods import method_family

FOCUS = "focus"  # the method row the report compares with the baselines
BOOTSTRAP_RESAMPLES = 4000
TOKEN_KINDS = ("main", "branch", "summary")


def collect(store: ArtifactStore, name: str) -> dict[str, Any]:
    """The report's data: one row per run, per (run, evaluated iteration) and per (run, final held-out task)."""
    from flows.compare import compare_rows

    runs, iterations, task_values, spend = [], [], [], []
    for row in compare_rows(store, name):
        rid = row["run_id"]
        info = store.run_info(rid) or {}
        committed = store.committed(rid)
        key = {"env": row["env"], "method": row["method"], "seed": row["seed"]}
        runs.append({**key, "run_id": rid, "status": info.get("status", "missing"),
                     "base_method": (info.get("config") or {}).get("method"), "overrides": row["overrides"],
                     "wall_s": info.get("wall_s"), "cpu_s": info.get("cpu_s"),
                     "compute_s": sum(m.timings.get(COMPUTE_TIMING, 0.0) for _, _, m in committed)})
        if info.get("status") != "finished":  # a partial curve's last point is not a final success
            continue
        tokens: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(TOKEN_KINDS, 0))
        critic: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        evaluated = {}
        for iteration, stage, manifest in committed:
            if "budget_ledger" in manifest.tables:
                ledger = store.read_table(rid, iteration, stage, "budget_ledger")
                for kind, spent in zip(ledger.column("kind").to_pylist(), ledger.column("tokens").to_pylist(),
                                       strict=True):
                    tokens[iteration][kind] = tokens[iteration].get(kind, 0) + int(spent)
            if stage.startswith("fit_critic_"):
                for figure in ("critic_error_before", "score_error_spearman"):
                    if figure in manifest.figures:
                        critic[iteration][figure].append(float(manifest.figures[figure]))
            if stage == "advantage" and "estimated_value_error" in manifest.figures:  # exact_values runs
                critic[iteration]["estimated_value_error"].append(float(manifest.figures["estimated_value_error"]))
            if stage == "evaluate":
                evaluated[iteration] = manifest
        for iteration in sorted(tokens):  # every iteration's spend, evaluated or not (eval_every > 1)
            spend.append({**key, "iteration": iteration, **{f"tokens_{k}": tokens[iteration].get(k, 0)
                                                           for k in TOKEN_KINDS}})
        for iteration in sorted(evaluated):
            spent_so_far = sum(sum(t.values()) for j, t in tokens.items() if j < iteration)
            figures = evaluated[iteration].figures
            iterations.append({**key, "iteration": iteration, "heldout_success": figures.get("heldout_success"),
                               "heldout_success_exact": figures.get("heldout_success_exact"),
                               "cumulative_tokens": spent_so_far,  # generated before this policy was evaluated
                               **{f"tokens_{k}": tokens[iteration].get(k, 0) for k in TOKEN_KINDS},
                               **{f: float(np.mean(v)) for f, v in critic[iteration].items()}})
        if evaluated:
            last = max(evaluated)
            table = store.read_table(rid, last, "evaluate", "evaluation")
            for task_id, value in per_task(table).items():
                task_values.append({**key, "iteration": last, "task_id": task_id, "value": value})
    return {"name": name, "runs": runs, "iterations": iterations, "tasks": task_values, "spend": spend}


def merge(data: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """``data`` plus the finished runs of an ``earlier`` report of the same comparison that ``data`` lacks (a grid
    run part by part, each part in a session whose store did not outlive it). A run finished in both is ``data``'s."""
    if earlier.get("name") != data["name"]:
        raise ValueError(f"the earlier report is of comparison {earlier.get('name')!r}, not {data['name']!r} "
                         f"(fix: pass that comparison's own JSON)")
    finished = {r["run_id"] for r in data["runs"] if r["status"] == "finished"}
    taken = {r["run_id"] for r in earlier["runs"] if r["status"] == "finished" and r["run_id"] not in finished}
    keys = {(r["env"], r["method"], r["seed"]) for r in earlier["runs"] if r["run_id"] in taken}
    by_id = {r["run_id"]: r for r in earlier["runs"]}
    runs = [by_id[r["run_id"]] if r["run_id"] in taken else r for r in data["runs"]]
    of = lambda rows: [r for r in rows if (r["env"], r["method"], r["seed"]) in keys]  # noqa: E731
    return {**data, "runs": runs, "iterations": data["iterations"] + of(earlier["iterations"]),
            "tasks": data["tasks"] + of(earlier["tasks"]),
            **({"spend": data["spend"] + of(earlier["spend"])} if "spend" in data and "spend" in earlier else {})}


def per_task(evaluation) -> dict[str, float]:
    """A final evaluation's value per held-out task: the exact V^π(s_0) where known, else the mean success."""
    values: dict[str, list[float]] = defaultdict(list)
    for task_id, exact, success in zip(*(evaluation.column(c).to_pylist() for c in
                                         ("task_id", "exact_value", "success")), strict=True):
        values[task_id].append(float(exact) if exact is not None else float(success))
    return {t: float(np.mean(v)) for t, v in values.items()}


def t_half_width(values: np.ndarray, axis: int = 0) -> np.ndarray:
    """Half-width of the 95% t-interval of the mean along ``axis`` (NaN-aware; NaN with fewer than 2 values)."""
    from scipy import stats

    x = np.asarray(values, dtype=float)
    n = np.sum(np.isfinite(x), axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return stats.t.ppf(0.975, n - 1) * np.nanstd(x, axis=axis, ddof=1) / np.sqrt(n)


def _t_interval(values: Sequence[float]) -> tuple[float, float]:
    x = np.asarray(values, dtype=float)
    if len(x) < 2:
        return float("nan"), float("nan")
    half = float(t_half_width(x))
    return float(x.mean() - half), float(x.mean() + half)


def paired_bootstrap(a: dict[tuple[int, str], float], b: dict[tuple[int, str], float],
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean of a − b over the (seed, task) pairs both have, and a 95% percentile interval from resampling
    seeds, then tasks within each drawn seed (the same draw for a and b: the pairing is kept)."""
    pairs = sorted(set(a) & set(b))
    by_seed: dict[int, np.ndarray] = defaultdict(list)
    for s, t in pairs:
        by_seed[s].append(a[(s, t)] - b[(s, t)])
    seeds = sorted(by_seed)
    diffs = [np.array(by_seed[s]) for s in seeds]
    if not diffs:
        return float("nan"), float("nan"), float("nan")
    mean = float(np.mean([d.mean() for d in diffs]))
    rng = np.random.default_rng(seed)
    draws = np.empty(BOOTSTRAP_RESAMPLES)
    for k in range(BOOTSTRAP_RESAMPLES):
        chosen = rng.integers(0, len(diffs), len(diffs))
        draws[k] = np.mean([diffs[j][rng.integers(0, len(diffs[j]), len(diffs[j]))].mean() for j in chosen])
    low, high = np.percentile(draws, [2.5, 97.5])
    return mean, float(low), float(high)


def paired_seed_t(a: dict[tuple[int, str], float], b: dict[tuple[int, str], float]) -> tuple[float, float]:
    """95% t-interval of the mean of the per-seed differences (a − b averaged over the tasks both have in a seed).
    The seeds alone are the unit of replication: with 3 seeds the bootstrap has only 10 distinct draws of seeds and
    its interval is narrower than this one; a reader sees both."""
    by_seed: dict[int, list[float]] = defaultdict(list)
    for s, t in sorted(set(a) & set(b)):
        by_seed[s].append(a[(s, t)] - b[(s, t)])
    return _t_interval([float(np.mean(d)) for d in by_seed.values()])


def _difference(a: dict[tuple[int, str], float], b: dict[tuple[int, str], float]) -> dict[str, Any]:
    mean, low, high = paired_bootstrap(a, b)
    seed_low, seed_high = paired_seed_t(a, b)
    return {"low": low, "high": high, "significant": bool(low > 0 or high < 0), "seed_low": seed_low,
            "seed_high": seed_high, "significant_seeds": bool(seed_low > 0 or seed_high < 0), "mean": mean}


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    """Per (env, method) final success and AUC over seeds; per env FOCUS minus the best baseline, paired."""
    value_key = "heldout_success_exact" if all(r["heldout_success_exact"] is not None for r in data["iterations"]) \
        else "heldout_success"
    base_method = {(r["env"], r["method"]): r["base_method"] for r in data["runs"]}
    curves: dict[tuple[str, str], dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in data["iterations"]:
        curves[(r["env"], r["method"])][r["seed"]].append(r)
    table = []
    for (env, method), by_seed in sorted(curves.items()):
        final = [max(rows, key=lambda r: r["iteration"])[value_key] for rows in by_seed.values()]
        area = [float(np.mean([r[value_key] for r in rows])) for rows in by_seed.values()]
        low, high = _t_interval(final)
        # Every iteration's spend where the JSON has it ("spend"; older reports: the evaluated iterations').
        spend = [r for r in data.get("spend", data["iterations"]) if (r["env"], r["method"]) == (env, method)]
        spent = [total for r in spend if (total := sum(r[f"tokens_{k}"] for k in TOKEN_KINDS))]
        table.append({"env": env, "method": method, "base_method": base_method.get((env, method)),
                      "seeds": len(final), "final": float(np.mean(final)), "final_low": low, "final_high": high,
                      "auc": float(np.mean(area)), "tokens_per_iteration": float(np.mean(spent)) if spent else 0.0})
    tasks: dict[tuple[str, str], dict[tuple[int, str], float]] = defaultdict(dict)
    for r in data["tasks"]:
        tasks[(r["env"], r["method"])][(r["seed"], r["task_id"])] = r["value"]
    versus, ablations = [], []
    for env in sorted({row["env"] for row in table}):
        rows = {row["method"]: row for row in table if row["env"] == env}
        # A row of FOCUS's family (focus itself, its overrides, focus_nobranch) is an ablation, never a baseline.
        family = {m: method_family(row["base_method"]) if row["base_method"] else None for m, row in rows.items()}
        baselines = [m for m in rows if family[m] not in (None, FOCUS)]
        if FOCUS not in rows or not baselines:
            continue
        best = max(baselines, key=lambda m: rows[m]["final"])
        difference = _difference(tasks[(env, FOCUS)], tasks[(env, best)])
        versus.append({"env": env, "best_baseline": best, "focus_minus_best": difference.pop("mean"), **difference})
        for ablation in sorted(m for m in rows if family[m] == FOCUS and m != FOCUS):
            for other in (FOCUS, best):  # what the ablated part is worth, and where the row stands
                difference = _difference(tasks[(env, ablation)], tasks[(env, other)])
                ablations.append({"env": env, "method": ablation, "versus": other,
                                  "difference": difference.pop("mean"), **difference})
    return {"value": value_key, "table": table, "focus_vs_best": versus, "ablations": ablations}


def headline(summary: dict[str, Any]) -> list[str]:
    """The two tables a reader wants first (the report opens with them; the copies on README.md and docs/ pages are
    made from them)."""
    lines = ["| env | method | seeds | final (95% CI) | AUC | generated tokens / iteration |",
             "|---|---|---|---|---|---|"]
    for r in summary["table"]:
        lines.append(f"| {r['env']} | {r['method']} | {r['seeds']} | {r['final']:.3f} ({r['final_low']:.3f}–"
                     f"{r['final_high']:.3f}) | {r['auc']:.3f} | {r['tokens_per_iteration']:,.0f} |")
    lines += ["", "| env | FOCUS − best baseline (paired, 95% CI) | t over seeds (95% CI) | best baseline |",
              "|---|---|---|---|"]
    for v in summary["focus_vs_best"]:
        lines.append(f"| {v['env']} | {v['focus_minus_best']:+.3f} {_intervals(v)} | {v['best_baseline']} |")
    return lines + ["", SIGNIFICANCE]


# The paired bootstrap resamples seeds, then tasks; the t-interval takes each seed's mean difference as one value.
SIGNIFICANCE = "\\* the bootstrap interval excludes 0; † the t-interval over seeds excludes 0."


def _intervals(v: dict[str, Any]) -> str:
    """The bootstrap interval, then the t-interval over seeds, as two table cells (older JSONs lack the second)."""
    star = " *" if v["significant"] else ""
    seeds = f"{v['seed_low']:+.3f} to {v['seed_high']:+.3f}{' †' if v['significant_seeds'] else ''}" \
        if "seed_low" in v and np.isfinite(v["seed_low"]) else "–"
    return f"({v['low']:+.3f} to {v['high']:+.3f}){star} | {seeds}"


def readme_block(name: str, source: str, summary: dict[str, Any], page: str = "README.md") -> str:
    """A page's copy of a comparison's headline, between markers whose first names the command that remakes it: the
    JSON it is made from and the page (README.md or a docs/ page, as the command is typed) it is on."""
    return "\n".join([f"<!-- focus report {name}: made by `focus report --from-json {source} --readme {page}` -->",
                       *headline(summary), f"<!-- end focus report {name} -->"])


def update_readme(readme: Path, name: str, source: str, summary: dict[str, Any]) -> None:
    """Replace the block of comparison ``name`` in the page ``readme`` (it must already have the two markers)."""
    text = readme.read_text()
    begin, end = f"<!-- focus report {name}:", f"<!-- end focus report {name} -->"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise ValueError(f"{readme} has no block for comparison {name!r} (fix: put the lines {begin} ... --> and "
                         f"{end} where its table goes)")
    readme.write_text(text[:start] + readme_block(name, source, summary, readme.as_posix()) + text[stop + len(end):])


def markdown(data: dict[str, Any], summary: dict[str, Any], images: Sequence[str]) -> str:
    value = "exact held-out success" if summary["value"] == "heldout_success_exact" else "held-out success"
    lines = [f"# Comparison `{data['name']}`", "",
             f"{len(data['runs'])} runs; the figure is the {value} of the policy after the last iteration (final) and "
             "its mean over the evaluated iterations (AUC). 95% intervals: t over seeds; the FOCUS difference is a "
             "paired bootstrap over seeds and held-out tasks, and a t-interval over the seeds' mean differences.", "",
             *headline(summary)]
    lines += ["", "| run | status | wall s | CPU s | stage compute s |", "|---|---|---|---|---|"]
    for r in data["runs"]:
        lines.append(f"| {r['run_id']} | {r['status']} | {_num(r['wall_s'])} | {_num(r['cpu_s'])} "
                     f"| {_num(r['compute_s'])} |")
    if data.get("spend"):
        by: dict[tuple[str, str, int], list[dict]] = defaultdict(list)
        for r in data["spend"]:
            by[(r["env"], r["method"], r["iteration"])].append(r)
        lines += ["", "Generated tokens per iteration by kind (mean over seeds; from the runs' `budget_ledger`): the "
                  "matched budget.", "", "| env | method | iteration | main | branch | summary | total |",
                  "|---|---|---|---|---|---|---|"]
        for (env, method, iteration), rows in sorted(by.items()):
            kinds = [float(np.mean([r[f"tokens_{k}"] for r in rows])) for k in TOKEN_KINDS]
            lines.append(f"| {env} | {method} | {iteration} | " + " | ".join(f"{v:,.0f}" for v in kinds)
                         + f" | {sum(kinds):,.0f} |")
    if summary.get("ablations"):
        lines += ["", "FOCUS's ablation rows against FOCUS and against the best baseline (final success, paired "
                  "bootstrap over seeds and held-out tasks, and t over the seeds' mean differences, 95% CI).", "",
                  "| env | row | − | difference (95% CI) | t over seeds (95% CI) |", "|---|---|---|---|---|"]
        for a in summary["ablations"]:
            lines.append(f"| {a['env']} | {a['method']} | {a['versus']} | {a['difference']:+.3f} {_intervals(a)} |")
        lines += ["", SIGNIFICANCE]
    # A critic that never branches (focus_nobranch) has no error before continuations, only the one against V^π.
    diagnostics = [r for r in data["iterations"] if "critic_error_before" in r or "estimated_value_error" in r]
    if diagnostics:
        exact = any("estimated_value_error" in r for r in diagnostics)
        lines += ["", "Critic diagnostics (mean over seeds and iterations): error on branched states before the "
                  "critic saw them; Spearman of the acquisition score with it"
                  + ("; for `exact_values` runs, the mean |V̂ − V^π| over the advantage batch." if exact else "."), "",
                  "| env | method | critic error before | score–error Spearman |" + (" V̂ error vs exact |" if exact
                                                                                     else ""),
                  "|---|---|---|---|" + ("---|" if exact else "")]
        groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for r in diagnostics:
            groups[(r["env"], r["method"])].append(r)
        for (env, method), rows in sorted(groups.items()):
            rho = [r["score_error_spearman"] for r in rows if "score_error_spearman" in r]
            before = [r["critic_error_before"] for r in rows if "critic_error_before" in r]
            versus_exact = [r["estimated_value_error"] for r in rows if "estimated_value_error" in r]
            lines.append(f"| {env} | {method} | {f'{np.mean(before):.3f}' if before else '–'} | "
                         f"{f'{np.mean(rho):.3f}' if rho else '–'} |"
                         + (f" {np.mean(versus_exact):.3f} |" if versus_exact else " – |" if exact else ""))
    lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in images]
    return "\n".join(lines) + "\n"


def _num(x) -> str:
    return "–" if x is None else f"{x:,.0f}"


def plots(data: dict[str, Any], summary: dict[str, Any], folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = summary["value"]
    envs = sorted({r["env"] for r in data["iterations"]})
    methods = sorted({r["method"] for r in data["iterations"]})
    written = []
    for name, x_key, xlabel in (("curves", "iteration", "iteration (policy entering it)"),
                                ("tokens", "cumulative_tokens", "generated tokens before the evaluation")):
        fig, axes = plt.subplots(1, len(envs), figsize=(5.5 * len(envs), 4), squeeze=False)
        for ax, env in zip(axes[0], envs, strict=True):
            for method in methods:
                rows = [r for r in data["iterations"] if r["env"] == env and r["method"] == method]
                seeds = sorted({r["seed"] for r in rows})
                its = sorted({r["iteration"] for r in rows})
                grid = np.array([[next((r[key] for r in rows if r["seed"] == s and r["iteration"] == i), np.nan)
                                  for i in its] for s in seeds], dtype=float)
                xs = np.array([[next((r[x_key] for r in rows if r["seed"] == s and r["iteration"] == i), np.nan)
                                for i in its] for s in seeds], dtype=float)
                # A run still in flight has iterations not evaluated yet: those points wait, they are not empty means.
                evaluated = np.isfinite(grid).any(0) & np.isfinite(xs).any(0)
                grid, xs = grid[:, evaluated], xs[:, evaluated]
                mean = np.nanmean(grid, 0)
                ax.plot(np.nanmean(xs, 0), mean, marker="o", label=f"{method} ({len(seeds)})",
                        linewidth=2.5 if method == FOCUS else 1.2)
                if len(seeds) > 1:
                    half = t_half_width(grid)
                    ax.fill_between(np.nanmean(xs, 0), mean - half, mean + half, alpha=0.15)
            ax.set_title(f"{env}: {key.replace('_', ' ')}")
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = folder / f"{data['name']}_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


def write_report(data: dict[str, Any], out: Path) -> dict[str, Any]:
    """report.json (the data and summary), the PNGs and report.md under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(data)
    images = plots(data, summary, out)
    (out / f"{data['name']}.json").write_text(json.dumps({**data, "summary": summary}, indent=1))
    (out / f"{data['name']}.md").write_text(markdown(data, summary, images))
    return summary
