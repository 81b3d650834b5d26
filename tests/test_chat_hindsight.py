"""Hindsight blocks: exact text, shared-prefix pieces, depth clipping, empty blocks, sources."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnsight_jax.chat import template as T
from turnsight_jax.chat.hindsight import (
    HindsightTemplate,
    hindsight_ids,
    hindsight_pieces,
    hindsight_texts,
    teacher_view_ids,
)
from turnsight_jax.chat.parsing import parse_turn, render_tool_call
from turnsight_jax.envs.base import malformed_observation
from turnsight_jax.chat.tokenizer import encode, load_tokenizer, special_ids
from turnsight_jax.chat.trajectory import TrajectoryBuilder
from turnsight_jax.chat.types import CallError


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir):
    return load_tokenizer(qwen3_tokenizer_dir)


TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}}]


def _rollout(tok, turns, *, think=True):
    """turns: list of (policy text, results or None). Returns the built trajectory."""
    sp = special_ids(tok)
    prompt = T.prompt_ids(tok, [{"role": "user", "content": "Weather?"}], TOOLS, enable_thinking=think)
    b = TrajectoryBuilder(prompt, 0, "task", im_start_id=sp.im_start, im_end_id=sp.im_end)
    for text, results in turns:
        parsed = parse_turn(text)
        ids = encode(tok, text + "<|im_end|>")
        b.add_policy_turn(ids, [-0.1] * len(ids), text, parsed.calls, parsed.answer)
        if results is not None:
            if results == "errors":
                results = [malformed_observation(c) if isinstance(c, CallError) else "?" for c in parsed.calls]
            s = T.observation_suffix_ids(tok, results, enable_thinking=think)
            b.add_observation(s.ids, results, s.result_spans, s.header_offset)
    return b.build(finish_reason="answer" if turns[-1][1] is None else "max_turns")


PARIS = render_tool_call("w", {"c": "Paris"})
ROME = render_tool_call("w", {"c": "Rome"})
OSLO = render_tool_call("w", {"c": "Oslo"})


@pytest.fixture(scope="module")
def traj(tok):
    return _rollout(
        tok,
        [
            ("<think>\nTwo cities.\n</think>\n\n" + PARIS + "\n" + ROME, ["Sunny", "Cloudy 18°C"]),
            ("<think>\nOne more.\n</think>\n\n" + OSLO, ["Snow\n"]),
            ('<think>\nOops.\n</think>\n\n<tool_call>\n{"name": "w", "arguments": [1]}\n</tool_call>', "errors"),
            ("<think>\nDone.\n</think>\n\n<answer>Sunny, cloudy, snow</answer>", None),
        ],
    )


ITEM0 = (
    "<turn>\n"
    '<tool_call>\n{"name": "w", "arguments": {"c": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "w", "arguments": {"c": "Rome"}}\n</tool_call>\n'
    "<tool_response>\nSunny\n</tool_response>\n"
    "<tool_response>\nCloudy 18°C\n</tool_response>\n"
    "</turn>\n"
)
ITEM1 = '<turn>\n<tool_call>\n{"name": "w", "arguments": {"c": "Oslo"}}\n</tool_call>\n<tool_response>\nSnow\n\n</tool_response>\n</turn>\n'
ITEM2 = (
    '<turn>\n<tool_call>\n{"name": "w", "arguments": [1]}\n</tool_call>\n'
    "<tool_response>\ntool call 1: arguments must be a JSON object, got list\n</tool_response>\n"
    "</turn>\n"
)
OPEN = "<|im_start|>user\n<hindsight>\n"
CLOSE = "</hindsight><|im_end|>\n"


def test_exact_text_of_each_depth(tok, traj):
    assert traj.num_turns == 4
    assert [tok.decode(hindsight_ids(tok, traj, 0, d)) for d in (1, 2, 3)] == [
        OPEN + ITEM0 + CLOSE,
        OPEN + ITEM0 + ITEM1 + CLOSE,
        OPEN + ITEM0 + ITEM1 + ITEM2 + CLOSE,
    ]
    assert tok.decode(hindsight_ids(tok, traj, 1, 3)) == OPEN + ITEM1 + ITEM2 + "<turn>\n</turn>\n" + CLOSE


def test_pieces_share_prefix_and_match_whole_tokenisation(tok, traj):
    for k in range(traj.num_turns):
        for source, gold in (("tool_results", None), ("tool_results_answer", "Sunny"), ("answer", "Sunny")):
            p = hindsight_pieces(tok, traj, k, source=source, gold_answer=gold)
            assert p.num_items == min(3, traj.num_turns - k)
            open_t, items_t, close_t, empty = hindsight_texts(traj, k, source=source, gold_answer=gold)
            for d in (1, 2, 3):
                whole = open_t + "".join(items_t[:d]) + close_t
                msg = p.message_ids(d)
                assert msg == (encode(tok, whole) if whole else []), (k, source, d)
                assert msg == hindsight_ids(tok, traj, k, d, source=source, gold_answer=gold)
                if not p.is_empty:
                    assert msg[: len(p.open_ids)] == p.open_ids
                    assert msg[len(p.open_ids) : len(msg) - len(p.close_ids)] == sum(p.item_ids[:d], [])
            t = traj.turns[k]
            assert p.header_ids == traj.tokens[t.header_start : t.policy_start].tolist()
            assert tok.decode(p.header_ids) == "<|im_start|>assistant\n"


def test_depth_clipping(tok, traj):
    # k = 2 has two items (turns 2 and 3): depth 3 equals depth 2 (k̄ = min(k+d-1, K-1) = 3).
    p = hindsight_pieces(tok, traj, 2)
    assert p.num_items == 2 and not p.is_empty
    assert p.message_ids(3) == p.message_ids(2) != p.message_ids(1)
    assert tok.decode(p.message_ids(1)) == OPEN + ITEM2 + CLOSE
    # max_depth limits the number of items.
    assert hindsight_pieces(tok, traj, 0, max_depth=2).num_items == 2
    with pytest.raises(ValueError, match="depth must be >= 1"):
        p.message_ids(0)
    with pytest.raises(ValueError, match="depth 4 outside 1..3"):
        hindsight_ids(tok, traj, 0, 4)


def test_answer_turn_block_is_empty_for_tool_results(tok, traj):
    k = 3
    p = hindsight_pieces(tok, traj, k)
    assert p.is_empty and p.num_items == 1
    assert p.open_ids == [] and p.close_ids == [] and p.item_ids == [[]]
    assert all(p.message_ids(d) == [] for d in (1, 2, 3))
    # The teacher's view is then the student's own context.
    t = traj.turns[k]
    assert teacher_view_ids(tok, traj, k, 2) == traj.tokens[: t.policy_end].tolist()


def test_answer_sources(tok, traj):
    gold = "Sunny, cloudy, snow"
    p = hindsight_pieces(tok, traj, 3, source="tool_results_answer", gold_answer=gold)
    assert not p.is_empty
    assert tok.decode(p.open_ids) == OPEN + f"<answer>{gold}</answer>\n"
    assert tok.decode(p.message_ids(1)) == OPEN + f"<answer>{gold}</answer>\n" + "<turn>\n</turn>\n" + CLOSE
    p = hindsight_pieces(tok, traj, 0, source="tool_results_answer", gold_answer=gold)
    assert tok.decode(p.message_ids(2)) == OPEN + f"<answer>{gold}</answer>\n" + ITEM0 + ITEM1 + CLOSE
    p = hindsight_pieces(tok, traj, 0, source="answer", gold_answer=gold)
    assert p.item_ids == [[], [], []]
    assert {tuple(p.message_ids(d)) for d in (1, 2, 3)} == {tuple(encode(tok, OPEN + f"<answer>{gold}</answer>\n" + CLOSE))}


def test_teacher_view_layout(tok, traj):
    k, d = 1, 2
    t = traj.turns[k]
    view = teacher_view_ids(tok, traj, k, d)
    context = traj.tokens[: t.header_start].tolist()
    message = hindsight_ids(tok, traj, k, d)
    turn = traj.tokens[t.header_start : t.policy_end].tolist()
    assert view == context + message + turn
    text = tok.decode(view)
    # The inserted message sits between the tool-response turn and turn k's assistant header.
    assert text.endswith("</tool_response><|im_end|>\n" + OPEN + ITEM1 + ITEM2 + CLOSE + "<|im_start|>assistant\n" + traj.turns[k].text + "<|im_end|>")


def test_argument_errors(tok, traj):
    with pytest.raises(IndexError, match="turn 4 out of range for a trajectory with 4 turns"):
        hindsight_pieces(tok, traj, 4)
    with pytest.raises(ValueError, match="unknown hindsight source 'gold'"):
        hindsight_pieces(tok, traj, 0, source="gold")
    with pytest.raises(ValueError, match="needs gold_answer"):
        hindsight_pieces(tok, traj, 0, source="answer")
    with pytest.raises(ValueError, match="max_depth must be >= 1"):
        hindsight_pieces(tok, traj, 0, max_depth=0)


def test_custom_template(tok, traj):
    tmpl = HindsightTemplate(
        message_open="<|im_start|>system\nHindsight for turn:\n",
        item="[{turn}/{offset}]\n{calls}{results}",
        call="CALL {call}\n",
        result="RESULT {result}\n",
        message_close="<|im_end|>\n",
    )
    p = hindsight_pieces(tok, traj, 1, template=tmpl)
    assert tok.decode(p.message_ids(1)) == (
        '<|im_start|>system\nHindsight for turn:\n[2/0]\nCALL {"name": "w", "arguments": {"c": "Oslo"}}\nRESULT Snow\n\n<|im_end|>\n'
    )


RESULT_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40) | st.sampled_from(
    ["", " ", "\n", "  \n\n", "trailing \n", "\nleading", "中文 🌞", "{\"a\": 1}\n", "e\u0301"]
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(r0=RESULT_TEXT, r1=RESULT_TEXT, gold=RESULT_TEXT)
def test_piecewise_equals_whole_for_arbitrary_results(tok, r0, r1, gold):
    tr = _rollout(tok, [(PARIS, [r0]), (ROME, [r1]), ("ok", None)], think=False)
    p = hindsight_pieces(tok, tr, 0, source="tool_results_answer", gold_answer=gold)
    open_t, items_t, close_t, _ = hindsight_texts(tr, 0, source="tool_results_answer", gold_answer=gold)
    for d in (1, 2, 3):
        assert p.message_ids(d) == encode(tok, open_t + "".join(items_t[:d]) + close_t)


@pytest.mark.parametrize("source", ["tool_results", "tool_results_answer", "answer"])
def test_equal_length_blocks(tok, traj, source):
    """rl.hindsight_budget: every non-empty message is exactly `budget` tokens for every source and
    depth; the content's head is kept (deeper messages extend shallower ones), the rest is the
    tiled filler; the markup and the answer are never cut; empty blocks stay empty."""
    answer = "Sunny, cloudy, snow"
    kw = dict(max_depth=3, source=source, gold_answer=None if source == "tool_results" else answer)
    dot = encode(tok, ".\n")
    assert len(dot) == 1  # the default filler is one token
    for budget in (40, 70, 200):  # cuts the deep messages, cuts some, pads all
        for k in range(traj.num_turns):
            plain = hindsight_pieces(tok, traj, k, **kw)
            fitted = hindsight_pieces(tok, traj, k, budget=budget, **kw)
            if plain.is_empty:
                assert fitted.message_ids(1) == []
                continue
            msgs = [fitted.message_ids(d) for d in (1, 2, 3)]
            assert [len(m) for m in msgs] == [budget] * 3
            markup = len(plain.open_ids) + len(plain.close_ids)
            for d, msg in zip((1, 2, 3), msgs):
                full = plain.message_ids(d)
                content = full[len(plain.open_ids):len(full) - len(plain.close_ids)]
                assert msg[:len(plain.open_ids)] == plain.open_ids and msg[len(msg) - len(plain.close_ids):] == plain.close_ids
                shown = msg[len(plain.open_ids):budget - len(plain.close_ids)]
                n = min(len(content), budget - markup)
                assert shown[:n] == content[:n] and shown[n:] == dot * (budget - markup - n)
            # prefix consistency: the kept content of depth d is a prefix of depth d+1's
            kept = [fitted.kept(min(d, fitted.num_items)) for d in (1, 2, 3)]
            assert kept == sorted(kept) and all(msgs[0][:len(plain.open_ids) + kept[0]] == m[:len(plain.open_ids) + kept[0]]
                                                for m in msgs)
    # padding only: the padded message is what the tokenizer makes of its text
    fitted = hindsight_pieces(tok, traj, 1, budget=200, **kw)
    assert encode(tok, tok.decode(fitted.message_ids(2))) == fitted.message_ids(2)
    # the answer and the markup are never cut
    with pytest.raises(ValueError, match=r"rl.hindsight_budget=5: turn 0's hindsight message needs \d+ tokens"):
        hindsight_pieces(tok, traj, 0, budget=5, **kw)
    # the teacher's plain view carries the fitted message
    view = teacher_view_ids(tok, traj, 0, 2, budget=70, **kw)
    assert view == ([int(x) for x in traj.tokens[:traj.turns[0].header_start]] + hindsight_ids(tok, traj, 0, 2, budget=70, **kw)
                    + [int(x) for x in traj.tokens[traj.turns[0].header_start:traj.turns[0].policy_end]])
