"""Value types shared by the chat format, the environments and the rollout driver."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One well-formed tool call parsed from policy text.

    `arguments` is the decoded JSON object; `raw` the text between the <tool_call> tags.
    """

    name: str
    arguments: dict[str, Any]
    raw: str = ""


@dataclasses.dataclass(frozen=True)
class CallError:
    """A tool call the parser could not accept.

    The environment returns `message` to the policy as that call's observation text, so a
    malformed call costs one observation, never an exception.
    """

    message: str
    raw: str = ""


Call = ToolCall | CallError


@dataclasses.dataclass(frozen=True)
class Task:
    """One task in FTRL format (docs/spec.md §3); every source (FTRL, ToolHop, built-in) maps to this.

    messages: chat messages of the prompt (usually one user message).
    tools: OpenAI-style function schemas, [{"type": "function", "function": {...}}].
    codes: tool name -> Python source defining a function of that name (run only in the isolated
      executor, never in the trainer's process).
    unsolved_set: tool name -> gold intermediate answers (FTRL's Solve-P/R/F1).
    answer: gold final answer.
    gold_calls: optional gold call chain, one list of {"name", "arguments"} per turn (MatchTIR).
    """

    task_id: str
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...]
    codes: dict[str, str]
    unsolved_set: dict[str, list[str]]
    answer: str
    data_source: str = ""
    category: str = ""
    gold_calls: tuple[tuple[dict[str, Any], ...], ...] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
