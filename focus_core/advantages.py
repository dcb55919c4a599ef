"""Advantage estimators: pure functions, and one registry with one signature that the pipeline dispatches on.

Every estimator comes in two forms that must agree exactly (tests/test_advantages.py checks this
on random ragged batches):

* a per-trajectory form that reads like the formula in ``reference/method.md``, and
* a vectorised ragged-batch form that scores many trajectories at once. A ragged batch is stored
  flat: the segments of all trajectories concatenated, plus ``lengths`` (segments per trajectory).
  Values carry one extra entry per trajectory (the state after the last segment), so a batch with
  segment counts ``lengths`` has ``sum(lengths)`` rewards and ``sum(lengths) + len(lengths)`` values.

Batch forms accept numpy arrays or torch tensors and return the same kind. The recursions walk
backwards from each trajectory's end in ``max(lengths)`` vector steps, touching every segment once
(no padding), which is what makes 1M segments take well under a second.

The registry ``ADVANTAGE_ESTIMATORS`` (bottom of the file) maps each estimator name of the method table
to a function ``(batch: AdvantageBatch, config) -> AdvantageResult``: every estimator reads the same
batch (segments of many episodes, their values, groups and, for token-level estimators, per-token
values) and returns per-segment advantages (and per-token ones where it has them).

Conventions (method.md §5): gamma is the per-segment discount Γ_k (a scalar or one value per
segment), the trace Λ_k multiplies A_{k+1} in A_k, and the value after a trajectory's last segment
is whatever the caller passes: 0 for an episode that ended, a bootstrap value for a truncated one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

Array = Any  # np.ndarray or torch.Tensor; the batch forms return the kind they are given

# --------------------------------------------------------------------------------------------
# Helpers shared by numpy and torch inputs
# --------------------------------------------------------------------------------------------


def _is_torch(x: Array) -> bool:
    return isinstance(x, torch.Tensor)


def _as_float(x: Array, like: Array) -> Array:
    """``x`` as a float array of the same kind (numpy/torch), dtype and device as ``like``."""
    if _is_torch(like):
        return torch.as_tensor(x, dtype=like.dtype, device=like.device)
    return np.asarray(x, dtype=like.dtype)


def _float_array(x: Array) -> Array:
    if _is_torch(x):
        return x if x.is_floating_point() else x.double()
    x = np.asarray(x)
    return x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float64)


def _lengths_numpy(lengths: Array) -> np.ndarray:
    lengths = lengths.detach().cpu().numpy() if _is_torch(lengths) else np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be a 1-D integer array, got shape {lengths.shape} {lengths.dtype}")
    if (lengths < 0).any():
        raise ValueError("lengths must be >= 0 (segments per trajectory)")
    return lengths.astype(np.int64)


def _per_segment(x: float | Array, n: int, like: Array, name: str) -> Array:
    """Broadcast a scalar or a length-``n`` array to one entry per segment."""
    if np.isscalar(x) or (hasattr(x, "ndim") and x.ndim == 0):
        out = _as_float(np.full(n, float(x)), like)
    else:
        out = _as_float(x, like)
        if out.shape != (n,):
            raise ValueError(f"{name} must be a scalar or have one entry per segment ({n}), got {tuple(out.shape)}")
    return out


def _reverse_linear_scan(deltas: Array, decay: Array, lengths: np.ndarray) -> Array:
    """Solve ``A_k = delta_k + decay_k * A_{k+1}`` (A past the end = 0) for every trajectory.

    Trajectories are sorted by length once; step ``d`` updates the ``d``-th segment from the end of
    every trajectory still that long, so the total work is one update per segment.
    """
    out = deltas * 0  # same kind, dtype and device
    if len(lengths) == 0 or lengths.max(initial=0) == 0:
        return out
    ends = np.cumsum(lengths)  # one past each trajectory's last segment
    order = np.argsort(-lengths, kind="stable")
    ends_by_len, lens_by_len = ends[order], lengths[order]
    n_longer = np.searchsorted(-lens_by_len, -np.arange(1, lens_by_len[0] + 1), side="right")
    to_index = torch.as_tensor if _is_torch(deltas) else np.asarray
    for d, n_active in enumerate(n_longer):
        pos = ends_by_len[:n_active] - 1 - d
        if d == 0:
            out[to_index(pos)] = deltas[to_index(pos)]
        else:
            idx = to_index(pos)
            out[idx] = deltas[idx] + decay[idx] * out[to_index(pos + 1)]
    return out


# --------------------------------------------------------------------------------------------
# Segment TD(lambda)  (method.md §5.1, worked examples T1-T4)
# --------------------------------------------------------------------------------------------


def segment_td_lambda(
    rewards: Array,
    values: Array,
    *,
    gamma: float | Array,
    lam: float,
    trace: Array | None = None,
) -> tuple[Array, Array]:
    """TD(λ) advantages over the K segments of one trajectory.

    ``rewards`` has shape [K]; ``values`` has shape [K+1], the last entry being the value of the
    state after the last segment (0 when the episode ended). ``gamma`` is the per-segment discount
    Γ_k, a scalar or shape [K]; ``lam`` is λ (``advantage.lam``); ``trace`` is an optional per-segment Λ_k of
    shape [K] overriding ``lam`` (``advantage.trace_mode: token_length`` passes ``token_length_trace(...)``).

        δ_k = r_k + Γ_k V(s_{k+1}) − V(s_k)
        A_k = δ_k + Γ_k Λ_k A_{k+1},   A_K = 0
        G^λ_k = A_k + V(s_k)

    Returns ``(advantages, lambda_returns)``, both shape [K]. λ=0 gives the VinePPO form δ_k and
    λ=1 (γ=1) gives R_{≥k} − V(s_k).
    """
    rewards, values = _float_array(rewards), _float_array(values)
    k = rewards.shape[0]
    if rewards.ndim != 1 or values.shape != (k + 1,):
        raise ValueError(
            f"segment_td_lambda takes rewards [K] and values [K+1]; got {tuple(rewards.shape)} "
            f"and {tuple(values.shape)} (append the terminal state's value, 0 if the episode ended)"
        )
    values = _as_float(values, rewards)
    discount = _per_segment(gamma, k, rewards, "gamma")
    trace_k = _per_segment(lam if trace is None else trace, k, rewards, "trace")
    advantages = rewards * 0
    next_advantage = 0.0
    for i in range(k - 1, -1, -1):
        delta = rewards[i] + discount[i] * values[i + 1] - values[i]
        next_advantage = delta + discount[i] * trace_k[i] * next_advantage
        advantages[i] = next_advantage
    return advantages, advantages + values[:k]


def _split_values(values: Array, lengths: np.ndarray) -> tuple[Array, Array]:
    """Flat values with K_i+1 entries per trajectory -> (V(s_k), V(s_{k+1})), each one per segment."""
    n_seg = int(lengths.sum())
    if values.shape != (n_seg + len(lengths),):
        raise ValueError(
            f"values must hold sum(lengths)+len(lengths) = {n_seg + len(lengths)} entries "
            f"(K_i+1 per trajectory: every segment start plus the final state); got {tuple(values.shape)}"
        )
    traj_of_segment = np.repeat(np.arange(len(lengths)), lengths)
    start_index = np.arange(n_seg) + traj_of_segment  # skip one extra value per earlier trajectory
    idx = torch.as_tensor(start_index, device=values.device) if _is_torch(values) else start_index
    return values[idx], values[idx + 1]


def segment_td_lambda_batch(
    rewards: Array,
    values: Array,
    lengths: Array,
    *,
    gamma: float | Array,
    lam: float,
    trace: Array | None = None,
) -> tuple[Array, Array]:
    """Vectorised ``segment_td_lambda`` over a ragged batch.

    ``rewards`` [N] flat over all segments, ``values`` [N+B] (K_i+1 per trajectory), ``lengths``
    [B]; ``gamma`` and ``trace`` are scalars or flat [N]. Returns flat ``(advantages, returns)``.
    """
    rewards = _float_array(rewards)
    lengths_np = _lengths_numpy(lengths)
    if rewards.ndim != 1 or rewards.shape[0] != lengths_np.sum():
        raise ValueError(
            f"rewards must be flat with sum(lengths)={lengths_np.sum()} entries, got {tuple(rewards.shape)}"
        )
    value_now, value_next = _split_values(_as_float(values, rewards), lengths_np)
    n = rewards.shape[0]
    discount = _per_segment(gamma, n, rewards, "gamma")
    trace_k = _per_segment(lam if trace is None else trace, n, rewards, "trace")
    deltas = rewards + discount * value_next - value_now
    advantages = _reverse_linear_scan(deltas, discount * trace_k, lengths_np)
    return advantages, advantages + value_now


def token_length_trace(segment_token_counts: Array, lambda_token: float) -> Array:
    """Per-segment trace Λ_k = λ_tok ** L_k for the token-length-aware mode (method.md §5.1, T4).

    Long segments then trust the far critic value less, as if the trace decayed per generated token.
    """
    counts = _float_array(segment_token_counts)
    if not 0.0 <= lambda_token <= 1.0:
        raise ValueError(f"lambda_token must be in [0, 1], got {lambda_token}")
    return lambda_token**counts


def lambda_token_for_halflife(halflife_tokens: float) -> float:
    """The per-token λ_tok whose trace halves every ``halflife_tokens`` tokens (``advantage.lambda_token_halflife``;
    T4 uses 200)."""
    return 0.5 ** (1.0 / halflife_tokens)


# --------------------------------------------------------------------------------------------
# VinePPO: TD(0) with Monte-Carlo values  (method.md §4)
# --------------------------------------------------------------------------------------------


def vineppo_advantages(rewards: Array, mc_values: Array) -> tuple[Array, Array]:
    """VinePPO's A_k = r_k + V̂_MC(s_{k+1}) − V̂_MC(s_k) for one trajectory (γ=1, λ=0)."""
    return segment_td_lambda(rewards, mc_values, gamma=1.0, lam=0.0)


