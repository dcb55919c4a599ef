"""One rollout stage played serially and sharded over Dask workers (``generation.shards``), as JSON.

The stage is the pipeline's own (``tasks/rollout.py: compute``) after one bootstrap: P × G_main main episodes
of the tiny policy. Per setting: the stage's wall seconds, its generation seconds (the longest shard's when
sharded), the share of the wall time spent outside generation (dispatch, the workers' policy load, moving the
episodes back), and whether the sharded stage wrote the serial stage's episodes (it must: each episode samples
from its own seed). The first sharded stage of a process also starts the workers, so it is reported apart
from a warm one.

    focus bench fanout --json bench/out/fanout.json            # serial vs 2 Dask workers (first and warm)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from bench import emit_json


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="deep_search")
    parser.add_argument("--prompts", type=int, default=16, help="P: tasks of the rollout (× G_main = 4 episodes)")
    parser.add_argument("--workers", type=int, default=2, help="Dask workers (and shards)")
    parser.add_argument("--sft-steps", type=int, default=60, help="bootstrap SFT steps (a policy that acts)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from focus_core.artifacts import ArtifactStore
    from focus_core.config import config_to_dict, load_config
    from tasks import rollout
    from tasks.bootstrap import bootstrap
    from tasks.fanout import task_runner
    from tasks.stage import RunContext

    overrides = [f"env.name={args.env}", "method=focus", f"budget.prompts_per_iteration={args.prompts}",
                 f"bootstrap.max_steps={args.sft_steps}", "bootstrap.max_seconds=100000", "budget.measure_episodes=16"]
    cfg = load_config(None, overrides)
    with tempfile.TemporaryDirectory(prefix="focus-bench-fanout-") as root:
        store = ArtifactStore(root)
        ctx = RunContext(store, "bench-fanout", cfg)
        store.write_run_info(ctx.run_id, {"status": "running", "config": config_to_dict(cfg), "store": store.root})
        policy = bootstrap.fn(ctx)
        ctx = ctx.with_tokens_per_iteration(10**12)  # nothing is cut: the two settings play the same episodes
        results, tables = {}, {}
        # The first sharded stage of a process also starts the workers (torch imports, each worker's Prefect
        # client and, without PREFECT_API_URL, its own ephemeral API, the policy load); later stages find them warm.
        dask = f"dask_{args.workers}"
        for name, shards in (("serial", 1), (f"{dask}_first", args.workers), (dask, args.workers)):
            sharded = cfg.model_copy(update={"generation": cfg.generation.model_copy(
                update={"shards": shards, "runner": "dask", "dask_workers": args.workers})})
            run = RunContext(store, ctx.run_id, sharded, ctx.tokens_per_iteration)
            cluster_s = 0.0
            if shards > 1:
                started = time.perf_counter()
                task_runner(sharded.generation)  # the local cluster, started once per process
                cluster_s = time.perf_counter() - started
            with tempfile.TemporaryDirectory() as scratch:
                started = time.perf_counter()
                result = rollout.compute(run, 0, policy, Path(scratch))
                wall = time.perf_counter() - started
            generation = result.timings["generation_s"]
            tables[name] = result.tables["episodes"].select(["episode_id", "reward", "generated_tokens"])
            results[name] = {"shards": shards, "episodes": result.figures["episodes"],
                             "generated_tokens": result.figures["tokens"], "wall_s": round(wall, 2),
                             "generation_s": round(generation, 2),
                             "outside_generation_share": round(1 - generation / wall, 3),
                             "tokens_per_s": round(result.figures["tokens"] / wall, 1),
                             **({"cluster_start_s": round(cluster_s, 2)} if shards > 1 else {})}
        same = tables["serial"].equals(tables[dask]) and tables["serial"].equals(tables[f"{dask}_first"])
    emit_json({"env": args.env, "policy": "tiny (SFT warm start)", "cores": os.cpu_count(), "settings": results,
               "speedup_warm": round(results["serial"]["wall_s"] / results[dask]["wall_s"], 2),
               "same_episodes": bool(same)}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
