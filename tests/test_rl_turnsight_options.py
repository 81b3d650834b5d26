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


# ---- rl.norm_pool="per_turn": one value per (trajectory, turn) ----

def test_per_turn_pool_by_hand():
    # one value per turn: 2, -1 (row 0) and 1 (row 1) -> μ = 2/3, σ² = (16 + 25 + 1)/27 = 14/9,
    # whatever the turns' lengths (turn_mean weighs them 2, 2, 3: μ = 5/7)
    _expect(_run(norm_pool="per_turn"), 2 / 3, math.sqrt(14) / 3)
    # covered turns only (turns="first:1", uncovered_in_stats=False): 2 and 1 -> μ = 3/2, σ = 1/2
    out = _run(norm_pool="per_turn", uncovered_in_stats=False, turns="first:1")
    _expect(out, 1.5, 0.5, covered=COVERED)


def _per_turn_reference(delta, mask, turns, groups, base, *, depth, aggregation, lam=0.5, eps_w=0.5):
    """numpy, loop by loop: δ̄* at the fixed depth (the turn mean, or the token's gap under
    aggregation="token"), μ_g / σ_g (ddof 0) over one value per (trajectory, turn) of the group
    (the turn's mean of δ̄*), δ̂ = (δ̄* − μ)/(σ + eps), w, Ã."""
    x = delta[depth].astype(np.float64)
    b, t = mask.shape
    xbar = np.zeros((b, t))
    turn_value = {}
    for i in range(b):
        for k in set(turns[i][mask[i]].tolist()):
            sel = mask[i] & (turns[i] == k)
            turn_value[i, k] = x[i][sel].mean()
            xbar[i][sel] = turn_value[i, k] if aggregation == "turn" else x[i][sel]
    mu, sd = {}, {}
    for g in set(groups.tolist()):
        vals = np.array([v for (i, _), v in turn_value.items() if groups[i] == g])
        mu[g], sd[g] = vals.mean(), vals.std()
    d_hat = np.zeros((b, t))
    for i in range(b):
        d_hat[i] = np.where(mask[i], (xbar[i] - mu[groups[i]]) / (sd[groups[i]] + EPS), 0.0)
    w = np.where(mask, 1 + eps_w * np.tanh(np.sign(base) * d_hat), 1.0)
    return mu, sd, d_hat, w, np.where(mask, base * ((1 - lam) + lam * w), 0.0)


@pytest.mark.parametrize("aggregation", ["turn", "token"])
def test_per_turn_pool_equals_a_numpy_reference(aggregation):
    """Three groups of unequal size, trajectories of 1-4 turns of 1-5 tokens, signed base advantages."""
    rng = np.random.default_rng(3)
    b, t, k_max = 7, 14, 4
    groups = np.array([0, 0, 0, 1, 1, 2, 2], np.int32)
    mask = np.zeros((b, t), bool)
    turns = np.full((b, t), -1, np.int32)
    for i in range(b):
        pos = 0
        for k in range(int(rng.integers(1, k_max + 1))):
            n = int(rng.integers(1, 4))
            mask[i, pos:pos + n] = True
            turns[i, pos:pos + n] = k
            pos += n + int(rng.integers(0, 2))  # an observation token between some turns
    delta = rng.normal(size=(2, b, t)).astype(np.float32)
    base = np.where(mask, rng.choice([-1.5, 0.5, 2.0], size=(b, 1)), 0.0).astype(np.float32)
    out = turnsight_advantages(jnp.asarray(delta), jnp.asarray(mask), jnp.asarray(turns), jnp.asarray(groups),
                               jnp.asarray(base), selection=1, aggregation=aggregation, norm_pool="per_turn",
                               eps=EPS, num_groups=3, max_turns=k_max)
    mu, sd, d_hat, w, adv = _per_turn_reference(delta, mask, turns, groups, base, depth=1, aggregation=aggregation)
    np.testing.assert_allclose(np.asarray(out["group_mean"]), [mu[g] for g in range(3)], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out["group_std"]), [sd[g] for g in range(3)], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out["delta_hat"]), d_hat, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out["weights"]), w, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out["advantages"]), adv, rtol=1e-5, atol=1e-6)
    # the token-weighted pool differs here (turns of unequal length)
    tm = turnsight_advantages(jnp.asarray(delta), jnp.asarray(mask), jnp.asarray(turns), jnp.asarray(groups),
                              jnp.asarray(base), selection=1, aggregation=aggregation, eps=EPS, num_groups=3,
                              max_turns=k_max)
    assert not np.allclose(np.asarray(tm["group_std"]), np.asarray(out["group_std"]))


