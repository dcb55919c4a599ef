"""The forms the Prefect UI shows for the train and compare deployments: typed parameters with choices.

Prefect renders a flow's pydantic parameters as a form (a ``Literal`` becomes a drop-down), validates what the
UI sends against it, and hands the flow the model. Each field of ``TrainSettings`` is one config override, so
the form can only say what ``focus train --set`` can; ``overrides`` stays for everything else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from focus_core.envs import environment_names
from focus_core.methods import METHODS

SPEC_FOLDER = Path(__file__).resolve().parents[1] / "configs" / "compare"

MethodName = Literal[tuple(METHODS)]  # type: ignore[valid-type]
EnvName = Literal[tuple(environment_names())]  # type: ignore[valid-type]
# The committed compare specs (configs/compare/*.yaml); where the package has none, only spec_path works.
SpecName = Literal[tuple(sorted(p.stem for p in SPEC_FOLDER.glob("*.yaml"))) or ("",)]  # type: ignore[valid-type]


class TrainSettings(BaseModel):
    """What a training run is: each field set here becomes an override (empty: the config's own value)."""

    model_config = ConfigDict(extra="forbid")

    method: MethodName | None = Field(None, description="the algorithm (method table in focus_core/methods.py)")
    env: EnvName | None = Field(None, description="the environment (env.name)")
    iterations: int | None = Field(None, ge=1, description="training iterations")
    seed: int | None = Field(None, ge=0, description="the run's seed (SFT, tasks, sampling)")
    tokens_per_iteration: int | None = Field(
        None, ge=1, description="B_tok, generated tokens per iteration for every method; empty: measured at bootstrap")

    def as_overrides(self) -> list[str]:
        names = {"method": "method", "env": "env.name", "iterations": "iterations", "seed": "seed",
                 "tokens_per_iteration": "budget.tokens_per_iteration"}
        return [f"{names[key]}={value}" for key, value in self.model_dump().items() if value is not None]


class CompareSettings(BaseModel):
    """Which comparison grid to run: a committed spec by name, or any spec file by path."""

    model_config = ConfigDict(extra="forbid")

    spec: SpecName | None = Field(None, description="a committed spec, configs/compare/{spec}.yaml")
    spec_path: str | None = Field(None, description="or a spec file's path (where the flow runs)")

    def path(self) -> str:
        if (self.spec is None) == (self.spec_path is None):
            raise ValueError("give the comparison either a committed spec or a spec_path, not both or neither")
        return self.spec_path or str(SPEC_FOLDER / f"{self.spec}.yaml")
