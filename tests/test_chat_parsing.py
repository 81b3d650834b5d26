"""Tool-call parsing: well-formed turns, every documented error, round-trips, linear time."""

from __future__ import annotations

import json
import gc
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnsight_jax.chat.parsing import ParsedTurn, parse_turn, render_tool_call
from turnsight_jax.envs.base import malformed_observation
from turnsight_jax.chat.types import CallError, ToolCall


def _errors(turn: ParsedTurn) -> list[str]:
    return [c.message for c in turn.calls if isinstance(c, CallError)]


def test_thinking_content_and_calls():
    text = (
        "<think>\nI need the weather.\n</think>\n\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name":"search","arguments":"{\\"q\\": \\"x\\"}"}</tool_call><|im_end|>'
    )
    t = parse_turn(text)
    assert t.thinking == "I need the weather."
    assert t.content == "Let me check."
    assert t.calls == [
        ToolCall("get_weather", {"city": "Paris"}, raw='\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'),
        ToolCall("search", {"q": "x"}, raw='{"name":"search","arguments":"{\\"q\\": \\"x\\"}"}'),
    ]
    assert t.answer is None


def test_whitespace_tolerance_and_missing_arguments():
    t = parse_turn('<tool_call>   \n\t {"name": "now"}  \n\n </tool_call>')
    assert [(c.name, c.arguments) for c in t.calls] == [("now", {})]
    assert t.content == "" and t.answer is None and t.thinking is None


def test_answer_tag_and_plain_answer():
    t = parse_turn("<think>done</think>\n\nThe result: <answer> 42 </answer>")
    assert (t.thinking, t.content, t.answer) == ("done", "The result: <answer> 42 </answer>", "42")
    assert parse_turn("Paris is sunny.<|im_end|>").answer == "Paris is sunny."
    assert parse_turn("<answer>Rome").answer == "Rome"  # unclosed answer still counts
    assert parse_turn("<think>\nonly thinking\n</think>\n\n").answer is None
    assert parse_turn("").answer is None
    # With calls there is no plain-text answer, but an explicit <answer> is kept.
    t = parse_turn('Call first. <tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert t.answer is None and t.content == "Call first."
    t = parse_turn('<answer>7</answer><tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert t.answer == "7"


def test_answer_inside_call_arguments_is_not_an_answer():
    t = parse_turn('<tool_call>{"name": "f", "arguments": {"x": "<answer>no</answer>"}}</tool_call>')
    assert t.answer is None and t.calls[0].arguments == {"x": "<answer>no</answer>"}


def test_closing_think_without_opening_tag():
    # Like the chat template, thinking is what follows the last <think> before </think>.
    t = parse_turn("preamble <think>\nthought\n</think>\n\nAnswer: 3")
    assert (t.thinking, t.content) == ("thought", "Answer: 3")
    t = parse_turn("I reason here\n</think>\n\nAnswer: 3")
    assert (t.thinking, t.content, t.answer) == ("I reason here", "Answer: 3", "Answer: 3")


def test_calls_inside_think_are_not_executed():
    t = parse_turn('<think>maybe <tool_call>{"name": "f"}</tool_call>?</think>\nNo call.')
    assert t.calls == [] and t.content == "No call." and t.answer == "No call."
    t = parse_turn('<think>cut off mid-thought <tool_call>{"name": "f"}</tool_call>')
    assert t.calls == [] and t.thinking.startswith("cut off") and t.content == "" and t.answer is None


def test_calls_in_think_option_executes_them_first():
    # rollout.calls_in_think (the released code's parse): the thought's calls come first, numbered
    # with the rest; the thought's text stays out of the content, the thinking text is unchanged
    text = ('<think>maybe <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> and '
            '<tool_call>{bad</tool_call>?</think>\nNow: <tool_call>{"name": "g"}</tool_call>')
    off, on = parse_turn(text), parse_turn(text, calls_in_think=True)
    assert [c.name for c in off.calls] == ["g"]
    assert [(c.name, c.arguments) for c in on.calls if isinstance(c, ToolCall)] == [("f", {"a": 1}), ("g", {})]
    assert _errors(on) == ["tool call 2: invalid JSON (Expecting property name enclosed in double quotes at char 1)"]
    assert on.thinking == off.thinking and on.content == off.content == "Now:" and on.answer is None
    # a thought cut off mid-way: its call runs; a call left open inside the thought is unclosed there
    t = parse_turn('<think>cut off <tool_call>{"name": "f"}</tool_call>', calls_in_think=True)
    assert [c.name for c in t.calls] == ["f"] and t.content == "" and t.answer is None
    t = parse_turn('<think>x <tool_call>{"name": "f"}</think> <tool_call>{"name": "g"}</tool_call>', calls_in_think=True)
    assert _errors(t) == ["tool call 1: unclosed <tool_call> tag"] and [c.name for c in t.calls[1:]] == ["g"]
    # the opening tag in the prompt ("... </think>"): the body before </think> is the thought
    t = parse_turn('I think\n</think>\n\n<answer>4</answer>', calls_in_think=True)
    assert t.calls == [] and t.answer == "4"


def test_think_close_inside_arguments_is_not_thinking():
    t = parse_turn('<tool_call>{"name": "f", "arguments": {"x": "</think>"}}</tool_call>')
    assert t.thinking is None and t.calls == [ToolCall("f", {"x": "</think>"}, raw='{"name": "f", "arguments": {"x": "</think>"}}')]


OK = '<tool_call>{"name": "ok", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "f", "arguments": [1, 2]}', "tool call 2: arguments must be a JSON object, got list"),
        ('{"name": "f", "arguments": 3}', "tool call 2: arguments must be a JSON object, got number"),
        ('{"name": "f", "arguments": null}', "tool call 2: arguments must be a JSON object, got null"),
        ('{"name": "f", "arguments": "[1]"}', "tool call 2: arguments string must hold a JSON object, got list"),
        ('{"name": "f", "arguments": "{oops"}', "tool call 2: arguments string is not valid JSON (invalid JSON (Expecting property name enclosed in double quotes at char 1))"),
        ('{"arguments": {}}', 'tool call 2: missing "name"'),
        ('{"name": "", "arguments": {}}', 'tool call 2: "name" must be a non-empty string, got empty string'),
        ('{"name": 5, "arguments": {}}', 'tool call 2: "name" must be a non-empty string, got number'),
        ('["f", {}]', "tool call 2: body must be a JSON object, got list"),
        ('"f"', "tool call 2: body must be a JSON object, got string"),
        ("   \n ", "tool call 2: empty body"),
        ('{"name": "f", "arguments": {"a": 1', "tool call 2: truncated JSON (Expecting ',' delimiter at char 34)"),
        ('{"name": "f" "arguments": {}}', "tool call 2: invalid JSON (Expecting ',' delimiter at char 13)"),
        ('{"name": "f"} {"name": "g"}', "tool call 2: invalid JSON (Extra data at char 14)"),
        ("[" * 100_000, "tool call 2: JSON nested too deeply"),
    ],
)
def test_malformed_call_messages(body, message):
    t = parse_turn(OK + "\n<tool_call>" + body + "</tool_call>")
    assert isinstance(t.calls[0], ToolCall)
    assert len(t.calls) == 2
    err = t.calls[1]
    assert isinstance(err, CallError)
    assert err.message == message
    assert err.raw == body
    assert malformed_observation(err) == message  # what the policy is shown


