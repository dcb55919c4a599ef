"""Every content-derived id and seed of FOCUS, in one place.

Ids are never random and never ``hash()``: they are digests of what they name, so a resumed run, another
process or another machine derives the same ids and seeds. Two encodings feed the digests: ``content_id``'s
tagged, length-prefixed bytes (("ab", "c") and ("a", "bc") differ) and ``canonical_json`` (sorted keys, finite
numbers), which the artifact store also uses for manifests and stage versions. Changing any function here
changes stored ids: stages committed before would no longer be found, so don't.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np


def _blake8(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


# --- strings: ids of tasks, episodes, branches ----------------------------------------------------------------


def content_id(*parts: Any) -> str:
    """A stable 16-hex-digit id derived from the parts (blake2b, 8 bytes).

    Stable across processes and machines, unlike ``hash()``: every part is encoded canonically with a
    type tag and a length prefix, so ("ab", "c") and ("a", "bc") differ. Supported parts: None, bool,
    int, float, str, bytes, numpy scalars and arrays, and lists/tuples/dicts of these. Other objects
    raise TypeError because their repr may contain memory addresses.
    """
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(_canonical_bytes(part))
    return digest.hexdigest()


def _tagged(tag: bytes, payload: bytes) -> bytes:
    return tag + struct.pack("<Q", len(payload)) + payload


def _canonical_bytes(part: Any) -> bytes:
    if isinstance(part, np.generic):
        part = part.item()
    if part is None:
        return _tagged(b"N", b"")
    if isinstance(part, bool):  # before int: bool is a subclass of int
        return _tagged(b"B", b"1" if part else b"0")
    if isinstance(part, int):
        return _tagged(b"I", str(part).encode())
    if isinstance(part, float):
        return _tagged(b"F", repr(part).encode())
    if isinstance(part, str):
        return _tagged(b"S", part.encode("utf-8"))
    if isinstance(part, bytes | bytearray | memoryview):
        return _tagged(b"Y", bytes(part))
    if isinstance(part, np.ndarray):
        header = f"{part.dtype.str}{part.shape}".encode()
        return _tagged(b"A", _tagged(b"h", header) + np.ascontiguousarray(part).tobytes())
    if isinstance(part, list | tuple):
        return _tagged(b"L", b"".join(_canonical_bytes(item) for item in part))
    if isinstance(part, dict):
        items = sorted((_canonical_bytes(key), _canonical_bytes(value)) for key, value in part.items())
        return _tagged(b"D", b"".join(key + value for key, value in items))
    raise TypeError(
        f"content_id cannot encode {type(part).__name__}; pass str, int, float, bytes, numpy data "
        f"or lists/tuples/dicts of them"
    )


def task_id(env: str, *parts: Any) -> str:
    """A short content id for a task: the same generator input always gives the same id."""
    return _blake8("\x00".join([env, *map(str, parts)]).encode()).hex()


def episode_id(run_id: str, iteration: int, task_id: str, kind: str, *keys: Any) -> str:
    """Id of one episode: ``kind`` is e.g. "main" or "branch"; ``keys`` tell episodes of one kind apart
    (the sample index within a task's group, or a branch's state id, round and index)."""
    return content_id("episode", run_id, int(iteration), task_id, kind, list(keys))


def branch_id(state_id: str, round: int, index: int) -> str:
    """Id of continuation ``index`` allocated to a state in acquisition ``round`` (unique per iteration;
    the same state recurs across iterations, so join on run_id and iteration too)."""
    return content_id("branch", state_id, int(round), int(index))


# --- numbers: seeds and fractions ---------------------------------------------------------------------------


def unit_fraction(key: str) -> float:
    """A number in [0, 1) from ``key``, uniform over keys (the split of a task by its split key)."""
    return int.from_bytes(_blake8(key.encode()), "big") / 2**64


def seed_of(key: str, bits: int = 63) -> int:
    """A ``bits``-bit seed from ``key``, the same in every process and Python version."""
    return int.from_bytes(_blake8(key.encode()), "little") >> (64 - bits)


def derive_seed(run_seed: int, iteration: int, stage: str, *keys: str | int) -> int:
    """A 63-bit seed from (run seed, iteration, stage, keys...), e.g. keys = (state_id, branch_index).

    A resumed stage derives the same seeds as an uninterrupted one, and distinct key tuples give
    independent seeds (sha256), unlike ``run_seed + iteration``-style arithmetic.
    """
    digest = hashlib.sha256(canonical_json(["focus.seed", run_seed, iteration, stage, *keys]).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


# --- canonical JSON ----------------------------------------------------------------------------------------


def canonical_json(value: Any, where: str = "value") -> str:
    """Deterministic JSON of plain data: sorted keys, no whitespace, finite floats, str keys only.

    Numpy scalars become Python numbers and tuples become lists; anything else that is not JSON data
    raises TypeError naming ``where`` (e.g. ``config.lr``), because its repr might not be stable.
    """
    return json.dumps(plain_data(value, where), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def plain_data(value: Any, where: str) -> Any:
    """``value`` as JSON data (numpy scalars as numbers, tuples as lists), or an error naming ``where``."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: non-finite number {value}; JSON artifacts hold finite numbers only")
        return value
    if isinstance(value, Mapping):
        plain = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: key {key!r} is not a string; use string keys")
            plain[key] = plain_data(item, f"{where}.{key}")
        return plain
    if isinstance(value, list | tuple):
        return [plain_data(item, f"{where}[{index}]") for index, item in enumerate(value)]
    raise TypeError(
        f"{where}: {type(value).__name__} is not JSON data; pass str, int, float, bool, None, lists or dicts"
    )
