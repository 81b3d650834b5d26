"""MatchTIR turn rewards (clean and released conventions), matchings, Sinkhorn plans, outcome
rewards and the ToolRL reward."""

from __future__ import annotations

import itertools
import math
import types

import numpy as np
import pytest

from turnsight_jax.chat.types import CallError, ToolCall
from turnsight_jax.rewards import (
    call_similarity,
    extract_answer,
    greedy_assignment,
    matched_call_rewards,
    matchtir_turn_rewards,
    multiset_jaccard,
    optimal_assignment,
    pot_sinkhorn_plan,
    released_answer_f1,
    sinkhorn_plan,
    token_f1,
    toolrl_correctness,
    toolrl_format,
    toolrl_reward,
)
from turnsight_jax.rl.config import AlgoConfig
from turnsight_jax.rl.methods import METHODS, REWARDS


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
    with pytest.raises(ValueError, match="method must be one of"):
        matchtir_turn_rewards([[]], gold, "", "", method="hungarian")
    with pytest.raises(ValueError, match="semantics must be one of"):
        matchtir_turn_rewards([[]], gold, "", "", semantics="paper")


def test_outcome_rewards():
    assert token_f1("the Eiffel Tower", "Eiffel tower!") == 1.0
    assert token_f1("x b c", "c d") == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))
    assert extract_answer("<think>x</think> <answer> Rila </answer>") == "Rila"
    assert extract_answer("<think>hm</think>Rila") == "Rila"
    assert token_f1(extract_answer("<answer>Rila</answer>"), "rila") == 1.0


# ---------------------------------------------------------------------------- MatchTIR, greedy
def test_greedy_differs_from_the_optimal_matching():
    gold = [g("f", a=1, b=2), g("f", c=3, d=4)]
    preds = [ToolCall("f", {"a": 1, "b": 2, "c": 3}), ToolCall("f", {"a": 1, "b": 7})]
    # Similarities (1 + Jaccard + exact) / (2 + #gold params):
    #   p0-g0 (1 + 2/3 + 2)/4 = 11/12, p0-g1 (1 + 1/4 + 1)/4 = 9/16,
    #   p1-g0 (1 + 1 + 1)/4 = 3/4,     p1-g1 (1 + 0 + 0)/4 = 1/4.
    # Greedy takes the top pair p0-g0 then p1-g1 (total 7/6); optimal p0-g1 + p1-g0 (21/16).
    for semantics in ("clean", "released"):
        np.testing.assert_allclose(matched_call_rewards(preds, gold, method="greedy", semantics=semantics),
                                   [11 / 12, 1 / 4])
        np.testing.assert_allclose(matched_call_rewards(preds, gold, method="assignment", semantics=semantics),
                                   [9 / 16, 3 / 4])
    # As turn rewards: one call per turn, then an answer turn.
    r = matchtir_turn_rewards([[preds[0]], [preds[1]], []], [[gold[0]], [gold[1]]], "x", "x", method="greedy")
    np.testing.assert_allclose(r, [11 / 12, 1 / 4, 1.0])


def test_greedy_ties_and_zero_scores():
    # Equal scores: stable order, lower predicted index first, then lower gold index. Pred 0 takes
    # gold 0; pred 1's only positive pair is with gold 0 (taken), its 0-score pair is no candidate.
    assert greedy_assignment(np.array([[0.5, 0.5], [0.5, 0.0]])) == [(0, 0)]
    assert sorted(optimal_assignment(np.array([[0.5, 0.5], [0.5, 0.0]]))) == [(0, 1), (1, 0)]
    assert greedy_assignment(np.array([[0.5, 0.5], [0.5, 0.5]])) == [(0, 0), (1, 1)]
    assert greedy_assignment(np.array([[0.3, 0.7], [0.7, 0.3]])) == [(0, 1), (1, 0)]
    assert greedy_assignment(np.zeros((2, 3))) == [] and greedy_assignment(np.zeros((0, 2))) == []


