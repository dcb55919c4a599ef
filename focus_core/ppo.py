"""The policy update of one iteration: token-level PPO-clip over segment sequences (method.md §2, §3.2, §9.6).

Input is one training sequence per segment (the context restarts at every compression, so a segment is exactly
what the model saw in one forward): ``token_ids``, the behaviour policy's ``old_logprobs`` and a ``loss_mask`` that
is 1 on the policy's own tokens (actions, summaries) and 0 on context, tool output and the first token; plus one
advantage per token. Only positions with mask 1 are ever read: whatever the other positions hold (garbage, NaN)
changes neither the loss nor the gradient.

Log-probabilities are untempered, log_softmax of the raw fp32 logits, the quantity every sampler stores
(``policy/base.py``) whatever temperature and top-p it sampled with: the ratio ρ = π_θ/π_old compares the model's
distributions, so tempered log-probs on one side would make ρ ≠ 1 before any step and bias every update. The
first minibatch of an update is on-policy, so ``UpdateReport.behaviour_logprob_gap`` (max |new − old| there) is a
free check of sampler/trainer agreement: ~1e-6 with the hf backend; a large gap means the stored log-probs are not
what this model computes (temperature, re-tokenisation, a bf16 sampler).

The forward keeps the model in eval mode: gradients flow the same, and the numerics are those of the sampler (a
model with dropout would otherwise make ρ ≠ 1 at step 0; the tiny Llama and SmolLM2 have none). Sequences are
right-padded with explicit positions 0..L−1 and no attention mask: under causal attention a real token never
sees the padding after it, and attention keeps its fast causal path. The vocabulary projection runs only at the
positions whose next token is trained (as in ``agent/sft.py``), so the [tokens, vocab] logits are not built for the
context and tool tokens, most of a transcript.

The minibatch unit is the segment, not the episode. Each epoch shuffles (seeded) and packs segments of similar
length into minibatches of at most ``batch_tokens`` padded tokens (a longer one gets a minibatch of its own), so
every minibatch holds about the same number of tokens; one optimizer step per minibatch. Loss, per step:

    loss = ppo_clip(ρ, A) + kl_coef · k3 KL(π_θ ‖ π_ref) − entropy_coef · entropy

* ``token_mean`` (default): the clipped surrogate summed over the minibatch's policy tokens / their number.
* ``constant`` (Dr.GRPO): summed / (C · n̄) with n̄ the mean number of sequences per minibatch of the epoch, so
  every token of the iteration has the same weight 1/(C·n̄) whatever its sequence's length or minibatch; dividing
  by each minibatch's own sequence count would give the tokens of long-sequence minibatches more weight.
* KL and entropy are token means over the minibatch in both modes; their coefficients set their scale.

AdamW at ``config.lr`` with no weight decay (zero advantages must leave the weights where they are) and a constant
rate within the call. A fresh optimizer starts every call unless ``optimizer_state`` (from the previous
iteration's ``UpdateReport.optimizer_state``) is passed: Adam's first steps are sign-like (every weight moves by
≈ lr), so carrying the moment estimates across iterations gives steadier steps; the caller decides whether to
checkpoint them. A non-finite loss or gradient raises ``FloatingPointError`` naming the step and the cause before
that step is applied; the model then holds the weights of the last good step and should not be saved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from focus_core.config import PPOConfig
from focus_core.losses import entropy_from_logits, kl_k3, ppo_clip_loss

# Stored log-probabilities above this are not log-probabilities (a probability, or a sign error).
_MAX_LOGPROB = 1e-3


class SequenceLike(Protocol):
    """Any object with these 1-D arrays of equal length, e.g. ``rollouts.SegmentSequence``."""

    token_ids: Any
    old_logprobs: Any
    loss_mask: Any


@dataclass(frozen=True, eq=False)
class TrainingSequence:
    """One training sequence: token ids, behaviour log-probs (0 where mask=0), loss mask (1 = trained)."""

    token_ids: np.ndarray
    old_logprobs: np.ndarray
    loss_mask: np.ndarray


@dataclass(frozen=True)
class UpdateReport:
    """What one ``policy_update`` did. ``rows`` are the ``updates`` table rows minus run_id/iteration/version."""

    rows: list[dict[str, float | int]]
    sequences: int  # sequences trained (those without a trained token are skipped)
    tokens: int  # tokens fed per epoch, padding excluded
    policy_tokens: int  # trained tokens per epoch
    kl: float  # mean over steps of the k3 KL to the reference (0 without a reference model)
    clip_fraction: float  # mean over steps
    entropy: float  # mean over steps
    approx_kl: float  # mean over steps of k3 KL(π_old ‖ π_θ), each measured before its step
    behaviour_logprob_gap: float  # max |new − old| log-prob on the first minibatch (on-policy there)
    seconds: float
    optimizer_state: dict = field(repr=False)  # AdamW state; pass it to the next call to continue the moments


@dataclass
class _Minibatch:
    inputs: torch.Tensor  # [rows, width] token ids fed (each sequence without its last token), right-padded
    targets: torch.Tensor  # [rows, width] the token each position predicts
    mask: torch.Tensor  # [rows, width] bool, True where the target is trained
    old: torch.Tensor  # [rows, width] float32 behaviour log-probs of the targets
    advantages: torch.Tensor  # [rows, width] float32


def policy_update(
    model: torch.nn.Module,
    sequences: Sequence[SequenceLike],
    advantages: Sequence[Any],
    config: PPOConfig,
    *,
    reference_model: torch.nn.Module | None = None,
    batch_tokens: int = 8192,
    seed: int = 0,
    optimizer_state: dict | None = None,
    progress: Callable[[dict[str, float | int]], None] | None = None,
) -> UpdateReport:
    """``config.epochs`` passes of PPO-clip over ``sequences`` with per-token ``advantages``; updates ``model``
    in place (a Hugging Face causal LM) and returns the per-step rows and summary figures.

    ``reference_model`` (frozen, never updated) is needed when ``config.kl_coef > 0``; given with kl_coef 0, the
    KL is only measured. ``progress`` is called with each step's row. Inputs are checked before any step: a
    non-finite advantage or old log-prob at a trained position raises ``ValueError``.
    """
    if config.kl_coef > 0 and reference_model is None:
        raise ValueError(f"policy_update: kl_coef={config.kl_coef} needs a reference_model (or set ppo.kl_coef=0)")
    if batch_tokens < 1:
        raise ValueError(f"policy_update: batch_tokens={batch_tokens} must be >= 1")
    data = _checked_arrays(sequences, advantages, model)
    if not data:
        raise ValueError("policy_update: no sequence has a trained token (loss_mask = 1)")
    lengths = np.array([len(ids) - 1 for ids, *_ in data])  # tokens fed: the last one is only predicted
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
        for group in optimizer.param_groups:  # the state carries the old run's rate; this call's config wins
            group.update(lr=config.lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    if reference_model is not None:
        reference_model.eval()
    rows: list[dict[str, float | int]] = []
    approx_kls: list[float] = []
    gap = 0.0
    started = time.perf_counter()
    try:
        for epoch in range(config.epochs):
            batches = _pack(lengths, batch_tokens, rng)
            mean_rows = len(data) / len(batches)  # n̄ of the constant normaliser
            for indices in batches:
                step = len(rows)
                where = f"epoch {epoch}, step {step}"
                batch = _collate([data[i] for i in indices], device)
                # Dr.GRPO: C · rows → C · n̄, the same normaliser for every minibatch.
                scale = len(indices) / mean_rows if config.loss_agg == "constant" else 1.0
                loss, parts, new = _minibatch_loss(model, reference_model, batch, config, scale, where)
                if step == 0:
                    gap = (new - batch.old)[batch.mask].abs().max().item()

                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
                _check_finite(grad_norm, "gradient norm", where, lambda: "the backward pass produced inf/NaN")
                optimizer.step()

                with torch.no_grad():
                    approx_kls.append(kl_k3(batch.old, new, batch.mask).item())
                row = {"epoch": epoch, "step": step, "loss": loss.item(), **parts}
                row.update(grad_norm=grad_norm.item(), lr=config.lr)
                rows.append(row)
                if progress:
                    progress(row)
    finally:
        model.train(was_training)
    return UpdateReport(
        rows=rows,
        sequences=len(data),
        tokens=int(sum(len(ids) for ids, *_ in data)),
        policy_tokens=int(sum(mask.sum() for _, _, mask, _ in data)),
        kl=float(np.mean([r["kl"] for r in rows])),
        clip_fraction=float(np.mean([r["clip_fraction"] for r in rows])),
        entropy=float(np.mean([r["entropy"] for r in rows])),
        approx_kl=float(np.mean(approx_kls)),
        behaviour_logprob_gap=gap,
        seconds=time.perf_counter() - started,
        optimizer_state=optimizer.state_dict(),
    )


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, sequences: Sequence[SequenceLike], *, batch_tokens: int = 8192
) -> list[np.ndarray]:
    """The model's untempered log-probs of each sequence's trained tokens (0 elsewhere), batched as in
    ``policy_update``: what a reference model, or a re-score of another backend's samples, needs."""
    data = [(np.asarray(s.token_ids, dtype=np.int64), np.asarray(s.loss_mask) == 1) for s in sequences]
    device = next(model.parameters()).device
    out = [np.zeros(len(ids), dtype=np.float32) for ids, _ in data]
    lengths = np.array([max(len(ids) - 1, 0) for ids, _ in data])
    todo = [i for i, (ids, mask) in enumerate(data) if len(ids) > 1 and mask[1:].any()]
    for indices in _pack(lengths[todo], batch_tokens, None):
        chosen = [todo[i] for i in indices]
        batch = _collate(
            [(data[i][0], np.zeros(len(data[i][0])), data[i][1], np.zeros(len(data[i][0]))) for i in chosen], device
        )
        new = _gather_logprobs(_trained_logits(model, batch), batch).cpu().numpy()
        for row, i in enumerate(chosen):
            out[i][1:] = new[row, : len(data[i][0]) - 1]
    return out


