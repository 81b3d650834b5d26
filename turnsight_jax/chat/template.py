"""The official Qwen3 chat template, re-implemented in Python.

Why not Jinja: rollouts render thousands of prompts and observation suffixes per step, and the
rollout must know exactly where each piece starts in token space (the policy's sampled tokens are
appended as they are, never re-tokenised). Rendering the pieces ourselves gives both speed and
control of the boundaries. ``tests/test_chat_template.py`` checks that the strings and ids equal
``tokenizer.apply_chat_template`` of the fixture Qwen3 tokenizer.

Layout (what the official template produces)::

  <|im_start|>system\\n[system content\\n\\n]# Tools ... <tools>\\n{tool json}\\n...</tools> ...<|im_end|>\\n
  <|im_start|>user\\n{content}<|im_end|>\\n
  <|im_start|>assistant\\n{policy text}<|im_end|>          <- sampled by the policy
  \\n<|im_start|>user\\n<tool_response>\\n{r1}\\n</tool_response>\\n<tool_response>...<|im_end|>\\n
  <|im_start|>assistant\\n[<think>\\n\\n</think>\\n\\n]     <- observation suffix ends here

Tool JSON is ``json.dumps(obj, ensure_ascii=False)`` with Python's default separators, which is
what transformers' ``tojson`` filter emits.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from turnsight_jax.chat import tokenizer as tok_lib

IM_START = tok_lib.IM_START
IM_END = tok_lib.IM_END
EMPTY_THINK = "<think>\n\n</think>\n\n"

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
# transformers copies older reasoning field names into `reasoning_content` before rendering.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_KNOWN_ROLES = ("system", "user", "assistant", "tool")


def _tojson(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _content(message: Mapping[str, Any]) -> str:
    # The template renders non-string content (None, multimodal lists) as ''.
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _is_tool_response_text(text: str) -> bool:
    return text.startswith("<tool_response>") and text.endswith("</tool_response>")


def _last_query_index(messages: Sequence[Mapping[str, Any]]) -> int:
    """Index of the last real user query (not a user message that only wraps tool responses)."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        content = message.get("content")
        if message.get("role") == "user" and isinstance(content, str) and not _is_tool_response_text(content):
            return index
    return len(messages) - 1


def _reasoning_of(message: Mapping[str, Any]) -> str | None:
    for key in _REASONING_FIELDS:
        value = message.get(key)
        if value is not None:
            return value if isinstance(value, str) else None
    return None


def _render_tool_call(call: Mapping[str, Any]) -> str:
    if call.get("function"):
        call = call["function"]
    arguments = call.get("arguments")
    args_text = arguments if isinstance(arguments, str) else _tojson(arguments)
    return '<tool_call>\n{"name": "' + str(call.get("name")) + '", "arguments": ' + args_text + "}\n</tool_call>"


def _render_assistant(message: Mapping[str, Any], *, after_last_query: bool, is_last: bool) -> str:
    content = _content(message)
    reasoning = _reasoning_of(message)
    if reasoning is None:
        reasoning = ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    # Past turns lose their (empty) think block: only turns after the last user query that carry
    # reasoning, and the final message, are rendered with <think>.
    if after_last_query and (is_last or reasoning):
        out = IM_START + "assistant\n<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
    else:
        out = IM_START + "assistant\n" + content
    for i, call in enumerate(message.get("tool_calls") or ()):
        if i > 0 or content:
            out += "\n"
        out += _render_tool_call(call)
    return out + IM_END + "\n"


