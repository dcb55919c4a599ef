"""The Prefect UI's forms (flows/forms.py): typed parameters with choices, each field one config override."""

from __future__ import annotations

import pytest
from prefect.utilities.callables import parameter_schema
from pydantic import ValidationError

from flows.compare import compare
from flows.forms import SPEC_FOLDER, CompareSettings, TrainSettings
from flows.train import train
from focus_core.config import load_config
from focus_core.envs import environment_names
from focus_core.methods import METHODS


def test_each_field_of_the_train_form_is_the_override_of_that_setting():
    settings = TrainSettings(method="grpo", env="legal", iterations=3, seed=7, tokens_per_iteration=5000)
    cfg = load_config(None, settings.as_overrides())
    assert (cfg.method, cfg.env.name, cfg.iterations, cfg.seed, cfg.budget.tokens_per_iteration) == (
        "grpo", "legal", 3, 7, 5000)
    assert TrainSettings().as_overrides() == []  # an empty form: the config as it is


def test_the_form_offers_exactly_the_registered_methods_and_environments_and_refuses_others():
    schema = parameter_schema(train).model_dump()
    assert list(schema["properties"])[:2] == ["settings", "config_path"]
    fields = schema["definitions"]["TrainSettings"]["properties"]
    assert fields["method"]["anyOf"][0]["enum"] == list(METHODS)
    assert fields["env"]["anyOf"][0]["enum"] == environment_names()
    with pytest.raises(ValidationError, match="method"):
        TrainSettings(method="ppo_magic")
    with pytest.raises(ValidationError, match="iterations"):
        TrainSettings(iterations=0)


def test_the_compare_form_names_the_committed_specs():
    fields = parameter_schema(compare).model_dump()["definitions"]["CompareSettings"]["properties"]
    assert fields["spec"]["anyOf"][0]["enum"] == sorted(p.stem for p in SPEC_FOLDER.glob("*.yaml"))
    assert CompareSettings(spec="traps").path() == str(SPEC_FOLDER / "traps.yaml")
    assert CompareSettings(spec_path="my.yaml").path() == "my.yaml"
    for both_or_neither in (CompareSettings(), CompareSettings(spec="traps", spec_path="my.yaml")):
        with pytest.raises(ValueError, match="either a committed spec or a spec_path"):
            both_or_neither.path()
