"""Parsing one policy turn (Qwen3 format) into thinking, content, tool calls and a final answer.

Grammar (what ``parse_turn`` accepts)::

  turn      := [thinking] rest
  thinking  := "<think>" text "</think>"      (text starting with <think> closes at the first </think>)
             | text "</think>"                (the opening tag was in the prompt; only when this
                                               </think> comes before the first <tool_call>)
  rest      := any text with zero or more  "<tool_call>" body "</tool_call>"  blocks
  body      := JSON object {"name": non-empty string, "arguments": object | JSON string of an object}
               ("arguments" may be absent: {}); surrounding whitespace is ignored.
  answer    := the text of the first "<answer>...</answer>" outside think and tool-call blocks; if
               there is none and the turn made no calls, the content itself (None when empty).

A trailing ``<|im_end|>`` / ``<|endoftext|>`` (the sampled stop token, when the caller decoded it)
is ignored. Tags inside the think block are reasoning and are never executed, unless
``parse_turn(text, calls_in_think=True)`` (``rollout.calls_in_think``; the released code parses calls
from the whole turn, thought included): then the think block's call blocks come first in ``calls``,
scanned by the same grammar within the block (a call must open and close inside the thought), and
the block's other text still stays out of ``content``.

Malformed calls never raise: each becomes a ``CallError`` whose message starts with
``"tool call N: "`` (N = 1-based position among the turn's call blocks) and is one of:

  - ``unclosed <tool_call> tag``                     (no </tool_call> before the end of the turn)
  - ``<tool_call> opened again before </tool_call>`` (a second opening tag inside the block; the
                                                      scan resumes at that second tag)
  - ``</tool_call> without a matching <tool_call>``
  - ``empty body``
  - ``invalid JSON (<decoder message> at char P)``   (``truncated JSON`` when the error is at the end)
  - ``JSON nested too deeply``                      (more than ``MAX_JSON_DEPTH`` = 128 levels)
  - ``body must be a JSON object, got <type>``
  - ``missing "name"`` / ``"name" must be a non-empty string, got <type>``
  - ``arguments must be a JSON object, got <type>``
  - ``arguments string is not valid JSON (...)`` / ``arguments string must hold a JSON object, got <type>``

``<type>`` is the JSON type name: object, list, string, number, boolean, null.

Ambiguity: the first ``</tool_call>`` after ``<tool_call>`` ends the block, even inside a JSON
string (as in Qwen's own parsers), so raw model text whose arguments literally contain
``</tool_call>`` is cut there and reported as invalid JSON. ``render_tool_call`` avoids this by
writing ``<`` of the tag texts inside strings as the JSON escape ``\\u003c``; its output parses back
to the same name and arguments for every JSON value.

All scanning uses ``str.find`` from monotonically advancing positions (no regular expressions), so
the cost is linear in the length of the text, including adversarial inputs.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from turnsight_jax.chat.types import Call, CallError, ToolCall

OPEN_CALL = "<tool_call>"
CLOSE_CALL = "</tool_call>"
OPEN_THINK = "<think>"
CLOSE_THINK = "</think>"
OPEN_ANSWER = "<answer>"
CLOSE_ANSWER = "</answer>"
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
# A call's JSON body nested deeper than this is refused ("JSON nested too deeply").
MAX_JSON_DEPTH = 128


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """One policy turn, parsed.

    thinking: text of the think block (newlines at its edges stripped), None when there is none.
    content: text outside think and tool-call blocks, whitespace-stripped.
    calls: one entry per tool-call block, in order (ToolCall or CallError).
    answer: the final answer (see the module docstring), None when the turn gives none.
    """

    thinking: str | None
    content: str
    calls: list[Call]
    answer: str | None


def json_type_name(value: Any) -> str:
    """JSON name of a decoded value's type (for error messages)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def json_depth(value: Any, stop: int) -> int:
    """Nesting depth of a JSON-like value (a scalar is 0, ``[]`` and ``{}`` are 1), counted without
    recursion; counting stops once the depth exceeds `stop`."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > stop:
            break
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _loads(text: str) -> tuple[Any, str | None]:
    """Decode JSON; return (value, None) or (None, error description). Never raises."""
    try:
        value = json.loads(text)
        # A fixed bound, not whatever the caller's stack leaves: every later coder of the call
        # (the executor, records, fault keys) recurses once per level.
        if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
            return None, "JSON nested too deeply"
        return value, None
    except json.JSONDecodeError as e:
        where = f"{e.msg.removesuffix(' at')} at char {e.pos}"
        # An unterminated string reports where the string starts, but it too means the text ended early.
        if e.pos >= len(text) or e.msg.startswith("Unterminated string"):
            return None, f"truncated JSON ({where})"
        return None, f"invalid JSON ({where})"
    except RecursionError:
        return None, "JSON nested too deeply"
    except ValueError as e:  # e.g. integers beyond Python's digit limit
        return None, f"invalid JSON ({e})"
    except Exception as e:  # noqa: BLE001 - MemoryError, ...: model text never raises out of here
        return None, f"invalid JSON ({type(e).__name__})"


def _parse_call_body(body: str) -> ToolCall | str:
    """A ToolCall, or the error description (without the "tool call N: " prefix)."""
    stripped = body.strip()
    if not stripped:
        return "empty body"
    value, error = _loads(stripped)
    if error is not None:
        return error
    if not isinstance(value, dict):
        return f"body must be a JSON object, got {json_type_name(value)}"
    if "name" not in value:
        return 'missing "name"'
    name = value["name"]
    if not isinstance(name, str) or not name:
        return f'"name" must be a non-empty string, got {"empty string" if name == "" else json_type_name(name)}'
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        decoded, error = _loads(arguments)
        if error is not None:
            return f"arguments string is not valid JSON ({error})"
        if not isinstance(decoded, dict):
            return f"arguments string must hold a JSON object, got {json_type_name(decoded)}"
        arguments = decoded
    elif not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {json_type_name(arguments)}"
    return ToolCall(name=name, arguments=arguments, raw=body)


def _strip_stop_token(text: str) -> str:
    for stop in _STOP_TOKENS:
        if text.endswith(stop):
            return text[: -len(stop)]
    return text


def _split_thinking(text: str) -> tuple[str | None, tuple[int, int], int]:
    """(thinking text or None, (start, end) of the raw think body, index where the rest starts)."""
    lead = len(text) - len(text.lstrip())
    if text.startswith(OPEN_THINK, lead):
        body_start = lead + len(OPEN_THINK)
        close = text.find(CLOSE_THINK, body_start)
        if close == -1:  # cut inside the thought: nothing after it is actionable
            return text[body_start:].strip("\n"), (body_start, len(text)), len(text)
        return text[body_start:close].strip("\n"), (body_start, close), close + len(CLOSE_THINK)
    close = text.find(CLOSE_THINK)
    if close != -1:
        first_call = text.find(OPEN_CALL, 0, close)
        if first_call == -1:
            opened = text.rfind(OPEN_THINK, 0, close)
            start = 0 if opened == -1 else opened + len(OPEN_THINK)
            return text[start:close].strip("\n"), (start, close), close + len(CLOSE_THINK)
    return None, (0, 0), 0


def _find_answer(content: str) -> str | None:
    start = content.find(OPEN_ANSWER)
    if start == -1:
        return None
    body_start = start + len(OPEN_ANSWER)
    end = content.find(CLOSE_ANSWER, body_start)
    # An unclosed <answer> (model stopped without the closing tag) still counts.
    return (content[body_start:] if end == -1 else content[body_start:end]).strip()


def _scan_calls(text: str, pos: int, end: int, calls: list[Call], outside: list[str]) -> None:
    """Scan text[pos:end] for call blocks: append each to `calls` (numbered after those already
    there) and the text between them to `outside`."""
    # Next opening / closing tag at or after `pos`. Each is recomputed only once `pos` has passed
    # it, and `pos` only moves forward, so every character is searched at most once per tag:
    # linear time even for floods of tags.
    next_open = text.find(OPEN_CALL, pos, end)
    next_close = text.find(CLOSE_CALL, pos, end)
    len_open, len_close = len(OPEN_CALL), len(CLOSE_CALL)

    while pos < end:
        if next_open != -1 and next_open < pos:
            next_open = text.find(OPEN_CALL, pos, end)
        if next_close != -1 and next_close < pos:
            next_close = text.find(CLOSE_CALL, pos, end)
        if next_open == -1 and next_close == -1:
            outside.append(text[pos:end])
            break
        if next_open == -1 or (next_close != -1 and next_close < next_open):
            outside.append(text[pos:next_close])
            calls.append(
                CallError(f"tool call {len(calls) + 1}: {CLOSE_CALL} without a matching {OPEN_CALL}", CLOSE_CALL)
            )
            pos = next_close + len_close
            continue
        outside.append(text[pos:next_open])
        body_start = next_open + len_open
        reopen = text.find(OPEN_CALL, body_start, next_close if next_close != -1 else end)
        if reopen != -1:
            calls.append(
                CallError(
                    f"tool call {len(calls) + 1}: {OPEN_CALL} opened again before {CLOSE_CALL}",
                    text[body_start:reopen],
                )
            )
            pos = next_open = reopen
            continue
        if next_close == -1:
            calls.append(CallError(f"tool call {len(calls) + 1}: unclosed {OPEN_CALL} tag", text[body_start:end]))
            break
        body = text[body_start:next_close]
        parsed = _parse_call_body(body)
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            calls.append(CallError(f"tool call {len(calls) + 1}: {parsed}", body))
        pos = next_close + len_close


def parse_turn(text: str, *, calls_in_think: bool = False) -> ParsedTurn:
    """Parse one policy turn's text. Never raises on model output; see the module docstring.
    calls_in_think: also execute the call blocks written inside the think block."""
    if not isinstance(text, str):
        raise TypeError(f"parse_turn expects str, got {type(text).__name__}")
    text = _strip_stop_token(text)
    thinking, (think_start, think_end), pos = _split_thinking(text)
    calls: list[Call] = []
    outside: list[str] = []
    if calls_in_think and thinking is not None:
        _scan_calls(text, think_start, think_end, calls, [])  # the thought's own text is not content
    _scan_calls(text, pos, len(text), calls, outside)
    content = "".join(outside).strip()
    answer = _find_answer(content)
    if answer is None and not calls and content:
        answer = content
    return ParsedTurn(thinking=thinking, content=content, calls=calls, answer=answer)


def render_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One call in Qwen3 format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    JSON is ``json.dumps(..., ensure_ascii=False)``, as the chat template writes past calls. Inside
    JSON strings the tag texts ``<tool_call>`` / ``</tool_call>`` have their ``<`` written as
    ``\\u003c`` (still the same JSON value) so that ``parse_turn`` reads the block back unchanged.
    """
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    # '<' never occurs in JSON outside a string or inside an escape sequence, so these replacements
    # only touch string contents.
    body = body.replace(CLOSE_CALL, "\\u003c/tool_call>").replace(OPEN_CALL, "\\u003ctool_call>")
    return f"{OPEN_CALL}\n{body}\n{CLOSE_CALL}"
