"""ToolOmni (methods.toolomni): InfoRecall, AnswerTran, the format term and the multiplicative
retrieval reward equal hand-computed values; the estimator normalises the tool turns and the
answer turn apart and gates the answer stage on R_ret; the registered rewards on real trajectories
of the built-in tasks."""

from __future__ import annotations

import numpy as np
import pytest

from turnsight_jax.chat.types import CallError, ToolCall
from turnsight_jax.methods import toolomni
from turnsight_jax.rl.groups import group_normalize


def test_info_recall_answer_tran_and_format_hand_values():
    unsolved = {"capital_of": ["Paris"], "population_of": ["2.1 million", "2,100,000"]}
    # "Paris" and "2.1 million" appear (normalised: case and punctuation), "2,100,000" does not
    assert toolomni.info_recall(["The capital is PARIS.", "about 2.1 million people"], unsolved) == pytest.approx(2 / 3)
    assert toolomni.info_recall([], {}) == 1.0 and toolomni.info_recall([], unsolved) == 0.0
    # LCS of (a, b, c, d) and (a, c, d): 3, over max length 4
    assert toolomni.answer_tran(["a", "b", "c", "d"], ["a", "c", "d"]) == pytest.approx(0.75)
    assert toolomni.answer_tran(["c", "a"], ["a", "c"]) == pytest.approx(0.5)  # order matters
    assert toolomni.answer_tran([], []) == 1.0 and toolomni.answer_tran(["a"], []) == 0.0
    ok = [[ToolCall("f", {})], []]
    assert toolomni.well_formed(ok, "x") == 1.0
    assert toolomni.well_formed(ok, None) == 0.0  # no answer
    assert toolomni.well_formed([[CallError("bad")], []], "x") == 0.0  # a call that did not parse
    assert toolomni.well_formed([[ToolCall("f", {})]], "x") == 0.0  # the last turn is a call, not an answer


def test_retrieval_reward_is_multiplicative():
    gold_calls = (({"name": "capital_of", "arguments": {}},), ({"name": "population_of", "arguments": {}},))
    unsolved = {"capital_of": ["Paris"], "population_of": ["2.1 million"]}
    calls = [[ToolCall("capital_of", {})], [ToolCall("population_of", {})], []]
    full = toolomni.retrieval_parts(calls, ["Paris", "2.1 million"], "2.1 million", unsolved, gold_calls)
    assert full == {"info_recall": 1.0, "answer_tran": 1.0, "format": 1.0, "retrieval": pytest.approx(1.2)}
    half = toolomni.retrieval_parts(calls, ["Paris", "unknown"], "?", unsolved, gold_calls)
    assert half["retrieval"] == pytest.approx(0.5 * 1.0 + 0.2)
    # nothing retrieved: the main score is zero whatever the order, only the format term is left
    none = toolomni.retrieval_parts(calls, ["no", "no"], "?", unsolved, gold_calls)
    assert none["retrieval"] == pytest.approx(0.2)


def test_estimator_normalises_the_stages_apart_and_gates_the_answer():
    """Two groups of three. Tool-turn tokens: R_ret group-normalised; answer-turn tokens: the
    answer reward normalised over the group's members with R_ret >= 0.95 only; 0 for the rest."""
    r_ret = np.array([1.2, 1.0, 0.2, 1.2, 0.4, 0.2], np.float32)
    r_ans = np.array([1.0, 0.0, 1.0, 1.0, 0.5, 0.0], np.float32)
    groups = np.array([0, 0, 0, 1, 1, 1], np.int32)
    turn_ids = np.array([[0, 0, 1, 1, -1]] * 6, np.int32)  # turn 0 a tool turn, turn 1 the answer
    mask = turn_ids >= 0
    answer_turn = np.array([[0.0, 1.0]] * 6, np.float32)
    out = toolomni.toolomni_advantages(r_ret, r_ans, answer_turn, r_ret, r_ret, groups, mask, turn_ids, eps=1e-6,
                                       num_groups=2, toolomni_gate=0.95)
    adv = np.asarray(out["advantages"])
    a_ret = np.asarray(group_normalize(r_ret, groups, num_groups=2))
    np.testing.assert_allclose(adv[:, :2], np.repeat(a_ret[:, None], 2, axis=1), atol=1e-6)
    # group 0: rows 0 and 1 pass (1.2, 1.0 >= 0.95): answer rewards 1 and 0 -> +-1/sqrt(2)/std... =
    # (x - 0.5) / std(ddof=1) = +-0.7071; row 2 is gated out: 0
    np.testing.assert_allclose(adv[:3, 2:4], [[0.70710677] * 2, [-0.70710677] * 2, [0.0, 0.0]], atol=1e-5)
    # group 1: one passing member (row 3): no sibling to compare with -> 0; the others gated: 0
    np.testing.assert_allclose(adv[3:, 2:4], 0.0)
    assert np.all(adv[:, 4] == 0.0)
    assert float(out["toolomni/gate_pass_rate"]) == pytest.approx(0.5)
    assert float(out["toolomni/answer_reward_passed_mean"]) == pytest.approx((1.0 + 0.0 + 1.0) / 3)


def test_registered_rewards_on_builtin_trajectories(tok):
    from turnsight_jax.envs.ftrl import FTRLEnv
    from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
    from turnsight_jax.rl.batch import compute_signals
    from turnsight_jax.rl.config import AlgoConfig, StepConfig
    from turnsight_jax.rl.methods import resolve_method
    from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout

    task = generate_task("multi_hop", 7, SyntheticConfig(hops=2))
    gold = gold_turn_texts(task)
    skip_first = gold[1:]  # the second call first, without the first's result: less recall, other order
    no_tools = ["<answer>no idea</answer>"]
    with FTRLEnv(num_workers=1) as env:
        trajs = rollout(ReplayPolicy(tok, [gold, skip_first, no_tools]), env, [task], tokenizer=tok, group_size=3,
                        config=RolloutConfig(max_turns=5, max_response_tokens=2048)).trajectories
    cfg = StepConfig(algo=AlgoConfig(method="toolomni"), group_size=3, max_turns=5)
    sig = compute_signals(resolve_method(cfg), trajs, [task] * 3, cfg)
    np.testing.assert_allclose(sig["info_recall"][0], 1.0)
    np.testing.assert_allclose(sig["answer_tran"][0], 1.0)
    np.testing.assert_allclose(sig["retrieval_rewards"][0], 1.2, atol=1e-6)
    np.testing.assert_allclose(sig["answer_rewards"][0], 1.0)
    assert sig["retrieval_rewards"][1] < 1.2 and sig["answer_tran"][1] < 1.0
    np.testing.assert_allclose(sig["retrieval_rewards"][2], 0.2, atol=1e-6)  # no tools: InfoRecall 0, format 1
    n = [len(t.turns) for t in trajs]
    for i, t in enumerate(trajs):  # the answer turn flagged, the tool turns not
        np.testing.assert_array_equal(sig["answer_turn"][i, : n[i]], [0.0] * (n[i] - 1) + [1.0])
