"""MatchTIR turn rewards, optimal matching, Sinkhorn plan and outcome rewards."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from turnsight_jax.chat.types import CallError, ToolCall
from turnsight_jax.rewards import (
    call_similarity,
    extract_answer,
    matched_call_rewards,
    matchtir_turn_rewards,
    optimal_assignment,
    sinkhorn_plan,
    token_f1,
)


def g(name, **args):
    return {"name": name, "arguments": args}


def test_call_similarity_hand_examples():
    gold = g("f", a=1, b="x")
    assert call_similarity(ToolCall("f", {"a": 1, "b": "x"}), gold) == 1.0
    assert call_similarity(ToolCall("f", {"a": 1, "b": "y"}), gold) == pytest.approx(3 / 4)
    assert call_similarity(ToolCall("f", {"a": 1}), gold) == pytest.approx((1 + 0.5 + 1) / 4)
    assert call_similarity(ToolCall("f", {"a": 1, "b": "x", "c": 3}), gold) == pytest.approx(
        (1 + 2 / 3 + 2) / 4)
    assert call_similarity(ToolCall("f", {}), gold) == pytest.approx(1 / 4)
    assert call_similarity(ToolCall("h", {"a": 1, "b": "x"}), gold) == 0.0
    assert call_similarity(CallError("bad"), gold) == 0.0
    # Exact means JSON-typed equality: True is not 1.
    assert call_similarity(ToolCall("f", {"a": True}), g("f", a=1)) == pytest.approx(2 / 3)
    assert call_similarity(ToolCall("f", {"a": 1.0}), g("f", a=1)) == 1.0
    # No parameters on either side: Jaccard of empty sets is 1.
    assert call_similarity(ToolCall("f", {}), g("f")) == 1.0


def test_turn_rewards_hand_example_spec_section_1():
    gold = [[g("f", a=1)], [g("g", b=2)]]
    pred = [[ToolCall("g", {"b": 2})], [ToolCall("f", {"a": 1}), ToolCall("f", {"a": 5})], []]
    r = matchtir_turn_rewards(pred, gold, "<answer>Paris France</answer>", "Paris")
    # turn 0: g matched exactly (1); turn 1: f(a=1) matched (1), f(a=5) left unmatched (0);
    # answer turn: token-F1("paris france", "paris") = 2/3.
    np.testing.assert_allclose(r, [1.0, 0.5, 2 / 3])
    assert r.shape == (3,)


def test_turn_rewards_without_answer_and_empty_turns():
    gold = [[g("f", a=1)]]
    r = matchtir_turn_rewards([[], [ToolCall("f", {"a": 2})]], gold, None, "x")
    np.testing.assert_allclose(r, [0.0, 2 / 3])  # (1 + 1 + 0) / 3
    r = matchtir_turn_rewards([[ToolCall("f", {"a": 1})], []], gold, None, "x")
    np.testing.assert_allclose(r, [1.0, 0.0])  # no answer given: answer turn 0
    assert matchtir_turn_rewards([], gold, "x", "x").shape == (0,)
    np.testing.assert_allclose(matchtir_turn_rewards([[]], None, "x", "x"), [1.0])


def test_assignment_is_optimal_not_greedy():
    s = np.array([[0.9, 0.8], [0.85, 0.1]])
    pairs = optimal_assignment(s)
    assert sorted(pairs) == [(0, 1), (1, 0)]  # 1.65, greedy would take 0.9 + 0.1
    gold = [g("f", a=1, b=2), g("f", a=1, b=3)]
    preds = [ToolCall("f", {"a": 1, "b": 3, "c": 0}), ToolCall("f", {"a": 1, "b": 2})]
    r = matched_call_rewards(preds, gold)
    # pred 1 exactly equals gold 0 (1.0); pred 0 then takes gold 1: (1 + 2/3 + 2)/4.
    np.testing.assert_allclose(r, [(1 + 2 / 3 + 2) / 4, 1.0])


@pytest.mark.parametrize("seed", range(40))
def test_assignment_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    p, q = (int(v) for v in rng.integers(1, 6, size=2))
    s = rng.random((p, q))
    s[rng.random((p, q)) < 0.3] = 0.0
    best = 0.0
    if p <= q:
        for perm in itertools.permutations(range(q), p):
            best = max(best, sum(s[i, perm[i]] for i in range(p)))
    else:
        for perm in itertools.permutations(range(p), q):
            best = max(best, sum(s[perm[j], j] for j in range(q)))
    pairs = optimal_assignment(s)
    assert len(pairs) == min(p, q)
    assert len({i for i, _ in pairs}) == len(pairs) == len({j for _, j in pairs})
    assert sum(s[i, j] for i, j in pairs) == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("shape", [(1, 1), (3, 3), (2, 5), (6, 2)])
def test_sinkhorn_plan_marginals(shape):
    rng = np.random.default_rng(sum(shape))
    s = rng.random(shape)
    plan = sinkhorn_plan(s, reg=0.1)
    assert (plan >= 0).all()
    np.testing.assert_allclose(plan.sum(axis=1), 1 / shape[0], atol=1e-8)
    np.testing.assert_allclose(plan.sum(axis=0), 1 / shape[1], atol=1e-8)


def test_transport_rewards_favour_the_better_match():
    gold = [g("f", a=1), g("h", b=2)]
    preds = [ToolCall("f", {"a": 1}), ToolCall("h", {"b": 2})]
    r = matched_call_rewards(preds, gold, method="transport")
    # Low-entropy plan (reg 0.1) concentrates on the exact matches.
    assert r[0] > 0.99 and r[1] > 0.99
    r = matchtir_turn_rewards([[preds[0], ToolCall("f", {"a": 9})], []], gold, "ok", "ok",
                              method="transport")
    assert 0.0 < r[0] < 1.0 and r[1] == 1.0
    with pytest.raises(ValueError, match="method"):
        matchtir_turn_rewards([[]], gold, "", "", method="greedy")


def test_outcome_rewards():
    assert token_f1("the Eiffel Tower", "Eiffel tower!") == 1.0
    assert token_f1("x b c", "c d") == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert extract_answer("<think>x</think> <answer> Rila </answer>") == "Rila"
    assert extract_answer("<think>hm</think>Rila") == "Rila"
    assert token_f1(extract_answer("<answer>Rila</answer>"), "rila") == 1.0
