"""Policy update: the trainer recomputes the sampler's log-probs at the sampling temperature (ratio 1 on the first
step), advantages move log-probs the right way, zero advantages move nothing, masked positions are inert, the two
loss aggregations scale as documented, clipping starts after the first step, the optimizer state survives a
checkpoint bit for bit, and bad numbers fail loudly."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from focus_core.config import PPOConfig
from focus_core.policy import chat_ids, tiny_policy, train_tokenizer
from focus_core.ppo import (
    OPTIMIZER_JSON,
    OPTIMIZER_TENSORS,
    TrainingSequence,
    UpdateReport,
    load_optimizer_state,
    policy_update,
    save_optimizer_state,
    sequence_logprobs,
)

CORPUS = [
    f'search("city {i % 7}") returned {i % 3} results. open(doc_{i}) -> The answer is {i * 7 % 13}.\n'
    for i in range(200)
]
SMALL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "max_context": 256}
ROW_KEYS = ["epoch", "step", "loss", "policy_loss", "kl", "clip_fraction", "entropy", "grad_norm", "lr"]
# How the ``sampled`` fixture samples; T is what every update of those sequences must be told.
T = 0.7
SAMPLING = {"temperature": T, "top_p": 0.9}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def policy():
    return tiny_policy(train_tokenizer(CORPUS, vocab_size=400), seed=3, **SMALL)


@pytest.fixture(scope="module")
def sampled(policy):
    """Sequences as rollouts store them: a single turn of two prompt lengths, and a two-turn sequence whose tool
    output sits between two trained spans (mask 0, 1…1, 0…0, 1…1), sampled at temperature T = 0.7 and top-p 0.9."""
    tok = policy.tokenizer
    prompts = [
        chat_ids(tok, [{"role": "user", "content": text}], add_generation_prompt=True)
        for text in ("Find city 3.", "Which entry says the answer is 5? Search the corpus for it.")
    ]
    sample = {"max_new_tokens": 16, "stop_token_ids": set(), **SAMPLING}
    sequences = []
    for prompt, group in zip(prompts, policy.generate(prompts, n=2, seed=1, **sample), strict=True):
        for g in group:
            sequences.append(_sequence(prompt, [(g.token_ids, g.logprobs, 1)]))
    first = sequences[0]
    tool = tok.encode("[1] entry 12: The answer is 5.")
    context = list(first.token_ids) + tool
    second = policy.generate([context], n=1, seed=2, **sample)[0][0]
    turns = [
        (first.token_ids[len(prompts[0]) :], first.old_logprobs[len(prompts[0]) :], 1),
        (tool, [0.0] * len(tool), 0),
        (second.token_ids, second.logprobs, 1),
    ]
    sequences.append(_sequence(prompts[0], turns))
    return sequences


def _sequence(prompt, turns) -> TrainingSequence:
    ids, logprobs, mask = list(prompt), [0.0] * len(prompt), [0] * len(prompt)
    for tokens, lps, trained in turns:
        ids += list(tokens)
        logprobs += [float(x) * trained for x in lps]
        mask += [trained] * len(tokens)
    return TrainingSequence(np.array(ids), np.array(logprobs, dtype=np.float32), np.array(mask))


def _advantages(sequences, value=None, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=len(s.loss_mask)) if value is None else np.full(len(s.loss_mask), float(value))) * s.loss_mask
        for s in sequences
    ]


def _update(policy, sequences, advantages, **kw) -> tuple[torch.nn.Module, UpdateReport]:
    """An update of a copy of the policy's model; at the sampling temperature T unless told otherwise."""
    model = copy.deepcopy(policy.model)
    config = PPOConfig(**{"epochs": 1, "lr": 1e-3, **kw.pop("config", {})})
    return model, policy_update(model, sequences, advantages, config, **{"temperature": T, **kw})


def _trained_logprob(model, sequence) -> float:
    return float(sequence_logprobs(model, [sequence], temperature=T)[0].sum())


# ---------------------------------------------------------------------- fidelity


