"""The step's input contract: `TrainBatch`, built from trajectories on the host, and its
worst-case geometry for the dry-run memory plan. This is the one description of the batch layout.

Compact policy-position layout (B trajectories, T bucketed trajectory width, N bucketed policy
tokens per row, K = max turns):

  tokens [B, T] int32                      right-padded trajectories (the student's forward)
  valid [B, T] bool                        the tokens the student's forward reads: every real token;
                                           with rl.student_sees_observations=False only the prompt
                                           and the policy tokens (`student_context`)
  layout: Layout [B, T] or None            when some trajectory's turns saw elided observations (an
                                           observation window, rollout.driver) and the student sees
                                           observations: each row is its trajectory's
                                           rl.context_rows row (every turn under its own context,
                                           in segments) and this its Layout; None: plain rows
  pol_pos [B, N] int32                     position in `tokens` of the row's n-th policy token (in
                                           trajectory order)
  pol_valid [B, N] bool                    False on padding slots
  turn_ids [B, N] int32                    turn of each policy token, -1 on padding
  old_logprobs [B, N] float32              the sampler's log-probs of the policy tokens
  group_ids [B] int32                      prompt group, renumbered in order of appearance
                                           from group_offset (0 .. B/G-1 in the fixed layout);
                                           -1: in no group (a padding row or an exemplar of a
                                           controller that forms its own groups, see below)
  num_turns [B] int32
  signals: {name: [B], [B, K] or [B, N]}    what the method's rewards filled ("rewards",
                                           "turn_rewards", per token: a controller's recorded values, ...;
                                           float32; turnsight_jax.rl.methods)
  views: PackedViews or None               packed hindsight rows of the frozen teacher
                                           (turnsight_jax.rl.views), when the advantage needs them
  length_class [B] int32 or None           the row's length class (rl.length_classes): with
                                           train.length_classes > 1 the student's forward runs each
                                           class cut to its own width, classes.widths[i] <= T
  classes: LengthClasses or None (static)  the classes' rows per cell and widths
  packed: PackedRows or None               with train.pack_rows: the student's forward runs the
                                           trajectories packed several per row (rl.packing):
                                           tokens [Rp, W], Layout [Rp, W] (W >= T), row/offset
                                           [B]; the [B, T] arrays above still describe each
                                           trajectory (targets, predictors); the views are packed
                                           alike (views.packed)
  aux_rows: {name: pytree} or None         the step auxiliaries' own rows (rl.auxiliaries.batch_rows;
                                           rows first), e.g. the retrospective teacher's probe rows
                                           "retrospective" (tokens/layout [B, Q], at/exists [B, K+1])
  turn_uses [B, K, K] bool or None         uses[b, j, i]: turn j's calls use a value turn i's results
                                           gave (rl.horizon.turn_dependencies), for TurnSight's
                                           rl.selection="dependency"
  micro_groups: MicroGroups or None        with train.micro_batch_groups > 1: the micro-batches
  (static)                                 (rows i with i mod M = j) hold rows ordered by length
                                           and run in groups, each cut to its own width
                                           (rl.micro_groups); widths[g] <= T, view_widths[g] <= P

Rows and groups. In the fixed layout (StepConfig.prompt_rows = 0) every group holds exactly G
rows, B = prompts x G. A rollout controller that forms its own groups (e.g. prompts stopped early,
exemplar rows; rl.methods.RolloutController.rows_per_prompt) gives R = prompt_rows rows per prompt,
B = prompts x R, static for the compiled step: a prompt's block holds its group (any size 1..R),
rows in no group (group id -1), and padding rows (chat.trajectory.padding_trajectory: one token,
no policy token, no reward computed). A row in no group gets advantage 0 from every group
estimator and carries no policy-gradient, KL, entropy or value loss (rl.losses: the RL terms
aggregate over the policy tokens of grouped rows); a loss term with its own rows (LossTerm.rows,
e.g. a CE on exemplars) trains on it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from turnsight_jax.chat.trajectory import Trajectory, is_padding
from turnsight_jax.chat.types import Task
from turnsight_jax.errors import ConfigError
from turnsight_jax.models.attention import NO_SEGMENT, PAD_SEGMENT, Layout
from turnsight_jax.models.sharding import BATCH, fit_spec, shard_rows
from turnsight_jax.rl import length_classes
from turnsight_jax.rl.config import StepConfig
from turnsight_jax.rl.context_rows import ContextRow, context_row, has_elisions, row_policy_positions
from turnsight_jax.rl.horizon import dependency_batch
from turnsight_jax.rl.length_classes import LengthClasses
from turnsight_jax.rl import micro_groups
from turnsight_jax.rl.methods import ResolvedMethod
from turnsight_jax.rl.micro_groups import MicroGroups
from turnsight_jax.rl.auxiliaries import AUXILIARIES, RowsRequest
from turnsight_jax.rl.packing import PackedRows, RowPacking, assemble, balanced_order, plan_packing, rows_bucket
from turnsight_jax.rl.views import (DEFAULT_PACKED_BUCKETS, VIEW_BUILDERS, PackedViews, ViewRequest, pick_bucket,
                                    policy_bucket, policy_positions)

log = logging.getLogger(__name__)

# Trajectory widths T: multiples of 128 up to 2,048, of 512 up to 8,192, of 2,048 up to 32,768
# (at most 1/8 padding past 2,048; powers of two padded a 17k-token row to 32k).
DEFAULT_BUCKETS: tuple[int, ...] = (tuple(range(128, 2049, 128)) + tuple(range(2560, 8193, 512))
                                    + tuple(range(10240, 32769, 2048)))
# Leaves whose trajectory axis is 1 ([R, B, N]); every other leaf has it first.
_VIEW_AXIS_LEAVES = ("view_pred", "slot")


@struct.dataclass
class TrainBatch:
    """A rollout batch in the compact policy-position layout (shapes in the module docstring)."""

    tokens: Any
    valid: Any
    pol_pos: Any
    pol_valid: Any
    turn_ids: Any
    old_logprobs: Any
    group_ids: Any
    num_turns: Any
    signals: dict[str, Any]
    views: Any = None
    length_class: Any = None
    classes: LengthClasses | None = struct.field(pytree_node=False, default=None)
    packed: Any = None
    aux_rows: dict[str, Any] | None = None
    layout: Any = None
    turn_uses: Any = None
    micro_groups: MicroGroups | None = struct.field(pytree_node=False, default=None)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def row_axis(path) -> int:
    """Axis holding the trajectories in a TrainBatch leaf: 1 for view_pred / slot [R, B, N], else 0."""
    names = [getattr(k, "name", getattr(k, "key", None)) for k in path]
    return 1 if names and names[-1] in _VIEW_AXIS_LEAVES else 0


def shard_batch(batch: TrainBatch, mesh) -> TrainBatch:
    """Place a (numpy) TrainBatch on `mesh`, rows split over the data axes."""
    return shard_rows(batch, mesh, row_axis)


def pad_tokens(trajs: Sequence[Trajectory], width: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """tokens [B, width] int32 right-padded with pad_id, valid [B, width] bool."""
    tokens = np.full((len(trajs), width), pad_id, np.int32)
    valid = np.zeros((len(trajs), width), bool)
    for i, t in enumerate(trajs):
        if t.length > width:
            raise ValueError(f"trajectory {i} has {t.length} tokens, over the batch width {width}")
        tokens[i, :t.length] = t.tokens
        valid[i, :t.length] = True
    return tokens, valid


def pad_rows(rows: Sequence[ContextRow], width: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, Layout]:
    """Right-padded rl.context_rows rows: tokens [B, width] int32, valid [B, width] bool and their
    Layout [B, width] (padding: PAD_SEGMENT, no context)."""
    b = len(rows)
    tokens = np.full((b, width), pad_id, np.int32)
    valid = np.zeros((b, width), bool)
    fields = {"positions": np.zeros((b, width), np.int32), "segment_ids": np.full((b, width), PAD_SEGMENT, np.int32),
              "ctx1_segment": np.full((b, width), NO_SEGMENT, np.int32), "ctx1_end": np.zeros((b, width), np.int32),
              "ctx2_segment": np.full((b, width), NO_SEGMENT, np.int32), "ctx2_end": np.zeros((b, width), np.int32)}
    for i, r in enumerate(rows):
        if r.length > width:
            raise ValueError(f"row {i} has {r.length} tokens, over the batch width {width}")
        tokens[i, :r.length] = r.tokens
        valid[i, :r.length] = True
        for name in ("positions", "segment_ids", "ctx1_segment", "ctx1_end"):
            fields[name][i, :r.length] = getattr(r, name)
    return tokens, valid, Layout(**fields)


def student_context(trajs: Sequence[Trajectory], width: int) -> np.ndarray:
    """[B, width] bool: the prompt and the policy tokens of each trajectory, the context of the
    released code's training forward (its attention mask is 0 on every token the environment
    appended: tool responses and the next turn's assistant header; docs/spec.md §1.9)."""
    keep = np.zeros((len(trajs), width), bool)
    for i, t in enumerate(trajs):
        keep[i, :t.prompt_len] = True
        keep[i, :t.length] |= t.policy_mask
    return keep


