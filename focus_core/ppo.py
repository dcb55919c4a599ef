"""The policy update of one iteration: token-level PPO-clip over segment sequences (method.md §2, §3.2, §9.6).

Input is one training sequence per segment (the context restarts at every compression, so a segment is exactly
what the model saw in one forward): ``token_ids``, the behaviour policy's ``old_logprobs`` and a ``loss_mask`` that
is 1 on the policy's own tokens (actions, summaries) and 0 on context, tool output and the first token; plus one
advantage per token. Only positions with mask 1 are ever read: whatever the other positions hold (garbage, NaN)
changes neither the loss nor the gradient.

Log-probabilities are those of the distribution the sampler drew from: log_softmax(logits / T) of the raw fp32
logits at the sampling temperature T (``temperature``), which is what the hf sampler stores (``policy/base.py``).
The ratio ρ = π_θ/π_old must compare one quantity on both sides: untempered log-probs here against tempered ones
in the rollouts (or the reverse) make ρ ≠ 1 before any step and bias every update (at T = 0.7 the tests' tiny
model starts 0.18 nats off instead of 5e-7). The KL to the reference and the entropy are taken at the same
temperature, since they are about the policy that acts. Top-p is not applied, on either side (as in verl): the
nucleus is a sampling-time truncation whose support moves with θ, so a stored token outside the new nucleus would
get log-prob −inf. What that leaves out is one factor per state, the ratio of the old and the new nucleus's
mass: 1 at the first step, and near 1 for top_p near 1. Greedy (T = 0) rollouts are not a distribution and cannot
be trained (``temperature`` must be > 0). The first minibatch of an update is on-policy, so
``UpdateReport.behaviour_logprob_gap`` (max |new − old| there) is a free check of sampler/trainer agreement: ~1e-6
with the hf backend at any temperature; a large gap means the stored log-probs are not what this model computes
at this temperature (another temperature, re-tokenisation, a bf16 sampler).

The forward keeps the model in eval mode: gradients flow the same, and the numerics are those of the sampler (a
model with dropout would otherwise make ρ ≠ 1 at step 0; the tiny Llama and SmolLM2 have none). Sequences are
right-padded with explicit positions 0..L−1 and no attention mask: under causal attention a real token never
sees the padding after it, and attention keeps its fast causal path. The vocabulary projection runs only at the
positions whose next token is trained (as in ``agent/sft.py``), so the [tokens, vocab] logits are not built for the
context and tool tokens, most of a transcript.

The minibatch unit is the segment, not the episode. Each epoch shuffles (seeded) and packs segments of similar
length into minibatches of at most ``batch_tokens`` padded tokens (a longer one gets a minibatch of its own), so
every minibatch holds about the same number of tokens; one optimizer step per minibatch. Loss, per step:

    loss = ppo_clip(ρ, A) + kl_coef · k3 KL(π_θ ‖ π_ref) − entropy_coef · entropy [+ value_coef · value_loss]

* ``token_mean`` (default): the clipped surrogate summed over the minibatch's policy tokens / their number.
* ``constant`` (Dr.GRPO): summed / (C · n̄) with n̄ the mean number of sequences per minibatch of the epoch, so
  every token of the iteration has the same weight 1/(C·n̄) whatever its sequence's length or minibatch; dividing
  by each minibatch's own sequence count would give the tokens of long-sequence minibatches more weight.
* KL and entropy are token means over the minibatch in both modes; their coefficients set their scale.

The value term exists only when a ``value_head`` (``focus_core.value_head``: PPO with token-level GAE) is passed:
0.5 · mean over the minibatch's trained tokens of (V − R)², V the head on the same final hidden states the logits
are taken from (the state each trained token is generated in), R the caller's ``value_returns``. With
``old_values`` (V at sampling time) and ``value_clip`` it is PPO's clipped variant, the max of (V − R)² and
(V_old + clip(V − V_old, ±value_clip) − R)²: a value may not gain by moving further than value_clip from its
sampling-time estimate in one update. The head's parameters join the same AdamW, and the value gradient flows into
the shared decoder as in TRL's causal LM with value head. Mind Adam there: its steps are normalised per weight, so
where the policy gradient is small (advantages near 0) the value term alone moves decoder weights by up to ≈ lr per
step, however small value_coef is; only value_coef = 0 leaves the policy untouched. Without a head nothing of this
runs, and the update is exactly the one above.

AdamW at ``config.lr`` with no weight decay (zero advantages must leave the weights where they are) and a constant
rate within the call. A fresh optimizer starts every call unless ``optimizer_state`` (from the previous
iteration's ``UpdateReport.optimizer_state``) is passed: Adam's first steps are sign-like (every weight moves by
≈ lr), so carrying the moment estimates across iterations gives steadier steps. For the same reason a minibatch with
no gradient at all (every advantage 0, no KL, entropy or value term) takes no step: the carried momentum would move
every weight without evidence (its ``updates`` row says grad_norm 0). The state is continued in place
(its tensors become the new optimizer's when device and dtype match), so pass a state once; the report's is the one
to carry on. It belongs to one list of parameters, the model's then the head's: a state from a call without a head
does not load into a call with one. ``save_optimizer_state`` / ``load_optimizer_state`` checkpoint it without
pickles (safetensors + JSON), exactly: a run resumed from them takes the same steps, bit for bit, as one that kept
the state in memory. A non-finite loss or gradient raises ``FloatingPointError`` naming the step and the cause
before that step is applied; the model then holds the weights of the last good step and should not be saved.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from focus_core.config import PPOConfig
from focus_core.losses import entropy_from_logits, kl_k3, ppo_clip_loss

if TYPE_CHECKING:  # value_head builds on this module's batching, so it cannot be imported at run time
    from focus_core.value_head import ValueHead

# Stored log-probabilities above this are not log-probabilities (a probability, or a sign error).
_MAX_LOGPROB = 1e-3
# An optimizer checkpoint: the tensors, and everything else (hyper-parameters, the key structure) as JSON.
OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_JSON = "optimizer.json"
_OPTIMIZER_FORMAT = 1


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
    kls_before: list[float]  # that KL per row
    kl_stop_step: int | None  # the row whose KL exceeded ppo.target_kl; it and every later minibatch took no step
    behaviour_logprob_gap: float  # max |new − old| log-prob on the first minibatch (on-policy there)
    value_loss: float | None  # mean over steps of the value loss; None without a value head
    seconds: float
    optimizer_state: dict = field(repr=False)  # AdamW state; pass it to the next call to continue the moments


@dataclass
class _Minibatch:
    inputs: torch.Tensor  # [rows, width] token ids fed (each sequence without its last token), right-padded
    targets: torch.Tensor  # [rows, width] the token each position predicts
    mask: torch.Tensor  # [rows, width] bool, True where the target is trained
    old: torch.Tensor  # [rows, width] float32 behaviour log-probs of the targets
    advantages: torch.Tensor  # [rows, width] float32
    returns: torch.Tensor | None = None  # [rows, width] float32 value targets of the targets (value head only)
    old_values: torch.Tensor | None = None  # [rows, width] float32 sampling-time values (value clipping only)


@dataclass(frozen=True)
class DataParallel:
    """This process's part of a data-parallel ``policy_update`` (e.g. under ``accelerate launch`` or ``torchrun``).

    Every process holds all the sequences and packs the same minibatches (same seed); each computes the loss of
    its rows, ``rank::world``, weighted by its share of the minibatch's trained tokens (or, for the constant
    normaliser, of its sequences), so that the processes' losses add up to the single-process loss. Gradients are
    summed over the processes before clipping, so every process takes the same step: the update equals the
    single-process one up to float summation order. ``all_reduce(tensor, op)`` reduces in place over the
    processes, ``op`` "sum" or "max" (``accelerate``'s ``Accelerator.reduce``, or ``torch.distributed``).
    ``close()`` waits for every process and ends the process group; call it before the process exits (a gloo
    group still alive at exit aborts the process: "terminate called without an active exception").
    """

    rank: int
    world: int
    all_reduce: Callable[[torch.Tensor, str], None]
    close: Callable[[], None] = lambda: None


def accelerate_data_parallel() -> DataParallel | None:
    """This process's ``DataParallel`` when it runs under ``accelerate launch`` (or ``torchrun``) with more than one
    process — gloo on CPUs, NCCL on GPUs, as accelerate sets it up — else None (one process: the plain update)."""
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available())
    if state.num_processes == 1:
        return None
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def close() -> None:
        dist.barrier()
        dist.destroy_process_group()

    return DataParallel(state.process_index, state.num_processes, lambda tensor, op: dist.all_reduce(tensor, ops[op]),
                        close)


def policy_update(
    model: torch.nn.Module,
    sequences: Sequence[SequenceLike],
    advantages: Sequence[Any],
    config: PPOConfig,
    *,
    reference_model: torch.nn.Module | None = None,
    batch_tokens: int = 8192,
    seed: int = 0,
    temperature: float = 1.0,
    optimizer_state: dict | None = None,
    value_head: ValueHead | None = None,
    value_returns: Sequence[np.ndarray] | None = None,
    old_values: Sequence[np.ndarray] | None = None,
    value_coef: float = 0.5,
    value_clip: float | None = 0.2,
    progress: Callable[[dict[str, float | int]], None] | None = None,
    data_parallel: DataParallel | None = None,
) -> UpdateReport:
    """``config.epochs`` passes of PPO-clip over ``sequences`` with per-token ``advantages``; updates ``model``
    in place (a Hugging Face causal LM) and returns the per-step rows and summary figures.

    ``temperature`` is the one the sequences were sampled at: log-probs, KL and entropy are those of
    log_softmax(logits / temperature) (see the module doc). ``reference_model`` (frozen, never updated) is needed
    when ``config.kl_coef > 0``; given with kl_coef 0, the KL is only measured. ``value_head`` trains a value head
    jointly (updated in place, moved to the model's device) on ``value_returns``, with PPO value clipping against
    ``old_values`` when both they and ``value_clip`` are given; each row then has a ``value_loss``. ``progress``
    is called with each step's row. With ``config.target_kl`` the update stops at the first minibatch whose KL to
    the sampling policy, measured before its step, exceeds it: that minibatch has a row but takes no step
    (``UpdateReport.kl_stop_step``). ``data_parallel`` splits each minibatch over processes (``DataParallel``).
    Inputs are checked before any step: a non-finite advantage, old log-prob, return or old value at a trained
    position raises ``ValueError``.
    """
    if config.kl_coef > 0 and reference_model is None:
        raise ValueError(f"policy_update: kl_coef={config.kl_coef} needs a reference_model (or set ppo.kl_coef=0)")
    if batch_tokens < 1:
        raise ValueError(f"policy_update: batch_tokens={batch_tokens} must be >= 1")
    _check_temperature(temperature, "policy_update")
    _check_value_arguments(value_head, value_returns, old_values, value_coef, value_clip)
    data, value_data = _checked_arrays(sequences, advantages, model, value_returns, old_values)
    if not data:
        raise ValueError("policy_update: no sequence has a trained token (loss_mask = 1)")
    lengths = np.array([len(ids) - 1 for ids, *_ in data])  # tokens fed: the last one is only predicted
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    if value_head is not None:
        value_head.to(device)
        params += [p for p in value_head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
        for group in optimizer.param_groups:  # the state carries the old run's rate; this call's config wins
            group.update(lr=config.lr, weight_decay=0.0)
    rng = np.random.default_rng(seed)
    was_training = model.training
    model.eval()
    if reference_model is not None:
        reference_model.eval()
    value = None if value_head is None else _ValueTerm(value_head, value_coef, value_clip)
    rows: list[dict[str, float | int]] = []
    approx_kls: list[float] = []
    stopped_at: int | None = None
    gap = 0.0
    started = time.perf_counter()
    trained = np.array([int(mask[1:].sum()) for _, _, mask, _ in data])  # trained tokens per sequence
    try:
        for epoch in range(config.epochs):
            batches = _pack(lengths, batch_tokens, rng)
            mean_rows = len(data) / len(batches)  # n̄ of the constant normaliser
            for indices in batches:
                step = len(rows)
                where = f"epoch {epoch}, step {step}"
                # Dr.GRPO: C · rows → C · n̄, the same normaliser for every minibatch.
                scale = len(indices) / mean_rows if config.loss_agg == "constant" else 1.0
                mine = indices if data_parallel is None else indices[data_parallel.rank::data_parallel.world]
                token_weight = float(trained[mine].sum() / trained[indices].sum())
                row_weight = len(mine) / len(indices) if config.loss_agg == "constant" else token_weight
                optimizer.zero_grad(set_to_none=True)
                new = None
                if len(mine):
                    batch = _collate([data[i] for i in mine], device)
                    if value is not None:
                        returns, old = zip(*(value_data[i] for i in mine), strict=True)
                        batch.returns = _collate_targets(returns, device)
                        batch.old_values = None if old_values is None else _collate_targets(old, device)
                    loss, parts, new = _minibatch_loss(model, reference_model, batch, config, scale * row_weight,
                                                       token_weight, where, temperature, value)
                    loss.backward()
                else:  # more processes than the minibatch has sequences: this one adds nothing, but reduces
                    parts = dict.fromkeys(("policy_loss", "kl", "clip_fraction", "entropy"), 0.0)
                    parts |= {"value_loss": 0.0} if value is not None else {}
                    loss = torch.zeros(())
                gap_now, kl_before = 0.0, 0.0  # the on-policy gap (first step) and the KL before the step
                if new is not None:
                    with torch.no_grad():
                        gap_now = (new - batch.old)[batch.mask].abs().max().item() if step == 0 else 0.0
                        kl_before = kl_k3(batch.old, new, batch.mask).item() * token_weight
                figures = {"loss": loss.item(), **parts, "kl_before": kl_before}
                if data_parallel is not None:
                    figures, gap_now = _reduce_over_processes(data_parallel, params, figures, gap_now)
                if step == 0:
                    gap = gap_now
                grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
                _check_finite(grad_norm, "gradient norm", where, lambda: "the backward pass produced inf/NaN")
                kl_before = figures.pop("kl_before")
                # ppo.target_kl: the policy already left the trust region on this minibatch (reduced over the
                # processes, so all of them stop together); no step on it or on any later one.
                if config.target_kl is not None and kl_before > config.target_kl:
                    stopped_at = step
                # No gradient, no step (a minibatch whose every advantage is 0, with no KL, entropy or value term):
                # AdamW would still move every weight by the momentum of earlier batches, a step without evidence.
                # Measured: a GRPO iteration whose every group failed moved the policy to approx KL 0.11 that way.
                elif grad_norm.item() > 0.0:
                    optimizer.step()

                approx_kls.append(kl_before)
                row = {"epoch": epoch, "step": step, **figures}
                row.update(grad_norm=grad_norm.item(), lr=config.lr)
                rows.append(row)
                if progress:
                    progress(row)
                if stopped_at is not None:
                    break
            if stopped_at is not None:
                break
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
        kls_before=approx_kls,
        kl_stop_step=stopped_at,
        behaviour_logprob_gap=gap,
        value_loss=None if value is None else float(np.mean([r["value_loss"] for r in rows])),
        seconds=time.perf_counter() - started,
        optimizer_state=optimizer.state_dict(),
    )


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[SequenceLike],
    *,
    batch_tokens: int = 8192,
    temperature: float = 1.0,
) -> list[np.ndarray]:
    """The model's log-probs, log_softmax(logits / temperature), of each sequence's trained tokens (0 elsewhere),
    batched as in ``policy_update``: what a reference model, or a re-score of another backend's samples, needs.
    The default temperature 1 gives the untempered log-probs that ``Policy.score`` returns."""
    _check_temperature(temperature, "sequence_logprobs")
    return teacher_forced(
        model,
        sequences,
        batch_tokens,
        lambda batch: _gather_logprobs(_trained_logits(model, batch, temperature), batch),
    )


def save_optimizer_state(state: dict, folder: Path) -> None:
    """Write an optimizer ``state_dict()`` (``UpdateReport.optimizer_state``) to ``folder`` without pickles.

    Tensors (moments, and step counts where they are tensors) go to ``optimizer.safetensors`` as they are, dtype
    included, so a resumed run is bit-identical; everything else, the key structure with them, to
    ``optimizer.json``: parameter-index keys, tuples (``betas``) and floats survive the round trip exactly, which
    plain JSON would not give (string keys, lists). Raises ``TypeError`` on a value that is neither a tensor nor
    plain data.
    """
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(state, (), tensors)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / OPTIMIZER_TENSORS)
    (folder / OPTIMIZER_JSON).write_text(json.dumps({"format": _OPTIMIZER_FORMAT, "state_dict": structure}))


def load_optimizer_state(folder: Path) -> dict | None:
    """The state ``save_optimizer_state`` wrote to ``folder`` (tensors on the CPU; ``load_state_dict`` moves them
    to the parameters' device), or None when the folder has no optimizer files: a run that starts fresh."""
    folder = Path(folder)
    present = [(folder / name).exists() for name in (OPTIMIZER_JSON, OPTIMIZER_TENSORS)]
    if not any(present):
        return None
    if not all(present):
        missing = OPTIMIZER_TENSORS if present[0] else OPTIMIZER_JSON
        raise FileNotFoundError(f"load_optimizer_state: {folder} has one optimizer file but not {missing}")
    saved = json.loads((folder / OPTIMIZER_JSON).read_text())
    if saved.get("format") != _OPTIMIZER_FORMAT:
        raise ValueError(f"load_optimizer_state: {folder / OPTIMIZER_JSON} has format {saved.get('format')!r}, "
                         f"expected {_OPTIMIZER_FORMAT}")
    tensors = load_file(folder / OPTIMIZER_TENSORS)
    used: set[str] = set()
    state = _decode(saved["state_dict"], tensors, used)
    if used != set(tensors):
        raise ValueError(f"load_optimizer_state: {folder} holds tensors the JSON does not name: "
                         f"{sorted(set(tensors) - used)[:5]}")
    return state


# ---------------------------------------------------------------------- internals


@dataclass(frozen=True)
class _ValueTerm:
    """The value head and the settings of its loss, for one ``policy_update``."""

    head: ValueHead
    coef: float
    clip: float | None


def _check_temperature(temperature: float, caller: str) -> None:
    if not temperature > 0:
        raise ValueError(
            f"{caller}: temperature={temperature} must be > 0: pass the temperature the sequences were sampled at "
            "(greedy samples have no distribution to take a ratio of)"
        )


def _check_value_arguments(
    value_head: ValueHead | None,
    value_returns: Sequence[Any] | None,
    old_values: Sequence[Any] | None,
    value_coef: float,
    value_clip: float | None,
) -> None:
    if value_head is None and (value_returns is not None or old_values is not None):
        raise ValueError("policy_update: value_returns / old_values were given without a value_head")
    if value_head is not None and value_returns is None:
        raise ValueError("policy_update: a value_head needs value_returns (its per-token regression targets)")
    if not value_coef >= 0:
        raise ValueError(f"policy_update: value_coef={value_coef} must be >= 0")
    if value_clip is not None and not value_clip > 0:
        raise ValueError(f"policy_update: value_clip={value_clip} must be > 0 (None: no clipping)")


def _checked_arrays(
    sequences: Sequence[SequenceLike],
    advantages: Sequence[Any],
    model: torch.nn.Module,
    value_returns: Sequence[Any] | None = None,
    old_values: Sequence[Any] | None = None,
) -> tuple[list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]], list[tuple[np.ndarray, np.ndarray]]]:
    """(ids, old log-probs, mask as bool, advantages) per sequence with a trained token, and for the same sequences
    (returns, old values) when ``value_returns`` is given (old values 0 when not); raises on bad input."""
    per_token = {"advantages": advantages, "value_returns": value_returns, "old_values": old_values}
    for name, arrays in per_token.items():
        if arrays is not None and len(arrays) != len(sequences):
            raise ValueError(f"policy_update: {len(sequences)} sequences but {len(arrays)} {name} arrays")
    vocab = model.get_output_embeddings().weight.shape[0]
    max_positions = getattr(model.config, "max_position_embeddings", None)
    for attribute in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, attribute, None) not in (None, 1.0):
            raise NotImplementedError(
                f"policy_update: models with {attribute} are not supported (the log-probs "
                "are computed from the decoder's hidden states and the output embedding)"
            )
    data, value_data = [], []
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
        checked = {"advantages": adv, "old_logprobs": old}
        for name in ("value_returns", "old_values"):
            if per_token[name] is not None:
                checked[name] = np.asarray(per_token[name][i], dtype=np.float32)
                if checked[name].shape != ids.shape:
                    raise ValueError(f"sequence {i}: {name} has shape {checked[name].shape}, token_ids {ids.shape}")
        if not np.isin(raw_mask, (0, 1)).all():
            raise ValueError(f"sequence {i}: loss_mask must hold only 0 and 1")
        mask = raw_mask == 1
        if len(mask) and mask[0]:
            raise ValueError(f"sequence {i}: loss_mask[0] is 1, but the first token has nothing to condition on")
        for name, values in checked.items():
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
            if value_returns is not None:
                zeros = np.zeros(len(ids), dtype=np.float32)
                value_data.append(tuple(np.where(mask, checked.get(name, zeros), 0.0)
                                        for name in ("value_returns", "old_values")))
    return data, value_data


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


