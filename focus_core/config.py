"""Typed run configuration: pydantic models, per-method presets, YAML loading with ``a.b=c`` overrides.

One ``FocusConfig`` describes a run. ``method`` picks a row of the method table
(``focus_core/methods.py``); every method is the same pipeline with other settings, so a method mostly
implies settings of the sections below (``method_defaults``). Preset values fill only the fields a user
did not give, and combinations the pipeline does not support fail at load time with the reason and the
fix, never halfway through a run.

Sections that a method does not use are ``None``: only the critic methods (FOCUS) have ``critic``, only
the branching methods (FOCUS, VinePPO) have ``acquisition``.

Entry points: ``load_config(path, overrides)`` for YAML files plus CLI overrides, ``validate_config``
for a plain dict; both raise ``ConfigError`` listing every problem as ``field.path: problem``.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from focus_core.methods import METHOD_TABLE, METHODS, get_method, method_defaults

# The allowed names are the registries' keys (tests check that they stay equal): the method table
# (focus_core/methods.py), the advantage estimators and the acquisition strategies.
MethodName = Literal[METHODS]  # type: ignore[valid-type]
EstimatorName = Literal["segment_td_lambda", "vineppo", "grpo", "dr_grpo", "rloo", "gae"]
StrategyName = Literal[
    "uniform_all", "uniform_random", "ensemble_std", "eer_diag", "ivr_greedy", "neyman", "entropy", "oracle",
    "residual_knn", "beta_posterior", "novelty",
]

# How a field enters the version of a stage that reads it (tasks/stage.py), when not as its plain value: a marker in
# the field's ``json_schema_extra`` under STAGE_VERSION, read in one place (``version_values``).
STAGE_VERSION = "stage_version"
# Says how a stage runs, not what it computes (``ppo.processes``): in no version, so changing it reuses committed
# stages.
EXECUTION_ONLY = "execution_only"
# A setting added after runs were committed: a stage that reads it by name has it in its version only while it is
# set to something other than its default, so those runs keep their versions (a stage that reads its whole section
# sees it as any other field).
VERSIONED_WHEN_SET = "versioned_when_set"


class ConfigError(ValueError):
    """An invalid configuration; the message lists each problem as ``field.path: problem``."""


class _Section(BaseModel):
    # Unknown keys are errors: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid")


def _fail_if(problems: list[str]) -> None:
    """Raise the collected problems of one model, one per line (ConfigError prefixes each with the path)."""
    if problems:
        raise ValueError("\n".join(problems))


class BudgetConfig(_Section):
    """Generated-token budget per iteration, one number for every method of a comparison (method.md §9.2).

    B_tok is measured, not assumed: the bootstrap stage plays ``measure_episodes`` training episodes with
    the warm-started policy and sets B_tok = mean generated tokens per episode × P × G_grpo (committed in
    its manifest, so every run started from that bootstrap with ``--init`` gets the same B_tok).
    ``tokens_per_iteration`` replaces the measurement by an explicit number.
    """

    prompts_per_iteration: int = Field(16, ge=1, description="P: prompts (tasks) per iteration at which B_tok is sized")
    group_size_grpo: int = Field(8, ge=1, description="G_grpo: rollouts per prompt of the methods that do not branch")
    group_size_main: int = Field(4, ge=1, description="G_main: main rollouts per prompt of the branching methods")
    tokens_per_iteration: int | None = Field(None, ge=1, description="explicit B_tok; default measured at bootstrap")
    measure_episodes: int = Field(64, ge=1, description="training episodes the bootstrap plays to measure B_tok")

    @model_validator(mode="after")
    def _check(self) -> BudgetConfig:
        problems = []
        if self.group_size_main > self.group_size_grpo:
            problems.append(
                f"group_size_main: {self.group_size_main} > group_size_grpo {self.group_size_grpo}; the main "
                f"rollouts alone would exceed the matched budget (fix: group_size_main <= group_size_grpo)"
            )
        _fail_if(problems)
        return self


class AdvantageConfig(_Section):
    """How segment (or group) advantages are computed (method.md §2, §3, §5)."""

    estimator: EstimatorName = "segment_td_lambda"
    gamma: float = Field(1.0, gt=0.0, le=1.0, description="per-segment discount γ")
    lam: float = Field(0.9, ge=0.0, le=1.0, description="TD(λ) trace λ")
    trace_mode: Literal["segment", "token_length"] = Field(
        "segment", description="segment: Λ_k = λ; token_length: Λ_k = λ_tok^{L_k}"
    )
    lambda_token_halflife: float | None = Field(
        None, gt=0.0, description="generated tokens after which the token-length trace halves"
    )
    whiten: bool = Field(True, description="whiten token advantages over the batch")
    grpo_std: Literal["unbiased", "population"] = Field(
        "unbiased", description="std of the GRPO group normaliser: unbiased (n−1) or population (n)"
    )

    @model_validator(mode="after")
    def _check(self) -> AdvantageConfig:
        problems = []
        if self.trace_mode == "token_length" and self.lambda_token_halflife is None:
            problems.append(
                "lambda_token_halflife: required when trace_mode is token_length "
                "(fix: set it, e.g. 2000, or use trace_mode=segment)"
            )
        if self.trace_mode == "segment" and self.lambda_token_halflife is not None:
            problems.append(
                "lambda_token_halflife: only used with trace_mode=token_length "
                "(fix: remove it or set trace_mode=token_length)"
            )
        _fail_if(problems)
        return self


class AcquisitionConfig(_Section):
    """Where the branch budget goes: the selective-branching strategy (method.md §7, §9.4, §9.5)."""

    # FOCUS's rule, from its row of the method table (the one place it is named); chosen by critic-agent and
    # critic-budget (docs/benchmarks.md, "Acquisition strategies: the ablation").
    strategy: StrategyName = METHOD_TABLE["focus"].branching
    eps_uniform: float = Field(0.2, ge=0.0, le=1.0, description="share of the branch budget spent uniformly")
    chunk_size: int = Field(2, ge=1, description="k_chunk: continuations per greedy pick")
    max_per_state: int = Field(8, ge=1, description="n_max: most continuations one state may get")
    vine_k: int = Field(9, ge=1, description="K: continuations per state for uniform_all (VinePPO)")
    rounds: int = Field(2, ge=1, description="R: acquire -> branch -> fit rounds per iteration")
    last_round_margin_sd: float = Field(
        2.0, ge=0.0, description="the last round plans this many standard deviations of its spend below its "
        "budget, since no later round can absorb an overspend (1 sd cut 14% of one iteration's continuations)"
    )
    jitter: float = Field(1e-4, gt=0.0, description="τ²: jitter added to the ensemble covariance diagonal")
    # The three below were tuned on critic-budget seeds 100-105 (confirmed on 106-111), never on the reported 0-9.
    neighbours: int = Field(
        8, ge=1, description="residual_knn: nearest observed states whose returns estimate a state's critic error"
    )
    beta_strength: float = Field(
        8.0, gt=0.0, description="beta_posterior: κ, how many returns the out-of-fold critic's prior is worth"
    )
    novelty_bandwidth: float = Field(
        1.5, gt=0.0, description="novelty: kernel width, in median nearest-neighbour distances between states"
    )
    benchmark_only: bool = Field(
        False, description="allow the oracle strategy, which reads true values only benchmarks have"
    )

    @model_validator(mode="after")
    def _check(self) -> AcquisitionConfig:
        problems = []
        if self.max_per_state < self.chunk_size:
            problems.append(
                f"max_per_state: {self.max_per_state} < chunk_size {self.chunk_size}, so no state could get "
                f"a chunk (fix: max_per_state >= chunk_size)"
            )
        if self.strategy == "oracle" and not self.benchmark_only:
            problems.append(
                "strategy: oracle needs true state values, which only benchmark environments provide "
                "(fix: set benchmark_only=true in a benchmark, or choose another strategy)"
            )
        _fail_if(problems)
        return self


class CriticConfig(_Section):
    """Critic ensemble on frozen state features (method.md §9.1, §9.5)."""

    members: int = Field(5, ge=2, description="M: ensemble heads (>= 2 to have a spread)")
    hidden: int = Field(256, ge=1, description="hidden width of each head")
    steps: int = Field(300, ge=1, description="gradient steps per fit, each on a minibatch of states")
    lr: float = Field(3e-3, gt=0.0, description="Adam learning rate")
    prior_precision: float = Field(
        15.0, ge=0.0, description="Gaussian prior (L2) on head weights, relative to one observed return"
    )
    batch_size: int = Field(1024, ge=1, description="states per minibatch")
    bootstrap: Literal["poisson", "none"] = Field(
        "poisson", description="poisson: each head weights every observed return by Poisson(1)"
    )
    seed: int = Field(0, description="offset combined with the run seed for head init and bootstrap")
    folds: int = Field(
        4, ge=2, description="cross-fitting: the value of a row comes from a critic fitted on the other folds "
        "(of tasks or of episodes, fold_unit), so no episode's baseline has seen its own return"
    )
    fold_unit: Literal["task", "episode"] = Field(
        "task", json_schema_extra={STAGE_VERSION: VERSIONED_WHEN_SET},
        description="what the cross-fitting folds are made of: task (a state's value comes from a critic that saw no "
        "episode of its task: it must generalise across tasks) or episode (from one that saw no return of the "
        "row's own episode, but the other episodes of its task: GRPO's group, generalised by the critic)")
    replay_iterations: int = Field(
        0, ge=0, description="also fit on the critic data of this many earlier iterations (features of older "
        "policies; 0 = this iteration only)"
    )
    continuation_states: bool = Field(
        False, json_schema_extra={STAGE_VERSION: VERSIONED_WHEN_SET},
        description="also fit on every later state of every continuation, each with the continuation's return "
        "(features from the sampling policy, as stage segment's); off: a continuation's return counts at the state "
        "it started from only")
    prior_variance: Literal["ensemble", "calibrated"] = Field(
        "ensemble", json_schema_extra={STAGE_VERSION: VERSIONED_WHEN_SET},
        description="the critic prior's variance when it is combined with a state's returns: ensemble (the members' "
        "spread) or calibrated (scaled up to the error the out-of-fold critic makes against the returns, when the "
        "spread is smaller: empirical Bayes)")


class AgentConfig(_Section):
    """The agent harness: limits, sampling and the context manager (issue: agent harness)."""

    max_turns: int = Field(20, ge=1, description="tool calls per episode before it is cut off (reward 0)")
    max_action_tokens: int = Field(48, ge=1, description="generated tokens per policy message")
    max_summary_tokens: int = Field(96, ge=1, description="generated tokens per compression summary")
    context_max_tokens: int = Field(
        1536, ge=64, description="C_max: compress when the working context would exceed this many tokens"
    )
    compress_every_turns: int = Field(
        4, ge=1, description="M: fallback, compress after this many turns in one segment"
    )
    compression: Literal["policy", "notes", "observation"] = Field(
        "notes", description="policy: the policy writes the summary (real models); notes: a deterministic "
        "compressor (the default: a from-scratch tiny model cannot write useful summaries); observation: the "
        "Markov context, [system, task prompt + the last observation] after every turn (compress_every_turns and "
        "context_max_tokens do not apply), so the policy at a state is a function of that state alone"
    )
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")


class EnvConfig(_Section):
    """Which environment the agent trains in, and which of its tasks (issue: agent harness)."""

    name: str = Field("deep_search", description="registered environment: deep_search, code_localization, legal, "
                      "or an adapter (browsecomp_plus, swebench_loc)")
    tier: str = Field("default", description="difficulty tier; default suits the tiny CPU model")
    options: dict[str, Any] = Field(default_factory=dict, description="constructor arguments, e.g. adapter data paths")
    eval_tasks: int = Field(64, ge=1, description="held-out tasks per evaluation (the same ones every time)")
    eval_every: int = Field(1, ge=1, description="evaluate after every this many iterations (and after the last)")
    eval_temperature: float = Field(1.0, gt=0.0, description="sampling temperature of held-out evaluation")


class ModelConfig(_Section):
    """Where the policy comes from and how it generates."""

    source: str = Field("tiny", description="tiny (built from config, warm-started by SFT), smollm2, or a local "
                        "Hugging Face model folder")
    layers: int = Field(2, ge=1, description="tiny model: transformer layers")
    hidden: int = Field(128, ge=16, description="tiny model: hidden size")
    heads: int = Field(4, ge=1, description="tiny model: attention heads")
    intermediate: int = Field(384, ge=16, description="tiny model: MLP width")
    vocab_size: int = Field(2048, ge=300, description="tiny model: byte-level BPE vocabulary trained on the env")
    max_context: int = Field(2048, ge=256, description="tiny model: positions")

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        problems = []
        if self.source not in ("tiny", "smollm2") and not Path(self.source).expanduser().is_dir():
            problems.append(f"source: {self.source!r} is neither tiny, smollm2 nor an existing Hugging Face model "
                            "folder (fix: model.source=tiny, or the path of a folder with config.json)")
        if self.hidden % self.heads:
            problems.append(f"hidden: {self.hidden} is not divisible by heads={self.heads}")
        _fail_if(problems)
        return self


class BootstrapConfig(_Section):
    """SFT warm start of the tiny model on scripted-expert demonstrations with injected mistakes."""

    demonstrations: int = Field(1000, ge=1, description="expert episodes on training tasks")
    mistake_rate: float = Field(0.05, ge=0.0, le=1.0, description="share of expert actions replaced by random ones")
    lr: float = Field(3e-3, gt=0.0, description="AdamW learning rate (linear decay)")
    epochs: float = Field(100.0, gt=0.0, description="passes over the demonstrations (max_seconds usually stops first)")
    max_seconds: float = Field(240.0, gt=0.0, description="wall-clock limit of the fine-tuning loop")
    batch_tokens: int = Field(8192, ge=256, description="padded tokens per step")
    context_weight: float = Field(0.0, ge=0.0, description="weight of the auxiliary loss on context/tool tokens")
    max_steps: int | None = Field(
        None, ge=1, description="SFT optimizer steps; bounds the warm start by steps, so it is the same on any "
        "machine (max_seconds still applies)"
    )
    init_from: str | None = Field(
        None, description="reuse a committed bootstrap instead of training one: a run id in this store, or a "
        "run's URL (s3://bucket/prefix/RUN_ID or /path/to/runs/RUN_ID); `focus train --init RUN_ID` sets it"
    )


class GenerationConfig(_Section):
    """How the generating stages (rollout, branch, evaluate) generate: the backend, and shards of their episodes on
    a Prefect task runner (``tasks/fanout.py``). The shards are part of no stage's version (a sharded stage writes
    the serial one's tables); the backend is, when it is not hf (it draws other tokens)."""

    backend: Literal["hf", "vllm"] = Field(
        "hf", json_schema_extra={STAGE_VERSION: VERSIONED_WHEN_SET},
        description="hf (the checkpoint in process) or vllm (a server on it, infra/vllm/); the update always trains "
        "the hf model")
    vllm_threads: int = Field(2, ge=1, description="vllm backend: CPU threads of the server (ignored on a GPU)")
    shards: int = Field(1, ge=1, description="episode shards per generating stage (1: played in the stage itself)")
    runner: Literal["threads", "dask"] = Field(
        "dask", description="threads: in the stage's process; dask: Dask workers (prefect-dask)")
    dask_address: str | None = Field(
        None, description="an existing Dask scheduler (tcp://host:8786); null: a local cluster of dask_workers")
    dask_workers: int = Field(2, ge=1, description="processes of the local Dask cluster (one thread each)")


