"""Micro-batches grouped by length (`train.micro_batch_groups`).

With `train.micro_batches = M` the step accumulates gradients over M strided micro-batches (rl.step:
micro-batch j holds rows j, j + M, j + 2M, ... of the batch), in one `lax.scan` at the batch's width
T. A config whose micro-batches hold one row per device (the paper's: 512 trajectories in 64
micro-batches on 8 devices) can neither pack rows nor split a micro-batch into length classes:
each of its micro-batches pads its row to the longest trajectory of the whole batch, a 2k-token
trajectory to 24k.

Here the host orders each row shard's rows by length so micro-batch j holds the j-th shortest
rows of every shard (`length_order`), and the M micro-batches run in G consecutive groups
(`split_counts`), each its own scan (or map, for the no-gradient forwards) at its own width: the
bucket of its longest row (`MicroGroups.widths`), and for the teacher, when its micro-batches are
the student's, the bucket of its longest packed hindsight row (`MicroGroups.view_widths`). Rows
only move between micro-batches of the one mini-batch, so every value of the step is the
ungrouped step's (the gradient summed in another order), and the memory is bounded as before: no
group is wider than T.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class MicroGroups:
    """Static description of a batch's micro-batch groups (hashable: part of the step's signature).

    counts: micro-batches in each group, in micro-batch order (the shortest rows first), summing
    to train.micro_batches; widths: the student's token width of each group (<= T); view_widths:
    the teacher's packed-row width of each group (<= P), or None (no views)."""

    counts: tuple[int, ...]
    widths: tuple[int, ...]
    view_widths: tuple[int, ...] | None = None

    @property
    def micro_batches(self) -> int:
        return sum(self.counts)

    def bounds(self) -> list[tuple[int, int]]:
        """[(first micro-batch, one past the last)] of each group."""
        ends = np.cumsum(self.counts).tolist()
        return list(zip([0] + ends[:-1], ends))

    def row_groups(self, b: int) -> np.ndarray:
        """[b] int: the group of each batch row (`row_groups`)."""
        return row_groups(b, self.counts)


def row_groups(b: int, counts: Sequence[int]) -> np.ndarray:
    """[b] int: the group of each batch row, for groups of `counts` micro-batches (row i is in
    micro-batch i mod M, M = sum(counts))."""
    of_micro = np.repeat(np.arange(len(counts)), counts)
    return of_micro[np.arange(b) % sum(counts)]


def split_counts(micro_batches: int, groups: int) -> tuple[int, ...]:
    """Micro-batches per group: near-equal, the larger parts first."""
    base, extra = divmod(micro_batches, groups)
    return tuple(base + (i < extra) for i in range(groups))


def length_order(lengths: Sequence[int], shards: int, micro_batches: int) -> np.ndarray:
    """order[i]: the row (index into `lengths`) placed at row i, so that within each of the `shards`
    contiguous shard blocks micro-batch j (the block's rows at j, j + M, ...) holds the block's
    rows of length ranks j*c .. (j+1)*c - 1 (c = rows per micro-batch per block; ties keep row
    order). Rows stay in their shard block. The block must be a multiple of M."""
    lengths = np.asarray(lengths)
    b = lengths.size
    block = b // shards
    if block * shards != b or block % micro_batches:
        raise ValueError(f"{b} rows do not split into {shards} shard block(s) of whole micro-batches of {micro_batches}")
    c = block // micro_batches
    order = np.empty(b, np.int64)
    for s in range(shards):
        ranked = s * block + np.argsort(lengths[s * block:(s + 1) * block], kind="stable")
        r = np.arange(block)
        order[s * block + (r // c) + (r % c) * micro_batches] = ranked
    return order


def cut_rows(rows, width: int):
    """A TrainBatch (or a stack of micro-batches of one) with its token arrays (tokens, valid and
    the layout, token axis last) cut to `width`."""
    cut = lambda a: a[..., :width]
    return rows.replace(tokens=cut(rows.tokens), valid=cut(rows.valid),
                        layout=None if rows.layout is None else jax.tree.map(cut, rows.layout))


def cut_views(views, width: int):
    """PackedViews (or a stack of micro-batches of them) cut to packed rows of `width`."""
    cut = lambda a: a[..., :width]
    return views.replace(tokens=cut(views.tokens), layout=jax.tree.map(cut, views.layout))


def run_grouped(run: Callable, stacked, groups: MicroGroups, cut: Callable, widths: Sequence[int], carry=None):
    """`run` over each group of stacked micro-batches (leaves [M, ...]), the group's slice cut by
    cut(slice, width): run(carry, slice) -> (carry, outputs [m_g, ...]); the carry threads from
    group to group. Returns (carry, outputs concatenated over the groups: [M, ...])."""
    outs = []
    for (start, stop), width in zip(groups.bounds(), widths):
        part = cut(jax.tree.map(lambda a: a[start:stop], stacked), width)
        carry, out = run(carry, part)
        outs.append(out)
    return carry, jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=0), *outs)
