"""BFCL's own inference loop for a Qwen3 policy: `bfcl_eval`'s Qwen FC handler, prompting path.

What BFCL's harness does (`BaseHandler.inference_multi_turn_prompting` with `QwenFCHandler`,
bfcl-eval 2026.3.23), and so what this module does:

* Every step re-renders the whole conversation (`render_prompt`, the handler's `_format_prompt`):
  no system prompt of its own; the entry's function docs, as they are (not wrapped in
  {"type": "function"}), one `json.dumps` line each (ASCII-escaped) inside Qwen3's <tools> block
  (a system message of the entry goes before it); `<|im_start|>assistant\\n` opens the turn
  (thinking on; `enable_thinking=False` adds the official template's empty think block).
* The model's reply (`split_response`): the text after `</think>` is the step's response; its
  reasoning is kept in the history only for assistant messages after the last user query (the
  official template's rule); a reply with tool calls goes into the history as content "" plus
  the re-serialised calls (the text around them is dropped), one without as its text.
* Calls are read by BFCL's rule (`decode_calls`): each `<tool_call>\\n...\\n</tool_call>` block
  is JSON-decoded (blocks that fail are dropped); a non-object item, a missing name/arguments or
  non-object arguments fail the whole step. A step that decodes to no call (or fails) ends the
  user turn. Calls run through `envs.bfcl.BFCLEpisode` (whitelisted methods, never `eval`), one
  tool message per result; more than 20 steps in a user turn force-quit the conversation.
* Scoring: multi-turn entries by `multi_turn_checker` over the executed calls (a force-quit fails
  only when it leaves fewer user turns than the ground truth, as BFCL's eval runner has it);
  Memory questions by `agentic_checker` on the last step that is not a call.
* Per step the handler asks for min(4096, context left) tokens: `step_tokens` (default 4096) and
  the conversation's context budget (`max_context_tokens`: first prompt + this many tokens);
  a conversation that runs out of context fails (BFCL's request would error).

Memory: the prerequisite conversations of each scenario run first, one after the other (each
continues the previous one's snapshot), then the questions, each in its own chain folder.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.chat.template import EMPTY_THINK, IM_END, IM_START
from turnsight_jax.chat.types import Task, ToolCall

STEP_TOKENS = 4096  # the handler's per-step cap (base_oss_handler._query_prompting)
_TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
_TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                 "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_FOOTER = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
                 "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                 '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class RenderError(ValueError):
    """The history holds a tool call BFCL's handler cannot render (it would crash on it)."""


# ---------------------------------------------------------------------------------------------
# Rendering and parsing (the handler's rules)
# ---------------------------------------------------------------------------------------------
def _is_tool_response(content: Any) -> bool:
    return isinstance(content, str) and content.startswith("<tool_response>") and content.endswith("</tool_response>")


def _render_tool_calls(tool_calls: Sequence[Any], content: str) -> str:
    out = ""
    for tool_call in tool_calls:
        # The handler compares by value: a call equal to the first one gets no separating newline.
        if (tool_call == tool_calls[0] and content) or tool_call != tool_calls[0]:
            out += "\n"
        if isinstance(tool_call, Mapping) and "function" in tool_call:
            tool_call = tool_call["function"]
        if not (isinstance(tool_call, Mapping) and isinstance(tool_call.get("name"), str)
                and "arguments" in tool_call):
            raise RenderError(f"tool call {tool_call!r:.80} has no string name / no arguments")
        arguments = tool_call["arguments"]
        out += '<tool_call>\n{"name": "' + tool_call["name"] + '", "arguments": '
        out += (arguments if isinstance(arguments, str) else json.dumps(arguments)) + "}\n</tool_call>"
    return out


def tools_block(functions: Sequence[Mapping[str, Any]]) -> str:
    """The system prompt's tool section for `functions` (one JSON line per function doc)."""
    return _TOOLS_HEADER + "".join(f"\n{json.dumps(f)}" for f in functions) + _TOOLS_FOOTER