# ------------------------------------------------------------------------- MatchTIR, transport
# POT 0.9.7.post1 (pip install pot, a throwaway venv): T = ot.sinkhorn(np.ones(P) / P, np.ones(G) / G,
# -S, reg=0.1), its defaults (sinkhorn_knopp, numItermax 1000, stopThr 1e-9); log=True gave the
# iteration it stopped at. These are its plans, printed with repr.
POT_CASES = [
    # S, plan, POT's last iteration (its error is checked on iterations 0, 10, 20, ...)
    ([[0.6, 0.2], [0.9, 0.4], [0.1, 0.7]],
     [[0.2198397824765119, 0.11349355085682142], [0.2801309065113959, 0.05320242682193745],
      [2.931101363278639e-05, 0.3333040223197005]], 40),
    ([[1.0, 1.0, 0.0], [1.0, 0.5, 0.5], [0.25, 1.0, 0.75]],
     [[0.10281393574493877, 0.2302207671136644, 0.0002986304747301752],
      [0.23049478800594744, 0.0034776126926271004, 0.09936093263475883],
      [2.4609942340529943e-05, 0.09963495357223298, 0.23367376981875984]], 20),
    # A rank-one kernel (rows differ by a constant): the independent plan after one iteration.
    ([[1.0, 0.5, 0.25], [0.75, 0.25, 0.0]], [[1 / 6] * 3, [1 / 6] * 3], 0),
]


@pytest.mark.parametrize("case", range(len(POT_CASES)))
def test_pot_sinkhorn_plan_equals_pot(case):
    s, want, last_iteration = POT_CASES[case]
    s = np.array(s)
    p, q = s.shape
    a, b = np.full(p, 1 / p), np.full(q, 1 / q)
    plan = pot_sinkhorn_plan(a, b, -s, 0.1)
    np.testing.assert_allclose(plan, want, rtol=0, atol=1e-15)
    # The stop rule matters at this precision: running on to convergence (no stop threshold), or
    # stopping one iteration before POT's last, gives a plan 1e-13 .. 1e-10 away.
    if last_iteration:
        longer = pot_sinkhorn_plan(a, b, -s, 0.1, stop_thr=0.0)
        assert np.abs(longer - np.array(want)).max() > 1e-13
        early = pot_sinkhorn_plan(a, b, -s, 0.1, max_iter=last_iteration)
        assert np.abs(early - np.array(want)).max() > 1e-13


@pytest.mark.parametrize("n", [1, 2, 4])
def test_transport_scale_released_unnormalised_clean_normalised(n):
    # n distinct gold calls, each made exactly once, one per turn: S = I_n. By symmetry both
    # plans are T = (1/n) K / rowsum(K); released K = exp(S / 0.1), clean K = exp(-(1 - S) / 0.1),
    # so T_ii = (1/n) e^10 / (e^10 + n - 1) in both. Released reward T_ii (about 1/n); clean
    # T_ii / (1/n) (about 1).
    gold = [[g(f"t{j}", x=j)] for j in range(n)]
    pred = [[ToolCall(f"t{j}", {"x": j})] for j in range(n)]
    share = math.exp(10) / (math.exp(10) + n - 1)
    released = matchtir_turn_rewards(pred, gold, None, None, method="transport", semantics="released")
    clean = matchtir_turn_rewards(pred, gold, None, None, method="transport", semantics="clean")
    np.testing.assert_allclose(released, [share / n] * n, rtol=1e-12)
    np.testing.assert_allclose(clean, [share] * n, rtol=1e-9)


# ------------------------------------------------------------------- MatchTIR, the conventions
def test_released_names_case_insensitive_values_python_equal():
    gold = g("get_team", person="Bube", n=1)
    cased = ToolCall("Get_Team", {"person": "Bube", "n": 1})
    assert call_similarity(cased, gold, semantics="released") == 1.0
    assert call_similarity(cased, gold, semantics="clean") == 0.0
    # Python ==: True == 1 == 1.0 and [1] == [True]; "1" != 1 in both.
    assert call_similarity(ToolCall("f", {"a": True}), g("f", a=1), semantics="released") == 1.0
    assert call_similarity(ToolCall("f", {"a": True}), g("f", a=1), semantics="clean") == pytest.approx(2 / 3)
    assert call_similarity(ToolCall("f", {"a": [True]}), g("f", a=[1]), semantics="released") == 1.0
    assert call_similarity(ToolCall("f", {"a": "1"}), g("f", a=1), semantics="released") == pytest.approx(2 / 3)
    # Parameter-name Jaccard is the same for both (names are unique): {a, b} vs {a}: 1/2.
    for semantics in ("clean", "released"):
        assert call_similarity(ToolCall("f", {"a": 1, "b": 2}), g("f", a=1), semantics=semantics) == \
            pytest.approx((1 + 1 / 2 + 1) / 3)
        assert call_similarity(ToolCall("f", {}), g("f"), semantics=semantics) == 1.0


