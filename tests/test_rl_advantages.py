"""Hand-computed examples for GRPO, MatchTIR and TurnSight, plus guards, registry and edge cases.

Every expected number below is worked out by hand in the comments from docs/spec.md §1; none comes from
running the implementation.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.rl import advantages as A
from turnsight_jax.rl.advantages import (
    grpo_advantages,
    matchtir_advantage_parts,
    matchtir_advantages,
    turnsight_advantages,
)

EPS = 1e-6
X = np.nan  # off-policy garbage: must never leak into any output


# ------------------------------------------------------------------------------------------------
# GRPO
# ------------------------------------------------------------------------------------------------


def test_grpo_hand_example():
    # group 0: r = (1, 0): mean 0.5, sample std sqrt(0.5) → ±0.5 / (sqrt(0.5) + eps)
    # group 1: r = (0.5, 0.5): σ = 0 → 0 exactly (not 0/eps round-off)
    # group 2: r = (0, 1, 2): mean 1, sample std 1 → (−1, 0, 1) / (1 + eps)
    # group 5 (ids need not be contiguous): one member → 0 (ddof=1 std undefined)
    rewards = np.array([1, 0, 0.5, 0.5, 0, 1, 2, 0.3], np.float32)
    gids = np.array([0, 0, 1, 1, 2, 2, 2, 5], np.int32)
    pm = np.array([[1, 1, 0], [1, 0, 1], [1, 1, 1], [0, 1, 1],
                   [1, 0, 0], [1, 1, 0], [0, 0, 1], [1, 1, 1]], bool)
    adv = np.asarray(grpo_advantages(rewards, gids, pm, num_groups=6))
    a = 0.5 / (math.sqrt(0.5) + EPS)
    per_traj = np.array([a, -a, 0, 0, -1 / (1 + EPS), 0, 1 / (1 + EPS), 0])
    np.testing.assert_allclose(adv, per_traj[:, None] * pm, rtol=1e-6, atol=1e-7)
    assert np.all(adv[2:4] == 0) and np.all(adv[~pm] == 0)


def test_grpo_ids_outside_num_groups_are_ungrouped():
    rewards = np.array([1, 0, 1, 0], np.float32)
    gids = np.array([0, 0, -1, 4], np.int32)  # −1 and 4 ∉ [0, 4)
    adv = np.asarray(grpo_advantages(rewards, gids, np.ones((4, 2), bool), num_groups=4))
    a = 0.5 / (math.sqrt(0.5) + EPS)
    np.testing.assert_allclose(adv[:, 0], [a, -a, 0, 0], rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# MatchTIR
# ------------------------------------------------------------------------------------------------


def test_matchtir_hand_example():
    r = np.array([[1, 0.5, 0], [0.5, 0, 0], [0, 1, 0], [1, 0, 0.7], [0.2, 0, 0]], np.float32)
    n = np.array([2, 1, 3, 2, 0], np.int32)  # traj3's 0.7 sits beyond its 2 turns: ignored
    gids = np.array([0, 0, 1, 1, 1], np.int32)
    tid = np.array([[0, 0, 1, -1], [0, -1, 1, -1], [0, 1, 2, -1], [0, 1, 1, -1], [0, -1, -1, -1]],
                   np.int32)
    pm = tid >= 0
    out = jax.device_get(matchtir_advantage_parts(r, n, tid, pm, gids, num_groups=2))
    chex.assert_tree_all_finite(out)

    # Discounted returns, γ = 0.9: G = Σ_{j≥k} γ^{j−k} r_j over real turns.
    want_g = np.array([[1 + 0.9 * 0.5, 0.5, 0], [0.5, 0, 0], [0.9, 1, 0], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_allclose(out["returns"], want_g, rtol=1e-6)

    # Trajectory level. Group 0 totals (1.5, 0.5): ±0.5/(sqrt(0.5)+eps).
    # Group 1 totals (1, 1, 0): mean 2/3, sample var ((1/3)²·2 + (2/3)²)/2 = 1/3.
    a0 = 0.5 / (math.sqrt(0.5) + EPS)
    s1 = math.sqrt(1 / 3)
    want_traj = [a0, -a0, (1 / 3) / (s1 + EPS), (1 / 3) / (s1 + EPS), (-2 / 3) / (s1 + EPS)]
    np.testing.assert_allclose(out["trajectory_advantages"], want_traj, rtol=1e-5)

    # Turn level, across the siblings that reach turn k:
    #   g0 k0: (1.45, 0.5) → ±0.475/(0.95/sqrt2 + eps);  g0 k1: only traj0 → 0.
    #   g1 k0: traj2, traj3 reach (traj4 has 0 turns): (0.9, 1) → ∓0.05/(0.1/sqrt2 + eps)
    #   g1 k1: (1, 0) → ±0.5/(1/sqrt2 + eps);  g1 k2: only traj2 → 0.
    t00 = 0.475 / (0.95 / math.sqrt(2) + EPS)
    t10 = 0.05 / (0.1 / math.sqrt(2) + EPS)
    t11 = 0.5 / (1 / math.sqrt(2) + EPS)
    want_turn = np.array([[t00, 0, 0], [-t00, 0, 0], [-t10, t11, 0], [t10, -t11, 0], [0, 0, 0]])
    np.testing.assert_allclose(out["turn_advantages"], want_turn, rtol=1e-5, atol=1e-7)

    # Tokens: (A_traj + A_turn[k]) / 2 on real turns; 0 on traj1's turn-1 token (n = 1), on traj4
    # (no real turns) and off policy.
    tr = want_traj
    want_tok = np.array([
        [(tr[0] + t00) / 2, (tr[0] + t00) / 2, tr[0] / 2, 0],
        [(tr[1] - t00) / 2, 0, 0, 0],
        [(tr[2] - t10) / 2, (tr[2] + t11) / 2, tr[2] / 2, 0],
        [(tr[3] + t10) / 2, (tr[3] - t11) / 2, (tr[3] - t11) / 2, 0],
        [0, 0, 0, 0],
    ])
    np.testing.assert_allclose(out["advantages"], want_tok, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(
        np.asarray(matchtir_advantages(r, n, tid, pm, gids, num_groups=2)), out["advantages"])


def test_matchtir_singleton_pools_zero_and_raw():
    # Group 0 = rows 0, 1; group 1 = row 2 alone. γ = 0.9.
    #   row 0: r = (1, 0.5), 2 turns -> total 1.5, G = (1 + 0.9 * 0.5, 0.5) = (1.45, 0.5)
    #   row 1: r = (0.5, ·), 1 turn  -> total 0.5, G = (0.5, 0)
    #   row 2: r = (0.8, 0.2), 2 turns -> total 1.0, G = (0.8 + 0.9 * 0.2, 0.2) = (0.98, 0.2)
    # Pools of one: group 1 (trajectory level), (g0, turn 1) reached by row 0 only, (g1, turn 0)
    # and (g1, turn 1). "zero": advantage 0; "raw": mean 0, std 1 -> value / (1 + eps).
    # Pools of two are the same for both: group 0 totals (1.5, 0.5) -> ±0.5 / (sqrt(0.5) + eps);
    # (g0, turn 0) returns (1.45, 0.5) -> ±0.475 / (0.95 / sqrt(2) + eps).
    r = np.array([[1, 0.5], [0.5, 0.9], [0.8, 0.2]], np.float32)  # row 1's 0.9 lies beyond its turn
    n = np.array([2, 1, 2], np.int32)
    gids = np.array([0, 0, 1], np.int32)
    tid = np.array([[0, 1, -1], [0, -1, -1], [0, 0, 1]], np.int32)
    pm = tid >= 0
    a = 0.5 / (math.sqrt(0.5) + EPS)
    t = 0.475 / (0.95 / math.sqrt(2) + EPS)
    zero = jax.device_get(matchtir_advantage_parts(r, n, tid, pm, gids, num_groups=2))
    raw = jax.device_get(matchtir_advantage_parts(r, n, tid, pm, gids, num_groups=2, singleton="raw"))
    np.testing.assert_allclose(zero["trajectory_advantages"], [a, -a, 0.0], rtol=1e-5)
    np.testing.assert_allclose(raw["trajectory_advantages"], [a, -a, 1.0 / (1 + EPS)], rtol=1e-5)
    np.testing.assert_allclose(zero["turn_advantages"], [[t, 0.0], [-t, 0.0], [0.0, 0.0]], rtol=1e-5)
    np.testing.assert_allclose(raw["turn_advantages"],
                               [[t, 0.5 / (1 + EPS)], [-t, 0.0], [0.98 / (1 + EPS), 0.2 / (1 + EPS)]], rtol=1e-5)
    # Tokens: (A_traj + A_turn[k]) / 2 on real turns.
    np.testing.assert_allclose(zero["advantages"], [[(a + t) / 2, a / 2, 0], [(-a - t) / 2, 0, 0], [0, 0, 0]],
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(raw["advantages"], [[(a + t) / 2, (a + 0.5) / 2, 0], [(-a - t) / 2, 0, 0],
                                                   [(1 + 0.98) / 2, (1 + 0.98) / 2, (1 + 0.2) / 2]],
                               rtol=1e-5, atol=1e-7)
    # Through the registry, as the step calls it (the knob is the AlgoConfig field's name).
    knobs = {"eps": EPS, "gamma": 0.9, "num_groups": 2, "matchtir_singleton": "raw"}
    out = A.make_advantage_fn("matchtir", knobs=knobs)({"turn_rewards": r, "num_turns": n, "turn_ids": tid,
                                                       "policy_mask": pm, "group_ids": gids})
    np.testing.assert_array_equal(out["advantages"], raw["advantages"])
    with pytest.raises(ValueError, match=r"singleton must be one of \('zero', 'raw'\), got 'one'"):
        matchtir_advantage_parts(r, n, tid, pm, gids, num_groups=2, singleton="one")


def test_matchtir_gamma_is_a_knob():
    r = np.array([[1, 1, 1]], np.float32)
    g = A.discounted_returns(r, np.array([3], np.int32), gamma=0.5)
    np.testing.assert_allclose(g, [[1.75, 1.5, 1.0]])


# ------------------------------------------------------------------------------------------------
# TurnSight: one hand example through every step
# ------------------------------------------------------------------------------------------------
#
# D = 3, B = 4, T = 5, groups (0, 0, 1, 1). Units (trajectory, turn), their policy positions and
# per-depth turn means δ̄ = (d0, d1, d2):
#   u0 traj0 turn0 @ {0, 1}: d0 (1,3)→2,  d1 (0,2)→1,   d2 (−2,−2)→−2   signs ++− → v=+, d*=0, δ̄*=2
#   u1 traj0 turn1 @ {3, 4}: d0 (−1,−1)→−1, d1 (1,3)→2, d2 (−3,1)→−1    signs −+− → v=−, |−1|=|−1|
#                                                                     → lowest index d*=0, δ̄*=−1
#   u2 traj1 turn0 @ {0, 1}: d0 (−1,1)→0, d1 (−1,−1)→−1, d2 (0,−1)→−0.5 0 counts as + → +−− → v=−,
#                                                                     d*=1, δ̄*=−1
#   u3 traj2 turn0 @ {0..3}: d0 (0,2,1,1)→1, d1 0.5, d2 0.25           all + (agree) → d*=0, δ̄*=1
#   u4 traj3 turn1 @ {2}   : d0 −4, d1 −3, d2 5 (turn 0 is empty)     −−+ → v=−, d*=0, δ̄*=−4
# Group 0 tokens: 2,2,−1,−1,−1,−1 → μ=0, σ²=12/6=2.
# Group 1 tokens: 1,1,1,1,−4 → μ=0, σ²=(4+16)/5=4 (turn-weighted would give μ=−1.5, σ=2.5).
# Base: GRPO on rewards (1, 0, 0, 1) → (+a, −a, −a, +a), a = 0.5/(sqrt(0.5)+eps).

DELTA = np.array([
    [[1, 3, X, -1, -1], [-1, 1, X, X, X], [0, 2, 1, 1, X], [X, X, -4, X, X]],
    [[0, 2, X, 1, 3], [-1, -1, X, X, X], [0.5, 0.5, 0.5, 0.5, X], [X, X, -3, X, X]],
    [[-2, -2, X, -3, 1], [0, -1, X, X, X], [0.25, 0.25, 0.25, 0.25, X], [X, X, 5, X, X]],
], np.float32)
TURN_IDS = np.array([[0, 0, -1, 1, 1], [0, 0, -1, -1, -1], [0, 0, 0, 0, -1], [-1, -1, 1, -1, -1]],
                    np.int32)
POLICY = TURN_IDS >= 0
GIDS = np.array([0, 0, 1, 1], np.int32)
A_BASE = 0.5 / (math.sqrt(0.5) + EPS)
BASE = (np.array([1, -1, -1, 1])[:, None] * A_BASE * POLICY).astype(np.float32)
UNIT = np.array([[0, 0, -1, 1, 1], [2, 2, -1, -1, -1], [3, 3, 3, 3, -1], [-1, -1, 4, -1, -1]])


def per_token(unit_values, fill=0.0):
    """Spread one value per unit u0..u4 over that unit's policy tokens."""
    vals = np.asarray(unit_values, np.float64)
    return np.where(UNIT >= 0, vals[np.maximum(UNIT, 0)], fill)