def render_prompt(messages: Sequence[Mapping[str, Any]], functions: Sequence[Mapping[str, Any]], *,
                  enable_thinking: bool = True, tools: str | None = None) -> str:
    """The prompt BFCL's Qwen FC handler sends for `messages` (its `_format_prompt`).

    messages: {"role", "content"} dicts (assistant: optional "tool_calls", "reasoning_content");
    functions: the entry's function docs; tools: `tools_block(functions)` when the caller has it
    (a conversation re-renders every step, and dumping ~20 function docs each time was a quarter of
    an 800-entry replay). Ends with the assistant header (+ an empty think block when
    `enable_thinking` is False: the official template's switch, which BFCL never sets).
    """
    out = ""
    if len(functions) > 0:
        out += IM_START + "system\n"
        if messages[0]["role"] == "system":
            out += messages[0]["content"] + "\n\n"
        out += (tools_block(functions) if tools is None else tools) + IM_END + "\n"
    elif messages[0]["role"] == "system":
        out += f"{IM_START}system\n{messages[0]['content']}{IM_END}\n"
    last_query = len(messages) - 1
    for idx in range(len(messages) - 1, -1, -1):
        m = messages[idx]
        if m["role"] == "user" and isinstance(m["content"], str) and not _is_tool_response(m["content"]):
            last_query = idx
            break
    for idx, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "user" or (role == "system" and idx != 0):
            out += f"{IM_START}{role}\n{content}{IM_END}\n"
        elif role == "assistant":
            reasoning = ""
            if m.get("reasoning_content"):
                reasoning = m["reasoning_content"]
            elif "</think>" in content:
                parts = content.split("</think>")
                reasoning = parts[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = parts[-1].lstrip("\n")
            if idx > last_query and (idx == len(messages) - 1 or reasoning):
                out += f"{IM_START}{role}\n<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
            else:
                out += f"{IM_START}{role}\n{content}"
            if "tool_calls" in m:
                out += _render_tool_calls(m["tool_calls"], content)
            out += IM_END + "\n"
        elif role == "tool":
            if idx == 0 or messages[idx - 1]["role"] != "tool":
                out += IM_START + "user"
            out += f"\n<tool_response>\n{content}\n</tool_response>"
            if idx == len(messages) - 1 or messages[idx + 1]["role"] != "tool":
                out += IM_END + "\n"
    out += IM_START + "assistant\n"
    return out + ("" if enable_thinking else EMPTY_THINK)


def extract_tool_calls(text: str) -> list[Any]:
    """The JSON values of the `<tool_call>\\n...\\n</tool_call>` blocks; undecodable blocks dropped."""
    found = []
    for match in _TOOL_CALL.findall(text):
        try:
            found.append(json.loads(match))
        except ValueError:
            pass
    return found


def decode_calls(text: str) -> list[ToolCall] | None:
    """BFCL's `decode_execute` of a step's response: the calls, or None when decoding fails.

    Fails (None) when an extracted item is not an object, lacks "name" or "arguments", has a
    non-string name, or arguments that are neither an object nor a JSON string of one."""
    calls = []
    for item in extract_tool_calls(text):
        if not isinstance(item, dict) or "name" not in item or "arguments" not in item:
            return None
        name, arguments = item["name"], item["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(name=name, arguments=arguments, raw=json.dumps(item)))
    return calls


def split_response(text: str) -> tuple[str, dict]:
    """(the step's response, its history message): the handler's `_parse_query_response_prompting`."""
    extracted = extract_tool_calls(text)
    reasoning, cleaned = "", text
    if "</think>" in text:
        parts = text.split("</think>")
        reasoning = parts[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
        cleaned = parts[-1].lstrip("\n")
    if extracted:
        message = {"role": "assistant", "content": "", "tool_calls": extracted}
    else:
        message = {"role": "assistant", "content": cleaned}
    message["reasoning_content"] = reasoning
    return cleaned, message


# ---------------------------------------------------------------------------------------------
# One conversation
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Step:
    text: str  # the step's response (after </think>)
    raw: str  # the model's whole reply
    calls: list[ToolCall] | None  # decoded calls ([] none, None decoding failed)
    results: list[str]


class Conversation:
    """One BFCL entry played the handler's way against a fresh `BFCLEpisode`."""

    def __init__(self, task: Task, episode, *, enable_thinking: bool):
        self.task = task
        self.episode = episode
        self.enable_thinking = enable_thinking
        self.functions = task.extra["bfcl_entry"]["function"]  # fixed for the entry (miss_func
        # announces its held-out functions in user turns), so its tool section is rendered once
        self._tools = tools_block(self.functions)
        self.messages: list[dict] = episode.turn_messages(0)
        self.turns: list[list[Step]] = [[]]
        self.first_prompt_len: int | None = None
        self.tokens = 0  # policy tokens generated
        self.error: str | None = None  # "length" (out of context) or a render error
        self.finished = False
        self._encoder: tok_lib.SegmentEncoder | None = None

    @property
    def active(self) -> bool:
        return not (self.finished or self.error)

    def prompt(self) -> str:
        return render_prompt(self.messages, self.functions, enable_thinking=self.enable_thinking, tools=self._tools)

    def prompt_ids(self, tokenizer, encoder: tok_lib.SegmentEncoder | None = None) -> list[int]:
        """Token ids of `prompt()` (equal to a full encode). Each step re-renders the whole
        history, so the ids come from a segment cache (`encoder`, shared across conversations by
        `run_conversations`; by default one per conversation)."""
        if encoder is None:
            if self._encoder is None or self._encoder.tokenizer is not tokenizer:
                self._encoder = tok_lib.SegmentEncoder(tokenizer)
            encoder = self._encoder
        return encoder(self.prompt())

    def feed(self, raw: str) -> None:
        """Applies the model's reply of one step."""
        text, message = split_response(raw)
        self.messages.append(message)
        calls = decode_calls(text)
        if not calls:  # no call, or decoding failed: the user turn ends
            self.turns[-1].append(Step(text, raw, calls, []))
            result = self.episode.step([])
            if result.done:
                self.finished = True
                return
            self.turns.append([])
            self.messages.extend(self.episode.turn_messages(self.episode.turn_index))
            return
        result = self.episode.step(calls)
        self.turns[-1].append(Step(text, raw, calls, list(result.observations)))
        for call, observation in zip(calls, result.observations):
            self.messages.append({"role": "tool", "name": call.name, "content": observation})
        if result.done:  # force-quit
            self.finished = True

    def verdict(self) -> dict:
        """BFCL's verdict ({"valid": bool, ...})."""
        from turnsight_jax.envs.bfcl import check_agentic, check_episode

        if self.error:
            return {"valid": False, "error_type": "inference_error", "error_message": self.error}
        answers = self.task.extra.get("bfcl_answers")
        if answers is not None:
            if len(self.turns) != 1:
                return {"valid": False, "error_type": "agentic:inference_error",
                        "error_message": f"{len(self.turns)} turns, expected 1"}
            steps = self.turns[0]
            return check_agentic([s.text for s in steps], answers, [bool(s.calls) for s in steps])
        return check_episode(self.episode)


# ---------------------------------------------------------------------------------------------
# Completers: where replies come from
# ---------------------------------------------------------------------------------------------
class ModelCompleter:
    """Replies from a `ModelPolicy`: each step prefills the re-rendered prompts anew (as BFCL's
    harness sends a new completion request per step) and decodes at most `budgets[i]` tokens."""

    def __init__(self, make_policy: Callable[[], Any], tokenizer):
        self.policy = make_policy()
        self.tokenizer = tokenizer

    def complete(self, prompts: Sequence[list[int]], budgets: Sequence[int], keys: Sequence[Any]) -> list[tuple[str, int]]:
        self.policy.begin(prompts, 1)
        outs = self.policy.generate(np.ones(len(prompts), bool), np.asarray(budgets, np.int64))
        # The completion text the handler sees: special tokens (the stop token) left out.
        return [(self.tokenizer.decode(o.ids, skip_special_tokens=True), len(o.ids)) for o in outs]

    @property
    def timings(self) -> dict:
        return getattr(self.policy, "timings", {})


class ScriptCompleter:
    """Replies from fixed scripts: `script_of(key)` -> turn texts, consumed one per step; a
    conversation past its script replies with an empty text (which ends its user turn). Keys are
    (task, sample index); a script's position is kept per (task id, sample index)."""

    def __init__(self, script_of: Callable[[Any], Sequence[str]], tokenizer):
        self.script_of = script_of
        self.tokenizer = tokenizer
        self.position: dict[Any, int] = {}
        self.timings: dict = {}

    def complete(self, prompts, budgets, keys) -> list[tuple[str, int]]:
        out = []
        for key, budget in zip(keys, budgets):
            script = self.script_of(key)
            slot = (key[0].task_id, key[1])
            i = self.position.get(slot, 0)
            self.position[slot] = i + 1
            text = script[i] if i < len(script) else ""
            ids = tok_lib.encode(self.tokenizer, text)
            if len(ids) > budget:
                ids = ids[:budget]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append((text, len(ids)))
        return out


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HarnessConfig:
    step_tokens: int = STEP_TOKENS
    max_context_tokens: int = 32_768  # tokens after the first prompt: re-rendered history + replies
    max_prompt_tokens: int = 10_000  # a longer first prompt is an error
    enable_thinking: bool = True


def run_conversations(completer, conversations: Sequence[Conversation], keys: Sequence[Any], tokenizer,
                      config: HarnessConfig, progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Plays the conversations to their end, all active ones one step per round. Returns stats."""
    t0 = time.perf_counter()
    rounds = 0
    encoder = tok_lib.SegmentEncoder(tokenizer)
    while True:
        live = [i for i, c in enumerate(conversations) if c.active]
        if not live:
            break
        rounds += 1
        prompts, budgets, ask = [], [], []
        for i in live:
            c = conversations[i]
            try:
                ids = c.prompt_ids(tokenizer, encoder)
            except RenderError as e:
                c.error = f"BFCL's handler cannot render the history: {e}"
                continue
            if c.first_prompt_len is None:
                c.first_prompt_len = len(ids)
                if len(ids) > config.max_prompt_tokens:
                    raise ValueError(f"BFCL {c.task.task_id}: prompt has {len(ids)} tokens, over "
                                     f"max_prompt_tokens={config.max_prompt_tokens}")
            left = c.first_prompt_len + config.max_context_tokens - len(ids)
            if left <= 0:
                c.error = "length"  # the context is full: BFCL's request would fail
                continue
            prompts.append(ids)
            budgets.append(min(config.step_tokens, left))
            ask.append(i)
        if ask:
            replies = completer.complete(prompts, budgets, [keys[i] for i in ask])
            for i, (text, n) in zip(ask, replies):
                conversations[i].tokens += n
                conversations[i].feed(text)
        if progress is not None:
            progress(sum(not c.active for c in conversations), len(conversations), rounds)
    for c in conversations:
        c.episode.finish()
    return {"rollout_s": time.perf_counter() - t0, "rounds": float(rounds),
            "tokens": float(sum(c.tokens for c in conversations))}


def new_memory_root() -> pathlib.Path:
    """A scratch folder for one evaluation's Memory snapshots."""
    return pathlib.Path(tempfile.mkdtemp(prefix="turnsight_bfcl_memory_"))
