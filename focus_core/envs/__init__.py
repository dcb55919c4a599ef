"""Environments. ``traps`` holds small text MDPs with exactly computable state values."""

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

__all__ = [
    "TRAP_ENVS",
    "CombinationLock",
    "Episode",
    "ExactValueEnv",
    "LookupChain",
    "Paraphrased",
    "TabularPolicy",
    "TextSession",
    "make_trap_env",
]