def ts(**kwargs):
    out = jax.device_get(turnsight_advantages(DELTA, POLICY, TURN_IDS, GIDS, BASE, **kwargs))
    chex.assert_tree_all_finite(out)
    return out


def expected_weights(d_hat_units, signs=(1, 1, -1, -1, 1), eps_w=0.5):
    return [1 + eps_w * math.tanh(s * h) for s, h in zip(signs, d_hat_units)]


def test_turnsight_hand_example_default_modes():
    out = ts(num_groups=2, max_turns=2)
    # Step 5: selection.
    np.testing.assert_array_equal(out["selected_depth"], per_token([0, 0, 1, 0, 0], fill=-1))
    np.testing.assert_allclose(out["delta_bar"], per_token([2, -1, -1, 1, -4]))
    # Step 6: token-weighted group statistics.
    np.testing.assert_allclose(out["group_mean"], [0, 0], atol=1e-7)
    np.testing.assert_allclose(out["group_std"], [math.sqrt(2), 2], rtol=1e-6)
    r2 = math.sqrt(2) + EPS
    d_hat = [2 / r2, -1 / r2, -1 / r2, 1 / (2 + EPS), -4 / (2 + EPS)]
    np.testing.assert_allclose(out["delta_hat"], per_token(d_hat), rtol=1e-6)
    # Step 7: w = 1 + 0.5·tanh(sign(A)·δ̂); signs of A per unit: traj0 +, traj1 −, traj2 −, traj3 +.
    w = expected_weights(d_hat)
    # tanh(√2)=0.88839, tanh(1/√2)=0.60886, tanh(.5)=0.46212, tanh(2)=0.96403
    np.testing.assert_allclose(w, [1.444193, 0.695571, 1.304429, 0.768941, 0.517986], atol=1e-6)
    np.testing.assert_allclose(out["weights"], per_token(w, fill=1.0), rtol=1e-6)
    # Step 8: Ã = A·(0.5 + 0.5·w).
    np.testing.assert_allclose(out["advantages"], BASE * (0.5 + 0.5 * out["weights"]), rtol=1e-6)
    np.testing.assert_allclose(out["advantages"][0, 0], A_BASE * (0.5 + 0.5 * 1.444193), rtol=1e-6)
    # Diagnostics: 1 of 5 turns agrees (u3); d* histogram (4, 1, 0); 11 policy tokens.
    assert float(out["agreement_rate"]) == pytest.approx(0.2)
    np.testing.assert_array_equal(out["depth_histogram"], [4, 1, 0])
    assert int(out["num_units"]) == 5 and int(out["num_unassigned_policy_tokens"]) == 0
    assert float(out["weight_mean"]) == pytest.approx(
        (2 * w[0] + 2 * w[1] + 2 * w[2] + 4 * w[3] + w[4]) / 11, rel=1e-6)
    assert float(out["weight_min"]) == pytest.approx(w[4], rel=1e-6)
    assert float(out["weight_max"]) == pytest.approx(w[0], rel=1e-6)
    assert float(out["frac_turns_amplified"]) == pytest.approx(2 / 5)  # u0, u2
    assert float(out["frac_turns_damped"]) == pytest.approx(3 / 5)  # u1, u3, u4


