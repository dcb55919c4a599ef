"""Stage 7 — update: PPO-clip on the policy tokens of the main rollouts — and, with
``ppo.train_on_continuations`` (FOCUS's default), of the continuations — with their advantages.

Each segment of each main episode is one training sequence (the context restarts at every
compression), with exactly the stored token ids and sampling log-probs — nothing is re-tokenized. Every
policy token of a segment gets the segment's advantage, or its own token advantage for a token-level
estimator (``token_advantages``, PPO+GAE, whose value head trains jointly on the stored value targets);
with ``advantage.whiten`` the token advantages are whitened over the batch. Main episodes the budget cut
off are left out. The PPO ratio uses log-probs at the sampling temperature ``agent.temperature``.

With ``ppo.train_on_continuations`` every segment of every continuation the budget did not cut is a
sequence too, with the advantage stage's row for (its episode id, segment): its first row is the parent
state's context with loss mask 0, so the shared prefix is a prompt, never trained twice, and only the tokens
the continuation generated are (``focus_core.continuations.update_sequences``). The figures
``policy_tokens_main`` and ``policy_tokens_continuations`` split the trained tokens by where they came from.

The optimizer's state (AdamW moments and step counts) is committed inside the policy checkpoint
(``ppo.save_optimizer_state``, no pickles) and the next iteration continues from it, so a resumed run
updates exactly as an uninterrupted one. ``focus_core.ppo.policy_update`` does the epochs; the new
checkpoint is committed as folder ``policy`` at version + 1, with one ``updates`` row per step. With
``ppo.kl_coef > 0`` the KL is taken to the bootstrap policy. With ``ppo.target_kl`` the update stops at the first
minibatch whose KL to the sampling policy exceeds it (figure ``kl_stop_step``); ``ppo.clip_ratio_c`` is dual-clip.

A minibatch with no gradient takes no optimizer step (``focus_core.ppo``). An iteration with no token to train (the
budget cut every episode, all masked) commits the checkpoint unchanged at version + 1, with a warning line, and the
run goes on.
"""

from __future__ import annotations

import logging
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm

from focus_core.advantages import whiten
from focus_core.artifacts import Manifest
from focus_core.continuations import update_sequences
from focus_core.lora import merged, with_lora
from focus_core.policy.hf import write_version
from focus_core.ppo import (
    DataParallel,
    SequenceLike,
    UpdateReport,
    load_optimizer_state,
    policy_update,
    save_optimizer_state,
)
from focus_core.rollouts import token_advantages
from focus_core.schemas import schema_for
from tasks.inputs import POLICY_FOLDER, load_value_head, policy_at, read
from tasks.stage import RunContext, StageResult, run_stage, stage_task
from tasks.update_dp import train_in_processes, worker

log = logging.getLogger("focus")
STAGE = "update"
READS = ("seed", "ppo", "ppo.clip_ratio_c", "ppo.target_kl", "advantage.whiten", "agent.temperature", "lora")


def compute(ctx: RunContext, iteration: int, rollout: Manifest, advantages: Manifest, policy_manifest: Manifest,
            reference: Manifest, scratch: Path, branches: Sequence[Manifest] = ()) -> StageResult:
    cfg = ctx.config
    sources = [rollout] + ([m for m in branches if not m.skipped] if cfg.ppo.train_on_continuations else [])
    sequences, part = update_sequences([(read(ctx, m, "rollouts"), read(ctx, m, "episodes")) for m in sources])
    seed = ctx.seed(iteration, STAGE)
    if not any(np.any(q.loss_mask) for q in sequences):  # before whitening, which has nothing to whiten either
        return _unchanged(ctx, iteration, policy_manifest, scratch, seed)
    value_returns = old_values = None
    if "token_advantages" in advantages.tables:
        per_token = _per_sequence(read(ctx, advantages, "token_advantages"), sequences)
        token_adv, value_returns, old_values = per_token["advantages"], per_token["returns"], per_token["values"]
    else:
        token_adv = token_advantages(sequences, read(ctx, advantages, "advantages"))
    if cfg.advantage.whiten:
        flat, mask = np.concatenate(token_adv), np.concatenate([s.loss_mask for s in sequences])
        flat = whiten(flat, mask)
        token_adv = np.split(flat, np.cumsum([len(a) for a in token_adv])[:-1])
    if cfg.ppo.processes > 1:  # the same update, split over processes (tasks/update_dp.py)
        report = train_in_processes(ctx, policy_manifest, reference, sequences, token_adv, value_returns, old_values,
                                    seed, scratch)
    else:
        report = train(ctx, policy_manifest, reference, sequences, token_adv, value_returns, old_values, seed,
                       scratch / POLICY_FOLDER)
    policy_version = policy_manifest.policy_version + 1
    rows = [{"run_id": ctx.run_id, "iteration": iteration, "policy_version": policy_manifest.policy_version, **row}
            for row in report.rows]
    tokens = np.array([q.generated_tokens for q in sequences], dtype=np.int64)
    figures = {"steps": len(report.rows), "sequences": report.sequences, "policy_tokens": report.policy_tokens,
               "policy_tokens_main": int(tokens[part == 0].sum()),
               "policy_tokens_continuations": int(tokens[part > 0].sum()),
               "kl": report.kl, "clip_fraction": report.clip_fraction, "entropy": report.entropy,
               "approx_kl": report.approx_kl, "logprob_gap": report.behaviour_logprob_gap}
    if report.value_loss is not None:
        figures["value_loss"] = report.value_loss
    if report.kl_stop_step is not None:
        figures["kl_stop_step"] = report.kl_stop_step
        log.info("[it %d] update: stopped at step %d: the policy's approx KL to the sampling policy reached %.3g > "
                 "ppo.target_kl = %g", iteration, report.kl_stop_step, report.kls_before[-1], cfg.ppo.target_kl)
    return StageResult(tables={"updates": pa.Table.from_pylist(rows, schema=schema_for("updates"))},
                       folders={POLICY_FOLDER: scratch / POLICY_FOLDER}, figures=figures,
                       policy_version=policy_version, seeds={"update": seed})


