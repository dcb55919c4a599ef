"""SFT warm start: imitate the scripted expert, with injected mistakes, so RL starts from a policy
that sometimes succeeds but has room to improve.

Demonstrations are recorded by the same harness that records policy rollouts (``ScriptedActor``
plays the expert and, with probability ``mistake_rate``, a random tool call instead), so their
token ids, loss masks and segment structure are exactly what the policy will see. Each segment is
one training sequence — the context restarts at every compression — and the loss covers the
policy's own tokens (actions and summaries), never the context or tool output. Mistakes are
imitated too: that is what keeps the warm start imperfect.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from focus_core.agent.harness import AgentEpisode, AgentRunner
from focus_core.agent.scripted import ScriptedActor
from focus_core.config import AgentConfig, BootstrapConfig, ModelConfig
from focus_core.envs.base import Task, ToolEnv
from focus_core.policy.models import tiny_policy
from focus_core.policy.tokenizer import END, train_tokenizer

IGNORE = -100  # label of tokens the loss skips


@dataclass(frozen=True)
class SFTReport:
    sequences: int
    steps: int
    epochs_done: float
    trained_tokens: int
    final_loss: float
    seconds: float
    planned_steps: int  # the steps epochs and max_steps allow; fewer were taken when max_seconds stopped first


def warm_start(env_factory: Callable[[], ToolEnv], train_tasks: Sequence[Task], agent_config: AgentConfig,
               model_config: ModelConfig, bootstrap: BootstrapConfig, *, seed: int = 0,
               progress: Callable[[int, float], None] | None = None):
    """The embedded default policy: a tokenizer trained on the environment's text, a tiny Llama built
    from ``model_config``, and SFT on expert demonstrations of ``train_tasks`` (with injected mistakes).

    Returns ``(policy, report)``. Deterministic for a seed, up to float rounding of the training loop.
    """
    if not train_tasks:
        raise ValueError("warm_start needs training tasks; the environment returned none for its train split")
    env = env_factory()
    rng = np.random.default_rng(seed)
    # The tokenizer learns the environment's vocabulary from expert transcripts of training tasks
    # (a first pass with a byte-level bootstrap tokenizer only produces the text).
    corpus_tasks = [train_tasks[i] for i in rng.permutation(len(train_tasks))[:300]]
    bootstrap_tokenizer = train_tokenizer([env.system_prompt(), *(t.prompt for t in corpus_tasks)], vocab_size=300)
    text_runs = record_demonstrations(env_factory, corpus_tasks, bootstrap_tokenizer, agent_config, mistake_rate=0.0)
    corpus = [env.system_prompt(), *(turn.text for episode in text_runs for turn in episode.turns)]
    tokenizer = train_tokenizer(corpus, vocab_size=model_config.vocab_size)

    chosen = [train_tasks[i] for i in rng.integers(0, len(train_tasks), size=bootstrap.demonstrations)]
    demonstrations = record_demonstrations(env_factory, chosen, tokenizer, agent_config,
                                           mistake_rate=bootstrap.mistake_rate, seed=seed)
    policy = tiny_policy(tokenizer, seed=seed, layers=model_config.layers, hidden=model_config.hidden,
                         heads=model_config.heads, intermediate=model_config.intermediate,
                         max_context=model_config.max_context)
    report = supervised_finetune(policy.model, segment_sequences(demonstrations), lr=bootstrap.lr,
                                 batch_tokens=bootstrap.batch_tokens, epochs=bootstrap.epochs,
                                 max_seconds=bootstrap.max_seconds, max_steps=bootstrap.max_steps, seed=seed,
                                 pad_id=tokenizer.pad_token_id, context_weight=bootstrap.context_weight,
                                 progress=progress)
    return policy, report


def record_demonstrations(env_factory: Callable[[], ToolEnv], tasks: Sequence[Task], tokenizer,
                          agent_config: AgentConfig, *, mistake_rate: float = 0.15, seed: int = 0
                          ) -> list[AgentEpisode]:
    """One expert episode per task, with random actions injected at ``mistake_rate``."""
    end_id = tokenizer.convert_tokens_to_ids(END)
    actor = ScriptedActor(tokenizer, end_id, mistake_rate=mistake_rate, seed=seed)
    return AgentRunner(actor, env_factory, agent_config).run(tasks)


def segment_sequences(episodes: Sequence[AgentEpisode]) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per segment: labels are the ids where the loss mask is 1, else IGNORE."""
    sequences = []
    for episode in episodes:
        by_segment: dict[int, tuple[list[int], list[int]]] = {}
        for turn in episode.turns:
            ids, labels = by_segment.setdefault(turn.segment_idx, ([], []))
            ids += turn.token_ids
            labels += [t if m else IGNORE for t, m in zip(turn.token_ids, turn.loss_mask, strict=True)]
        sequences += [(ids, labels) for ids, labels in by_segment.values() if any(x != IGNORE for x in labels)]
    return sequences


