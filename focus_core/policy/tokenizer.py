"""A byte-level BPE tokenizer with a chat template, trained offline on the caller's texts.

Conversation format (no separators between turns, no BOS):

    <|system|>You are …<|end|><|user|>Find …<|end|><|assistant|>search("…")<|end|><|tool|>[1] …<|end|><|assistant|>

- roles: ``system``, ``user``, ``assistant`` and ``tool`` (an environment observation);
- every turn ends with ``<|end|>``; for the policy that is the stop token of an assistant turn;
- ``add_generation_prompt=True`` appends ``<|assistant|>``;
- ``<|endoftext|>`` is the eos and pad token.

Special tokens are matched before byte-level pre-tokenization, so text never merges across a marker: the ids of
a whole conversation are exactly the concatenation of the ids of its turns rendered one by one (see
``chat_ids``). The agent harness relies on this to extend a context with new turns without re-tokenizing it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
END = "<|end|>"
ROLES = ("system", "user", "assistant", "tool")
ROLE_MARKERS = {role: f"<|{role}|>" for role in ROLES}
# Fixed order: these take ids 0..5 in every trained tokenizer.
SPECIAL_TOKENS = [EOS, END, *ROLE_MARKERS.values()]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('unknown chat role ' ~ message['role'] ~ '; expected system, user, assistant or tool') }}"
    "{%- endif -%}"
    "{{ '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``texts`` and wrap it with the chat template; same texts → same tokenizer.

    Every byte is in the initial alphabet, so any text encodes (no unknown token) and decodes back exactly.
    """
    minimum = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} is too small: the specials and 256 byte symbols need {minimum}")
    core = Tokenizer(models.BPE())
    # add_prefix_space=False keeps "x" and " x" distinct, so encoding a turn never changes its first byte.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(texts), trainer=trainer)
    return wrap_tokenizer(core)


def wrap_tokenizer(core: Tokenizer) -> PreTrainedTokenizerFast:
    """A transformers tokenizer around a trained ``tokenizers.Tokenizer`` with FOCUS's specials and template."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        padding_side="left",  # batched generation pads on the left
        clean_up_tokenization_spaces=False,  # keep decode(encode(text)) == text
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer written by ``save_pretrained`` (ours or any Hugging Face folder)."""
    return AutoTokenizer.from_pretrained(str(path))


def chat_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template.

    Renders to text and encodes without extra specials, which gives plain ids for any tokenizer version (newer
    transformers return a dict from ``apply_chat_template(tokenize=True)``).
    """
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def generation_prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids ``add_generation_prompt=True`` appends after a conversation (``<|assistant|>`` for ours).

    Found as the difference between a one-turn conversation rendered with and without the prompt, so it works
    for any template whose generation prompt is a pure suffix.
    """
    turn = [{"role": "user", "content": "x"}]
    without, with_prompt = chat_ids(tokenizer, turn), chat_ids(tokenizer, turn, add_generation_prompt=True)
    if with_prompt[: len(without)] != without:
        raise ValueError("this chat template's generation prompt is not a suffix of the rendered conversation")
    return with_prompt[len(without) :]


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Ids that end an assistant turn: ``<|end|>`` (ours), ``<|im_end|>`` (ChatML models such as SmolLM2), eos."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[marker] for marker in (END, "<|im_end|>", "<|eot_id|>") if marker in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