class LoRAConfig(_Section):
    """The update trains LoRA adapters (``peft``) and merges them into the checkpoint it writes (``lora.py``)."""

    rank: int = Field(16, ge=1, description="r: rank of each adapter")
    alpha: float = Field(32.0, gt=0.0, description="scale alpha (the update is alpha / r · B A)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input")
    targets: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                               min_length=1, description="names of the linear layers that get adapters")


class PPOConfig(_Section):
    """Clipped policy update (method.md §2, §3.2, §9.6)."""

    clip_eps: float = Field(0.2, gt=0.0, lt=1.0, description="ε: ratio clipped to [1−ε, 1+ε_high]")
    clip_eps_high: float | None = Field(None, gt=0.0, description="ε_high (clip-higher); default ε")
    clip_ratio_c: float | None = Field(
        None, gt=1.0, json_schema_extra={STAGE_VERSION: VERSIONED_WHEN_SET},
        description="dual-clip c: a token with negative advantage loses at most c·|A| (verl's clip_ratio_c, 3.0 "
        "there); null = plain PPO-clip")
    epochs: int = Field(2, ge=1, description="passes over the batch per iteration")
    lr: float = Field(1e-4, gt=0.0, description="policy learning rate (tiny default; ~1e-6 for LLMs)")
    kl_coef: float = Field(0.0, ge=0.0, description="coefficient of the k3 KL-to-reference loss")
    target_kl: float | None = Field(
        None, gt=0.0, json_schema_extra={STAGE_VERSION: VERSIONED_WHEN_SET},
        description="early stop (SB3, CleanRL): the first minibatch whose KL to the sampling policy, measured before "
        "its step, exceeds this takes no step, nor does any after it; null = every epoch runs in full")
    entropy_coef: float = Field(0.0, ge=0.0, description="coefficient of the entropy bonus")
    loss_agg: Literal["token_mean", "constant"] = Field(
        "token_mean", description="token_mean: sum / policy tokens; constant: sum / (C · sequences)"
    )
    constant_normaliser: int | None = Field(None, ge=1, description="C for loss_agg=constant (Dr.GRPO)")
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient norm clip")
    value_coef: float = Field(0.5, ge=0.0, description="weight of the value-head loss (ppo_gae)")
    value_clip: float | None = Field(0.2, gt=0.0, description="PPO value clipping around the sampling-time "
                                     "values (ppo_gae); null = none")
    processes: int = Field(
        1, ge=1, json_schema_extra={STAGE_VERSION: EXECUTION_ONLY},
        description="processes of the data-parallel update (torchrun + accelerate: gloo on CPUs, NCCL on GPUs); "
        "the same steps as one process, up to float summation order")
    train_on_continuations: bool = Field(
        False, json_schema_extra={STAGE_VERSION: VERSIONED_WHEN_SET},
        description="also train on the continuations' own tokens, each segment with its TD(λ) advantage "
        "(branching methods only; the method table's preset: on for focus, off for vineppo as in its paper)"
    )

    @model_validator(mode="after")
    def _check(self) -> PPOConfig:
        problems = []
        if self.loss_agg == "constant" and self.constant_normaliser is None:
            problems.append(
                "constant_normaliser: required when loss_agg is constant; Dr.GRPO uses the maximum "
                "generated tokens per sequence (fix: set ppo.constant_normaliser)"
            )
        if self.loss_agg == "token_mean" and self.constant_normaliser is not None:
            problems.append(
                "constant_normaliser: only used with loss_agg=constant "
                "(fix: remove it or set loss_agg=constant)"
            )
        _fail_if(problems)
        return self


