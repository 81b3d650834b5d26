"""Length classes: the rows of a batch run the trunk in a few groups of similar length, each padded
to its own width, instead of all padded to the longest row.

A batch's rows keep their order (every per-row array, the advantages and the loss see the rows as
built); what changes is how a forward pass visits them. The host sorts the rows of each *cell* by
length and gives the shortest `rows[0]` of them class 0, the next `rows[1]` class 1, and so on
(`assign`); the device, for each class, gathers that class's rows, cuts the token arrays to the
class's width, runs the forward, and puts the results back in row order (`run_by_class`).

A cell is the set of rows one forward call of the step sees from one row shard, at the finest
split the step makes: rows are sharded over the mesh's data axes in contiguous blocks, and every
micro-/mini-batch split of rl.step is strided (rows m, m + M, ...), so a cell is a shard block's
rows with one residue of the row index modulo `modulus` (the product of the splits). Every cell
holding exactly `rows[i]` rows of class i makes every split of the batch hold its classes in the
same proportions, so one static description (`LengthClasses`) serves every call, and each class's
gather stays within a row shard (no rows cross devices).

The shapes are few and fixed: the class sizes come from the config (`train.length_classes`), and
the widths are buckets of the class's longest row, at or above the floors the trainer passes
(turnsight_jax.batch_shapes: the largest seen, or none with train.shapes="batch"), as the batch
width always was.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from turnsight_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class LengthClasses:
    """Static description of a batch's length classes (hashable: part of the step's signature).

    rows: rows of each class in every cell (ascending length); widths: each class's width
    (tokens of the arrays it cuts); shards: the row-shard blocks of the whole (global) batch the
    cells were laid out in (with several processes, each process's rows are whole blocks)."""

    rows: tuple[int, ...]
    widths: tuple[int, ...]
    shards: int = 1

    @property
    def cell(self) -> int:
        return sum(self.rows)


def split_cell(cell: int, classes: int) -> tuple[int, ...]:
    """Rows per class of a cell of `cell` rows: near-equal, the larger parts first."""
    if classes < 1:
        raise ConfigError(f"train.length_classes must be >= 1, got {classes}")
    if cell < classes:
        raise ConfigError(f"train.length_classes={classes} but each cell of the batch holds {cell} rows (rows per "
                          "row shard / (mini_batches x micro_batches, and teacher_micro_batches)); use fewer classes")
    base, extra = divmod(cell, classes)
    return tuple(base + (i < extra) for i in range(classes))


def cell_modulus(micro_batches: int, mini_batches: int, teacher_micro_batches: int) -> int:
    """The residue modulus of the step's strided splits (rl.step): mini- then micro-batches for the
    update, micro-batches of the whole batch for the extra forwards, teacher micro-batches."""
    return math.lcm(mini_batches * micro_batches, micro_batches, teacher_micro_batches)


def cell_rows(batch: int, shards: int, cfg) -> tuple[tuple[int, ...], int]:
    """(rows per class of a cell, the cell modulus) for `batch` rows over `shards` row shards under
    StepConfig `cfg` (its splits and length_classes). Raises ConfigError when the rows do not form
    whole cells or a cell holds fewer rows than classes."""
    modulus = whole_cells(batch, shards, cfg, f"train.length_classes={cfg.length_classes}")
    return split_cell(batch // (shards * modulus), cfg.length_classes), modulus


def whole_cells(batch: int, shards: int, cfg, what: str) -> int:
    """The cell modulus for `batch` rows over `shards` row shards under StepConfig `cfg`;
    ConfigError, naming `what` (the setting that needs cells), when the rows form no whole cells."""
    modulus = cell_modulus(cfg.micro_batches, cfg.mini_batches, cfg.teacher_micro_batches)
    if batch % (shards * modulus):
        raise ConfigError(f"{what}: {batch} rows do not split into {shards} row shard(s) x {modulus} strided "
                          "micro-batches")
    return modulus


def cell_items(b: int, shards: int, modulus: int) -> list[np.ndarray]:
    """Row indices of each cell (module docstring), cells in the order (shard block, residue); b
    must split into shards x modulus equal cells."""
    if b % (shards * modulus):
        raise ValueError(f"{b} rows do not form cells for {shards} shard(s) x modulus {modulus}")
    block = b // shards
    return [s * block + np.arange(r, block, modulus) for s in range(shards) for r in range(modulus)]


def assign(lengths: Sequence[int], rows: tuple[int, ...], *, shards: int, modulus: int) -> np.ndarray:
    """class [B] int32 of each row: within every cell (rl.length_classes module docstring) the
    shortest rows[0] rows get class 0, the next rows[1] class 1, ... (ties keep row order)."""
    lengths = np.asarray(lengths)
    b = lengths.size
    if b % (shards * modulus) or b // (shards * modulus) != sum(rows):
        raise ValueError(f"{b} rows do not form cells of {sum(rows)} rows for {shards} shard(s) x modulus {modulus}")
    labels = np.repeat(np.arange(len(rows), dtype=np.int32), rows)
    out = np.zeros(b, np.int32)
    for idx in cell_items(b, shards, modulus):
        out[idx[np.argsort(lengths[idx], kind="stable")]] = labels
    return out


def class_widths(lengths: Sequence[int], classes: np.ndarray, count: int) -> list[int]:
    """The longest row of each class (0 for a class with no row)."""
    lengths = np.asarray(lengths)
    return [int(lengths[classes == i].max(initial=0)) for i in range(count)]


def run_by_class(fn: Callable, spec: LengthClasses, classes: jax.Array, rows: tuple, cut: tuple, *,
                 out_axis: int = 0):
    """fn over each length class, results back in row order.

    classes [B] int32 (this call's rows); rows: arrays with the B rows on axis 0; cut: arrays
    [B, T, ...] whose axis 1 is cut to the class's width. fn(i, *rows_i, *cut_i) -> a pytree of
    arrays with the class's rows on `out_axis`. Returns the same pytree over all B rows."""
    b = classes.shape[0]
    s = spec.shards
    block = b // s
    cells = block // spec.cell
    if block * s != b or cells * spec.cell != block:
        raise ValueError(f"{b} rows do not hold whole cells of {spec.cell} rows on {s} shard(s)")
    key = classes.reshape(s, block) * block + jnp.arange(block, dtype=jnp.int32)
    order = jnp.argsort(key, axis=1)  # each shard block's rows grouped by class, in row order within

    def take(x, idx):  # x [B, ...] -> [S * n, ...] (the rows idx [S, n] of each block)
        xb = x.reshape(s, block, *x.shape[1:])
        return jnp.take_along_axis(xb, idx.reshape(*idx.shape, *([1] * (x.ndim - 1))), axis=1).reshape(
            -1, *x.shape[1:])

    outs, first = [], 0
    for i, (n, width) in enumerate(zip(spec.rows, spec.widths)):
        idx = order[:, first * cells:(first + n) * cells]
        first += n
        args = [take(x, idx) for x in rows] + [take(x, idx)[:, :width] for x in cut]
        outs.append(fn(i, *args))
    back = jnp.argsort(order, axis=1)  # [S, block]: where each row landed

    def merge(*parts):  # class results -> row order
        parts = [jnp.moveaxis(p, out_axis, 0) for p in parts]
        cat = jnp.concatenate([p.reshape(s, -1, *p.shape[1:]) for p in parts], axis=1)  # [S, block, ...]
        out = jnp.take_along_axis(cat, back.reshape(*back.shape, *([1] * (cat.ndim - 2))), axis=1)
        return jnp.moveaxis(out.reshape(b, *out.shape[2:]), 0, out_axis)

    return jax.tree.map(merge, *outs)
