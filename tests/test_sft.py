"""SFT warm start: demonstrations are recorded by the harness, segments become labelled sequences,
and fine-tuning on them teaches a tiny model the expert's moves."""

import numpy as np

from focus_core.agent.harness import AgentRunner
from focus_core.agent.sft import IGNORE, record_demonstrations, segment_sequences, supervised_finetune
from focus_core.config import AgentConfig
from focus_core.policy.models import tiny_policy
from focus_core.policy.tokenizer import train_tokenizer
from tests.test_agent_harness import LookupEnv


def test_segment_sequences_label_only_policy_tokens():
    env = LookupEnv()
    tokenizer = train_tokenizer([env.system_prompt(), 'look(key="alpha") answer(text="42") see card beta'] * 4,
                                vocab_size=400)
    config = AgentConfig(compress_every_turns=2)
    episodes = record_demonstrations(LookupEnv, env.tasks("train"), tokenizer, config, mistake_rate=0.0)
    sequences = segment_sequences(episodes)
    assert len(sequences) == sum(e.n_segments for e in episodes)
    for episode in episodes:
        generated = sum(t.generated_tokens for t in episode.turns)
        assert generated == episode.generated_tokens > 0
    for ids, labels in sequences:
        assert len(ids) == len(labels)
        assert all(label in (IGNORE, token) for token, label in zip(ids, labels, strict=True))


def test_finetuning_on_demonstrations_makes_the_tiny_model_solve_the_task():
    env = LookupEnv()
    tokenizer = train_tokenizer([env.system_prompt(), 'look(key="alpha") look(key="beta") answer(text="42") '
                                 "see card beta value 42 Correct."] * 4, vocab_size=420)
    config = AgentConfig(max_turns=4, max_action_tokens=24, compress_every_turns=8)
    policy = tiny_policy(tokenizer, layers=2, hidden=64, heads=2, intermediate=128, max_context=512)
    before = AgentRunner(policy, LookupEnv, config).run(env.tasks("heldout"), seed=0)
    demos = record_demonstrations(LookupEnv, env.tasks("train") * 4, tokenizer, config, mistake_rate=0.0)
    report = supervised_finetune(policy.model, segment_sequences(demos), lr=1e-2, epochs=150, max_seconds=90)
    after = AgentRunner(policy, LookupEnv, config).run(env.tasks("heldout"), seed=0)
    assert np.mean([e.reward for e in before]) == 0.0
    assert report.final_loss < 0.05 and report.steps > 10
    assert np.mean([e.reward for e in after]) >= 2 / 3


def test_labelled_token_loss_equals_the_full_causal_lm_loss():
    """Running the output layer only at labelled positions must not change the loss."""
    import torch

    from focus_core.agent.sft import _pad, labelled_token_loss

    tokenizer = train_tokenizer(["alpha beta gamma delta"] * 4, vocab_size=300)
    policy = tiny_policy(tokenizer, layers=1, hidden=32, heads=2, intermediate=64)
    rng = np.random.default_rng(0)
    batch = []
    for length in (9, 14, 6):
        ids = rng.integers(6, len(tokenizer), size=length).tolist()
        labels = [t if rng.random() < 0.4 else IGNORE for t in ids]
        labels[-1] = ids[-1]
        batch.append((ids, labels))
    ids, labels, mask = _pad(batch, pad_id=0)
    with torch.no_grad():
        reference = policy.model(input_ids=ids, attention_mask=mask, labels=labels).loss
        ours = labelled_token_loss(policy.model, ids, labels, mask)
        # The auxiliary context loss is the loss of predicting the unlabelled real tokens.
        context_labels = torch.where((labels == IGNORE) & (mask > 0), ids, torch.full_like(ids, IGNORE))
        context = policy.model(input_ids=ids, attention_mask=mask, labels=context_labels).loss
        both = labelled_token_loss(policy.model, ids, labels, mask, context_weight=0.5)
    assert torch.allclose(ours, reference, atol=1e-5)
    assert torch.allclose(both, reference + 0.5 * context, atol=1e-5)


def test_a_step_bounded_warm_start_that_the_clock_cut_short_says_so():
    """``bootstrap.max_steps`` promises the same warm start on any machine; under load ``max_seconds`` could
    stop it first (a grid's bootstraps differed from an idle run's this way), and that must not pass silently."""
    from focus_core.agent.sft import clock_cut_warning
    from focus_core.config import BootstrapConfig

    tokenizer = train_tokenizer(["alpha beta gamma delta"] * 4, vocab_size=300)
    policy = tiny_policy(tokenizer, layers=1, hidden=32, heads=2, intermediate=64)
    rng = np.random.default_rng(0)
    sequences = [(ids, ids) for ids in (rng.integers(6, len(tokenizer), size=12).tolist() for _ in range(8))]

    cut = supervised_finetune(policy.model, sequences, epochs=1e6, max_steps=1_000_000, max_seconds=0.2)
    assert 0 < cut.steps < cut.planned_steps == 1_000_000
    warning = clock_cut_warning(cut, BootstrapConfig(max_steps=1_000_000, max_seconds=0.2))
    assert warning is not None and f"after {cut.steps:,} of 1,000,000 steps" in warning
    assert "bootstrap.max_seconds" in warning and "fix:" in warning

    whole = supervised_finetune(policy.model, sequences, epochs=1e6, max_steps=3, max_seconds=600)
    assert whole.steps == whole.planned_steps == 3
    assert clock_cut_warning(whole, BootstrapConfig(max_steps=3, max_seconds=600)) is None
    # Without max_steps the clock is the intended bound (the embedded default): nothing to warn about.
    assert clock_cut_warning(cut, BootstrapConfig(max_seconds=0.2)) is None
