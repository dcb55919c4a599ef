"""What stages load besides tables: the policy entering an iteration, the environment, its tasks."""

from __future__ import annotations

import atexit
import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from focus_core.artifacts import Manifest
from focus_core.envs import make_env
from focus_core.envs.base import Task, ToolEnv
from focus_core.policy.base import Policy
from focus_core.policy.hf import HFPolicy
from focus_core.policy.models import load_policy
from focus_core.rollouts import states_table
from tasks.stage import RunContext

POLICY_FOLDER = "policy"  # the checkpoint folder name in the bootstrap and update stages
CRITIC_FOLDER = "critic"  # the checkpoint folder name in fit_critic stages


def fold_critic_folder(fold: int) -> str:
    """The checkpoint folder of the critic fit_critic fitted without the tasks of ``fold``."""
    return f"{CRITIC_FOLDER}_fold{fold}"


def env_factory(ctx: RunContext) -> Callable[[], ToolEnv]:
    env = ctx.config.env
    return functools.partial(make_env, env.name, tier=env.tier, **env.options)


@functools.lru_cache(maxsize=8)
def _tasks(name: str, options: tuple, split: str, tier: str) -> tuple[Task, ...]:
    return tuple(make_env(name, tier=tier, **dict(options)).tasks(split, tier))


def tasks(ctx: RunContext, split: str) -> list[Task]:
    env = ctx.config.env
    found = list(_tasks(env.name, tuple(sorted(env.options.items())), split, env.tier))
    if not found:
        raise ValueError(f"environment {env.name} has no {split} tasks at tier {env.tier!r} "
                         "(fix: another env.tier, or check the adapter's data paths in env.options)")
    return found


def policy_at(ctx: RunContext, policy: Manifest) -> HFPolicy:
    """Load the checkpoint a bootstrap or update manifest points to, at its policy version."""
    folder = ctx.store.fetch_folder(ctx.run_id, policy.iteration, policy.stage, POLICY_FOLDER)
    return load_policy(folder)


def generator_at(ctx: RunContext, policy: Manifest) -> Policy:
    """The policy that generates in rollout, branch and evaluate: the checkpoint in process (``generation.backend:
    hf``), or a vLLM server on it (``vllm``), started once per process and handed each newer checkpoint in place
    (``VLLMPolicy.load_weights``: reload, then a prefix-cache reset), stopped at exit."""
    if ctx.config.generation.backend == "hf":
        return policy_at(ctx, policy)
    from focus_core.policy.vllm import VLLMPolicy

    folder = Path(ctx.store.fetch_folder(ctx.run_id, policy.iteration, policy.stage, POLICY_FOLDER)).resolve()
    served = _SERVED.get("policy")
    if served is None:
        positions = json.loads((folder / "config.json").read_text()).get("max_position_embeddings", 2048)
        served = VLLMPolicy.launch(folder, threads=ctx.config.generation.vllm_threads,
                                   max_model_len=positions)
        served.version = policy.policy_version or 0
        atexit.register(served.close)
        _SERVED.update(policy=served, folder=folder)
    elif _SERVED["folder"] != folder:
        served.load_weights(folder, version=policy.policy_version)
        _SERVED["folder"] = folder
    return served


_SERVED: dict[str, Any] = {}  # this process's vLLM policy and the checkpoint folder it serves, once started


def read(ctx: RunContext, manifest: Manifest, table: str):
    """A committed table of an upstream stage (only the parts its manifest lists, hash-checked)."""
    return ctx.store.read_table(ctx.run_id, manifest.iteration, manifest.stage, table)


def continuation_tables(ctx: RunContext, branches: Sequence[Manifest]) -> tuple[pa.Table, pa.Table] | None:
    """The continuations of the branch stages (every round): their ``states`` rows, sorted by episode then segment
    (a continuation's first row is the state it started from), and their ``episodes``; None without any."""
    parts = [(read(ctx, m, "rollouts"), read(ctx, m, "episodes")) for m in branches if not m.skipped]
    parts = [(rollouts, episodes) for rollouts, episodes in parts if episodes.num_rows]
    if not parts:
        return None
    states = pa.concat_tables([states_table(rollouts, episodes) for rollouts, episodes in parts])
    states = states.take(np.lexsort((states.column("segment_idx").to_numpy(),
                                     np.array(states.column("episode_id").to_pylist(), dtype=object))))
    return states, pa.concat_tables([episodes for _, episodes in parts])


def spent_tokens(ctx: RunContext, manifests: Sequence[Manifest]) -> int:
    """Generated tokens already charged this iteration, from the budget_ledger tables of ``manifests``."""
    return sum(int(pc.sum(read(ctx, m, "budget_ledger").column("tokens")).as_py() or 0)
               for m in manifests if not m.skipped)


# The columns that identify a segment start state in every table keyed by one (advantages, acquisition, values):
# copied from the states table, so each such table joins it, and the others, on them.
STATE_KEYS = ("run_id", "iteration", "episode_id", "segment_idx", "state_id", "policy_version")


def state_keys(states: pa.Table) -> dict[str, pa.ChunkedArray]:
    """The STATE_KEYS columns of ``states``, the first columns of a table with one row per state."""
    return {name: states.column(name) for name in STATE_KEYS}


def floats_or_nulls(values, n: int) -> pa.Array:
    """A float64 column, or n nulls where a method has no such number (e.g. no critic)."""
    return pa.nulls(n, pa.float64()) if values is None else pa.array(values, pa.float64())


def load_value_head(ctx: RunContext, policy: Manifest, loaded: HFPolicy):
    """The value head stored beside a policy checkpoint (PPO+GAE), or a fresh one for the bootstrap policy."""
    from focus_core.value_head import ValueHead

    folder = ctx.store.fetch_folder(ctx.run_id, policy.iteration, policy.stage, POLICY_FOLDER)
    try:
        return ValueHead.load(folder)
    except FileNotFoundError:  # the bootstrap checkpoint has no head: every run starts from the same fresh one
        return ValueHead.for_model(loaded.model, seed=ctx.seed(0, "value_head"))
