"""Run configuration: defaults, presets, YAML + overrides, and errors that name the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from focus_core.config import (
    METHODS,
    AcquisitionConfig,
    BudgetConfig,
    ConfigError,
    FocusConfig,
    config_to_dict,
    dump_config,
    load_config,
    method_defaults,
    validate_config,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def write_yaml(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# --- defaults and files -------------------------------------------------------------------------------


def test_defaults_load_as_focus_with_method_md_values():
    cfg = load_config(None)
    assert cfg.method == "focus"
    assert cfg.advantage.estimator == "segment_td_lambda"
    assert (cfg.advantage.gamma, cfg.advantage.lam) == (1.0, 0.9)
    assert cfg.acquisition.strategy == "novelty"
    acquisition = cfg.acquisition
    assert (acquisition.eps_uniform, acquisition.chunk_size, acquisition.max_per_state) == (0.2, 2, 8)
    assert (acquisition.vine_k, acquisition.rounds) == (9, 2)
    assert (cfg.critic.folds, cfg.critic.replay_iterations) == (4, 0)
    assert cfg.critic.members == 5 and cfg.critic.lr == 3e-3 and cfg.critic.prior_precision == 15.0
    assert (cfg.ppo.clip_eps, cfg.ppo.epochs, cfg.ppo.loss_agg) == (0.2, 2, "token_mean")
    assert cfg.uses_branches and cfg.uses_critic and cfg.main_group_size == 4


def test_default_yaml_equals_the_built_in_defaults():
    assert load_config(CONFIGS / "default.yaml") == FocusConfig()


@pytest.mark.parametrize("method", ["grpo", "vineppo"])
def test_method_yaml_equals_the_method_preset(method):
    assert load_config(CONFIGS / f"{method}.yaml") == validate_config({"method": method})


def test_shipped_configs_share_one_budget_so_comparisons_are_matched():
    budgets = {name: load_config(CONFIGS / f"{name}.yaml").budget for name in ("default", "grpo", "vineppo")}
    assert len({budget.model_dump_json() for budget in budgets.values()}) == 1


# --- budget -------------------------------------------------------------------------------------------


def test_the_budget_is_measured_unless_given():
    budget = BudgetConfig()
    assert budget.tokens_per_iteration is None and budget.measure_episodes == 64
    assert (budget.prompts_per_iteration, budget.group_size_grpo, budget.group_size_main) == (16, 8, 4)
    assert BudgetConfig(tokens_per_iteration=10_000).tokens_per_iteration == 10_000


def test_tokens_per_iteration_is_the_measured_mean_times_p_times_g_grpo():
    """T11 with a measured L̄: P = 2, L̄ = 5,000, G_grpo = 8 -> B_tok = 80,000, unless given explicitly."""
    from focus_core.artifacts import Manifest
    from tasks.bootstrap import tokens_per_iteration

    bootstrap = Manifest(run_id="r", iteration=0, stage="bootstrap", version="v",
                         figures={"mean_episode_tokens": 5000.0})
    cfg = load_config(None, ["budget.prompts_per_iteration=2"])
    assert tokens_per_iteration(cfg, bootstrap) == 80_000
    assert tokens_per_iteration(load_config(None, ["budget.tokens_per_iteration=1234"]), bootstrap) == 1234


# --- YAML and overrides -------------------------------------------------------------------------------


def test_yaml_and_overrides_apply_in_order(tmp_path):
    path = write_yaml(tmp_path, {"seed": 7, "advantage": {"lam": 0.5}, "ppo": {"lr": 3e-4}})
    cfg = load_config(
        path,
        [
            "advantage.lam=0.8",
            "ppo.lr=1e-5",
            "advantage.whiten=false",
            "budget.group_size_main=2",
            "acquisition.strategy=neyman",
            "ppo.clip_eps_high=0.28",
        ],
    )
    assert cfg.seed == 7
    assert cfg.advantage.lam == 0.8
    assert cfg.ppo.lr == 1e-5
    assert cfg.advantage.whiten is False
    assert cfg.budget.group_size_main == 2
    assert cfg.acquisition.strategy == "neyman"
    assert cfg.ppo.clip_eps_high == 0.28


def test_override_can_set_a_section_to_null_and_switch_method(tmp_path):
    cfg = load_config(CONFIGS / "default.yaml", ["method=grpo", "acquisition=null", "critic=null"])
    assert cfg.method == "grpo" and cfg.acquisition is None and cfg.critic is None
    assert cfg.advantage.estimator == "grpo" and cfg.main_group_size == 8


def test_override_creates_a_section_missing_from_the_file(tmp_path):
    path = write_yaml(tmp_path, {"method": "grpo"})
    cfg = load_config(path, ["method=focus", "acquisition.rounds=4"])
    assert cfg.acquisition.rounds == 4 and cfg.acquisition.strategy == "novelty"


def test_override_without_equals_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"override 'ppo.lr': expected the form section.field=value"):
        load_config(None, ["ppo.lr"])


def test_override_with_unknown_key_names_it_and_the_valid_keys():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["budget.prompts=4"])
    message = str(error.value)
    assert "unknown key 'budget.prompts'" in message
    assert "valid keys at budget: prompts_per_iteration, group_size_grpo" in message


def test_override_with_unknown_top_level_key():
    expected = r"unknown key 'optimizer'.*valid keys at the top level: method, seed"
    with pytest.raises(ConfigError, match=expected):
        load_config(None, ["optimizer.lr=1"])


def test_override_into_a_value_is_rejected():
    with pytest.raises(ConfigError, match=r"'seed' is a value, not a section"):
        load_config(None, ["seed.x=1"])


def test_override_reaches_into_a_mapping_field_keeping_its_other_keys():
    # env.options is a free mapping (an environment's constructor arguments): one key of it is set, the file's
    # other keys stay, and a key the file lacks is added (the environment, not the schema, checks its names).
    cfg = load_config(CONFIGS / "combination_lock.yaml", ["env.options.horizon=12", "env.options.delay=3"])
    assert cfg.env.options["horizon"] == 12 and cfg.env.options["delay"] == 3
    assert cfg.env.options["n_symbols"] == 3 and cfg.env.options["train_tasks"] == 512
    cfg = load_config(None, ["env.options.corpus.path=/data/x"])
    assert cfg.env.options == {"corpus": {"path": "/data/x"}}
    with pytest.raises(ConfigError, match=r"'env.options.horizon' is a value, not a mapping"):
        load_config(CONFIGS / "combination_lock.yaml", ["env.options.horizon.x=1"])


def test_override_value_is_parsed_as_yaml_and_bad_yaml_is_reported():
    cfg = load_config(None, ["ppo.constant_normaliser=4096", "ppo.loss_agg=constant", "ppo.clip_eps_high=.3"])
    assert cfg.ppo.constant_normaliser == 4096 and cfg.ppo.clip_eps_high == 0.3
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(None, ["ppo.lr=[1,"])


def test_unknown_key_in_yaml_names_the_field_and_allowed_keys(tmp_path):
    path = write_yaml(tmp_path, {"critic": {"memebrs": 3}})
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert "critic.memebrs: unknown field (allowed: members, hidden, steps" in str(error.value)


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path)


def test_literal_errors_list_the_allowed_values():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["acquisition.strategy=ivr", "advantage.trace_mode=tokens"])
    message = str(error.value)
    assert "acquisition.strategy: got 'ivr' (allowed: 'uniform_all', 'uniform_random'" in message
    assert "'neyman', 'entropy', 'oracle', 'residual_knn', 'beta_posterior' or 'novelty')" in message
    assert "advantage.trace_mode: got 'tokens' (allowed: 'segment' or 'token_length')" in message


def test_unknown_method_lists_methods():
    with pytest.raises(ConfigError, match=r"method: got 'ppo' \(allowed: 'focus', 'vineppo', 'grpo'"):
        load_config(None, ["method=ppo"])


def test_range_errors_name_the_field_and_value():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["advantage.gamma=0", "advantage.lam=1.5", "critic.members=1"])
    message = str(error.value)
    assert "advantage.gamma: Input should be greater than 0 (got 0)" in message
    assert "advantage.lam: Input should be less than or equal to 1 (got 1.5)" in message
    assert "critic.members: Input should be greater than or equal to 2 (got 1)" in message


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# --- fail-fast combinations ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["method=grpo", "acquisition.strategy=ivr_greedy"],
            r"acquisition: grpo does not branch.*set acquisition=null",
        ),
        (["method=rloo", "critic.members=3"], r"critic: rloo takes its values from group"),
        (
            ["method=vineppo", "critic=null", "acquisition.strategy=ivr_greedy"],
            r"acquisition.strategy: vineppo is the uniform_all rule, got ivr_greedy.*strategy=uniform_all",
        ),
        (["method=vineppo", "critic={}"], r"critic: vineppo takes its values from monte_carlo"),
        (
            ["method=dr_grpo", "ppo.loss_agg=token_mean", "ppo.constant_normaliser=null"],
            r"ppo.loss_agg: dr_grpo needs constant",
        ),
        (
            ["acquisition.strategy=oracle"],
            r"acquisition.strategy: oracle needs true state values.*benchmark_only",
        ),
        (["ppo.loss_agg=constant"], r"ppo.constant_normaliser: required when loss_agg is constant"),
        (["ppo.constant_normaliser=512"], r"ppo.constant_normaliser: only used with loss_agg=constant"),
        (["budget.group_size_main=9"], r"budget.group_size_main: 9 > group_size_grpo 8"),
        (["budget.tokens_per_iteration=0"], r"budget.tokens_per_iteration: Input should be greater than or equal to 1"),
        (["acquisition.max_per_state=1"], r"acquisition.max_per_state: 1 < chunk_size 2"),
        (["advantage.trace_mode=token_length"], r"advantage.lambda_token_halflife: required"),
        (["advantage.lambda_token_halflife=2000"], r"advantage.lambda_token_halflife: only used with"),
        (
            ["advantage.estimator=gae"],
            r"advantage.estimator: method focus uses estimator segment_td_lambda, got gae.*method=ppo_gae",
        ),
        (["acquisition=null"], r"acquisition: focus branches"),
        (
            ["method=grpo", "ppo.train_on_continuations=true"],
            r"^invalid config:\n  ppo.train_on_continuations: grpo does not branch, so there are no continuations "
            r"to train on \(fix: remove it or set ppo.train_on_continuations=false\)$",
        ),
        (
            ["method=ppo_gae", "acquisition={}", "critic={}"],
            r"critic: ppo_gae takes its values from value_head.*\n.*acquisition: ppo_gae does not branch",
        ),
        (
            ["method=grpo", "budget.group_size_grpo=1", "budget.group_size_main=1"],
            r"budget.group_size_grpo: grpo compares rollouts within a group",
        ),
        (
            ["method=grpo", "acquisition=null", "critic=null", "exact_values=true"],
            r"exact_values: grpo takes no state values.*method=focus or vineppo",
        ),
        (["exact_values=true"], r"exact_values: exact values need the Markov context.*agent.compression=observation"),
        (["method=focus_nobranch", "acquisition=null", "critic.continuation_states=true"],
         r"critic.continuation_states: focus_nobranch fits no critic on continuations \(fix: remove it, or use "
         r"method=focus\)"),
        (["exact_values_share=0.5"], r"exact_values_share: 0.5 mixes V\^π into the values only with exact_values "
                                     r"\(fix: exact_values=true"),
    ],
)
def test_unsupported_combinations_fail_fast_with_reason_and_fix(overrides, expected):
    with pytest.raises(ConfigError, match=expected) as error:
        load_config(None, overrides)
    assert "fix:" in str(error.value) or "Input should" in str(error.value)


def test_switching_method_on_the_default_file_points_to_the_method_file():
    with pytest.raises(ConfigError, match=r"critic=null; configs/grpo.yaml is an example"):
        load_config(CONFIGS / "default.yaml", ["method=grpo"])


def test_oracle_is_allowed_in_benchmarks():
    cfg = load_config(None, ["acquisition.strategy=oracle", "acquisition.benchmark_only=true"])
    assert cfg.acquisition.strategy == "oracle"


def test_sections_reject_unknown_fields_when_built_in_python():
    with pytest.raises(ValueError, match="extra"):
        AcquisitionConfig(stratgy="neyman")


# --- presets ------------------------------------------------------------------------------------------


def test_every_method_has_a_preset():
    assert set(METHODS) == {"focus", "vineppo", "grpo", "dr_grpo", "rloo", "ppo_gae", "focus_nobranch"}
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        method_defaults("ppo")


def test_the_configs_allowed_names_are_the_registries_keys():
    """One method table: the config's Literals list exactly what the registries hold."""
    from typing import get_args

    from focus_core.acquisition import STRATEGIES
    from focus_core.advantages import ADVANTAGE_ESTIMATORS
    from focus_core.config import EstimatorName, MethodName, StrategyName
    from focus_core.methods import METHOD_TABLE

    assert set(get_args(MethodName)) == set(METHOD_TABLE)
    assert set(get_args(EstimatorName)) == set(ADVANTAGE_ESTIMATORS)
    assert set(get_args(StrategyName)) == set(STRATEGIES)
    assert {m.estimator for m in METHOD_TABLE.values()} <= set(ADVANTAGE_ESTIMATORS)
    assert {m.branching for m in METHOD_TABLE.values()} - {None} <= set(STRATEGIES)


