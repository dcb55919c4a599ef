"""The tool-call grammar: how a policy's text turns into a tool call, and how a call is written.

A policy message ends with exactly one tool call, in either of two forms:

* the call form, short enough for a tiny model to learn:   ``search(query="bridge builders", k=5)``
  (positional arguments follow the tool's parameter order: ``search("bridge builders")``);
* the JSON form most chat templates use:
  ``<tool_call>{"name": "search", "arguments": {"query": "bridge builders"}}</tool_call>``.

Text before the call is free reasoning and is ignored. Parsing never executes anything (the call
form is read with ``ast`` and only literal arguments are accepted) and never raises on bad input:
``parse_tool_call`` returns either a ``ToolCall`` or a ``ToolCallError`` whose message is shown to
the policy as its next observation, so malformed output is environment feedback, not a crash.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

MAX_CALL_CHARS = 4000  # longer "calls" are rejected before parsing (runaway generations)


@dataclass(frozen=True)
class ToolSpec:
    """A tool the environment offers: its name, what it does, and its parameters in order."""

    name: str
    description: str
    parameters: tuple[tuple[str, str, str], ...] = ()  # (name, type: "string" | "integer", description)
    required: tuple[str, ...] = ()

    def json_schema(self) -> dict[str, Any]:
        """The OpenAI/Hugging Face function schema, for chat templates that render tools."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {n: {"type": t, "description": d} for n, t, d in self.parameters},
                    "required": list(self.required),
                },
            },
        }

    def signature(self) -> str:
        """``search(query, k=5)``-style one-line description for plain-text system prompts."""
        args = [n if n in self.required else f"{n}=..." for n, _, _ in self.parameters]
        return f"{self.name}({', '.join(args)})"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def render(self) -> str:
        """The call form of this call (what the scripted expert writes)."""
        args = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in self.arguments.items())
        return f"{self.name}({args})"


@dataclass(frozen=True)
class ToolCallError:
    """Why a message could not be read as a call to an offered tool; shown to the policy."""

    message: str


_JSON_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_CALL_START = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\(")


def parse_tool_call(text: str, tools: dict[str, ToolSpec]) -> ToolCall | ToolCallError:
    """Read the last tool call in ``text`` and check it against ``tools``."""
    if not isinstance(text, str):
        return ToolCallError(f"expected text, got {type(text).__name__}")
    json_match = _JSON_CALL.findall(text)
    raw = _parse_json_call(json_match[-1]) if json_match else _parse_call_form(text, tools)
    if isinstance(raw, ToolCallError):
        return raw
    return _check_against_spec(raw, tools)


def _parse_json_call(payload: str) -> ToolCall | ToolCallError:
    try:
        data = json.loads(payload)
    except json.JSONDecodeError as exc:
        return ToolCallError(f"the <tool_call> block is not valid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCallError('a <tool_call> block needs {"name": ..., "arguments": {...}}')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some templates double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCallError("the arguments of the <tool_call> are not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCallError("the arguments of the <tool_call> must be a JSON object")
    return ToolCall(data["name"], dict(arguments))


def _parse_call_form(text: str, tools: dict[str, ToolSpec]) -> ToolCall | ToolCallError:
    # The call is the last `name(` that starts a call to an offered tool; everything before is thought.
    starts = [m for m in _CALL_START.finditer(text) if m.group(1) in tools]
    if not starts:
        offered = ", ".join(spec.signature() for spec in tools.values())
        return ToolCallError(f"no tool call found. End your message with one call: {offered}")
    start = starts[-1]
    candidate = text[start.start():].strip()
    if len(candidate) > MAX_CALL_CHARS:
        return ToolCallError(f"the tool call is longer than {MAX_CALL_CHARS} characters")
    closing = _matching_paren(candidate, len(start.group(1)))
    if closing is None:
        return ToolCallError(f"the call to {start.group(1)} is not closed with ')'")
    try:
        node = ast.parse(candidate[: closing + 1], mode="eval").body
    except SyntaxError as exc:
        return ToolCallError(f"the call to {start.group(1)} is not valid syntax ({exc.msg})")
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return ToolCallError(f"write the call as {tools[start.group(1)].signature()}")
    spec = tools[node.func.id]
    try:
        positional = [ast.literal_eval(arg) for arg in node.args]
        keywords = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except (ValueError, SyntaxError):
        return ToolCallError(f"arguments of {spec.name} must be plain strings or numbers")
    if len(positional) > len(spec.parameters):
        return ToolCallError(f"{spec.name} takes at most {len(spec.parameters)} arguments: {spec.signature()}")
    arguments = {spec.parameters[i][0]: value for i, value in enumerate(positional)}
    for key, value in keywords.items():
        if key in arguments:
            return ToolCallError(f"{spec.name} got argument {key!r} twice")
        arguments[key] = value
    return ToolCall(spec.name, arguments)


def _matching_paren(text: str, open_index: int) -> int | None:
    """Index of the ')' closing the '(' at ``open_index``, skipping quoted strings."""
    depth, quote, escaped = 0, None, False
    for i in range(open_index, len(text)):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i
    return None


def _check_against_spec(call: ToolCall, tools: dict[str, ToolSpec]) -> ToolCall | ToolCallError:
    spec = tools.get(call.name)
    if spec is None:
        return ToolCallError(f"unknown tool {call.name!r}; tools: {', '.join(sorted(tools))}")
    known = {name: kind for name, kind, _ in spec.parameters}
    unknown = sorted(set(call.arguments) - set(known))
    if unknown:
        return ToolCallError(f"{spec.name} has no argument {unknown[0]!r}; use {spec.signature()}")
    missing = [name for name in spec.required if name not in call.arguments]
    if missing:
        return ToolCallError(f"{spec.name} needs {missing[0]!r}: {spec.signature()}")
    arguments = {}
    for name, value in call.arguments.items():
        if known[name] == "integer":
            if isinstance(value, bool) or not isinstance(value, int | str) or (
                isinstance(value, str) and not value.strip().lstrip("-").isdigit()
            ):
                return ToolCallError(f"{spec.name}: {name} must be a whole number, got {value!r}")
            arguments[name] = int(value)
        else:
            if not isinstance(value, str | int | float) or isinstance(value, bool):
                return ToolCallError(f"{spec.name}: {name} must be text, got {value!r}")
            arguments[name] = str(value)
    return ToolCall(spec.name, arguments)
