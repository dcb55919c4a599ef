"""LoRA for the policy update, through ``peft``: the update trains low-rank adapters on the attention projections
instead of every weight, then merges them, so the checkpoint it writes is a plain model again.

Merged after every update because generation reads plain checkpoints: the hf backend loads the folder and the vllm
backend reloads its weights in place (``VLLMPolicy.load_weights``) — a server holding the base weights plus
per-iteration adapters would need vLLM's LoRA serving, whose adapters must then track every update. The price: the
adapters start at zero in every iteration (B = 0, so the merged model is unchanged until a step is taken) and
AdamW's moments restart with them, where a full update carries them over (``ppo.py``).
"""

from __future__ import annotations

import warnings

import torch

from focus_core.config import LoRAConfig


def with_lora(model: torch.nn.Module, config: LoRAConfig) -> torch.nn.Module:
    """``model`` with fresh adapters on ``config.targets`` (only they require gradients); the same outputs until a
    step is taken."""
    from peft import LoraConfig, get_peft_model

    missing = [t for t in config.targets if not any(name.endswith(t) for name, _ in model.named_modules())]
    if missing:
        raise ValueError(f"lora.targets: the model has no modules named {missing} (fix: names of its linear layers, "
                         f"e.g. q_proj, k_proj, v_proj, o_proj for Llama and Qwen)")
    adapters = LoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                          target_modules=list(config.targets), bias="none")
    with warnings.catch_warnings():  # peft 0.21 asks transformers a deprecated question; nothing to act on
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, adapters)


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """The plain model with the adapters added into its weights (W + (alpha / r) B A), adapters removed."""
    return model.merge_and_unload()
