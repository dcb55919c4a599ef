"""FOCUS against GRPO and VinePPO on the trap environments, where held-out success is exact.

For each (environment, seed) one FOCUS run trains the bootstrap; every other method starts from it
(`focus train --init`), so all methods of a seed share the warm start, the measured budget B_tok and the
held-out tasks and sampling seeds. Each run is a plain `focus train` subprocess on the environment's
config (`configs/{env}.yaml`); a rerun skips finished runs and resumes unfinished ones.

The figure that decides is `heldout_success_exact` of the evaluate stage: V^π(s_0) averaged over the
held-out tasks by the trap's own dynamic programme, so the learning curve carries no sampling noise
(only the training runs' own randomness, which the seeds measure). Differences are paired by seed.

    python -m bench.trap_methods --store /tmp/traps/runs --json docs/results/trap_methods.json \
        --plot docs/results/trap_methods.png
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench import emit_json
from focus_core.artifacts import ArtifactStore

ENVS = ("combination_lock", "lookup_chain")
METHODS = ("focus", "grpo", "vineppo")
# What a method needs on top of the environment's config (the config is written for focus). The focus_* rows are
# ablations: FOCUS with one component swapped, from the same bootstrap (--methods focus focus_uniform_random ...).
METHOD_OVERRIDES = {
    "focus": (),
    "grpo": ("method=grpo", "acquisition=null", "critic=null"),
    "vineppo": ("method=vineppo",),
    "focus_uniform_random": ("acquisition.strategy=uniform_random",),  # no selective branching
    "focus_ivr_greedy": ("acquisition.strategy=ivr_greedy",),  # the default before novelty
    "focus_residual_knn": ("acquisition.strategy=residual_knn",),
    "focus_no_continuations": ("ppo.train_on_continuations=false",),  # continuations for values only
}
REPO = Path(__file__).resolve().parents[1]


def run_id(env: str, method: str, seed: int) -> str:
    return f"{env}-{method}-s{seed}"


def _focus(args: Sequence[str], log: Path) -> None:
    # Each run gets its own Prefect home and MLflow store: two processes creating one sqlite store at the same
    # moment collide ("table ... already exists").
    home = log.with_suffix("")
    home.mkdir(parents=True, exist_ok=True)
    environ = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_HOME=str(home / ".prefect"),
                   MLFLOW_TRACKING_URI=f"sqlite:///{home / 'mlruns.db'}")
    with log.open("a") as out:
        done = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=home, env=environ,
                              stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        raise RuntimeError(f"focus {' '.join(args)} exited {done.returncode}; see {log}")


def ensure_run(store: ArtifactStore, root: Path, env: str, method: str, seed: int, extra: Sequence[str]) -> str:
    """Train (or resume, or skip) one run; the non-FOCUS methods start from the seed's FOCUS bootstrap."""
    rid = run_id(env, method, seed)
    info = store.run_info(rid)
    log = root / "logs" / f"{rid}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    if info and info.get("status") == "finished":
        return rid
    if info:
        _focus(["resume", rid, "--store", str(store.root)], log)
        return rid
    sets = [f"seed={seed}", *METHOD_OVERRIDES[method], *extra]
    init = [] if method == "focus" else ["--init", run_id(env, "focus", seed)]
    _focus(["train", "--config", str(REPO / "configs" / f"{env}.yaml"), *init, "--store", str(store.root),
            "--run-id", rid, *[arg for s in sets for arg in ("--set", s)]], log)
    return rid


def curve(store: ArtifactStore, rid: str) -> list[dict]:
    """Per evaluated iteration: exact and sampled held-out success, and the iteration's generated tokens."""
    spent: dict[int, int] = {}
    for iteration, stage, manifest in store.committed(rid):
        if "budget_ledger" in manifest.tables:
            table = store.read_table(rid, iteration, stage, "budget_ledger")
            spent[iteration] = spent.get(iteration, 0) + int(sum(table.column("tokens").to_pylist()))
    rows = []
    for iteration, stage, manifest in store.committed(rid):
        if stage == "evaluate":
            rows.append({"iteration": iteration, "exact": manifest.figures.get("heldout_success_exact"),
                         "sampled": manifest.figures["heldout_success"],
                         "generated_tokens": spent.get(iteration, 0)})
    return sorted(rows, key=lambda r: r["iteration"])


