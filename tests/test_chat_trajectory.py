"""Trajectory assembly, masks, turn ids (the training batch built from them: tests/test_rl_batch.py)."""

from __future__ import annotations

import numpy as np
import pytest

from turnsight_jax.chat import template as T
from turnsight_jax.chat.parsing import parse_turn, render_tool_call
from turnsight_jax.chat.tokenizer import encode, load_tokenizer, special_ids
from turnsight_jax.chat.trajectory import (
    QWEN3_IM_END_ID as END,
    QWEN3_IM_START_ID as START,
    Trajectory,
    TrajectoryBuilder,
    check_trajectory,
)
from turnsight_jax.chat.types import ToolCall

# --- hand-built ids (no tokenizer needed) -------------------------------------------------------

PROMPT = [START, 10, 11, END, 12, START, 13, 14]  # ... <|im_start|>assistant\n


def _call(name="f"):
    return ToolCall(name, {}, raw="")


def _three_turn_trajectory(group_id=0, reward=1.0, turn_rewards=None):
    b = TrajectoryBuilder(PROMPT, group_id=group_id, task_id="t0")
    b.add_policy_turn([20, 21, 22, END], [-0.1, -0.2, -0.3, -0.4], "two calls", [_call("a"), _call("b")])
    # suffix: "\n" user ... results ... header at offset 5
    b.add_observation([30, START, 31, 32, 33, START, 13, 14], ["r1", "r2"], [(2, 3), (3, 4)], header_offset=5)
    b.add_policy_turn([END], [-0.5], "", [], answer=None)  # empty turn: only <|im_end|>, no calls
    b.add_observation([30, START, 34, START, 13, 14], [], [], header_offset=3)
    b.add_policy_turn([40, 41, END], [-0.6, -0.7, -0.8], "42", [], answer="42")
    metrics = {} if turn_rewards is None else {"turn_rewards": turn_rewards}
    return b.build(reward=reward, metrics=metrics)


def test_masks_turn_ids_and_spans_exact():
    tr = _three_turn_trajectory()
    assert tr.tokens.tolist() == PROMPT + [20, 21, 22, END] + [30, START, 31, 32, 33, START, 13, 14] + [END] + [30, START, 34, START, 13, 14] + [40, 41, END]
    assert tr.tokens.dtype == np.int32 and tr.policy_mask.dtype == np.bool_
    assert tr.turn_ids.tolist() == [-1] * 8 + [0] * 4 + [-1] * 8 + [1] + [-1] * 6 + [2] * 3
    assert tr.policy_mask.tolist() == [t >= 0 for t in tr.turn_ids.tolist()]
    np.testing.assert_array_equal(
        tr.old_logprobs,
        np.array([0] * 8 + [-0.1, -0.2, -0.3, -0.4] + [0] * 8 + [-0.5] + [0] * 6 + [-0.6, -0.7, -0.8], np.float32),
    )
    assert tr.prompt_len == 8 and tr.length == 30 and tr.num_turns == 3
    t0, t1, t2 = tr.turns
    assert (t0.header_start, t0.policy_start, t0.policy_end, t0.obs_start, t0.obs_end) == (5, 8, 12, 12, 20)
    assert t0.result_spans == [(14, 15), (15, 16)] and t0.results == ["r1", "r2"]
    assert (t1.header_start, t1.policy_start, t1.policy_end, t1.obs_start, t1.obs_end) == (17, 20, 21, 21, 27)
    assert (t2.header_start, t2.policy_start, t2.policy_end, t2.obs_start, t2.obs_end) == (24, 27, 30, 30, 30)
    assert not t2.has_observation and t2.answer == "42"
    assert tr.finish_reason == "answer" and not tr.truncated and tr.reward == 1.0
    for t in tr.turns:
        assert tr.tokens[t.header_start] == START


def test_truncated_turn_without_im_end():
    b = TrajectoryBuilder(PROMPT, group_id=3, task_id="t1")
    b.add_policy_turn([20, END], [-1.0, -1.0], "x", [_call()])
    b.add_observation([30, START, 31, START, 13, 14], ["r"], [(2, 3)], header_offset=3)
    b.add_policy_turn([50, 51, 52], [-0.5, -0.5, -0.5], "cut mid-senten", [])  # length limit hit
    with pytest.raises(ValueError, match="ended with token 52, not <\\|im_end\\|>"):
        b.add_observation([30, START, 13], [], [], header_offset=1)
    b.mark_truncated("length")
    with pytest.raises(RuntimeError, match="marked truncated \\(length\\)"):
        b.add_policy_turn([1], [0.0], "", [])
    tr = b.build()
    assert tr.truncated and tr.finish_reason == "length" and tr.group_id == 3
    assert tr.turn_ids.tolist() == [-1] * 8 + [0, 0] + [-1] * 6 + [1, 1, 1]
    assert tr.turns[1].policy_end == tr.length == 19