def render_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    enable_thinking: bool = True,
) -> str:
    """Render a conversation exactly as the official Qwen3 template does.

    Args:
      messages: dicts with ``role`` in {system, user, assistant, tool} and ``content``; assistant
        messages may carry ``tool_calls`` (``[{"function": {"name", "arguments"}}]`` or the flat
        ``{"name", "arguments"}``; ``arguments`` a dict or a JSON string) and ``reasoning_content``.
      tools: OpenAI-style function schemas; rendered in the system prompt when non-empty.
      add_generation_prompt: append the assistant header for the next turn.
      enable_thinking: when False the generation prompt includes an empty think block.

    Raises:
      ValueError: an empty conversation or an unknown role (the Jinja template would silently
        drop such a message; here it is a bug in the caller).
    """
    if not messages:
        raise ValueError("cannot render an empty conversation")
    for i, message in enumerate(messages):
        if message.get("role") not in _KNOWN_ROLES:
            raise ValueError(f"message {i} has role {message.get('role')!r}; expected one of {_KNOWN_ROLES}")
    parts: list[str] = []
    first = messages[0]
    if tools:
        parts.append(IM_START + "system\n")
        if first["role"] == "system":
            parts.append(first["content"] + "\n\n")
        parts.append(_TOOLS_HEADER)
        for tool in tools:
            parts.append("\n" + _tojson(tool))
        parts.append(_TOOLS_FOOTER + IM_END + "\n")
    elif first["role"] == "system":
        parts.append(IM_START + "system\n" + first["content"] + IM_END + "\n")

    last_query = _last_query_index(messages)
    n = len(messages)
    for i, message in enumerate(messages):
        role = message["role"]
        if role == "user" or (role == "system" and i > 0):
            parts.append(IM_START + role + "\n" + _content(message) + IM_END + "\n")
        elif role == "assistant":
            parts.append(_render_assistant(message, after_last_query=i > last_query, is_last=i == n - 1))
        elif role == "tool":
            # Consecutive tool messages share one user turn.
            if i == 0 or messages[i - 1]["role"] != "tool":
                parts.append(IM_START + "user")
            parts.append("\n<tool_response>\n" + _content(message) + "\n</tool_response>")
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                parts.append(IM_END + "\n")
    if add_generation_prompt:
        parts.append(generation_prompt(enable_thinking=enable_thinking))
    return "".join(parts)


def generation_prompt(*, enable_thinking: bool) -> str:
    """The assistant header that opens a policy turn (plus an empty think block when thinking is off)."""
    return IM_START + "assistant\n" + ("" if enable_thinking else EMPTY_THINK)


def render_prompt(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    enable_thinking: bool,
) -> str:
    """The rollout prompt: system/tools, the task's messages, and the generation prompt."""
    return render_messages(messages, tools, add_generation_prompt=True, enable_thinking=enable_thinking)


def prompt_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    enable_thinking: bool,
) -> list[int]:
    """Token ids of ``render_prompt`` (int list, length = prompt length)."""
    return tok_lib.encode(tokenizer, render_prompt(messages, tools, enable_thinking=enable_thinking))


OPEN_RESPONSE = "<tool_response>"
CLOSE_RESPONSE = "</tool_response>"


def escape_tool_response(text: str) -> str:
    """``text`` with the ``<`` of every ``<tool_response>`` / ``</tool_response>`` written as
    ``&lt;``: a tool result can then never spell the added tokens that delimit a tool response
    (Qwen3's 151665 / 151666), nor close its own response and forge another. No ``<`` is added,
    so no new delimiter can form; escaping twice changes nothing more. Other text is unchanged."""
    if "_response>" not in text:
        return text
    return text.replace(CLOSE_RESPONSE, "&lt;/tool_response>").replace(OPEN_RESPONSE, "&lt;tool_response>")


OBSERVATION_TEMPLATES = ("project", "released")


def check_observation_template(template: str) -> str:
    """``template`` if it is one of ``OBSERVATION_TEMPLATES``, else ValueError naming the key."""
    if template not in OBSERVATION_TEMPLATES:
        raise ValueError(f"rollout.observation_template must be one of {OBSERVATION_TEMPLATES}, got {template!r}")
    return template