class FocusConfig(_Section):
    """The whole run configuration."""

    method: MethodName = "focus"
    seed: int = Field(0, description="run seed; every stage seed derives from it")
    iterations: int = Field(8, ge=1, description="training iterations")
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    acquisition: AcquisitionConfig | None = Field(default_factory=AcquisitionConfig)
    critic: CriticConfig | None = Field(default_factory=CriticConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    bootstrap: BootstrapConfig = Field(default_factory=BootstrapConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    lora: LoRAConfig | None = Field(None, json_schema_extra={STAGE_VERSION: VERSIONED_WHEN_SET},
                                    description="null: the update trains every weight")
    exact_values: bool = Field(
        False, json_schema_extra={STAGE_VERSION: VERSIONED_WHEN_SET},
        description="a diagnostic, not a method (trap environments, Markov context): the advantage stage uses the "
        "exact V^π of the sampling policy at every segment state in place of V̂, so a run shows what a perfect "
        "critic would buy; the critic is still fitted and branching is unchanged")
    exact_values_share: float = Field(
        1.0, ge=0.0, le=1.0, json_schema_extra={STAGE_VERSION: VERSIONED_WHEN_SET},
        description="with exact_values: the values are this share of V^π plus the rest of V̂, so the critic's "
        "error against V^π shrinks by that share (1: a perfect critic; 0: the fitted critic, with its error measured)")

    @model_validator(mode="before")
    @classmethod
    def _apply_method_preset(cls, data: Any) -> Any:
        """Fill the fields the user did not give from the method's row of the method table."""
        if not isinstance(data, dict):
            return data
        method = data.get("method", "focus")
        if method not in METHOD_TABLE:
            return data  # the Literal check on `method` reports it
        filled = dict(data)
        for section, preset in method_defaults(method).items():
            if section not in filled:
                filled[section] = preset
            elif isinstance(preset, dict) and isinstance(filled[section], dict):
                filled[section] = {**preset, **filled[section]}
        return filled

    @model_validator(mode="after")
    def _check_method_combination(self) -> FocusConfig:
        """Check the config against the method's row: estimator, critic, branching rule, requirements."""
        method, problems = get_method(self.method), []
        if self.advantage.estimator != method.estimator:
            others = [m.name for m in METHOD_TABLE.values() if m.estimator == self.advantage.estimator]
            problems.append(
                f"advantage.estimator: method {method.name} uses estimator {method.estimator}, got "
                f"{self.advantage.estimator} (fix: remove advantage.estimator"
                + (f", or use method={others[0]})" if others else ")")
            )
        if method.uses_critic and self.critic is None:
            problems.append(f"critic: {method.name} needs it (fix: give the section or remove the null)")
        if not method.uses_critic and self.critic is not None:
            problems.append(
                f"critic: {method.name} takes its values from {method.values}, so the critic section would be "
                f"ignored (fix: remove it or set critic=null; configs/{'vineppo' if method.uses_branches else 'grpo'}"
                f".yaml is an example)"
            )
        if method.uses_branches and self.acquisition is None:
            problems.append(f"acquisition: {method.name} branches (fix: give the section or remove the null)")
        if not method.uses_branches and self.ppo.train_on_continuations:
            problems.append(f"ppo.train_on_continuations: {method.name} does not branch, so there are no "
                            f"continuations to train on (fix: remove it or set ppo.train_on_continuations=false)")
        if not method.uses_branches and self.acquisition is not None:
            problems.append(
                f"acquisition: {method.name} does not branch, so the acquisition section would be ignored "
                f"(fix: remove it or set acquisition=null)"
            )
        if (method.strategy_fixed and self.acquisition is not None
                and self.acquisition.strategy != method.branching):
            problems.append(
                f"acquisition.strategy: {method.name} is the {method.branching} rule, got "
                f"{self.acquisition.strategy} (fix: strategy={method.branching}, or method=focus to compare "
                f"strategies)"
            )
        if method.uses_branches is False and self.budget.group_size_grpo < 2 and method.values == "group":
            problems.append(
                f"budget.group_size_grpo: {method.name} compares rollouts within a group, so a group of "
                f"{self.budget.group_size_grpo} gives no signal (fix: group_size_grpo >= 2)"
            )
        if self.generation.backend == "vllm" and self.agent.temperature != 1.0:
            problems.append(f"agent.temperature: the vllm backend records untempered log-probs and the update "
                            f"compares them at agent.temperature={self.agent.temperature} (fix: "
                            f"agent.temperature=1.0, or generation.backend=hf)")
        if self.generation.backend == "vllm" and self.generation.shards > 1:
            problems.append("generation.shards: with backend vllm the server batches every episode's requests "
                            "itself (fix: generation.shards=1, or generation.backend=hf)")
        if self.exact_values and method.values not in ("critic", "monte_carlo"):
            problems.append(f"exact_values: {method.name} takes no state values (it uses {method.values}), so there "
                            f"is nothing to replace (fix: remove it, or use method=focus or vineppo)")
        if self.critic is not None and self.critic.continuation_states and not (method.uses_critic
                                                                           and method.uses_branches):
            problems.append(f"critic.continuation_states: {method.name} fits no critic on continuations (fix: "
                            f"remove it, or use method=focus)")
        if self.exact_values_share != 1.0 and not self.exact_values:
            problems.append(f"exact_values_share: {self.exact_values_share:g} mixes V^π into the values only with "
                            f"exact_values (fix: exact_values=true, or remove exact_values_share)")
        if self.exact_values and (self.agent.compression != "observation" or self.agent.top_p != 1.0):
            problems.append("exact_values: exact values need the Markov context and the untruncated sampler "
                            "(fix: agent.compression=observation and agent.top_p=1)")
        resolved = self.model_dump()
        for path, wanted in method.requires.items():
            section, name = path.split(".")
            if (resolved.get(section) or {}).get(name) != wanted:
                problems.append(f"{path}: {method.name} needs {wanted} (fix: {path}={wanted} or remove the setting)")
        _fail_if(problems)
        return self

    @property
    def method_row(self):
        """This run's row of the method table (``focus_core.methods.Method``)."""
        return get_method(self.method)

    @property
    def uses_branches(self) -> bool:
        """Whether the method spends part of the budget on continuations (stages acquire and branch)."""
        return self.method_row.uses_branches

    @property
    def uses_critic(self) -> bool:
        """Whether the method trains the critic ensemble."""
        return self.method_row.uses_critic

    @property
    def main_group_size(self) -> int:
        """Main rollouts per prompt: G_main for branching methods, G_grpo otherwise."""
        return self.budget.group_size_main if self.uses_branches else self.budget.group_size_grpo


def version_values(cfg: FocusConfig, names: Iterable[str]) -> dict[str, Any]:
    """The resolved values of the config fields and sections ``names`` (``"ppo"``, ``"env.name"``) as a stage's
    version takes them: without the EXECUTION_ONLY fields, and without a VERSIONED_WHEN_SET field named while it
    has its default. A name inside a section that is null (``critic.members`` for GRPO) has the value None."""
    resolved, markers, picked = config_to_dict(cfg), version_markers(), {}
    for path, marker in markers.items():
        section, _, name = path.rpartition(".")
        holder = resolved.get(section) if section else resolved
        if marker == EXECUTION_ONLY and isinstance(holder, dict):
            holder.pop(name, None)
    for name in names:
        value: Any = resolved
        for key in name.split("."):
            value = value[key] if isinstance(value, dict) else None
        if markers.get(name) == VERSIONED_WHEN_SET and (value == _default_at(name) or value is None):
            continue  # None: the field's section is null (critic.prior_variance for GRPO)
        if markers.get(name) != EXECUTION_ONLY:
            picked[name] = value
    # A VERSIONED_WHEN_SET field a stage names beside its whole section is versioned by its own name alone (so only
    # when set), not also inside the section.
    for name in names:
        section, _, field = name.rpartition(".")
        if markers.get(name) == VERSIONED_WHEN_SET and isinstance(picked.get(section), dict):
            picked[section] = {key: value for key, value in picked[section].items() if key != field}
    return picked


def version_markers() -> dict[str, str]:
    """Dotted name -> STAGE_VERSION marker of every marked field (``{"ppo.processes": EXECUTION_ONLY, ...}``)."""
    found = {}
    for section, info in FocusConfig.model_fields.items():
        for name, field_info in [(section, info), *((f"{section}.{n}", f) for n, f in _fields_of(info.annotation))]:
            marker = (field_info.json_schema_extra or {}).get(STAGE_VERSION)
            if marker is not None:
                found[name] = marker
    return found


def execution_only_fields() -> frozenset[str]:
    """Dotted names of the EXECUTION_ONLY fields (``ppo.processes``)."""
    return frozenset(name for name, marker in version_markers().items() if marker == EXECUTION_ONLY)


def _fields_of(annotation: Any) -> list[tuple[str, Any]]:
    model = _section_model(annotation)
    return list(model.model_fields.items()) if model is not None else []


def _default_at(path: str) -> Any:
    """The declared default of the field at dotted ``path``, as plain data (the method presets aside)."""
    *sections, name = path.split(".")
    info = _model_at(tuple(sections)).model_fields[name]
    default = info.get_default(call_default_factory=True)
    return default.model_dump(mode="json") if isinstance(default, BaseModel) else default


# --- loading, overrides and error reporting ----------------------------------------------------------


def validate_config(data: dict[str, Any]) -> FocusConfig:
    """Build a FocusConfig from a plain dict, raising ConfigError with one line per problem."""
    try:
        return FocusConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error)) from None


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> FocusConfig:
    """Read a YAML config (None: all defaults), apply ``a.b=c`` overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = _parse_yaml(Path(path).read_text(), where=str(path))
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the top level must be a mapping of config sections, got {type(loaded).__name__}"
            )
        data = loaded
    return _overridden(data, overrides)


def with_overrides(cfg: FocusConfig, overrides: list[str] | tuple[str, ...]) -> FocusConfig:
    """``cfg`` with ``a.b=c`` overrides applied, validated again (e.g. a committed run's config, changed)."""
    return _overridden(config_to_dict(cfg), overrides)


def _overridden(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> FocusConfig:
    for override in overrides:
        _apply_override(data, override)
    return validate_config(data)


def config_to_dict(cfg: FocusConfig) -> dict[str, Any]:
    """The resolved config as plain data; ``validate_config`` of it gives the same config back."""
    return cfg.model_dump(mode="json")


def dump_config(cfg: FocusConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (for run logs and reproducibility)."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def _apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one ``a.b=c`` override in place; the value is parsed as YAML (numbers, bools, lists, null)."""
    key_path, separator, raw_value = override.partition("=")
    key_path = key_path.strip()
    if not separator or not key_path:
        raise ConfigError(f"override {override!r}: expected the form section.field=value, e.g. ppo.lr=1e-5")
    keys = key_path.split(".")
    model: type[BaseModel] = FocusConfig
    target = data
    for depth, key in enumerate(keys):
        where = ".".join(keys[:depth]) or "the top level"
        if key not in model.model_fields:
            raise ConfigError(
                f"override {override!r}: unknown key {'.'.join(keys[: depth + 1])!r}; "
                f"valid keys at {where}: {', '.join(model.model_fields)}"
            )
        if depth == len(keys) - 1:
            target[key] = _parse_yaml(raw_value, where=f"override {override!r}")
            return
        annotation = model.model_fields[key].annotation
        if _is_mapping(annotation):  # a free mapping (env.options): the rest of the path are its own keys
            if not isinstance(target.get(key), dict):
                target[key] = {}
            _set_in_mapping(target[key], keys[: depth + 1], keys[depth + 1:], raw_value, override)
            return
        section_model = _section_model(annotation)
        if section_model is None:
            raise ConfigError(
                f"override {override!r}: {'.'.join(keys[: depth + 1])!r} is a value, not a section"
            )
        if not isinstance(target.get(key), dict):
            target[key] = {}  # a missing or null section: the override creates it
        target, model = target[key], section_model


def _is_mapping(annotation: Any) -> bool:
    return annotation is dict or get_origin(annotation) is dict


def _set_in_mapping(mapping: dict[str, Any], above: list[str], keys: list[str], raw_value: str,
                    override: str) -> None:
    """Set ``keys`` (a path of free keys) in ``mapping``, creating the mappings on the way; its other keys stay."""
    for depth, key in enumerate(keys[:-1]):
        if key not in mapping or mapping[key] is None:
            mapping[key] = {}
        if not isinstance(mapping[key], dict):
            raise ConfigError(f"override {override!r}: {'.'.join(above + keys[: depth + 1])!r} is a value, "
                              f"not a mapping")
        mapping = mapping[key]
    mapping[keys[-1]] = _parse_yaml(raw_value, where=f"override {override!r}")


def _parse_yaml(text: str, *, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{where}: not valid YAML: {error}") from None


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model class of a section field (unwrapping ``X | None``), or None for a plain value."""
    candidates = get_args(annotation) if get_origin(annotation) is not None else (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _model_at(path: tuple[str, ...]) -> type[BaseModel] | None:
    """The model class that holds the fields at ``path`` (a tuple of section names)."""
    model: type[BaseModel] | None = FocusConfig
    for key in path:
        if model is None or key not in model.model_fields:
            return None
        model = _section_model(model.model_fields[key].annotation)
    return model


def _format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        loc = tuple(str(part) for part in item["loc"])
        path = ".".join(loc)
        kind = item["type"]
        if kind == "value_error":
            # Our model validators report one problem per line, relative to their own model.
            prefix = f"{path}." if path else ""
            lines.extend(f"{prefix}{problem}" for problem in str(item["ctx"]["error"]).splitlines())
        elif kind == "extra_forbidden":
            model = _model_at(loc[:-1])
            allowed = ", ".join(model.model_fields) if model else "?"
            lines.append(f"{path}: unknown field (allowed: {allowed})")
        elif kind == "literal_error":
            lines.append(f"{path}: got {item['input']!r} (allowed: {item['ctx']['expected']})")
        else:
            lines.append(f"{path}: {item['msg']} (got {item['input']!r})")
    return "invalid config:\n" + "\n".join(f"  {line}" for line in dict.fromkeys(lines))
