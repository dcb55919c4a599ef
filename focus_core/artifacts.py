"""The artifact store: each stage's output as Parquet parts plus a manifest written last.

The object store is FOCUS's ledger (DESIGN.md, "Artifacts"). A stage of an iteration is done if and only if
its ``_manifest.json`` exists and validates; everything else in its folder (parts of a write that crashed,
temporary files) is invisible to readers and is wiped when the stage is committed again. Resume therefore
needs no other bookkeeping: walk (iteration, stage) in order and skip every stage whose manifest carries
the expected ``stage_version``.

Layout under one root (a local folder or ``s3://bucket/prefix``, served by the same fsspec code)::

    {root}/{run_id}/_run.json                                          run metadata (status, config, ...)
    {root}/{run_id}/iteration=0003/{stage}/{table}/part-00000-1a2b3c4d.parquet
    {root}/{run_id}/iteration=0003/{stage}/files/{name}/...            checkpoint folders
    {root}/{run_id}/iteration=0003/{stage}/_manifest.json              written last

Commit protocol (``ArtifactStore.commit``): validate every table against ``focus_core.schemas`` and every
JSON field first, so a NaN fails before anything is written; remove the stage's old manifest, then its old
folder; write the parts (each at most ``part_rows`` rows, named after their content hash) and the folder
files; then write the manifest in one atomic step (local: temporary file + rename; S3: one PUT, and S3
objects appear whole or not at all). The manifest lists every part and file with its size and sha256,
so readers read exactly those and detect truncated, overwritten or swapped files.

Manifest hash: ``Manifest.hash`` covers everything except the two volatile fields ``created_at`` and
``timings``, so recomputing a deterministic stage reproduces its hash and does not invalidate the stages
downstream of it (their ``stage_version`` includes the upstream hashes).

Timings: a manifest's ``timings`` maps names to seconds. ``compute_s`` is the stage's own work; every
other entry (``store_write_s``, added by the store, or a task wrapper's ``store_read_s``,
``orchestration_s``) counts as overhead in ``list_runs``, except the parts of ``compute_s`` that a stage
reports (``generation_s``: its generation, the longest shard's when sharded).

S3: endpoint and credentials come only from the standard AWS environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``), never from config, and never
appear in messages. The store checks the endpoint and bucket when it is created and fails within seconds
with the fix (``python -m infra.services up s3``) instead of hanging in retries.

One writer per run: the store itself does not stop two processes committing the same (run, iteration,
stage) at once (a second writer would wipe the first one's parts); the run's lease does
(``focus_core.lease``, ``{root}/{run_id}/_lease.json``), which ``focus train``, ``resume`` and ``compare`` hold.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from focus_core.ids import canonical_json, plain_data
from focus_core.schemas import SCHEMA_VERSION, SchemaError, validate_table

MANIFEST_NAME = "_manifest.json"
RUN_INFO_NAME = "_run.json"
MANIFEST_KIND = "focus.stage-manifest"  # marks our JSON, so a foreign file is recognised as such
RUN_INFO_KIND = "focus.run-info"
RUN_STATUSES = ("running", "finished", "failed")
DEFAULT_PART_ROWS = 50_000
COMPUTE_TIMING = "compute_s"
PARTS_OF_COMPUTE = ("generation_s",)  # timings inside compute_s, not beside it
STORE_WRITE_TIMING = "store_write_s"

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")  # stages, tables, folder names
_MANIFEST_PATH = re.compile(rf"/iteration=(?P<iteration>\d+)/(?P<stage>{_NAME.pattern})/{re.escape(MANIFEST_NAME)}$")
_VOLATILE_FIELDS = ("created_at", "timings")

# botocore settings for S3 clients: fail fast on a dead endpoint; retry throttling, 5xx and refused or reset
# connections with backoff (standard mode, 3 attempts: a dead store fails within seconds); longer outages
# are left to the stages'
# Prefect retries (tasks/stage.py). s3fs adds its own retries of timeouts and broken reads (`retries` below).
_S3_CLIENT_CONFIG = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3, "mode": "standard"}}
_S3_FIX = "start it with `python -m infra.services up s3` or fix AWS_ENDPOINT_URL"


class ArtifactError(RuntimeError):
    """The store cannot do what was asked; the message names the file or endpoint and the fix."""


class StoreUnavailable(ArtifactError):
    """The store did not answer (connection refused or reset, timeout) after the client's own retries: the one
    store error that a later retry can cure (the stages' Prefect retries wait for it, ``tasks/stage.py``)."""


# --- stage versions (canonical JSON and seeds: focus_core/ids.py) ---------------------------------------------------


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def stage_version(
    stage: str,
    config_fields: Mapping[str, Any],
    upstream_hashes: Sequence[str],
    schema_version: int = SCHEMA_VERSION,
) -> str:
    """The version a stage's manifest must carry to count as done: sha256 over its inputs.

    Inputs: the stage name, the config fields the stage depends on (plain JSON data), the hashes of the
    upstream manifests it read (their order does not matter: each names one manifest) and the schema
    version. A changed config field invalidates exactly the stages that list it.
    """
    if isinstance(upstream_hashes, str | Mapping):
        raise TypeError("upstream_hashes: pass a list of manifest hashes, e.g. list(manifest.upstream.values())")
    inputs = {
        "stage": stage,
        "config": config_fields,
        "upstream": sorted(upstream_hashes),
        "schema_version": schema_version,
    }
    return _sha256(canonical_json(inputs, "stage_version inputs"))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


# --- manifests --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredFile:
    """One file of a commit: its path relative to the stage folder, size, sha256 and, for parts, rows."""

    path: str
    size: int
    sha256: str
    rows: int | None = None

    def to_dict(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"path": self.path, "size": self.size, "sha256": self.sha256}
        if self.rows is not None:
            entry["rows"] = self.rows
        return entry


@dataclass(frozen=True)
class Manifest:
    """What a stage committed (frozen); ``to_json``/``from_json`` round-trip it exactly."""

    run_id: str
    iteration: int
    stage: str
    version: str  # the stage_version it was computed for
    tables: Mapping[str, tuple[StoredFile, ...]] = field(default_factory=dict)  # table -> parts
    files: Mapping[str, tuple[StoredFile, ...]] = field(default_factory=dict)  # folder name -> files
    upstream: Mapping[str, str] = field(default_factory=dict)  # e.g. "segment" -> manifest hash
    seeds: Mapping[str, Any] = field(default_factory=dict)
    policy_version: int | None = None
    timings: Mapping[str, float] = field(default_factory=dict)  # seconds; see the module docstring
    figures: Mapping[str, Any] = field(default_factory=dict)  # headline numbers (mean reward, ...)
    skipped: str | None = None  # why a method skipped the stage (then there are no tables)
    created_at: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def rows(self) -> dict[str, int]:
        """Row count per table."""
        return {name: sum(part.rows or 0 for part in parts) for name, parts in self.tables.items()}

    @property
    def hash(self) -> str:
        """sha256 of the canonical JSON without ``created_at`` and ``timings`` (see the module docstring)."""
        content = {key: value for key, value in self.to_dict().items() if key not in _VOLATILE_FIELDS}
        return _sha256(canonical_json(content))

    def __hash__(self) -> int:  # the dataclass one would fail on the dict fields
        return hash(self.hash)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": MANIFEST_KIND,
            "schema_version": self.schema_version,
            "run_id": self.run_id,
            "iteration": self.iteration,
            "stage": self.stage,
            "version": self.version,
            "skipped": self.skipped,
            "policy_version": self.policy_version,
            "created_at": self.created_at,
            "upstream": dict(self.upstream),
            "seeds": dict(self.seeds),
            "tables": {
                name: {"rows": self.rows[name], "parts": [part.to_dict() for part in parts]}
                for name, parts in self.tables.items()
            },
            "files": {name: [entry.to_dict() for entry in entries] for name, entries in self.files.items()},
            "timings": dict(self.timings),
            "figures": dict(self.figures),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "manifest") -> Manifest:
        """Parse a manifest; ``ArtifactError`` for corrupt JSON, a foreign file or another schema version."""
        try:
            data = json.loads(text)
        except (ValueError, UnicodeDecodeError) as error:
            raise ArtifactError(
                f"{source} is corrupt (not JSON: {error}); delete the stage folder and resume to recompute it"
            ) from None
        if not isinstance(data, dict) or data.get("kind") != MANIFEST_KIND:
            raise ArtifactError(
                f'{source} is not a FOCUS stage manifest (no "kind": "{MANIFEST_KIND}"); another tool wrote '
                f"it. Move it away, or give FOCUS a store root that only FOCUS writes to"
            )
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ArtifactError(
                f"{source} was written by schema version {data.get('schema_version')}, this FOCUS reads "
                f"{SCHEMA_VERSION}: start a new run (new run id), or delete the run's stage folders to "
                f"recompute them, or use the FOCUS release that wrote it"
            )
        try:
            return cls(
                run_id=data["run_id"],
                iteration=int(data["iteration"]),
                stage=data["stage"],
                version=data["version"],
                tables={
                    name: tuple(StoredFile(**part) for part in table["parts"]) for name, table in data["tables"].items()
                },
                files={
                    name: tuple(StoredFile(**entry) for entry in entries) for name, entries in data["files"].items()
                },
                upstream=data["upstream"],
                seeds=data["seeds"],
                policy_version=data["policy_version"],
                timings=data["timings"],
                figures=data["figures"],
                skipped=data["skipped"],
                created_at=data["created_at"],
                schema_version=data["schema_version"],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ArtifactError(
                f"{source} is malformed ({type(error).__name__}: {error}); delete the stage folder and resume "
                f"to recompute it"
            ) from None


@dataclass(frozen=True)
class RunSummary:
    """One run as ``focus runs`` shows it."""

    run_id: str
    status: str  # running / finished / failed from _run.json, "unknown" without one
    created_at: str | None
    updated_at: str | None
    stages: dict[int, tuple[str, ...]]  # iteration -> committed stages, in commit order
    last_committed: tuple[int, str] | None
    compute_s: float  # sum of the manifests' compute_s
    overhead_s: float  # sum of all their other timings (store IO, orchestration)
    info: dict[str, Any]  # the whole _run.json


# --- the store --------------------------------------------------------------------------------------------


class ArtifactStore:
    """Parquet tables, checkpoint folders and manifests of FOCUS runs under one root URL.

    ``root`` is a local folder (``runs``, ``/abs/runs``, ``file:///abs/runs``) or ``s3://bucket[/prefix]``.
    For S3 the constructor checks that the endpoint answers and the bucket exists.
    """

    def __init__(self, root: str | os.PathLike[str], *, part_rows: int = DEFAULT_PART_ROWS) -> None:
        if part_rows < 1:
            raise ValueError(f"part_rows must be >= 1, got {part_rows}")
        self.part_rows = part_rows
        root = os.fspath(root)
        if root.startswith("s3://"):
            self._s3 = True
            self._base = root.removeprefix("s3://").strip("/")
            if not self._base:
                raise ArtifactError(f"store root {root!r} names no bucket; use s3://bucket/prefix")
            self._fs = _s3_filesystem()
        elif "://" in root and not root.startswith("file://"):
            raise ArtifactError(f"store root {root!r}: unsupported scheme; use a local path or s3://bucket/prefix")
        else:
            self._s3 = False
            self._base = Path(root.removeprefix("file://")).expanduser().resolve().as_posix()
            self._fs = fsspec.filesystem("file", auto_mkdir=True)
        self.check()

    def __repr__(self) -> str:
        return f"ArtifactStore({self.root!r})"

    @property
    def root(self) -> str:
        return self._url(self._base)

    @property
    def filesystem(self) -> fsspec.AbstractFileSystem:
        """The fsspec filesystem, e.g. for ``duckdb_connection.register_filesystem(store.filesystem)``."""
        return self._fs

    def check(self) -> None:
        """Fail early and clearly if the root cannot be used (S3: endpoint down, bucket missing, denied)."""
        if not self._s3:
            if self._fs.isfile(self._base):
                raise ArtifactError(f"store root {self._base} is a file; give a folder")
            return
        endpoint = _s3_endpoint()
        if endpoint is not None:
            # A plain TCP connect answers "is anything listening" in milliseconds, where a botocore
            # request would spend seconds in connection retries first.
            parts = urlsplit(endpoint)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                socket.create_connection((parts.hostname, port), timeout=3).close()
            except OSError as error:
                raise ArtifactError(f"cannot reach S3 endpoint {endpoint} ({error}): {_S3_FIX}") from None
        bucket = self._base.split("/")[0]
        with self._errors("checking bucket", f"s3://{bucket}"):
            try:
                self._fs.call_s3("head_bucket", Bucket=bucket)
            except FileNotFoundError:
                raise ArtifactError(
                    f"S3 bucket {bucket!r} does not exist at {endpoint or 'AWS'}: create it (`python -m "
                    f"infra.services up s3` creates 'focus') or fix the store root {self.root}"
                ) from None

    # --- paths

    def stage_url(self, run_id: str, iteration: int, stage: str) -> str:
        """URL of a stage folder, for logs and error messages."""
        return self._url(self._stage_path(run_id, iteration, stage))

    def _stage_path(self, run_id: str, iteration: int, stage: str) -> str:
        _check_run_id(run_id)
        _check_name("stage", stage)
        if not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"iteration must be an int >= 0, got {iteration!r}")
        return f"{self._base}/{run_id}/iteration={iteration:04d}/{stage}"

    def _url(self, path: str) -> str:
        return f"s3://{path}" if self._s3 else path

    # --- committing

    def commit(
        self,
        run_id: str,
        iteration: int,
        stage: str,
        *,
        version: str,
        tables: Mapping[str, pa.Table] | None = None,
        folders: Mapping[str, str | os.PathLike[str]] | None = None,
        upstream: Mapping[str, str] | None = None,
        seeds: Mapping[str, Any] | None = None,
        policy_version: int | None = None,
        timings: Mapping[str, float] | None = None,
        figures: Mapping[str, Any] | None = None,
        skipped: str | None = None,
    ) -> Manifest:
        """Write a stage's tables and folders, then its manifest; return the manifest.

        Everything is validated before the first write: tables against their schemas (NaN/inf, types,
        nulls: ``SchemaError``), folders exist, and upstream/seeds/timings/figures are plain finite JSON
        (``ArtifactError``). A failure at any point leaves the stage without a manifest, i.e. not done.
        """
        stage_path = self._stage_path(run_id, iteration, stage)
        where = self._url(stage_path)
        validated = {}
        for name, table in (tables or {}).items():
            _check_name("table", name)
            try:
                validated[name] = validate_table(name, table)
            except (SchemaError, ValueError) as error:
                raise SchemaError(f"not committing {where}: {error}") from error
        local_folders = {}
        for name, folder in (folders or {}).items():
            _check_name("folder", name)
            if not Path(folder).is_dir():
                raise ArtifactError(f"not committing {where}: folder {name!r} = {folder} is not a directory")
            local_folders[name] = Path(folder)
        try:
            fields = {"upstream": upstream, "seeds": seeds, "timings": timings, "figures": figures}
            plain = {key: plain_data(dict(value or {}), key) for key, value in fields.items()}
            if not all(isinstance(value, str) for value in plain["upstream"].values()):
                raise TypeError("upstream: values must be manifest hashes (str)")
            if not all(isinstance(value, int | float) and value >= 0 for value in plain["timings"].values()):
                raise TypeError("timings: values must be seconds (numbers >= 0)")
            if policy_version is not None and not isinstance(policy_version, int):
                raise TypeError(f"policy_version must be an int or None, got {policy_version!r}")
        except (TypeError, ValueError) as error:
            raise ArtifactError(f"not committing {where}: {error}") from error

        started = time.perf_counter()
        with self._errors("committing", where):
            self._remove_stage(stage_path)  # the old manifest first, then old parts and crash leftovers
            written = {name: self._write_parts(stage_path, name, table) for name, table in validated.items()}
            uploaded = {name: self._upload_folder(stage_path, name, folder) for name, folder in local_folders.items()}
            manifest = Manifest(
                run_id=run_id,
                iteration=iteration,
                stage=stage,
                version=version,
                tables=written,
                files=uploaded,
                upstream=plain["upstream"],
                seeds=plain["seeds"],
                policy_version=policy_version,
                timings={**plain["timings"], STORE_WRITE_TIMING: round(time.perf_counter() - started, 6)},
                figures=plain["figures"],
                skipped=skipped,
                created_at=_now(),
            )
            self._write_atomic(f"{stage_path}/{MANIFEST_NAME}", manifest.to_json())
        return manifest

    def _write_parts(self, stage_path: str, table_name: str, table: pa.Table) -> tuple[StoredFile, ...]:
        """Write a table as parts of at most ``part_rows`` rows (one part even for an empty table)."""
        parts = []
        for number, offset in enumerate(range(0, max(table.num_rows, 1), self.part_rows)):
            part = table.slice(offset, self.part_rows)
            sink = pa.BufferOutputStream()
            pq.write_table(part, sink, compression="zstd")
            data = sink.getvalue().to_pybytes()
            digest = _sha256(data)
            relative = f"{table_name}/part-{number:05d}-{digest[:8]}.parquet"
            self._fs.pipe_file(f"{stage_path}/{relative}", data)
            parts.append(StoredFile(relative, len(data), digest, part.num_rows))
        return tuple(parts)

    def _upload_folder(self, stage_path: str, name: str, folder: Path) -> tuple[StoredFile, ...]:
        entries = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            relative = f"files/{name}/{path.relative_to(folder).as_posix()}"
            digest, size = _sha256_file(path)
            self._fs.put_file(str(path), f"{stage_path}/{relative}")
            entries.append(StoredFile(relative, size, digest))
        return tuple(entries)

    def _write_atomic(self, path: str, text: str) -> None:
        """Make ``path`` appear complete or not at all: S3 PUTs are atomic, local files are renamed into place."""
        data = text.encode()
        if self._s3:
            self._fs.pipe_file(path, data)
            return
        temporary = Path(f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        temporary.parent.mkdir(parents=True, exist_ok=True)
        with temporary.open("wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)

    def _remove_stage(self, stage_path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(f"{stage_path}/{MANIFEST_NAME}")
        with contextlib.suppress(FileNotFoundError):
            self._fs.rm(stage_path, recursive=True)

    def invalidate(self, run_id: str, iteration: int, stage: str) -> None:
        """Un-commit a stage: delete its manifest (now it is not done), then everything else in its folder."""
        stage_path = self._stage_path(run_id, iteration, stage)
        with self._errors("deleting", self._url(stage_path)):
            self._remove_stage(stage_path)

    # --- reading

    def manifest(self, run_id: str, iteration: int, stage: str) -> Manifest | None:
        """The stage's manifest, or None if it was never committed (or was invalidated)."""
        path = f"{self._stage_path(run_id, iteration, stage)}/{MANIFEST_NAME}"
        with self._errors("reading", self._url(path)):
            try:
                text = self._fs.cat_file(path)
            except FileNotFoundError:
                return None
        return self._parse_manifest(text, path, (run_id, iteration, stage))

    def _parse_manifest(self, text: bytes, path: str, expected: tuple[str, int, str]) -> Manifest:
        manifest = Manifest.from_json(text, source=self._url(path))
        if (manifest.run_id, manifest.iteration, manifest.stage) != expected:
            raise ArtifactError(
                f"{self._url(path)} describes run {manifest.run_id!r} iteration {manifest.iteration} stage "
                f"{manifest.stage!r}, not {expected}: it was copied or moved here. Delete the stage folder and "
                f"resume to recompute it"
            )
        return manifest

    def is_done(self, run_id: str, iteration: int, stage: str, version: str) -> bool:
        """Whether the stage is committed with exactly this stage version."""
        manifest = self.manifest(run_id, iteration, stage)
        return manifest is not None and manifest.version == version

    def _require(self, run_id: str, iteration: int, stage: str) -> Manifest:
        manifest = self.manifest(run_id, iteration, stage)
        if manifest is None:
            raise ArtifactError(
                f"{self.stage_url(run_id, iteration, stage)} is not committed (no {MANIFEST_NAME}); run or "
                f"resume the stage first"
            )
        return manifest

    def read_table(self, run_id: str, iteration: int, stage: str, table: str, *, verify: bool = True) -> pa.Table:
        """A committed table, read from exactly the parts its manifest lists, hash-checked and schema-checked."""
        manifest = self._require(run_id, iteration, stage)
        stage_path = self._stage_path(run_id, iteration, stage)
        if table not in manifest.tables:
            reason = f"the stage was skipped: {manifest.skipped}" if manifest.skipped else "it was not written"
            raise ArtifactError(
                f"{self._url(stage_path)} has no table {table!r} ({reason}); it has {sorted(manifest.tables)}"
            )
        pieces = []
        for part in manifest.tables[table]:
            data = self._read_file(stage_path, part, verify)
            try:
                pieces.append(pq.read_table(pa.BufferReader(data)))
            except pa.ArrowException as error:
                raise ArtifactError(
                    f"{self._url(f'{stage_path}/{part.path}')} is not readable Parquet ({error}); delete the stage "
                    f"folder and resume to recompute it"
                ) from None
        try:
            return validate_table(table, pa.concat_tables(pieces))
        except (SchemaError, pa.ArrowException) as error:
            raise ArtifactError(
                f"{self._url(stage_path)}: stored table {table!r} does not match the current schema ({error}); "
                f"delete the stage folder and resume to recompute it"
            ) from None

    def _read_file(self, stage_path: str, entry: StoredFile, verify: bool) -> bytes:
        url = self._url(f"{stage_path}/{entry.path}")
        with self._errors("reading", url):
            try:
                data = self._fs.cat_file(f"{stage_path}/{entry.path}")
            except FileNotFoundError:
                raise _missing(url) from None
        if verify:
            _check_content(url, _sha256(data), len(data), entry)
        return data

    def fetch_folder(
        self, run_id: str, iteration: int, stage: str, name: str, dest: str | os.PathLike[str] | None = None
    ) -> Path:
        """A committed folder as a local path, every file checked against the manifest.

        Local store without ``dest``: the stored folder itself. Otherwise the files are copied to ``dest``
        (default for S3: ``$FOCUS_CACHE_DIR`` or ``~/.cache/focus``, keyed by the manifest hash, so a cached
        copy is reused only while it matches).
        """
        manifest = self._require(run_id, iteration, stage)
        stage_path = self._stage_path(run_id, iteration, stage)
        if name not in manifest.files:
            raise ArtifactError(f"{self._url(stage_path)} has no folder {name!r}; it has {sorted(manifest.files)}")
        prefix = f"files/{name}/"
        if not self._s3 and dest is None:
            for entry in manifest.files[name]:
                path = Path(stage_path, entry.path)
                if not path.is_file():
                    raise _missing(str(path))
                _check_content(str(path), *_sha256_file(path), entry)
            return Path(stage_path, prefix)
        if dest is None:
            cache = Path(os.environ.get("FOCUS_CACHE_DIR", "~/.cache/focus")).expanduser()
            dest = cache / "artifacts" / manifest.hash[:16] / name
        target = Path(dest)
        target.mkdir(parents=True, exist_ok=True)
        for entry in manifest.files[name]:
            local = target / entry.path.removeprefix(prefix)
            if local.is_file() and _sha256_file(local) == (entry.sha256, entry.size):
                continue
            local.parent.mkdir(parents=True, exist_ok=True)
            temporary = local.with_name(f"{local.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            url = self._url(f"{stage_path}/{entry.path}")
            with self._errors("downloading", url):
                try:
                    self._fs.get_file(f"{stage_path}/{entry.path}", str(temporary))
                except FileNotFoundError:
                    raise _missing(url) from None
            digest, size = _sha256_file(temporary)
            try:
                _check_content(url, digest, size, entry)
            except ArtifactError:
                temporary.unlink()
                raise
            os.replace(temporary, local)
        return target

    # --- runs

    def write_run_info(self, run_id: str, info: Mapping[str, Any]) -> dict[str, Any]:
        """Merge ``info`` into ``{root}/{run_id}/_run.json`` (atomically) and return the result.

        Typical keys: ``status`` (running / finished / failed), ``config``, ``mlflow_run_id``. The store
        keeps ``created_at`` from the first write and sets ``updated_at``.
        """
        _check_run_id(run_id)
        status = info.get("status")
        if status is not None and status not in RUN_STATUSES:
            raise ValueError(f"run status {status!r} is not one of {list(RUN_STATUSES)}")
        merged = {**(self.run_info(run_id) or {}), **plain_data(dict(info), "run info")}
        now = _now()
        merged.update(kind=RUN_INFO_KIND, run_id=run_id, updated_at=now)
        merged.setdefault("created_at", now)
        path = f"{self._base}/{run_id}/{RUN_INFO_NAME}"
        with self._errors("writing", self._url(path)):
            self._write_atomic(path, json.dumps(merged, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        return merged

    def run_info(self, run_id: str) -> dict[str, Any] | None:
        """The run's ``_run.json``, or None if it has none."""
        _check_run_id(run_id)
        path = f"{self._base}/{run_id}/{RUN_INFO_NAME}"
        url = self._url(path)
        with self._errors("reading", url):
            try:
                text = self._fs.cat_file(path)
            except FileNotFoundError:
                return None
        try:
            info = json.loads(text)
        except (ValueError, UnicodeDecodeError) as error:
            raise ArtifactError(f"{url} is corrupt (not JSON: {error}); delete it and write it again") from None
        if not isinstance(info, dict) or info.get("kind") != RUN_INFO_KIND:
            raise ArtifactError(f'{url} is not a FOCUS run file (no "kind": "{RUN_INFO_KIND}"); move it away')
        return info

    def read_run_file(self, run_id: str, name: str) -> str | None:
        """The text of a small file ``{root}/{run_id}/{name}`` (e.g. the lease), or None if there is none."""
        _check_run_id(run_id)
        path = f"{self._base}/{run_id}/{name}"
        with self._errors("reading", self._url(path)):
            try:
                return self._fs.cat_file(path).decode()
            except FileNotFoundError:
                return None

    def write_run_file(self, run_id: str, name: str, text: str) -> None:
        """Write ``{root}/{run_id}/{name}`` whole (a reader sees the old text or the new one, never a part)."""
        _check_run_id(run_id)
        path = f"{self._base}/{run_id}/{name}"
        with self._errors("writing", self._url(path)):
            self._write_atomic(path, text)

    def remove_run_file(self, run_id: str, name: str) -> None:
        _check_run_id(run_id)
        path = f"{self._base}/{run_id}/{name}"
        with self._errors("deleting", self._url(path)), contextlib.suppress(FileNotFoundError):
            self._fs.rm_file(path)

    def committed(self, run_id: str) -> list[tuple[int, str, Manifest]]:
        """Every committed (iteration, stage, manifest) of a run, by iteration, then commit time."""
        _check_run_id(run_id)
        pattern = f"{self._base}/{run_id}/iteration=*/*/{MANIFEST_NAME}"
        with self._errors("listing", self._url(f"{self._base}/{run_id}")):
            paths = self._fs.glob(pattern)
            texts = self._fs.cat(paths) if paths else {}
        found = []
        for path in paths:
            match = _MANIFEST_PATH.search(path)
            if match is None:  # e.g. a folder "iteration=old" that FOCUS did not write
                continue
            iteration, stage = int(match["iteration"]), match["stage"]
            found.append((iteration, stage, self._parse_manifest(texts[path], path, (run_id, iteration, stage))))
        found.sort(key=lambda item: (item[0], item[2].created_at, item[1]))
        return found

    def list_runs(self) -> list[RunSummary]:
        """All runs under the root (folders with a ``_run.json`` or a manifest), sorted by run id."""
        with self._errors("listing", self.root):
            try:
                entries = self._fs.ls(self._base, detail=True)
            except FileNotFoundError:
                return []
        run_ids = sorted(
            entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries if entry["type"] == "directory"
        )
        summaries = []
        for run_id in run_ids:
            if not _RUN_ID.fullmatch(run_id):
                continue
            info = self.run_info(run_id)
            committed = self.committed(run_id)
            if info is None and not committed:
                continue  # not a FOCUS run
            stages: dict[int, tuple[str, ...]] = {}
            compute = overhead = 0.0
            for iteration, stage, manifest in committed:
                stages[iteration] = (*stages.get(iteration, ()), stage)
                for key, seconds in manifest.timings.items():
                    if key == COMPUTE_TIMING:
                        compute += seconds
                    elif key not in PARTS_OF_COMPUTE:
                        overhead += seconds
            last = max(committed, key=lambda item: item[2].created_at, default=None)
            info = info or {}
            summaries.append(
                RunSummary(
                    run_id=run_id,
                    status=info.get("status", "unknown"),
                    created_at=info.get("created_at"),
                    updated_at=info.get("updated_at"),
                    stages=stages,
                    last_committed=(last[0], last[1]) if last else None,
                    compute_s=compute,
                    overhead_s=overhead,
                    info=info,
                )
            )
        return summaries

    def parquet_files(self, run_id: str, table: str) -> list[tuple[int, str, str]]:
        """(iteration, stage, url) of every committed part of ``table`` in a run, for DuckDB views.

        Local URLs are paths; S3 URLs need ``con.register_filesystem(store.filesystem)`` first.
        """
        _check_name("table", table)
        return [
            (iteration, stage, self._url(f"{self._stage_path(run_id, iteration, stage)}/{part.path}"))
            for iteration, stage, manifest in self.committed(run_id)
            for part in manifest.tables.get(table, ())
        ]

    # --- error translation

    @contextlib.contextmanager
    def _errors(self, action: str, url: str) -> Iterator[None]:
        """Turn connection, credential and permission failures into an ArtifactError with the fix."""
        try:
            yield
        except ArtifactError:
            raise
        except Exception as error:
            translated = self._translate(error, action, url)
            if translated is None:
                raise
            raise translated from error

    def _translate(self, error: Exception, action: str, url: str) -> ArtifactError | None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return ArtifactError(f"no space left on the device {action} {url} ({error.strerror}): free space there "
                                 f"or give another --store; the stage was not committed, a resume redoes it")
        if isinstance(error, PermissionError):
            fix = (
                "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's policy"
                if self._s3
                else "check the folder's owner and permissions"
            )
            return ArtifactError(f"permission denied {action} {url} ({error}): {fix}")
        if not self._s3:
            return None
        from botocore import exceptions as boto  # s3fs's dependency; imported only for S3 stores

        if isinstance(error, boto.NoCredentialsError | boto.PartialCredentialsError):
            return ArtifactError(
                f"no S3 credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment "
                f'(for the local server: eval "$(python -m infra.services env s3)"); FOCUS never reads them '
                f"from config"
            )
        if isinstance(error, boto.ConnectionError | boto.HTTPClientError | ConnectionError | TimeoutError):
            return StoreUnavailable(
                f"cannot reach S3 endpoint {_s3_endpoint() or 'AWS'} while {action} {url} ({error}): {_S3_FIX}"
            )
        return None


# --- module helpers ---------------------------------------------------------------------------------------


def _check_run_id(run_id: str) -> None:
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ValueError(
            f"run id {run_id!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{kind} name {name!r}: use lower-case letters, digits and '_', starting with a letter")


def _missing(url: str) -> ArtifactError:
    return ArtifactError(
        f"{url} is listed in the manifest but missing; delete the stage folder and resume to recompute it"
    )


def _check_content(url: str, digest: str, size: int, entry: StoredFile) -> None:
    if size != entry.size or digest != entry.sha256:
        raise ArtifactError(
            f"{url} is corrupt: {size} bytes with sha256 {digest[:12]}..., but the manifest lists {entry.size} "
            f"bytes with sha256 {entry.sha256[:12]}... (truncated, overwritten or swapped). Fix: delete the stage "
            f"folder and resume to recompute it"
        )


def _sha256_file(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _s3_endpoint() -> str | None:
    """The endpoint botocore will use, from the standard variables (service-specific one first)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _s3_filesystem() -> fsspec.AbstractFileSystem:
    import s3fs  # deferred: local stores do not need it

    filesystem = s3fs.S3FileSystem(
        skip_instance_cache=True,  # the AWS variables may differ between stores (tests, several endpoints)
        use_listings_cache=False,  # other processes write to the same bucket; never trust a stale listing
        config_kwargs=_S3_CLIENT_CONFIG,
    )
    filesystem.retries = 3  # s3fs's own retry loop on top of botocore's (default 5, with backoff)
    return filesystem