def test_readme_method_table_is_the_registrys():
    from focus_core.methods import method_table_markdown

    readme = (CONFIGS.parent / "docs" / "pipeline.md").read_text()  # the pipeline page holds the method table
    assert method_table_markdown() in readme, "regenerate it: python -c 'from focus_core.methods import *; " \
        "print(method_table_markdown())'"


@pytest.mark.parametrize(
    ("method", "extra", "estimator", "strategy", "has_critic", "whiten", "group"),
    [
        ("focus", [], "segment_td_lambda", "novelty", True, True, 4),
        ("vineppo", [], "vineppo", "uniform_all", False, True, 4),
        ("grpo", [], "grpo", None, False, False, 8),
        ("dr_grpo", ["ppo.constant_normaliser=4096"], "dr_grpo", None, False, False, 8),
        ("rloo", [], "rloo", None, False, False, 8),
        ("ppo_gae", [], "gae", None, False, True, 8),
        ("focus_nobranch", [], "segment_td_lambda", None, True, True, 8),
    ],
)
def test_method_presets(method, extra, estimator, strategy, has_critic, whiten, group):
    cfg = load_config(None, [f"method={method}", *extra])
    assert cfg.advantage.estimator == estimator
    assert (cfg.acquisition.strategy if cfg.acquisition else None) == strategy
    assert cfg.uses_critic is has_critic
    assert cfg.advantage.whiten is whiten
    assert cfg.main_group_size == group
    assert cfg.uses_branches is (strategy is not None)