def test_turnsight_default_bounds_match_explicit_ones():
    """num_groups=None → B and max_turns=None → T give the same numbers as tight bounds."""
    out, ref = ts(), ts(num_groups=2, max_turns=2)
    for key in ("advantages", "weights", "selected_depth", "delta_bar", "delta_hat"):
        np.testing.assert_array_equal(out[key], ref[key], err_msg=key)
    np.testing.assert_allclose(out["group_std"][:2], ref["group_std"])
    assert out["group_std"].shape == (4,)


def test_turnsight_hand_example_fusion_and_fixed_depth():
    # mean: δ̄* = depth average of each unit's turn means, d* = −1, empty histogram.
    mean_units = [(2 + 1 - 2) / 3, (-1 + 2 - 1) / 3, (0 - 1 - 0.5) / 3, 1.75 / 3, (-4 - 3 + 5) / 3]
    out = ts(selection="mean")
    np.testing.assert_allclose(out["delta_bar"], per_token(mean_units), atol=1e-7)
    np.testing.assert_array_equal(out["selected_depth"], -np.ones((4, 5)))
    np.testing.assert_array_equal(out["depth_histogram"], [0, 0, 0])
    # group 0 tokens 1/3,1/3,0,0,−.5,−.5: μ = −1/18; group 1: 7/12 ×4, −2/3 → μ = (7/3 − 2/3)/5 = 1/3
    np.testing.assert_allclose(out["group_mean"][:2], [-1 / 18, 1 / 3], rtol=1e-6)
    # selection=2 uses depth 2's turn means: (−2, −1, −0.5, 0.25, 5).
    out = ts(selection=2)
    np.testing.assert_allclose(out["delta_bar"], per_token([-2, -1, -0.5, 0.25, 5]))
    np.testing.assert_array_equal(out["selected_depth"], per_token([2] * 5, fill=-1))
    np.testing.assert_array_equal(out["depth_histogram"], [0, 0, 5])


