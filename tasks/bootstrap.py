"""Stage 0 — bootstrap: the policy that iteration 0 starts from, and the budget B_tok it sets.

``model.source=tiny`` (the embedded default) trains a byte-level BPE tokenizer on the environment's
text, builds a tiny Llama from ``model.*`` and warm-starts it by SFT on scripted-expert
demonstrations with injected mistakes (``focus_core.agent.sft.warm_start``), so RL starts from a
policy that sometimes succeeds. Any other source (``smollm2`` or a Hugging Face folder) is loaded as
is. Either way the stage commits the checkpoint folder ``policy`` at version 0.

Then it measures the budget: the policy plays ``budget.measure_episodes`` training episodes and the
manifest records their mean generated tokens. B_tok = that mean × P × G_grpo (figure ``budget_tokens``), unless
``budget.tokens_per_iteration`` gives it (``tokens_per_iteration``).

``bootstrap.init_from`` (``focus train --init RUN_ID``) copies another run's committed bootstrap
instead — its checkpoint byte for byte and its measured figures — so methods compared side by side
start from the same weights and spend the same B_tok. The other run must share this run's env and
model settings (its tokenizer was trained on that env's text).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from focus_core.agent.harness import AgentRunner
from focus_core.agent.sft import clock_cut_warning, warm_start
from focus_core.artifacts import ArtifactStore, Manifest
from focus_core.config import FocusConfig
from focus_core.policy.models import load_policy
from tasks.inputs import POLICY_FOLDER, env_factory, tasks
from tasks.progress import GenerationBar
from tasks.stage import RunContext, StageResult, run_stage, stage_task

STAGE = "bootstrap"
log = logging.getLogger("focus")
# What a bootstrap trained here reads; a copy (bootstrap.init_from) is versioned by its source instead.
READS = ("seed", "env.name", "env.tier", "env.options", "model", "bootstrap", "agent", "budget.measure_episodes",
         "budget.prompts_per_iteration", "budget.group_size_grpo")
SHARED_SECTIONS = ("env.name", "env.tier", "env.options", "model")  # an --init source must match these


def tokens_per_iteration(cfg: FocusConfig, bootstrap: Manifest) -> int:
    """B_tok of this run: ``budget.tokens_per_iteration`` if given, else the bootstrap's measured mean × P × G_grpo."""
    if cfg.budget.tokens_per_iteration is not None:
        return cfg.budget.tokens_per_iteration
    return measured_tokens_per_iteration(cfg, float(bootstrap.figures["mean_episode_tokens"]))


def measured_tokens_per_iteration(cfg: FocusConfig, mean_episode_tokens: float) -> int:
    """B_tok from a measured mean: mean generated tokens per episode × P × G_grpo."""
    return max(1, round(mean_episode_tokens * cfg.budget.prompts_per_iteration * cfg.budget.group_size_grpo))


def source_of(init_from: str, store: ArtifactStore) -> tuple[ArtifactStore, str]:
    """(store, run id) of an ``init_from`` value: a run id in ``store``, or a run's URL or path."""
    if "/" not in init_from:
        return store, init_from
    root, _, run_id = init_from.rstrip("/").rpartition("/")
    return ArtifactStore(root), run_id


def _copy_bootstrap(ctx: RunContext, scratch: Path) -> StageResult:
    source_store, source_run = source_of(ctx.config.bootstrap.init_from, ctx.store)
    info = source_store.run_info(source_run)
    manifest = source_store.manifest(source_run, 0, STAGE)
    if info is None or manifest is None:
        raise ValueError(f"bootstrap.init_from: {ctx.config.bootstrap.init_from!r} has no committed bootstrap "
                         f"(fix: the id of a run that got past its bootstrap stage, in store {source_store.root})")
    theirs = RunContext(source_store, source_run, FocusConfig.model_validate(info["config"])).fields(*SHARED_SECTIONS)
    ours = ctx.fields(*SHARED_SECTIONS)
    differ = [name for name in SHARED_SECTIONS if theirs[name] != ours[name]]
    if differ:
        raise ValueError(f"bootstrap.init_from: run {source_run} was bootstrapped with other {', '.join(differ)} "
                         f"({', '.join(f'{n}={theirs[n]!r}' for n in differ)}); fix: use the same settings")
    folder = source_store.fetch_folder(source_run, 0, STAGE, POLICY_FOLDER)
    shutil.copytree(folder, scratch / POLICY_FOLDER)
    return StageResult(folders={POLICY_FOLDER: scratch / POLICY_FOLDER},
                       figures=dict(manifest.figures),
                       policy_version=0, seeds=dict(manifest.seeds))


