"""Row packing: the rows of a batch (trajectories for the student's forward, packed hindsight rows
for the teacher's) laid end to end in fewer rows of one width, each item its own segments.

Items keep their order in every per-item array ([B, N] log-probs, advantages, the loss); only the
forward visits them packed. As with length classes (rl.length_classes), the packing is done per
*cell* — the items one forward call of the step sees from one row shard at the finest strided
split — so one static description serves every micro-/mini-batch and no item crosses devices:
the host packs the items of each cell into `rows` packed rows by first-fit decreasing, and lays
a shard block's packed rows out so that packed row k = j * modulus + r is the j-th row of cell r.
A strided split of the items (i, i + m, ...) and the same split of the packed rows then keep
each cell with its rows, and a call finds an item's packed row from the item's own bin index
(`PackedRows.row`) and its position in the call (`packed_index`).

An item is exact in its packed row: its tokens keep their rotary positions, its segment ids are
offset past the row's earlier items (context segments too, context ends by the item's start
column), so the attention mask (models.attention.packed_mask) lets no token read another item.

Shapes are few: the width is the batch's bucketed width (the longest item fits), the rows per
cell a bucket of the fullest cell's count (`rows_bucket`: at most 16 values per cell size),
and both at least the trainer's floors (turnsight_jax.batch_shapes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from turnsight_jax.models.attention import NO_SEGMENT, PAD_SEGMENT, Layout
from turnsight_jax.rl.length_classes import cell_items


@dataclasses.dataclass(frozen=True)
class RowPacking:
    """Static description of a packing (hashable: part of the step's signature).

    rows: packed rows per cell; cell: items per cell; shards: the row-shard blocks of the whole
    (global) batch the cells were laid out in (with several processes, each process's rows are
    whole blocks)."""

    rows: int
    cell: int
    shards: int = 1


@struct.dataclass
class PackedRows:
    """Items packed into rows (numpy or jax arrays).

    tokens [Rp, W] int32, layout (Layout fields [Rp, W]): the packed rows, Rp = shards x
    modulus x plan.rows; row [B] int32: the packed row of item b within its cell (its bin);
    offset [B] int32: the column of item b's first token in that row."""

    tokens: Any
    layout: Any
    row: Any
    offset: Any
    plan: RowPacking = struct.field(pytree_node=False)


def rows_bucket(n: int, cell: int) -> int:
    """Packed rows per cell for a fullest cell of n rows: n itself up to 8, then a multiple of
    ceil(cell / 8); at most `cell` (one item per row never needs more). At most 16 values."""
    if n <= 8:
        return max(1, min(n, cell))
    step = -(-cell // 8)
    return min(cell, -(-n // step) * step)


def first_fit_decreasing(lengths: Sequence[int], width: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(bin [n], offset [n], bins used): the items, longest first, each in the first bin with room
    (ties keep item order); every length must be <= width."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and lengths.max() > width:
        raise ValueError(f"an item of {int(lengths.max())} tokens does not fit a packed row of {width}")
    fill: list[int] = []
    bins = np.zeros(lengths.size, np.int32)
    offset = np.zeros(lengths.size, np.int32)
    for i in np.argsort(-lengths, kind="stable"):
        n = int(lengths[i])
        j = next((j for j, f in enumerate(fill) if f + n <= width), len(fill))
        if j == len(fill):
            fill.append(0)
        bins[i], offset[i] = j, fill[j]
        fill[j] += n
    return bins, offset, len(fill)


def balanced_order(lengths: Sequence[int], *, shards: int, modulus: int, keep: int) -> np.ndarray:
    """A row order [B] (position i holds item order[i]) that balances the cells' token totals.

    An item only moves between positions of the same shard block and the same residue modulo
    `keep` (the mini-batch count: an item stays in its mini-batch, so every update sees the same
    rows and the step's values do not change; moving between micro-batches only reorders a sum).
    Within each such group, items go longest first to the cell with the fewest tokens that still
    has a free slot, so no cell needs many more packed rows than the others (the fullest cell
    sets every cell's row count)."""
    lengths = np.asarray(lengths, np.int64)
    b = lengths.size
    if b % (shards * modulus) or modulus % keep:
        raise ValueError(f"{b} items, {shards} shard(s), modulus {modulus}, keep {keep}: no whole cells")
    block, order = b // shards, np.arange(b)
    for s in range(shards):
        for a in range(keep):
            cells = [s * block + np.arange(r, block, modulus) for r in range(a, modulus, keep)]
            if len(cells) == 1:
                continue
            pool = np.concatenate(cells)
            total = np.zeros(len(cells), np.int64)
            filled: list[list[int]] = [[] for _ in cells]
            for i in pool[np.argsort(-lengths[pool], kind="stable")]:
                open_ = [c for c in range(len(cells)) if len(filled[c]) < cells[c].size]
                c = min(open_, key=lambda c: (total[c], c))
                filled[c].append(int(i))
                total[c] += lengths[i]
            for slots, items in zip(cells, filled):
                order[slots] = sorted(items)  # within a cell, the items keep their order
    return order


def plan_packing(lengths: Sequence[int], width: int, *, shards: int, modulus: int, min_rows: int = 0,
                 total_shards: int | None = None) -> tuple[np.ndarray, np.ndarray, RowPacking]:
    """(row [B], offset [B], plan): every cell's items packed by first-fit decreasing into rows of
    `width`; plan.rows the bucketed fullest cell's row count, at least min_rows. total_shards:
    the shard blocks of the global batch (shards x processes; default shards)."""
    lengths = np.asarray(lengths)
    cells = cell_items(lengths.size, shards, modulus)
    row = np.zeros(lengths.size, np.int32)
    offset = np.zeros(lengths.size, np.int32)
    used = 0
    for idx in cells:
        row[idx], offset[idx], n = first_fit_decreasing(lengths[idx], width)
        used = max(used, n)
    cell = lengths.size // (shards * modulus)
    rows = rows_bucket(max(used, min(int(min_rows), cell)), cell)
    return row, offset, RowPacking(rows, cell, shards if total_shards is None else total_shards)


def assemble(items: Sequence[dict[str, np.ndarray]], row: np.ndarray, offset: np.ndarray, plan: RowPacking,
             width: int, *, shards: int, modulus: int, pad_id: int = 0) -> tuple[np.ndarray, Layout]:
    """Packed tokens [Rp, W] and Layout from per-item arrays, Rp = shards x modulus x plan.rows.

    items[b]: "tokens", "positions", "segment_ids" [L_b] (segment ids >= 0 real, PAD_SEGMENT
    padding inside the item), optionally "ctx1_segment", "ctx1_end", "ctx2_segment", "ctx2_end"
    [L_b]. Each item's segments are offset past its row's earlier items, its context ends by its
    start column (module docstring)."""
    block = modulus * plan.rows
    rp = shards * block
    tokens = np.full((rp, width), pad_id, np.int32)
    fields = {"positions": np.zeros((rp, width), np.int32), "segment_ids": np.full((rp, width), PAD_SEGMENT, np.int32),
              "ctx1_segment": np.full((rp, width), NO_SEGMENT, np.int32), "ctx1_end": np.zeros((rp, width), np.int32),
              "ctx2_segment": np.full((rp, width), NO_SEGMENT, np.int32), "ctx2_end": np.zeros((rp, width), np.int32)}
    base: dict[int, int] = {}  # next free segment id of each packed row
    b = len(items)
    per_block = b // shards
    # items in column order, so each row's segment ids ascend along the row
    for i in sorted(range(b), key=lambda i: (int(row[i]), int(offset[i]))):
        s, local = divmod(i, per_block)
        k = s * block + int(row[i]) * modulus + local % modulus
        item, o = items[i], int(offset[i])
        n = len(item["tokens"])
        if o + n > width:
            raise ValueError(f"item {i}: {n} tokens from column {o} overflow the packed width {width}")
        first = base.get(k, 0)
        cols = slice(o, o + n)
        tokens[k, cols] = item["tokens"]
        fields["positions"][k, cols] = item["positions"]
        seg = np.asarray(item["segment_ids"])
        fields["segment_ids"][k, cols] = np.where(seg >= 0, seg + first, seg)
        for c in ("ctx1", "ctx2"):
            if f"{c}_segment" in item:
                cs = np.asarray(item[f"{c}_segment"])
                fields[f"{c}_segment"][k, cols] = np.where(cs >= 0, cs + first, cs)
                fields[f"{c}_end"][k, cols] = np.where(cs >= 0, np.asarray(item[f"{c}_end"]) + o, 0)
        base[k] = first + (int(seg.max()) + 1 if (seg >= 0).any() else 0)
    return tokens, Layout(**fields)


def packed_index(packed: PackedRows, cols: jax.Array) -> jax.Array:
    """Flat index into each shard block's packed rows of item columns: cols [Bc, K] (columns of
    this call's items in their own coordinates) -> [S, Bc/S x K] int32, index into a block's
    rows flattened ([Rc/S x W]).

    The call's items and packed rows are a strided split of the batch's (or all of it): in each
    block the call holds `cells` whole cells, its p-th item in cell p mod cells, whose j-th
    packed row is the block's row j x cells + (p mod cells) (module docstring)."""
    s = packed.plan.shards
    bc, k = cols.shape
    rc, w = packed.tokens.shape
    if bc % s or rc % s or (rc // s) % packed.plan.rows:
        raise ValueError(f"{bc} items and {rc} packed rows do not split into {s} shard block(s) of whole cells "
                         f"({packed.plan.rows} packed rows each)")
    tb, cells = bc // s, rc // s // packed.plan.rows
    if tb != cells * packed.plan.cell:
        raise ValueError(f"{tb} items per block but {cells} cells of {packed.plan.cell} items")
    p = jnp.arange(tb, dtype=jnp.int32)
    local_row = packed.row.reshape(s, tb) * cells + (p % cells)[None]
    start = local_row * w + packed.offset.reshape(s, tb)
    return (start[:, :, None] + cols.reshape(s, tb, k)).reshape(s, tb * k).astype(jnp.int32)
