"""TurnSight choices the paper leaves open (docs/spec.md §1.6): what the group statistics pool
(rl.norm_pool) and whether turns outside the coverage window enter them (rl.uncovered_in_stats),
hand-computed on tiny [B, T] batches."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.rl.turnsight import turnsight_advantages

EPS = 1e-6
# One group of two rows, one depth. Row 0: turn 0 = tokens 0-1, turn 1 = tokens 2-3. Row 1: turn 0 =
# tokens 0-2, token 3 off policy (its δ is garbage and must be ignored).
DELTA = np.array([[[1.0, 3.0, -2.0, 0.0], [0.0, 0.0, 3.0, 99.0]]], np.float32)  # [D=1, B=2, T=4]
MASK = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], bool)
TURNS = np.array([[0, 0, 1, 1], [0, 0, 0, -1]], np.int32)
GROUPS = np.zeros(2, np.int32)
BASE = np.where(MASK, 1.0, 0.0).astype(np.float32)  # A^base = +1: w = 1 + ε_w·tanh(δ̂)
# Turn means δ̄*: row 0 (1+3)/2 = 2 and (-2+0)/2 = -1; row 1 (0+0+3)/3 = 1.
XBAR = np.array([[2.0, 2.0, -1.0, -1.0], [1.0, 1.0, 1.0, 0.0]])


def _run(**kw):
    out = turnsight_advantages(jnp.asarray(DELTA), jnp.asarray(MASK), jnp.asarray(TURNS), jnp.asarray(GROUPS),
                               jnp.asarray(BASE), selection=0, eps=EPS, eps_w=0.5, lam=0.5, num_groups=1,
                               max_turns=2, **kw)
    return {k: np.asarray(v) for k, v in out.items()}


def _expect(out, mu, sigma, covered=MASK):
    d_hat = np.where(MASK, (XBAR - mu) / (sigma + EPS), 0.0)
    np.testing.assert_allclose(out["group_mean"], [mu], rtol=1e-6)
    np.testing.assert_allclose(out["group_std"], [sigma], rtol=1e-6)
    np.testing.assert_allclose(out["delta_hat"][covered], d_hat[covered], rtol=1e-5)
    w = np.where(covered, 1 + 0.5 * np.tanh(d_hat), 1.0)
    np.testing.assert_allclose(out["weights"][MASK], w[MASK], rtol=1e-6)
    np.testing.assert_allclose(out["advantages"][MASK], (0.5 + 0.5 * w)[MASK], rtol=1e-6)


@pytest.mark.parametrize("pool,mu,sigma", [
    # turn_mean pools δ̄* per token: 2, 2, -1, -1, 1, 1, 1 -> μ = 5/7, E[x²] = 13/7, σ² = 13/7 - 25/49 = 66/49
    ("turn_mean", 5 / 7, math.sqrt(66) / 7),
    # token_gap pools the raw gaps: 1, 3, -2, 0, 0, 0, 3 -> μ = 5/7 (a token-weighted mean of turn means
    # is the mean of the tokens), E[x²] = 23/7, σ² = 23/7 - 25/49 = 136/49
    ("token_gap", 5 / 7, math.sqrt(136) / 7),
])
def test_normalisation_pool_by_hand(pool, mu, sigma):
    _expect(_run(norm_pool=pool), mu, sigma)


def test_turn_mean_is_the_default():
    a, b = _run(), _run(norm_pool="turn_mean", uncovered_in_stats=True)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


COVERED = MASK & (TURNS == 0)  # turns="first:1": only turn 0 of each row is reweighted


@pytest.mark.parametrize("pool,inside,mu,sigma", [
    # all turns in the statistics (default): the numbers above; only the weights of turn 1 are 1
    ("turn_mean", True, 5 / 7, math.sqrt(66) / 7),
    # covered turns only: δ̄* = 2, 2, 1, 1, 1 -> μ = 7/5, σ² = 11/5 - 49/25 = 6/25
    ("turn_mean", False, 7 / 5, math.sqrt(6) / 5),
    # covered turns only, raw gaps 1, 3, 0, 0, 3 -> μ = 7/5, σ² = 19/5 - 49/25 = 46/25
    ("token_gap", False, 7 / 5, math.sqrt(46) / 5),
])
def test_coverage_in_statistics_by_hand(pool, inside, mu, sigma):
    out = _run(norm_pool=pool, uncovered_in_stats=inside, turns="first:1")
    _expect(out, mu, sigma, covered=COVERED)
    assert np.all(out["weights"][MASK & ~COVERED] == 1.0)


def test_token_gap_reads_the_selected_depth():
    """Two depths, vote: row 0's turn selects depth 1 (means 1 and 2, both > 0), row 1's depth 0
    (means -2 and -1). The token_gap pool reads the selected depth's raw gaps."""
    delta = np.array([[[1.0, 1.0], [-1.0, -3.0]],   # depth 0
                      [[4.0, 0.0], [-1.0, -1.0]]], np.float32)  # depth 1
    mask = np.ones((2, 2), bool)
    turns = np.zeros((2, 2), np.int32)

    def run(pool):
        out = turnsight_advantages(jnp.asarray(delta), jnp.asarray(mask), jnp.asarray(turns), jnp.asarray(GROUPS),
                                   jnp.ones((2, 2), jnp.float32), norm_pool=pool, num_groups=1, max_turns=1)
        return {k: np.asarray(v) for k, v in out.items()}

    tm, tg = run("turn_mean"), run("token_gap")
    np.testing.assert_array_equal(tm["selected_depth"], [[1, 1], [0, 0]])
    np.testing.assert_array_equal(tm["delta_bar"], [[2, 2], [-2, -2]])
    # turn_mean: 2, 2, -2, -2 -> μ = 0, σ = 2; token_gap: 4, 0, -1, -3 -> μ = 0, σ² = 26/4
    np.testing.assert_allclose(tm["group_std"], [2.0], rtol=1e-6)
    np.testing.assert_allclose(tg["group_std"], [math.sqrt(6.5)], rtol=1e-6)
    np.testing.assert_allclose(tg["delta_hat"], np.array([[2, 2], [-2, -2]]) / (math.sqrt(6.5) + 1e-6), rtol=1e-5)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="norm_pool must be one of"):
        _run(norm_pool="tokens")
    with pytest.raises(ValueError, match="uncovered_in_stats must be a bool"):
        _run(uncovered_in_stats=1)
