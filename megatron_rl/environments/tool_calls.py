"""Tool calls in assistant messages: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, parsed and answered.

The format is the one Qwen2.5/Qwen3 and Hermes-style chat models are trained on: one JSON object per call between
the tags, `arguments` an object (a string holding a JSON object, as in OpenAI's API, is accepted too). A message may
hold several calls; each is answered with its own `{"role": "tool", "content": ...}` message, in order.

A call cut off by the turn's stop string is still a call: the rollout stops each turn at `</tool_call>`
(environment.stop) and the engine may leave the stop string out of the text, so a final `<tool_call>` without its
closing tag counts as closed at the end of the message.

Nothing here raises on model output: a call that is not valid JSON, names no tool, names an unknown tool or passes
wrong arguments becomes a ToolCall with `error` set, and `answer_calls` answers it with an error message the model
can read and correct ("error: ..."), never a crash of the environment.
"""
from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)
MAX_CALL_CHARS = 10_000  # a call this long is not a call; bounds what json.loads and the tools see
MAX_RESULT_CHARS = 2000  # a tool result is cut here (the model reads it, the token budget pays for it)


@dataclass
class ToolCall:
    """One parsed call: name and arguments, or `error` (what is wrong with it) and whatever could be read."""
    name: Optional[str]
    arguments: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None
    raw: str = ""  # the text between the tags


class ToolError(Exception):
    """Raised by a tool for bad input; its message is shown to the model as the call's result."""


def has_tool_call(text: str) -> bool:
    return OPEN in text


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` in `text`, in order (the last one may lack its closing tag)."""
    return [_parse_one(m.group(1)) for m in _CALL_RE.finditer(text)]


def _parse_one(raw: str) -> ToolCall:
    body = raw.strip()
    if len(body) > MAX_CALL_CHARS:
        return ToolCall(None, error=f"the call is longer than {MAX_CALL_CHARS} characters", raw=raw[:200])
    if not body:
        return ToolCall(None, error='empty call: expected {"name": ..., "arguments": {...}}', raw=raw)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, error=f"the call is not valid JSON ({e.msg} at character {e.pos})", raw=raw)
    except RecursionError:
        return ToolCall(None, error="the call's JSON is nested too deeply", raw=raw)
    if not isinstance(obj, dict):
        return ToolCall(None, error=f'the call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got '
                                    f"{type(obj).__name__}", raw=raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, error='the call has no "name" (a string)', raw=raw)
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI's wire format: the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(name, error=f'"arguments" is a string but not valid JSON ({e.msg})', raw=raw)
    if not isinstance(args, dict):
        return ToolCall(name, error=f'"arguments" must be a JSON object, got {type(args).__name__}', raw=raw)
    return ToolCall(name, args, raw=raw)


def answer_calls(calls: list[ToolCall], tools: dict[str, Callable[..., str]]) -> tuple[list[dict], int]:
    """One tool message per call: the tool's result, or "error: ..." for a malformed call, an unknown tool, wrong
    arguments or a ToolError/ValueError from the tool. Returns (messages, number of calls that errored).

    Only ToolError and ValueError (bad input) become answers; any other exception is a bug in the tool and
    propagates (in an environment worker it ends the trajectory as "raised", and is counted)."""
    out, errors = [], 0
    for call in calls:
        try:
            content = _answer(call, tools)
        except (ToolError, ValueError) as e:
            content = f"error: {e}"
        if content.startswith("error: "):
            errors += 1
        if len(content) > MAX_RESULT_CHARS:
            content = content[:MAX_RESULT_CHARS] + " ...(cut)"
        out.append({"role": "tool", "content": content})
    return out, errors


def _answer(call: ToolCall, tools: dict[str, Callable[..., str]]) -> str:
    if call.error is not None:
        return f"error: {call.error}"
    fn = tools.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r} (available: {', '.join(sorted(tools))})"
    try:  # the arguments against the tool's signature first: a wrong name is the model's error, not the tool's
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        return f"error: {call.name}: {e}"
    return str(fn(**call.arguments))
