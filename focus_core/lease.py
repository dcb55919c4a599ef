"""A run's lease: one process at a time writes a run, and a dead writer's run can be taken over.

Two ``focus resume`` of one run would commit the same stages at once and wipe each other's parts, so a
process that writes a run first takes its lease, a small JSON file in the run's folder of the artifact store
(``{root}/{run_id}/_lease.json``: owner, token, heartbeat, expiry). The store is the one thing every machine
of a run shares, so the lease works the same on a local folder and on S3, with no lock server.

* **Take**: no lease, an expired one, or one whose holder is a dead process on this same host: write ours,
  wait ``settle_s`` and read it back; if another process wrote after us, it holds the run and we refuse.
  (Write-then-verify: S3 has no create-if-absent that every server supports. Two takers would both have to
  read "free" and the later one write more than ``settle_s`` after the earlier one's check to both win.)
* **Hold**: a daemon thread renews the heartbeat every ``ttl_s / 4`` seconds, so a live holder never expires.
* **Refuse**: a live lease of another owner raises ``LeaseHeld`` with one line naming the holder.
* **Give back**: on exit the file is removed (if it is still ours). After ``kill -9`` it stays until it
  expires (``ttl_s``, default 60 s, ``$FOCUS_LEASE_TTL_S``) — or at once on the holder's own host, where a
  missing process id is proof that the holder died.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from focus_core.artifacts import ArtifactError, ArtifactStore

log = logging.getLogger("focus")

LEASE_NAME = "_lease.json"
TTL_ENV = "FOCUS_LEASE_TTL_S"
DEFAULT_TTL_S = 60.0
SETTLE_S = 0.5


class LeaseHeld(ArtifactError):
    """Another live process holds the run."""


@dataclass(frozen=True)
class Holder:
    owner: str  # "host:pid"
    token: str
    heartbeat_at: float  # unix seconds
    expires_at: float

    @property
    def host(self) -> str:
        return self.owner.rsplit(":", 1)[0]

    @property
    def pid(self) -> int:
        return int(self.owner.rsplit(":", 1)[1])

    def alive(self, now: float) -> bool:
        """Live unless expired, or a process of this host that no longer exists."""
        if now >= self.expires_at:
            return False
        if self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:  # exists, another user's
                return True
        return True


def current_holder(store: ArtifactStore, run_id: str) -> Holder | None:
    """The lease written in the store, or None (none, or unreadable: a torn or foreign file is not a lease)."""
    text = store.read_run_file(run_id, LEASE_NAME)
    if text is None:
        return None
    try:
        data = json.loads(text)
        return Holder(str(data["owner"]), str(data["token"]), float(data["heartbeat_at"]), float(data["expires_at"]))
    except (ValueError, KeyError, TypeError):
        log.warning("run %s: unreadable lease file %s replaced", run_id, LEASE_NAME)
        return None


def refuse_if_held(store: ArtifactStore, run_id: str) -> None:
    """Raise ``LeaseHeld`` (one line, naming the holder and the way out) if a live process holds the run."""
    holder, now = current_holder(store, run_id), time.time()
    if holder is not None and holder.alive(now):
        raise LeaseHeld(
            f"run {run_id} is being written by {holder.owner} (heartbeat {now - holder.heartbeat_at:.0f} s ago); "
            f"fix: wait for it to finish, or stop that process — a dead holder's lease is taken over "
            f"{max(0.0, holder.expires_at - now):.0f} s from now")


class Lease:
    """A held lease; ``hold`` is the way to get one."""

    def __init__(self, store: ArtifactStore, run_id: str, ttl_s: float) -> None:
        self.store, self.run_id, self.ttl_s = store, run_id, ttl_s
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.token = uuid.uuid4().hex
        self.lost = False  # set when another process took the lease over (we were presumed dead)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        now = time.time()
        self.store.write_run_file(self.run_id, LEASE_NAME, json.dumps(
            {"owner": self.owner, "token": self.token, "heartbeat_at": now, "expires_at": now + self.ttl_s}))

    def take(self, settle_s: float = SETTLE_S) -> None:
        refuse_if_held(self.store, self.run_id)
        self._write()
        time.sleep(settle_s)
        holder = current_holder(self.store, self.run_id)
        if holder is None or holder.token != self.token:
            refuse_if_held(self.store, self.run_id)  # the other taker won: name it
            raise LeaseHeld(f"run {self.run_id}: another process took the lease at the same time; fix: retry")
        self._thread = threading.Thread(target=self._renew, name=f"lease-{self.run_id}", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                holder = current_holder(self.store, self.run_id)
                if holder is not None and holder.token != self.token:
                    self.lost = True
                    log.error("run %s: the lease was taken over by %s; this process should stop writing",
                              self.run_id, holder.owner)
                    return
                self._write()
            except Exception as error:  # noqa: BLE001 - a missed heartbeat is retried; expiry is ttl_s away
                log.warning("run %s: lease heartbeat failed (%s); retrying", self.run_id, error)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with contextlib.suppress(ArtifactError):
            holder = current_holder(self.store, self.run_id)
            if holder is not None and holder.token == self.token:
                self.store.remove_run_file(self.run_id, LEASE_NAME)


def ttl_from_env() -> float:
    value = os.environ.get(TTL_ENV)
    if value is None:
        return DEFAULT_TTL_S
    try:
        ttl = float(value)
    except ValueError:
        raise ValueError(f"${TTL_ENV}={value!r} is not a number of seconds (fix: e.g. {TTL_ENV}=60)") from None
    if ttl <= 0:
        raise ValueError(f"${TTL_ENV}={value!r} must be > 0 seconds")
    return ttl


@contextlib.contextmanager
def hold(store: ArtifactStore, run_id: str, ttl_s: float | None = None) -> Iterator[Lease]:
    """Hold the run's lease for the ``with`` block (``LeaseHeld`` if a live process has it)."""
    lease = Lease(store, run_id, ttl_from_env() if ttl_s is None else ttl_s)
    lease.take()
    try:
        yield lease
    finally:
        lease.release()