def test_tag_structure_errors():
    t = parse_turn(OK + '<tool_call>{"name": "f", "arguments": {}}')
    assert _errors(t) == ["tool call 2: unclosed <tool_call> tag"]
    assert t.calls[1].raw == '{"name": "f", "arguments": {}}'

    # Forgotten close: the first block is an error, the second still parses.
    t = parse_turn('<tool_call>{"name": "a"}\n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    assert _errors(t) == ["tool call 1: <tool_call> opened again before </tool_call>"]
    assert t.calls[1] == ToolCall("b", {"x": 1}, raw='{"name": "b", "arguments": {"x": 1}}')

    t = parse_turn('text </tool_call> more ' + OK)
    assert _errors(t) == ["tool call 1: </tool_call> without a matching <tool_call>"]
    assert t.calls[1].name == "ok" and t.content == "text  more" and t.answer is None

    # Nested tags: opened again, then the inner block parses, then a stray close.
    t = parse_turn('<tool_call> <tool_call>{"name": "in"}</tool_call> </tool_call>')
    assert [type(c).__name__ for c in t.calls] == ["CallError", "ToolCall", "CallError"]
    assert _errors(t) == [
        "tool call 1: <tool_call> opened again before </tool_call>",
        "tool call 3: </tool_call> without a matching <tool_call>",
    ]


def test_never_raises_on_random_tag_soup():
    rng = random.Random(0)
    atoms = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<answer>", "</answer>", "{", "}", '"name"', ":", '"arguments"', "[", "]", "x", " ", "\n", '"'] 
    for _ in range(2000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 40)))
        t = parse_turn(text)
        assert isinstance(t, ParsedTurn)
        for c in t.calls:
            assert isinstance(c, (ToolCall, CallError))


def _best_time(text: str, repeats: int = 3, min_batch_s: float = 0.01) -> tuple[ParsedTurn, float]:
    """Best-of-`repeats` CPU seconds per parse of this process (not wall time: under `pytest -n 2`
    on two cores the other worker's XLA compiles steal the core, and a wall-clock ratio of 26 was
    seen in CI for a parser whose CPU ratio is 11). A fast parse is timed over a batch of calls
    lasting at least `min_batch_s`: one 0.1 ms parse is below the clock's resolution and gave a
    ratio of 104 for a linear parser. The collector is paused because a full collection walks
    every live object, which would make any parse that allocates superlinear."""
    best = float("inf")
    gc.collect()
    gc.disable()
    try:
        calls = 1
        while True:  # grow the batch until it is long enough to time
            t0 = time.process_time()
            for _ in range(calls):
                out = parse_turn(text)
            if time.process_time() - t0 >= min_batch_s or calls >= 1 << 12:
                break
            calls *= 4
        for _ in range(repeats):
            t0 = time.process_time()
            for _ in range(calls):
                out = parse_turn(text)
            best = min(best, (time.process_time() - t0) / calls)
    finally:
        gc.enable()
    return out, best


