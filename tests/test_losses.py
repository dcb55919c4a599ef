"""Policy losses: hand-computed PPO-clip numbers, normalisers, k3 KL, entropy, masked-position invariance."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from focus_core.losses import entropy_from_logits, kl_k3, masked_mean, ppo_clip_loss

# Hand-worked batch: 2 sequences x 3 tokens, the last token of sequence 1 is masked (an env token).
RATIOS = [[1.5, 0.5, 1.1], [0.7, 1.3, 1.0]]
ADVANTAGES = [[1.0, 1.0, -2.0], [-1.0, 0.5, 9.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
# Per-token loss −min(ρA, clip(ρ, 0.8, 1.2)A) with ε = 0.2:
#   (1.5, A=1):  min(1.5, 1.2)   = 1.2   -> −1.2   clipped
#   (0.5, A=1):  min(0.5, 0.8)   = 0.5   -> −0.5
#   (1.1, A=−2): min(−2.2, −2.2) = −2.2  -> +2.2
#   (0.7, A=−1): min(−0.7, −0.8) = −0.8  -> +0.8   clipped
#   (1.3, A=.5): min(0.65, 0.6)  = 0.6   -> −0.6   clipped
# Sum 0.7 over 5 policy tokens.
HAND_SUM = 0.7


def hand_batch(requires_grad: bool = False):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.9]], dtype=torch.float64)
    new = (old + torch.log(torch.tensor(RATIOS, dtype=torch.float64))).requires_grad_(requires_grad)
    return new, old, torch.tensor(ADVANTAGES, dtype=torch.float64), torch.tensor(MASK)


def test_ppo_clip_hand_computed_token_mean():
    new, old, adv, mask = hand_batch()
    loss, stats = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(HAND_SUM / 5)  # 0.14
    assert stats["clip_fraction"] == pytest.approx(3 / 5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.7 + 1.3) / 5)  # 1.02
    # mean of (old − new) = −mean(log ρ) = −log(1.5 · 0.5 · 1.1 · 0.7 · 1.3) / 5 = −log(0.75075) / 5
    assert stats["approx_kl"] == pytest.approx(-math.log(0.75075) / 5)  # 0.0573


def test_ppo_clip_hand_computed_gradients():
    new, old, adv, mask = hand_batch(requires_grad=True)
    loss, _ = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2)
    loss.backward()
    # Unclipped tokens: d(−ρA)/d log π = −ρA, over 5 tokens. Clipped and masked tokens: 0.
    expected = torch.tensor([[0.0, -0.5 / 5, 2.2 / 5], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(new.grad, expected)


def test_ppo_clip_higher_widens_only_the_upper_bound():
    new, old, adv, mask = hand_batch()
    loss, stats = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    # (1.5, A=1) -> −1.28 ; (1.3, A=0.5) -> −min(0.65, 0.64) = −0.64 ; the lower clip (0.7, A=−1) stays 0.8.
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 2.2 + 0.8 - 0.64) / 5)  # 0.116
    assert stats["clip_fraction"] == pytest.approx(3 / 5)


def test_dual_clip_bounds_the_loss_of_negative_advantage_tokens_whose_ratio_ran_away():
    """Dual-clip with c = 3 (verl's clip_ratio_c): a token with A < 0 loses at most c·|A| and gets no gradient beyond
    it; tokens with A > 0, or with a ratio below c, are untouched."""
    old = torch.zeros(1, 4, dtype=torch.float64)
    ratios = torch.tensor([[5.0, 2.0, 5.0, 0.5]], dtype=torch.float64)
    new = torch.log(ratios).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4)
    # Per-token −surrogate with ε = 0.2:
    #   (5, A=−1): plain min(−5, −1.2) = −5 -> 5; dual max(−5, −3) = −3 -> 3, clipped (no gradient)
    #   (2, A=−1): min(−2, −1.2) = −2, above −3 -> 2, gradient −ρA = 2
    #   (5, A=+1): min(5, 1.2) = 1.2 -> −1.2, clipped
    #   (0.5, A=−1): min(−0.5, −0.8) = −0.8 -> 0.8, clipped
    plain, plain_stats = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2)
    assert plain.item() == pytest.approx((5 + 2 - 1.2 + 0.8) / 4)
    dual, stats = ppo_clip_loss(new, old, adv, mask, clip_eps=0.2, clip_ratio_c=3.0)
    assert dual.item() == pytest.approx((3 + 2 - 1.2 + 0.8) / 4)
    assert plain_stats["clip_fraction"] == pytest.approx(2 / 4) and stats["clip_fraction"] == pytest.approx(3 / 4)
    dual.backward()
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 2.0 / 4, 0.0, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ppo_clip_loss(new, old, adv, mask, clip_ratio_c=1.0)


def test_constant_normaliser_divides_by_c_times_sequences():
    new, old, adv, mask = hand_batch()
    constant, _ = ppo_clip_loss(new, old, adv, mask, agg="constant", constant_normaliser=10)
    token_mean, _ = ppo_clip_loss(new, old, adv, mask, agg="token_mean")
    assert constant.item() == pytest.approx(HAND_SUM / (10 * 2))  # 0.035
    assert token_mean.item() == pytest.approx(HAND_SUM / 5)


def test_constant_normaliser_weights_sequences_by_length_token_mean_does_not_per_batch():
    # Doubling the policy tokens of the batch (by repeating it along time) doubles the constant-normalised
    # loss but leaves the token mean unchanged.
    new, old, adv, mask = hand_batch()
    doubled = [torch.cat([x, x], dim=1) for x in (new, old, adv, mask)]
    single_c, _ = ppo_clip_loss(new, old, adv, mask, agg="constant", constant_normaliser=10)
    double_c, _ = ppo_clip_loss(*doubled, agg="constant", constant_normaliser=10)
    single_t, _ = ppo_clip_loss(new, old, adv, mask)
    double_t, _ = ppo_clip_loss(*doubled)
    assert double_c.item() == pytest.approx(2 * single_c.item())
    assert double_t.item() == pytest.approx(single_t.item())


def test_ratio_one_gives_minus_mean_advantage_and_no_clipping():
    advantages = torch.tensor([[0.5, -1.5, 2.0]])
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    loss, stats = ppo_clip_loss(logprobs, logprobs.clone(), advantages, torch.ones(1, 3))
    assert loss.item() == pytest.approx(-1.0 / 3)
    assert stats == {"clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 1.0}


def test_empty_mask_gives_zero_loss():
    x = torch.zeros(2, 3, requires_grad=True)
    loss, stats = ppo_clip_loss(x, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and stats["clip_fraction"] == 0.0
    assert torch.equal(x.grad, torch.zeros(2, 3))


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"logprobs has shape \(2, 3\) but advantages has shape \(2,\)"):
        ppo_clip_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"logits has shape \(2, 3, 5\) but mask has shape \(2, 4\)"):
        entropy_from_logits(torch.zeros(2, 3, 5), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"logprobs has shape \(1, 3\) but ref_logprobs has shape \(3, 1\)"):
        kl_k3(torch.zeros(1, 3), torch.zeros(3, 1), torch.ones(1, 3))


def test_bad_aggregation_arguments():
    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="needs constant_normaliser"):
        ppo_clip_loss(*args, agg="constant")
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        ppo_clip_loss(*args, agg="sum")
    with pytest.raises(ValueError, match=r"\[sequences, tokens\]"):
        ppo_clip_loss(*(x.flatten() for x in args))


# --- k3 KL and entropy --------------------------------------------------------------------------------


def test_k3_hand_value_and_zero_when_equal():
    logprobs = torch.log(torch.tensor([[0.5, 0.2]]))
    ref = torch.log(torch.tensor([[0.25, 0.2]]))
    # token 0: r = log(0.25/0.5) = −log 2 -> 0.5 + log 2 − 1 = 0.193147; token 1: r = 0 -> 0.
    assert kl_k3(logprobs, ref, torch.ones(1, 2)).item() == pytest.approx((0.5 + math.log(2) - 1) / 2)
    assert kl_k3(logprobs, logprobs.clone(), torch.ones(1, 2)).item() == 0.0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-30, 0), min_size=1, max_size=16),
    st.lists(st.floats(-30, 0), min_size=1, max_size=16),
)
def test_k3_is_never_negative(logprobs, ref):
    n = min(len(logprobs), len(ref))
    lp = torch.tensor([logprobs[:n]], dtype=torch.float32)
    rf = torch.tensor([ref[:n]], dtype=torch.float32)
    assert kl_k3(lp, rf, torch.ones(1, n)).item() >= 0.0
    assert kl_k3(lp + 1e-7, lp, torch.ones(1, n)).item() >= 0.0  # tiny differences round safely


def test_entropy_of_uniform_and_banned_tokens():
    logits = torch.zeros(1, 2, 4)
    logits[0, 1, 2:] = -math.inf  # only two allowed tokens at position 1
    logits.requires_grad_(True)
    entropy = entropy_from_logits(logits, torch.ones(1, 2))
    assert entropy.item() == pytest.approx((math.log(4) + math.log(2)) / 2)
    entropy.backward()
    assert torch.isfinite(logits.grad).all()


def test_masked_mean_ignores_masked_values():
    values = torch.tensor([[1.0, math.nan, 3.0]])
    assert masked_mean(values, torch.tensor([[1, 0, 1]])).item() == 2.0


# --- masked positions never leak ----------------------------------------------------------------------

POISON = st.sampled_from([math.nan, math.inf, -math.inf, 1e9, -1e9])


def _random_batch(seed: int, sequences: int, tokens: int):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(sequences, tokens, generator=generator, dtype=torch.float64) * 3
    new = old + 0.4 * torch.randn(sequences, tokens, generator=generator, dtype=torch.float64)
    adv = torch.randn(sequences, tokens, generator=generator, dtype=torch.float64)
    mask = torch.rand(sequences, tokens, generator=generator) < 0.6
    return new, old, adv, mask


def _poisoned(x: torch.Tensor, mask: torch.Tensor, poison: float) -> torch.Tensor:
    return torch.where(mask, x, torch.full_like(x, poison))


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    sequences=st.integers(1, 4),
    tokens=st.integers(1, 12),
    poison=POISON,
    agg=st.sampled_from(["token_mean", "constant"]),
)
def test_ppo_loss_and_grads_ignore_masked_positions(seed, sequences, tokens, poison, agg):
    new, old, adv, mask = _random_batch(seed, sequences, tokens)
    kwargs = {"clip_eps": 0.2, "agg": agg, "constant_normaliser": 7}

    clean = new.clone().requires_grad_(True)
    clean_loss, clean_stats = ppo_clip_loss(clean, old, adv, mask, **kwargs)
    clean_loss.backward()

    dirty = _poisoned(new, mask, poison).requires_grad_(True)
    dirty_loss, dirty_stats = ppo_clip_loss(
        dirty, _poisoned(old, mask, poison), _poisoned(adv, mask, poison), mask, **kwargs
    )
    dirty_loss.backward()

    assert torch.isfinite(dirty_loss)
    assert dirty_loss.item() == pytest.approx(clean_loss.item(), rel=1e-12, abs=1e-12)
    assert dirty_stats == pytest.approx(clean_stats, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(dirty.grad, clean.grad, rtol=0, atol=1e-12)
    assert torch.equal(dirty.grad[~mask], torch.zeros_like(dirty.grad[~mask]))


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sequences=st.integers(1, 4), tokens=st.integers(1, 12), poison=POISON)
def test_kl_and_entropy_ignore_masked_positions(seed, sequences, tokens, poison):
    new, old, _, mask = _random_batch(seed, sequences, tokens)
    dirty = _poisoned(new, mask, poison).requires_grad_(True)
    kl = kl_k3(dirty, _poisoned(old, mask, poison), mask)
    kl.backward()
    assert kl.item() == pytest.approx(kl_k3(new, old, mask).item(), rel=1e-12, abs=1e-12)
    assert torch.isfinite(dirty.grad).all()
    assert torch.equal(dirty.grad[~mask], torch.zeros_like(dirty.grad[~mask]))

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(sequences, tokens, 5, generator=generator, dtype=torch.float64)
    dirty_logits = _poisoned(logits, mask.unsqueeze(-1), poison).requires_grad_(True)
    entropy = entropy_from_logits(dirty_logits, mask)
    entropy.backward()
    assert entropy.item() == pytest.approx(entropy_from_logits(logits, mask).item(), rel=1e-12, abs=1e-12)
    assert torch.isfinite(dirty_logits.grad).all()
    assert torch.equal(dirty_logits.grad[~mask], torch.zeros_like(dirty_logits.grad[~mask]))