def measure_episode_tokens(ctx: RunContext, policy) -> dict[str, float]:
    """Mean generated tokens (and success) of ``budget.measure_episodes`` training episodes of ``policy``."""
    cfg = ctx.config
    train = tasks(ctx, "train")
    seed = ctx.seed(0, STAGE, "measure")
    chosen = [train[i] for i in np.random.default_rng(seed).integers(0, len(train), cfg.budget.measure_episodes)]
    with GenerationBar("measuring B_tok", len(chosen)) as bar:
        episodes = AgentRunner(policy, env_factory(ctx), cfg.agent).run(chosen, seed=seed, progress=bar.callback())
    tokens = np.array([e.generated_tokens for e in episodes], dtype=np.float64)
    return {"mean_episode_tokens": float(tokens.mean()), "max_episode_tokens": int(tokens.max()),
            "measured_episodes": len(episodes), "measured_success": float(np.mean([e.reward > 0 for e in episodes]))}


def compute(ctx: RunContext, scratch: Path) -> StageResult:
    cfg = ctx.config
    if cfg.bootstrap.init_from:
        return _copy_bootstrap(ctx, scratch)
    seed = ctx.seed(0, STAGE)
    if cfg.model.source == "tiny":
        with tqdm(desc="SFT warm start", unit="step", leave=False) as bar:
            def progress(step: int, loss: float) -> None:
                bar.update(step - bar.n)
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

            policy, report = warm_start(env_factory(ctx), tasks(ctx, "train"), cfg.agent, cfg.model, cfg.bootstrap,
                                        seed=seed, progress=progress)
        if warning := clock_cut_warning(report, cfg.bootstrap):
            log.warning("[it 0] bootstrap: %s", warning)
        figures = {"sft_steps": report.steps, "sft_planned_steps": report.planned_steps,
                   "sft_epochs": report.epochs_done, "sft_loss": report.final_loss,
                   "parameters": sum(p.numel() for p in policy.model.parameters())}
    else:
        policy = load_policy(cfg.model.source)
        figures = {"parameters": sum(p.numel() for p in policy.model.parameters())}
    figures |= measure_episode_tokens(ctx, policy)
    # Named before B_tok's name was settled: runs and comparisons read the figure under this name.
    figures["budget_tokens"] = measured_tokens_per_iteration(cfg, figures["mean_episode_tokens"])
    policy.version = 0
    policy.save(scratch / POLICY_FOLDER)
    return StageResult(folders={POLICY_FOLDER: scratch / POLICY_FOLDER}, figures=figures, policy_version=0,
                       seeds={"sft": seed})


@stage_task("bootstrap")
def bootstrap(ctx: RunContext) -> Manifest:
    cfg = ctx.config
    if cfg.bootstrap.init_from:  # the copy is valid as long as the source's bootstrap is the same one
        source_store, source_run = source_of(cfg.bootstrap.init_from, ctx.store)
        source = source_store.manifest(source_run, 0, STAGE)
        depends_on = {"init_from": cfg.bootstrap.init_from, "source_hash": source.hash if source else None}
    else:
        depends_on = ctx.fields(*READS)
    return run_stage(ctx, 0, STAGE, depends_on=depends_on, upstream={}, compute=lambda scratch: compute(ctx, scratch))
