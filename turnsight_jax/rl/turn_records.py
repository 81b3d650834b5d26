"""Per-turn summaries of the step's per-token arrays, computed inside the jitted step for the
trajectory records (turnsight_jax.records; docs/records.md).

The step's advantages, weights, selected depths, teacher gaps and loss-term values live per
policy token ([B, N], rl.batch's compact layout). A record needs them per turn: for each
(trajectory b, turn k) this gives the token count and the min, max and sum of every array over
the turn's policy tokens ([B, K] each, K = the rollout's max turns). A quantity that is constant
over a turn (TurnSight's weight, depth and δ̂ under aggregation="turn", a GRPO or MatchTIR
advantage) has min == max, and that value is the exact float the update used; one that varies
(a token-level estimator's advantage, a per-token gate) is summarised by its mean, min and max.
The reductions read the same traced arrays the loss reads, so they cannot disagree with it; they
are small ([B, K]), and the step only returns them when built with `records=True`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def turn_summaries(values: dict, turn_ids: Array, policy_mask: Array, max_turns: int) -> dict:
    """values: {name: [B, N] array (float, int or bool), or (array, mask [B, N] bool) to summarise
    only the masked tokens}; turn_ids [B, N] int32 (-1 off policy); policy_mask [B, N] bool.
    Returns {"count": [B, K] float32 tokens per turn, name: {"min", "max", "sum"} [B, K] float32,
    with "n" (the masked tokens per turn) for a masked value}; a turn without (masked) tokens has
    min = +inf, max = -inf, sum = 0. Integer values must be exact in float32 (depth indices)."""
    b, _ = policy_mask.shape
    k = max_turns
    assigned = policy_mask & (turn_ids >= 0) & (turn_ids < k)
    n_seg = b * k
    seg = jnp.where(assigned, jnp.arange(b, dtype=jnp.int32)[:, None] * k + jnp.clip(turn_ids, 0, k - 1), n_seg)
    seg = seg.reshape(-1)

    def reduce(op, x):
        return op(x.reshape(-1), seg, num_segments=n_seg + 1)[:n_seg].reshape(b, k)

    out = {"count": reduce(jax.ops.segment_sum, assigned.astype(jnp.float32))}
    for name, x in values.items():
        x, mask = x if isinstance(x, tuple) else (x, None)
        x = jax.lax.stop_gradient(jnp.asarray(x).astype(jnp.float32))
        m = assigned if mask is None else assigned & mask
        out[name] = {"min": reduce(jax.ops.segment_min, jnp.where(m, x, jnp.inf)),
                     "max": reduce(jax.ops.segment_max, jnp.where(m, x, -jnp.inf)),
                     "sum": reduce(jax.ops.segment_sum, jnp.where(m, x, 0.0))}
        if mask is not None:
            out[name]["n"] = reduce(jax.ops.segment_sum, m.astype(jnp.float32))
    return out


# Per-token outputs of the advantage estimators a record keeps, by the estimator's output name ->
# the record's field (docs/records.md). "advantages" (Ã, what the surrogate uses) is always kept.
ESTIMATOR_FIELDS = {"base_advantages": "base_adv", "weights": "weight", "selected_depth": "depth",
                    "delta_bar": "delta_star", "delta_hat": "delta_hat", "rlsd_weights": "rlsd_weight"}


def step_records(adv: Array, estimator_out: dict, batch, teacher_lp, covered, term_values: dict | None,
                 max_turns: int) -> dict:
    """The records' arrays of one step: per-turn summaries of Ã (`adv` [B, N]), the estimator's
    per-token outputs (ESTIMATOR_FIELDS), the teacher-student gap of view 0 on the tokens its view
    covered (a privileged view; `teacher_lp` [R, B, N] or None, `covered` [B, N] bool) and of each
    loss term's per-token values in the step's first update (`term_values` {name: [B, N]}, under
    "term/<name>"); TurnSight's per-depth turn means δ̄^{(d)} [D, B, K] and group statistics μ_g,
    σ_g [G] as the estimator computed them."""
    values = {"adv": adv}
    values.update({field: estimator_out[name] for name, field in ESTIMATOR_FIELDS.items() if name in estimator_out})
    if teacher_lp is not None and covered is not None:
        values["gap"] = (teacher_lp[0] - batch.old_logprobs, covered)
    values.update({f"term/{name}": v for name, v in (term_values or {}).items()})
    out = {"turns": turn_summaries(values, batch.turn_ids, batch.pol_valid, max_turns)}
    for name in ("depth_turn_means", "group_mean", "group_std"):
        if name in estimator_out:
            out[name] = jax.lax.stop_gradient(estimator_out[name])
    return out
