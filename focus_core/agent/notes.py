"""The deterministic notes compressor (``agent.compression: notes``): what a segment keeps when it closes.

While a segment runs, the harness keeps a note of each observation (``note``: its first characters). When the
segment closes, its summary is the last few notes and the last call (``summarize_notes``). The scripted expert
writes the same text when asked to summarize, so its demonstrations teach what the compressor would keep.
"""

from __future__ import annotations

from collections.abc import Sequence

NOTE_CHARS = 240  # how much of each observation a note keeps
NOTES_KEPT = 4  # how many of the segment's last notes a summary keeps


def note(observation: str) -> str:
    """An observation's note: its first ``NOTE_CHARS`` characters, whitespace collapsed."""
    return " ".join(observation.split())[:NOTE_CHARS]


def summarize_notes(notes: Sequence[str], history: Sequence[tuple[str, str]]) -> str:
    """The start of each of the segment's last observations, then the last action (its last line)."""
    lines = [f"- {text}" for text in notes[-NOTES_KEPT:] if text]
    if history:
        lines.append(f"Last call: {(history[-1][0].splitlines() or [''])[-1]}")
    return "\n".join(lines)
