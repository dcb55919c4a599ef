"""Environments, and the one registry that finds them.

An environment module registers its class with ``@register_env("name")``; nothing lists the modules:
``make_env`` imports every module of this package once (they load their data lazily, so this is cheap),
and whatever registered itself is known. A new environment is one new file here.

    env = make_env("deep_search")            # a ToolEnv (the protocol is in focus_core/envs/base.py)
    environment_names()                      # every registered name, sorted

``traps`` holds small text MDPs with exactly computable state values; ``trap_tools`` puts them behind
the same ``ToolEnv`` protocol as the pipeline environments ``combination_lock`` and ``lookup_chain``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from focus_core.envs.traps import (
    TRAP_ENVS,
    CombinationLock,
    Episode,
    ExactValueEnv,
    LookupChain,
    Paraphrased,
    TabularPolicy,
    TextSession,
    make_trap_env,
)

if TYPE_CHECKING:
    from focus_core.envs.base import ToolEnv

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


__all__ = [
    "ENVIRONMENTS",
    "TRAP_ENVS",
    "CombinationLock",
    "Episode",
    "ExactValueEnv",
    "LookupChain",
    "Paraphrased",
    "TabularPolicy",
    "TextSession",
    "environment_names",
    "make_env",
    "make_trap_env",
    "register_env",
]