def _observation_parts(results: Sequence[str], enable_thinking: bool,
                       template: str = "project") -> tuple[str, list[tuple[int, int]], int]:
    """Suffix text, each result's character span in it, and where the next assistant header starts.
    Each result is written through `escape_tool_response` (its span covers the escaped text).

    template: "project", the official Qwen3 chat template's text
    (``\n<|im_start|>user`` + per call ``\n<tool_response>\n{r}\n</tool_response>`` + ``<|im_end|>\n``);
    "released", the released MatchTIR rollout's text (``vllm_rollout_spmd.py``: ``<|im_start|>user\n``
    + per call ``<tool_response>\n{r}\n</tool_response>\n`` + ``<|im_end|>\n``: no newline after the
    sampled ``<|im_end|>``, one after each ``</tool_response>``). Both end with the generation prompt."""
    check_observation_template(template)
    if isinstance(results, str):
        raise TypeError("results must be a list of strings (one per tool call), not a single string")
    if len(results) == 0:
        # The template renders no user turn at all for zero tool messages.
        raise ValueError("observation suffix needs at least one result (a turn without tool calls gets no observation)")
    if template == "released":
        parts = [IM_START + "user\n"]
        opening, closing = OPEN_RESPONSE + "\n", "\n" + CLOSE_RESPONSE + "\n"
    else:
        parts = ["\n" + IM_START + "user"]
        opening, closing = "\n" + OPEN_RESPONSE + "\n", "\n" + CLOSE_RESPONSE
    size = len(parts[0])
    spans: list[tuple[int, int]] = []
    for i, result in enumerate(results):
        if not isinstance(result, str):
            raise TypeError(f"result {i} is {type(result).__name__}, expected str")
        result = escape_tool_response(result)
        size += len(opening)
        spans.append((size, size + len(result)))
        parts += (opening, result, closing)
        size += len(result) + len(closing)
    parts.append(IM_END + "\n")
    header_char = size + len(parts[-1])
    parts.append(generation_prompt(enable_thinking=enable_thinking))
    return "".join(parts), spans, header_char


def observation_suffix(results: Sequence[str], *, enable_thinking: bool, template: str = "project") -> str:
    """Text appended after a policy turn that ended with the sampled ``<|im_end|>``.

    "project" (default): it starts with the newline the template writes after ``<|im_end|>``, holds
    one ``<tool_response>`` block per call (all in one user turn, as the template groups consecutive
    tool messages), closes that turn and opens the next assistant turn. "released": the released
    MatchTIR rollout's text (`_observation_parts`; ``rollout.observation_template``).
    """
    return _observation_parts(results, enable_thinking, template)[0]


@dataclasses.dataclass(frozen=True)
class ObservationSuffix:
    """A tokenised observation suffix.

    ids: token ids (int list, length S).
    result_spans: per result, the token span [start, end) within ``ids`` covering its text.
      Byte-level BPE may merge a result's leading/trailing newlines with the template's newline;
      such a shared token is included in the span.
    header_offset: index in ``ids`` of the ``<|im_start|>`` that opens the next assistant turn.
    text: the suffix string.
    """

    ids: list[int]
    result_spans: list[tuple[int, int]]
    header_offset: int
    text: str

    def __iter__(self):
        # `ids, spans = observation_suffix_ids(...)` unpacks like a plain (ids, result_spans) pair.
        return iter((self.ids, self.result_spans))


def observation_suffix_ids(tokenizer: Any, results: Sequence[str], *, enable_thinking: bool,
                           template: str = "project") -> ObservationSuffix:
    """Tokenise ``observation_suffix`` as one string and locate each result and the next header.

    The suffix is tokenised whole (not piece by piece) so its ids are exactly the template's ids;
    the result spans come from the tokenizer's character offsets. Results are untrusted: one that
    spells a control token (``<|im_end|>``, ...) is tokenised as plain text instead, piece by piece
    (`tokenizer.encode_with_plain_spans`), so a tool cannot close the turn or open a fake one.
    template: "project" | "released" (`_observation_parts`).
    """
    text, char_spans, header_char = _observation_parts(results, enable_thinking, template)
    ids, spans, (header_offset,) = tok_lib.encode_with_plain_spans(tokenizer, text, char_spans, [header_char])
    im_start = tok_lib.im_start_id(tokenizer)
    if header_offset >= len(ids) or ids[header_offset] != im_start:
        raise RuntimeError(
            f"observation suffix: the next assistant header does not start a token at char {header_char} "
            f"(tokenizer does not treat {IM_START} as a control token?)"
        )
    return ObservationSuffix(ids=ids, result_spans=spans, header_offset=header_offset, text=text)
