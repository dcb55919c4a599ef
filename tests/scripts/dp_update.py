"""One ``policy_update`` on a fixed problem, run alone or as each process of ``torchrun --nproc_per_node N``
(``tests/test_ppo_data_parallel.py``): rank 0 saves the updated weights and the step rows to ``argv[1]``."""

from __future__ import annotations

import sys

import numpy as np
import torch

from focus_core.config import PPOConfig
from focus_core.policy import tiny_policy, train_tokenizer
from focus_core.ppo import TrainingSequence, accelerate_data_parallel, policy_update, sequence_logprobs

CORPUS = [f"search city {i % 7} returned {i % 3} results, the answer is {i * 7 % 13}." for i in range(100)]


def problem(agg: str, target_kl: float | None = None):
    """The model, 7 sequences of mixed lengths with on-policy log-probs, their advantages and the config."""
    torch.manual_seed(0)
    policy = tiny_policy(train_tokenizer(CORPUS, vocab_size=300), seed=3, layers=1, hidden=32, heads=2,
                         intermediate=64, max_context=256)
    rng = np.random.default_rng(0)
    sequences = []
    for length in (20, 33, 12, 41, 27, 9, 30):
        ids = rng.integers(5, 300, size=length)
        mask = (rng.random(length) < 0.6).astype(np.int64)
        mask[0] = 0
        sequences.append(TrainingSequence(ids, np.zeros(length, dtype=np.float32), mask))
    old = sequence_logprobs(policy.model, sequences, temperature=1.0)
    sequences = [TrainingSequence(s.token_ids, (o * s.loss_mask).astype(np.float32), s.loss_mask)
                 for s, o in zip(sequences, old, strict=True)]
    advantages = [rng.normal(size=len(s.loss_mask)) * s.loss_mask for s in sequences]
    config = PPOConfig(epochs=2, lr=1e-2, loss_agg=agg, constant_normaliser=64 if agg == "constant" else None,
                       kl_coef=0.0, entropy_coef=0.01, target_kl=target_kl)
    return policy.model, sequences, advantages, config


def run(agg: str, data_parallel=None, target_kl: float | None = None):
    model, sequences, advantages, config = problem(agg, target_kl)
    # batch_tokens small enough for several minibatches, one of which holds a single sequence
    report = policy_update(model, sequences, advantages, config, batch_tokens=90, seed=1,
                           data_parallel=data_parallel)
    return model, report


if __name__ == "__main__":
    torch.set_num_threads(1)
    out, agg = sys.argv[1], sys.argv[2]
    target_kl = float(sys.argv[3]) if len(sys.argv) > 3 else None
    data_parallel = accelerate_data_parallel()
    assert data_parallel is not None and data_parallel.world == 2, "run me with torchrun --nproc_per_node 2"
    model, report = run(agg, data_parallel, target_kl)
    if data_parallel.rank == 0:
        torch.save({"state": model.state_dict(), "rows": report.rows, "gap": report.behaviour_logprob_gap,
                    "approx_kl": report.approx_kl, "kl_stop_step": report.kl_stop_step}, out)
    # Regression: without it, the process that finished first sometimes aborted at exit (gloo threads alive).
    data_parallel.close()
