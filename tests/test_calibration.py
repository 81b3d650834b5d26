"""Turn outcomes (rl.turn_outcomes) and the calibration report (python -m turnsight_jax.calibration)
on scripted trajectories and scripted teacher log-probs: outcomes, faults, metrics, ECE and the
gap-outcome correlation against hand-computed values."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax import calibration
from turnsight_jax.envs.faults import FaultConfig, FaultyEnv
from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts, tool_call_text
from turnsight_jax.rl import turn_outcomes
from turnsight_jax.rl.turn_records import turn_summaries
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout


def test_reliability_and_correlation_hand_computed():
    p = np.array([0.05, 0.15, 0.95, 0.85, 0.91])
    y = np.array([0, 1, 1, 0, 1])
    r = calibration.reliability(p, y, bins=2)
    # bin [0, .5): p 0.05, 0.15 (mean 0.1), y mean 0.5; bin [.5, 1]: p mean 0.9033, y mean 2/3
    np.testing.assert_allclose(r["conf"], [0.1, (0.95 + 0.85 + 0.91) / 3])
    np.testing.assert_allclose(r["acc"], [0.5, 2 / 3])
    assert r["ece"] == pytest.approx(2 / 5 * 0.4 + 3 / 5 * abs(2 / 3 - 2.71 / 3))
    x = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    rr, lo, hi, n = calibration.correlation(x, np.array([0, 0, 0, 1, 1, 1]))
    assert rr == pytest.approx(np.corrcoef(x, [0, 0, 0, 1, 1, 1])[0, 1]) and lo < rr < hi and n == 6
    assert math.tanh(math.atanh(rr) + 1.96 / math.sqrt(3)) == pytest.approx(hi)
    assert math.isnan(calibration.correlation(x, np.zeros(6))[0])  # a constant outcome: undefined


@pytest.fixture(scope="module")
def records(tok):
    """Two rollouts of a 2-hop task with every tool down on a call's first attempt (unavailable
    rate 1, one attempt): the gold chain with each call retried once, and the same after a wasted
    call to another tool; scripted teacher log-probs per token."""
    task = generate_task("multi_hop", 3, SyntheticConfig(hops=2))
    gold = gold_turn_texts(task)
    first = task.gold_calls[0][0]
    other = next(t["function"]["name"] for t in task.tools if t["function"]["name"] != first["name"])
    retried = [gold[0], gold[0], gold[1], gold[1], gold[2]]
    scripts = [retried, [tool_call_text(other, dict(first["arguments"]))] + retried]
    with FTRLEnv(num_workers=1) as inner:
        env = FaultyEnv(inner, FaultConfig(unavailable_rate=1.0), sleep=lambda s: None)
        trajs = rollout(ReplayPolicy(tok, scripts), env, [task], tokenizer=tok, group_size=2,
                        config=RolloutConfig(max_turns=6, max_response_tokens=4096)).trajectories
    k = 6
    n = max(int(t.policy_mask.sum()) for t in trajs)
    teacher = np.zeros((2, 2, n), np.float32)
    turn_ids, mask = np.full((2, n), -1, np.int32), np.zeros((2, n), bool)
    for b, t in enumerate(trajs):
        m = int(t.policy_mask.sum())
        teacher[0, b, :m] = t.old_logprobs[t.policy_mask] + 0.5  # depth 1: +0.5 nats on every token
        teacher[1, b, :m] = t.old_logprobs[t.policy_mask] - 0.25 * np.arange(m) / m
        turn_ids[b, :m], mask[b, :m] = t.turn_ids[t.policy_mask], True
    # the step's per-token outputs, summarised per turn as the step does (rl.turn_records); turn k of
    # row b gets advantage 10 b + k, weight 1.25, depth index 1 (depth 2 of (1, 2))
    per_token = {"adv": (10.0 * np.arange(2)[:, None] + np.maximum(turn_ids, 0)).astype(np.float32),
                 "weight": np.full((2, n), 1.25, np.float32), "depth": np.ones((2, n), np.int32)}
    summaries = jax.tree.map(np.asarray, {"turns": turn_summaries(per_token, jnp.asarray(turn_ids), jnp.asarray(mask), k),
                                          "teacher_logprobs": teacher})
    # batch order reversed: batch row 0 holds trajectory 1
    summaries = jax.tree.map(lambda v: v[:, ::-1] if v.ndim == 3 else v[::-1], summaries)
    rec = turn_outcomes.step_records(trajs, [task, task], summaries, [1, 0], k, depths=(1, 2),
                                     views=["depth 1", "depth 2"])
    return task, trajs, rec


def test_turn_outcomes_and_metrics(records):
    task, trajs, rec = records
    # rollout 0: each hop's first attempt unavailable (an error), its retry ran; then the answer
    assert rec["num_turns"].tolist() == [5, 6]
    assert rec["has_calls"][0].tolist() == [True, True, True, True, False, False]
    assert rec["errored"][0].tolist() == [True, False, True, False, False, False]
    assert rec["fault_unavailable"][0].tolist() == rec["errored"][0].tolist() == rec["faulted"][0].tolist()
    assert rec["gold_match"][0].tolist() == [True, True, True, True, False, False]
    assert rec["gold_turn"][0].tolist() == [0, 0, 1, 1, -1, -1] and rec["gold_horizon"][0, :4].tolist() == [2, 2, 1, 1]
    # an unavailable result offers nothing: the outage starts no chain; the retry's result is used
    # by hop 2's attempt and by its retry
    assert rec["horizon"][0].tolist() == [1, 3, 1, 1, 1, -1]
    # rollout 1: a wasted call to another tool first (down too), then the same
    assert rec["gold_match"][1].tolist() == [False, True, True, True, True, False]
    assert rec["faulted"][1].tolist() == [True, True, False, True, False, False]
    assert rec["episode_faulted"].tolist() == [True, True] and rec["success"].tolist() == [True, True]
    # the step's arrays come back in trajectory order, per turn
    assert rec["step_advantage"][0, :5].tolist() == [0, 1, 2, 3, 4] and rec["step_advantage"][1, :6].tolist() == [
        10, 11, 12, 13, 14, 15]
    assert rec["step_depth"][0].tolist() == [2, 2, 2, 2, 2, -1]  # depth 2; -1 past the turns
    assert rec["token_views"].tolist() == ["depth 1", "depth 2"]
    np.testing.assert_allclose(rec["token_teacher"][0] - rec["token_student"], 0.5, atol=1e-6)
    assert rec["token_row"].tolist() == sorted(rec["token_row"].tolist())
    sums = turn_outcomes.metric_sums(rec, (1, 2))
    m = turn_outcomes.ratios(sums)
    tool = rec["has_calls"]
    assert m["faults/faulted_turns"] == pytest.approx((rec["faulted"] & tool).sum() / tool.sum())
    assert sums["credit/weight_faulted"] == (1.25 * 5, 5.0) and m["horizon/depth_mean"] == 2.0
    assert m["recovery/success_faulted"] == 1.0 and "recovery/success_clean" not in m  # no clean episode
    # gold turns: depth 2 covers a gold horizon of 2 and not one of 1
    known = tool & (rec["gold_horizon"] >= 1)
    assert m["horizon/depth_covers_gold"] == pytest.approx((known & (rec["gold_horizon"] == 2)).sum() / known.sum())


def test_calibration_report_on_a_run_folder(records, tmp_path):
    _, trajs, rec = records
    turn_outcomes.write(tmp_path, 1, rec)
    turn_outcomes.write(tmp_path, 2, rec)
    assert calibration.main([str(tmp_path), "--bins", "5"]) == 0
    out = tmp_path / "calibration"
    assert (out / "reliability.png").stat().st_size > 10_000
    table = (out / "calibration.md").read_text()
    assert "| student |" in table and "| depth 1 |" in table and "| depth 2 |" in table
    res = calibration.report(tmp_path, tmp_path / "again", bins=5)
    d1 = next(r for r in res["rows"] if r["view"] == "depth 1")
    assert d1["gap_mean"] == pytest.approx(0.5, abs=1e-6)  # the scripted +0.5 nats
    assert res["tool_turns"] == 2 * int(rec["has_calls"].sum())
    # the gap of depth 2 falls with the turn's length: its correlation with the outcome, by hand
    gap = np.concatenate([_turn_gaps(rec, 1)] * 2)
    y = np.concatenate([rec["errored"][rec["has_calls"]]] * 2)
    assert next(r for r in res["rows"] if r["view"] == "depth 2")["r_errored"][0] == pytest.approx(
        np.corrcoef(gap, y)[0, 1], abs=1e-6)
    assert calibration.main([str(tmp_path / "nothing")]) == 2


def _turn_gaps(rec, view: int) -> np.ndarray:
    """Mean teacher - student log-prob of each tool turn, in (row, turn) order."""
    out = []
    for b in range(rec["has_calls"].shape[0]):
        for k in np.flatnonzero(rec["has_calls"][b]):
            at = (rec["token_row"] == b) & (rec["token_turn"] == k)
            out.append(float((rec["token_teacher"][view, at] - rec["token_student"][at]).mean()))
    return np.asarray(out)
