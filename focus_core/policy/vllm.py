"""The ``vllm`` backend: the ``Policy`` interface over a vLLM OpenAI-compatible server on loopback.

vLLM lives in its own venv and process (``infra/vllm``: ``setup.sh`` builds it, the module ``infra.vllm.server``
starts it), because its pins clash with the main environment's. This module speaks plain HTTP with the standard
library, so the main venv needs nothing new:

    policy = VLLMPolicy.launch(smollm2_folder(), threads=2)      # starts a server it owns; policy.close() stops it
    policy = VLLMPolicy("http://127.0.0.1:8000", folder)         # or attach to a server started on ``folder``

How each part of the interface maps onto the server (vLLM 0.32):

- ``generate``: one ``/v1/completions`` request per prompt, sent concurrently so the server batches them. The
  prompt goes as token ids (``prompt: [ids]``), ``n`` samples per request (vLLM computes the prompt once and the
  branches share its KV blocks through prefix caching), ``logprobs: 0`` (only the sampled token's) and
  ``return_token_ids`` (ids back, no detokenize round trip). The server runs ``--logprobs-mode raw_logprobs``:
  the values are log_softmax of the raw logits before temperature/top-p, i.e. what ``base.py`` asks for.
- stop tokens: ``stop_token_ids`` with ``ignore_eos: true``, so exactly our set ends a generation (vLLM would
  otherwise also stop at the model's eos ids). The stop token is included in ``token_ids``, as in ``hf``.
- seeds: vLLM seeds child ``j`` of an ``n``-sample request with ``seed + j``. We send ``seed = H(seed, i)`` (or
  ``H(seed[i])`` for per-prompt seeds), H a 62-bit hash, so sample ``j`` of prompt ``i`` depends on
  ``(seed, i, j)`` only, and sample 0 is the same whatever ``n`` is. The CPU sampler draws from a per-request
  generator, so a sample does not depend on the rest of the batch. The draws differ from the hf backend's.
- ``score``: one request with prompt + completion as the prompt, ``prompt_logprobs: 0`` and one throwaway
  generated token. Prompt log-probabilities are raw log_softmax in every ``logprobs_mode``. The server needs room
  for that one token, so prompt + completion must stay below ``max_context`` (the hf backend allows equal).
- ``load_weights``: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": folder}}``
  makes every worker reload the checkpoint in place (about a second for SmolLM2 on CPU), then
  ``POST /reset_prefix_cache`` drops KV blocks computed with the old weights. Both need ``VLLM_SERVER_DEV_MODE=1``,
  which ``infra/vllm/server.py`` sets. On a server without them (404) a policy that owns its server restarts it on
  the new folder instead (a full engine start, ~30-60 s on 2 cores); one attached to a foreign server raises.
  A training checkpoint also holds ``optimizer.safetensors``, which vLLM would load as weights, so the server is
  handed a temp folder of links without it (``model_view``); the policy keeps one such folder, the one the server
  reads now, and removes it on ``close``.
- ``save``: the server cannot hand its weights back, so ``save`` copies the folder it currently serves (written
  by ``HFPolicy.save`` of the trainer) and records the version.

Numerics: the server runs fp32 by default, like ``hf``; with the same weights its sampled and scored
log-probabilities agree with ``HFPolicy.score`` to < 5e-5 on SmolLM2 (measured; the kernels sum in a different
order), and tests/test_vllm.py asserts the 1e-4 of ``base.py``. A bf16 server (``dtype="bfloat16"``) was off by
up to 0.23 on the same tokens: faster, but its log-probabilities must then be re-scored in fp32 before training.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

from transformers import AutoTokenizer

from focus_core.policy.base import FinishReason, Generation, check_sampling_arguments, check_seeds
from focus_core.policy.hf import read_version, write_version
from focus_core.policy.tokenizer import end_of_turn_ids

START_HINT = (
    "build vLLM's venv once with infra/vllm/setup.sh, then start a server (infra/vllm/server.py) with "
    "`python -m infra.vllm.server MODEL_FOLDER` or use VLLMPolicy.launch(MODEL_FOLDER)"
)


class VLLMUnreachableError(ConnectionError):
    """No server answers at the policy's URL."""


