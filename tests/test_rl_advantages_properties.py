"""Hypothesis property tests: statements about the advantage math that hold for every batch."""

from __future__ import annotations

import functools

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_rl_turnsight_reference import ALL_MODES, G, MAX_TURNS, matchtir_batches, trajectory_batches
from turnsight_jax.rl.advantages import (
    grpo_advantages,
    matchtir_advantage_parts,
    matchtir_advantages,
    turnsight_advantages,
)

PROP = settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
modes_st = st.sampled_from(ALL_MODES).map(
    lambda m: dict(selection=m[0], aggregation=m[1], group_norm=m[2], turns=m[3])
)
TOKEN_KEYS = ("advantages", "weights", "selected_depth", "delta_bar", "delta_hat")


def run(batch, **kwargs):
    kwargs.setdefault("num_groups", G)
    kwargs.setdefault("max_turns", MAX_TURNS)
    out = turnsight_advantages(*(jnp.asarray(x) for x in batch.values()), **kwargs)
    out = jax.device_get(out)
    chex.assert_tree_all_finite(out)
    return out


def group_mask(batch, g):
    return batch["group_ids"] == g


# ------------------------------------------------------------------------------------------------
# Weights and mixing
# ------------------------------------------------------------------------------------------------


@PROP
@given(batch=trajectory_batches(values="float"), modes=modes_st,
       lam=st.floats(0.0, 1.0, width=32), eps_w=st.floats(0.0, float(np.float32(0.999)), width=32))
def test_weight_bounds_sign_preservation_and_lambda_zero(batch, modes, lam, eps_w):
    out = run(batch, lam=lam, eps_w=eps_w, **modes)
    w, a_tilde, base = out["weights"], out["advantages"], batch["base_adv"]
    pol = batch["policy_mask"]
    eps_w32 = float(np.float32(eps_w))
    # w ∈ [1 − ε_w, 1 + ε_w] (1 ulp of slack for the float32 tanh/add), exactly 1 off policy.
    assert np.all(w >= 1 - eps_w32 - 1e-6) and np.all(w <= 1 + eps_w32 + 1e-6)
    assert np.all(w[~pol] == 1.0)
    # sign(Ã) = sign(A^base) on every token (ε_w < 1, λ ∈ [0, 1]); Ã = 0 off policy. Where
    # |Ã| may be subnormal (|A| (1 − λε_w) < 2 · 1.2e-38), a backend that flushes float32
    # denormals to zero (XLA's CPU loop emitters, once a process has set flush-to-zero; GPUs) may
    # give 0: there Ã is 0 or of A's sign, never of the other.
    lo, hi = (1 - lam * eps_w32) * np.abs(base), (1 + lam * eps_w32) * np.abs(base)
    normal = (lo >= 2 * np.finfo(np.float32).tiny) | (base == 0)
    np.testing.assert_array_equal(np.sign(a_tilde)[normal], np.sign(base)[normal])
    assert np.all(np.sign(a_tilde) * np.sign(base) >= 0)
    assert np.all(a_tilde[~pol] == 0.0)
    # |Ã| within the mixing bounds: (1 − λε_w)|A| ≤ |Ã| ≤ (1 + λε_w)|A| (the lower one where Ã is normal).
    assert np.all(np.abs(a_tilde)[normal] >= lo[normal] * (1 - 1e-6)) and np.all(np.abs(a_tilde) <= hi * (1 + 1e-6))
    # λ = 0 reproduces the base advantages bit for bit.
    out0 = run(batch, lam=0.0, eps_w=eps_w, **modes)
    np.testing.assert_array_equal(out0["advantages"], np.where(pol, base, 0.0))


@PROP
@given(batch=trajectory_batches(), modes=modes_st)
def test_zero_base_advantage_gives_unit_weight(batch, modes):
    """sign(A^base) = 0 ⇒ w = tanh(0)·ε_w + 1 = 1 on that token."""
    out = run(batch, **modes)
    zero = batch["policy_mask"] & (batch["base_adv"] == 0)
    assert np.all(out["weights"][zero] == 1.0)


# ------------------------------------------------------------------------------------------------
# Invariances
# ------------------------------------------------------------------------------------------------


