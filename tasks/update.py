"""Stage 7 — update: PPO-clip on the main rollouts' policy tokens with their segments' advantages.

Each segment of each main episode is one training sequence (the context restarts at every
compression), with exactly the stored token ids and sampling log-probs — nothing is re-tokenized.
Every policy token of a segment gets the segment's advantage; with ``advantage.whiten`` the token
advantages are whitened over the batch. ``focus_core.ppo.policy_update`` does the epochs; the new
checkpoint is committed as folder ``policy`` at version + 1, with one ``updates`` row per step.
With ``ppo.kl_coef > 0`` the KL is taken to the bootstrap policy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from focus_core.advantages import whiten
from focus_core.artifacts import Manifest
from focus_core.ppo import policy_update
from focus_core.rollouts import token_advantages, training_sequences
from focus_core.schemas import schema_for
from tasks.inputs import POLICY_FOLDER, policy_at, read
from tasks.stage import RunContext, StageResult, run_stage

STAGE = "update"


def compute(ctx: RunContext, iteration: int, rollout: Manifest, advantages: Manifest, policy_manifest: Manifest,
            reference: Manifest, scratch: Path) -> StageResult:
    cfg = ctx.config
    sequences = training_sequences(read(ctx, rollout, "rollouts"))
    token_adv = token_advantages(sequences, read(ctx, advantages, "advantages"))
    if cfg.advantage.whiten:
        flat, mask = np.concatenate(token_adv), np.concatenate([s.loss_mask for s in sequences])
        flat = whiten(flat, mask)
        token_adv = np.split(flat, np.cumsum([len(a) for a in token_adv])[:-1])
    policy = policy_at(ctx, policy_manifest)
    reference_model = policy_at(ctx, reference).model if cfg.ppo.kl_coef > 0 else None
    seed = ctx.seed(iteration, STAGE)
    with tqdm(desc=f"it {iteration} update", unit="step", leave=False) as bar:
        report = policy_update(policy.model, sequences, token_adv, cfg.ppo, reference_model=reference_model,
                               seed=seed, progress=lambda row: bar.update(1))
    policy.version = policy_manifest.policy_version + 1
    policy.save(scratch / POLICY_FOLDER)
    rows = [{"run_id": ctx.run_id, "iteration": iteration, "policy_version": policy_manifest.policy_version, **row}
            for row in report.rows]
    figures = {"steps": len(report.rows), "policy_tokens": report.policy_tokens, "kl": report.kl,
               "clip_fraction": report.clip_fraction, "entropy": report.entropy, "approx_kl": report.approx_kl,
               "logprob_gap": report.behaviour_logprob_gap}
    return StageResult(tables={"updates": pa.Table.from_pylist(rows, schema=schema_for("updates"))},
                       folders={POLICY_FOLDER: scratch / POLICY_FOLDER}, figures=figures,
                       policy_version=policy.version, seeds={"update": seed})


@task(name="update", retries=1, cache_policy=NO_CACHE)
def update(ctx: RunContext, iteration: int, rollout: Manifest, advantages: Manifest, policy: Manifest,
           reference: Manifest) -> Manifest:
    upstream = {"rollout": rollout, "advantages": advantages, "policy": policy, "reference": reference}
    return run_stage(ctx, iteration, STAGE, depends_on=ctx.fields("seed", "ppo", "advantage.whiten"),
                     upstream=upstream,
                     compute=lambda scratch: compute(ctx, iteration, rollout, advantages, policy, reference, scratch))
