"""The padded shapes a step's batch takes (`train.shapes`): the widths and packed row counts of
rl.batch.make_train_batch (`shape_keys`: "T", "N", "P", "U", per length class "T0", ..., packed
rows "RT", "RP", probe rows "Q"), each a bucket, and the step compiles once per distinct shape.

- "grow" (the default): the largest of each width seen so far. Shapes only grow, so a run
  compiles a handful of times, but after one long batch every later batch pays its padding.
- "batch": each batch's own buckets (the smallest that fit it), unless a shape the run has
  already used fits it and its counted executed update FLOPs (turnsight_jax.flops, summed over
  processes) are within `train.shape_reuse` of the batch's own: then that one (the cheapest of
  the CANDIDATES used shapes nearest the batch's own), so the programs compiled stay few while
  the padding follows the batch.

Both are deterministic in the run's history (the shapes used so far), which the checkpoint
saves, so a resumed run pads its batches exactly as the uninterrupted one (padding changes XLA's
summation order, hence the last bits of every loss and gradient). Every process builds its own
rows: the widths are agreed (the largest of every process's) before a shape is chosen.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from turnsight_jax import distributed
from turnsight_jax.rl.batch import shape_keys

Shape = dict[str, int]
CANDIDATES = 2  # used shapes costed per batch under "batch"


@dataclasses.dataclass
class ShapeHistory:
    """The shapes a run has run its step at, in first-use order (each a compiled program)."""

    policy: str = "grow"
    reuse: float = 0.1
    used: list[Shape] = dataclasses.field(default_factory=list)

    def floors(self) -> Shape:
        """"grow"'s floors: the largest of every width used so far."""
        out: Shape = {}
        for s in self.used:
            for k, v in s.items():
                out[k] = max(out.get(k, 0), int(v))
        return out

    def record(self, shape: Shape) -> None:
        if shape not in self.used:
            self.used.append(dict(shape))

    def to_meta(self) -> dict[str, Any]:
        """For the checkpoint's metadata ("batch_shapes": the last floors, read by older runs too)."""
        return {"batch_shapes": self.floors(), "batch_shapes_used": [dict(s) for s in self.used]}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], policy: str, reuse: float) -> "ShapeHistory":
        used = [{k: int(v) for k, v in s.items()} for s in meta.get("batch_shapes_used", [])]
        if not used and meta.get("batch_shapes"):  # a checkpoint from before the history was saved
            used = [{k: int(v) for k, v in meta["batch_shapes"].items()}]
        return cls(policy, float(reuse), used)


def _agreed(stats: dict[str, float], keys: list[str], floors: Shape) -> Shape:
    """The widths of `keys` every process agrees on: the largest of every process's (and `floors`)."""
    mine = np.array([max(floors.get(k, 0), int(stats[k])) for k in keys], np.int64)
    return {k: int(v) for k, v in zip(keys, distributed.gather(mine).max(axis=0))}


def choose_batch(build: Callable[[Shape], tuple[Any, dict[str, float]]], cost: Callable[[Any, dict[str, float]], float],
                 history: ShapeHistory) -> tuple[Any, dict[str, float], Shape]:
    """(batch, stats, shape) of this step under `history.policy`; the shape is recorded in `history`.

    build(floors): make_train_batch's (batch, stats) with those floors (`min_shapes`); its shapes
    are the smallest buckets at or above them. cost(batch, stats): this process's executed update
    FLOPs of the batch (summed over processes here: every process must take the same shape)."""
    floors = history.floors() if history.policy == "grow" else {}
    batch, stats = build(floors)
    keys = shape_keys(stats)
    own = _agreed(stats, keys, floors)
    if any(own[k] > int(stats[k]) for k in keys):  # another process's rows (or the floors) are wider
        batch, stats = build(own)
    chosen = own
    if history.policy == "batch" and own not in history.used:
        fits = [s for s in history.used if set(s) == set(keys) and all(s[k] >= own[k] for k in keys)]
        # building a batch is host work (seconds at the paper's size): only the used shapes
        # nearest the batch's own (the least total log-excess of their widths) are costed
        fits = sorted(fits, key=lambda s: sum(np.log(s[k] / max(own[k], 1)) for k in keys))[:CANDIDATES]
        if fits:
            built = [build(s) for s in fits]
            # a floor reproduces its shape only when it is a bucket: anything else is not a candidate
            ok = [all(int(st[k]) == s[k] for k in keys) for s, (_, st) in zip(fits, built)]
            costs = distributed.gather(np.array([cost(batch, stats)] + [cost(b, st) if good else np.inf
                                                                       for (b, st), good in zip(built, ok)],
                                                np.float64)).sum(axis=0)
            best = int(np.argmin(costs[1:]))
            if costs[1 + best] <= (1.0 + history.reuse) * costs[0]:
                chosen, (batch, stats) = fits[best], built[best]
    history.record(chosen)
    return batch, stats, chosen
