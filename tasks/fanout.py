"""Fan-out inside a stage: the episodes of rollout, branch and evaluate split into shards on a Prefect task runner.

``play`` is what those stages call to generate. With ``generation.shards: 1`` (the default) it plays every episode
in the stage's own process, as one ``AgentRunner.run``. With more shards it cuts the episodes into contiguous
shards (at seed boundaries where it can, so a state's continuations share their prefix), submits one
``play-shard`` task per shard to the task runner (``generation.runner``: threads in this process, or Dask workers:
a local cluster of ``generation.dask_workers`` processes, or the scheduler at ``generation.dask_address``) and puts
the episodes back in order.

Why the tables do not change: each episode samples from its own (seed, index) (``AgentRunner.run``'s
``episode_seeds``), which the stage derives per episode, never per batch; so an episode draws the same
tokens in any shard, and a sharded stage commits the serial stage's tables (``tests/test_fanout.py``, with a
real local Dask cluster). The policy reaches a worker through the artifact store: the shard carries the
policy stage's manifest, and the worker fetches and loads that checkpoint (cached per process). The stage's
ledger is split over the shards in proportion to their episodes' expected cost (``BudgetLedger.split``; the
acquisition's cost estimates for continuations) and their charges
come back into it, so the spend still never exceeds B_tok; only when a shard's part binds does a sharded
stage cut other episodes than the serial one would. The shards' episodes return as task results and the stage
commits its tables under one manifest, as before.
"""

from __future__ import annotations

import atexit
import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from focus_core.agent.harness import AgentEpisode, AgentRunner, RunProgress, SegmentStart
from focus_core.artifacts import ArtifactStore, Manifest
from focus_core.budget import BudgetLedger
from focus_core.config import AgentConfig, GenerationConfig, config_to_dict, validate_config
from focus_core.envs.base import Task
from focus_core.policy.base import Policy
from focus_core.policy.hf import HFPolicy
from tasks.inputs import env_factory, policy_at
from tasks.stage import RunContext


@dataclass(frozen=True)
class Shard:
    """One shard's work: everything a worker needs, and no weights (the policy comes from the store)."""

    store_root: str
    run_id: str
    config: dict[str, Any]
    policy: Manifest
    agent: dict[str, Any]
    tasks: tuple[Task, ...]
    starts: tuple[SegmentStart, ...]
    episode_seeds: tuple[tuple[int, int], ...]
    seed: int
    budget: int | None  # this shard's part of the stage's ledger; None: no ledger
    kind: str
    round_idx: int
    own_process: bool  # a Dask worker: one torch thread, the process is the shard's alone


def play(ctx: RunContext, policy_manifest: Manifest, policy: Policy, agent: AgentConfig, *,
         tasks: Sequence[Task] = (), starts: Sequence[SegmentStart] = (), episode_seeds: Sequence[tuple[int, int]],
         seed: int, ledger: BudgetLedger | None = None, costs: Sequence[float] | None = None, kind: str = "main",
         round_idx: int = 0, progress: Callable[[RunProgress], None] | None = None,
         timings: dict[str, float] | None = None) -> list[AgentEpisode]:
    """The episodes of ``tasks`` then ``starts``, as ``AgentRunner(policy, ...).run`` plays them (same order),
    split over ``ctx.config.generation.shards`` shards; ``ledger`` is charged what they generated. ``costs``: each
    episode's expected tokens (the acquisition's estimates), by which the ledger is split; default equal.
    ``timings`` (if given) adds up ``generation_s``: the seconds of generation, of the longest shard when
    sharded (the part of the stage's time that more workers could not have saved)."""
    generation, total = ctx.config.generation, len(tasks) + len(starts)
    timings = {} if timings is None else timings
    if generation.shards == 1 or total < 2:
        started = time.perf_counter()
        episodes = AgentRunner(policy, env_factory(ctx), agent).run(
            tasks, starts=starts, seed=seed, episode_seeds=episode_seeds, ledger=ledger, kind=kind,
            round_idx=round_idx, progress=progress)
        timings["generation_s"] = timings.get("generation_s", 0.0) + time.perf_counter() - started
        return episodes
    bounds = shard_bounds([s for s, _ in episode_seeds], generation.shards)
    costs = [1.0] * total if costs is None else list(costs)
    parts = ([None] * len(bounds) if ledger is None
             else ledger.split([max(sum(costs[low:high]), 1e-9) for low, high in bounds]))
    config = config_to_dict(ctx.config)
    work = [Shard(ctx.store.root, ctx.run_id, config, policy_manifest, agent.model_dump(),
                  tuple(tasks[low:high]), tuple(starts[max(0, low - len(tasks)):max(0, high - len(tasks))]),
                  tuple(episode_seeds[low:high]), seed, None if part is None else part.budget, kind, round_idx,
                  generation.runner == "dask")
            for (low, high), part in zip(bounds, parts, strict=True)]
    runner = task_runner(generation)
    futures = [runner.submit(play_shard, {"shard": shard}) for shard in work]
    episodes: list[AgentEpisode] = []
    finished = tokens = 0
    longest = 0.0
    for future in futures:  # in shard order: the episodes come back in the serial order
        played, charged, seconds = future.result()
        longest = max(longest, seconds)
        episodes += played
        if ledger is not None:
            ledger.absorb(charged)
        finished, tokens = finished + len(played), tokens + sum(e.generated_tokens for e in played)
        if progress:
            progress(RunProgress(finished, total, max((len(e.turns) for e in played), default=0), tokens))
    timings["generation_s"] = timings.get("generation_s", 0.0) + longest
    return episodes


