"""TurnSight: turn-level hindsight weighting of a base advantage (docs/spec.md §1 steps 4-8).

Pure `jax.numpy`, jit- and vmap-able; shapes as in turnsight_jax.rl.advantages:
delta [D, B, T] (teacher minus student log-prob per hindsight depth), policy_mask / turn_ids [B, T],
group_ids [B], base advantages [B, T].
"""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from turnsight_jax.rl.config import parse_turn_coverage
from turnsight_jax.rl.groups import group_gather, pooled_group_stats
from turnsight_jax.rl.horizon import dependency_horizon, depth_index, saturation_index

Array = jax.Array

_SELECT_VOTE, _SELECT_MEAN, _SELECT_FIXED, _SELECT_DEPENDENCY, _SELECT_SATURATION = 0, 1, 2, 3, 4
_ADAPTIVE = {"dependency": _SELECT_DEPENDENCY, "saturation": _SELECT_SATURATION}
_COVER_ALL, _COVER_FIRST, _COVER_LAST = 0, 1, 2
_POOL_TURN_MEAN, _POOL_TOKEN_GAP, _POOL_PER_TURN = 0, 1, 2
_POOLS = {"turn_mean": _POOL_TURN_MEAN, "token_gap": _POOL_TOKEN_GAP, "per_turn": _POOL_PER_TURN}
_EMPTY_BLOCK = {"weighted": 0, "excluded": 1}


def parse_turns(turns: str) -> tuple[int, int]:
    """"all" | "first:N" | "last:N" (N ≥ 1) → (coverage code, N); the spec is read by
    rl.config.parse_turn_coverage, the one parser of it."""
    kind, n = parse_turn_coverage(turns)
    return {"all": _COVER_ALL, "first": _COVER_FIRST, "last": _COVER_LAST}[kind], n


def _parse_selection(selection: Any, num_depths: int) -> tuple[int, int]:
    """"vote" | "mean" | "dependency" | "saturation" | int depth index in [0, D) → (selection
    code, depth index)."""
    if selection == "vote":
        return _SELECT_VOTE, 0
    if selection == "mean":
        return _SELECT_MEAN, 0
    if isinstance(selection, str) and selection in _ADAPTIVE:
        return _ADAPTIVE[selection], 0
    if (isinstance(selection, (int, np.integer)) and not isinstance(selection, (bool, np.bool_))
            and 0 <= selection < num_depths):
        return _SELECT_FIXED, int(selection)
    raise ValueError(
        f"selection must be 'vote', 'mean', 'dependency', 'saturation' or a depth index in [0, {num_depths}), "
        f"got {selection!r}"
    )