def test_trainer_recomputes_the_sampler_logprobs(policy, sampled):
    """Right-padded batches of different lengths, with a tool span in the middle: at the sampling temperature the
    same log-probs as the left-padded branched sampler, and untempered the same as the unpadded ``score``; so the
    first step's ratio is 1."""
    batched = sequence_logprobs(policy.model, sampled, temperature=T)
    alone = [sequence_logprobs(policy.model, [s], temperature=T)[0] for s in sampled]
    untempered = sequence_logprobs(policy.model, sampled)
    for seq, together, single, raw in zip(sampled, batched, alone, untempered, strict=True):
        trained = seq.loss_mask == 1
        assert np.abs(together - seq.old_logprobs)[trained].max() < 1e-4
        np.testing.assert_allclose(together, single, atol=1e-5)
        assert not together[~trained].any()
        start = int(np.argmax(trained))
        scored = policy.score(list(seq.token_ids[:start]), list(seq.token_ids[start:]))
        np.testing.assert_allclose(raw[start:][trained[start:]], np.array(scored)[trained[start:]], atol=1e-5)

    _, report = _update(policy, sampled, _advantages(sampled), config={"epochs": 2})
    assert report.behaviour_logprob_gap < 1e-4  # |ratio − 1| < 1e-4 on every token of the first step
    first = report.rows[0]
    assert first["clip_fraction"] == 0.0 and first["kl"] == 0.0
    assert [list(row) for row in report.rows] == [ROW_KEYS] * len(report.rows)
    assert report.sequences == len(sampled) and report.policy_tokens == sum(int(s.loss_mask.sum()) for s in sampled)
    assert report.tokens == sum(len(s.token_ids) for s in sampled)


def test_the_ratio_is_taken_at_the_sampling_temperature(policy, sampled):
    """``sampled`` was drawn at T = 0.7 with top-p 0.9. The sampler stores log_softmax(logits / T), without top-p,
    and an update told T recomputes exactly that: ratio 1 on its first, on-policy minibatch. Untempered log-probs
    on the trainer's side (temperature 1, what both sides used to compute) start the update off-policy."""
    advantages = _advantages(sampled)
    _, tempered = _update(policy, sampled, advantages)
    _, untempered = _update(policy, sampled, advantages, temperature=1.0)
    assert tempered.behaviour_logprob_gap < 1e-4
    assert untempered.behaviour_logprob_gap > 1e-2
    assert tempered.rows[0]["clip_fraction"] == 0.0
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature=.* must be > 0"):
            _update(policy, sampled, advantages, temperature=bad)
        with pytest.raises(ValueError, match="temperature=.* must be > 0"):
            sequence_logprobs(policy.model, sampled, temperature=bad)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_the_logprob(policy, sampled, sign):
    sequence = sampled[-1]
    before = _trained_logprob(policy.model, sequence)
    model, _ = _update(policy, [sequence], [sign * sequence.loss_mask.astype(float)])
    assert sign * (_trained_logprob(model, sequence) - before) > 0.05


def test_zero_advantages_change_nothing(policy, sampled):
    model, report = _update(policy, sampled, _advantages(sampled, value=0.0), config={"epochs": 2}, batch_tokens=64)
    assert len(report.rows) > 2
    assert all(row["grad_norm"] == 0.0 and row["loss"] == 0.0 for row in report.rows)
    for name, weight in policy.model.state_dict().items():
        assert torch.equal(weight, model.state_dict()[name]), name


def test_masked_positions_cannot_change_anything(policy, sampled):
    """verl-style invariance: garbage where loss_mask = 0 gives the same steps and the same weights."""
    rng = np.random.default_rng(5)
    advantages = _advantages(sampled)
    garbage_sequences, garbage_advantages = [], []
    for seq, adv in zip(sampled, advantages, strict=True):
        untrained = seq.loss_mask == 0
        junk = rng.choice([np.nan, np.inf, -np.inf, 1e9, -37.0, 5.0], size=len(adv))
        garbage_sequences.append(
            TrainingSequence(seq.token_ids, np.where(untrained, junk, seq.old_logprobs), seq.loss_mask)
        )
        garbage_advantages.append(np.where(untrained, junk[::-1], adv))
    kw = {"config": {"epochs": 2, "entropy_coef": 0.01}, "batch_tokens": 96, "seed": 4}
    clean_model, clean = _update(policy, sampled, advantages, **kw)
    dirty_model, dirty = _update(policy, garbage_sequences, garbage_advantages, **kw)
    assert clean.rows == dirty.rows and len(clean.rows) > 2
    for name, weight in clean_model.state_dict().items():
        assert torch.equal(weight, dirty_model.state_dict()[name]), name