def group_index(trajs: Sequence[Trajectory], group_size: int | None) -> np.ndarray:
    """Group ids renumbered 0, 1, ... in order of appearance, -1 for a row in no group
    (Trajectory.group_id < 0). group_size: every group must hold exactly that many rows (the
    fixed layout); None: groups of any size (a controller that forms its own groups)."""
    index: dict[int, int] = {}
    ids = np.array([index.setdefault(t.group_id, len(index)) if t.group_id >= 0 else -1 for t in trajs], np.int32)
    counts = np.bincount(ids[ids >= 0], minlength=len(index))
    if group_size is not None:
        bad = np.flatnonzero(counts != group_size)
        if bad.size or (ids < 0).any():
            g, n = (bad[0], counts[bad[0]]) if bad.size else ("-1 (no group)", int((ids < 0).sum()))
            raise ConfigError(f"group {g} has {n} trajectories, expected group_size={group_size}")
    return ids


def compute_signals(method: ResolvedMethod, trajs: Sequence[Trajectory], tasks: Sequence[Task],
                    cfg: StepConfig, positions: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Run the method's rewards on the rollout record: {output: [B], [B, K] or [B, N] float32}.
    positions: (pol_pos, pol_valid) [B, N] of the batch, for the per-token rewards."""
    if len(tasks) != len(trajs):
        raise ValueError(f"{len(trajs)} trajectories but {len(tasks)} row tasks")
    out: dict[str, np.ndarray] = {}
    padding = {i for i, t in enumerate(trajs) if is_padding(t)}  # their outputs stay 0
    for reward in method.rewards:
        lacking = [i for i, task in enumerate(tasks)
                   if i not in padding and any(getattr(task, f, None) is None for f in reward.needs)]
        if reward.per == "token" and positions is None:
            raise ValueError(f"reward {reward.name!r} is per token: compute_signals needs the batch's positions")
        if reward.per == "trajectory":
            arr = np.zeros(len(trajs), np.float32)
        elif reward.per == "token":
            arr = np.zeros(positions[0].shape, np.float32)
        else:
            arr = np.zeros((len(trajs), cfg.max_turns), np.float32)
        for i, (traj, task) in enumerate(zip(trajs, tasks)):
            if i in lacking or i in padding:
                continue
            value = reward.fn(traj, task, cfg.algo)
            if reward.per == "trajectory":
                arr[i] = float(value)
                continue
            value = np.asarray(value, np.float32)
            if reward.per == "token":
                if value.shape != (traj.length,):
                    raise ValueError(f"reward {reward.name!r}: trajectory {i} has {traj.length} tokens but the "
                                     f"reward returned shape {value.shape}")
                n = int(positions[1][i].sum())
                arr[i, :n] = value[positions[0][i, :n]]
                continue
            if value.shape != (traj.num_turns,):
                raise ValueError(f"reward {reward.name!r}: trajectory {i} has {traj.num_turns} turns but the "
                                 f"reward returned shape {value.shape}")
            if traj.num_turns > cfg.max_turns:
                raise ValueError(f"trajectory {i} has {traj.num_turns} turns, over max_turns {cfg.max_turns}")
            arr[i, :traj.num_turns] = value
        if lacking:
            # Kept loud rather than fatal: FTRL test rows carry no gold calls (see docs/spec.md §3).
            log.warning("reward %s: %d of %d trajectories' tasks lack %s; their %s stay 0", reward.name,
                        len(lacking), len(trajs), "/".join(reward.needs), reward.output)
        out[reward.output] = arr
    return out


def packed_reference(cfg: StepConfig, method: ResolvedMethod) -> bool:
    """Whether the packed views carry the reference row (view D) for a loss term that reads the
    reference. Its segment is the whole trajectory, so it serves only a student that sees the
    observations, and the views are scored by the teacher, so only a teacher that is the reference
    (teacher.weights); otherwise the step scores the reference on the student's context."""
    return method.needs_ref and cfg.algo.student_sees_observations and cfg.teacher.weights == "reference"


def make_train_batch(
    trajs: Sequence[Trajectory],
    tasks: Sequence[Task],
    tokenizer,
    cfg: StepConfig,
    method: ResolvedMethod,
    *,
    length_buckets: Sequence[int] = DEFAULT_BUCKETS,
    packed_buckets: Sequence[int] = DEFAULT_PACKED_BUCKETS,
    pad_id: int = 0,
    min_shapes: dict[str, int] | None = None,
    group_offset: int = 0,
    row_shards: int = 1,
    processes: int = 1,
) -> tuple[TrainBatch, dict[str, float]]:
    """Assemble a TrainBatch (numpy arrays) and stats (token counts, view overhead).

    tasks: the task of each row (len(trajs) of them): the rewards and the hindsight source read
    gold calls and answers from it. min_shapes: floors for the bucketed widths (`shape_keys`:
    "T", "N", "P", "U", per length class "T0", "T1", ..., "P0", ..., and with train.pack_rows the
    packed rows per cell "RT" (student) and "RP" (teacher)); the trainer passes the
    floors of train.shapes (turnsight_jax.batch_shapes: by default the largest widths seen so far, so
    shapes only grow and the step compiles a handful of times). The
    widths used are returned in stats under the same keys. group_offset: the index of the first
    group in the whole batch (a process builds its own rows of it). row_shards: the row shards of
    the mesh the batch will be placed on (this process's share), for the length classes' cells;
    processes: how many processes build rows alike (the step sees processes x row_shards shard
    blocks, each one process's local block).

    With train.pack_rows the rows may come in another order than `trajs` (each stays in its
    shard block and mini-batch: rl.packing.balanced_order), so every value of the step is the
    same as without packing."""
    cfg.validate(len(trajs))
    floor = {"T": 0, "N": 0, "P": 0, "U": 0, **(min_shapes or {})}
    own, lengths = _row_lengths(trajs, cfg)
    windowed = own is not None and cfg.algo.student_sees_observations
    modulus = packing_modulus(len(trajs), row_shards, cfg) if cfg.pack_rows else 1
    if cfg.pack_rows or cfg.micro_batch_groups > 1:  # rows move between micro-batches (never mini-batches)
        order = _row_order(lengths, cfg, row_shards)
        trajs, tasks = [trajs[i] for i in order], [tasks[i] for i in order]
        lengths = [lengths[i] for i in order]
        own = None if own is None else [own[i] for i in order]
    groups = group_of_row = None
    if cfg.micro_batch_groups > 1:
        counts = micro_groups.split_counts(cfg.micro_batches, cfg.micro_batch_groups)
        group_of_row = micro_groups.row_groups(len(trajs), counts)
        gw = tuple(_bucket(n, length_buckets, floor.get(f"T{g}", 0), "trajectory")
                   for g, n in enumerate(length_classes.class_widths(lengths, group_of_row, len(counts))))
        groups = MicroGroups(counts, gw)
        floor["T"] = max(floor["T"], *gw)
        floor["P"] = max([floor["P"]] + [floor.get(f"P{g}", 0) for g in range(len(counts))])
    classes = cls_widths = None
    if cfg.length_classes > 1:
        rows, modulus = length_classes.cell_rows(len(trajs), row_shards, cfg)

        def classify(sizes, buckets, key, what):
            """(class of each row, bucketed width of each class) by `sizes` [B]."""
            ids = length_classes.assign(sizes, rows, shards=row_shards, modulus=modulus)
            return ids, tuple(_bucket(n, buckets, floor.get(f"{key}{i}", 0), what)
                              for i, n in enumerate(length_classes.class_widths(sizes, ids, len(rows))))

        classes, cls_widths = classify(lengths, length_buckets, "T", "trajectory")
        floor["T"] = max(floor["T"], *cls_widths)
    width = _bucket(max(lengths), length_buckets, floor["T"], "trajectory")
    layout = None
    if windowed:
        tokens, valid, layout = pad_rows(own, width, pad_id)
    else:
        tokens, valid = pad_tokens(trajs, width, pad_id)
    if not cfg.algo.student_sees_observations:
        valid &= student_context(trajs, width)
    x_pos, pol_valid = policy_positions(
        trajs, max(policy_bucket(max(int(t.policy_mask.sum()) for t in trajs)), floor["N"]))
    turn_ids = np.full(x_pos.shape, -1, np.int32)
    old_lp = np.zeros(x_pos.shape, np.float32)
    for i, t in enumerate(trajs):
        n = int(pol_valid[i].sum())
        turn_ids[i, :n] = t.turn_ids[x_pos[i, :n]]
        old_lp[i, :n] = t.old_logprobs[x_pos[i, :n]]
    row_pos = x_pos if own is None else row_policy_positions(own, x_pos, pol_valid)  # the views' coordinates
    pol_pos = row_pos if windowed else x_pos
    views = None
    stats = {"trajectory_tokens": float(sum(lengths)), "policy_tokens": float(pol_valid.sum()),
             "batch_width": float(width), "policy_width": float(pol_pos.shape[1]),
             "T": float(width), "N": float(pol_pos.shape[1])}
    packed = None
    if cfg.pack_rows:
        if windowed:
            items = [{"tokens": r.tokens, "positions": r.positions, "segment_ids": r.segment_ids,
                      "ctx1_segment": r.ctx1_segment, "ctx1_end": r.ctx1_end} for r in own]
        else:
            items = [{"tokens": t.tokens, "positions": np.arange(t.length, dtype=np.int32),
                      "segment_ids": np.where(valid[i, :t.length], 0, PAD_SEGMENT)} for i, t in enumerate(trajs)]
        packed = _pack(items, _packed_width(width, cfg.pack_width, length_buckets), floor.get("RT", 0), row_shards,
                       processes, modulus, pad_id)
        stats["RT"] = float(packed.plan.rows)
    spec = None
    if classes is not None:
        spec = LengthClasses(rows, cls_widths, row_shards * processes)
        stats.update({f"T{i}": float(w) for i, w in enumerate(cls_widths)})
    if groups is not None:
        stats.update({f"T{g}": float(w) for g, w in enumerate(groups.widths)})
    if method.needs_views:
        if classes is not None:  # the rows are as wide as their widest class
            floor["P"] = max([floor["P"]] + [floor.get(f"P{i}", 0) for i in range(len(rows))])
        views, vstats = VIEW_BUILDERS[method.teacher](ViewRequest(
            trajs, tasks, tokenizer, cfg, packed_reference(cfg, method), row_pos, pol_pos, pol_valid, packed_buckets,
            (floor["P"], floor["U"])))
        stats.update(vstats)
        if classes is not None:
            vclass, pw = classify((np.asarray(views.layout.segment_ids) >= 0).sum(axis=1), packed_buckets, "P",
                                  "packed hindsight row")
            views = views.replace(row_class=vclass, classes=LengthClasses(rows, pw, row_shards * processes))
            stats.update({f"P{i}": float(w) for i, w in enumerate(pw)})
        if groups is not None:
            vw = tuple(_bucket(n, packed_buckets, floor.get(f"P{g}", 0), "packed hindsight row") for g, n in enumerate(
                length_classes.class_widths((np.asarray(views.layout.segment_ids) >= 0).sum(axis=1), group_of_row,
                                            len(groups.counts))))
            groups = dataclasses.replace(groups, view_widths=vw)
            stats.update({f"P{g}": float(w) for g, w in enumerate(vw)})
        stats["P"], stats["U"] = float(views.tokens.shape[1]), float(views.pred.shape[1])
        if cfg.pack_rows:
            views = _pack_views(views, _packed_width(views.tokens.shape[1], cfg.teacher_pack_width or cfg.pack_width,
                                                     packed_buckets),
                                floor.get("RP", 0), row_shards, processes, modulus, pad_id)
            stats["RP"] = float(views.packed.plan.rows)
    aux_rows = {}
    for aux in method.auxiliaries:
        if aux.batch_rows is not None:
            aux_rows[aux.name], astats = aux.batch_rows(RowsRequest(trajs, tasks, tokenizer, cfg, packed_buckets,
                                                                    floor.get(aux.rows_key, 0)))
            stats.update(astats)
    batch = TrainBatch(
        tokens=tokens, valid=valid, pol_pos=pol_pos, pol_valid=pol_valid, turn_ids=turn_ids, old_logprobs=old_lp,
        # a controller's prompt block may hold several groups (e.g. initial rollouts and branches): a
        # process numbers its groups from first prompt x rows per prompt, which no other process's reach
        group_ids=_offset_groups(group_index(trajs, None if cfg.prompt_rows else cfg.group_size),
                                 group_offset * (cfg.prompt_rows or 1)),
        num_turns=np.asarray([t.num_turns for t in trajs], np.int32),
        signals=compute_signals(method, trajs, tasks, cfg, (pol_pos, pol_valid)),
        views=views, length_class=classes, classes=spec, packed=packed, aux_rows=aux_rows or None, layout=layout,
        turn_uses=dependency_batch(trajs, cfg.max_turns) if needs_turn_uses(cfg, method) else None,
        micro_groups=groups,
    )
    if own is not None:
        stats["context_segments"] = float(sum(r.segments - 1 for r in own))  # beyond each trajectory's segment 0
    return batch, stats


def _row_lengths(trajs: Sequence[Trajectory], cfg: StepConfig):
    """(each trajectory's context row or None, the row lengths the student's forward reads).

    Turns that saw elided observations (an observation window): each trajectory's row holds
    every turn under its own context (rl.context_rows); the student reads it when it sees the
    observations (masked out, no observation is read, so the trajectory itself serves)."""
    own = [context_row(t) for t in trajs] if any(has_elisions(t) for t in trajs) else None
    windowed = own is not None and cfg.algo.student_sees_observations
    return own, [r.length for r in own] if windowed else [t.length for t in trajs]


def batch_row_order(trajs: Sequence[Trajectory], cfg: StepConfig, row_shards: int = 1) -> list[int]:
    """order[i]: the trajectory (index into `trajs`) that make_train_batch puts in row i: the
    identity, with train.pack_rows rl.packing.balanced_order's, with train.micro_batch_groups
    rl.micro_groups.length_order's."""
    if cfg.pack_rows or cfg.micro_batch_groups > 1:
        return _row_order(_row_lengths(trajs, cfg)[1], cfg, row_shards)
    return list(range(len(trajs)))


def _row_order(lengths: Sequence[int], cfg: StepConfig, row_shards: int) -> list[int]:
    """The rows' order under train.pack_rows or train.micro_batch_groups."""
    if cfg.pack_rows:
        return _packing_order(lengths, cfg, row_shards)
    length_classes.whole_cells(len(lengths), row_shards, cfg, f"train.micro_batch_groups={cfg.micro_batch_groups}")
    return [int(i) for i in micro_groups.length_order(lengths, row_shards, cfg.micro_batches)]


def _packing_order(lengths: Sequence[int], cfg: StepConfig, row_shards: int) -> list[int]:
    """train.pack_rows' row order of rows of `lengths` (rl.packing.balanced_order)."""
    modulus = packing_modulus(len(lengths), row_shards, cfg)
    return [int(i) for i in balanced_order(lengths, shards=row_shards, modulus=modulus, keep=cfg.mini_batches)]


def _offset_groups(ids: np.ndarray, offset: int) -> np.ndarray:
    """Group ids numbered from `offset` (the process's first group); -1 (no group) kept."""
    return np.where(ids >= 0, ids + np.int32(offset), -1).astype(np.int32)


def needs_turn_uses(cfg: StepConfig, method: ResolvedMethod) -> bool:
    """Whether the batch carries turn_uses: TurnSight's dependency horizon reads it."""
    return cfg.algo.selection == "dependency" and "turn_uses" in _optional_inputs(method)


def _optional_inputs(method: ResolvedMethod) -> tuple[str, ...]:
    return tuple(x for est in (method.advantage, method.base) if est is not None for x in est.optional)


def packing_modulus(b: int, row_shards: int, cfg: StepConfig) -> int:
    """The cell modulus of train.pack_rows (rl.packing: cells as rl.length_classes lays them out);
    ConfigError when `b` rows do not form whole cells on `row_shards` shards."""
    return length_classes.whole_cells(b, row_shards, cfg, "train.pack_rows")


def _pack(items, width: int, min_rows: int, row_shards: int, processes: int, modulus: int, pad_id: int) -> PackedRows:
    """PackedRows of per-item arrays (rl.packing.assemble) in rows of `width`."""
    row, offset, plan = plan_packing([len(it["tokens"]) for it in items], width, shards=row_shards, modulus=modulus,
                                     min_rows=min_rows, total_shards=row_shards * processes)
    tokens, layout = assemble(items, row, offset, plan, width, shards=row_shards, modulus=modulus, pad_id=pad_id)
    return PackedRows(tokens, layout, row, offset, plan)


def _packed_width(width: int, pack_width: int, buckets: Sequence[int]) -> int:
    """Packed rows' width: the batch's (bucketed) width, or train.pack_width's bucket when wider."""
    return max(width, pick_bucket(pack_width, buckets, "train.pack_width")) if pack_width else width


def _pack_views(views: PackedViews, width: int, min_rows: int, row_shards: int, processes: int, modulus: int,
                pad_id: int) -> PackedViews:
    """The views with their rows packed several per row in rows of `width` (tokens and layout then
    live in .packed)."""
    lay = views.layout
    fields = {"tokens": np.asarray(views.tokens), **{f.name: np.asarray(getattr(lay, f.name))
                                                   for f in dataclasses.fields(Layout)}}
    real = fields["segment_ids"] >= 0
    ends = np.where(real.any(axis=1), real.shape[1] - np.argmax(real[:, ::-1], axis=1), 0)  # one past the last real token
    items = [{k: v[i, :ends[i]] for k, v in fields.items()} for i in range(real.shape[0])]
    packed = _pack(items, width, min_rows, row_shards, processes, modulus, pad_id)
    return views.replace(tokens=None, layout=None, packed=packed)


def _bucket(n: int, buckets: Sequence[int], floor: int, what: str) -> int:
    """The bucket of a width n at or above `floor` (any bucket when n exceeds them all: it raises)."""
    above = [b for b in buckets if b >= max(floor, 1)] or list(buckets)
    return pick_bucket(n, above if n <= above[-1] else buckets, what)


def shape_keys(stats: dict[str, float]) -> list[str]:
    """The width keys of make_train_batch's stats (the floors `min_shapes` takes), in order."""
    fixed = {"RT", "RP"} | {a.rows_key for a in AUXILIARIES.values() if a.rows_key}
    return [k for k in stats if k in fixed or (k[:1] in "TNPU" and (len(k) == 1 or k[1:].isdigit()))]


# ---- the worst-case geometry, for the dry-run memory plan ----

@dataclasses.dataclass
class Geometry:
    batch: int  # trajectories per step (B)
    length: int  # T: bucketed prompt + response
    policy: int  # N: policy tokens per row (bucketed response budget)
    packed: int  # P: packed teacher row
    distinct: int  # U: distinct teacher predictors per row
    views: int  # R: teacher views (depths, + reference row with KL)
    turns: int  # K
    class_rows: tuple[int, ...] | None = None  # rows per cell of each length class (rl.length_classes)
    row_shards: int = 1
    pack_cell: int | None = None  # train.pack_rows: trajectories per cell (rl.packing)
    pack_student: tuple[int, int] = (0, 0)  # with pack_cell: the student's (packed rows per cell, width), at the worst
    pack_teacher: tuple[int, int] = (0, 0)  # with pack_cell: the teacher's (packed rows per cell, width), at the worst
    aux_rows: tuple[tuple[str, int], ...] = ()  # (step auxiliary, its rows' width) of those with rows
    turn_uses: bool = False  # the [B, K, K] dependency matrix (rl.selection="dependency")
    micro_groups: tuple[int, ...] | None = None  # train.micro_batch_groups: micro-batches per group (each at T / P at the worst)


def worst_case_geometry(cfg: mlc.ConfigDict, method: ResolvedMethod, step_cfg: StepConfig,
                        row_shards: int) -> Geometry:
    """The config's widest batch for a mesh of `row_shards` (data x fsdp) row shards."""
    r, t = cfg.rollout, cfg.train
    _, window_extra = method.rollout.planned_extra(cfg)  # e.g. MM-GRPO's rows of several contexts (rl.context_rows)
    length = pick_bucket(r.max_prompt_tokens + r.max_response_tokens + window_extra, DEFAULT_BUCKETS,
                         "plan: trajectory")
    policy = policy_bucket(r.max_response_tokens)
    packed = pick_bucket(int(length * cfg.plan.packed_factor), DEFAULT_PACKED_BUCKETS, "plan: packed row")
    views = method.teacher_views(step_cfg.algo) + int(packed_reference(step_cfg, method))
    distinct = policy_bucket(int(policy * min(views, cfg.plan.distinct_factor)))
    batch = t.prompts_per_step * step_cfg.rows_per_prompt
    class_rows = pack_cell = None
    pack_student = pack_teacher = (0, 0)
    if step_cfg.length_classes > 1:  # the worst case: every class as wide as the widest row
        class_rows, _ = length_classes.cell_rows(batch, row_shards, step_cfg)
    if step_cfg.pack_rows:  # the worst case: every row as wide as the widest
        pack_cell = batch // (row_shards * packing_modulus(batch, row_shards, step_cfg))
        width = _packed_width(length, step_cfg.pack_width, DEFAULT_BUCKETS)
        pack_student = (_worst_rows(pack_cell, length, width), width)
        width = _packed_width(packed, step_cfg.teacher_pack_width or step_cfg.pack_width, DEFAULT_PACKED_BUCKETS)
        pack_teacher = (_worst_rows(pack_cell, packed, width), width)
    aux_rows = tuple((a.name, a.plan_width(cfg, length)) for a in method.auxiliaries if a.batch_rows is not None)
    return Geometry(batch, length, policy, packed, distinct, views, r.max_turns, class_rows, row_shards, pack_cell,
                    pack_student, pack_teacher, aux_rows, needs_turn_uses(step_cfg, method),
                    micro_groups.split_counts(step_cfg.micro_batches, step_cfg.micro_batch_groups)
                    if step_cfg.micro_batch_groups > 1 else None)


def _worst_rows(cell: int, item: int, width: int) -> int:
    """Packed rows per cell (bucketed, rl.packing.rows_bucket) that first-fit decreasing can need
    for `cell` items of at most `item` tokens in rows of `width`: it opens a row only when every
    open one holds more than width - item tokens, so all rows but the last do."""
    return rows_bucket(min(cell, cell * item // (width - item + 1) + 1), cell)


def abstract_batch(g: Geometry, mesh, method: ResolvedMethod) -> TrainBatch:
    """A TrainBatch of ShapeDtypeStructs at geometry `g`, sharded as shard_batch would place it."""
    def arr(shape, dtype, axis=0):
        spec = [None] * len(shape)
        spec[axis] = BATCH
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, fit_spec(P(*spec), shape, mesh)))

    b, i32 = g.batch, jnp.int32
    classes = row_class = views = None
    if g.class_rows is not None:
        classes, row_class = LengthClasses(g.class_rows, (g.length,) * len(g.class_rows), g.row_shards), arr((b,), i32)
    def packed_rows(rows_width):  # rl.packing's arrays at the worst case
        rows, width = rows_width
        rp = b // g.pack_cell * rows
        return PackedRows(arr((rp, width), i32), Layout(*(arr((rp, width), i32) for _ in range(6))), arr((b,), i32),
                          arr((b,), i32), RowPacking(rows, g.pack_cell, g.row_shards))

    if method.needs_views:
        lay = Layout(*(arr((b, g.packed), i32) for _ in range(6)))
        views = PackedViews(arr((b, g.packed), i32), lay, arr((g.views, b, g.policy), i32, axis=1),
                            arr((b, g.distinct), i32), arr((b, g.distinct), i32), arr((g.views, b, g.policy), i32, axis=1),
                            row_class=row_class, classes=None if classes is None else LengthClasses(
                                g.class_rows, (g.packed,) * len(g.class_rows), g.row_shards))
        views = views.replace(covered=arr((b, g.policy), bool))  # privileged and hindsight views record it
        if g.pack_cell is not None:
            views = views.replace(tokens=None, layout=None, packed=packed_rows(g.pack_teacher))
    signals = {r.output: arr({"trajectory": (b,), "turn": (b, g.turns), "token": (b, g.policy)}[r.per], jnp.float32)
               for r in method.rewards}
    aux_rows = {name: jax.tree.map(lambda x: arr(x.shape, x.dtype), AUXILIARIES[name].abstract_rows(b, width, g.turns))
                for name, width in g.aux_rows}
    return TrainBatch(
        tokens=arr((b, g.length), i32), valid=arr((b, g.length), bool), pol_pos=arr((b, g.policy), i32),
        pol_valid=arr((b, g.policy), bool), turn_ids=arr((b, g.policy), i32),
        old_logprobs=arr((b, g.policy), jnp.float32), group_ids=arr((b,), i32), num_turns=arr((b,), i32),
        signals=signals, views=views, length_class=row_class, classes=classes,
        packed=None if g.pack_cell is None else packed_rows(g.pack_student), aux_rows=aux_rows or None,
        turn_uses=arr((b, g.turns, g.turns), bool) if g.turn_uses else None,
        micro_groups=None if g.micro_groups is None else MicroGroups(
            g.micro_groups, (g.length,) * len(g.micro_groups), (g.packed,) * len(g.micro_groups)),
    )