def test_turnsight_hand_example_without_group_norm():
    out = ts(group_norm=False)
    np.testing.assert_allclose(out["delta_hat"], per_token([2, -1, -1, 1, -4]))
    w = expected_weights([2, -1, -1, 1, -4])
    np.testing.assert_allclose(out["weights"], per_token(w, fill=1.0), rtol=1e-6)


def test_turnsight_hand_example_turn_coverage():
    full = ts()
    # first:1 → turns with id ≥ 1 (u1, u4) get w = 1; the rest keep their weight. Statistics are
    # unchanged (coverage only masks the weight).
    out = ts(turns="first:1")
    keep = per_token([1, 0, 1, 1, 0]).astype(bool)
    np.testing.assert_array_equal(out["weights"], np.where(keep, full["weights"], 1.0))
    np.testing.assert_array_equal(out["delta_hat"], full["delta_hat"])
    # last:1 is relative to each trajectory's own turn count n = 1 + max turn id:
    # traj0 n=2 → only turn 1 (u1); traj1 n=1 → turn 0 (u2); traj2 → u3; traj3 n=2 → turn 1 (u4).
    out = ts(turns="last:1")
    keep = per_token([0, 1, 1, 1, 1]).astype(bool)
    np.testing.assert_array_equal(out["weights"], np.where(keep, full["weights"], 1.0))
    np.testing.assert_array_equal(out["advantages"][0, :2], BASE[0, :2])  # w = 1 ⇒ Ã = A exactly