def test_builder_errors_are_clear():
    with pytest.raises(ValueError, match="no <\\|im_start\\|>"):
        TrajectoryBuilder([1, 2, 3], 0, "t")
    b = TrajectoryBuilder(PROMPT, 0, "t")
    with pytest.raises(RuntimeError, match="must follow a policy turn"):
        b.add_observation([START], [], [], 0)
    with pytest.raises(ValueError, match="at least one token"):
        b.add_policy_turn([], [], "", [])
    with pytest.raises(ValueError, match="3 tokens but logprobs has shape \\(2,\\)"):
        b.add_policy_turn([1, 2, END], [0.0, 0.0], "", [])
    with pytest.raises(ValueError, match="non-finite"):
        b.add_policy_turn([1, END], [0.0, np.nan], "", [])
    b.add_policy_turn([1, END], [-1.0, -1.0], "", [_call()])
    with pytest.raises(RuntimeError, match="add_observation must follow turn 0"):
        b.add_policy_turn([1, END], [-1.0, -1.0], "", [])
    with pytest.raises(ValueError, match="1 calls but 2 results"):
        b.add_observation([30, START], ["a", "b"], [(0, 0), (0, 0)], 1)
    with pytest.raises(ValueError, match="header_offset 0 does not point at <\\|im_start\\|>"):
        b.add_observation([30, START], ["a"], [(0, 1)], 0)
    with pytest.raises(ValueError, match="result span \\(1, 5\\) outside"):
        b.add_observation([30, START], ["a"], [(1, 5)], 1)
    with pytest.raises(ValueError, match="finish_reason is required"):
        b.build()
    tr = b.build(finish_reason="max_turns")
    assert tr.finish_reason == "max_turns"


def test_check_trajectory_detects_corruption():
    tr = _three_turn_trajectory()
    tr.turn_ids[9] = 1
    with pytest.raises(AssertionError, match="turn_ids disagree"):
        check_trajectory(tr)
    tr = _three_turn_trajectory()
    tr.old_logprobs[0] = -1.0
    with pytest.raises(AssertionError, match="old_logprobs must be 0"):
        check_trajectory(tr)
    with pytest.raises(ValueError, match="policy_mask must be bool"):
        Trajectory(np.zeros(3, np.int32), np.zeros(3, np.int32), np.zeros(3, np.int32), np.zeros(3, np.float32), 3, [], 0, "t")


# --- with the real tokenizer ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir):
    return load_tokenizer(qwen3_tokenizer_dir)


@pytest.mark.parametrize("think", [True, False])
def test_real_rollout_layout(tok, hf_tok, think):
    sp = special_ids(tok)
    messages = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}}]
    prompt = T.prompt_ids(tok, messages, tools, enable_thinking=think)
    b = TrajectoryBuilder(prompt, 0, "paris", im_start_id=sp.im_start, im_end_id=sp.im_end)
    # Turn 0: parallel calls.
    text0 = "Both.\n" + render_tool_call("w", {"c": "Paris"}) + "\n" + render_tool_call("w", {"c": "Rome"})
    ids0 = encode(tok, text0 + "<|im_end|>")
    p0 = parse_turn(text0)
    assert len(p0.calls) == 2
    b.add_policy_turn(ids0, [-0.5] * len(ids0), text0, p0.calls, p0.answer)
    results = ["Sunny 21°C", "Cloudy"]
    s0 = T.observation_suffix_ids(tok, results, enable_thinking=think)
    b.add_observation(s0.ids, results, s0.result_spans, s0.header_offset)
    # Turn 1: answer.
    ids1 = encode(tok, "<answer>Sunny / Cloudy</answer><|im_end|>")
    b.add_policy_turn(ids1, [-0.25] * len(ids1), "<answer>Sunny / Cloudy</answer>", [], "Sunny / Cloudy")
    tr = b.build(reward=1.0)

    assert tr.tokens.tolist() == prompt + ids0 + s0.ids + ids1  # nothing re-tokenised
    P, n0, s, n1 = len(prompt), len(ids0), len(s0.ids), len(ids1)
    assert tr.turn_ids.tolist() == [-1] * P + [0] * n0 + [-1] * s + [1] * n1
    header = "<|im_start|>assistant\n" + ("" if think else "<think>\n\n</think>\n\n")
    for t in tr.turns:
        assert tok.decode(tr.tokens[t.header_start : t.policy_start].tolist()) == header
        assert tr.tokens[t.policy_end - 1] == sp.im_end
    t0 = tr.turns[0]
    assert [tok.decode(tr.tokens[a:b].tolist()) for a, b in t0.result_spans] == results
    # The whole trajectory is what the official template renders for the equivalent conversation
    # (thinking on: the turn-0 message has no reasoning, so the template writes it without <think>).
    if think:
        conv = messages + [
            {"role": "assistant", "content": "Both.", "tool_calls": [{"function": {"name": "w", "arguments": {"c": c}}} for c in ("Paris", "Rome")]},
            {"role": "tool", "content": results[0]},
            {"role": "tool", "content": results[1]},
        ]
        expected = hf_tok.apply_chat_template(conv, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=True)
        assert tok.decode(tr.tokens[: t0.obs_end].tolist()) == expected


# --- batching -----------------------------------------------------------------------------------
