"""Packed hindsight views (docs/spec.md §4.2) and the compact policy-token index of a training batch.

One packed teacher row per trajectory holds:

  [original trajectory (segment 0)]
  then, for every covered turn k with a non-empty hindsight block:
  [trunk_k: message open + item(k) + item(k+1) + ... ]           reads original[:header_start_k]
  [branch_k,m: message close + assistant header + turn k tokens]  reads original[:header_start_k]
                                                                  and trunk_k up to m items
  (one branch per distinct item count m = min(d, K - k) over the depths d)

so the three depths of a turn share their common prefix, and a branch token sees exactly what it
would see in the plain sequence original[:header_start_k] + message(d) + header + turn k
(rotary positions continue from header_start_k). A turn whose block is empty (the answer turn
with source "tool_results") is scored on the original segment itself: its teacher context is
the student's own. Turns outside the coverage window (`turns="first:N"/"last:N"`) get no views.

Everything is indexed by *policy positions*: `pol_pos [B, N]` lists each row's policy-token
positions (N = a bucket of the longest row's count), and `view_pred [D, B, N]` gives, for depth
d, the packed index whose hidden state predicts that token. The trainer works on these compact
[B, N] arrays (turn means, group statistics and the loss only involve policy tokens).

A trajectory whose turns saw elided observations (an observation window, methods.mm_grpo) has the
segments of its rl.context_rows row in place of the original: each turn's own context is
segment 0 up to a point, then the rest of its context (`TurnPrefix`), and the trunk of a turn
scored outside segment 0 starts with that rest, so its views read exactly that turn's context.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
from flax import struct

from turnsight_jax.chat.hindsight_template import DEFAULT_FILLER
from turnsight_jax.chat.hindsight import HindsightTemplate, hindsight_pieces
from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.models.attention import NO_SEGMENT, PAD_SEGMENT, Layout
from turnsight_jax.rl.config import parse_turn_coverage
from turnsight_jax.rl.context_rows import ContextRow, context_row, row_policy_positions

# multiples of 256 up to 4,096, of 1,024 up to 16,384, of 4,096 up to 131,072 (at most 1/4 padding
# past 4,096; powers of two padded a 4.3k-token packed row to 8k)
DEFAULT_PACKED_BUCKETS: tuple[int, ...] = (tuple(range(256, 4097, 256)) + tuple(range(5120, 16385, 1024))
                                           + tuple(range(20480, 131073, 4096)))


def pick_bucket(n: int, buckets: Sequence[int], what: str) -> int:
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ValueError(f"{what}: length {n} exceeds the largest bucket {max(buckets)}; add a larger bucket "
                     f"(never truncated silently)")


def policy_bucket(n: int) -> int:
    """Width for n policy tokens: multiples of 32 up to 512, then powers of two (bounded compiles,
    little padding on short responses)."""
    if n <= 512:
        return max(32, -(-n // 32) * 32)
    return 1 << int(n - 1).bit_length()


def covered_turns(num_turns: int, turns: str) -> range:
    """Turn indices a coverage spec selects: "all", "first:N" or "last:N"."""
    kind, n = parse_turn_coverage(turns)
    if kind == "all":
        return range(num_turns)
    return range(min(n, num_turns)) if kind == "first" else range(max(0, num_turns - n), num_turns)


@struct.dataclass
class PackedViews:
    """Teacher input for a batch of B trajectories (numpy or jax arrays).

    tokens [B, P] int32 and layout (Layout fields [B, P]): the packed rows.
    view_pred [R, B, N] int32: packed index whose hidden state predicts policy token n of row b
      under view r: r < D the hindsight depths, r = D (when built `with_reference`) the student's
      own context (the original segment) for a KL term. 0 where the policy slot is padding.
    pred, pred_target [B, U] int32: the distinct (predictor, target) pairs of each row — depths
      that clip to the same block, and every depth of an empty block, share one pair, so the
      vocabulary projection runs once per distinct pair. Within a row the predictors ascend from
      slot 0 and the rest is zero padding (so slot u > 0 is real exactly when pred > 0).
    slot [R, B, N] int32: index into pred of each (view, row, policy token).
    row_class [B] int32 or None, classes (static): the rows' length classes by packed length
      (rl.length_classes): the teacher's forward runs each class cut to classes.widths[i] <= P.
    packed: rl.packing.PackedRows or None: the rows packed several per row (train.pack_rows);
      tokens and layout are then None (the packed rows replace them; pred and view_pred stay in
      each row's own coordinates).
    covered [B, N] bool or None: True where the token's view 0 showed a block (privileged views,
      methods.privileged_views) or its hindsight views did (False: no block, the student's own context:
      a turn outside rl.turns or with an empty hindsight block; rl.empty_block_turns reads it).
    """

    tokens: Any
    layout: Layout
    view_pred: Any
    pred: Any
    pred_target: Any
    slot: Any
    row_class: Any = None
    classes: Any = struct.field(pytree_node=False, default=None)
    packed: Any = None
    covered: Any = None


@dataclasses.dataclass(frozen=True)
class ViewOptions:
    depths: tuple[int, ...] = (1, 2, 3)
    source: str = "tool_results"
    turns: str = "all"
    template: HindsightTemplate = HindsightTemplate()
    budget: int = 0  # every non-empty hindsight message this many tokens (0: off; rl.hindsight_budget)
    filler: str = DEFAULT_FILLER  # what pads a message to the budget (rl.hindsight_filler)


def distinct_slots_used(pred):
    """[B, U] bool: the real slots of PackedViews.pred [B, U] (numpy or jax): slot 0, and every
    slot whose predictor is > 0 (a row's predictors ascend from slot 0, then zero padding)."""
    return (pred > 0) | (np.arange(pred.shape[1]) == 0)[None, :]


def policy_positions(trajs: Sequence[Trajectory], width: int | None = None):
    """pol_pos [B, N] int32 (policy-token positions, 0-padded), pol_valid [B, N] bool."""
    counts = [int(t.policy_mask.sum()) for t in trajs]
    n = width or policy_bucket(max(counts + [1]))
    if max(counts + [0]) > n:
        raise ValueError(f"a trajectory has {max(counts)} policy tokens, over the policy width {n}")
    pos = np.zeros((len(trajs), n), np.int32)
    valid = np.zeros((len(trajs), n), bool)
    for b, t in enumerate(trajs):
        p = np.flatnonzero(t.policy_mask)
        pos[b, : p.size] = p
        valid[b, : p.size] = True
    return pos, valid


class _Row:
    """Accumulates one packed row, from the trajectory's own (rl.context_rows) row."""

    def __init__(self, own: ContextRow):
        n = own.length
        self.tok = [own.tokens.astype(np.int32)]
        self.pos = [own.positions]
        self.seg = [own.segment_ids]
        self.c1s = [own.ctx1_segment]
        self.c1e = [own.ctx1_end]
        self.c2s = [np.full(n, NO_SEGMENT, np.int32)]
        self.c2e = [np.zeros(n, np.int32)]
        self.length = n
        self.next_seg = own.segments

    def add(self, ids, first_pos, ctx1_end, ctx2=(NO_SEGMENT, 0)) -> tuple[int, int]:
        """Append a segment; returns (segment id, packed start)."""
        m = len(ids)
        seg, start = self.next_seg, self.length
        self.next_seg += 1
        self.tok.append(np.asarray(ids, np.int32))
        self.pos.append(first_pos + np.arange(m, dtype=np.int32))
        self.seg.append(np.full(m, seg, np.int32))
        self.c1s.append(np.zeros(m, np.int32))
        self.c1e.append(np.full(m, ctx1_end, np.int32))
        self.c2s.append(np.full(m, ctx2[0], np.int32))
        self.c2e.append(np.full(m, ctx2[1], np.int32))
        self.length += m
        return seg, start

    def arrays(self, width: int):
        pad = width - self.length
        fills = (0, 0, PAD_SEGMENT, NO_SEGMENT, 0, NO_SEGMENT, 0)
        parts = (self.tok, self.pos, self.seg, self.c1s, self.c1e, self.c2s, self.c2e)
        return [np.concatenate(p + [np.full(pad, f, np.int32)]) for p, f in zip(parts, fills)]


def build_views(
    trajs: Sequence[Trajectory],
    tokenizer,
    *,
    options: ViewOptions = ViewOptions(),
    gold_answers: Sequence[str | None] | None = None,
    policy_width: int | None = None,
    buckets: Sequence[int] = DEFAULT_PACKED_BUCKETS,
    with_reference: bool = False,
    min_widths: tuple[int, int] = (0, 0),
    positions: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[PackedViews, dict[str, float]]:
    """Packed teacher rows for `trajs` (numpy). Returns (views, stats) where stats counts the
    packed tokens against the trajectories' own rows' tokens. `with_reference` adds the
    student-context row (view D) for a KL term. `positions`: (pol_pos, pol_valid) in the
    trajectories' rl.context_rows coordinates (a trajectory's own positions when no turn saw an
    elided observation) when already built (otherwise computed at `policy_width`)."""
    depths = tuple(options.depths)
    if not depths or any(d < 1 for d in depths):
        raise ValueError(f"hindsight depths must be a non-empty tuple of ints >= 1, got {depths}")
    max_depth = max(depths)
    own_rows = [context_row(t) for t in trajs]
    if positions is None:
        x_pos, pol_valid = policy_positions(trajs, policy_width)
        positions = row_policy_positions(own_rows, x_pos, pol_valid), pol_valid
    pol_pos, pol_valid = positions
    n_pol = pol_pos.shape[1]
    n_views = len(depths) + int(with_reference)
    view_pred = np.zeros((n_views, len(trajs), n_pol), np.int32)
    covered = np.zeros((len(trajs), n_pol), bool)  # the tokens whose views show a hindsight block
    rows = []
    block_tokens = copy_tokens = 0  # the packed tokens of each view kind (next to the trajectories)
    n_msgs = msg_tokens = cut = 0  # distinct (turn, item count) hindsight messages, their tokens, those cut
    for b, (traj, own) in enumerate(zip(trajs, own_rows)):
        row = _Row(own)
        where = {int(p): j for j, p in enumerate(pol_pos[b, : int(pol_valid[b].sum())])}
        # Default predictor of every policy token: the original sequence (the student's context).
        # The reference row (with_reference) keeps it.
        for p, j in where.items():
            view_pred[:, b, j] = p - 1
        answer = None if gold_answers is None else gold_answers[b]
        for k in covered_turns(traj.num_turns, options.turns):
            turn = traj.turns[k]
            pieces = hindsight_pieces(tokenizer, traj, k, max_depth=max_depth, source=options.source,
                                      gold_answer=answer, template=options.template, budget=options.budget,
                                      filler=options.filler)
            if pieces.is_empty:
                continue
            # the turn's context before its header: segment 0 before `read`, then `rest` (which
            # opens the trunk, so the branches need no third context); the trunk holds the deepest
            # message's shown content, a branch reads the first kept(m) tokens of it and carries its
            # own filler (with a budget: chat.budget)
            pre = own.prefixes[k]
            read = pre.read
            content = [t for item in pieces.item_ids for t in item]
            trunk = [int(t) for t in pre.rest] + list(pieces.open_ids) + content[: pieces.kept(pieces.num_items)]
            trunk_seg, trunk_start = row.add(trunk, read, read)
            block_tokens += len(trunk)
            policy = [int(x) for x in traj.tokens[turn.policy_start: turn.policy_end - 1]]
            branch_of: dict[int, int] = {}
            for di, d in enumerate(depths):
                m = min(d, pieces.num_items)
                if m not in branch_of:
                    end = pre.rest.size + len(pieces.open_ids) + pieces.kept(m)
                    pad = pieces.padding(m)
                    head = pad + list(pieces.close_ids) + list(pieces.header_ids)
                    _, start = row.add(head + policy, read + end, read, (trunk_seg, trunk_start + end))
                    block_tokens += len(pad)  # the filler is part of the block shown
                    copy_tokens += len(head) - len(pad) + len(policy)
                    # the token before policy token 0 is the header's last token
                    branch_of[m] = start + len(head) - 1
                    n_msgs += 1
                    msg_tokens += len(pieces.open_ids) + pieces.kept(m) + len(pad) + len(pieces.close_ids)
                    cut += int(pieces.kept(m) < sum(len(x) for x in pieces.item_ids[:m]))
                first = branch_of[m]
                for i, p in enumerate(range(turn.policy_start, turn.policy_end)):
                    view_pred[di, b, where[int(own.index[p])]] = first + i
                    covered[b, where[int(own.index[p])]] = True
        rows.append(row)
    width = pick_bucket(max([r.length for r in rows] + [min_widths[0]]), buckets, "packed hindsight row")
    cols = [np.stack(c) for c in zip(*(r.arrays(width) for r in rows))]
    tok, pos, seg, c1s, c1e, c2s, c2e = cols
    pred, pred_target, slot = _distinct_predictors([r.tokens for r in own_rows], view_pred, pol_pos, pol_valid,
                                                   min_widths[1])
    views = PackedViews(tok, Layout(pos, seg, c1s, c1e, c2s, c2e), view_pred, pred, pred_target, slot,
                        covered=covered)
    own = sum(r.length for r in own_rows)
    packed = sum(r.length for r in rows)
    stats = {"view_tokens": float(packed), "trajectory_tokens": float(own), "view_overhead": packed / max(own, 1),
             "packed_width": float(width), "teacher_rows": float(pol_valid.sum() * n_views),
             "teacher_distinct_rows": float(sum(len(set(view_pred[:, b, pol_valid[b]].ravel())) for b in range(len(trajs)))),
             **view_token_kinds(own, block_tokens, copy_tokens),
             "hindsight_blocks": float(n_msgs), "hindsight_block_tokens": float(msg_tokens),
             "hindsight_blocks_cut": float(cut)}
    return views, stats


def view_token_kinds(trajectory: int, blocks: int, copies: int) -> dict[str, float]:
    """The packed teacher tokens by kind (they sum to stats["view_tokens"]): the trajectories
    themselves (segment 0), the blocks the teacher is shown (hindsight items, privileged texts;
    under an observation window with the rest of the turn's context that opens the trunk) and the
    copies of the turns scored behind them (with their message close and assistant header)."""
    return {"view_tokens_trajectory": float(trajectory), "view_tokens_blocks": float(blocks),
            "view_tokens_turn_copies": float(copies)}


def _distinct_predictors(row_tokens, view_pred, pol_pos, pol_valid, min_width: int = 0):
    """(pred [B, U], pred_target [B, U], slot [R, B, N]): one entry per distinct predictor;
    row_tokens: each row's own tokens, which pol_pos indexes."""
    r, b, n = view_pred.shape
    targets = [tokens[pol_pos[i]] for i, tokens in enumerate(row_tokens)]
    uniq = []
    for i in range(b):
        valid = pol_valid[i]
        keys = view_pred[:, i, :][:, valid]  # [R, n_valid]
        tg = np.broadcast_to(targets[i][valid], keys.shape)
        u, inverse = np.unique(keys.ravel(), return_inverse=True)
        first = np.zeros(u.size, np.int64)
        first[inverse[::-1]] = np.arange(inverse.size)[::-1]
        uniq.append((u, tg.ravel()[first], inverse.reshape(keys.shape)))
    width = policy_bucket(max([u.size for u, _, _ in uniq] + [min_width]))
    pred = np.zeros((b, width), np.int32)
    pred_target = np.zeros((b, width), np.int32)
    slot = np.zeros((r, b, n), np.int32)
    for i, (u, tg, inv) in enumerate(uniq):
        pred[i, : u.size] = u
        pred_target[i, : u.size] = tg
        slot[:, i, pol_valid[i]] = inv
    return pred, pred_target, slot


# ---- the teacher's view builders, by teacher kind ----

@dataclasses.dataclass(frozen=True)
class ViewRequest:
    """What a teacher-view builder gets from rl.batch.make_train_batch: the batch's trajectories
    and their tasks (row order), the tokenizer, the StepConfig, whether the views carry the
    reference row (rl.batch.packed_reference), the policy tokens' positions in the trajectories'
    rl.context_rows coordinates (`row_positions`) and in their own (`policy_positions`), both
    [B, N] int32 with `pol_valid` [B, N] bool, the packed-row `buckets` and the batch's floor
    `min_widths` (P, U)."""

    trajs: Sequence[Trajectory]
    tasks: Sequence[Any]
    tokenizer: Any
    cfg: Any
    with_reference: bool
    row_positions: np.ndarray
    policy_positions: np.ndarray
    pol_valid: np.ndarray
    buckets: Sequence[int]
    min_widths: tuple[int, int]


# teacher kind (rl.methods.Method.teacher) -> fn(ViewRequest) -> (PackedViews, stats)
VIEW_BUILDERS: dict[str, Any] = {}


def register_view_builder(kind: str, fn) -> None:
    """Let methods whose `teacher` is `kind` have their views built by `fn(ViewRequest) ->
    (PackedViews, stats)` (view_pred [R, B, N] with R = the kind's views + the reference row)."""
    if kind in VIEW_BUILDERS:
        raise ValueError(f"teacher view builder {kind!r} already registered")
    VIEW_BUILDERS[kind] = fn


def _hindsight_views(req: ViewRequest):
    """TurnSight's hindsight views: one per depth of rl.depths."""
    a = req.cfg.algo
    return build_views(req.trajs, req.tokenizer,
                       options=ViewOptions(depths=tuple(a.depths), source=a.source, turns=a.turns,
                                           template=a.hindsight_template, budget=a.hindsight_budget,
                                           filler=a.hindsight_filler),
                       gold_answers=[t.answer for t in req.tasks], buckets=req.buckets,
                       with_reference=req.with_reference, min_widths=req.min_widths,
                       positions=(req.row_positions, req.pol_valid))


register_view_builder("hindsight", _hindsight_views)
