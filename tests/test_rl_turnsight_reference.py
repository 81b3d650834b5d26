"""An independent, loop-based NumPy reference for the advantage estimators, checked against the
jnp implementation on 200 hypothesis-generated batches per estimator and every TurnSight mode.

The reference is written straight from docs/spec.md §1 and the issue text with plain Python loops over
trajectories, turns and tokens, in float64; it shares no code with `turnsight_jax.rl.advantages`.

Batches use values on a dyadic grid (multiples of 1/8) so that the discrete decisions (signs,
majority votes, argmax over |δ̄|, "all equal in the group") are exact in float32 as well as in
float64: a turn's depth means share the divisor, so their order is preserved by rounding, and a
constant group is exactly constant. Only the continuous outputs need a tolerance.
"""

from __future__ import annotations

import functools
import itertools
import math

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnsight_jax.rl import advantages as adv_mod

# Fixed shapes so each estimator compiles once per mode structure.
D, B, T, G, MAX_TURNS = 3, 6, 12, 3, 8
REF_SETTINGS = settings(
    max_examples=200,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

SELECTIONS = ("vote", "mean", 0, 1, 2)
AGGREGATIONS = ("turn", "token")
GROUP_NORMS = (True, False)
TURNS = ("all", "first:2", "last:2")
ALL_MODES = list(itertools.product(SELECTIONS, AGGREGATIONS, GROUP_NORMS, TURNS))


# ------------------------------------------------------------------------------------------------
# Strategies (also imported by the property tests)
# ------------------------------------------------------------------------------------------------


@st.composite
def trajectory_batches(draw, *, depths: int = D, batch: int = B, length: int = T, groups: int = G,
                       max_turn_id: int = 10, values: str = "grid"):
    """A [D, B, T] TurnSight batch as float32/int32/bool numpy arrays.

    Turn ids are sorted per trajectory with gaps (empty turns), and reach past MAX_TURNS = 8 so
    some policy tokens are unassigned; some trajectories have no policy tokens; group sizes vary
    from 0 to B (so σ = 0 and size-1 groups occur); non-policy positions hold garbage that must be
    ignored. values="grid": δ on the 1/8 grid, A^base on the 1/4 grid (exact decisions, see the
    module docstring); values="float": arbitrary float32 δ in [−20, 20], A^base in [−3, 3].
    """
    group_ids = draw(hnp.arrays(np.int32, (batch,), elements=st.integers(0, groups - 1)))
    policy = draw(hnp.arrays(np.bool_, (batch, length)))
    empty = draw(hnp.arrays(np.bool_, (batch,)))
    policy = policy & ~empty[:, None]
    raw_turns = draw(hnp.arrays(np.int32, (batch, length), elements=st.integers(0, max_turn_id - 1)))
    turn_ids = np.where(policy, np.sort(raw_turns, axis=1), -1).astype(np.int32)
    shape = (depths, batch, length)
    if values == "grid":
        delta = draw(hnp.arrays(np.int32, shape, elements=st.integers(-24, 24))) / 8.0
        base = draw(hnp.arrays(np.int32, (batch, length), elements=st.integers(-8, 8))) / 4.0
    else:
        # No subnormals: XLA flushes them to zero on CPU/GPU, so A^base = 1e-45 would become 0.
        floats = functools.partial(st.floats, width=32, allow_subnormal=False)
        delta = draw(hnp.arrays(np.float32, shape, elements=floats(-20, 20)))
        base = draw(hnp.arrays(np.float32, (batch, length), elements=floats(-3, 3)))
    delta = np.where(policy[None], delta, np.float32(1e6)).astype(np.float32)  # off-policy garbage
    base = np.where(policy, base, 0.0).astype(np.float32)
    return {
        "delta": delta,
        "policy_mask": policy,
        "turn_ids": turn_ids,
        "group_ids": group_ids,
        "base_adv": base,
    }


@st.composite
def matchtir_batches(draw, *, batch: int = B, length: int = T, k: int = 4, groups: int = G):
    """MatchTIR inputs: turn rewards on the 1/8 grid in [0, 1], num_turns in [0, K]; some policy
    tokens name a turn ≥ num_turns (must get 0)."""
    group_ids = draw(hnp.arrays(np.int32, (batch,), elements=st.integers(0, groups - 1)))
    rewards = draw(hnp.arrays(np.int32, (batch, k), elements=st.integers(0, 8)))
    num_turns = draw(hnp.arrays(np.int32, (batch,), elements=st.integers(0, k)))
    policy = draw(hnp.arrays(np.bool_, (batch, length)))
    raw_turns = draw(hnp.arrays(np.int32, (batch, length), elements=st.integers(0, k)))
    turn_ids = np.where(policy, np.sort(raw_turns, axis=1), -1).astype(np.int32)
    return {
        "turn_rewards": (rewards / 8.0).astype(np.float32),
        "num_turns": num_turns,
        "turn_ids": turn_ids,
        "policy_mask": policy,
        "group_ids": group_ids,
    }


# ------------------------------------------------------------------------------------------------
# Reference implementations (loops, float64)
# ------------------------------------------------------------------------------------------------


def _sample_std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def ref_grpo(rewards, group_ids, policy_mask, eps=1e-6):
    n_b, n_t = policy_mask.shape
    out = np.zeros((n_b, n_t))
    for i in range(n_b):
        members = [float(rewards[j]) for j in range(n_b) if group_ids[j] == group_ids[i]]
        if len(members) < 2:
            a = 0.0
        else:
            a = (float(rewards[i]) - sum(members) / len(members)) / (_sample_std(members) + eps)
        for t in range(n_t):
            if policy_mask[i, t]:
                out[i, t] = a
    return out


def ref_matchtir(turn_rewards, num_turns, turn_ids, policy_mask, group_ids, gamma=0.9, eps=1e-6):
    n_b, n_k = turn_rewards.shape
    n_t = policy_mask.shape[1]
    n_real = [min(max(int(num_turns[i]), 0), n_k) for i in range(n_b)]
    totals = [sum(float(turn_rewards[i, k]) for k in range(n_real[i])) for i in range(n_b)]
    returns = np.zeros((n_b, n_k))
    for i in range(n_b):
        running = 0.0
        for k in reversed(range(n_real[i])):
            running = float(turn_rewards[i, k]) + gamma * running
            returns[i, k] = running
    a_traj = np.zeros(n_b)
    a_turn = np.zeros((n_b, n_k))
    for i in range(n_b):
        sib = [j for j in range(n_b) if group_ids[j] == group_ids[i]]
        if len(sib) >= 2:
            vals = [totals[j] for j in sib]
            a_traj[i] = (totals[i] - sum(vals) / len(vals)) / (_sample_std(vals) + eps)
        for k in range(n_real[i]):
            reach = [returns[j, k] for j in sib if n_real[j] > k]
            if len(reach) >= 2:
                a_turn[i, k] = (returns[i, k] - sum(reach) / len(reach)) / (_sample_std(reach) + eps)
    out = np.zeros((n_b, n_t))
    for i in range(n_b):
        for t in range(n_t):
            k = int(turn_ids[i, t])
            if policy_mask[i, t] and 0 <= k < n_real[i]:
                out[i, t] = (a_traj[i] + a_turn[i, k]) / 2
    return {"advantages": out, "trajectory_advantages": a_traj, "turn_advantages": a_turn,
            "returns": returns}


def _vote(values):
    """docs/spec.md §1.5 with the documented tie rule (even split → sign of the depth sum, ≥ 0 is +)."""
    signs = [1 if v >= 0 else -1 for v in values]
    pos, neg = signs.count(1), signs.count(-1)
    if pos != neg:
        majority = 1 if pos > neg else -1
    else:
        majority = 1 if sum(values) >= 0 else -1
    best = None
    for d, v in enumerate(values):
        if signs[d] == majority and (best is None or abs(v) > abs(values[best])):
            best = d
    return best


def ref_turnsight(delta, policy_mask, turn_ids, group_ids, base_adv, *, lam=0.5, eps_w=0.5,
                  eps=1e-6, selection="vote", aggregation="turn", group_norm=True, turns="all",
                  num_groups=None, max_turns=None):
    n_d, n_b, n_t = delta.shape
    n_k = n_t if max_turns is None else max_turns
    n_g = n_b if num_groups is None else num_groups

    def assigned(i, t):
        return bool(policy_mask[i, t]) and 0 <= int(turn_ids[i, t]) < n_k

    # Selection units: lists of (i, t) positions sharing one δ̄ vector.
    units = []
    for i in range(n_b):
        if aggregation == "turn":
            by_turn = {}
            for t in range(n_t):
                if assigned(i, t):
                    by_turn.setdefault(int(turn_ids[i, t]), []).append(t)
            for k in sorted(by_turn):
                units.append((i, by_turn[k]))
        else:
            for t in range(n_t):
                if assigned(i, t):
                    units.append((i, [t]))

    x_star = np.zeros((n_b, n_t))
    d_star = np.full((n_b, n_t), -1)
    agree, hist = 0, np.zeros(n_d, int)
    for i, positions in units:
        dbar = [sum(float(delta[d, i, t]) for t in positions) / len(positions) for d in range(n_d)]
        if len({v >= 0 for v in dbar}) == 1:
            agree += 1
        if selection == "vote":
            d_sel = _vote(dbar)
            value = dbar[d_sel]
        elif selection == "mean":
            d_sel, value = -1, sum(dbar) / n_d
        else:
            d_sel, value = selection, dbar[selection]
        if d_sel >= 0:
            hist[d_sel] += 1
        for t in positions:
            x_star[i, t], d_star[i, t] = value, d_sel

    mu, sigma = np.zeros(n_g), np.zeros(n_g)
    for g in range(n_g):
        pooled = [x_star[i, t] for i in range(n_b) for t in range(n_t)
                  if group_ids[i] == g and assigned(i, t)]
        if pooled:
            mu[g] = sum(pooled) / len(pooled)
            sigma[g] = math.sqrt(sum((x - mu[g]) ** 2 for x in pooled) / len(pooled))

    d_hat = np.zeros((n_b, n_t))
    weights = np.ones((n_b, n_t))
    out = np.zeros((n_b, n_t))
    for i in range(n_b):
        last = max([int(turn_ids[i, t]) for t in range(n_t) if assigned(i, t)], default=-1)
        for t in range(n_t):
            if not policy_mask[i, t]:
                continue
            a = float(base_adv[i, t])
            if assigned(i, t):
                g = int(group_ids[i])
                d_hat[i, t] = (x_star[i, t] - mu[g]) / (sigma[g] + eps) if group_norm else x_star[i, t]
                k = int(turn_ids[i, t])
                if turns == "all":
                    inside = True
                elif turns.startswith("first:"):
                    inside = k < int(turns[6:])
                else:
                    inside = k >= last + 1 - int(turns[5:])
                if inside:
                    sgn = (a > 0) - (a < 0)
                    weights[i, t] = 1 + eps_w * math.tanh(sgn * d_hat[i, t])
            out[i, t] = a * ((1 - lam) + lam * weights[i, t])

    # δ̄^{(d)} of every (trajectory, turn) segment, whatever the aggregation (0 for an empty turn)
    depth_turn_means = np.zeros((n_d, n_b, n_k))
    for i in range(n_b):
        for k in range(n_k):
            positions = [t for t in range(n_t) if assigned(i, t) and int(turn_ids[i, t]) == k]
            for d in range(n_d):
                if positions:
                    depth_turn_means[d, i, k] = sum(float(delta[d, i, t]) for t in positions) / len(positions)

    pol_w = [weights[i, t] for i in range(n_b) for t in range(n_t) if policy_mask[i, t]]
    turn_w = []  # token-mean weight of each non-empty turn
    for i in range(n_b):
        by_turn = {}
        for t in range(n_t):
            if assigned(i, t):
                by_turn.setdefault(int(turn_ids[i, t]), []).append(weights[i, t])
        turn_w += [sum(ws) / len(ws) for ws in by_turn.values()]
    return {
        "advantages": out, "weights": weights, "selected_depth": d_star, "delta_bar": x_star,
        "delta_hat": d_hat, "depth_turn_means": depth_turn_means, "group_mean": mu, "group_std": sigma,
        "agreement_rate": agree / max(len(units), 1), "depth_histogram": hist,
        "num_units": len(units),
        "weight_mean": sum(pol_w) / len(pol_w) if pol_w else 1.0,
        "weight_min": min(pol_w, default=1.0), "weight_max": max(pol_w, default=1.0),
        "turn_weights": turn_w,
    }


# ------------------------------------------------------------------------------------------------
# Agreement tests
# ------------------------------------------------------------------------------------------------


_FLOAT_KEYS = ("advantages", "weights", "delta_bar", "depth_turn_means", "group_mean", "group_std",
               "weight_mean", "weight_min", "weight_max")
_EXACT_KEYS = ("selected_depth", "depth_histogram", "num_units")
_ORDER = _FLOAT_KEYS + ("delta_hat",) + _EXACT_KEYS + (
    "agreement_rate", "frac_turns_amplified", "frac_turns_damped")


@jax.jit
def _pack(out):
    """All outputs as one float32 vector: one device→host transfer instead of sixteen (this runs
    12,000+ times per test). The integer outputs are small, so float32 holds them exactly."""
    return jnp.concatenate([jnp.ravel(out[k]).astype(jnp.float32) for k in _ORDER])


def _unpack(flat, want):
    got, start = {}, 0
    for key in _ORDER:
        size = int(np.size(want[key])) if key in want else 1
        got[key] = flat[start:start + size].reshape(np.shape(want.get(key, 0.0)))
        start += size
    assert start == flat.size
    return got


def assert_matches_reference(got, want, *, rtol=2e-4, atol=2e-5):
    """Every output of `turnsight_advantages` against the reference.

    A fast path compares everything with a few numpy calls; only on a mismatch does it fall back
    to per-key asserts for a readable message.
    """
    flat = np.asarray(_pack(got))
    if not np.all(np.isfinite(flat)):
        chex.assert_tree_all_finite(got)  # raises with chex's message
    got = _unpack(flat, want)
    n_float = sum(np.size(want[k]) for k in _FLOAT_KEYS)
    n_hat = np.size(want["delta_hat"])
    w_f = np.concatenate([np.ravel(want[k]) for k in _FLOAT_KEYS])
    w_e = np.concatenate([np.ravel(want[k]) for k in _EXACT_KEYS])
    # δ̂ amplifies float32 round-off by 1/σ; the weight (what matters) is held tighter.
    ok = (
        np.allclose(flat[:n_float], w_f, rtol=rtol, atol=atol)
        and np.allclose(flat[n_float:n_float + n_hat], np.ravel(want["delta_hat"]), rtol=1e-3,
                        atol=1e-3)
        and np.array_equal(flat[n_float + n_hat:n_float + n_hat + w_e.size], w_e)
        and abs(float(got["agreement_rate"]) - want["agreement_rate"]) <= 1e-6
    )
    if not ok:
        for key in _FLOAT_KEYS:
            np.testing.assert_allclose(got[key], want[key], rtol=rtol, atol=atol, err_msg=key)
        np.testing.assert_allclose(got["delta_hat"], want["delta_hat"], rtol=1e-3, atol=1e-3,
                                   err_msg="delta_hat")
        for key in _EXACT_KEYS:
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        np.testing.assert_allclose(got["agreement_rate"], want["agreement_rate"], atol=1e-6)
    # Amplify/damp fractions: a turn whose reference weight is within round-off of 1 may fall on
    # either side in float32, so bound the count between the strict and the loose reference count.
    n_turns = max(len(want["turn_weights"]), 1)
    tw = np.asarray(want["turn_weights"])
    for key, strict, loose in (
        ("frac_turns_amplified", tw > 1 + 1e-6, tw > 1 - 1e-6),
        ("frac_turns_damped", tw < 1 - 1e-6, tw < 1 + 1e-6),
    ):
        got_count = float(got[key]) * n_turns
        assert strict.sum() - 1e-4 <= got_count <= loose.sum() + 1e-4, key


@REF_SETTINGS
@given(batch=trajectory_batches())
def test_turnsight_matches_reference_every_mode(batch):
    """200 batches × 60 mode combinations (selection × aggregation × group_norm × turns)."""
    device_batch = [jnp.asarray(x) for x in batch.values()]
    for selection, aggregation, group_norm, turns in ALL_MODES:
        modes = dict(selection=selection, aggregation=aggregation, group_norm=group_norm,
                     turns=turns, num_groups=G, max_turns=MAX_TURNS)
        got = adv_mod.turnsight_advantages(*device_batch, **modes)
        want = ref_turnsight(*batch.values(), **modes)
        assert_matches_reference(got, want)


@REF_SETTINGS
@given(batch=trajectory_batches(), lam=st.sampled_from([0.0, 0.3, 1.0]),
       eps_w=st.sampled_from([0.0, 0.25, 0.9]))
def test_turnsight_matches_reference_lam_eps_w_and_default_bounds(batch, lam, eps_w):
    """The λ/ε_w knobs and the derived bounds (num_groups=None → B, max_turns=None → T)."""
    got = adv_mod.turnsight_advantages(*map(jnp.asarray, batch.values()), lam=lam, eps_w=eps_w)
    want = ref_turnsight(*batch.values(), lam=lam, eps_w=eps_w)
    assert_matches_reference(got, want)


@REF_SETTINGS
@given(batch=trajectory_batches(depths=2), aggregation=st.sampled_from(AGGREGATIONS))
def test_turnsight_matches_reference_even_depths_ties(batch, aggregation):
    """D = 2: vote ties are frequent; the reference applies the documented tie rule."""
    modes = dict(aggregation=aggregation, num_groups=G, max_turns=MAX_TURNS)
    got = adv_mod.turnsight_advantages(*map(jnp.asarray, batch.values()), **modes)
    assert_matches_reference(got, ref_turnsight(*batch.values(), **modes))


@REF_SETTINGS
@given(batch=trajectory_batches(), rewards=hnp.arrays(np.int32, (B,), elements=st.integers(0, 4)))
def test_grpo_matches_reference(batch, rewards):
    rewards = (rewards / 4.0).astype(np.float32)
    got = adv_mod.grpo_advantages(jnp.asarray(rewards), jnp.asarray(batch["group_ids"]),
                                  jnp.asarray(batch["policy_mask"]), num_groups=G)
    chex.assert_tree_all_finite(got)
    want = ref_grpo(rewards, batch["group_ids"], batch["policy_mask"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@REF_SETTINGS
@given(batch=matchtir_batches())
def test_matchtir_matches_reference(batch):
    got = adv_mod.matchtir_advantage_parts(*map(jnp.asarray, batch.values()), num_groups=G)
    chex.assert_tree_all_finite(got)
    want = ref_matchtir(*batch.values())
    for key in ("advantages", "trajectory_advantages", "turn_advantages", "returns"):
        np.testing.assert_allclose(np.asarray(got[key]), want[key], rtol=1e-4, atol=1e-4,
                                   err_msg=key)
    np.testing.assert_allclose(
        np.asarray(adv_mod.matchtir_advantages(*map(jnp.asarray, batch.values()), num_groups=G)),
        want["advantages"], rtol=1e-4, atol=1e-4)


def test_reference_covers_every_mode_combination():
    assert len(ALL_MODES) == len(SELECTIONS) * 2 * 2 * 3 == 60


@pytest.mark.parametrize("values, expected", [
    ([0.5, -0.25, 0.1], 0),        # majority +, largest + is depth 0
    ([-0.5, -0.75, 2.0], 1),       # majority −, |−0.75| beats |−0.5| despite |2.0|
    ([0.25, -0.75], 1),            # tie → sign of the sum (−0.5) → −
    ([0.75, -0.25], 0),            # tie → sum +0.5 → +
    ([0.5, -0.5], 0),              # tie with zero sum → ≥ 0 → +
    ([0.0, -0.0, -1.0], 0),        # ±0 counts as +, so + wins 2:1
    ([0.3, 0.3, -1.0], 0),         # equal magnitudes → lowest index
])
def test_reference_vote_rule(values, expected):
    """The reference's own vote, pinned on hand cases (the same cases run against jnp in
    test_advantages.py)."""
    assert _vote(values) == expected