@PROP
@given(batch=trajectory_batches(values="float"), modes=modes_st, data=st.data())
def test_non_policy_positions_change_nothing(batch, modes, data):
    """Arbitrary δ (NaN/inf included), turn ids and A^base at non-policy positions are ignored."""
    out = run(batch, **modes)
    pol = batch["policy_mask"]
    junk_delta = data.draw(hnp.arrays(np.float32, batch["delta"].shape,
                                      elements=st.floats(allow_nan=True, allow_infinity=True, width=32)))
    junk_turns = data.draw(hnp.arrays(np.int32, pol.shape, elements=st.integers(-5, 50)))
    junk_base = data.draw(hnp.arrays(np.float32, pol.shape,
                                     elements=st.floats(allow_nan=True, allow_infinity=True, width=32)))
    changed = dict(batch)
    changed["delta"] = np.where(pol[None], batch["delta"], junk_delta)
    changed["turn_ids"] = np.where(pol, batch["turn_ids"], junk_turns)
    changed["base_adv"] = np.where(pol, batch["base_adv"], junk_base)
    out2 = run(changed, **modes)
    for key in out:
        np.testing.assert_array_equal(out2[key], out[key], err_msg=key)


@PROP
@given(batch=trajectory_batches(), modes=modes_st, perm=st.permutations(range(6)))
def test_permuting_trajectories_permutes_outputs(batch, modes, perm):
    """Trajectories (and their group ids) reordered ⇒ per-token outputs reordered the same way;
    group statistics and diagnostics unchanged (up to summation order)."""
    perm = np.asarray(perm)
    out = run(batch, **modes)
    permuted = {k: (v[:, perm] if k == "delta" else v[perm]) for k, v in batch.items()}
    out2 = run(permuted, **modes)
    for key in TOKEN_KEYS:
        np.testing.assert_allclose(out2[key], out[key][perm], rtol=1e-5, atol=1e-5, err_msg=key)
    np.testing.assert_array_equal(out2["selected_depth"], out["selected_depth"][perm])
    for key in ("group_mean", "group_std", "agreement_rate", "depth_histogram", "weight_mean",
                "weight_min", "weight_max", "frac_turns_amplified", "frac_turns_damped"):
        np.testing.assert_allclose(out2[key], out[key], rtol=1e-5, atol=1e-6, err_msg=key)


shift_modes_st = st.tuples(st.sampled_from(["mean", 0, 1, 2]), st.sampled_from(["turn", "token"]))


@PROP
@given(batch=trajectory_batches(), sel_agg=shift_modes_st, g=st.integers(0, G - 1),
       c=st.integers(-40, 40).map(lambda k: k / 8))