class VLLMServerError(RuntimeError):
    """The server answered with an error (``status``: its HTTP code), or with something this client does not
    understand (``status`` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def launcher() -> ModuleType:
    """The module that starts vLLM servers, ``infra.vllm.server`` (installed with the project). Imported on first
    use, so importing the library loads no infrastructure (tests/test_layering.py)."""
    return importlib.import_module("infra.vllm.server")


class VLLMPolicy:
    """A policy served by vLLM (see the module doc). ``model`` is the Hugging Face folder the server was started
    on: its tokenizer is loaded here, and the server must serve it."""

    def __init__(
        self,
        base_url: str,
        model: str | Path,
        *,
        server: Any = None,
        served_model: str | None = None,
        stop_token_ids: set[int] | None = None,
        version: int | None = None,
        timeout: float = 600.0,
        max_parallel_requests: int = 64,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.weights_path = Path(model).expanduser().resolve()  # the folder whose weights the server holds now
        self.server = server  # an infra.vllm.server VLLMServer when this policy owns the server, else None
        self.view: Path | None = None  # the folder of links (``model_view``) the server reads, when it needs one
        self.timeout = timeout
        self.max_parallel_requests = max_parallel_requests
        # HTTP never goes through a proxy: the server is on loopback, and proxy variables would break that.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        # Ask the server first: an unreachable server or a wrong model should fail before any loading.
        self.served_model, self.max_context = self._check_server(served_model or str(self.weights_path))
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.weights_path))
        if not self.tokenizer.chat_template:
            raise ValueError("the tokenizer has no chat_template; the agent harness renders prompts with it")
        self.version = version if version is not None else read_version(self.weights_path)
        self._stop_token_ids = frozenset(
            stop_token_ids if stop_token_ids is not None else end_of_turn_ids(self.tokenizer)
        )

    @classmethod
    def launch(cls, model: str | Path, *, policy_kw: dict | None = None, **server_kw: Any) -> VLLMPolicy:
        """Start a server on ``model`` (keywords go to ``VLLMServer``: threads, dtype, max_model_len, ...) and
        return a policy that owns it: ``close()`` stops it, and ``load_weights`` can fall back to restarting it.
        A training checkpoint is served through a folder of links without its optimizer state (``model_view``)."""
        model = Path(model).expanduser().resolve()
        served = model_view(model)
        server = launcher().VLLMServer(served, **server_kw)
        try:
            url = server.start()
            policy = cls(url, served, server=server, **(policy_kw or {}))
        except BaseException:
            server.stop()
            remove_view(served, model)
            raise
        policy.view = None if served == model else served
        return policy

    def close(self) -> None:
        """Stop the server if this policy started it (``launch``; a no-op for an attached server), and remove the
        folder of links it was reading."""
        if self.server is not None:
            self.server.stop()
        self._replace_view(None)

    def __enter__(self) -> VLLMPolicy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop_token_ids

    # ------------------------------------------------------------------ sampling

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: set[int] | None = None,
        seed: int | Sequence[int] = 0,
        first_sample: Sequence[int] | None = None,
    ) -> list[list[Generation]]:
        self._check_sampling(prompts, n, max_new_tokens, temperature, top_p)
        firsts = check_seeds(seed, first_sample, len(prompts))
        if isinstance(seed, int):
            request_seeds = [request_seed(seed, i) for i in range(len(prompts))]
        else:  # vLLM seeds child j with seed + j, so sample first + j of a seed starts at seed + first
            request_seeds = [request_seed(s, None) + first for s, first in zip(seed, firsts, strict=True)]
        stops = self._stop_token_ids if stop_token_ids is None else frozenset(stop_token_ids)
        # vLLM rejects n > 1 with greedy decoding (the samples would be identical): ask once, copy n times.
        asked = 1 if temperature == 0 else n
        bodies = [
            completion_request(
                self.served_model, prompt, n=asked, max_tokens=min(max_new_tokens, self.max_context - len(prompt)),
                temperature=temperature, top_p=top_p, stop_token_ids=stops, seed=s,
            )
            for prompt, s in zip(prompts, request_seeds, strict=True)
        ]
        responses = self._post_many("/v1/completions", bodies)
        results = [parse_completion(response, asked, stops) for response in responses]
        if asked < n:
            results = [[copy.deepcopy(gens[0]) for _ in range(n)] for gens in results]
        return results

    def _check_sampling(
        self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int, temperature: float, top_p: float
    ) -> None:
        check_sampling_arguments(prompts, n, max_new_tokens, temperature, top_p, self.max_context)

    def score(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], *, temperature: float = 1.0
              ) -> list[float]:
        if not prompt_ids:
            raise ValueError("score: prompt_ids is empty; the first token has no log-probability to condition on")
        if temperature != 1.0:
            raise NotImplementedError("score: the vllm backend scores untempered log-probs (temperature 1) only; "
                                      "use ppo.sequence_logprobs(..., temperature=T) on the hf model for another T")
        if not completion_ids:
            return []
        ids = [*prompt_ids, *completion_ids]
        if len(ids) >= self.max_context:
            raise ValueError(
                f"score: {len(ids)} tokens; the vllm backend scores at most max_context - 1 = {self.max_context - 1} "
                "(the server must have room to generate one token after the scored ones)"
            )
        response = self._post("/v1/completions", score_request(self.served_model, ids))
        return parse_prompt_logprobs(response, ids, start=len(prompt_ids))

    # ------------------------------------------------------------------ checkpoints

    def load_weights(self, path: str | Path, version: int | None = None) -> None:
        """Serve the weights of checkpoint folder ``path`` (same architecture and tokenizer) from now on.

        In place through the workers' ``reload_weights`` when the server has the dev endpoints; otherwise, if this
        policy owns its server, by restarting it on ``path``. ``version`` defaults to the checkpoint's, else
        the current version + 1.
        """
        path = Path(path).expanduser().resolve()
        if not any(path.glob("model*.safetensors")):
            raise FileNotFoundError(f"load_weights: no model*.safetensors in {path} (expected a folder written by "
                                    "save)")
        served = model_view(path)
        try:
            self._serve(served)
        except BaseException:
            remove_view(served, path)
            raise
        self._replace_view(None if served == path else served)
        self.weights_path = path
        self.version = version if version is not None else read_version(path, default=self.version + 1)

    def _serve(self, folder: Path) -> None:
        """Make the server serve the weights in ``folder``: reloaded in place, or by restarting a server we own."""
        try:
            self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        except VLLMServerError as error:
            if error.status != 404:
                raise
            if self.server is None:
                raise VLLMServerError(
                    f"the vLLM server at {self.base_url} has no /collective_rpc, so it cannot reload weights in "
                    "place: start it with VLLM_SERVER_DEV_MODE=1 (infra/vllm/server.py does), or create the "
                    "policy with VLLMPolicy.launch so it can restart its own server on the new folder"
                ) from error
            self._restart(folder)
        else:
            # Prefix-cache blocks hold keys/values computed with the old weights; reusing them would be wrong.
            reset = self._post("/reset_prefix_cache", {})
            if not reset.get("success", False):
                raise VLLMServerError(f"the vLLM server at {self.base_url} could not reset its prefix cache: {reset}")

    def _replace_view(self, view: Path | None) -> None:
        """Remember ``view`` as the folder of links the server reads, removing the previous one: the server has
        loaded the weights it pointed to and never reads it again."""
        if self.view is not None and self.view != view:
            shutil.rmtree(self.view, ignore_errors=True)
        self.view = view

    def _restart(self, path: Path) -> None:
        self.base_url = self.server.restart(path).rstrip("/")
        self.served_model, self.max_context = self._check_server(str(path))

    def save(self, path: str | Path) -> None:
        """Copy the served checkpoint folder (model, tokenizer) to ``path`` with this policy's version; a crash
        leaves no partial folder."""
        path = Path(path).expanduser().resolve()
        if path == self.weights_path:
            write_version(path, self.version)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        staging.chmod(0o755)
        try:
            shutil.copytree(self.weights_path, staging, dirs_exist_ok=True)
            write_version(staging, self.version)
            if path.exists():
                shutil.rmtree(path)
            os.replace(staging, path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    # ------------------------------------------------------------------ HTTP

    def _check_server(self, expected: str) -> tuple[str, int]:
        """(served model name, max_model_len), after checking the server serves ``expected`` (name or folder)."""
        models = self._get("/v1/models").get("data") or []
        for entry in models:
            if expected in (entry.get("id"), entry.get("root")):
                return entry["id"], int(entry["max_model_len"])
        served = [entry.get("root") or entry.get("id") for entry in models]
        raise ValueError(
            f"the vLLM server at {self.base_url} serves {served}, not {expected}. Point the policy at the folder "
            f"that server was started on, or start one on {expected} (infra/vllm/server.py): "
            f"python -m infra.vllm.server {expected}"
        )

    def _get(self, route: str) -> dict:
        return self._request(urllib.request.Request(self.base_url + route, method="GET"))

    def _post(self, route: str, body: dict) -> dict:
        request = urllib.request.Request(
            self.base_url + route, data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )
        return self._request(request)

    def _post_many(self, route: str, bodies: list[dict]) -> list[dict]:
        """POST each body on its own connection, concurrently (the server batches what arrives together)."""
        if len(bodies) == 1:
            return [self._post(route, bodies[0])]
        with ThreadPoolExecutor(max_workers=min(len(bodies), self.max_parallel_requests)) as pool:
            return list(pool.map(lambda body: self._post(route, body), bodies))

    def _request(self, request: urllib.request.Request) -> dict:
        route = request.selector
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as error:
            raise _http_error(self.base_url, route, error) from None
        except TimeoutError as error:
            raise VLLMServerError(f"{self.base_url}{route} did not answer within {self.timeout:.0f} s") from error
        except (urllib.error.URLError, ConnectionError) as error:
            reason = getattr(error, "reason", error)
            if isinstance(reason, TimeoutError):
                raise VLLMServerError(f"{self.base_url}{route} did not answer within {self.timeout:.0f} s") from error
            raise VLLMUnreachableError(f"no vLLM server answers at {self.base_url} ({reason}); {START_HINT}") from error
        if not text:  # some dev endpoints answer 200 with an empty body
            return {}
        try:
            return json.loads(text)
        except json.JSONDecodeError as error:
            raise VLLMServerError(f"{self.base_url}{route} answered non-JSON: {text[:200]!r}") from error


def _http_error(base_url: str, route: str, error: urllib.error.HTTPError) -> VLLMServerError:
    """The server's own message (vLLM: ``{"error": {"message": ...}}`` or FastAPI's ``{"detail": ...}``)."""
    body = error.read().decode(errors="replace")
    message = body[:500]
    try:
        parsed = json.loads(body)
        detail = parsed.get("error", parsed.get("detail", parsed))
        message = detail.get("message", detail) if isinstance(detail, dict) else detail
    except (json.JSONDecodeError, AttributeError):
        pass
    return VLLMServerError(f"{base_url}{route}: HTTP {error.code}: {message}", status=error.code)


# ---------------------------------------------------------------------- requests and responses (pure functions)


def model_view(path: Path) -> Path:
    """``path``, or when it also holds other safetensors (a training checkpoint: the optimizer state, a value
    head), a new temp folder of links to everything but those. vLLM loads every ``*.safetensors`` of a folder as
    weights. The caller removes it (``remove_view``) once the server no longer reads it."""
    others = [f for f in path.glob("*.safetensors") if not f.name.startswith("model")]
    if not others:
        return path
    view = Path(tempfile.mkdtemp(prefix=f"focus-vllm-{path.name}-"))
    for item in path.iterdir():
        if item not in others:
            (view / item.name).symlink_to(item)
    return view


def remove_view(view: Path, path: Path) -> None:
    """Remove the folder of links ``model_view(path)`` made (nothing when it returned ``path`` itself)."""
    if view != path:
        shutil.rmtree(view, ignore_errors=True)


def request_seed(seed: int, prompt_index: int | None) -> int:
    """The seed of one prompt's request: a 62-bit hash, so vLLM's ``seed + j`` for sample j stays an int64."""
    key = f"{seed}:{prompt_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 2


def completion_request(
    model: str,
    prompt: Sequence[int],
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float,
    stop_token_ids: frozenset[int],
    seed: int,
) -> dict:
    """The ``/v1/completions`` body for ``n`` samples of one token-id prompt (see the module doc)."""
    return {
        "model": model,
        "prompt": [int(t) for t in prompt],
        "n": n,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": 0,  # 0 = no top-k
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "seed": seed,
        "logprobs": 0,  # the sampled token's log-probability only
        "return_token_ids": True,
        "stop_token_ids": sorted(stop_token_ids),
        "ignore_eos": True,  # our stop set, not the model's eos ids, ends a generation
        "skip_special_tokens": False,
    }


def score_request(model: str, ids: Sequence[int]) -> dict:
    """The ``/v1/completions`` body that returns the log-probability of every token of ``ids`` given the ones
    before it (one greedy token is generated and discarded)."""
    return {
        "model": model,
        "prompt": [int(t) for t in ids],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,  # the prompt token's own log-probability (plus top-0)
        "ignore_eos": True,
    }


def parse_completion(response: dict, n: int, stops: frozenset[int]) -> list[Generation]:
    """The ``n`` generations of one completion response, in sample order."""
    choices = sorted(response.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise VLLMServerError(f"expected {n} choices from the vLLM server, got {len(choices)}: {str(response)[:300]}")
    generations = []
    for choice in choices:
        token_ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if token_ids is None or logprobs is None:
            raise VLLMServerError(
                "the vLLM server returned no token_ids/logprobs; it must accept return_token_ids and logprobs "
                f"(vLLM >= 0.10): {str(choice)[:300]}"
            )
        if len(token_ids) != len(logprobs) or not token_ids:
            raise VLLMServerError(f"{len(token_ids)} token ids but {len(logprobs)} log-probabilities from the server")
        generations.append(
            Generation(
                token_ids=[int(t) for t in token_ids],
                logprobs=[float(lp) for lp in logprobs],
                finish_reason=_finish_reason(choice, token_ids, stops),
            )
        )
    return generations


def _finish_reason(choice: dict, token_ids: list[int], stops: frozenset[int]) -> FinishReason:
    """vLLM's ``stop`` (a stop token; we send no stop strings) and ``length`` map onto ours; ``abort`` and
    anything else mean the request did not complete and raise."""
    reason = choice.get("finish_reason")
    if reason == "length":
        return "length"
    if reason == "stop":
        if token_ids[-1] not in stops:
            raise VLLMServerError(
                f"the vLLM server stopped at token {token_ids[-1]}, which is not a stop token "
                f"({sorted(stops)}); stop_reason={choice.get('stop_reason')!r}"
            )
        return "stop"
    raise VLLMServerError(f"the vLLM server ended a generation with finish_reason={reason!r} (request aborted?)")


def parse_prompt_logprobs(response: dict, ids: Sequence[int], start: int) -> list[float]:
    """Log-probabilities of ``ids[start:]`` from a ``prompt_logprobs`` response (one dict per prompt position,
    keyed by token id as a string; position 0 is null)."""
    choices = response.get("choices") or []
    entries = choices[0].get("prompt_logprobs") if choices else None
    if entries is None or len(entries) != len(ids):
        raise VLLMServerError(
            f"expected prompt_logprobs for {len(ids)} tokens from the vLLM server, got "
            f"{None if entries is None else len(entries)}"
        )
    values = []
    for position in range(start, len(ids)):
        entry = entries[position] or {}
        token = str(int(ids[position]))
        if token not in entry:
            raise VLLMServerError(f"prompt_logprobs at position {position} lacks token {token}: {entry}")
        values.append(float(entry[token]["logprob"]))
    return values