def supervised_finetune(model: torch.nn.Module, sequences: Sequence[tuple[list[int], list[int]]], *,
                        lr: float = 1e-3, batch_tokens: int = 8192, epochs: float = 3.0, max_seconds: float = 300.0,
                        max_steps: int | None = None, seed: int = 0, pad_id: int = 0, context_weight: float = 0.0,
                        progress: Callable[[int, float], None] | None = None) -> SFTReport:
    """Causal-LM loss on the labelled tokens (plus ``context_weight`` times the loss on the rest, see
    ``labelled_token_loss``), AdamW with linear decay, until ``epochs``, ``max_steps`` or ``max_seconds``.

    ``max_steps`` makes the result independent of the machine's speed (the decay schedule then runs over
    ``max_steps`` steps); ``max_seconds`` alone stops wherever the clock says.

    Batches group sequences of similar length up to ``batch_tokens`` padded tokens.
    """
    if not sequences:
        raise ValueError("supervised_finetune got no sequence with a labelled token")
    rng = np.random.default_rng(seed)
    order = np.argsort([len(ids) for ids, _ in sequences], kind="stable")
    batches, current, longest = [], [], 0
    for index in order:
        length = len(sequences[index][0])
        if current and max(longest, length) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    batches.append(current)

    total_steps = max(1, int(epochs * len(batches)))
    if max_steps is not None:
        total_steps = min(total_steps, max_steps)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.05, 1 - step / total_steps))
    model.train()
    started, step, tokens, loss_value = time.perf_counter(), 0, 0, float("nan")
    try:
        while step < total_steps and time.perf_counter() - started < max_seconds:
            for batch_index in rng.permutation(len(batches)):
                if step >= total_steps or time.perf_counter() - started >= max_seconds:
                    break
                ids, labels, mask = _pad([sequences[i] for i in batches[batch_index]], pad_id)
                loss = labelled_token_loss(model, ids, labels, mask, context_weight=context_weight)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                step += 1
                tokens += int((labels != IGNORE).sum())
                loss_value = loss.item()
                if progress:
                    progress(step, loss_value)
    finally:
        model.eval()
    return SFTReport(len(sequences), step, step / len(batches), tokens, loss_value, time.perf_counter() - started,
                     total_steps)


def clock_cut_warning(report: SFTReport, bootstrap: BootstrapConfig) -> str | None:
    """One line when a warm start bounded by ``max_steps`` was stopped by ``max_seconds`` first: its weights
    then depend on the machine's load (a grid's concurrent bootstraps ran fewer steps than an idle one)."""
    if bootstrap.max_steps is None or report.steps >= report.planned_steps:
        return None
    return (f"SFT stopped by bootstrap.max_seconds = {bootstrap.max_seconds:g} after {report.steps:,} of "
            f"{report.planned_steps:,} steps, so this warm start depends on the machine's load (fix: raise "
            f"bootstrap.max_seconds, or start every run from one bootstrap with --init)")


def labelled_token_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor,
                        mask: torch.Tensor, *, context_weight: float = 0.0) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled positions, plus ``context_weight`` times the
    mean cross-entropy of predicting the other (context and tool) tokens.

    The output layer runs only where a target is scored (about one position in ten carries a label in
    agent transcripts): with a small model the vocabulary projection is a large share of the cost.
    The context term is an auxiliary language-modelling loss: the tiny model starts from scratch, and
    predicting tool output (which repeats names and numbers from the task and earlier turns) teaches
    it to read and copy its context sooner than the sparse action tokens alone would.
    """
    hidden = model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    head = model.get_output_embeddings()
    targets = labels[:, 1:]
    keep = targets != IGNORE
    loss = torch.nn.functional.cross_entropy(head(hidden[keep]).float(), targets[keep])
    if context_weight > 0:
        context = ~keep & (mask[:, 1:] > 0)
        if context.any():
            loss = loss + context_weight * torch.nn.functional.cross_entropy(head(hidden[context]).float(),
                                                                             ids[:, 1:][context])
    return loss


def _pad(batch: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (seq, lab) in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, : len(lab)] = torch.tensor(lab)
        mask[row, : len(seq)] = 1
    return ids, labels, mask