def test_group_shift_leaves_delta_hat_unchanged(batch, sel_agg, g, c):
    """δ → δ + c on every token of one group ⇒ δ̄* shifts by c there ⇒ δ̂ unchanged everywhere.

    Holds for the fixed-depth and fusion selections; the vote is not shift-invariant (a shift
    moves signs, hence the majority), so it is covered by the scaling property instead.
    """
    selection, aggregation = sel_agg
    out = run(batch, selection=selection, aggregation=aggregation)
    shifted = dict(batch)
    shifted["delta"] = np.where(group_mask(batch, g)[None, :, None], batch["delta"] + c,
                                batch["delta"]).astype(np.float32)
    out2 = run(shifted, selection=selection, aggregation=aggregation)
    np.testing.assert_allclose(out2["delta_hat"], out["delta_hat"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out2["weights"], out["weights"], rtol=1e-5, atol=1e-5)
    assigned = batch["policy_mask"] & (batch["turn_ids"] < MAX_TURNS)
    in_g = assigned & group_mask(batch, g)[:, None]
    np.testing.assert_allclose(out2["delta_bar"][in_g], out["delta_bar"][in_g] + c, atol=1e-5)


@PROP
@given(batch=trajectory_batches(), modes=modes_st.filter(lambda m: m["group_norm"]),
       g=st.integers(0, G - 1), c=st.integers(1, 80).map(lambda k: k / 8))
def test_group_scaling_leaves_delta_hat_unchanged(batch, modes, g, c):
    """δ → c·δ (c > 0) on one group ⇒ δ̂ unchanged up to eps, for every selection mode (scaling
    keeps signs and the |δ̄| order, so the vote picks the same depth). c is a multiple of 1/8 so
    products of grid values stay exact and a zero turn mean stays exactly zero."""
    out = run(batch, eps=1e-6, **modes)
    scaled = dict(batch)
    scaled["delta"] = np.where(group_mask(batch, g)[None, :, None], batch["delta"] * c,
                               batch["delta"]).astype(np.float32)
    out2 = run(scaled, eps=1e-6, **modes)
    # |δ̂(cδ) − δ̂(δ)| ≈ |δ̂|·eps·|1/c − 1|/σ, and the grid keeps σ ≥ ~1e-2 when σ ≠ 0.
    np.testing.assert_allclose(out2["delta_hat"], out["delta_hat"], rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(out2["selected_depth"], out["selected_depth"])


# ------------------------------------------------------------------------------------------------
# Selection modes
# ------------------------------------------------------------------------------------------------


@PROP
@given(batch=trajectory_batches(), depth=st.integers(0, 2), aggregation=st.sampled_from(["turn", "token"]),
       group_norm=st.booleans())
def test_single_depth_selection_equals_using_that_depth(batch, depth, aggregation, group_norm):
    """selection=i on D depths ≡ a D = 1 run on depth i (where vote, mean and 0 all coincide)."""
    kw = dict(aggregation=aggregation, group_norm=group_norm)
    out = run(batch, selection=depth, **kw)
    single = dict(batch, delta=batch["delta"][depth:depth + 1])
    for sel in ("vote", "mean", 0):
        ref = run(single, selection=sel, **kw)
        for key in ("advantages", "weights", "delta_bar", "delta_hat"):
            np.testing.assert_array_equal(out[key], ref[key], err_msg=f"{sel}:{key}")
    assigned = batch["policy_mask"] & (batch["turn_ids"] < MAX_TURNS)
    np.testing.assert_array_equal(out["selected_depth"], np.where(assigned, depth, -1))
    hist = out["depth_histogram"]
    assert hist[depth] == out["num_units"] and hist.sum() == out["num_units"]


@PROP
@given(batch=trajectory_batches(values="float"), aggregation=st.sampled_from(["turn", "token"]),
       group_norm=st.booleans())
def test_mean_selection_equals_depth_average(batch, aggregation, group_norm):
    """Fusion: selection="mean" ≡ a D = 1 run on the depth-averaged δ (turn means are linear)."""
    kw = dict(aggregation=aggregation, group_norm=group_norm)
    out = run(batch, selection="mean", **kw)
    avg = dict(batch, delta=batch["delta"].mean(axis=0, keepdims=True, dtype=np.float64).astype(np.float32))
    ref = run(avg, selection=0, **kw)
    np.testing.assert_allclose(out["delta_bar"], ref["delta_bar"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["weights"], ref["weights"], rtol=1e-4, atol=1e-4)
    assert np.all(out["selected_depth"] == -1) and np.all(out["depth_histogram"] == 0)


@PROP
@given(batch=trajectory_batches(values="float"), group_norm=st.booleans(),
       turns=st.sampled_from(["all", "first:2", "last:2"]))
def test_vote_selects_the_largest_majority_sign_depth(batch, group_norm, turns):
    """Under the vote (token aggregation, so a unit is one token and its depth values are the
    input δ): δ̄* = δ^{(d*)}, it has the majority sign of the three depths, and the largest
    magnitude among the depths of that sign."""
    out = run(batch, selection="vote", aggregation="token", group_norm=group_norm, turns=turns)
    assigned = batch["policy_mask"] & (batch["turn_ids"] < MAX_TURNS)
    vals = batch["delta"][:, assigned]  # [D, N]
    x_star = out["delta_bar"][assigned]
    d_star = out["selected_depth"][assigned]
    np.testing.assert_array_equal(vals[d_star, np.arange(vals.shape[1])], x_star)
    signs = np.where(vals >= 0, 1, -1)
    majority = np.sign(signs.sum(0))  # D = 3: never 0
    np.testing.assert_array_equal(np.where(x_star >= 0, 1, -1), majority)
    np.testing.assert_array_equal(np.abs(x_star), np.where(signs == majority, np.abs(vals), -1).max(0))


# ------------------------------------------------------------------------------------------------
# Group statistics and degenerate batches
# ------------------------------------------------------------------------------------------------


@PROP
@given(batch=trajectory_batches(), modes=modes_st)
def test_group_statistics_are_token_weighted(batch, modes):
    """μ_g, σ_g equal the plain mean/population std of delta_bar over the group's assigned policy
    tokens; δ̂ has zero token-mean and unit (or zero) token-std inside every group."""
    out = run(batch, **modes)
    assigned = batch["policy_mask"] & (batch["turn_ids"] < MAX_TURNS)
    for g in range(G):
        sel = assigned & group_mask(batch, g)[:, None]
        vals = out["delta_bar"][sel].astype(np.float64)
        if vals.size == 0:
            assert out["group_mean"][g] == 0 and out["group_std"][g] == 0
            continue
        np.testing.assert_allclose(out["group_mean"][g], vals.mean(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out["group_std"][g], vals.std(), rtol=1e-4, atol=1e-5)
        if modes["group_norm"]:
            hat = out["delta_hat"][sel].astype(np.float64)
            assert abs(hat.mean()) < 1e-4
            sd = hat.std()
            assert abs(sd) < 1e-4 or abs(sd - 1) < 1e-3


@PROP
@given(batch=trajectory_batches(), modes=modes_st.filter(lambda m: m["group_norm"]),
       values=hnp.arrays(np.int32, (G,), elements=st.integers(-24, 24)))
def test_constant_groups_get_unit_weight(batch, modes, values):
    """σ = 0 (every δ of a group equal) ⇒ δ̂ = 0 exactly ⇒ w = 1 ⇒ Ã = A^base, finite."""
    const = (values[batch["group_ids"]] / 8.0).astype(np.float32)
    flat = dict(batch, delta=np.broadcast_to(const[None, :, None], batch["delta"].shape).copy())
    out = run(flat, **modes)
    assert np.all(out["delta_hat"] == 0) and np.all(out["weights"] == 1)
    np.testing.assert_array_equal(out["advantages"], np.where(batch["policy_mask"], batch["base_adv"], 0))
    np.testing.assert_array_equal(out["group_std"], np.zeros(G))


@PROP
@given(batch=trajectory_batches(), modes=modes_st, drop=hnp.arrays(np.bool_, (6,)),
       new_groups=hnp.arrays(np.int32, (6,), elements=st.integers(0, G - 1)))
def test_trajectories_without_policy_tokens_are_inert(batch, modes, drop, new_groups):
    """A trajectory with no policy tokens gets Ã = 0, w = 1, d* = −1, and contributes nothing to
    any group: moving it to another group changes no output at all."""
    cut = dict(batch)
    cut["policy_mask"] = batch["policy_mask"] & ~drop[:, None]
    cut["turn_ids"] = np.where(cut["policy_mask"], batch["turn_ids"], -1)
    out = run(cut, **modes)
    assert np.all(out["advantages"][drop] == 0) and np.all(out["weights"][drop] == 1)
    assert np.all(out["selected_depth"][drop] == -1)
    moved = dict(cut, group_ids=np.where(drop, new_groups, batch["group_ids"]).astype(np.int32))
    out2 = run(moved, **modes)
    for key in out:
        np.testing.assert_array_equal(out2[key], out[key], err_msg=key)


# ------------------------------------------------------------------------------------------------
# jit / vmap
# ------------------------------------------------------------------------------------------------


VMAP_MODES = (
    dict(selection="vote", aggregation="turn", group_norm=True, turns="all"),
    dict(selection="mean", aggregation="token", group_norm=False, turns="last:2"),
)


@functools.cache
def _compiled(mode_index: int, batched: bool):
    """One jitted (optionally vmapped) TurnSight per mode, built once: λ stays a traced argument."""
    kw = dict(num_groups=G, max_turns=MAX_TURNS, **VMAP_MODES[mode_index])

    def fn(delta, policy_mask, turn_ids, group_ids, base_adv, lam):
        return turnsight_advantages(delta, policy_mask, turn_ids, group_ids, base_adv, lam=lam, **kw)

    return jax.jit(jax.vmap(fn, in_axes=(0, 0, 0, 0, 0, None)) if batched else fn)


@settings(PROP, max_examples=6)
@given(batches=st.lists(trajectory_batches(values="float"), min_size=3, max_size=3),
       lam=st.floats(0, 1, width=32))
def test_vmap_over_batches_equals_loop_and_jit_equals_eager(batches, lam):
    stacked = [np.stack([b[k] for b in batches]) for k in batches[0]]
    for m, modes in enumerate(VMAP_MODES):
        vm = jax.device_get(_compiled(m, True)(*stacked, lam))
        for i, b in enumerate(batches):
            eager = run(b, lam=lam, **modes)
            jt = jax.device_get(_compiled(m, False)(*b.values(), lam))
            for key in eager:
                np.testing.assert_allclose(vm[key][i], eager[key], rtol=1e-6, atol=1e-6, err_msg=key)
                np.testing.assert_allclose(jt[key], eager[key], rtol=1e-6, atol=1e-6, err_msg=key)


@settings(PROP, max_examples=6)
@given(batches=st.lists(matchtir_batches(), min_size=3, max_size=3),
       rewards=hnp.arrays(np.float32, (3, 6), elements=st.floats(0, 1, width=32)))
def test_base_estimators_vmap_equals_loop(batches, rewards):
    stacked = [np.stack([b[k] for b in batches]) for k in batches[0]]
    vm = jax.vmap(functools.partial(matchtir_advantages, num_groups=G))(*stacked)
    gids, pms = stacked[4], stacked[3]
    vg = jax.vmap(functools.partial(grpo_advantages, num_groups=G))(rewards, gids, pms)
    for i, b in enumerate(batches):
        np.testing.assert_allclose(vm[i], matchtir_advantages(*b.values(), num_groups=G), atol=1e-6)
        np.testing.assert_allclose(vg[i], grpo_advantages(rewards[i], gids[i], pms[i], num_groups=G),
                                   atol=1e-6)


# ------------------------------------------------------------------------------------------------
# GRPO and MatchTIR
# ------------------------------------------------------------------------------------------------


@PROP
@given(batch=trajectory_batches(), rewards=hnp.arrays(np.int32, (6,), elements=st.integers(-8, 8)),
       scale=st.floats(0.1, 10), offset=st.floats(-10, 10))
def test_grpo_group_properties(batch, rewards, scale, offset):
    gid, pm = batch["group_ids"], batch["policy_mask"]
    rewards = (rewards / 4).astype(np.float32)
    adv = np.asarray(grpo_advantages(rewards, gid, pm, num_groups=G))
    chex.assert_shape(adv, pm.shape)
    chex.assert_tree_all_finite(adv)
    assert np.all(adv[~pm] == 0)
    for g in range(G):
        members = np.flatnonzero(gid == g)
        r = rewards[members].astype(np.float64)
        if members.size < 2:
            assert np.all(adv[members] == 0)  # a lone sibling has no sample std
            continue
        want = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
        for j, i in enumerate(members):  # one value over all of a trajectory's policy tokens
            np.testing.assert_allclose(adv[i][pm[i]], want[j], rtol=1e-5, atol=1e-5)
        # Within a group the per-trajectory advantages have mean 0 and sample std 1 (or are all 0).
        per = np.asarray(want)
        assert abs(per.mean()) < 1e-6 and (np.all(per == 0) or abs(per.std(ddof=1) - 1) < 1e-4)
    # Positive affine maps of the rewards leave the advantages unchanged up to eps/σ (σ ≥ 1/8 on
    # this grid unless 0, and a constant group stays exactly 0).
    adv2 = np.asarray(grpo_advantages((rewards * scale + offset).astype(np.float32), gid, pm,
                                      num_groups=G))
    np.testing.assert_allclose(adv2, adv, rtol=1e-3, atol=1e-3)


@PROP
@given(batch=matchtir_batches())
def test_matchtir_structure(batch):
    parts = jax.device_get(matchtir_advantage_parts(*batch.values(), num_groups=G))
    chex.assert_tree_all_finite(parts)
    r, n, tid, pm, gid = batch.values()
    k = r.shape[1]
    # The trajectory level is exactly GRPO on the summed real-turn rewards.
    totals = np.where(np.arange(k)[None] < n[:, None], r, 0).sum(1)
    grpo = np.asarray(grpo_advantages(totals.astype(np.float32), gid, np.ones((6, 1), bool), num_groups=G))[:, 0]
    np.testing.assert_allclose(parts["trajectory_advantages"], grpo, rtol=1e-5, atol=1e-5)
    # Turn advantages sum to zero over the siblings that reach each turn; 0 beyond num_turns.
    reach = np.arange(k)[None] < n[:, None]
    assert np.all(parts["turn_advantages"][~reach] == 0)
    for g in range(G):
        for kk in range(k):
            sel = (gid == g) & reach[:, kk]
            assert abs(parts["turn_advantages"][sel, kk].sum()) < 1e-4
    # Every policy token of a real turn carries (A_traj + A_turn[k]) / 2; all others 0.
    adv = parts["advantages"]
    for i in range(6):
        for t in range(pm.shape[1]):
            kk = tid[i, t]
            if pm[i, t] and 0 <= kk < n[i]:
                want = 0.5 * (parts["trajectory_advantages"][i] + parts["turn_advantages"][i, kk])
                np.testing.assert_allclose(adv[i, t], want, rtol=1e-6, atol=1e-7)
            else:
                assert adv[i, t] == 0
