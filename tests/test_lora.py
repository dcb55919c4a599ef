"""LoRA for the update (focus_core/lora.py): only the adapters train, the merged model computes what the adapted
one did, and a FOCUS run with `lora` set writes plain checkpoints that the next iteration loads."""

from __future__ import annotations

import pytest
import torch

from focus_core.config import LoRAConfig, load_config
from focus_core.lora import merged, with_lora
from focus_core.ppo import policy_update
from tests.scripts.dp_update import problem


def test_adapters_alone_train_and_the_merge_keeps_what_they_learned():
    model, sequences, advantages, config = problem("token_mean")
    before = {name: w.clone() for name, w in model.state_dict().items()}
    ids = torch.as_tensor(sequences[0].token_ids[None, :], dtype=torch.long)
    with torch.no_grad():
        plain = model(ids).logits
    adapted = with_lora(model, LoRAConfig(rank=4, alpha=8.0, targets=["q_proj", "v_proj"]))
    trainable = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    with torch.no_grad():  # B = 0: the same model until a step is taken
        torch.testing.assert_close(adapted(ids).logits, plain)
    report = policy_update(adapted, sequences, advantages, config, batch_tokens=90, seed=1)
    assert report.rows and all(row["grad_norm"] > 0 for row in report.rows)
    with torch.no_grad():
        learned = adapted(ids).logits
    assert (learned - plain).abs().max() > 1e-4
    plain_again = merged(adapted)
    with torch.no_grad():
        torch.testing.assert_close(plain_again(ids).logits, learned, rtol=1e-4, atol=1e-5)
    state = plain_again.state_dict()
    assert set(state) == set(before) and not any("lora" in name for name in state)
    # only the targeted projections moved, by the merged low-rank product
    moved = {name for name in state if not torch.equal(state[name], before[name])}
    assert moved and all(name.endswith(("q_proj.weight", "v_proj.weight")) for name in moved)


def test_unknown_targets_name_the_fix():
    model = problem("token_mean")[0]
    with pytest.raises(ValueError, match="lora.targets: the model has no modules named"):
        with_lora(model, LoRAConfig(targets=["query_key_value"]))


def test_gpu_config_validates_with_a_model_folder_in_place_of_the_qwen_one(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = load_config("configs/gpu/qwen.yaml", [f"model.source={tmp_path}"])
    assert cfg.lora is not None and cfg.generation.backend == "vllm"
    assert cfg.model.source == str(tmp_path)