def test_turnsight_hand_example_token_aggregation():
    out = ts(aggregation="token")
    # Per token (d0, d1, d2) → vote:
    #   traj0 @0 (1,0,−2) ++− → d0 → 1;  @1 (3,2,−2) → d0 → 3;  @3 (−1,1,−3) −+− → d2 → −3;
    #   @4 (−1,3,1) −++ → d1 → 3;  traj1 @0 (−1,−1,0) −−+ → tie |−1| → d0 → −1;
    #   @1 (1,−1,−1) +−− → tie → d1 → −1;  traj2 all + → @0 (0,.5,.25) → d1 → 0.5, then d0 → 2,1,1;
    #   traj3 @2 → d0 → −4.
    want_d = np.array([[0, 0, -1, 2, 1], [0, 1, -1, -1, -1], [1, 0, 0, 0, -1], [-1, -1, 0, -1, -1]])
    want_x = np.array([[1, 3, 0, -3, 3], [-1, -1, 0, 0, 0], [0.5, 2, 1, 1, 0], [0, 0, -4, 0, 0]])
    np.testing.assert_array_equal(out["selected_depth"], want_d)
    np.testing.assert_allclose(out["delta_bar"], want_x)
    # Group 0 tokens 1,3,−3,3,−1,−1: μ = 1/3, σ² = 30/6 − 1/9 = 44/9.
    # Group 1 tokens .5,2,1,1,−4: μ = 0.1, σ² = 22.25/5 − 0.01 = 4.44.
    np.testing.assert_allclose(out["group_mean"], [1 / 3, 0.1, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(out["group_std"], [math.sqrt(44) / 3, math.sqrt(4.44), 0, 0], rtol=1e-6)
    # Agreement per token: only traj2's four tokens (all +) → 4/11; histogram over 11 tokens.
    assert float(out["agreement_rate"]) == pytest.approx(4 / 11)
    np.testing.assert_array_equal(out["depth_histogram"], [7, 3, 1])
    np.testing.assert_allclose(
        out["delta_hat"][0, 1], (3 - 1 / 3) / (math.sqrt(44) / 3 + EPS), rtol=1e-6)


def test_group_statistics_are_token_weighted_not_turn_weighted():
    """Group 1 holds a 4-token turn at δ̄* = 1 and a 1-token turn at −4. Token weighting gives
    μ = 0, σ = 2 → δ̂ = (0.5, −2); turn weighting would give μ = −1.5, σ = 2.5 → (1, −1)."""
    out = ts(num_groups=2)
    assert float(out["group_mean"][1]) == pytest.approx(0.0, abs=1e-7)
    assert float(out["group_std"][1]) == pytest.approx(2.0)
    np.testing.assert_allclose(out["delta_hat"][2, 0], 0.5, rtol=1e-6)
    np.testing.assert_allclose(out["delta_hat"][3, 2], -2.0, rtol=1e-6)


def test_lambda_zero_and_zero_base_advantage():
    out = ts(lam=0.0)
    np.testing.assert_array_equal(out["advantages"], BASE)
    zero = BASE.copy()
    zero[0, :2] = 0.0  # sign(A) = 0 → tanh(0) = 0 → w = 1, Ã = 0
    out = jax.device_get(turnsight_advantages(DELTA, POLICY, TURN_IDS, GIDS, zero))
    assert np.all(out["weights"][0, :2] == 1.0) and np.all(out["advantages"][0, :2] == 0.0)


# ------------------------------------------------------------------------------------------------
# Vote tie rule (even D): the split goes to the sign of the depth sum, Σ ≥ 0 → +
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("values, expected", [
    ([0.5, -0.25, 0.1], 0),             # majority +, largest + is depth 0
    ([-0.5, -0.75, 2.0], 1),            # majority −: |−0.75| wins although |2.0| is larger
    ([0.25, -0.75], 1),                 # 1:1 tie, Σ = −0.5 → − → depth 1
    ([0.75, -0.25], 0),                 # 1:1 tie, Σ = +0.5 → + → depth 0
    ([0.5, -0.5], 0),                   # 1:1 tie, Σ = 0 → ≥ 0 → +
    ([0.5, 0.25, -0.5, -0.5], 2),       # 2:2 tie, Σ = −0.25 → −; equal |−0.5| → lowest index
    ([1.0, 0.5, -0.25, -1.0], 0),       # 2:2 tie, Σ = +0.25 → +
    ([0.0, -0.0, -1.0], 0),             # 0 and −0 count as +: + wins 2:1, equal |0| → depth 0
    ([0.3, 0.3, -1.0], 0),              # equal magnitudes among the majority → lowest index
])
@pytest.mark.parametrize("aggregation", ["turn", "token"])
def test_vote_tie_rule(values, expected, aggregation):
    d = np.array(values, np.float32)[:, None, None]
    out = turnsight_advantages(d, np.ones((1, 1), bool), np.zeros((1, 1), np.int32),
                               np.zeros((1,), np.int32), np.ones((1, 1), np.float32),
                               aggregation=aggregation)
    assert int(out["selected_depth"][0, 0]) == expected
    assert float(out["delta_bar"][0, 0]) == np.float32(values[expected])


# ------------------------------------------------------------------------------------------------
# Degenerate batches
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["turn", "token"])
@pytest.mark.parametrize("selection", ["vote", "mean", 1])
def test_degenerate_batches_are_finite(aggregation, selection):
    kw = dict(aggregation=aggregation, selection=selection, num_groups=3, max_turns=4)
    d = np.full((3, 3, 4), 0.7, np.float32)  # σ = 0 in every group
    tid = np.array([[0, 3, 3, -1], [-1, -1, -1, -1], [5, 0, 0, -1]], np.int32)  # empty turns 1, 2
    pm = tid != -1  # traj1 has no policy tokens; traj2 @0 has turn id 5 ≥ max_turns: unassigned
    gids = np.array([0, 0, 2], np.int32)  # traj2 alone in its group; group 1 empty
    base = np.where(pm, 1.5, 0).astype(np.float32)
    out = jax.device_get(turnsight_advantages(d, pm, tid, gids, base, **kw))
    chex.assert_tree_all_finite(out)
    assert np.all(out["weights"] == 1.0)  # σ = 0 ⇒ δ̂ = 0 exactly
    np.testing.assert_array_equal(out["advantages"], base)
    assert int(out["num_unassigned_policy_tokens"]) == 1 and out["selected_depth"][2, 0] == -1
    # Nothing at all on policy: neutral diagnostics, zero advantages.
    none = np.zeros_like(pm)
    out = jax.device_get(turnsight_advantages(d, none, tid * 0 - 1, gids, base * 0, **kw))
    chex.assert_tree_all_finite(out)
    assert np.all(out["advantages"] == 0) and np.all(out["weights"] == 1)
    assert float(out["weight_mean"]) == 1 and float(out["agreement_rate"]) == 0
    assert float(out["frac_turns_amplified"]) == 0 and int(out["num_units"]) == 0


def test_ungrouped_trajectories_get_unit_weight():
    gids = np.array([0, 0, 7, -1], np.int32)  # traj2, traj3 outside [0, 2)
    out = jax.device_get(turnsight_advantages(DELTA, POLICY, TURN_IDS, gids, BASE, num_groups=2))
    chex.assert_tree_all_finite(out)
    assert np.all(out["weights"][2:] == 1) and np.all(out["delta_hat"][2:] == 0)


# ------------------------------------------------------------------------------------------------
# Guards, jit, gradients, registry
# ------------------------------------------------------------------------------------------------


def test_shape_rank_and_type_guards():
    with pytest.raises(AssertionError):  # chex.assert_shape: turn_ids [B, T+1]
        turnsight_advantages(DELTA, POLICY, np.zeros((4, 6), np.int32), GIDS, BASE)
    with pytest.raises(AssertionError):  # chex.assert_rank: delta without the depth axis
        turnsight_advantages(DELTA[0], POLICY, TURN_IDS, GIDS, BASE)
    with pytest.raises(AssertionError):  # chex.assert_type: float policy mask
        turnsight_advantages(DELTA, POLICY.astype(np.float32), TURN_IDS, GIDS, BASE)
    with pytest.raises(AssertionError):
        grpo_advantages(np.zeros(3, np.float32), GIDS, POLICY)
    with pytest.raises(AssertionError):
        matchtir_advantages(np.zeros((4, 2), np.float32), np.zeros(4, np.int32),
                            TURN_IDS[:, :3], POLICY, GIDS)


@pytest.mark.parametrize("kwargs", [
    dict(selection=3), dict(selection=-1), dict(selection=True), dict(selection="max"),
    dict(aggregation="trajectory"), dict(turns="first:0"), dict(turns="middle:2"),
    dict(turns="last"), dict(max_turns=0), dict(group_norm=1),
])
def test_invalid_modes_raise(kwargs):
    with pytest.raises(ValueError):
        turnsight_advantages(DELTA, POLICY, TURN_IDS, GIDS, BASE, **kwargs)


def test_jit_with_traced_knobs_and_stop_gradient():
    @jax.jit
    def f(delta, lam, eps_w):
        return turnsight_advantages(delta, POLICY, TURN_IDS, GIDS, BASE, lam=lam, eps_w=eps_w,
                                    selection=0, turns="last:1")["advantages"]

    eager = turnsight_advantages(DELTA, POLICY, TURN_IDS, GIDS, BASE, lam=0.3, eps_w=0.2,
                                 selection=0, turns="last:1")["advantages"]
    np.testing.assert_allclose(f(DELTA, 0.3, 0.2), eager, rtol=1e-6)
    # δ is outside the gradient (docs/spec.md §1.3).
    clean = np.nan_to_num(DELTA)
    grad = jax.grad(lambda d: f(d, 0.5, 0.5).sum())(jnp.asarray(clean))
    assert np.all(np.asarray(grad) == 0)


def test_registry_and_make_advantage_fn():
    assert {"grpo", "matchtir", "turnsight"} <= set(A.ESTIMATORS)
    assert A.get_estimator("turnsight").wraps_base and A.get_estimator("turnsight").needs_views
    rewards = np.array([1, 0, 0, 1], np.float32)
    batch = {"rewards": rewards, "group_ids": GIDS, "policy_mask": POLICY, "turn_ids": TURN_IDS,
             "delta": DELTA}
    knobs = {"eps": 1e-6, "gamma": 0.9, "num_groups": None, "max_turns": None, "lam": 0.25, "eps_w": 0.5,
             "selection": "mean", "aggregation": "turn", "group_norm": True, "turns": "all",
             "matchtir_singleton": "zero", "norm_pool": "turn_mean", "uncovered_in_stats": True,
             "empty_block_turns": "weighted", "depths": (1, 2, 3),
             "horizon_tol": 0.05}
    plain = A.make_advantage_fn("grpo", knobs=knobs)(batch)
    np.testing.assert_array_equal(plain["advantages"], grpo_advantages(rewards, GIDS, POLICY))
    np.testing.assert_array_equal(plain["advantages"], plain["base_advantages"])
    out = jax.jit(A.make_advantage_fn("turnsight", base="grpo", knobs=knobs))(batch)
    want = turnsight_advantages(DELTA, POLICY, TURN_IDS, GIDS, grpo_advantages(rewards, GIDS, POLICY),
                                selection="mean", lam=0.25)
    np.testing.assert_allclose(out["advantages"], want["advantages"], rtol=1e-6)
    np.testing.assert_allclose(out["advantages"], ts(selection="mean", lam=0.25)["advantages"], rtol=1e-5)
    np.testing.assert_array_equal(out["base_advantages"], plain["advantages"])
    mt = A.make_advantage_fn("matchtir", knobs=dict(knobs, gamma=0.5))
    mbatch = dict(batch, turn_rewards=np.ones((4, 2), np.float32), num_turns=np.array([2, 1, 1, 2], np.int32))
    np.testing.assert_array_equal(
        mt(mbatch)["advantages"],
        matchtir_advantages(mbatch["turn_rewards"], mbatch["num_turns"], TURN_IDS, POLICY, GIDS, gamma=0.5))
    with pytest.raises(KeyError, match="unknown advantage estimator 'ppo'"):
        A.make_advantage_fn("ppo", knobs=knobs)
    with pytest.raises(KeyError, match="wraps a base estimator; none given"):
        A.make_advantage_fn("turnsight", knobs=knobs)
    with pytest.raises(KeyError, match=r"needs knobs \['gamma'"):
        A.make_advantage_fn("matchtir", knobs={"eps": 1e-6})
    with pytest.raises(KeyError, match=r"needs batch arrays \['turn_rewards', 'num_turns'\]"):
        A.make_advantage_fn("matchtir", knobs=knobs)(batch)
    with pytest.raises(ValueError, match="already registered"):
        A.register_advantage("grpo", ("rewards",))(lambda r: r)
    with pytest.raises(ValueError, match="unknown knobs"):
        A.register_advantage("bad_knob_test", ("rewards",), ("temperature",))