def _scales_linearly(make) -> ParsedTurn:
    """Parse make(n) and make(8n); a linear parser takes ~8x as long, a quadratic one ~64x. The
    ratio (best of 3 each), not a wall-clock bound, so a loaded machine cannot fail it."""
    n = 1 << 17
    _, small = _best_time(make(n))
    out, large = _best_time(make(8 * n))
    assert large / max(small, 1e-6) < 24, (make(16)[:16], small, large)
    return out


def test_adversarial_megabyte_inputs_parse_in_linear_time():
    rng = random.Random(1)
    garbage = "".join(rng.choice("abc{}[]\":, <>/\n") for _ in range(1 << 20))
    _scales_linearly(lambda n: garbage[:n])  # plain random printable garbage
    # Many opening tags with one close at the very end (a naive scanner is quadratic).
    t = _scales_linearly(lambda n: "<tool_call>" * (n // 11) + "</tool_call>")
    n = 8 << 17
    assert len(t.calls) == n // 11
    assert t.calls[0].message == "tool call 1: <tool_call> opened again before </tool_call>"
    assert t.calls[-1].message.endswith("empty body")
    # Many stray closes; one huge unclosed block; a 1 MB JSON-looking body.
    for make in (lambda n: "</tool_call>" * (n // 12), lambda n: "<tool_call>" + "x" * n,
                 lambda n: '<tool_call>{"name": "f", "arguments": {"a": "' + "y" * n):
        t = _scales_linearly(make)
        assert t.calls and all(isinstance(c, CallError) for c in t.calls)
    # Think tags: many opens without a close.
    assert _scales_linearly(lambda n: "<think>" * (n // 7)).calls == []


def test_render_tool_call_format():
    assert render_tool_call("get_weather", {"city": "Zürich"}) == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    )
    # Tag texts inside strings are escaped so the block stays parseable, and decode to the same value.
    rendered = render_tool_call("f", {"s": "a</tool_call>b<tool_call>c"})
    assert rendered == '<tool_call>\n{"name": "f", "arguments": {"s": "a\\u003c/tool_call>b\\u003ctool_call>c"}}\n</tool_call>'
    assert parse_turn(rendered).calls[0].arguments == {"s": "a</tool_call>b<tool_call>c"}


def test_raw_close_tag_inside_string_is_cut_there():
    # The documented ambiguity: unescaped model text is cut at the first </tool_call>.
    t = parse_turn('<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>')
    assert _errors(t)[0] == "tool call 1: truncated JSON (Unterminated string starting at char 33)"
    assert _errors(t)[1] == "tool call 2: </tool_call> without a matching <tool_call>"


JSON_SCALARS = st.none() | st.booleans() | st.integers(-(10**18), 10**18) | st.floats(allow_nan=False, allow_infinity=False) | st.text()
TAG_TEXT = st.sampled_from(["<tool_call>", "</tool_call>", "<think>", "</think>", "<answer>", "</answer>", "<|im_end|>", "\\", '"', "\n"])
STRINGS = st.lists(st.text() | TAG_TEXT, max_size=4).map("".join)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**18), 10**18) | st.floats(allow_nan=False, allow_infinity=False) | STRINGS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(STRINGS, children, max_size=4),
    max_leaves=20,
)
ARGUMENTS = st.dictionaries(STRINGS, JSON_VALUES, max_size=5)
NAMES = STRINGS.filter(bool)


@settings(max_examples=100, deadline=None)
@given(calls=st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=4), content=st.sampled_from(["", "Let me check.", "Step 2:\n"]))
def test_rendered_calls_round_trip(calls, content):
    text = content + "\n".join(render_tool_call(n, a) for n, a in calls) + "<|im_end|>"
    t = parse_turn(text)
    assert [(c.name, c.arguments) for c in t.calls] == calls
    assert all(isinstance(c, ToolCall) for c in t.calls)
    assert t.content == content.strip()
    assert t.thinking is None


@settings(max_examples=100, deadline=None)
@given(args=ARGUMENTS)
def test_arguments_as_json_string_round_trip(args):
    body = json.dumps({"name": "f", "arguments": json.dumps(args, ensure_ascii=False)}, ensure_ascii=False)
    body = body.replace("</tool_call>", "\\u003c/tool_call>").replace("<tool_call>", "\\u003ctool_call>")
    t = parse_turn(f"<tool_call>\n{body}\n</tool_call>")
    assert [(c.name, c.arguments) for c in t.calls] == [("f", args)]


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=300) | st.lists(st.text(max_size=20) | TAG_TEXT, max_size=30).map("".join))
def test_arbitrary_text_never_raises(text):
    t = parse_turn(text)
    assert isinstance(t.content, str)
    for c in t.calls:
        assert isinstance(c, (ToolCall, CallError))
        if isinstance(c, CallError):
            assert c.message.startswith("tool call ")
