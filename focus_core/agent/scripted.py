"""Scripted actors: the environment's expert (with injected mistakes, for SFT data) and a random agent.

They write the same kind of messages a model would, tokenized with the policy's tokenizer and
ended with the chat template's end-of-message token, so their episodes are recorded exactly like
model episodes and serve directly as supervised demonstrations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from focus_core.agent.notes import summarize_notes
from focus_core.agent.toolcall import ToolCall
from focus_core.envs.base import Task, ToolEnv
from focus_core.policy.base import Generation


@dataclass
class ScriptedActor:
    """Writes the expert's message, or with probability ``mistake_rate`` a random tool call.

    ``mistake_rate=1`` is the random agent of the benchmarks. Summaries are the deterministic
    notes of the segment (the same text the ``notes`` compressor would keep).
    """

    tokenizer: Any
    end_token_id: int
    mistake_rate: float = 0.0
    seed: int = 0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.mistake_rate <= 1.0:
            raise ValueError(f"mistake_rate must be in [0, 1], got {self.mistake_rate}")
        self.rng = np.random.default_rng(self.seed)

    def respond(self, env: ToolEnv, task: Task, history: Sequence[tuple[str, str]], notes: Sequence[str],
                summarizing: bool) -> Generation:
        if summarizing:
            text = summarize_notes(notes, history)
        elif self.rng.random() < self.mistake_rate:
            text = random_action(env, task, history, self.rng)
        else:
            text = env.expert_action(task, list(history))
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.end_token_id]
        return Generation(ids, [0.0] * len(ids), "stop")


def random_action(env: ToolEnv, task: Task, history: Sequence[tuple[str, str]], rng: np.random.Generator) -> str:
    """A random tool with arguments made of random words from the task and the last observation."""
    spec = env.tools[int(rng.integers(len(env.tools)))]
    words = (task.prompt + " " + (history[-1][1] if history else "")).split() or ["x"]
    arguments: dict[str, Any] = {}
    for name, kind, _ in spec.parameters:
        if name not in spec.required and rng.random() < 0.5:
            continue
        if kind == "integer":
            arguments[name] = int(rng.integers(0, 5))
        else:
            k = int(rng.integers(1, 4))
            arguments[name] = " ".join(str(w) for w in rng.choice(words, size=k))
    return ToolCall(spec.name, arguments).render()
