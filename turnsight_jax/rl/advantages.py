"""Advantage estimators (GRPO, MatchTIR dual-level), their registry, and the one composition the
step uses (`make_advantage_fn`). TurnSight is in turnsight_jax.rl.turnsight and registered here.

Everything here is pure `jax.numpy`: no Python loops over tokens, turns or trajectories, no host
round-trips, so every function can be jitted, vmapped over a leading batch-of-batches axis and
fused into the train step (docs/spec.md §4). Modes are static keyword-only Python values; numeric knobs
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

import dataclasses
import functools
from typing import Any, Callable, Mapping

import chex
import jax
import jax.numpy as jnp

from turnsight_jax.rl.config import MATCHTIR_SINGLETONS
from turnsight_jax.rl.groups import group_gather, group_normalize
from turnsight_jax.rl.turnsight import turnsight_advantages

Array = jax.Array

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


def _singleton_raw(values: Array, normalised: Array, group_ids: Array, mask: Array, num_groups: int,
                   eps: float) -> Array:
    """`normalised` with every entry that is alone in its pool (the only masked member of its group,
    per trailing position) replaced by (value − 0) / (1 + eps): the released code's mean 0, std 1 for
    a pool of one. values / normalised / mask: [B] or [B, K]; group_ids [B]."""
    count = jax.ops.segment_sum(mask.astype(jnp.float32), group_ids, num_segments=num_groups)
    alone = mask & (group_gather(count, group_ids, num_groups) == 1)  # 0 for ungrouped rows
    return jnp.where(alone, jnp.asarray(values, jnp.float32) / (1.0 + eps), normalised)


@functools.partial(jax.jit, static_argnames=("num_groups", "singleton"))
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
    singleton: str = "zero",
) -> dict[str, Array]:
    """MatchTIR dual-level advantages with their components.

    turn_rewards [B, K] float32, num_turns [B] int32 (turns 0..num_turns−1 are real; clipped to K),
    turn_ids [B, T] int32, policy_mask [B, T] bool, group_ids [B] int32.
    singleton (static): what a pool of one gets, a group of one trajectory (trajectory level) or
      a (group, turn k) that only one sibling reaches (turn level): "zero" (default) advantage 0,
      no sibling to compare with; "raw" normalisation with mean 0, std 1, i.e. value / (1 + eps),
      the released MatchTIR code (rl.config.MATCHTIR_SINGLETONS; config key rl.matchtir_singleton).
    Returns:
      trajectory_advantages [B]: group-normalised (ddof=1, eps) Σ_k r_k over real turns; a group
        of size 1 per `singleton`.
      returns [B, K]: discounted returns G_k (0 beyond num_turns).
      turn_advantages [B, K]: G_k normalised (mean, ddof=1 std, eps) across the siblings of the
        group with num_turns > k; where only one sibling reaches turn k, per `singleton`; 0 for
        k ≥ num_turns.
      advantages [B, T]: (A_traj + A_turn[k]) / 2 on policy tokens whose turn k is real
        (0 ≤ k < min(num_turns, K)); 0 on every other token (including policy tokens whose turn id
        does not name a real turn, which would be an inconsistent batch).
    """
    if singleton not in MATCHTIR_SINGLETONS:
        raise ValueError(f"singleton must be one of {MATCHTIR_SINGLETONS}, got {singleton!r}")
    chex.assert_rank([turn_rewards, num_turns, turn_ids, policy_mask, group_ids], [2, 1, 2, 2, 1])
    b, k = turn_rewards.shape
    t = policy_mask.shape[1]
    chex.assert_shape([num_turns, group_ids, turn_ids, policy_mask], [(b,), (b,), (b, t), (b, t)])
    chex.assert_type([num_turns, turn_ids, group_ids, policy_mask], [int, int, int, bool])
    groups = b if num_groups is None else num_groups
    n = jnp.clip(num_turns, 0, k)
    real = jnp.arange(k)[None, :] < n[:, None]  # [B, K]
    r = jnp.where(real, jnp.asarray(turn_rewards, jnp.float32), 0.0)
    total = r.sum(-1)
    a_traj = group_normalize(total, group_ids, num_groups=groups, ddof=1, eps=eps)
    g = discounted_returns(r, n, gamma)
    a_turn = group_normalize(g, group_ids, mask=real, num_groups=groups, ddof=1, eps=eps)
    if singleton == "raw":
        a_traj = _singleton_raw(total, a_traj, group_ids, jnp.ones((b,), bool), groups, eps)
        a_turn = _singleton_raw(g, a_turn, group_ids, real, groups, eps)
    tok_real = policy_mask & (turn_ids >= 0) & (turn_ids < n[:, None])
    a_turn_tok = jnp.take_along_axis(a_turn, jnp.clip(turn_ids, 0, k - 1), axis=1)
    adv = jnp.where(tok_real, 0.5 * (a_traj[:, None] + a_turn_tok), 0.0)
    return {
        "advantages": adv,
        "trajectory_advantages": a_traj,
        "turn_advantages": a_turn,
        "returns": g,
    }


@functools.partial(jax.jit, static_argnames=("num_groups", "singleton"))
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
    singleton: str = "zero",
) -> Array:
    """[B, T] MatchTIR token advantages; see `matchtir_advantage_parts` for the definition."""
    return matchtir_advantage_parts(
        turn_rewards, num_turns, turn_ids, policy_mask, group_ids,
        gamma=gamma, eps=eps, num_groups=num_groups, singleton=singleton,
    )["advantages"]


def _matchtir_estimator(turn_rewards, num_turns, turn_ids, policy_mask, group_ids, *, gamma, eps, num_groups,
                        matchtir_singleton):
    """The registered "matchtir" estimator: the knob `matchtir_singleton` (AlgoConfig field) is
    `matchtir_advantages`'s `singleton`."""
    return matchtir_advantages(turn_rewards, num_turns, turn_ids, policy_mask, group_ids, gamma=gamma, eps=eps,
                               num_groups=num_groups, singleton=matchtir_singleton)


