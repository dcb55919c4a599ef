"""Environments, and the one registry that finds them.

An environment module registers its class with ``@register_env("name")``; nothing lists the modules:
``make_env`` imports every module of this package once (they load their data lazily, so this is cheap),
and whatever registered itself is known. A new environment is one new file here.

    env = make_env("deep_search")            # a ToolEnv (the protocol is in focus_core/envs/base.py)
    environment_names()                      # every registered name, sorted
    trap = make_trap_env("combination_lock", seed=3)  # the tabular MDP behind a trap environment

The trap environments (``has_exact_values``: ``combination_lock``, ``lookup_chain``) are registered like any
other (``trap_tools``); behind each is a small text MDP of ``traps`` whose state values are exactly computable,
which ``make_trap_env`` builds from the same name.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from focus_core.envs.base import ToolEnv
    from focus_core.envs.traps import ExactValueEnv

ENVIRONMENTS: dict[str, type[ToolEnv]] = {}


def register_env(name: str) -> Callable[[type[ToolEnv]], type[ToolEnv]]:
    """Class decorator: the environment is made by ``make_env(name)`` and its ``name`` is ``name``."""
    def add(cls: type[ToolEnv]) -> type[ToolEnv]:
        if name in ENVIRONMENTS:
            raise ValueError(f"environment {name!r} is registered twice")
        cls.name = name
        ENVIRONMENTS[name] = cls
        return cls

    return add


def _import_all() -> None:
    # Importing a module runs its @register_env decorators; Python imports each module once.
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def environment_names() -> list[str]:
    """Every registered environment's name (``env.name``), sorted."""
    _import_all()
    return sorted(ENVIRONMENTS)


def make_env(name: str, **kwargs: Any) -> ToolEnv:
    """A fresh environment by its registered name; ``kwargs`` go to its constructor (``tier=...``, options)."""
    _import_all()
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENTS))}")
    return ENVIRONMENTS[name](**kwargs)


def trap_env_names() -> list[str]:
    """The registered environments with exact values (a tabular MDP behind them), sorted."""
    _import_all()
    return sorted(name for name, cls in ENVIRONMENTS.items() if cls.has_exact_values)


def make_trap_env(name: str, *, paraphrase: bool = False, **kwargs: Any) -> ExactValueEnv:
    """The tabular MDP behind a registered trap environment, e.g. ``make_trap_env("combination_lock", seed=3)``:
    ``kwargs`` go to the MDP's constructor (its own defaults, not the pipeline environment's);
    ``paraphrase=True`` wraps it in ``Paraphrased``."""
    if name not in trap_env_names():
        raise ValueError(f"unknown trap environment {name!r}; known: {', '.join(trap_env_names())}")
    # Every environment with exact values is a trap_tools.TrapToolEnv, which builds its MDP.
    return ENVIRONMENTS[name].exact_value_model(paraphrase=paraphrase, **kwargs)


__all__ = ["ENVIRONMENTS", "environment_names", "make_env", "make_trap_env", "register_env", "trap_env_names"]