def vineppo_advantages_batch(rewards: Array, mc_values: Array, lengths: Array) -> tuple[Array, Array]:
    """Vectorised ``vineppo_advantages`` over a ragged batch (layout as ``segment_td_lambda_batch``)."""
    return segment_td_lambda_batch(rewards, mc_values, lengths, gamma=1.0, lam=0.0)


# --------------------------------------------------------------------------------------------
# Group baselines: GRPO, Dr.GRPO, RLOO  (method.md §3, T10)
# --------------------------------------------------------------------------------------------


def _group_index(group_ids: Array) -> tuple[np.ndarray, int]:
    ids = group_ids.detach().cpu().numpy() if _is_torch(group_ids) else np.asarray(group_ids)
    if ids.ndim != 1:
        raise ValueError(f"group_ids must be 1-D (one id per trajectory), got shape {ids.shape}")
    _, inverse = np.unique(ids, return_inverse=True)
    return inverse.reshape(-1), int(inverse.max(initial=-1)) + 1


def _group_sum(x: Array, group: np.ndarray, n_groups: int) -> Array:
    if _is_torch(x):
        out = torch.zeros(n_groups, dtype=x.dtype, device=x.device)
        return out.index_add_(0, torch.as_tensor(group, device=x.device), x)
    return np.bincount(group, weights=x, minlength=n_groups).astype(x.dtype)