def shard_bounds(seeds: Sequence[int], shards: int) -> list[tuple[int, int]]:
    """[low, high) of each shard: ``shards`` contiguous parts of about equal size, each boundary moved to the
    nearest change of seed (episodes of one seed share prompts) when one lies within half a shard."""
    n, shards = len(seeds), min(shards, len(seeds))
    cuts = [0]
    for k in range(1, shards):
        target = round(k * n / shards)
        reach = max(1, n // (2 * shards))
        candidates = [c for c in range(max(cuts[-1] + 1, target - reach), min(n, target + reach + 1))
                      if seeds[c] != seeds[c - 1]]
        cut = min(candidates, key=lambda c: abs(c - target)) if candidates else max(cuts[-1] + 1, target)
        if cut < n:
            cuts.append(cut)
    return list(zip(cuts, [*cuts[1:], n], strict=True))


@task(name="play-shard", cache_policy=NO_CACHE)
def play_shard(shard: Shard) -> tuple[list[AgentEpisode], BudgetLedger | None, float]:
    """Play one shard on a worker: the policy from the store, the episodes with their own seeds."""
    if shard.own_process:
        import torch

        torch.set_num_threads(1)  # one core per worker process, as the compare flow's workers
    config = validate_config(shard.config)
    ctx = RunContext(ArtifactStore(shard.store_root), shard.run_id, config)
    policy = worker_policy(shard.store_root, shard.policy, threading.get_ident())
    ledger = None if shard.budget is None else BudgetLedger(shard.budget)
    started = time.perf_counter()
    episodes = AgentRunner(policy, env_factory(ctx), AgentConfig.model_validate(shard.agent)).run(
        shard.tasks, starts=shard.starts, seed=shard.seed, episode_seeds=shard.episode_seeds, ledger=ledger,
        kind=shard.kind, round_idx=shard.round_idx)
    return episodes, ledger, time.perf_counter() - started


@functools.lru_cache(maxsize=8)
def worker_policy(store_root: str, manifest: Manifest, thread: int) -> HFPolicy:
    """The checkpoint of the policy stage ``manifest`` (the one the shard carries), if the store still holds that
    stage. A worker loads each checkpoint once (a stage's shards, then the next stage's, use the same one); each
    thread its own copy, since a policy's generate is not made for two threads at once."""
    store = ArtifactStore(store_root)
    stored = store.manifest(manifest.run_id, manifest.iteration, manifest.stage)
    if stored is None or stored.hash != manifest.hash:
        raise RuntimeError(f"run {manifest.run_id}: the policy of {manifest.stage} at iteration {manifest.iteration} "
                           f"is not the one the stage was given (its manifest changed or is gone); rerun the stage")
    with _LOADING:  # transformers builds a model on the meta device process-wide: one load at a time
        return policy_at(RunContext(store, manifest.run_id, validate_config({})), manifest)


_LOADING = threading.Lock()


_RUNNERS: dict[tuple, TaskRunner] = {}


def task_runner(generation: GenerationConfig) -> TaskRunner:
    """The task runner of ``generation``, started once per process and kept for the next stages (a local Dask
    cluster takes seconds to start), closed at exit."""
    key = (generation.runner, generation.dask_address, generation.dask_workers, generation.shards)
    if key not in _RUNNERS:
        if generation.runner == "threads":
            runner: TaskRunner = ThreadPoolTaskRunner(max_workers=generation.shards)
        else:
            from prefect_dask import DaskTaskRunner

            runner = DaskTaskRunner(address=generation.dask_address) if generation.dask_address else DaskTaskRunner(
                cluster_kwargs={"n_workers": generation.dask_workers, "threads_per_worker": 1, "processes": True,
                                "dashboard_address": None})
        runner.__enter__()
        atexit.register(runner.__exit__, None, None, None)
        _RUNNERS[key] = runner
    return _RUNNERS[key]
