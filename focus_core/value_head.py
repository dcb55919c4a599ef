"""A token-level value head on the policy's decoder, for PPO with GAE (TRL's "causal LM with value head").

The head is one linear map from the decoder's final hidden state to a scalar. It shares the whole decoder with the
policy: no second model to hold, run or keep in step, which is what makes per-token values affordable next to a
policy that already costs one forward per token. ``ppo.policy_update(..., value_head=...)`` trains it jointly with
the policy, on the same hidden states the logits come from.

Convention: for a sequence of token ids x_0 … x_{L−1}, ``values[t]`` is V of the state in which token t is
generated, i.e. the head on the hidden state at position t − 1, after the model has read x_0 … x_{t−1}; that is the
position whose logits give token t's log-prob, so value, log-prob and advantage of token t all sit at index t, as
``loss_mask`` and ``old_logprobs`` do. ``values[0]`` = 0: the first token has no state to condition on.

The weights start small (normal, std 1e-3; bias 0), so the first values are ≈ 0 and the first value gradients
into the shared decoder are small, instead of a random head's O(1) errors pulling the policy's representation
around before the head has learned anything. The head runs in fp32 whatever the decoder's dtype: it is a few
thousand weights, and a regression target in bf16 would round away the small differences GAE takes.

Checkpoints are ``value_head.safetensors`` (weight, bias) and ``value_head.json`` (hidden size, format) in a
folder, typically the policy's checkpoint folder; no pickles.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from focus_core.ppo import SequenceLike, scatter_masked, teacher_forced, trained_hidden

TENSORS_FILE = "value_head.safetensors"
METADATA_FILE = "value_head.json"
_FORMAT = 1
_INIT_STD = 1e-3


class ValueHead(torch.nn.Module):
    """hidden state [..., hidden_size] → value [...] (fp32). ``seed`` makes the initial weights reproducible
    without touching the global random state."""

    def __init__(self, hidden_size: int, *, seed: int = 0) -> None:
        super().__init__()
        if hidden_size < 1:
            raise ValueError(f"ValueHead: hidden_size={hidden_size} must be >= 1")
        self.hidden_size = int(hidden_size)
        self.linear = torch.nn.Linear(self.hidden_size, 1, dtype=torch.float32)
        with torch.no_grad():
            torch.nn.init.normal_(self.linear.weight, std=_INIT_STD, generator=torch.Generator().manual_seed(seed))
            self.linear.bias.zero_()

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, seed: int = 0) -> ValueHead:
        """A fresh head sized for ``model`` (a Hugging Face causal LM), on its device."""
        device = next(model.parameters()).device
        return cls(model.config.hidden_size, seed=seed).to(device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden.to(self.linear.weight.dtype))[..., 0]

    def save(self, folder: str | Path) -> None:
        """Write ``value_head.safetensors`` and ``value_head.json`` into ``folder`` (created if needed)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in self.linear.state_dict().items()}
        save_file(tensors, folder / TENSORS_FILE)
        (folder / METADATA_FILE).write_text(json.dumps({"format": _FORMAT, "hidden_size": self.hidden_size}))

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu") -> ValueHead:
        """The head ``save`` wrote to ``folder``; ``FileNotFoundError`` when the folder holds none."""
        folder = Path(folder)
        if not (folder / TENSORS_FILE).is_file() or not (folder / METADATA_FILE).is_file():
            raise FileNotFoundError(
                f"ValueHead.load: no value head in {folder} (expected {TENSORS_FILE} and {METADATA_FILE}, "
                "written by ValueHead.save)"
            )
        metadata = json.loads((folder / METADATA_FILE).read_text())
        if metadata.get("format") != _FORMAT:
            raise ValueError(f"ValueHead.load: {folder / METADATA_FILE} has format {metadata.get('format')!r}, "
                             f"expected {_FORMAT}")
        head = cls(metadata["hidden_size"])
        head.linear.load_state_dict(load_file(folder / TENSORS_FILE))  # strict: shapes and names must match
        return head.to(device)


@torch.no_grad()
def token_values(
    model: torch.nn.Module, head: ValueHead, sequences: Sequence[SequenceLike], *, batch_tokens: int = 8192
) -> list[np.ndarray]:
    """``values[t]`` (see the module doc) of each sequence's trained tokens (``loss_mask`` 1), 0 elsewhere.

    Context and tool positions are left at 0, as ``ppo.sequence_logprobs`` leaves their log-probs: the head is only
    ever fitted at trained tokens, so its output elsewhere is not a value estimate, and GAE over the policy's own
    tokens reads none there. Batched and right-padded as in ``policy_update`` (only ``token_ids`` and ``loss_mask``
    are read), so padding and ``batch_tokens`` change the values by float rounding only.
    """
    if batch_tokens < 1:
        raise ValueError(f"token_values: batch_tokens={batch_tokens} must be >= 1")
    head.to(next(model.parameters()).device)
    was_training = model.training
    model.eval()  # the numerics of the sampler and of policy_update (no dropout)
    try:
        return teacher_forced(
            model, sequences, batch_tokens, lambda batch: scatter_masked(head(trained_hidden(model, batch)), batch.mask)
        )
    finally:
        model.train(was_training)

