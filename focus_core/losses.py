"""Policy-update losses on per-token tensors: PPO clipped surrogate, k3 KL to a reference, entropy.

Every function takes a ``mask`` of the same shape as its per-token inputs: nonzero marks a policy-generated
token that is trained; zero marks an environment/tool/context token or padding. Masked positions contribute
nothing, to the value or to the gradient, whatever they hold (NaN, 1e9, -inf): inputs are replaced with 0
by ``torch.where`` *before* any non-linear operation, because ``where`` after e.g. ``exp`` still sends NaN
gradients back through the unselected branch (0 · inf = NaN).

Shapes: ``[sequences, tokens]`` for logprobs, advantages and masks; ``[sequences, tokens, vocab]`` for
logits. Computations run in float32 or wider, whatever the input dtype.
"""

from __future__ import annotations

from typing import Literal

import torch

LossAggregation = Literal["token_mean", "constant"]


def _check_same_shape(**tensors: torch.Tensor) -> None:
    names = list(tensors)
    reference = names[0]
    for name in names[1:]:
        if tensors[name].shape != tensors[reference].shape:
            raise ValueError(
                f"shape mismatch: {reference} has shape {tuple(tensors[reference].shape)} but {name} has "
                f"shape {tuple(tensors[name].shape)}; all per-token tensors must be [sequences, tokens]"
            )


def _as_float(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is nonzero (0 when the mask is empty)."""
    _check_same_shape(values=values, mask=mask)
    keep = mask != 0
    total = torch.where(keep, values, torch.zeros_like(values)).sum()
    return total / keep.sum().clamp(min=1)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    clip_ratio_c: float | None = None,
    agg: LossAggregation = "token_mean",
    constant_normaliser: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate loss, L = −Σ min(ρ·A, clip(ρ, 1−ε, 1+ε_high)·A) / normaliser.

    ρ = exp(logprobs − old_logprobs) per token. ``clip_eps_high`` (clip-higher) defaults to ``clip_eps``.
    ``clip_ratio_c`` (dual-clip, Ye et al. 2020; verl's ``clip_ratio_c``) bounds the loss of a token with A < 0 by
    −c·A: the plain surrogate grows without bound in ρ there (clipping only stops ρ from *improving* the objective),
    so one token whose ratio ran away can dominate a minibatch's gradient. Such a token then gets no gradient.
    Aggregation over the masked per-token terms:

    * ``token_mean``: divide by the number of policy tokens in the batch;
    * ``constant``: divide by ``constant_normaliser × sequences`` (Dr.GRPO, method.md §3.2), so a
      sequence's weight does not depend on its length.

    Returns the loss and detached statistics: ``clip_fraction`` (share of policy tokens where the clipped
    or the dual-clip term is the active one), ``approx_kl`` (mean of old − new logprob) and ``ratio_mean``.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    if logprobs.dim() != 2:
        raise ValueError(f"expected [sequences, tokens] tensors, got shape {tuple(logprobs.shape)}")
    if clip_eps <= 0 or (clip_eps_high is not None and clip_eps_high <= 0):
        raise ValueError(f"clip_eps and clip_eps_high must be > 0, got {clip_eps}, {clip_eps_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip bounds ratios above it), got {clip_ratio_c}")
    keep = mask != 0
    zeros = torch.zeros_like(_as_float(logprobs))
    log_ratio = torch.where(keep, _as_float(logprobs) - _as_float(old_logprobs), zeros)
    advantage = torch.where(keep, _as_float(advantages), zeros)

    ratio = torch.exp(log_ratio)
    upper = 1.0 + (clip_eps if clip_eps_high is None else clip_eps_high)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1.0 - clip_eps, upper) * advantage
    surrogate = torch.minimum(unclipped, clipped)
    if clip_ratio_c is not None:  # dual-clip: for A < 0 the objective is at least c·A
        dual = clip_ratio_c * advantage
        surrogate = torch.where(advantage < 0, torch.maximum(surrogate, dual), surrogate)
        clipped_active = (clipped < unclipped) | ((advantage < 0) & (dual > unclipped))
    else:
        clipped_active = clipped < unclipped
    per_token_loss = torch.where(keep, -surrogate, zeros)

    if agg == "token_mean":
        normaliser = keep.sum().clamp(min=1)
    elif agg == "constant":
        if constant_normaliser is None or constant_normaliser <= 0:
            raise ValueError(f"agg='constant' needs constant_normaliser > 0, got {constant_normaliser}")
        normaliser = constant_normaliser * logprobs.shape[0]
    else:
        raise ValueError(f"unknown loss aggregation {agg!r}; allowed: token_mean, constant")
    loss = per_token_loss.sum() / normaliser

    with torch.no_grad():
        stats = {
            "clip_fraction": masked_mean(clipped_active.to(zeros.dtype), keep).item(),
            "approx_kl": masked_mean(-log_ratio, keep).item(),
            "ratio_mean": masked_mean(ratio, keep).item(),
        }
    return loss, stats


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean of the k3 estimator of KL(π_θ ‖ π_ref): exp(r) − r − 1 with r = ref − logp, ≥ 0.

    Written as expm1(r) − r, which stays non-negative in floating point where exp(r) − 1 − r can round
    below zero for tiny r.
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    keep = mask != 0
    log_ratio = _as_float(ref_logprobs) - _as_float(logprobs)
    log_ratio = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
    per_token = (torch.expm1(log_ratio) - log_ratio).clamp(min=0.0)
    return masked_mean(per_token, keep)


def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean over tokens of the entropy of softmax(logits) over the last (vocabulary) axis.

    Vocabulary entries with logit −inf (banned tokens) have probability 0 and contribute 0.
    """
    if logits.shape[:-1] != mask.shape:
        raise ValueError(
            f"shape mismatch: logits has shape {tuple(logits.shape)} but mask has shape {tuple(mask.shape)}; "
            f"expected logits [sequences, tokens, vocab] and mask [sequences, tokens]"
        )
    keep = mask != 0
    logits = _as_float(logits)
    logits = torch.where(keep.unsqueeze(-1), logits, torch.zeros_like(logits))
    log_probs = torch.log_softmax(logits, dim=-1)
    # p·log p is 0·(−inf) for banned tokens; use log p = 0 there so value and gradient stay finite.
    finite_log_probs = torch.where(torch.isfinite(log_probs), log_probs, torch.zeros_like(log_probs))
    entropy = -(log_probs.exp() * finite_log_probs).sum(dim=-1)
    return masked_mean(entropy, keep)