def _collate_targets(arrays: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
    """Per-token float arrays of the sequences of one minibatch (in its row order), laid out as ``_collate`` lays
    out ``old``: column t holds position t + 1, the target that column predicts."""
    out = np.zeros((len(arrays), max(len(a) for a in arrays) - 1), dtype=np.float32)
    for row, values in enumerate(arrays):
        out[row, : len(values) - 1] = values[1:]
    return torch.from_numpy(out).to(device)


def teacher_forced(
    model: torch.nn.Module,
    sequences: Sequence[SequenceLike],
    batch_tokens: int,
    per_target: Callable[[_Minibatch], torch.Tensor],
) -> list[np.ndarray]:
    """``per_target(batch)`` ([rows, width], one number per predicted token) of each sequence's trained tokens
    placed at their positions, 0 elsewhere and everywhere in sequences without a trained token; packed and padded
    as in ``policy_update`` (deterministic order), under ``no_grad`` as the caller sets it."""
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
        values = per_target(batch).float().cpu().numpy()
        for row, i in enumerate(chosen):
            out[i][1:] = values[row, : len(data[i][0]) - 1]
    return out


def _reduce_over_processes(data_parallel: DataParallel, params: list[torch.nn.Parameter], figures: dict[str, float],
                           gap: float) -> tuple[dict[str, float], float]:
    """Sum the processes' gradients (one flat all-reduce) and their shares of the step's figures; the largest gap."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    data_parallel.all_reduce(flat, "sum")
    for p, chunk in zip(params, flat.split([g.numel() for g in grads]), strict=True):
        p.grad = chunk.view_as(p).clone()
    summed = torch.tensor(list(figures.values()), dtype=torch.float64)
    data_parallel.all_reduce(summed, "sum")
    largest = torch.tensor([gap], dtype=torch.float64)
    data_parallel.all_reduce(largest, "max")
    return dict(zip(figures, summed.tolist(), strict=True)), largest.item()


def _minibatch_loss(
    model: torch.nn.Module,
    reference_model: torch.nn.Module | None,
    batch: _Minibatch,
    config: PPOConfig,
    scale: float,
    token_weight: float,
    where: str,
    temperature: float,
    value: _ValueTerm | None,
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """(loss, its logged parts, detached new log-probs [rows, width]) of one minibatch. ``scale`` multiplies the
    clipped surrogate, ``token_weight`` the token means (KL, entropy, value, clip fraction): both 1 but in a
    data-parallel update, where they are this process's share of the minibatch."""
    hidden = trained_hidden(model, batch)
    logits = _logits(model, hidden, temperature)
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
        clip_ratio_c=config.clip_ratio_c,
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
            reference = _gather_logprobs(_trained_logits(reference_model, batch, temperature), batch)
        kl = kl_k3(new, reference, batch.mask)
    with torch.set_grad_enabled(config.entropy_coef > 0):  # logged either way; a graph only when trained
        entropy = entropy_from_logits(logits[None], torch.ones(logits.shape[:1], device=logits.device)[None])
    if token_weight != 1.0:  # a data-parallel share; at 1 the loss is computed exactly as before
        kl, entropy = kl * token_weight, entropy * token_weight
    loss = policy_loss + config.kl_coef * kl - config.entropy_coef * entropy
    parts = {
        "policy_loss": policy_loss.item(),
        "kl": kl.item(),
        "clip_fraction": stats["clip_fraction"] * token_weight,
        "entropy": entropy.item(),
    }
    if value is not None:  # only then, so that without a head the loss is exactly what it was
        old_values = None if batch.old_values is None else batch.old_values[batch.mask]
        value_loss = _value_loss(value.head(hidden), batch.returns[batch.mask], old_values, value.clip)
        if token_weight != 1.0:
            value_loss = value_loss * token_weight
        loss = loss + value.coef * value_loss
        parts["value_loss"] = value_loss.item()
    _check_finite(loss, "loss", where, lambda: "the KL, entropy or value term is not finite")
    return loss, parts, new.detach()


def _value_loss(
    values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor | None, clip: float | None
) -> torch.Tensor:
    """0.5 · mean (V − R)² over trained tokens (1-D tensors), or PPO's clipped variant when ``old_values`` and
    ``clip`` are given: the max of the plain error and that of V_old + clip(V − V_old, ±clip), so that a value
    gains nothing by moving further than ``clip`` from its sampling-time estimate."""
    error = (values - returns).square()
    if old_values is not None and clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        error = torch.maximum(error, (clipped - returns).square())
    return 0.5 * error.mean()


def trained_hidden(model: torch.nn.Module, batch: _Minibatch) -> torch.Tensor:
    """The decoder's final hidden states [trained tokens, hidden] at the positions whose target is trained, in
    row-major order: the state in which each trained token is generated."""
    positions = torch.arange(batch.inputs.shape[1], device=batch.inputs.device).expand_as(batch.inputs)
    hidden = model.get_decoder()(input_ids=batch.inputs, position_ids=positions, use_cache=False).last_hidden_state
    return hidden[batch.mask]


def _logits(model: torch.nn.Module, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / temperature of these hidden states (no division at 1, so untempered runs are unchanged)."""
    logits = model.get_output_embeddings()(hidden).float()
    return logits if temperature == 1.0 else logits / temperature


def _trained_logits(model: torch.nn.Module, batch: _Minibatch, temperature: float) -> torch.Tensor:
    """fp32 logits / temperature [trained tokens, vocab] at the positions whose target is trained, row-major."""
    return _logits(model, trained_hidden(model, batch), temperature)


def _gather_logprobs(logits: torch.Tensor, batch: _Minibatch) -> torch.Tensor:
    """log_softmax(logits) of the trained targets, scattered back to [rows, width] with 0 elsewhere."""
    picked = torch.log_softmax(logits, dim=-1).gather(1, batch.targets[batch.mask][:, None])[:, 0]
    return scatter_masked(picked, batch.mask)


def scatter_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One value per True of ``mask`` (row-major) back to ``mask``'s shape, 0 elsewhere."""
    return torch.zeros(mask.shape, dtype=values.dtype, device=values.device).masked_scatter(mask, values)


def _check_finite(value: torch.Tensor, what: str, where: str, cause: Callable[[], str]) -> None:
    """Raise before the step is applied; ``cause`` is only worked out on failure."""
    if not bool(torch.isfinite(value).all()):
        raise FloatingPointError(
            f"policy_update: non-finite {what} at {where}: {cause()}. This step was not applied, the earlier ones "
            "were: do not save the model"
        )


# ---------------------------------------------------------------------- optimizer checkpoints

# JSON has neither tuples nor integer keys nor tensors; these one-key objects stand for them.
_TENSOR, _TUPLE, _INT_KEYS = "__tensor__", "__tuple__", "__int_keys__"


def _encode(value: Any, path: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON data; its tensors go to ``tensors`` under their path ("state/3/exp_avg")."""
    where = "/".join(path) or "the state"
    if isinstance(value, torch.Tensor):
        key = "/".join(path)
        if key in tensors:
            raise TypeError(f"save_optimizer_state: two tensors would be stored as {key!r}")
        tensors[key] = value.detach().cpu().contiguous()
        return {_TENSOR: key}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            if any(k in (_TENSOR, _TUPLE, _INT_KEYS) for k in value):
                raise TypeError(f"save_optimizer_state: {where} has a key reserved for the encoding")
            return {k: _encode(v, (*path, k), tensors) for k, v in value.items()}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in value):
            return {_INT_KEYS: {str(k): _encode(v, (*path, str(k)), tensors) for k, v in value.items()}}
        raise TypeError(f"save_optimizer_state: {where} mixes key types {sorted({type(k).__name__ for k in value})}")
    if isinstance(value, tuple | list):
        items = [_encode(v, (*path, str(i)), tensors) for i, v in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if value is None or isinstance(value, bool | int | float | str):
        return value  # json writes floats with repr, which reads back to the same float (inf and nan included)
    raise TypeError(f"save_optimizer_state: cannot store a {type(value).__name__} at {where}")


def _decode(value: Any, tensors: dict[str, torch.Tensor], used: set[str]) -> Any:
    """The inverse of ``_encode``; records the tensor keys it read in ``used``."""
    if isinstance(value, list):
        return [_decode(v, tensors, used) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {_TENSOR}:
        key = value[_TENSOR]
        if key not in tensors:
            raise ValueError(f"load_optimizer_state: the JSON names tensor {key!r}, which the safetensors file lacks")
        used.add(key)
        return tensors[key]
    if set(value) == {_TUPLE}:
        return tuple(_decode(v, tensors, used) for v in value[_TUPLE])
    if set(value) == {_INT_KEYS}:
        return {int(k): _decode(v, tensors, used) for k, v in value[_INT_KEYS].items()}
    return {k: _decode(v, tensors, used) for k, v in value.items()}