def _select_depth(x: Array, sel_code: Array, fixed_depth: Array) -> tuple[Array, Array, Array]:
    """Direction-consistent depth selection over axis 0.

    x [D, N] f32, sel_code int32 scalar, fixed_depth int32 scalar or [N] (per unit: the adaptive
    rules' choice, rl.horizon) → (x_star [N] f32, d_star [N] int32, agree [N] bool).
    vote: s = +1 if x ≥ 0 else −1; v = majority of s; on a tie (even D only) v = the sign of the
      depth sum (Σ_d x ≥ 0 → +1), so with D = 2 and opposite signs the larger-magnitude depth wins
      (and an exact magnitude tie goes to the non-negative one); d* = argmax_{d: s_d = v} |x_d|,
      equal magnitudes resolved to the lowest depth index. {d: s_d = v} is never empty: a tie
      with Σ x ≥ 0 has some x_d ≥ 0, and with Σ x < 0 some x_d < 0.
    mean (fusion): x_star = mean over depths; d_star = −1.
    fixed, dependency, saturation: x_star = x[fixed_depth]; d_star = fixed_depth (a scalar for a
      fixed index, per unit for the adaptive rules).
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
    fixed_depth = jnp.broadcast_to(jnp.asarray(fixed_depth, jnp.int32), d_vote.shape)
    x_fixed = jnp.take_along_axis(x, fixed_depth[None], axis=0)[0]
    x_star = jnp.where(
        sel_code == _SELECT_VOTE, x_vote, jnp.where(sel_code == _SELECT_MEAN, jnp.mean(x, axis=0), x_fixed)
    )
    d_star = jnp.where(
        sel_code == _SELECT_VOTE, d_vote, jnp.where(sel_code == _SELECT_MEAN, -1, fixed_depth)
    ).astype(jnp.int32)
    return x_star, d_star, agree


def _unit_depth(x: Array, horizon: Array, sel_code: Array, fixed_depth: Array, depths: tuple[int, ...],
                horizon_tol) -> Array:
    """The depth index per unit [U] for the modes that read one (fixed, dependency, saturation),
    from x [D, U] (the units' mean gaps) and horizon [U] (the dependency rule's h)."""
    return jnp.where(sel_code == _SELECT_DEPENDENCY, depth_index(horizon, depths),
                     jnp.where(sel_code == _SELECT_SATURATION, saturation_index(x, depths, horizon_tol),
                               fixed_depth)).astype(jnp.int32)


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
    norm_pool: str = "turn_mean",
    uncovered_in_stats: bool = True,
    empty_block_turns: str = "weighted",
    teacher_covered: Array | None = None,
    num_groups: int | None = None,
    max_turns: int | None = None,
    depths: tuple[int, ...] | None = None,
    horizon_tol: float = 0.05,
    turn_uses: Array | None = None,
) -> dict[str, Array]:
    """TurnSight mixed advantages Ã = A^base · ((1−λ) + λ·w) (docs/spec.md §1 steps 4–8).

    Inputs: delta [D, B, T] float (upcast to float32), policy_mask [B, T] bool, turn_ids [B, T]
    int32 (−1 off policy), group_ids [B] int32, base_adv [B, T] float. delta and base_adv are
    wrapped in stop_gradient: advantages are constants of the surrogate (docs/spec.md §1.3).
    Modes (`selection`, `aggregation`, `group_norm`, `turns`, `norm_pool`, `uncovered_in_stats`,
    `empty_block_turns`, `num_groups`, `max_turns`) are Python values, validated here; `lam`, `eps_w`, `eps` may be traced. Jit- and vmap-able.

    A policy token is *assigned* when 0 ≤ turn_id < max_turns. Assigned tokens form the
    (trajectory, turn) segments; unassigned policy tokens (an inconsistent batch) pass through
    with w = 1, Ã = A^base, and are counted in `num_unassigned_policy_tokens`. Values of delta,
    turn_ids and base_adv at non-policy positions are ignored entirely (even NaN/inf).

    Steps:
      aggregation="turn": δ̄^{(d)} = mean of δ^{(d)} over the turn's policy tokens (segment sums).
      aggregation="token" (w/o-aggregation ablation): every assigned token is its own unit, δ̄ = δ.
      selection per unit: "vote" (docs/spec.md §1.5; tie rule in `_select_depth`: an even split goes to
        the sign of the depth sum, ≥ 0 → +1), "mean" (fusion: depth average; d* = −1), an int
        depth index i (δ̄* = δ̄^{(i)}, d* = i), or an adaptive horizon (rl.horizon): "dependency"
        (d* = the smallest configured depth covering the turn's dependency horizon h, from
        `turn_uses` [B, K, K] bool; required), "saturation" (d* = the first depth, in increasing
        order, whose next depth moves δ̄ by at most `horizon_tol`). `depths`: the configured depth
        values (rows of delta; default 1..D), which the adaptive rules order and compare.
      group_norm=True: μ_g, σ_g = mean and population std (ddof=0) of the pooled values over every
        assigned policy token of group g (token-weighted: a turn counts once per token), and
        δ̂ = (δ̄*−μ)/(σ+eps). The pooled value of a token (`norm_pool`): "turn_mean" its δ̄*
        (default), "token_gap" its raw gap at its unit's selected depth, δ^{(d*)}_{i,t} (the depth
        mean for selection="mean"; the same as "turn_mean" under aggregation="token").
        "per_turn": one value per (trajectory, turn), whatever its length: its δ̄* (under
        aggregation="token", the mean of its tokens' δ̄*), μ_g and σ_g over the group's turns.
        `uncovered_in_stats`=False pools only the tokens of covered turns (see `turns`).
      empty_block_turns: "weighted" (default) treats a turn whose hindsight block was empty like
        any other (its δ̄ is then the reference-vs-current gap on the student's own context);
        "excluded": such a covered turn gets w = 1 exactly and leaves the group statistics. Which
        turns had a block: `teacher_covered` [B, T] bool (the step's "teacher_covered": False on
        the tokens of a turn scored on its own context); required for "excluded".
        A group whose δ̄* are all equal gives δ̂ = 0 exactly (shifted accumulation); values equal
        only up to float32 round-off leave σ ~ 1e-7·|δ̄*|, which eps = 1e-6 need not absorb.
        group_norm=False: δ̂ = δ̄*.
      w = 1 + eps_w·tanh(sign(A^base)·δ̂); sign(A^base) = 0 gives w = 1 (tanh 0).
      turns: "all" | "first:N" (turn id < N) | "last:N" (turn id ≥ n_i − N, n_i = 1 + the largest
        turn id among trajectory i's assigned policy tokens). Tokens of turns outside get w = 1.
        Coverage masks the weight; selection always uses all turns, and the group statistics do
        too unless uncovered_in_stats=False.
      Ã = A^base + A^base·λ·(w − 1), algebraically A^base·((1−λ) + λ·w) but exact when λ = 0 or
        w = 1. With 0 ≤ λ ≤ 1 and eps_w < 1 the factor is > 0, so sign(Ã) = sign(A^base) (for
        normal floats: XLA flushes float32 subnormals to zero on CPU and GPU).
      Off policy tokens: advantages 0, weights 1, selected_depth −1, delta_bar = delta_hat = 0.

    max_turns bounds turn ids and sizes the B·max_turns segment sums. None uses T (a turn has ≥ 1
    token), which is always safe but makes the [B·T, D] segment buffers as large as delta itself
    instead of [B·K, D]; pass the rollout's max turns when known.

    Returns a dict:
      advantages [B, T] f32 (Ã); weights [B, T] f32 (w); selected_depth [B, T] int32 (d*, −1 off
      policy / unassigned / selection="mean"); horizon [B, T] int32 (the dependency rule's h of
      the token's turn, with `turn_uses`; −1 off policy, and everywhere without it); delta_bar [B, T]
      (δ̄* per token); delta_hat [B, T] (δ̂ per token); depth_turn_means [D, B, K] (δ̄^{(d)} of every
      (trajectory, turn k) segment, the values the vote reads under aggregation="turn"; 0 for empty
      turns); group_mean, group_std [G] (μ_g, σ_g of the pool rl.norm_pool names; 0 for empty groups, reported even when
      group_norm=False); diagnostics (scalars unless noted):
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
    cover_code, cover_n = parse_turns(turns)
    if norm_pool not in _POOLS:
        raise ValueError(f"norm_pool must be one of {tuple(_POOLS)}, got {norm_pool!r}")
    if not isinstance(uncovered_in_stats, (bool, np.bool_)):
        raise ValueError(f"uncovered_in_stats must be a bool, got {uncovered_in_stats!r}")
    if empty_block_turns not in _EMPTY_BLOCK:
        raise ValueError(f"empty_block_turns must be one of {tuple(_EMPTY_BLOCK)}, got {empty_block_turns!r}")
    if empty_block_turns == "excluded" and teacher_covered is None:
        raise ValueError("empty_block_turns='excluded' needs teacher_covered [B, T] (which turns showed a block)")
    if teacher_covered is None:
        teacher_covered = jnp.ones((b, t), bool)
    chex.assert_shape(teacher_covered, (b, t))
    max_turns = t if max_turns is None else int(max_turns)
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    depths = tuple(range(1, num_depths + 1)) if depths is None else tuple(int(d) for d in depths)
    if len(depths) != num_depths:
        raise ValueError(f"depths {depths} name {len(depths)} depths but delta has {num_depths}")
    if sel_code == _SELECT_DEPENDENCY and turn_uses is None:
        raise ValueError("selection='dependency' needs turn_uses [B, K, K] (rl.horizon.dependency_batch)")
    if turn_uses is not None:
        chex.assert_shape(turn_uses, (b, max_turns, max_turns))
    num_groups = b if num_groups is None else int(num_groups)
    # Only `aggregation` and the segment sizes change the program's structure; the other modes
    # travel as int32 scalars so an ablation sweep reuses one executable (under an outer jit they
    # are constants and fold away).
    modes = np.asarray([sel_code, fixed_depth, int(group_norm), cover_code, cover_n, _POOLS[norm_pool],
                        int(uncovered_in_stats), _EMPTY_BLOCK[empty_block_turns]], np.int32)
    return _turnsight_impl(
        delta, policy_mask, turn_ids, group_ids, base_adv, modes, lam, eps_w, eps, horizon_tol, turn_uses,
        jnp.asarray(teacher_covered, bool),
        aggregation=aggregation, num_groups=num_groups, max_turns=max_turns, depths=depths,
    )


@functools.partial(jax.jit, static_argnames=("aggregation", "num_groups", "max_turns", "depths"))
def _turnsight_impl(
    delta, policy_mask, turn_ids, group_ids, base_adv, modes, lam, eps_w, eps, horizon_tol, turn_uses, block,
    *, aggregation: str, num_groups: int, max_turns: int, depths: tuple[int, ...],
) -> dict[str, Array]:
    """Body of `turnsight_advantages`; modes = [sel_code, fixed_depth, group_norm, cover_code, N,
    pool code, uncovered_in_stats, empty-block code]; block [B, T]: the tokens whose view showed
    a hindsight block."""
    sel_code, fixed_depth, group_norm, cover_code, cover_n, pool, uncovered_in_stats, empty_mode = (
        modes[i] for i in range(8))
    num_depths, b, t = delta.shape
    k = max_turns

    # Sanitise first: nothing outside the assigned policy tokens may reach any arithmetic (0·NaN
    # is NaN), so non-policy garbage provably changes nothing.
    assigned = policy_mask & (turn_ids >= 0) & (turn_ids < k)  # [B, T]
    delta = jax.lax.stop_gradient(jnp.asarray(delta, jnp.float32))
    delta = jnp.where(assigned[None], delta, 0.0)  # [D, B, T]
    base = jax.lax.stop_gradient(jnp.where(policy_mask, jnp.asarray(base_adv, jnp.float32), 0.0))
    tid = jnp.where(assigned, turn_ids, 0)

    # The dependency rule's horizon per (trajectory, turn) [B, K] (1 everywhere without turn_uses).
    horizon = jnp.ones((b, k), jnp.int32) if turn_uses is None else dependency_horizon(turn_uses)

    # (trajectory, turn) segment ids; unassigned tokens go to a trash segment n_seg.
    n_seg = b * k
    seg = jnp.where(assigned, jnp.arange(b, dtype=jnp.int32)[:, None] * k + tid, n_seg)  # [B, T]
    seg_flat = seg.reshape(-1)
    tok_count = jax.ops.segment_sum(
        assigned.reshape(-1).astype(jnp.float32), seg_flat, num_segments=n_seg + 1
    )[:n_seg]  # [B·K]
    nonempty = tok_count > 0

    # Sum δ and a per-depth token count in one scatter. The count is carried as D columns
    # rather than broadcast from tok_count because XLA rewrites x / broadcast(n) into
    # x * broadcast(1/n), which is not exact: a constant turn would get a mean 1 ulp off its
    # value, and a constant group a spurious σ ~ 1e-8 that eps does not fully absorb. (Computed
    # for aggregation="token" too: the per-depth turn means are an output, dropped by the
    # compiler when unused.)
    flat = delta.reshape(num_depths, -1).T  # [B·T, D]
    ones = jnp.broadcast_to(assigned.reshape(-1, 1), flat.shape).astype(jnp.float32)
    acc = jax.ops.segment_sum(
        jnp.concatenate([flat, ones], axis=1), seg_flat, num_segments=n_seg + 1
    )[:n_seg]  # [B·K, 2D]
    turn_mean = acc[:, :num_depths] / jnp.maximum(acc[:, num_depths:], 1.0)  # [B·K, D]
    if aggregation == "turn":
        pick = _unit_depth(turn_mean.T, horizon.reshape(-1), sel_code, fixed_depth, depths, horizon_tol)
        x_star_u, d_star_u, agree_u = _select_depth(turn_mean.T, sel_code, pick)  # [B·K]
        unit_mask = nonempty
        # Gather turn values back to tokens; the trash segment reads (0, −1).
        x_star = jnp.concatenate([x_star_u, jnp.zeros((1,), jnp.float32)])[seg]
        d_star = jnp.concatenate([d_star_u, jnp.full((1,), -1, jnp.int32)])[seg]
    else:
        x_units = delta.reshape(num_depths, -1)
        h_tok = jnp.take_along_axis(horizon, tid, axis=1)  # each token its turn's horizon
        pick = _unit_depth(x_units, h_tok.reshape(-1), sel_code, fixed_depth, depths, horizon_tol)
        x_star_u, d_star_u, agree_u = _select_depth(x_units, sel_code, pick)  # [B·T]
        unit_mask = assigned.reshape(-1)
        x_star = x_star_u.reshape(b, t)
        d_star = d_star_u.reshape(b, t)
    x_star = jnp.where(assigned, x_star, 0.0)
    d_star = jnp.where(assigned, d_star, -1)

    n_turns = jnp.max(jnp.where(assigned, turn_ids, -1), axis=1, keepdims=True) + 1  # [B, 1]
    in_window = jnp.where(
        cover_code == _COVER_FIRST,
        turn_ids < cover_n,
        jnp.where(cover_code == _COVER_LAST, turn_ids >= n_turns - cover_n, True),
    )
    covered = assigned & in_window
    # rl.empty_block_turns="excluded": covered turns scored on their own context (an empty block)
    # get w = 1 and leave the group statistics
    empty = (empty_mode == 1) & covered & ~block
    weighted = covered & ~empty

    # Group statistics (population std) of the pooled values, token-weighted: δ̄* itself, or each
    # token's raw gap at its unit's selected depth; over every assigned token, or the covered ones.
    token_gap = jnp.where(d_star >= 0, jnp.take_along_axis(delta, jnp.maximum(d_star, 0)[None], axis=0)[0],
                          jnp.mean(delta, axis=0))
    pooled = jnp.where(pool == _POOL_TOKEN_GAP, jnp.where(assigned, token_gap, 0.0), x_star)
    in_stats = jnp.where(uncovered_in_stats == 1, assigned, covered) & ~empty
    count_g, mean_g, dev = pooled_group_stats(pooled, in_stats, group_ids, num_groups)
    var_g = jax.ops.segment_sum(jnp.sum(dev * dev, axis=1), group_ids, num_segments=num_groups)
    # or one value per (trajectory, turn) (norm_pool="per_turn"): the turn's δ̄* (its tokens' mean
    # of δ̄* under aggregation="token"), in the statistics when its tokens are
    if aggregation == "turn":
        turn_val = x_star_u
    else:
        turn_val = jax.ops.segment_sum(x_star.reshape(-1), seg_flat, num_segments=n_seg + 1)[:n_seg] / \
            jnp.maximum(tok_count, 1.0)
    turn_in = jax.ops.segment_sum(in_stats.reshape(-1).astype(jnp.float32), seg_flat,
                                  num_segments=n_seg + 1)[:n_seg] > 0
    count_t, mean_t, dev_t = pooled_group_stats(turn_val.reshape(b, k), turn_in.reshape(b, k), group_ids, num_groups)
    var_t = jax.ops.segment_sum(jnp.sum(dev_t * dev_t, axis=1), group_ids, num_segments=num_groups)
    per_turn = pool == _POOL_PER_TURN
    mean_g = jnp.where(per_turn, mean_t, mean_g)
    std_g = jnp.where(per_turn, jnp.sqrt(var_t / jnp.maximum(count_t, 1.0)),
                      jnp.sqrt(var_g / jnp.maximum(count_g, 1.0)))
    std_b = group_gather(std_g, group_ids, num_groups)[:, None]
    # δ̄* − μ: where δ̄* is the pooled value itself, the shifted-accumulation deviation (exactly 0
    # for a constant group); elsewhere centred directly. Ungrouped trajectories get 0 (w = 1).
    in_group = ((group_ids >= 0) & (group_ids < num_groups))[:, None]
    mean_b = group_gather(mean_g, group_ids, num_groups)[:, None]
    direct = jnp.where(assigned & in_group, x_star - mean_b, 0.0)
    if aggregation == "turn":  # a token's δ̄* is its turn's value: the per-turn deviation, gathered
        dev_tok = jnp.concatenate([dev_t.reshape(-1), jnp.zeros((1,), jnp.float32)])[seg]
        direct = jnp.where(per_turn & in_stats, dev_tok, direct)
    centred = jnp.where((pool == _POOL_TURN_MEAN) & in_stats, dev, direct)
    d_hat = jnp.where(group_norm == 1, jnp.where(assigned, centred / (std_b + eps), 0.0), x_star)

    w = jnp.where(weighted, 1.0 + eps_w * jnp.tanh(jnp.sign(base) * d_hat), 1.0)
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
    h_out = jnp.where(assigned, jnp.take_along_axis(horizon, tid, axis=1), -1) if turn_uses is not None \
        else jnp.full((b, t), -1, jnp.int32)
    return {
        "advantages": adv,
        "weights": w,
        "selected_depth": d_star,
        "horizon": h_out,
        "delta_bar": x_star,
        "delta_hat": d_hat,
        "depth_turn_means": jnp.moveaxis(turn_mean.reshape(b, k, num_depths), 2, 0),
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