# ---------------------------------------------------------------------- internals


def _checked_arrays(
    sequences: Sequence[SequenceLike], advantages: Sequence[Any], model: torch.nn.Module
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(ids, old log-probs, mask as bool, advantages) per sequence with a trained token; raises on bad input."""
    if len(sequences) != len(advantages):
        raise ValueError(f"policy_update: {len(sequences)} sequences but {len(advantages)} advantage arrays")
    vocab = model.get_output_embeddings().weight.shape[0]
    max_positions = getattr(model.config, "max_position_embeddings", None)
    for attribute in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, attribute, None) not in (None, 1.0):
            raise NotImplementedError(
                f"policy_update: models with {attribute} are not supported (the log-probs "
                "are computed from the decoder's hidden states and the output embedding)"
            )
    data = []
    for i, (sequence, advantage) in enumerate(zip(sequences, advantages, strict=True)):
        ids = np.asarray(sequence.token_ids, dtype=np.int64)
        old = np.asarray(sequence.old_logprobs, dtype=np.float32)
        raw_mask = np.asarray(sequence.loss_mask)
        adv = np.asarray(advantage, dtype=np.float32)
        if not ids.ndim == old.ndim == raw_mask.ndim == adv.ndim == 1 or not (
            len(ids) == len(old) == len(raw_mask) == len(adv)
        ):
            raise ValueError(
                f"sequence {i}: token_ids, old_logprobs, loss_mask and advantages must be 1-D of one "
                f"length, got shapes {ids.shape}, {old.shape}, {raw_mask.shape}, {adv.shape}"
            )
        if not np.isin(raw_mask, (0, 1)).all():
            raise ValueError(f"sequence {i}: loss_mask must hold only 0 and 1")
        mask = raw_mask == 1
        if len(mask) and mask[0]:
            raise ValueError(f"sequence {i}: loss_mask[0] is 1, but the first token has nothing to condition on")
        for name, values in (("advantages", adv), ("old_logprobs", old)):
            bad = np.flatnonzero(mask & ~np.isfinite(values))
            if len(bad):
                raise ValueError(
                    f"sequence {i}: {name} are not finite at trained positions {bad[:5].tolist()} "
                    f"(values {values[bad[:5]].tolist()}); no step was taken"
                )
        if (old[mask] > _MAX_LOGPROB).any():
            raise ValueError(f"sequence {i}: old_logprobs above 0 at trained positions; expected log-probabilities")
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"sequence {i}: token ids outside the model's vocabulary [0, {vocab})")
        if max_positions is not None and len(ids) > max_positions:
            raise ValueError(f"sequence {i}: {len(ids)} tokens exceed the model's {max_positions} positions")
        if mask.any():  # untrained positions are zeroed here, so nothing downstream can read what they held
            data.append((ids, np.where(mask, old, 0.0), mask, np.where(mask, adv, 0.0)))
    return data


def _pack(lengths: np.ndarray, batch_tokens: int, rng: np.random.Generator | None) -> list[list[int]]:
    """Minibatches of indices: sorted by length (ties in random order), each at most ``batch_tokens`` padded
    tokens unless a single sequence is longer; returned in random order. ``rng=None``: deterministic."""
    order = np.arange(len(lengths)) if rng is None else rng.permutation(len(lengths))
    order = order[np.argsort(lengths[order], kind="stable")]
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order.tolist():
        # Sorted ascending, so this sequence is the longest of the minibatch: its length sets the padded width.
        if current and int(lengths[index]) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(index)
    batches.append(current)
    return batches if rng is None else [batches[i] for i in rng.permutation(len(batches))]


def _collate(items: Sequence[tuple[np.ndarray, ...]], device: torch.device) -> _Minibatch:
    """Right-padded tensors, shifted by one: position t feeds token t and predicts token t + 1."""
    width = max(len(ids) for ids, *_ in items) - 1
    arrays = {
        name: np.zeros((len(items), width), dtype=dtype)
        for name, dtype in (
            ("inputs", np.int64),
            ("targets", np.int64),
            ("mask", bool),
            ("old", np.float32),
            ("advantages", np.float32),
        )
    }
    for row, (ids, old, mask, adv) in enumerate(items):
        n = len(ids) - 1
        arrays["inputs"][row, :n] = ids[:-1]
        arrays["targets"][row, :n] = ids[1:]
        arrays["mask"][row, :n] = mask[1:]
        arrays["old"][row, :n] = old[1:]
        arrays["advantages"][row, :n] = adv[1:]
    return _Minibatch(**{name: torch.from_numpy(value).to(device) for name, value in arrays.items()})


def _minibatch_loss(
    model: torch.nn.Module,
    reference_model: torch.nn.Module | None,
    batch: _Minibatch,
    config: PPOConfig,
    scale: float,
    where: str,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """(loss, its logged parts, detached new log-probs [rows, width]) of one minibatch."""
    logits = _trained_logits(model, batch)
    new = _gather_logprobs(logits, batch)
    _check_finite(
        new[batch.mask],
        "new log-probabilities",
        where,
        lambda: "the model's logits are not finite; its weights diverged (lower ppo.lr)",
    )
    policy_loss, stats = ppo_clip_loss(
        new,
        batch.old,
        batch.advantages,
        batch.mask,
        clip_eps=config.clip_eps,
        clip_eps_high=config.clip_eps_high,
        agg=config.loss_agg,
        constant_normaliser=config.constant_normaliser,
    )
    policy_loss = policy_loss * scale
    _check_finite(
        policy_loss,
        "policy loss",
        where,
        lambda: (
            f"the ratio exp(new − old) overflowed (max new − old = {(new - batch.old)[batch.mask].max().item():.3g}): "
            "the policy moved too far from the behaviour policy (lower ppo.lr), or old_logprobs are not this model's"
        ),
    )
    kl = torch.zeros((), device=new.device)
    if reference_model is not None:
        with torch.no_grad():
            reference = _gather_logprobs(_trained_logits(reference_model, batch), batch)
        kl = kl_k3(new, reference, batch.mask)
    with torch.set_grad_enabled(config.entropy_coef > 0):  # logged either way; a graph only when trained
        entropy = entropy_from_logits(logits[None], torch.ones(logits.shape[:1], device=logits.device)[None])
    loss = policy_loss + config.kl_coef * kl - config.entropy_coef * entropy
    _check_finite(loss, "loss", where, lambda: "the KL or entropy term is not finite")
    parts = {
        "policy_loss": policy_loss.item(),
        "kl": kl.item(),
        "clip_fraction": stats["clip_fraction"],
        "entropy": entropy.item(),
    }
    return loss, parts, new.detach()


def _trained_logits(model: torch.nn.Module, batch: _Minibatch) -> torch.Tensor:
    """fp32 logits [trained tokens, vocab] at the positions whose target is trained, in row-major order."""
    positions = torch.arange(batch.inputs.shape[1], device=batch.inputs.device).expand_as(batch.inputs)
    hidden = model.get_decoder()(input_ids=batch.inputs, position_ids=positions, use_cache=False).last_hidden_state
    return model.get_output_embeddings()(hidden[batch.mask]).float()


def _gather_logprobs(logits: torch.Tensor, batch: _Minibatch) -> torch.Tensor:
    """log_softmax(logits) of the trained targets, scattered back to [rows, width] with 0 elsewhere."""
    picked = torch.log_softmax(logits, dim=-1).gather(1, batch.targets[batch.mask][:, None])[:, 0]
    return torch.zeros(batch.mask.shape, dtype=picked.dtype, device=picked.device).masked_scatter(batch.mask, picked)


def _check_finite(value: torch.Tensor, what: str, where: str, cause: Callable[[], str]) -> None:
    """Raise before the step is applied; ``cause`` is only worked out on failure."""
    if not bool(torch.isfinite(value).all()):
        raise FloatingPointError(
            f"policy_update: non-finite {what} at {where}: {cause()}. This step was not applied, the earlier ones "
            "were: do not save the model"
        )
