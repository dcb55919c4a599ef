"""Policy backends behind one interface (``Policy``): sampling with log-probs, teacher-forced scoring, checkpoints.

    from focus_core.policy import load_policy, train_tokenizer, chat_ids
    tok = train_tokenizer(texts)                       # byte-level BPE + chat template, <|end|> ends a turn
    policy = load_policy("tiny", tokenizer=tok)        # or "smollm2", or a Hugging Face folder path
    prompt = chat_ids(tok, messages, add_generation_prompt=True)
    [[gen]] = policy.generate([prompt], max_new_tokens=128, seed=7)   # gen.token_ids, gen.logprobs
"""

from focus_core.policy.base import FinishReason, Generation, Policy
from focus_core.policy.hf import HFPolicy, read_version
from focus_core.policy.models import (
    data_dir,
    folder_policy,
    load_policy,
    smollm2_available,
    smollm2_folder,
    smollm2_policy,
    tiny_config,
    tiny_policy,
)
from focus_core.policy.tokenizer import (
    CHAT_TEMPLATE,
    END,
    EOS,
    ROLES,
    chat_ids,
    end_of_turn_ids,
    generation_prompt_ids,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "END",
    "EOS",
    "ROLES",
    "FinishReason",
    "Generation",
    "HFPolicy",
    "Policy",
    "chat_ids",
    "data_dir",
    "end_of_turn_ids",
    "folder_policy",
    "generation_prompt_ids",
    "load_policy",
    "load_tokenizer",
    "read_version",
    "smollm2_available",
    "smollm2_folder",
    "smollm2_policy",
    "tiny_config",
    "tiny_policy",
    "train_tokenizer",
]