def test_dr_grpo_preset_uses_the_constant_normaliser():
    cfg = load_config(None, ["method=dr_grpo", "ppo.constant_normaliser=4096"])
    assert cfg.ppo.loss_agg == "constant"


def test_vineppo_preset_spreads_its_budget_in_one_round():
    assert load_config(None, ["method=vineppo"]).acquisition.rounds == 1


@pytest.mark.parametrize("method", METHODS)
def test_continuations_train_by_default_for_focus_only(method):
    """FOCUS trains on every token it generates; VinePPO uses its continuations for values only, as in its paper;
    a method that does not branch has nothing to train on, and refuses the setting (the fail-fast list above)."""
    cfg = validate_config({"method": method})
    assert cfg.ppo.train_on_continuations is (method == "focus")
    if cfg.uses_branches:  # a knob for the branching methods, either way
        flipped = load_config(None, [f"method={method}", f"ppo.train_on_continuations={method != 'focus'}"])
        assert flipped.ppo.train_on_continuations is (method != "focus")


def test_explicit_fields_win_over_the_preset():
    cfg = load_config(None, ["method=grpo", "advantage.whiten=true", "advantage.grpo_std=population"])
    assert cfg.advantage.whiten is True and cfg.advantage.grpo_std == "population"


def test_preset_fills_only_missing_fields_of_a_given_section():
    cfg = validate_config({"method": "vineppo", "acquisition": {"vine_k": 4}})
    assert cfg.acquisition.strategy == "uniform_all" and cfg.acquisition.vine_k == 4