# ---- rl.empty_block_turns: turns scored on their own context (no hindsight block) ----

# Row 0's turn 1 (tokens 2-3) had an empty block: the teacher read the student's own context.
BLOCK = MASK & ~((np.arange(2)[:, None] == 0) & (TURNS == 1))


def test_empty_block_turns_excluded_by_hand():
    out = _run(empty_block_turns="excluded", teacher_covered=jnp.asarray(BLOCK))
    # weight exactly 1 (and Ã = A^base) on the excluded turn
    assert np.all(out["weights"][MASK & ~BLOCK] == 1.0) and np.all(out["advantages"][MASK & ~BLOCK] == 1.0)
    # the statistics of the remaining turns: δ̄* = 2, 2, 1, 1, 1 -> μ = 7/5, σ² = 11/5 - 49/25 = 6/25
    _expect(out, 7 / 5, math.sqrt(6) / 5, covered=BLOCK)
    # the same as a batch without the excluded turn (its tokens off policy)
    alone = turnsight_advantages(jnp.asarray(DELTA), jnp.asarray(BLOCK), jnp.asarray(TURNS), jnp.asarray(GROUPS),
                                 jnp.asarray(BASE), selection=0, eps=EPS, eps_w=0.5, lam=0.5, num_groups=1, max_turns=2)
    for key in ("group_mean", "group_std"):
        np.testing.assert_array_equal(out[key], np.asarray(alone[key]), err_msg=key)
    np.testing.assert_array_equal(out["weights"][BLOCK], np.asarray(alone["weights"])[BLOCK])
    # with one value per turn: 2 and 1 -> μ = 3/2, σ = 1/2
    _expect(_run(empty_block_turns="excluded", teacher_covered=jnp.asarray(BLOCK), norm_pool="per_turn"),
            1.5, 0.5, covered=BLOCK)


def test_empty_block_turns_weighted_is_the_default_and_ignores_the_blocks():
    a, b = _run(), _run(empty_block_turns="weighted", teacher_covered=jnp.asarray(BLOCK))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_empty_block_turns_through_the_registry():
    """The step's path: make_advantage_fn passes the batch's "teacher_covered" to TurnSight."""
    from turnsight_jax.rl.advantages import KNOBS, make_advantage_fn

    knobs = {k: None for k in KNOBS} | dict(eps=EPS, num_groups=1, max_turns=2, lam=0.5, eps_w=0.5, selection=0,
                                           aggregation="turn", group_norm=True, turns="all", norm_pool="turn_mean",
                                           uncovered_in_stats=True, empty_block_turns="excluded", depths=(1,),
                                           horizon_tol=0.05)
    arrays = {"rewards": np.array([1.0, 0.0], np.float32), "group_ids": GROUPS, "policy_mask": MASK,
              "turn_ids": TURNS, "delta": DELTA, "teacher_covered": BLOCK}
    out = make_advantage_fn("turnsight", base="grpo", knobs=knobs)(arrays)
    assert np.all(np.asarray(out["weights"])[MASK & ~BLOCK] == 1.0)
    np.testing.assert_allclose(np.asarray(out["group_mean"]), [7 / 5], rtol=1e-6)


def test_bad_empty_block_options_are_refused():
    with pytest.raises(ValueError, match="empty_block_turns must be one of"):
        _run(empty_block_turns="dropped")
    with pytest.raises(ValueError, match="needs teacher_covered"):
        _run(empty_block_turns="excluded")