def _unchanged(ctx: RunContext, iteration: int, policy_manifest: Manifest, scratch: Path, seed: int) -> StageResult:
    """No token to train: the budget cut every episode (a policy whose episodes outgrew B_tok, e.g. one drifting off
    the tools' menus), so all were masked. The checkpoint goes on as it is (weights, optimizer state, value head)
    at version + 1, so the next iteration samples again from the same policy; the run does not stop."""
    folder = ctx.store.fetch_folder(ctx.run_id, policy_manifest.iteration, policy_manifest.stage, POLICY_FOLDER)
    out = scratch / POLICY_FOLDER
    shutil.copytree(folder, out)
    version = policy_manifest.policy_version + 1
    write_version(out, version)
    log.warning("[it %d] update: no policy token to train (every episode was cut by the budget or masked): the "
                "policy goes on unchanged (fix: a larger budget.tokens_per_iteration, or fewer "
                "budget.prompts_per_iteration)", iteration)
    figures = dict.fromkeys(("steps", "sequences", "policy_tokens", "policy_tokens_main",
                             "policy_tokens_continuations"), 0)
    return StageResult(tables={"updates": schema_for("updates").empty_table()}, folders={POLICY_FOLDER: out},
                       figures=figures, policy_version=version, seeds={"update": seed})


def train(ctx: RunContext, policy_manifest: Manifest, reference: Manifest, sequences: Sequence[SequenceLike],
          token_adv: Sequence[np.ndarray], value_returns: Sequence[np.ndarray] | None,
          old_values: Sequence[np.ndarray] | None, seed: int, out: Path,
          data_parallel: DataParallel | None = None) -> UpdateReport:
    """The update of the policy ``policy_manifest`` points to; the new checkpoint (version + 1, optimizer state,
    value head) is written to ``out``, by the first process only under ``data_parallel``."""
    cfg = ctx.config
    policy = policy_at(ctx, policy_manifest)
    folder = ctx.store.fetch_folder(ctx.run_id, policy_manifest.iteration, policy_manifest.stage, POLICY_FOLDER)
    head = load_value_head(ctx, policy_manifest, policy) if value_returns is not None else None
    reference_model = policy_at(ctx, reference).model if cfg.ppo.kl_coef > 0 else None
    # LoRA: fresh adapters each iteration, merged below; AdamW restarts with them (focus_core/lora.py).
    model = with_lora(policy.model, cfg.lora) if cfg.lora else policy.model
    first = data_parallel is None or data_parallel.rank == 0
    only_rank_0 = {} if first else {"disable": True}  # passed only when it disables, so TQDM_DISABLE still holds
    with tqdm(desc=f"it {policy_manifest.iteration} update", unit="step", leave=False, **only_rank_0) as bar:
        report = policy_update(model, sequences, token_adv, cfg.ppo, reference_model=reference_model,
                               seed=seed, temperature=cfg.agent.temperature,
                               optimizer_state=None if cfg.lora else load_optimizer_state(folder), value_head=head,
                               value_returns=value_returns, old_values=old_values, value_coef=cfg.ppo.value_coef,
                               value_clip=cfg.ppo.value_clip, progress=lambda row: bar.update(1),
                               data_parallel=data_parallel)
    if first:
        if cfg.lora:
            policy.model = merged(model)
        policy.version = policy_manifest.policy_version + 1
        policy.save(out)
        if not cfg.lora:
            save_optimizer_state(report.optimizer_state, out)
        if head is not None:
            head.save(out)
    return report


def _per_sequence(table: pa.Table, sequences) -> dict[str, list[np.ndarray]]:
    """The token-level columns of ``token_advantages`` in the order of ``sequences``."""
    row_of = {key: i for i, key in enumerate(zip(table.column("episode_id").to_pylist(),
                                                 table.column("segment_idx").to_pylist(), strict=True))}
    rows = [row_of[(s.episode_id, s.segment_idx)] for s in sequences]
    return {name: [np.asarray(table.column(name)[r].as_py(), np.float64) for r in rows]
            for name in ("advantages", "returns", "values")}


@stage_task("update")
def update(ctx: RunContext, iteration: int, rollout: Manifest, advantages: Manifest, policy: Manifest,
           reference: Manifest, branches: Sequence[Manifest] = ()) -> Manifest:
    upstream = {"rollout": rollout, "advantages": advantages, "policy": policy, "reference": reference,
                **({f"branch_{k}": m for k, m in enumerate(branches)} if ctx.config.ppo.train_on_continuations else {})}
    return run_stage(ctx, iteration, STAGE, depends_on=ctx.fields(*READS), upstream=upstream,
                     compute=lambda scratch: compute(ctx, iteration, rollout, advantages, policy, reference, scratch,
                                                     branches))


if __name__ == "__main__":  # one process of a ppo.processes > 1 update, started by torchrun (tasks/update_dp.py)
    worker(Path(sys.argv[1]), train)