def _take(x: Array, index: np.ndarray) -> Array:
    return x[torch.as_tensor(index, device=x.device)] if _is_torch(x) else x[index]


ZERO_STD = 1e-6  # a group whose reward std is below this is treated as having no spread


def grpo_advantages(
    rewards: Array, group_ids: Array, *, scale: str = "std", unbiased: bool = True
) -> Array:
    """GRPO outcome advantages ``(r_i − mean_g) / std_g`` per trajectory.

    ``scale="none"`` is Dr.GRPO (no division: removes the difficulty bias). ``unbiased`` picks the
    (n−1) standard deviation, as ``torch.std`` does: rewards [1,0,1,0] give ±0.866 rather than ±1.
    A group of one trajectory, or with identical rewards, gets advantage 0 (no signal).
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' (GRPO) or 'none' (Dr.GRPO), got {scale!r}")
    rewards = _float_array(rewards)
    group, n_groups = _group_index(group_ids)
    if group.shape[0] != rewards.shape[0]:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids ({group.shape[0]},) must match")
    counts = _as_float(np.bincount(group, minlength=n_groups), rewards)
    mean = _group_sum(rewards, group, n_groups) / counts
    centred = rewards - _take(mean, group)
    if scale == "none":
        return centred
    sq = _group_sum(centred * centred, group, n_groups)
    dof = counts - 1 if unbiased else counts
    dof = dof + (dof == 0)  # singleton groups: centred is 0 anyway; avoid 0/0
    std = (sq / dof) ** 0.5
    # Zero-variance groups carry no signal; their centred rewards are 0 up to rounding, which a
    # division by a ~1e-17 std would blow up to ±1. Give them exactly 0.
    has_spread = std > ZERO_STD
    inv_std = has_spread / (std + ~has_spread)
    return centred * _take(inv_std, group)


def dr_grpo_advantages(rewards: Array, group_ids: Array) -> Array:
    """Dr.GRPO: ``r_i − mean_g`` (GRPO without the std division)."""
    return grpo_advantages(rewards, group_ids, scale="none")


def rloo_advantages(rewards: Array, group_ids: Array) -> Array:
    """RLOO leave-one-out baseline: ``r_i − mean_{j≠i} r_j = G/(G−1) (r_i − mean_g)``; 0 for G=1."""
    rewards = _float_array(rewards)
    group, n_groups = _group_index(group_ids)
    counts = _as_float(np.bincount(group, minlength=n_groups), rewards)
    mean = _group_sum(rewards, group, n_groups) / counts
    g = _take(counts, group)
    factor = g / (g - 1 + (g == 1))  # G/(G-1); singletons get centred = 0 anyway
    return factor * (rewards - _take(mean, group))


# --------------------------------------------------------------------------------------------
# Token-level GAE with masked environment tokens  (method.md §2; anchors §4.3: verl PR #2337)
# --------------------------------------------------------------------------------------------


def _check_gae_inputs(token_rewards: Array, token_values: Array, mask: Array) -> None:
    if not (token_rewards.shape == token_values.shape == mask.shape):
        raise ValueError(
            f"gae needs token_rewards, token_values and mask of one shape; got {tuple(token_rewards.shape)}, "
            f"{tuple(token_values.shape)}, {tuple(mask.shape)}"
        )
    masked_reward = (token_rewards != 0) & (mask == 0)
    if bool(masked_reward.any()):
        raise ValueError(
            "gae: a non-zero reward sits on a masked (environment) token, where it would be lost; "
            "put each reward on the last policy token before it"
        )


def gae(
    token_rewards: Array, token_values: Array, mask: Array, *, gamma: float, lam: float
) -> tuple[Array, Array]:
    """GAE over policy tokens only, for a padded batch [B, T] (or one sequence [T]).

    Tokens with ``mask == 0`` (tool/environment output, padding) are skipped: they neither
    bootstrap nor accumulate, and get advantage and return 0. The recursion links each policy
    token to the *next policy token*, whose value is its bootstrap (0 after the last one):

        δ_t = r_t + γ V(next policy token) − V_t,   A_t = δ_t + γλ A(next policy token)

    Returns ``(advantages, returns)`` with returns = A + V on policy tokens.
    """
    token_rewards = _float_array(token_rewards)
    token_values = _as_float(token_values, token_rewards)
    _check_gae_inputs(token_rewards, token_values, mask)
    single = token_rewards.ndim == 1
    rewards = token_rewards[None] if single else token_rewards
    values = token_values[None] if single else token_values
    is_policy = (mask[None] if single else mask) != 0
    where = torch.where if _is_torch(rewards) else np.where
    advantages = rewards * 0
    next_value = rewards[:, 0] * 0
    next_advantage = rewards[:, 0] * 0
    for t in range(rewards.shape[1] - 1, -1, -1):
        policy_t = is_policy[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        advantages[:, t] = where(policy_t, advantage_t, 0.0)
        next_value = where(policy_t, values[:, t], next_value)
        next_advantage = where(policy_t, advantage_t, next_advantage)
    returns = where(is_policy, advantages + values, 0.0)
    return (advantages[0], returns[0]) if single else (advantages, returns)


# --------------------------------------------------------------------------------------------
# Segment -> token broadcast  (method.md §5.2, T5)
# --------------------------------------------------------------------------------------------


def broadcast_segments(segment_advantages: Array, segment_token_counts: Array, token_mask: Array) -> Array:
    """Give each policy token its segment's advantage; masked tokens get 0.

    ``segment_advantages`` [K] and ``segment_token_counts`` [K] (policy tokens per segment, in
    order) describe one trajectory — or many, concatenated, since segments never straddle
    trajectories. ``token_mask`` [T] marks policy tokens with 1; it must hold exactly
    ``sum(segment_token_counts)`` ones.
    """
    counts = segment_token_counts.detach().cpu().numpy() if _is_torch(segment_token_counts) else (
        np.asarray(segment_token_counts)
    )
    mask_np = token_mask.detach().cpu().numpy() if _is_torch(token_mask) else np.asarray(token_mask)
    if counts.shape != tuple(segment_advantages.shape):
        raise ValueError(
            f"one token count per segment: got {counts.shape[0]} counts for {segment_advantages.shape[0]} segments"
        )
    policy_positions = np.flatnonzero(mask_np != 0)
    if policy_positions.size != counts.sum():
        raise ValueError(
            f"token_mask has {policy_positions.size} policy tokens but the segments count {counts.sum()}; "
            "the loss mask and the segment token counts come from different rollouts"
        )
    per_token = np.repeat(np.arange(counts.shape[0]), counts)
    if _is_torch(segment_advantages):
        out = torch.zeros(mask_np.shape, dtype=segment_advantages.dtype, device=segment_advantages.device)
        out[torch.as_tensor(policy_positions)] = segment_advantages[torch.as_tensor(per_token)]
        return out
    out = np.zeros(mask_np.shape, dtype=_float_array(segment_advantages).dtype)
    out[policy_positions] = np.asarray(segment_advantages)[per_token]
    return out


# --------------------------------------------------------------------------------------------
# Batch statistics
# --------------------------------------------------------------------------------------------


def whiten(advantages: Array, mask: Array | None = None, *, eps: float = 1e-8) -> Array:
    """Zero-mean, unit-variance advantages over the (masked) batch, as VinePPO and PPO do.

    Statistics use the positions where ``mask`` is non-zero (all positions without a mask); masked
    positions come back as 0.
    """
    adv = _float_array(advantages)
    if mask is None:
        mask = np.ones(adv.shape, dtype=bool) if not _is_torch(adv) else torch.ones_like(adv, dtype=torch.bool)
    keep = mask != 0
    selected = adv[keep]
    if _is_torch(adv):
        mean, std = selected.mean(), selected.std(unbiased=False)
        return torch.where(keep, (adv - mean) / (std + eps), torch.zeros_like(adv))
    mean, std = selected.mean(), selected.std()
    return np.where(keep, (adv - mean) / (std + eps), 0.0)


# --------------------------------------------------------------------------------------------
# Values of states without returns (VinePPO beyond its value-estimation cap)
# --------------------------------------------------------------------------------------------


def fill_missing_values(rewards: np.ndarray, values: np.ndarray, known: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """V(s_k) = ``values[k]`` where ``known``, else r_k + V(s_{k+1}) (V after the last segment = 0).

    VinePPO's rule for states it estimates no value for: their δ_k = r_k + V(s_{k+1}) − V(s_k) is 0, and the
    credit goes to the nearest earlier state that has a Monte-Carlo value. Flat ragged layout as above.
    """
    rewards, values = np.asarray(rewards, np.float64), np.asarray(values, np.float64)
    known, lengths = np.asarray(known, bool), _lengths_numpy(lengths)
    out = np.where(known, values, 0.0)
    end = 0
    for length in lengths:
        start, end = end, end + length
        following = 0.0
        for k in range(end - 1, start - 1, -1):
            if not known[k]:
                out[k] = rewards[k] + following
            following = out[k]
    return out


# --------------------------------------------------------------------------------------------
# The pipeline's registry: one signature for every estimator
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvantageBatch:
    """The segments of a batch of episodes, episodes contiguous and segments in order.

    rewards [N], lengths [B] (segments per episode), values [N] V̂(s_k) (None for group and token estimators),
    outcomes [B] episode rewards, groups [B] group ids (a cut episode gets a group of its own),
    token_values / token_masks: per segment, the value head's V_t and the policy-token mask (gae only).
    """

    rewards: np.ndarray
    lengths: np.ndarray
    outcomes: np.ndarray
    groups: np.ndarray
    values: np.ndarray | None = None
    segment_tokens: np.ndarray | None = None  # [N] generated tokens L_k (the token-length trace)
    token_values: Sequence[np.ndarray] | None = None
    token_masks: Sequence[np.ndarray] | None = None


@dataclass(frozen=True)
class AdvantageResult:
    """Per segment: A_k, V̂(s_k), V̂(s_{k+1}) and the λ-return; per token where the estimator has them."""

    advantage: np.ndarray
    value: np.ndarray
    next_value: np.ndarray
    lambda_return: np.ndarray
    token_advantages: list[np.ndarray] | None = None
    token_returns: list[np.ndarray] | None = None


Estimator = Callable[[AdvantageBatch, Any], AdvantageResult]
ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}


def register_advantage(name: str) -> Callable[[Estimator], Estimator]:
    """Add a pipeline estimator ``(batch, config) -> AdvantageResult`` under ``name``."""

    def add(fn: Estimator) -> Estimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return add


def get_advantage_estimator(name: str) -> Estimator:
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; known estimators: {known}") from None


def _with_terminal_zero(batch: AdvantageBatch) -> np.ndarray:
    """Values [N] -> [N + B]: V(s_0..s_{K-1}) of each episode, then 0 after its end."""
    ends = np.cumsum(_lengths_numpy(batch.lengths))
    return np.insert(np.asarray(batch.values, np.float64), ends, 0.0)


def _segment_result(batch: AdvantageBatch, advantage: np.ndarray, returns: np.ndarray) -> AdvantageResult:
    flat = _with_terminal_zero(batch)
    value_now, value_next = _split_values(flat, _lengths_numpy(batch.lengths))
    return AdvantageResult(advantage, value_now, value_next, returns)


@register_advantage("segment_td_lambda")
def _segment_td_lambda_estimator(batch: AdvantageBatch, config: Any) -> AdvantageResult:
    trace = None
    if config.trace_mode == "token_length":
        if batch.segment_tokens is None:
            raise ValueError("trace_mode=token_length needs AdvantageBatch.segment_tokens")
        trace = token_length_trace(batch.segment_tokens, lambda_token_for_halflife(config.lambda_token_halflife))
    advantage, returns = segment_td_lambda_batch(batch.rewards, _with_terminal_zero(batch), batch.lengths,
                                                 gamma=config.gamma, lam=config.lam, trace=trace)
    return _segment_result(batch, advantage, returns)


@register_advantage("vineppo")
def _vineppo_estimator(batch: AdvantageBatch, config: Any) -> AdvantageResult:
    advantage, returns = vineppo_advantages_batch(batch.rewards, _with_terminal_zero(batch), batch.lengths)
    return _segment_result(batch, advantage, returns)


def _group_result(batch: AdvantageBatch, per_episode: np.ndarray) -> AdvantageResult:
    lengths = _lengths_numpy(batch.lengths)
    advantage = np.repeat(per_episode, lengths)
    value = np.repeat(np.asarray(batch.outcomes, np.float64) - per_episode, lengths)  # the group baseline r − A
    return AdvantageResult(advantage, value, np.zeros_like(advantage), advantage + value)


@register_advantage("grpo")
def _grpo_estimator(batch: AdvantageBatch, config: Any) -> AdvantageResult:
    return _group_result(batch, grpo_advantages(batch.outcomes, batch.groups, unbiased=config.grpo_std == "unbiased"))


@register_advantage("dr_grpo")
def _dr_grpo_estimator(batch: AdvantageBatch, config: Any) -> AdvantageResult:
    return _group_result(batch, dr_grpo_advantages(batch.outcomes, batch.groups))


@register_advantage("rloo")
def _rloo_estimator(batch: AdvantageBatch, config: Any) -> AdvantageResult:
    return _group_result(batch, rloo_advantages(batch.outcomes, batch.groups))


@register_advantage("gae")
def _gae_estimator(batch: AdvantageBatch, config: Any) -> AdvantageResult:
    """Token-level GAE over each episode's policy tokens (its segments' tokens in order, tool tokens masked);
    the reward sits on the episode's last policy token. Per segment: the mean token advantage, and the value
    and return at the segment's first policy token."""
    if batch.token_values is None or batch.token_masks is None:
        raise ValueError("the gae estimator needs token_values and token_masks (a value head's per-token values)")
    lengths = _lengths_numpy(batch.lengths)
    token_advantages, token_returns = [], []
    seg_adv, seg_value, seg_return = (np.zeros(int(lengths.sum())) for _ in range(3))
    start = 0
    for episode, length in enumerate(lengths):
        segments = range(start, start + length)
        masks = [np.asarray(batch.token_masks[k]) for k in segments]
        values = np.concatenate([np.asarray(batch.token_values[k], np.float64) for k in segments])
        mask = np.concatenate(masks)
        rewards = np.zeros(len(mask))
        policy = np.flatnonzero(mask != 0)
        if policy.size:
            rewards[policy[-1]] = batch.outcomes[episode]
        advantages, returns = gae(rewards, values, mask, gamma=config.gamma, lam=config.lam)
        cuts = np.cumsum([len(m) for m in masks])[:-1]
        for k, adv, ret, val, m in zip(segments, np.split(advantages, cuts), np.split(returns, cuts),
                                       np.split(values, cuts), masks, strict=True):
            token_advantages.append(adv)
            token_returns.append(ret)
            on = np.flatnonzero(m != 0)
            if on.size:
                seg_adv[k], seg_value[k], seg_return[k] = adv[on].mean(), val[on[0]], ret[on[0]]
        start += length
    next_value = np.r_[seg_value[1:], 0.0]
    next_value[np.cumsum(lengths) - 1] = 0.0
    return AdvantageResult(seg_adv, seg_value, next_value, seg_return, token_advantages, token_returns)