# ----------------------------------------------------------------------------------------------
# Registry and the one composition the step, the docs and the tests use
# ----------------------------------------------------------------------------------------------

# Knobs an estimator may ask for, and where they come from: the AlgoConfig field of the same name,
# or the step geometry (num_groups = B / G, max_turns = the rollout's turn budget).
KNOBS = ("eps", "gamma", "num_groups", "max_turns", "lam", "eps_w", "selection", "aggregation",
         "group_norm", "turns", "norm_pool", "uncovered_in_stats", "empty_block_turns", "matchtir_singleton", "depths",
         "horizon_tol")
# ... and "<section>.<key>": a key of a method's own config section (rl.config.AlgoConfig.section_knobs),
# passed as the keyword argument "<section>_<key>" (APPO's transform: "appo.amplify" -> appo_amplify).


def _kwarg(knob: str) -> str:
    return knob.replace(".", "_")


@dataclasses.dataclass(frozen=True)
class Estimator:
    """A registered advantage estimator.

    fn(*arrays[inputs], **knobs) -> [B, N] advantages, or a dict holding "advantages" (and any
    diagnostics) for estimators that report more. `inputs` name batch arrays (see
    `rl.batch.advantage_inputs`: rewards, group_ids, policy_mask, turn_ids, turn_rewards,
    num_turns, delta, base_advantages, values (the critic's V [B, N], for a method with a critic:
    methods.critic), and any key a registered reward fills); `knobs` name
    entries of KNOBS. An estimator that takes "base_advantages" wraps a base estimator; one that
    takes "delta" needs the teacher's views (hindsight or privileged, as the method declares;
    "teacher_covered" [B, N] bool marks the tokens whose view showed a block: a privileged one, or
    a non-empty hindsight block). `optional` names arrays passed as keyword arguments when the
    batch has them (TurnSight's "turn_uses" [B, K, K], which the batch carries only for
    rl.selection="dependency", and "teacher_covered", read for rl.empty_block_turns="excluded").
    """

    name: str
    fn: Callable[..., Any]
    inputs: tuple[str, ...]
    knobs: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()

    @property
    def wraps_base(self) -> bool:
        return "base_advantages" in self.inputs

    @property
    def needs_views(self) -> bool:
        return "delta" in self.inputs


ESTIMATORS: dict[str, Estimator] = {}


def _registrar(table: dict[str, Estimator], kind: str, name: str, inputs: tuple[str, ...], knobs: tuple[str, ...],
               optional: tuple[str, ...] = ()):
    unknown = [k for k in knobs if k not in KNOBS and "." not in k]
    if unknown:
        raise ValueError(f"{kind} {name!r}: unknown knobs {unknown}; known: {KNOBS}")

    def deco(fn):
        if name in table:
            raise ValueError(f"{kind} {name!r} already registered")
        table[name] = Estimator(name, fn, tuple(inputs), tuple(knobs), tuple(optional))
        return fn

    return deco


def _lookup(table: dict[str, Estimator], kind: str, name: str) -> Estimator:
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; known: {sorted(table)}")
    return table[name]


def register_advantage(name: str, inputs: tuple[str, ...], knobs: tuple[str, ...] = (),
                       optional: tuple[str, ...] = ()):
    """Decorator: register `fn(*batch[inputs], **knobs, **present optional arrays)` as the
    advantage estimator `name`."""
    return _registrar(ESTIMATORS, "advantage estimator", name, inputs, knobs, optional)


