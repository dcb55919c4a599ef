"""Stage 0 — bootstrap: the policy that iteration 0 starts from.

``model.source=tiny`` (the embedded default) trains a byte-level BPE tokenizer on the environment's
text, builds a tiny Llama from ``model.*`` and warm-starts it by SFT on scripted-expert
demonstrations with injected mistakes (``focus_core.agent.sft.warm_start``), so RL starts from a
policy that sometimes succeeds. Any other source (``smollm2`` or a Hugging Face folder) is loaded as
is. Either way the stage commits the checkpoint folder ``policy`` at version 0.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from focus_core.agent.sft import warm_start
from focus_core.artifacts import Manifest
from focus_core.policy.models import load_policy
from tasks.inputs import POLICY_FOLDER, env_factory, tasks
from tasks.stage import RunContext, StageResult, run_stage

STAGE = "bootstrap"


def compute(ctx: RunContext, scratch: Path) -> StageResult:
    cfg = ctx.config
    seed = ctx.seed(0, STAGE)
    if cfg.model.source == "tiny":
        with tqdm(desc="SFT warm start", unit="step", leave=False) as bar:
            def progress(step: int, loss: float) -> None:
                bar.update(step - bar.n)
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

            policy, report = warm_start(env_factory(ctx), tasks(ctx, "train"), cfg.agent, cfg.model, cfg.bootstrap,
                                        seed=seed, progress=progress)
        figures = {"sft_steps": report.steps, "sft_epochs": report.epochs_done, "sft_loss": report.final_loss,
                   "parameters": sum(p.numel() for p in policy.model.parameters())}
    else:
        policy = load_policy(cfg.model.source)
        figures = {"parameters": sum(p.numel() for p in policy.model.parameters())}
    policy.version = 0
    policy.save(scratch / POLICY_FOLDER)
    return StageResult(folders={POLICY_FOLDER: scratch / POLICY_FOLDER}, figures=figures, policy_version=0,
                       seeds={"sft": seed})


@task(name="bootstrap", retries=1, cache_policy=NO_CACHE)
def bootstrap(ctx: RunContext) -> Manifest:
    return run_stage(ctx, 0, STAGE, depends_on=ctx.fields("seed", "env.name", "env.tier", "env.options", "model",
                                                       "bootstrap", "agent"),
                     upstream={}, compute=lambda scratch: compute(ctx, scratch))