# ---------------------------------------------------------------------- aggregation, clipping, KL


def test_constant_normaliser_scaling(policy):
    """token_mean divides each minibatch's sum by its policy tokens T; constant by C · n̄, n̄ = mean sequences per
    minibatch of the epoch. Four 40-token and two 80-token inputs with 10 trained tokens each, 160 padded tokens
    per minibatch: minibatches of 4 and 2 sequences, n̄ = 3, so constant/token_mean = 10·rows / (C·3)."""
    rng = np.random.default_rng(0)
    sequences = []
    for length in (41, 41, 41, 41, 81, 81):
        mask = np.zeros(length, dtype=int)
        mask[rng.choice(np.arange(1, length), size=10, replace=False)] = 1
        sequences.append(TrainingSequence(rng.integers(0, 400, size=length), np.zeros(length), mask))
    sequences = [
        TrainingSequence(s.token_ids, lp, s.loss_mask)
        for s, lp in zip(sequences, sequence_logprobs(policy.model, sequences, temperature=T), strict=True)
    ]
    advantages = _advantages(sequences, seed=1)
    # A negligible rate keeps the weights (and so the per-step sums) the same in both runs.
    common = {"epochs": 1, "lr": 1e-12}
    _, mean = _update(policy, sequences, advantages, config=common, batch_tokens=160)
    _, constant = _update(
        policy,
        sequences,
        advantages,
        config={**common, "loss_agg": "constant", "constant_normaliser": 64},
        batch_tokens=160,
    )
    ratios = sorted(c["policy_loss"] / m["policy_loss"] for c, m in zip(constant.rows, mean.rows, strict=True))
    np.testing.assert_allclose(ratios, [10 * 2 / (64 * 3), 10 * 4 / (64 * 3)], rtol=1e-5)


def test_clip_fraction_is_zero_on_policy_and_grows_after_a_large_step(policy, sampled):
    _, report = _update(policy, sampled, _advantages(sampled), config={"epochs": 3, "lr": 3e-2})
    assert len(report.rows) == 3  # one minibatch per epoch
    assert report.rows[0]["clip_fraction"] == 0.0
    assert report.rows[-1]["clip_fraction"] > 0.0
    assert report.approx_kl > 0.0 and report.clip_fraction > 0.0


class _Stop(Exception):
    pass


def test_target_kl_stops_at_the_first_minibatch_beyond_it_without_stepping_on_it(policy, sampled):
    """``ppo.target_kl`` (SB3's and CleanRL's early stop): each minibatch's KL to the sampling policy is measured
    before its step; the first one above target_kl takes no step, and no later one does. Seen: one update of a
    critic run on the 5-hop chain (lr 1e-4, whitened advantages) went from KL ~0 to 0.73 in one ordinary step,
    then to 2.2 over the remaining 38 steps, and the run never came back (td0_critic, seed 105)."""
    advantages = _advantages(sampled, seed=1)
    settings = {"epochs": 6, "lr": 3e-2}
    _, free = _update(policy, sampled, advantages, config=settings, batch_tokens=64)
    assert free.kl_stop_step is None and len(free.kls_before) == len(free.rows)
    target = 0.05
    beyond = next(step for step, kl in enumerate(free.kls_before) if kl > target)
    assert 0 < beyond < len(free.rows) - 1  # the rate leaves the trust region partway through
    guarded_model, guarded = _update(policy, sampled, advantages, config={**settings, "target_kl": target},
                                     batch_tokens=64)
    assert guarded.kl_stop_step == beyond and len(guarded.rows) == beyond + 1
    np.testing.assert_allclose(guarded.kls_before, free.kls_before[: beyond + 1], rtol=1e-6, atol=1e-9)
    assert guarded.approx_kl == pytest.approx(np.mean(guarded.kls_before))
    # The stopping minibatch took no step: the weights are those of the free update after its first `beyond` steps.
    def stop_after(row):
        if row["step"] == beyond - 1:
            raise _Stop
    cut = copy.deepcopy(policy.model)
    with pytest.raises(_Stop):
        policy_update(cut, sampled, advantages, PPOConfig(**settings), temperature=T, batch_tokens=64,
                      progress=stop_after)
    for name, weight in cut.state_dict().items():
        assert torch.equal(weight, guarded_model.state_dict()[name]), name
    # A target no minibatch reaches changes nothing.
    _, loose = _update(policy, sampled, advantages, config={**settings, "target_kl": 1e6}, batch_tokens=64)
    assert loose.kl_stop_step is None and [r["loss"] for r in loose.rows] == [r["loss"] for r in free.rows]