def get_estimator(name: str) -> Estimator:
    return _lookup(ESTIMATORS, "advantage estimator", name)


# Advantage transforms: applied to the method's final advantage (after its estimator, and after the
# base's for a wrapping method such as TurnSight), named by a rollout controller
# (rl.methods.RolloutController.advantage_transform; APPO's Ω amplification). Same record as an
# estimator; its inputs name "advantages" (the method's) and the batch arrays it reads.
TRANSFORMS: dict[str, Estimator] = {}


def register_advantage_transform(name: str, inputs: tuple[str, ...], knobs: tuple[str, ...] = ()):
    """Decorator: register `fn(*batch[inputs], **knobs) -> [B, N]` (or a dict holding "advantages"
    and diagnostics), `inputs` including "advantages", as the advantage transform `name`."""
    if "advantages" not in inputs:
        raise ValueError(f"advantage transform {name!r}: its inputs must include 'advantages'")
    return _registrar(TRANSFORMS, "advantage transform", name, inputs, knobs)


def get_transform(name: str) -> Estimator:
    return _lookup(TRANSFORMS, "advantage transform", name)


register_advantage("grpo", ("rewards", "group_ids", "policy_mask"), ("eps", "num_groups"))(grpo_advantages)
register_advantage("matchtir", ("turn_rewards", "num_turns", "turn_ids", "policy_mask", "group_ids"),
                   ("gamma", "eps", "num_groups", "matchtir_singleton"))(_matchtir_estimator)
register_advantage(
    "turnsight", ("delta", "policy_mask", "turn_ids", "group_ids", "base_advantages"),
    ("lam", "eps_w", "eps", "selection", "aggregation", "group_norm", "turns", "num_groups", "max_turns",
     "norm_pool", "uncovered_in_stats", "empty_block_turns", "depths", "horizon_tol"),
    optional=("turn_uses", "teacher_covered"),
)(turnsight_advantages)


def _call(est: Estimator, arrays: Mapping[str, Array], knobs: Mapping[str, Any]) -> dict[str, Array]:
    missing = [k for k in est.inputs if k not in arrays]
    if missing:
        raise KeyError(f"advantage estimator {est.name!r} needs batch arrays {missing}")
    out = est.fn(*(arrays[k] for k in est.inputs), **{_kwarg(k): knobs[k] for k in est.knobs},
                 **{k: arrays[k] for k in est.optional if arrays.get(k) is not None})
    return dict(out) if isinstance(out, Mapping) else {"advantages": out}


def make_advantage_fn(name: str, *, base: str | None = None, knobs: Mapping[str, Any] | None = None,
                      transform: str | None = None) -> Callable[[Mapping[str, Array]], dict[str, Array]]:
    """`fn(arrays) -> dict` for the estimator `name` (composed over `base` when it wraps one), its
    final advantage passed through the advantage transform `transform` when given.

    The dict always has "advantages" (what the surrogate uses) and "base_advantages"; a wrapping
    estimator adds its own outputs (TurnSight: weights, selected depths, diagnostics) to its base's
    (GAE: "returns"), a transform its diagnostics. knobs: the
    values of KNOBS the estimators ask for. Unknown names and missing knobs fail here, at build
    time, not inside the step.
    """
    est = get_estimator(name)
    base_est = None
    if est.wraps_base:
        if base is None:
            raise KeyError(f"advantage estimator {name!r} wraps a base estimator; none given")
        base_est = get_estimator(base)
        if base_est.wraps_base:
            raise KeyError(f"base estimator {base!r} itself wraps a base; nest at most one level")
    tr = get_transform(transform) if transform else None
    knobs = dict(knobs or {})
    needed = set(est.knobs) | set(base_est.knobs if base_est else ()) | set(tr.knobs if tr else ())
    missing = sorted(needed - set(knobs))
    if missing:
        raise KeyError(f"advantage estimator {name!r} needs knobs {missing}")

    def estimate(arrays: Mapping[str, Array]) -> dict[str, Array]:
        if base_est is None:
            out = _call(est, arrays, knobs)
            return {**out, "base_advantages": out["advantages"]}
        base_out = _call(base_est, arrays, knobs)
        a_base = base_out["advantages"]
        out = _call(est, {**arrays, "base_advantages": a_base}, knobs)
        # the base's other outputs (e.g. GAE's "returns", the critic's targets) pass through
        return {**{k: v for k, v in base_out.items() if k != "advantages"}, **out, "base_advantages": a_base}

    def fn(arrays: Mapping[str, Array]) -> dict[str, Array]:
        out = estimate(arrays)
        if tr is None:
            return out
        return {**out, **_call(tr, {**arrays, "advantages": out["advantages"]}, knobs)}

    return fn
