"""Strided micro-batches of the step's rows: split, run, merge back (rl.step and the step auxiliaries).

A batch of B rows splits into m micro-batches of B/m rows, micro-batch i holding rows i, i+m,
i+2m, ...: each micro-batch spreads over all data shards (rows are sharded in contiguous blocks),
so a `lax.map` / `lax.scan` over them keeps every device busy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from turnsight_jax.rl import micro_groups
from turnsight_jax.rl.batch import TrainBatch, row_axis


def split_rows(x, m: int, axis: int = 0):
    """[.., B, ..] -> [m, .., B/m, ..]: micro-batch i holds rows i, i+m, i+2m, ..."""
    x = jnp.moveaxis(x, axis, 0)
    b = x.shape[0]
    x = x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)
    return jnp.moveaxis(x, 1, axis + 1)


def merge_rows(x, axis: int = 0):
    """Inverse of split_rows: [m, .., B/m, ..] -> [.., B, ..]."""
    x = jnp.moveaxis(x, axis + 1, 1)  # [m, B/m, ...]
    m, r = x.shape[:2]
    x = x.swapaxes(0, 1).reshape(m * r, *x.shape[2:])
    return jnp.moveaxis(x, 0, axis)


def split_batch(batch, m: int):
    """Strided micro-batches of a TrainBatch (views included), stacked on a new leading axis."""
    def f(path, x):
        return None if x is None else split_rows(x, m, axis=row_axis(path))

    return jax.tree_util.tree_map_with_path(f, batch)


def student_rows(batch: TrainBatch) -> TrainBatch:
    """The arrays a no-gradient student forward reads (no views, no signals)."""
    return batch.replace(views=None, signals={})


def in_micro_batches(fn, batch: TrainBatch, m: int):
    """fn(batch) over strided micro-batches of its rows (lax.map), merged back; m = 1: one call.
    With micro-batch groups (rl.micro_groups) of m micro-batches, each group's map runs cut to
    its own width."""
    if m == 1:
        return fn(batch)
    groups = batch.micro_groups
    if groups is None or groups.micro_batches != m:
        return merge_rows(jax.lax.map(fn, split_batch(batch, m)))
    _, out = micro_groups.run_grouped(lambda c, part: (c, jax.lax.map(fn, part)), split_batch(batch, m), groups,
                                      micro_groups.cut_rows, groups.widths)
    return merge_rows(out)


def map_micro_batches(fn, rows, m: int):
    """fn(rows) over m strided micro-batches of `rows` (lax.map; m = 1: one call), each output
    leaf merged back to the whole batch's rows (the teacher-side passes: cfg.teacher_micro_batches)."""
    return fn(rows) if m == 1 else jax.tree.map(merge_rows, jax.lax.map(fn, split_batch(rows, m)))
