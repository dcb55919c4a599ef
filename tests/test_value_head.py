"""Value head for PPO with GAE: values[t] is the head on the hidden state at t − 1, padding and batching change
nothing, checkpoints round-trip, joint training in ``policy_update`` fits the head (and only the value term moves
the weights when advantages are 0), value clipping holds values near their sampling-time estimates, and without a
head the update is exactly what it was."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from focus_core.config import PPOConfig
from focus_core.policy import tiny_policy, train_tokenizer
from focus_core.ppo import (
    TrainingSequence,
    _value_loss,
    load_optimizer_state,
    policy_update,
    save_optimizer_state,
    sequence_logprobs,
)
from focus_core.value_head import METADATA_FILE, TENSORS_FILE, ValueHead, token_values
from tests.test_ppo import CORPUS, SMALL  # the same tiny model as the PPO tests

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    return tiny_policy(train_tokenizer(CORPUS, vocab_size=400), seed=3, **SMALL).model


@pytest.fixture(scope="module")
def sequences(model):
    """Four sequences of different lengths, each with a context prefix and an untrained (tool) span inside its
    trained part, and a fifth with no trained token; old log-probs are the model's own (on-policy)."""
    rng = np.random.default_rng(0)
    raw = []
    for length in (30, 45, 60, 20, 12):
        mask = np.zeros(length, dtype=int)
        if length > 12:
            mask[length // 3 :] = 1
            mask[length // 2 : length // 2 + 3] = 0
        raw.append(TrainingSequence(rng.integers(0, 400, size=length), np.zeros(length), mask))
    return [
        TrainingSequence(s.token_ids, lp, s.loss_mask)
        for s, lp in zip(raw, sequence_logprobs(model, raw), strict=True)
    ]


def _per_token(sequences, value: float) -> list[np.ndarray]:
    return [np.full(len(s.token_ids), value) for s in sequences]


def _random_head(model, seed: int = 1) -> ValueHead:
    """A head with O(1) weights, so values differ clearly from position to position (a fresh head's are ≈ 0)."""
    head = ValueHead.for_model(model, seed=seed)
    with torch.no_grad():
        head.linear.weight.normal_(generator=torch.Generator().manual_seed(seed))
        head.linear.bias.fill_(0.3)
    return head


def _train(model, sequences, head, *, lr=3e-3, epochs=4, **kw):
    """Zero advantages, so the policy term contributes nothing and only the value term can move anything."""
    model = copy.deepcopy(model)
    report = policy_update(
        model, sequences, _per_token(sequences, 0.0), PPOConfig(epochs=epochs, lr=lr), batch_tokens=100,
        value_head=head, **kw,
    )
    return model, report


# ---------------------------------------------------------------------- values


def test_values_use_the_hidden_state_before_the_token(model, sequences):
    """values[t] = head(h[t − 1]) at trained positions, 0 elsewhere and at t = 0; checked against one plain
    forward per sequence, and shown to differ from the head on h[t] (so the check can tell the two apart)."""
    head = _random_head(model)
    values = token_values(model, head, sequences)
    assert [v.shape for v in values] == [s.token_ids.shape for s in sequences]
    assert all(v.dtype == np.float32 for v in values)
    for sequence, got in zip(sequences, values, strict=True):
        trained = sequence.loss_mask == 1
        with torch.no_grad():
            hidden = model.get_decoder()(input_ids=torch.tensor(sequence.token_ids)[None]).last_hidden_state[0]
            at = head(hidden).numpy()
        expected = np.zeros(len(trained), dtype=np.float32)
        expected[1:] = at[:-1]
        assert got[0] == 0.0 and not got[~trained].any()
        np.testing.assert_allclose(got[trained], expected[trained], atol=1e-5)
        if trained.any():
            assert np.abs(got[trained] - at[trained]).max() > 1e-2
    assert not values[-1].any()  # no trained token: nothing to value


def test_padding_and_batching_do_not_change_the_values(model, sequences):
    head = _random_head(model)
    together = token_values(model, head, sequences, batch_tokens=8192)  # one right-padded minibatch
    alone = token_values(model, head, sequences, batch_tokens=1)  # one unpadded sequence per forward
    shuffled = token_values(model, head, sequences[::-1], batch_tokens=90)[::-1]
    for a, b, c in zip(together, alone, shuffled, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
        np.testing.assert_allclose(a, c, atol=1e-5)


def test_a_fresh_head_starts_near_zero_and_is_seeded(model, sequences):
    head = ValueHead.for_model(model, seed=7)
    assert head.linear.weight.std().item() == pytest.approx(1e-3, rel=0.3) and not head.linear.bias.any()
    assert torch.equal(head.linear.weight, ValueHead(SMALL["hidden"], seed=7).linear.weight)
    assert not torch.equal(head.linear.weight, ValueHead(SMALL["hidden"], seed=8).linear.weight)
    assert max(np.abs(v).max() for v in token_values(model, head, sequences)) < 0.1


def test_checkpoint_round_trip(model, sequences, tmp_path):
    head = _random_head(model)
    head.save(tmp_path / "policy")
    assert {p.name for p in (tmp_path / "policy").iterdir()} == {TENSORS_FILE, METADATA_FILE}
    loaded = ValueHead.load(tmp_path / "policy")
    assert loaded.hidden_size == head.hidden_size
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    for a, b in zip(token_values(model, head, sequences), token_values(model, loaded, sequences), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileNotFoundError, match=r"no value head in .*nowhere") as error:
        ValueHead.load(tmp_path / "nowhere")
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------- joint training


def test_joint_training_fits_the_head(model, sequences):
    """Zero advantages, targets 1: the value loss falls from 0.5 (a fresh head's values are ≈ 0) to a small
    fraction of it. A head left out of the optimizer (frozen here) stays near 0.5, because the decoder alone,
    seen through the head's tiny weights, cannot move the values far."""
    returns = _per_token(sequences, 1.0)
    _, fitted = _train(model, sequences, ValueHead.for_model(model), value_returns=returns)
    frozen_head = ValueHead.for_model(model).requires_grad_(False)
    _, frozen = _train(model, sequences, frozen_head, value_returns=returns)
    first, last = fitted.rows[0]["value_loss"], fitted.rows[-1]["value_loss"]
    assert first == pytest.approx(0.5, abs=0.01)
    assert last < 0.1 * first
    assert frozen.rows[-1]["value_loss"] > 0.7 * first
    assert fitted.value_loss == pytest.approx(np.mean([row["value_loss"] for row in fitted.rows]))
    assert all(list(row)[-3:] == ["value_loss", "grad_norm", "lr"] for row in fitted.rows)


def test_value_coef_zero_leaves_everything_in_place(model, sequences):
    """With AdamW and no weight decay, zero gradients are zero steps: zero advantages and value_coef 0 move neither
    the policy nor the head. value_coef > 0 moves both, the decoder included (it is shared, as in TRL)."""
    returns = _per_token(sequences, 1.0)
    head = ValueHead.for_model(model)
    before = copy.deepcopy(head.state_dict())
    still, report = _train(model, sequences, head, value_returns=returns, value_coef=0.0)
    assert all(row["grad_norm"] == 0.0 for row in report.rows) and report.value_loss > 0.4
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, still.state_dict()[name]), name
    assert all(torch.equal(w, head.state_dict()[name]) for name, w in before.items())
    moved, _ = _train(model, sequences, head, value_returns=returns, value_coef=0.5)
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, moved.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(before["linear.bias"], head.state_dict()["linear.bias"])


def test_value_clipping_holds_values_near_their_sampling_time_estimates(model, sequences):
    """PPO value clipping, V_old ≈ 0 (a fresh head), R = 1, value_clip 0.05: once V is more than 0.05 above V_old,
    the clipped error (V_old + 0.05 − R)² is the larger one and has no gradient in V, so the loss never drops below
    0.5 · 0.95² and V is no longer pulled up; Adam's momentum carries it a little further. Unclipped, V goes on to
    the target."""
    values, returns, old = (torch.tensor([0.5, 0.02, -0.5], requires_grad=True), torch.ones(3), torch.zeros(3))
    loss = _value_loss(values, returns, old, 0.05)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * (0.95**2 + 0.98**2 + 1.5**2) / 3)
    assert values.grad.tolist() == pytest.approx([0.0, -0.98 / 3, -1.5 / 3])  # clipped only above V_old + 0.05

    returns = _per_token(sequences, 1.0)
    old_values = token_values(model, ValueHead.for_model(model), sequences)
    settings = {"value_returns": returns, "old_values": old_values, "lr": 1e-3, "epochs": 6}
    clipped_head, free_head = ValueHead.for_model(model), ValueHead.for_model(model)
    clipped_model, clipped = _train(model, sequences, clipped_head, value_clip=0.05, **settings)
    free_model, free = _train(model, sequences, free_head, value_clip=None, **settings)
    trained = np.concatenate([s.loss_mask == 1 for s in sequences])
    clipped_values = np.concatenate(token_values(clipped_model, clipped_head, sequences))[trained]
    free_values = np.concatenate(token_values(free_model, free_head, sequences))[trained]
    assert min(row["value_loss"] for row in clipped.rows) > 0.44
    assert free.rows[-1]["value_loss"] < 0.05
    assert np.median(clipped_values) < 0.5 < 0.9 < np.median(free_values)


def test_model_head_and_optimizer_resume_from_a_checkpoint_bit_for_bit(model, sequences, tmp_path):
    """The head's moments sit in the same AdamW state as the decoder's: saved next to the head, the second update
    of a resumed run equals that of one that kept everything in memory."""
    returns = _per_token(sequences, 1.0)
    head = ValueHead.for_model(model)
    kept_model, first = _train(model, sequences, head, value_returns=returns, epochs=1)
    head.save(tmp_path)
    save_optimizer_state(first.optimizer_state, tmp_path)
    resumed_model, resumed_head = copy.deepcopy(kept_model), ValueHead.load(tmp_path)
    runs = []
    for updated, its_head, state in ((kept_model, head, first.optimizer_state),
                                     (resumed_model, resumed_head, load_optimizer_state(tmp_path))):
        runs.append(policy_update(updated, sequences, _per_token(sequences, 0.0), PPOConfig(epochs=1, lr=3e-3),
                                  batch_tokens=100, value_head=its_head, value_returns=returns, optimizer_state=state))
    assert runs[0].rows == runs[1].rows
    assert all(torch.equal(w, resumed_model.state_dict()[name]) for name, w in kept_model.state_dict().items())
    assert all(torch.equal(w, resumed_head.state_dict()[name]) for name, w in head.state_dict().items())


def test_without_a_head_the_update_is_unchanged(model, sequences):
    """The default arguments of the value term change nothing: same rows (no value_loss), same weights."""
    advantages = [np.random.default_rng(1).normal(size=len(s.token_ids)) * s.loss_mask for s in sequences]
    runs = []
    for kw in ({}, {"value_coef": 0.0, "value_clip": None}):
        updated = copy.deepcopy(model)
        report = policy_update(updated, sequences, advantages, PPOConfig(epochs=2, lr=1e-3), batch_tokens=100, **kw)
        runs.append((updated, report))
    (a, first), (b, second) = runs
    assert first.rows == second.rows and "value_loss" not in first.rows[0] and first.value_loss is None
    assert all(torch.equal(w, b.state_dict()[name]) for name, w in a.state_dict().items())


def test_bad_value_arguments_raise_before_any_step(model, sequences):
    head = ValueHead.for_model(model)
    zero = _per_token(sequences, 0.0)
    config = PPOConfig(epochs=1)
    with pytest.raises(ValueError, match="needs value_returns"):
        policy_update(copy.deepcopy(model), sequences, zero, config, value_head=head)
    with pytest.raises(ValueError, match="without a value_head"):
        policy_update(copy.deepcopy(model), sequences, zero, config, value_returns=zero)
    returns = _per_token(sequences, 1.0)
    returns[1][np.flatnonzero(sequences[1].loss_mask)[2]] = np.nan
    with pytest.raises(ValueError, match="sequence 1: value_returns are not finite at trained positions"):
        policy_update(copy.deepcopy(model), sequences, zero, config, value_head=head, value_returns=returns)
    with pytest.raises(ValueError, match="4 value_returns arrays"):
        policy_update(copy.deepcopy(model), sequences, zero, config, value_head=head, value_returns=returns[:4])
    # NaN where loss_mask = 0 is never read.
    untrained = [np.where(s.loss_mask == 1, 1.0, np.nan) for s in sequences]
    policy_update(copy.deepcopy(model), sequences, zero, config, value_head=head, value_returns=untrained)
