"""The policy interface the agent harness and the stages call, whatever the backend (``hf`` here, ``vllm`` later).

Sampled log-probabilities (``Generation.logprobs``, stored in the rollouts) are those of the distribution sampled
from, ``log_softmax(raw logits / temperature)`` in fp32, without top-p truncation (greedy, temperature 0, keeps the
untempered ones). The PPO ratio compares them with the trainer's recomputation at the same temperature
(``ppo.policy_update(..., temperature=T)``), so both sides must be the same quantity; top-p is left out on both
sides because the trainer cannot follow a nucleus that moves with the weights (as in verl). ``score`` returns the
log-probs at its ``temperature`` (default 1: untempered), equal to the sampled ones at that temperature. A
backend that can only report other log-probabilities (untempered, or top-p truncated) must convert or re-score
before it hands them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from transformers import PreTrainedTokenizerBase

FinishReason = Literal["stop", "length"]


@dataclass
class Generation:
    """One sampled continuation of a prompt.

    ``logprobs[i]`` is the fp32 log-probability of ``token_ids[i]`` at the sampling temperature T,
    log_softmax(raw logits / T) with no top-p (untempered for T = 0): equal, within 1e-4, to
    ``ppo.sequence_logprobs(..., temperature=T)``, and at T = 1 to what ``Policy.score`` returns.
    ``finish_reason`` is ``"stop"`` when the last token is a stop token (it is included in ``token_ids``) and
    ``"length"`` when ``max_new_tokens`` or the model's context ran out first.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


@runtime_checkable
class Policy(Protocol):
    """A causal LM that samples continuations of token-id prompts and scores given continuations."""

    tokenizer: PreTrainedTokenizerBase  # a fast tokenizer with a chat template (system/user/assistant/tool)
    max_context: int  # prompt + generated tokens never exceed this
    version: int  # the checkpoint's policy version (0 for a fresh model); bumped by ``load_weights``

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """The tokens that end an assistant turn (used when ``generate`` gets ``stop_token_ids=None``)."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: set[int] | None = None,
        seed: int | Sequence[int] = 0,
        first_sample: Sequence[int] | None = None,
    ) -> list[list[Generation]]:
        """``n`` samples per prompt: ``result[i][j]`` is sample ``j`` of ``prompts[i]``.

        ``temperature=0`` is greedy decoding. ``stop_token_ids=None`` means ``self.stop_token_ids``; pass an
        empty set to disable stopping. A generation ends at its first stop token, which it includes.
        Deterministic for a seed: sample ``j`` of prompt ``i`` draws its randomness from ``(seed, i, j)``, or from
        ``(seed[i], first_sample[i] + j)`` when ``seed`` is one integer per prompt (``first_sample`` default 0),
        so it does not depend on the other prompts in the batch (up to float rounding of the batched forward),
        and samples 2 and 3 of a seed can be drawn apart from samples 0 and 1.
        """
        ...

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], *, temperature: float = 1.0
              ) -> list[float]:
        """Teacher-forced fp32 log-probabilities of ``completion_ids`` after ``prompt_ids`` (one per token), at
        ``temperature``: log_softmax(logits / T), what sampling at T reports."""
        ...

    def load_weights(self, path: str | Path, version: int | None = None) -> None:
        """Load a checkpoint folder written by ``save`` (same architecture) and set ``version``."""
        ...

    def save(self, path: str | Path) -> None:
        """Write model, tokenizer and version to a Hugging Face folder (safetensors)."""
        ...


def check_sampling_arguments(prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, temperature: float,
                             top_p: float, max_context: int) -> None:
    """The argument checks every backend's ``generate`` makes, with the same messages."""
    if not prompts:
        raise ValueError("generate: no prompts")
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"generate: n={n} and max_new_tokens={max_new_tokens} must both be >= 1")
    if temperature < 0:
        raise ValueError(f"generate: temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"generate: top_p={top_p} must be in (0, 1]")
    for i, prompt in enumerate(prompts):
        if not 0 < len(prompt) < max_context:
            raise ValueError(
                f"generate: prompt {i} has {len(prompt)} tokens; it needs 1 to {max_context - 1} "
                f"(max_context={max_context} leaves room for at least one new token)"
            )


def check_seeds(seed: int | Sequence[int], first_sample: Sequence[int] | None, prompts: int) -> list[int]:
    """``first_sample`` per prompt (zeros when None), after checking ``seed`` and it against the prompt count."""
    if not isinstance(seed, int) and len(seed) != prompts:
        raise ValueError(f"seed: got {len(seed)} seeds for {prompts} prompts; pass one int or one per prompt")
    if first_sample is None:
        return [0] * prompts
    if isinstance(seed, int):
        raise ValueError("first_sample: only with one seed per prompt (seed=[...])")
    if len(first_sample) != prompts or min(first_sample, default=0) < 0:
        raise ValueError(f"first_sample: got {list(first_sample)[:8]} for {prompts} prompts; give one index >= 0 each")
    return [int(first) for first in first_sample]