def test_method_defaults_returns_a_copy():
    method_defaults("focus")["advantage"]["estimator"] = "gae"
    assert method_defaults("focus")["advantage"]["estimator"] == "segment_td_lambda"


# --- resolved config logging --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["focus", "vineppo", "grpo", "rloo", "ppo_gae"])
def test_dump_and_reload_round_trips(tmp_path, method):
    cfg = load_config(None, [f"method={method}", "seed=11", "advantage.lam=0.5"])
    path = tmp_path / "resolved.yaml"
    dump_config(cfg, path)
    assert load_config(path) == cfg
    assert validate_config(config_to_dict(cfg)) == cfg


def test_config_to_dict_is_plain_data():
    data = config_to_dict(load_config(None, ["method=grpo"]))
    assert data["acquisition"] is None and data["critic"] is None
    assert yaml.safe_load(yaml.safe_dump(data)) == data


@pytest.mark.parametrize(("overrides", "problem"), [
    (["generation.backend=vllm", "agent.temperature=0.7"], "agent.temperature: the vllm backend records untempered"),
    (["generation.backend=vllm", "generation.shards=2"], "generation.shards: with backend vllm the server batches"),
    (["generation.runner=ray"], "generation.runner"),
    (["lora.rank=0"], "lora.rank"),
])
def test_generation_and_lora_settings_that_cannot_work_fail_in_one_line(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        load_config(None, overrides)


def test_exact_values_enter_the_advantage_stages_version_only_when_set():
    """A field added after runs were committed: at its default it leaves every committed stage's version as it was."""
    from tasks.advantage import READS
    from tasks.stage import RunContext

    markov = ["agent.compression=observation"]
    off, on = (RunContext(None, "r", load_config(None, [*markov, *extra])) for extra in ([], ["exact_values=true"]))
    assert "exact_values" not in off.fields(*READS) and on.fields(*READS)["exact_values"] is True
    assert {k: v for k, v in on.fields(*READS).items() if k != "exact_values"} == off.fields(*READS)
    # Its share, added later still: at its default 1 (the perfect critic) the committed exact_values runs keep theirs.
    half = RunContext(None, "r", load_config(None, [*markov, "exact_values=true", "exact_values_share=0.5"]))
    assert "exact_values_share" not in on.fields(*READS) and half.fields(*READS)["exact_values_share"] == 0.5
    assert {k: v for k, v in half.fields(*READS).items() if k != "exact_values_share"} == on.fields(*READS)


def test_dual_clip_and_target_kl_enter_the_updates_version_only_when_set():
    """Added after runs were committed: unset, the update stage's version is what it was before (the whole ppo
    section is in it, so the stage names them beside it); set, each is in it by its own name."""
    from tasks.stage import RunContext
    from tasks.update import READS

    plain = RunContext(None, "r", load_config(None, [])).fields(*READS)
    assert "clip_ratio_c" not in plain["ppo"] and "target_kl" not in plain["ppo"]
    assert "ppo.clip_ratio_c" not in plain and "ppo.target_kl" not in plain
    guarded = RunContext(None, "r", load_config(None, ["ppo.clip_ratio_c=3", "ppo.target_kl=0.1"])).fields(*READS)
    assert guarded["ppo.clip_ratio_c"] == 3.0 and guarded["ppo.target_kl"] == 0.1
    assert {k: v for k, v in guarded.items() if not k.startswith("ppo.")} == plain
    for bad, problem in (("ppo.clip_ratio_c=1", "clip_ratio_c"), ("ppo.target_kl=0", "target_kl")):
        with pytest.raises(ConfigError, match=problem):
            load_config(None, [bad])


def test_critic_prior_variance_enters_fit_critics_version_only_when_set():
    from tasks.fit_critic import READS
    from tasks.stage import RunContext

    for method in ([], ["method=grpo", "acquisition=null", "critic=null"]):
        fields = RunContext(None, "r", load_config(None, method)).fields(*READS)
        assert "critic.prior_variance" not in fields
        assert fields["critic"] is None or "prior_variance" not in fields["critic"]
    on = RunContext(None, "r", load_config(None, ["critic.prior_variance=calibrated"])).fields(*READS)
    assert on["critic.prior_variance"] == "calibrated" and "prior_variance" not in on["critic"]


def test_the_variance_floor_fit_critic_applies_is_in_its_version():
    # Regression: fit_critic floors the out-of-fold variance at acquisition.jitter but did not name it in READS,
    # so a run resumed with another floor reused the values the old floor had combined.
    from tasks.fit_critic import READS
    from tasks.stage import RunContext

    low, high = (RunContext(None, "r", load_config(None, [f"acquisition.jitter={j}"])).fields(*READS)
                 for j in (1e-4, 1e-2))
    assert low != high
    assert "critic" in RunContext(None, "r", load_config(None, ["method=grpo", "acquisition=null", "critic=null"])
                                  ).fields(*READS)