def summarise(rows: list[dict], methods: Sequence[str]) -> list[dict]:
    """Per environment and method: final exact success (mean, se over seeds) and, against FOCUS, the paired
    difference of final success and of the area under the exact curve."""
    out = []
    for env in sorted({r["env"] for r in rows}):
        final, area = {}, {}
        for method in methods:
            runs = {r["seed"]: r["curve"] for r in rows if r["env"] == env and r["method"] == method}
            final[method] = {s: c[-1]["exact"] for s, c in runs.items() if c}
            area[method] = {s: float(np.mean([p["exact"] for p in c])) for s, c in runs.items() if c}
        for method in methods:
            values = np.array(list(final[method].values()), dtype=float)
            row = {"env": env, "method": method, "seeds": len(values),
                   "final_exact": float(values.mean()) if len(values) else None,
                   "final_exact_se": float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else None,
                   "mean_exact_over_iterations": float(np.mean(list(area[method].values()))) if area[method]
                   else None}
            if method != "focus":
                paired = sorted(set(final[method]) & set(final["focus"]))
                diff = np.array([final["focus"][s] - final[method][s] for s in paired])
                row["focus_minus_this"] = float(diff.mean()) if len(diff) else None
                row["focus_minus_this_se"] = float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else None
            out.append(row)
    return out


def markdown(summary: list[dict]) -> str:
    """The summary as a markdown table (docs/results/trap_methods.md): final exact success per method, and FOCUS minus
    each baseline."""
    def pm(mean: float | None, se: float | None, signed: bool = False) -> str:
        if mean is None:
            return "–"
        text = f"{mean:+.3f}" if signed else f"{mean:.3f}"
        return text + (f" ± {se:.3f}" if se is not None else "")

    lines = ["| env | method | seeds | final exact success ± se | mean over iterations "
             "| FOCUS − method (paired) ± se |", "|---|---|---|---|---|---|"]
    for row in summary:
        lines.append(f"| {row['env']} | {row['method']} | {row['seeds']} "
                     f"| {pm(row['final_exact'], row['final_exact_se'])} "
                     f"| {pm(row['mean_exact_over_iterations'], None)} "
                     f"| {pm(row.get('focus_minus_this'), row.get('focus_minus_this_se'), signed=True)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], methods: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = sorted({r["env"] for r in rows})
    fig, axes = plt.subplots(1, len(envs), figsize=(5.5 * len(envs), 4), squeeze=False)
    for ax, env in zip(axes[0], envs, strict=True):
        for method in methods:
            curves = [r["curve"] for r in rows if r["env"] == env and r["method"] == method and r["curve"]]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            values = np.array([[p["exact"] for p in c[:n]] for c in curves], dtype=float)
            mean = values.mean(axis=0)
            se = values.std(axis=0, ddof=1) / np.sqrt(len(values)) if len(values) > 1 else np.zeros(n)
            x = [p["iteration"] for p in curves[0][:n]]
            ax.plot(x, mean, marker="o", label=f"{method} ({len(values)} seeds)",
                    linewidth=2.5 if method == "focus" else 1.2)
            ax.fill_between(x, mean - 1.96 * se, mean + 1.96 * se, alpha=0.15)
        ax.set_title(f"{env}: exact held-out success")
        ax.set_xlabel("iteration (policy entering it)")
        ax.set_ylabel("V^π(s_0), mean over held-out tasks")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.trap_methods", description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", type=Path, required=True, help="artifact store root for the runs")
    parser.add_argument("--envs", nargs="+", default=list(ENVS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=sorted(METHOD_OVERRIDES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--workers", type=int, default=2, help="runs at once (one core each)")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="override for every run")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--markdown", type=Path, help="write the summary table here")
    args = parser.parse_args(argv)
    if "focus" not in args.methods:
        parser.error("--methods must include focus: its run trains the bootstrap the others start from")
    store, root = ArtifactStore(args.store), args.store.resolve().parent
    root.mkdir(parents=True, exist_ok=True)

    def seed_job(env: str, seed: int) -> None:
        ensure_run(store, root, env, "focus", seed, args.sets)
        for method in args.methods:
            if method != "focus":
                ensure_run(store, root, env, method, seed, args.sets)
                print(f"done {run_id(env, method, seed)}", flush=True)

    with ThreadPoolExecutor(args.workers) as pool:
        for future in [pool.submit(seed_job, env, seed) for env in args.envs for seed in args.seeds]:
            future.result()
    rows = [{"env": env, "method": method, "seed": seed, "run_id": run_id(env, method, seed),
             "curve": curve(store, run_id(env, method, seed))}
            for env in args.envs for method in args.methods for seed in args.seeds]
    result = {"command": "python -m bench.trap_methods " + " ".join(argv if argv is not None else sys.argv[1:]),
              "summary": summarise(rows, args.methods), "runs": rows}
    if args.plot:
        plot(rows, args.methods, args.plot)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(result["summary"]))
    emit_json(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
