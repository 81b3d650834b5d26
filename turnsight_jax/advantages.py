"""Advantage estimators: GRPO, MatchTIR dual-level, and TurnSight turn-level hindsight weighting.

Everything here is pure `jax.numpy`: no Python loops over tokens, turns or trajectories, no host
round-trips, so every function can be jitted, vmapped over a leading batch-of-batches axis and
fused into the train step (SPEC §4). Modes are static keyword-only Python values; numeric knobs
(`lam`, `eps_w`, `eps`, `gamma`) may be Python floats or traced scalars (sweeps do not recompile).

Shapes (B trajectories, T tokens, K turn slots, D hindsight depths, G groups):

* `policy_mask`  [B, T] bool  -- True on tokens the policy wrote (never on observation tokens).
* `turn_ids`     [B, T] int32 -- turn index of a policy token, −1 elsewhere.
* `group_ids`    [B]    int32 -- prompt group of each trajectory, in [0, num_groups).
  `num_groups=None` means B (every id must then lie in [0, B)). Ids need not be contiguous or
  sorted: groups are formed with segment sums, so empty groups are harmless. A trajectory whose id
  lies outside [0, num_groups) belongs to no group: its GRPO/MatchTIR advantage is 0 and, with
  group_norm=True, its TurnSight δ̂ is 0 (w = 1).
* `delta`        [D, B, T] float -- δ^{(d)}_{i,t}, teacher minus student token log-prob per depth.

Group statistics are computed on values shifted by the group maximum before accumulation (the
"shifted data" variance algorithm). This costs one segment_max and makes a group whose values are
all equal give exactly 0 (rather than float32 round-off divided by eps, which can be O(1)).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import chex
import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ADVANTAGE_FNS",
    "ADVANTAGE_INPUTS",
    "compute_base_advantages",
    "discounted_returns",
    "group_normalize",
    "grpo_advantages",
    "make_advantage_fn",
    "matchtir_advantage_parts",
    "matchtir_advantages",
    "register_advantage",
    "turnsight_advantages",
]

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# Group helpers
# ----------------------------------------------------------------------------------------------


def _group_gather(values: Array, group_ids: Array, num_groups: int) -> Array:
    """values[group_ids] along axis 0, with 0 for ids outside [0, num_groups).

    Masked explicitly: with `.at[].get(mode="fill")` negative ids would still wrap, numpy-style.
    """
    in_range = (group_ids >= 0) & (group_ids < num_groups)
    safe = jnp.where(in_range, group_ids, 0)
    out = values[safe]
    in_range = in_range.reshape(in_range.shape + (1,) * (out.ndim - 1))
    return jnp.where(in_range, out, jnp.zeros((), out.dtype))


def _pooled_group_stats(
    values: Array, mask: Array, group_ids: Array, num_groups: int
) -> tuple[Array, Array, Array]:
    """Token-pooled group count, mean and centred deviations.

    values, mask: [B, T]; group_ids: [B]. Every masked entry of every trajectory of a group is
    one sample (token-weighted pooling). Returns (count [G], mean [G], dev [B, T]) with
    dev = values − own group mean, 0 where masked out or ungrouped. The mean is accumulated on
    values − group max (see module docstring) and the max added back.
    """
    row_max = jnp.max(jnp.where(mask, values, -jnp.inf), axis=1)  # [B]
    gmax = jax.ops.segment_max(row_max, group_ids, num_segments=num_groups)
    shift = jnp.where(jnp.isfinite(gmax), gmax, 0.0)  # empty groups: −inf → 0
    centred = jnp.where(mask, values - _group_gather(shift, group_ids, num_groups)[:, None], 0.0)
    count = jax.ops.segment_sum(jnp.sum(mask, axis=1).astype(jnp.float32), group_ids,
                                num_segments=num_groups)
    mean_c = jax.ops.segment_sum(jnp.sum(centred, axis=1), group_ids,
                                 num_segments=num_groups) / jnp.maximum(count, 1.0)
    in_group = ((group_ids >= 0) & (group_ids < num_groups))[:, None]
    dev = jnp.where(mask & in_group,
                    centred - _group_gather(mean_c, group_ids, num_groups)[:, None], 0.0)
    return count, mean_c + shift, dev


def group_normalize(
    values: Array,
    group_ids: Array,
    *,
    mask: Array | None = None,
    num_groups: int | None = None,
    ddof: int = 1,
    eps: float = 1e-6,
) -> Array:
    """(x − mean_group) / (std_group + eps), per trailing position, over masked group members.

    values: [B] or [B, K] float; mask: same shape bool (default all True); group_ids: [B] int.
    For [B, K] inputs each column k is normalised separately across the siblings whose mask is set
    (MatchTIR's "siblings that reach turn k"). Std uses `ddof` (1 = sample std). Where a group
    (column) has count ≤ ddof the std is undefined and the result is defined as 0 — with ddof=1 a
    lone sibling carries no relative signal. Masked-out entries return 0.
    Returns float32 of the shape of `values`.
    """
    values = jnp.asarray(values, jnp.float32)
    if mask is None:
        mask = jnp.ones(values.shape, bool)
    num_groups = values.shape[0] if num_groups is None else num_groups
    # segment ops reduce axis 0 only, so a trailing K axis stays a separate statistic per column.
    gmax = jax.ops.segment_max(jnp.where(mask, values, -jnp.inf), group_ids, num_segments=num_groups)
    shift = jnp.where(jnp.isfinite(gmax), gmax, 0.0)
    centred = jnp.where(mask, values - _group_gather(shift, group_ids, num_groups), 0.0)
    count = jax.ops.segment_sum(mask.astype(jnp.float32), group_ids, num_segments=num_groups)
    mean_c = jax.ops.segment_sum(centred, group_ids, num_segments=num_groups) / jnp.maximum(count, 1.0)
    dev = jnp.where(mask, centred - _group_gather(mean_c, group_ids, num_groups), 0.0)
    var = jax.ops.segment_sum(dev * dev, group_ids, num_segments=num_groups) / jnp.maximum(
        count - ddof, 1.0
    )
    std_b = _group_gather(jnp.sqrt(var), group_ids, num_groups)
    count_b = _group_gather(count, group_ids, num_groups)  # 0 for ungrouped rows
    return jnp.where(mask & (count_b > ddof), dev / (std_b + eps), 0.0)


# ----------------------------------------------------------------------------------------------
# GRPO
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("num_groups",))
def grpo_advantages(
    rewards: Array,
    group_ids: Array,
    policy_mask: Array,
    *,
    eps: float = 1e-6,
    num_groups: int | None = None,
) -> Array:
    """GRPO outcome advantages broadcast over policy tokens.

    rewards [B] float, group_ids [B] int, policy_mask [B, T] bool → [B, T] float32:
    (r_i − mean_g) / (std_g(ddof=1) + eps) on policy tokens, 0 elsewhere. A group of size 1 has
    no sample std: its trajectory gets advantage 0. Every trajectory counts in its group's
    statistics, whether or not it has policy tokens.
    """
    chex.assert_rank([rewards, group_ids, policy_mask], [1, 1, 2])
    b = policy_mask.shape[0]
    chex.assert_shape([rewards, group_ids], [(b,), (b,)])
    chex.assert_type([group_ids, policy_mask], [int, bool])
    adv = group_normalize(rewards, group_ids, num_groups=num_groups, ddof=1, eps=eps)
    return jnp.where(policy_mask, adv[:, None], 0.0)


# ----------------------------------------------------------------------------------------------
# MatchTIR
# ----------------------------------------------------------------------------------------------


def discounted_returns(turn_rewards: Array, num_turns: Array, gamma: float = 0.9) -> Array:
    """G_k = Σ_{j≥k, j<n} γ^{j−k} r_j for k < n, 0 for k ≥ n.

    turn_rewards [B, K] float, num_turns [B] int (clipped to [0, K]) → [B, K] float32.
    Computed as a masked upper-triangular [K, K] contraction (K is ~10, so O(K²) is nothing) by
    elementwise multiply-and-sum rather than a matmul, so no TF32/bf16 matmul precision applies.
    """
    k = turn_rewards.shape[-1]
    valid = jnp.arange(k)[None, :] < jnp.clip(num_turns, 0, k)[:, None]
    r = jnp.where(valid, jnp.asarray(turn_rewards, jnp.float32), 0.0)
    lag = jnp.arange(k)[None, :] - jnp.arange(k)[:, None]  # [k, j] = j − k
    disc = jnp.where(lag >= 0, jnp.power(jnp.asarray(gamma, jnp.float32), jnp.maximum(lag, 0)), 0.0)
    g = jnp.sum(r[:, None, :] * disc[None, :, :], axis=-1)
    return jnp.where(valid, g, 0.0)


@functools.partial(jax.jit, static_argnames=("num_groups",))
def matchtir_advantage_parts(
    turn_rewards: Array,
    num_turns: Array,
    turn_ids: Array,
    policy_mask: Array,
    group_ids: Array,
    *,
    gamma: float = 0.9,
    eps: float = 1e-6,
    num_groups: int | None = None,
) -> dict[str, Array]:
    """MatchTIR dual-level advantages with their components.

    turn_rewards [B, K] float32, num_turns [B] int32 (turns 0..num_turns−1 are real; clipped to K),
    turn_ids [B, T] int32, policy_mask [B, T] bool, group_ids [B] int32.
    Returns:
      trajectory_advantages [B]: group-normalised (ddof=1, eps) Σ_k r_k over real turns; 0 for a
        group of size 1.
      returns [B, K]: discounted returns G_k (0 beyond num_turns).
      turn_advantages [B, K]: G_k normalised (mean, ddof=1 std, eps) across the siblings of the
        group with num_turns > k; 0 where only one sibling reaches turn k, and 0 for k ≥ num_turns.
      advantages [B, T]: (A_traj + A_turn[k]) / 2 on policy tokens whose turn k is real
        (0 ≤ k < min(num_turns, K)); 0 on every other token (including policy tokens whose turn id
        does not name a real turn, which would be an inconsistent batch).
    """
    chex.assert_rank([turn_rewards, num_turns, turn_ids, policy_mask, group_ids], [2, 1, 2, 2, 1])
    b, k = turn_rewards.shape
    t = policy_mask.shape[1]
    chex.assert_shape([num_turns, group_ids, turn_ids, policy_mask], [(b,), (b,), (b, t), (b, t)])
    chex.assert_type([num_turns, turn_ids, group_ids, policy_mask], [int, int, int, bool])
    n = jnp.clip(num_turns, 0, k)
    real = jnp.arange(k)[None, :] < n[:, None]  # [B, K]
    r = jnp.where(real, jnp.asarray(turn_rewards, jnp.float32), 0.0)
    a_traj = group_normalize(r.sum(-1), group_ids, num_groups=num_groups, ddof=1, eps=eps)
    g = discounted_returns(r, n, gamma)
    a_turn = group_normalize(g, group_ids, mask=real, num_groups=num_groups, ddof=1, eps=eps)
    tok_real = policy_mask & (turn_ids >= 0) & (turn_ids < n[:, None])
    a_turn_tok = jnp.take_along_axis(a_turn, jnp.clip(turn_ids, 0, k - 1), axis=1)
    adv = jnp.where(tok_real, 0.5 * (a_traj[:, None] + a_turn_tok), 0.0)
    return {
        "advantages": adv,
        "trajectory_advantages": a_traj,
        "turn_advantages": a_turn,
        "returns": g,
    }


@functools.partial(jax.jit, static_argnames=("num_groups",))
def matchtir_advantages(
    turn_rewards: Array,
    num_turns: Array,
    turn_ids: Array,
    policy_mask: Array,
    group_ids: Array,
    *,
    gamma: float = 0.9,
    eps: float = 1e-6,
    num_groups: int | None = None,
) -> Array:
    """[B, T] MatchTIR token advantages; see `matchtir_advantage_parts` for the definition."""
    return matchtir_advantage_parts(
        turn_rewards, num_turns, turn_ids, policy_mask, group_ids,
        gamma=gamma, eps=eps, num_groups=num_groups,
    )["advantages"]


# ----------------------------------------------------------------------------------------------
# TurnSight
# ----------------------------------------------------------------------------------------------


_SELECT_VOTE, _SELECT_MEAN, _SELECT_FIXED = 0, 1, 2
_COVER_ALL, _COVER_FIRST, _COVER_LAST = 0, 1, 2


def _parse_turns(turns: str) -> tuple[int, int]:
    """"all" | "first:N" | "last:N" (N ≥ 1) → (coverage code, N)."""
    if turns == "all":
        return _COVER_ALL, 0
    kind, _, num = turns.partition(":")
    if kind in ("first", "last") and num.isdigit() and int(num) >= 1:
        return (_COVER_FIRST if kind == "first" else _COVER_LAST), int(num)
    raise ValueError(f"turns must be 'all', 'first:N' or 'last:N' with N >= 1, got {turns!r}")


def _parse_selection(selection: Any, num_depths: int) -> tuple[int, int]:
    """"vote" | "mean" | int depth index in [0, D) → (selection code, depth index)."""
    if selection == "vote":
        return _SELECT_VOTE, 0
    if selection == "mean":
        return _SELECT_MEAN, 0
    if (isinstance(selection, (int, np.integer)) and not isinstance(selection, (bool, np.bool_))
            and 0 <= selection < num_depths):
        return _SELECT_FIXED, int(selection)
    raise ValueError(
        f"selection must be 'vote', 'mean' or a depth index in [0, {num_depths}), got {selection!r}"
    )


def _select_depth(x: Array, sel_code: Array, fixed_depth: Array) -> tuple[Array, Array, Array]:
    """Direction-consistent depth selection over axis 0.

    x [D, N] f32, sel_code / fixed_depth int32 scalars → (x_star [N] f32, d_star [N] int32,
    agree [N] bool).
    vote: s = +1 if x ≥ 0 else −1; v = majority of s; on a tie (even D only) v = the sign of the
      depth sum (Σ_d x ≥ 0 → +1), so with D = 2 and opposite signs the larger-magnitude depth wins
      (and an exact magnitude tie goes to the non-negative one); d* = argmax_{d: s_d = v} |x_d|,
      equal magnitudes resolved to the lowest depth index. {d: s_d = v} is never empty: a tie
      with Σ x ≥ 0 has some x_d ≥ 0, and with Σ x < 0 some x_d < 0.
    mean (fusion): x_star = mean over depths; d_star = −1.
    fixed: x_star = x[fixed_depth]; d_star = fixed_depth.
    agree: all depths share one sign (for every mode, as a diagnostic).
    The three candidates are cheap next to the segment sums, so all are computed and one is picked
    with `where`: a Python-constant code folds away under an outer jit, and sweeping the selection
    ablation does not recompile.
    """
    s = jnp.where(x >= 0, 1, -1).astype(jnp.int32)
    agree = jnp.all(s == s[:1], axis=0)
    votes = jnp.sum(s, axis=0)
    tie_sign = jnp.where(jnp.sum(x, axis=0) >= 0, 1, -1)
    v = jnp.where(votes > 0, 1, jnp.where(votes < 0, -1, tie_sign))
    score = jnp.where(s == v[None], jnp.abs(x), -jnp.inf)
    d_vote = jnp.argmax(score, axis=0).astype(jnp.int32)  # argmax returns the first maximum
    x_vote = jnp.take_along_axis(x, d_vote[None], axis=0)[0]
    x_fixed = jnp.take(x, fixed_depth, axis=0)
    x_star = jnp.where(
        sel_code == _SELECT_VOTE, x_vote, jnp.where(sel_code == _SELECT_MEAN, jnp.mean(x, axis=0), x_fixed)
    )
    d_star = jnp.where(
        sel_code == _SELECT_VOTE, d_vote, jnp.where(sel_code == _SELECT_MEAN, -1, fixed_depth)
    ).astype(jnp.int32)
    return x_star, d_star, agree


def turnsight_advantages(
    delta: Array,
    policy_mask: Array,
    turn_ids: Array,
    group_ids: Array,
    base_adv: Array,
    *,
    lam: float = 0.5,
    eps_w: float = 0.5,
    eps: float = 1e-6,
    selection: str | int = "vote",
    aggregation: str = "turn",
    group_norm: bool = True,
    turns: str = "all",
    num_groups: int | None = None,
    max_turns: int | None = None,
) -> dict[str, Array]:
    """TurnSight mixed advantages Ã = A^base · ((1−λ) + λ·w) (SPEC §1 steps 4–8).

    Inputs: delta [D, B, T] float (upcast to float32), policy_mask [B, T] bool, turn_ids [B, T]
    int32 (−1 off policy), group_ids [B] int32, base_adv [B, T] float. delta and base_adv are
    wrapped in stop_gradient: advantages are constants of the surrogate (SPEC §1.3).
    Modes (`selection`, `aggregation`, `group_norm`, `turns`, `num_groups`, `max_turns`) are
    Python values, validated here; `lam`, `eps_w`, `eps` may be traced. Jit- and vmap-able.

    A policy token is *assigned* when 0 ≤ turn_id < max_turns. Assigned tokens form the
    (trajectory, turn) segments; unassigned policy tokens (an inconsistent batch) pass through
    with w = 1, Ã = A^base, and are counted in `num_unassigned_policy_tokens`. Values of delta,
    turn_ids and base_adv at non-policy positions are ignored entirely (even NaN/inf).

    Steps:
      aggregation="turn": δ̄^{(d)} = mean of δ^{(d)} over the turn's policy tokens (segment sums).
      aggregation="token" (w/o-aggregation ablation): every assigned token is its own unit, δ̄ = δ.
      selection per unit: "vote" (SPEC §1.5; tie rule in `_select_depth`: an even split goes to
        the sign of the depth sum, ≥ 0 → +1), "mean" (fusion: depth average; d* = −1), or an int
        depth index i (δ̄* = δ̄^{(i)}, d* = i).
      group_norm=True: μ_g, σ_g = mean and population std (ddof=0) of δ̄* over every assigned
        policy token of group g (token-weighted: a turn counts once per token), δ̂ = (δ̄*−μ)/(σ+eps).
        A group whose δ̄* are all equal gives δ̂ = 0 exactly (shifted accumulation); values equal
        only up to float32 round-off leave σ ~ 1e-7·|δ̄*|, which eps = 1e-6 need not absorb.
        group_norm=False: δ̂ = δ̄*.
      w = 1 + eps_w·tanh(sign(A^base)·δ̂); sign(A^base) = 0 gives w = 1 (tanh 0).
      turns: "all" | "first:N" (turn id < N) | "last:N" (turn id ≥ n_i − N, n_i = 1 + the largest
        turn id among trajectory i's assigned policy tokens). Tokens of turns outside get w = 1.
        Coverage only masks the weight: selection and group statistics still use all turns.
      Ã = A^base + A^base·λ·(w − 1), algebraically A^base·((1−λ) + λ·w) but exact when λ = 0 or
        w = 1. With 0 ≤ λ ≤ 1 and eps_w < 1 the factor is > 0, so sign(Ã) = sign(A^base) (for
        normal floats: XLA flushes float32 subnormals to zero on CPU and GPU).
      Off policy tokens: advantages 0, weights 1, selected_depth −1, delta_bar = delta_hat = 0.

    max_turns bounds turn ids and sizes the B·max_turns segment sums. None uses T (a turn has ≥ 1
    token), which is always safe but makes the [B·T, D] segment buffers as large as delta itself
    instead of [B·K, D]; pass the rollout's max turns when known.

    Returns a dict:
      advantages [B, T] f32 (Ã); weights [B, T] f32 (w); selected_depth [B, T] int32 (d*, −1 off
      policy / unassigned / selection="mean"); delta_bar [B, T] (δ̄* per token); delta_hat [B, T]
      (δ̂ per token); group_mean, group_std [G] (μ_g, σ_g of δ̄*; 0 for empty groups, reported even
      when group_norm=False); diagnostics (scalars unless noted):
        agreement_rate: fraction of selection units where all D depths share one sign — units are
          non-empty turns for aggregation="turn" and assigned policy tokens for "token".
        depth_histogram [D] int32: count of selection units per selected depth (zeros for "mean").
        num_units: the denominator of the two above.
        weight_mean / weight_min / weight_max over all policy tokens (1 if there are none).
        frac_turns_amplified / frac_turns_damped: fraction of non-empty turns whose token-mean
          weight is > 1 / < 1 (0 if there are no turns).
        num_unassigned_policy_tokens: policy tokens whose turn id is outside [0, max_turns).
    """
    chex.assert_rank([delta, policy_mask, turn_ids, group_ids, base_adv], [3, 2, 2, 1, 2])
    num_depths, b, t = delta.shape
    chex.assert_shape(
        [policy_mask, turn_ids, group_ids, base_adv], [(b, t), (b, t), (b,), (b, t)]
    )
    chex.assert_type([delta, policy_mask, turn_ids, group_ids, base_adv], [float, bool, int, int, float])
    sel_code, fixed_depth = _parse_selection(selection, num_depths)
    if aggregation not in ("turn", "token"):
        raise ValueError(f"aggregation must be 'turn' or 'token', got {aggregation!r}")
    if not isinstance(group_norm, (bool, np.bool_)):
        raise ValueError(f"group_norm must be a bool, got {group_norm!r}")
    cover_code, cover_n = _parse_turns(turns)
    max_turns = t if max_turns is None else int(max_turns)
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    num_groups = b if num_groups is None else int(num_groups)
    # Only `aggregation` and the segment sizes change the program's structure; the other modes
    # travel as int32 scalars so an ablation sweep reuses one executable (under an outer jit they
    # are constants and fold away).
    modes = np.asarray([sel_code, fixed_depth, int(group_norm), cover_code, cover_n], np.int32)
    return _turnsight_impl(
        delta, policy_mask, turn_ids, group_ids, base_adv, modes, lam, eps_w, eps,
        aggregation=aggregation, num_groups=num_groups, max_turns=max_turns,
    )


@functools.partial(jax.jit, static_argnames=("aggregation", "num_groups", "max_turns"))
def _turnsight_impl(
    delta, policy_mask, turn_ids, group_ids, base_adv, modes, lam, eps_w, eps,
    *, aggregation: str, num_groups: int, max_turns: int,
) -> dict[str, Array]:
    """Body of `turnsight_advantages`; modes = [sel_code, fixed_depth, group_norm, cover_code, N]."""
    sel_code, fixed_depth, group_norm, cover_code, cover_n = (modes[i] for i in range(5))
    num_depths, b, t = delta.shape
    k = max_turns

    # Sanitise first: nothing outside the assigned policy tokens may reach any arithmetic (0·NaN
    # is NaN), so non-policy garbage provably changes nothing.
    assigned = policy_mask & (turn_ids >= 0) & (turn_ids < k)  # [B, T]
    delta = jax.lax.stop_gradient(jnp.asarray(delta, jnp.float32))
    delta = jnp.where(assigned[None], delta, 0.0)  # [D, B, T]
    base = jax.lax.stop_gradient(jnp.where(policy_mask, jnp.asarray(base_adv, jnp.float32), 0.0))
    tid = jnp.where(assigned, turn_ids, 0)

    # (trajectory, turn) segment ids; unassigned tokens go to a trash segment n_seg.
    n_seg = b * k
    seg = jnp.where(assigned, jnp.arange(b, dtype=jnp.int32)[:, None] * k + tid, n_seg)  # [B, T]
    seg_flat = seg.reshape(-1)
    tok_count = jax.ops.segment_sum(
        assigned.reshape(-1).astype(jnp.float32), seg_flat, num_segments=n_seg + 1
    )[:n_seg]  # [B·K]
    nonempty = tok_count > 0

    if aggregation == "turn":
        # Sum δ and a per-depth token count in one scatter. The count is carried as D columns
        # rather than broadcast from tok_count because XLA rewrites x / broadcast(n) into
        # x * broadcast(1/n), which is not exact: a constant turn would get a mean 1 ulp off its
        # value, and a constant group a spurious σ ~ 1e-8 that eps does not fully absorb.
        flat = delta.reshape(num_depths, -1).T  # [B·T, D]
        ones = jnp.broadcast_to(assigned.reshape(-1, 1), flat.shape).astype(jnp.float32)
        acc = jax.ops.segment_sum(
            jnp.concatenate([flat, ones], axis=1), seg_flat, num_segments=n_seg + 1
        )[:n_seg]  # [B·K, 2D]
        turn_mean = acc[:, :num_depths] / jnp.maximum(acc[:, num_depths:], 1.0)  # [B·K, D]
        x_star_u, d_star_u, agree_u = _select_depth(turn_mean.T, sel_code, fixed_depth)  # [B·K]
        unit_mask = nonempty
        # Gather turn values back to tokens; the trash segment reads (0, −1).
        x_star = jnp.concatenate([x_star_u, jnp.zeros((1,), jnp.float32)])[seg]
        d_star = jnp.concatenate([d_star_u, jnp.full((1,), -1, jnp.int32)])[seg]
    else:
        x_star_u, d_star_u, agree_u = _select_depth(
            delta.reshape(num_depths, -1), sel_code, fixed_depth
        )  # [B·T]
        unit_mask = assigned.reshape(-1)
        x_star = x_star_u.reshape(b, t)
        d_star = d_star_u.reshape(b, t)
    x_star = jnp.where(assigned, x_star, 0.0)
    d_star = jnp.where(assigned, d_star, -1)

    # Token-weighted group statistics of δ̄* (population std).
    count_g, mean_g, dev = _pooled_group_stats(x_star, assigned, group_ids, num_groups)
    var_g = jax.ops.segment_sum(jnp.sum(dev * dev, axis=1), group_ids, num_segments=num_groups)
    std_g = jnp.sqrt(var_g / jnp.maximum(count_g, 1.0))
    std_b = _group_gather(std_g, group_ids, num_groups)[:, None]
    # dev is 0 for ungrouped trajectories, so their normalised δ̂ is 0 (w = 1).
    d_hat = jnp.where(group_norm == 1, jnp.where(assigned, dev / (std_b + eps), 0.0), x_star)

    n_turns = jnp.max(jnp.where(assigned, turn_ids, -1), axis=1, keepdims=True) + 1  # [B, 1]
    in_window = jnp.where(
        cover_code == _COVER_FIRST,
        turn_ids < cover_n,
        jnp.where(cover_code == _COVER_LAST, turn_ids >= n_turns - cover_n, True),
    )
    covered = assigned & in_window

    w = jnp.where(covered, 1.0 + eps_w * jnp.tanh(jnp.sign(base) * d_hat), 1.0)
    adv = jnp.where(policy_mask, base + base * (lam * (w - 1.0)), 0.0)

    # ---- diagnostics ----
    n_units = jnp.sum(unit_mask)
    agreement = jnp.sum(agree_u & unit_mask) / jnp.maximum(n_units, 1)
    hist = jnp.sum(
        (d_star_u[None, :] == jnp.arange(num_depths, dtype=jnp.int32)[:, None]) & unit_mask[None, :],
        axis=1,
    ).astype(jnp.int32)
    n_pol = jnp.sum(policy_mask)
    has_pol = n_pol > 0
    w_mean = jnp.where(has_pol, jnp.sum(jnp.where(policy_mask, w, 0.0)) / jnp.maximum(n_pol, 1), 1.0)
    w_min = jnp.where(has_pol, jnp.min(jnp.where(policy_mask, w, jnp.inf)), 1.0)
    w_max = jnp.where(has_pol, jnp.max(jnp.where(policy_mask, w, -jnp.inf)), 1.0)
    turn_w = jax.ops.segment_sum(
        jnp.where(assigned, w, 0.0).reshape(-1), seg_flat, num_segments=n_seg + 1
    )[:n_seg] / jnp.maximum(tok_count, 1.0)
    n_turns_total = jnp.maximum(jnp.sum(nonempty), 1)
    return {
        "advantages": adv,
        "weights": w,
        "selected_depth": d_star,
        "delta_bar": x_star,
        "delta_hat": d_hat,
        "group_mean": mean_g,
        "group_std": std_g,
        "agreement_rate": agreement,
        "depth_histogram": hist,
        "num_units": n_units.astype(jnp.int32),
        "weight_mean": w_mean,
        "weight_min": w_min,
        "weight_max": w_max,
        "frac_turns_amplified": jnp.sum(nonempty & (turn_w > 1.0)) / n_turns_total,
        "frac_turns_damped": jnp.sum(nonempty & (turn_w < 1.0)) / n_turns_total,
        "num_unassigned_policy_tokens": jnp.sum(policy_mask & ~assigned).astype(jnp.int32),
    }


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

ADVANTAGE_FNS: dict[str, Callable[..., Array]] = {}
# Batch keys each base estimator reads, in its positional order.
ADVANTAGE_INPUTS: dict[str, tuple[str, ...]] = {}


def register_advantage(name: str, inputs: tuple[str, ...]):
    """Decorator: register a base estimator `fn(*batch[inputs], **kwargs) -> [B, T]` by name."""

    def deco(fn):
        if name in ADVANTAGE_FNS:
            raise ValueError(f"advantage estimator {name!r} already registered")
        ADVANTAGE_FNS[name] = fn
        ADVANTAGE_INPUTS[name] = tuple(inputs)
        return fn

    return deco


register_advantage("grpo", ("rewards", "group_ids", "policy_mask"))(grpo_advantages)
register_advantage(
    "matchtir", ("turn_rewards", "num_turns", "turn_ids", "policy_mask", "group_ids")
)(matchtir_advantages)


def compute_base_advantages(name: str, batch: Mapping[str, Array], **kwargs) -> Array:
    """Run the registered base estimator `name` on the arrays it needs from `batch` → [B, T]."""
    if name not in ADVANTAGE_FNS:
        raise KeyError(f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_FNS)}")
    missing = [key for key in ADVANTAGE_INPUTS[name] if key not in batch]
    if missing:
        raise KeyError(f"advantage estimator {name!r} needs batch keys {missing}")
    return ADVANTAGE_FNS[name](*(batch[key] for key in ADVANTAGE_INPUTS[name]), **kwargs)


def make_advantage_fn(
    base: str,
    *,
    base_kwargs: Mapping[str, Any] | None = None,
    turnsight: Mapping[str, Any] | None = None,
) -> Callable[[Mapping[str, Array]], dict[str, Array]]:
    """Build `fn(batch) -> dict` for a train step, chosen by config.

    base: a registered base estimator name ("grpo", "matchtir"). turnsight: None for the plain
    base estimator, else the keyword arguments of `turnsight_advantages`; the batch must then also
    hold "delta" [D, B, T] (and "turn_ids", "group_ids", "policy_mask"). The dict always has
    "advantages" (what the surrogate uses) and "base_advantages"; with TurnSight it also carries
    every TurnSight output. Unknown names fail here, at build time, not inside the step.
    """
    if base not in ADVANTAGE_FNS:
        raise KeyError(f"unknown advantage estimator {base!r}; known: {sorted(ADVANTAGE_FNS)}")
    base_kwargs = dict(base_kwargs or {})
    ts_kwargs = None if turnsight is None else dict(turnsight)

    def fn(batch: Mapping[str, Array]) -> dict[str, Array]:
        a_base = compute_base_advantages(base, batch, **base_kwargs)
        if ts_kwargs is None:
            return {"advantages": a_base, "base_advantages": a_base}
        out = turnsight_advantages(
            batch["delta"], batch["policy_mask"], batch["turn_ids"], batch["group_ids"], a_base,
            **ts_kwargs,
        )
        return {**out, "base_advantages": a_base}

    return fn