def test_kl_to_reference_starts_at_zero_and_pulls_back(policy, sampled):
    advantages = _advantages(sampled)
    reference = policy.model
    settings = {"epochs": 3, "lr": 1e-2}
    _, free = _update(policy, sampled, advantages, config=settings, reference_model=reference)
    _, tied = _update(policy, sampled, advantages, config={**settings, "kl_coef": 10.0}, reference_model=reference)
    assert free.rows[0]["kl"] < 1e-9 and free.rows[-1]["kl"] > 0.0
    assert tied.rows[-1]["kl"] < free.rows[-1]["kl"]
    with pytest.raises(ValueError, match="needs a reference_model"):
        _update(policy, sampled, advantages, config={"kl_coef": 0.1})


def test_zero_advantages_change_nothing_after_a_real_update_either(policy, sampled):
    """An update with no signal after one with signal: AdamW's carried momentum moved every weight with a zero
    gradient (seen: a GRPO iteration whose every group failed moved the tiny policy to approx KL 0.11, which then
    drifted off the tools' menus). A step with no gradient is no step: weights and optimizer state stay as they were."""
    model, first = _update(policy, sampled, _advantages(sampled))
    before = copy.deepcopy(model.state_dict())
    second = policy_update(model, sampled, _advantages(sampled, value=0.0), PPOConfig(epochs=2, lr=1e-3),
                           optimizer_state=first.optimizer_state, temperature=T, batch_tokens=64)
    assert len(second.rows) > 2 and all(row["grad_norm"] == 0.0 for row in second.rows)
    for name, weight in before.items():
        assert torch.equal(weight, model.state_dict()[name]), name
    _assert_same(first.optimizer_state, second.optimizer_state)
    # ... and the next step with a gradient continues the momentum as if the empty steps had not been there.
    steps = first.optimizer_state["state"][0]["step"].item()  # the state continues in place: read it first
    mixed = [a if k % 2 else np.zeros_like(a) for k, a in enumerate(_advantages(sampled, seed=1))]
    third = policy_update(model, sampled, mixed, PPOConfig(epochs=2, lr=1e-3), optimizer_state=first.optimizer_state,
                          temperature=T, batch_tokens=64)
    stepped = [row for row in third.rows if row["grad_norm"] > 0.0]
    assert 0 < len(stepped) < len(third.rows)  # some minibatches hold only zero advantages, some do not
    assert third.optimizer_state["state"][0]["step"].item() == steps + len(stepped)


def test_optimizer_state_carries_over_with_this_calls_rate(policy, sampled):
    model, first = _update(policy, sampled, _advantages(sampled))
    second = policy_update(
        model, sampled, _advantages(sampled), PPOConfig(epochs=1, lr=5e-4), optimizer_state=first.optimizer_state
    )
    assert second.rows[0]["lr"] == 5e-4
    assert second.optimizer_state["state"][0]["step"].item() == 2
    assert second.optimizer_state["param_groups"][0]["lr"] == 5e-4


