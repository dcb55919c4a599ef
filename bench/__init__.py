"""Benchmarks: each prints its figures as JSON (and may write them with --json PATH)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit_json(results: Any, path: Path | None) -> None:
    """Print ``results`` as JSON and, when ``path`` is given, write the same text there."""
    text = json.dumps(results, indent=2)
    print(text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