def test_multiset_jaccard_is_the_released_match_score():
    assert multiset_jaccard([], []) == 1.0 and multiset_jaccard(["a"], []) == 0.0
    assert multiset_jaccard(["a", "b"], ["b", "a"]) == 1.0
    assert multiset_jaccard(["f"], ["f", "f"]) == pytest.approx(1 / 2)  # 1 / (1 + 2 - 1)
    assert multiset_jaccard(["f", "h"], ["f", "g", "g"]) == pytest.approx(1 / 4)  # 1 / (2 + 3 - 1)


def test_released_answer_f1_punctuation_articles_sets_and_tags():
    # "The U.S. army": punctuation becomes spaces and articles stay -> {the, u, s, army} vs
    # {u, s, army}: P 3/4, R 1, F1 6/7. Clean deletes punctuation and articles: "us army" twice, 1.
    assert released_answer_f1("<answer>The U.S. army</answer>", "U.S. Army") == pytest.approx(6 / 7)
    assert token_f1(extract_answer("<answer>The U.S. army</answer>"), "U.S. Army") == 1.0
    # Token sets: a repeated token counts once (clean: multiset, P 1/2, R 1, F1 2/3).
    assert released_answer_f1("<answer>paris paris</answer>", "Paris") == 1.0
    assert token_f1("paris paris", "Paris") == pytest.approx(2 / 3)
    # No closed <answer> tag: 0; the first tagged answer counts; a stop token is stripped first.
    assert released_answer_f1("Paris", "Paris") == 0.0
    assert released_answer_f1("<answer>Paris", "Paris") == 0.0
    assert released_answer_f1("<answer>Rome</answer> <answer>Paris</answer>", "Paris") == 0.0
    assert released_answer_f1("<think>hm</think><answer>Paris</answer><|im_end|>", "paris") == 1.0
    assert released_answer_f1("<answer>!!</answer>", "") == 0.0  # both empty: 0 (clean: 1)


def test_turn_rewards_untagged_answer_and_dropped_malformed_calls():
    gold = [[g("f", a=1)]]
    good, bad = ToolCall("f", {"a": 1}), CallError("tool call 2: empty body")
    # Clean: the malformed call is a call of its turn scoring 0 -> (1 + 0) / 2; the untagged
    # answer text "Paris" is the answer -> F1 1. Released: the malformed call is dropped -> 1;
    # no <answer> tags -> 0.
    pred = [[good, bad], []]
    np.testing.assert_allclose(matchtir_turn_rewards(pred, gold, "Paris", "Paris", semantics="clean"), [0.5, 1.0])
    np.testing.assert_allclose(matchtir_turn_rewards(pred, gold, "Paris", "Paris", semantics="released"),
                               [1.0, 0.0])
    np.testing.assert_allclose(
        matchtir_turn_rewards(pred, gold, "<answer>Paris</answer>", "Paris", semantics="released"), [1.0, 1.0])
    # A turn of malformed calls only: clean 0 (their mean), released 0 (no calls left).
    for semantics in ("clean", "released"):
        np.testing.assert_allclose(matchtir_turn_rewards([[bad], [good]], gold, None, None, semantics=semantics),
                                   [0.0, 1.0])


def _traj(*turns):
    """A stand-in for chat.trajectory.Trajectory: the rewards read turns[k].calls/.text/.answer."""
    return types.SimpleNamespace(turns=[types.SimpleNamespace(calls=c, text=t, answer=a) for c, t, a in turns])


def test_registered_matchtir_reward_reads_semantics_and_matching():
    task = types.SimpleNamespace(gold_calls=((g("f", a=1),),), answer="Paris")
    traj = _traj(([ToolCall("F", {"a": True})], '<tool_call>{"name": "F"}</tool_call>', None),
                 ([], "Paris", "Paris"))  # an untagged answer: the parsed answer is the text
    fn = REWARDS["matchtir_turns"].fn
    # clean: name "F" != "f" -> 0; the parsed answer "Paris" -> 1.
    np.testing.assert_allclose(fn(traj, task, AlgoConfig()), [0.0, 1.0])
    # released: case-insensitive name and True == 1 -> 1; the raw text has no tags -> 0.
    np.testing.assert_allclose(fn(traj, task, AlgoConfig(matchtir_semantics="released",
                                                         matchtir_matching="greedy")), [1.0, 0.0])


# ------------------------------------------------------------------------------------- ToolRL
TOOLRL_GOLD = [[g("f", a=1)], [g("h", b=2, c=3)]]


