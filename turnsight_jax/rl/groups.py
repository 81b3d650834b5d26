"""Prompt-group statistics shared by every estimator (segment sums over `group_ids`).

Shapes: values / mask [B, T] or [B]; group_ids [B] int32 in [0, num_groups) (ids outside belong to
no group). Statistics are accumulated on values shifted by the group maximum, so a group whose
values are all equal gives exactly 0 instead of float32 round-off divided by eps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

def group_gather(values: Array, group_ids: Array, num_groups: int) -> Array:
    """values[group_ids] along axis 0, with 0 for ids outside [0, num_groups).

    Masked explicitly: with `.at[].get(mode="fill")` negative ids would still wrap, numpy-style.
    """
    in_range = (group_ids >= 0) & (group_ids < num_groups)
    safe = jnp.where(in_range, group_ids, 0)
    out = values[safe]
    in_range = in_range.reshape(in_range.shape + (1,) * (out.ndim - 1))
    return jnp.where(in_range, out, jnp.zeros((), out.dtype))


def pooled_group_stats(
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
    centred = jnp.where(mask, values - group_gather(shift, group_ids, num_groups)[:, None], 0.0)
    count = jax.ops.segment_sum(jnp.sum(mask, axis=1).astype(jnp.float32), group_ids,
                                num_segments=num_groups)
    mean_c = jax.ops.segment_sum(jnp.sum(centred, axis=1), group_ids,
                                 num_segments=num_groups) / jnp.maximum(count, 1.0)
    in_group = ((group_ids >= 0) & (group_ids < num_groups))[:, None]
    dev = jnp.where(mask & in_group,
                    centred - group_gather(mean_c, group_ids, num_groups)[:, None], 0.0)
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
    centred = jnp.where(mask, values - group_gather(shift, group_ids, num_groups), 0.0)
    count = jax.ops.segment_sum(mask.astype(jnp.float32), group_ids, num_segments=num_groups)
    mean_c = jax.ops.segment_sum(centred, group_ids, num_segments=num_groups) / jnp.maximum(count, 1.0)
    dev = jnp.where(mask, centred - group_gather(mean_c, group_ids, num_groups), 0.0)
    var = jax.ops.segment_sum(dev * dev, group_ids, num_segments=num_groups) / jnp.maximum(
        count - ddof, 1.0
    )
    std_b = group_gather(jnp.sqrt(var), group_ids, num_groups)
    count_b = group_gather(count, group_ids, num_groups)  # 0 for ungrouped rows
    return jnp.where(mask & (count_b > ddof), dev / (std_b + eps), 0.0)


