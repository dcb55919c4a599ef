"""One progress bar per generating stage: episodes finished, and while they are being generated, the turn, the
tokens and the tokens per second (``focus_core.agent.harness.RunProgress``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from tqdm.auto import tqdm

from focus_core.agent.harness import RunProgress


class GenerationBar:
    """``with GenerationBar("it 0 rollouts", total) as bar: runner.run(..., progress=bar.callback())``; several
    ``run`` calls (rollout waves) add up on one bar."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "episode") -> None:
        self.bar = tqdm(total=total, desc=desc, unit=unit, leave=False)
        self.started = time.perf_counter()
        self.finished = self.tokens = 0

    def __enter__(self) -> GenerationBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    def callback(self) -> Callable[[RunProgress], None]:
        """The ``progress`` of one ``AgentRunner.run`` call, counted on top of the calls before it."""
        finished_before, tokens_before = self.finished, self.tokens

        def update(progress: RunProgress) -> None:
            self.finished, self.tokens = finished_before + progress.finished, tokens_before + progress.tokens
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"turn {progress.steps}, {self.tokens:,} tokens, {rate:,.0f} tok/s", refresh=False)
            self.bar.update(self.finished - self.bar.n)  # redraws, postfix included
            self.bar.refresh()

        return update