def test_toolrl_correctness_hand_cases():
    # Exact: names ["f", "h"] equal -> 1; f: 1 + 1 exact = 2; h: 1 + 2 = 3; max 1 + 2 + 3 = 6 -> 3.
    exact = [ToolCall("f", {"a": 1}), ToolCall("h", {"b": 2, "c": 3})]
    assert toolrl_correctness(exact, TOOLRL_GOLD) == 3.0
    # Partial: names 1; f(a=2): 1 + 0; h(b=2): Jaccard([b, c], [b]) = 1/2 + 1 exact -> 1.5;
    # 6 * 3.5 / 6 - 3 = 0.5.
    partial = [ToolCall("f", {"a": 2}), ToolCall("h", {"b": 2})]
    assert toolrl_correctness(partial, TOOLRL_GOLD) == pytest.approx(0.5)
    # Wrong tool: names Jaccard 0, nothing matches -> -3. No well-formed call at all: 0 (the
    # released code returns its initial score unmapped).
    assert toolrl_correctness([ToolCall("g", {"a": 1})], TOOLRL_GOLD) == -3.0
    assert toolrl_correctness([], TOOLRL_GOLD) == 0.0
    assert toolrl_correctness([CallError("tool call 1: empty body")], TOOLRL_GOLD) == 0.0
    # A repeated call: names Jaccard([f], [f, f]) = 1/2, f matched once (2): 6 * 2.5 / 3 - 3 = 2.
    assert toolrl_correctness([ToolCall("f", {"a": 1})] * 2, [[g("f", a=1)]]) == pytest.approx(2.0)
    # Names compare exactly here (case-sensitive); values with Python ==.
    assert toolrl_correctness([ToolCall("F", {"a": 1})], [[g("f", a=1)]]) == -3.0
    assert toolrl_correctness([ToolCall("f", {"a": True})], [[g("f", a=1)]]) == 3.0
    # Each gold call takes the best unused call of its name: the second f(a=1) gold gets f(a=5):
    # names 1 (equal lists); 2 + 1 -> 6 * 4 / 5 - 3 = 1.8.
    two = [[g("f", a=1)], [g("f", a=1)]]
    assert toolrl_correctness([ToolCall("f", {"a": 5}), ToolCall("f", {"a": 1})], two) == pytest.approx(1.8)


def test_toolrl_format_and_total():
    calls = [[ToolCall("f", {"a": 1})], [ToolCall("h", {"b": 2, "c": 3})], []]
    tagged = "<think>done</think><answer>x</answer>"
    assert toolrl_format(calls, tagged) == 1.0
    assert toolrl_reward(calls, tagged, TOOLRL_GOLD) == 4.0  # 1 + 3
    assert toolrl_reward(calls, tagged, TOOLRL_GOLD, with_format=False) == 3.0
    # Format 0: an untagged final answer, a tag only inside the think block, a malformed call,
    # a call-free turn before the last, no turns.
    assert toolrl_format(calls, "x") == 0.0
    assert toolrl_format(calls, "<think><answer>x</answer></think>x") == 0.0
    assert toolrl_format([[ToolCall("f", {"a": 1}), CallError("tool call 2: empty body")], []], tagged) == 0.0
    assert toolrl_format([[], [ToolCall("f", {"a": 1})]], "") == 0.0
    assert toolrl_format([], tagged) == 0.0
    # A trajectory cut by the turn budget after well-formed calls keeps its format point.
    assert toolrl_format([[ToolCall("f", {"a": 1})]], '<tool_call>...</tool_call>') == 1.0
    # Answering without any call: R_correct 0 + format 1.
    assert toolrl_reward([[]], "<answer>x</answer>", TOOLRL_GOLD) == 1.0


def test_toolrl_method_is_registered_with_its_reward():
    m = METHODS["toolrl"]
    assert (m.advantage, m.rewards, m.loss_terms) == ("grpo", ("toolrl",), ("clipped_surrogate",))
    reward = REWARDS["toolrl"]
    assert (reward.output, reward.per, reward.needs) == ("rewards", "trajectory", ("gold_calls",))
    task = types.SimpleNamespace(gold_calls=tuple(tuple(t) for t in TOOLRL_GOLD), answer="x")
    traj = _traj(([ToolCall("f", {"a": 2})], "", None), ([ToolCall("h", {"b": 2})], "", None),
                 ([], "<answer>x</answer>", "x"))
    assert reward.fn(traj, task, AlgoConfig()) == pytest.approx(1.5)  # format 1 + partial 0.5
    assert reward.fn(traj, task, AlgoConfig(toolrl_format=False)) == pytest.approx(0.5)