def _assert_same(a, b, path="state") -> None:
    """Equal all the way down, types included: tensors bit for bit with their dtype, tuples stay tuples, integer
    keys stay integers (JSON alone would turn them into lists and strings)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_optimizer_state_round_trips_through_a_folder_without_pickles(policy, sampled, tmp_path):
    _, report = _update(policy, sampled, _advantages(sampled))
    state = report.optimizer_state
    assert load_optimizer_state(tmp_path) is None  # no optimizer files: a fresh start
    save_optimizer_state(state, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted([OPTIMIZER_JSON, OPTIMIZER_TENSORS])
    loaded = load_optimizer_state(tmp_path / "ckpt")
    _assert_same(state, loaded)
    assert loaded["param_groups"][0]["betas"] == (0.9, 0.999) and len(loaded["state"]) == len(state["state"])
    torch.optim.AdamW(copy.deepcopy(policy.model).parameters()).load_state_dict(loaded)

    # Whatever else a state may hold: other dtypes, 0-d tensors, non-finite hyper-parameters, nesting.
    odd = {"state": {3: {"step": torch.tensor(7.0), "m": torch.ones(2, 3, dtype=torch.bfloat16)}},
           "param_groups": [{"lr": 1e-3, "eps": float("inf"), "betas": (0.5, 0.25), "params": [3], "fused": None,
                             "note": "x", "flags": [True, 2, (1, [0.1])]}]}
    save_optimizer_state(odd, tmp_path / "odd")
    _assert_same(odd, load_optimizer_state(tmp_path / "odd"))
    with pytest.raises(TypeError, match="cannot store a set at param_groups/0/bad"):
        save_optimizer_state({"param_groups": [{"bad": {1, 2}}]}, tmp_path / "bad")

    (tmp_path / "ckpt" / OPTIMIZER_TENSORS).unlink()
    with pytest.raises(FileNotFoundError, match=f"has one optimizer file but not {OPTIMIZER_TENSORS}"):
        load_optimizer_state(tmp_path / "ckpt")


def test_a_checkpointed_optimizer_state_continues_bit_for_bit(policy, sampled, tmp_path):
    """Two updates with the state carried through save/load take exactly the steps of two updates that kept it in
    memory; a fresh optimizer for the second takes other steps (so the comparison can fail)."""
    advantages = _advantages(sampled)
    kw = {"batch_tokens": 96, "seed": 1, "temperature": T}
    model, first = _update(policy, sampled, advantages, **kw)
    save_optimizer_state(first.optimizer_state, tmp_path)  # before the in-memory run continues it in place
    resumed, fresh = copy.deepcopy(model), copy.deepcopy(model)
    config = PPOConfig(epochs=2, lr=1e-3)
    kept = policy_update(model, sampled, advantages, config, optimizer_state=first.optimizer_state, **kw)
    again = policy_update(resumed, sampled, advantages, config, optimizer_state=load_optimizer_state(tmp_path), **kw)
    policy_update(fresh, sampled, advantages, config, **kw)
    assert len(kept.rows) > 2 and [r["loss"] for r in kept.rows] == [r["loss"] for r in again.rows]
    for name, weight in model.state_dict().items():
        assert torch.equal(weight, resumed.state_dict()[name]), name
    assert not all(torch.equal(weight, fresh.state_dict()[name]) for name, weight in model.state_dict().items())
    _assert_same(kept.optimizer_state, again.optimizer_state)


# ---------------------------------------------------------------------- failures


def test_non_finite_inputs_raise_before_any_step(policy, sampled):
    model = copy.deepcopy(policy.model)
    weights = copy.deepcopy(model.state_dict())
    steps = []
    advantages = _advantages(sampled)
    advantages[1][np.flatnonzero(sampled[1].loss_mask)[3]] = np.nan
    with pytest.raises(ValueError, match=r"sequence 1: advantages are not finite at trained positions"):
        policy_update(model, sampled, advantages, PPOConfig(lr=1e-2), progress=steps.append)
    bad = sampled[2]
    broken = TrainingSequence(bad.token_ids, np.where(bad.loss_mask == 1, -np.inf, 0.0), bad.loss_mask)
    with pytest.raises(ValueError, match=r"sequence 2: old_logprobs are not finite"):
        policy_update(model, [*sampled[:2], broken], _advantages(sampled[:3]), PPOConfig(lr=1e-2))
    assert steps == []
    assert all(torch.equal(w, model.state_dict()[k]) for k, w in weights.items())


def test_non_finite_loss_names_the_step_and_cause(policy, sampled):
    model = copy.deepcopy(policy.model)
    with torch.no_grad():
        model.get_output_embeddings().weight[:, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"new log-probabilities at epoch 0, step 0: .*logits are not"):
        policy_update(model, sampled, _advantages(sampled), PPOConfig())
