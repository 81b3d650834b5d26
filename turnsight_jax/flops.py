"""The one FLOP counter: what a piece of work needs, and what the compiled step executes for it.

Used by the trainer's metrics (`perf/mfu*`, `perf/update_flops_*`) and by every benchmark, so
their MFU figures agree. Conventions:

* a multiply-add is 2 FLOPs; matmuls only (projections, MLP, attention scores and values, the
  vocabulary head). Norms, rotary, softmax, the embedding lookup and the optimizer are not counted;
* a backward pass costs 2 forwards, so forward + backward = 3 forwards;
* **necessary**: every real token through the trunk once per pass, attention over exactly the
  (query, key) pairs the token may read (causal, or the packed hindsight layout), the head at the
  rows whose log-prob is used (policy tokens; the teacher's distinct (predictor, target) pairs).
  MFU counts these only;
* **executed**: what the compiled step computes for the batch as shaped: padded rows and slots,
  the pairs the chunked attention kernel scores (models.attention.chunked_attention: query chunks
  in at most 4 groups, each scoring every key up to its group's end; with model.attn_row_group
  only the chunks of each row group that hold a live query), the head chunks that hold a used
  row (rl.logprobs skips the others), and rematerialised forwards (a `jax.checkpoint`ed layer,
  attention chunk or log-prob chunk runs its forward again in the backward pass: 4 forwards
  instead of 3; the skipping attention kernel's own backward recomputes only the score product:
  3.5; under model.remat the layer's forward, attention's included, runs once more: +1). The
  fused kernel (model.attn_impl "pallas", models.fused_attention) computes whole (query block,
  key block) tiles that hold a readable pair, and its backward pass runs two kernels (dq: 3 tile
  products; dk/dv: 4) against the forward's 2: 4.5 forwards in all.

executed / necessary is the step's padding ratio (1.0 = no wasted work).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from turnsight_jax.models.attention import chunk_plan
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.rl.views import distinct_slots_used


def trunk_flops_per_token(cfg: Qwen3Config) -> float:
    """Projection and MLP FLOPs of one token through every layer (no attention pairs, no head)."""
    d, f, h = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = d * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * f
    return 2.0 * cfg.num_layers * per_layer


def attention_flops(cfg: Qwen3Config, pairs: float) -> float:
    """QK^T and PV over `pairs` (query, key) pairs, every layer and query head."""
    return 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * pairs


def head_flops(cfg: Qwen3Config, rows: float) -> float:
    return 2.0 * cfg.hidden_size * cfg.vocab_size * rows


def forward_flops(cfg: Qwen3Config, tokens: float, pairs: float, head_rows: float) -> float:
    return trunk_flops_per_token(cfg) * tokens + attention_flops(cfg, pairs) + head_flops(cfg, head_rows)


def causal_pairs(length: int) -> float:
    return length * (length + 1) / 2.0


def readable_pairs(valid: np.ndarray) -> float:
    """Causal pairs among the readable tokens of right-padded rows; valid [B, T] bool."""
    valid = np.asarray(valid, bool)
    return float(np.sum(np.where(valid, np.cumsum(valid, axis=1), 0)))


def layout_pairs(segment_ids, ctx1_segment, ctx1_end, ctx2_segment, ctx2_end) -> float:
    """(query, key) pairs a packed layout lets its tokens read (models.attention.packed_mask):
    its own segment up to itself, plus each context segment up to the context's end. [B, P] int32;
    segments are contiguous (rl.views builds them so). Vectorised: it runs every training step."""
    return reach_pairs(_reach(segment_ids, ctx1_segment, ctx1_end, ctx2_segment, ctx2_end), segment_ids)


def reach_pairs(reach: np.ndarray, segment_ids) -> float:
    """layout_pairs from the layout's key ranges (`key_reach`) [B, T, 3, 2]: each real token's
    own range and context ranges."""
    n = reach[..., 1] - reach[..., 0]
    real = np.asarray(segment_ids) >= 0
    return float(n[..., 0].sum() + np.where(real[..., None], n[..., 1:], 0).sum())


def chunked_pairs(width: int, q_chunk: int) -> float:
    """(query, key) pairs the chunked causally bounded kernel scores for one row of `width` tokens."""
    size, _, plan = chunk_plan(width, width, q_chunk, True)
    return float(sum((last - first) * size * keys for first, last, keys in plan))


def skipping_pairs(live: np.ndarray, q_chunk: int, row_group: int, *, reach: np.ndarray | None = None,
                   key_block: int = 0) -> float:
    """(query, key) pairs the chunked kernel scores for one forward call's rows when it skips the
    padding (models.attention.chunked_attention with row_group > 0): live [B, W] bool, the queries
    that read a key, at the call's width W. Rows run in groups of gcd(B, row_group); a group's
    chunk is scored (its queries x its group's key bound, per row) only if one of its queries is
    live. row_group 0: nothing skipped, B x chunked_pairs(W). key_block (with `reach` [B, W, 3, 2],
    `key_reach`): a scored chunk whose key bound exceeds one block scores only the blocks of
    `key_block` keys one of its group's queries reads (the last block padded to a whole one)."""
    live = np.asarray(live, bool)
    b, w = live.shape
    if row_group <= 0 or b == 0:
        return b * chunked_pairs(w, q_chunk)
    r = math.gcd(b, row_group)
    per_group = live.reshape(b // r, r, w).any(axis=1)  # [groups, W]
    size, _, plan = chunk_plan(w, w, q_chunk, True)
    blocks = None
    if key_block and reach is not None and any(keys > key_block for *_, keys in plan):
        blocks = _blocks_read(np.asarray(reach)[:, :w], key_block, -(-max(k for *_, k in plan) // key_block))
        blocks = blocks.reshape(b // r, r, w, -1).any(axis=1)  # [groups, W, blocks]
    total = 0.0
    for first, last, keys in plan:
        for c in range(first, last):
            scored = per_group[:, c * size:(c + 1) * size].any(axis=1)
            if blocks is None or keys <= key_block:
                total += float(scored.sum()) * r * size * keys
                continue
            read = blocks[:, c * size:(c + 1) * size, :-(-keys // key_block)].any(axis=1)  # [groups, blocks]
            total += float(read[scored].sum()) * r * size * key_block
    return total


def key_reach(layout) -> np.ndarray:
    """[B, T, 3, 2] int64: the key ranges [lo, hi) each token of a Layout (numpy fields) reads
    under models.attention.packed_mask: its own segment from the segment's first token up to
    itself, and each context segment from its first token up to the context's end (an empty range
    lo == hi where there is none). Segments are contiguous (rl.views builds them so)."""
    return _reach(*(getattr(layout, f) for f in ("segment_ids", "ctx1_segment", "ctx1_end", "ctx2_segment",
                                                 "ctx2_end")))


def _reach(segment_ids, ctx1_segment, ctx1_end, ctx2_segment, ctx2_end) -> np.ndarray:
    """key_reach of a layout's [B, T] fields."""
    seg, c1s, c1e, c2s, c2e = (np.asarray(a) for a in (segment_ids, ctx1_segment, ctx1_end, ctx2_segment, ctx2_end))
    b, t = seg.shape
    out = np.zeros((b, t, 3, 2), np.int64)
    idx = np.arange(t)
    for i in range(b):
        real = seg[i] >= 0
        if not real.any():
            continue
        size = int(seg[i].max()) + 1
        start, end = np.zeros(size, np.int64), np.zeros(size, np.int64)
        start[seg[i][real][::-1]] = idx[real][::-1]
        end[seg[i][real]] = idx[real] + 1
        own = np.where(real, seg[i], 0)
        out[i, :, 0, 0] = np.where(real, start[own], 0)
        out[i, :, 0, 1] = np.where(real, idx + 1, 0)
        for j, (cs, ce) in enumerate(((c1s[i], c1e[i]), (c2s[i], c2e[i])), start=1):
            ok = (cs >= 0) & (cs < size)
            c = np.where(ok, cs, 0)
            lo, hi = start[c], np.minimum(ce, end[c])
            ok &= hi > lo
            out[i, :, j, 0], out[i, :, j, 1] = np.where(ok, lo, 0), np.where(ok, hi, 0)
    return out


def causal_reach(valid: np.ndarray) -> np.ndarray:
    """key_reach of right-padded causal rows (models.attention.Layout.causal): valid [B, T] bool."""
    valid = np.asarray(valid, bool)
    out = np.zeros(valid.shape + (3, 2), np.int64)
    out[..., 0, 1] = np.where(valid, np.arange(valid.shape[1]) + 1, 0)
    return out


def _blocks_read(reach: np.ndarray, block: int, n: int) -> np.ndarray:
    """[B, W, n] bool: whether each query reads a key of block j (keys j*block .. (j+1)*block - 1)."""
    lo, hi = reach[..., 0], reach[..., 1]  # [B, W, 3]
    first = np.arange(n) * block
    return ((lo[..., None] < first + block) & (hi[..., None] > first) & (hi > lo)[..., None]).any(axis=2)


def fused_pairs(reach: np.ndarray, block: int) -> float:
    """Pairs the fused kernel computes (models.fused_attention): every (query block, key block)
    tile of `block` x `block` holding a pair some query reads; reach [B, W, 3, 2] (`key_reach`).
    Rows are independent, so how they are split into calls does not change it."""
    reach = np.asarray(reach)
    w = reach.shape[1]
    n = -(-w // block)
    q_block = np.broadcast_to((np.arange(w) // block)[:, None], reach.shape[1:3])  # [W, 3]
    tiles = 0
    for row in reach:  # a row at a time, each query's ranges marked as runs of key blocks: O(W), not O(W x n)
        lo, hi = row[..., 0], row[..., 1]
        live = hi > lo
        runs = np.zeros((n, n + 1), np.int32)  # per query block: +1 where a run of read key blocks starts, -1 after
        np.add.at(runs, (q_block[live], lo[live] // block), 1)
        np.add.at(runs, (q_block[live], (hi[live] - 1) // block + 1), -1)
        tiles += int((np.cumsum(runs, axis=1)[:, :n] > 0).sum())
    return float(tiles) * block * block


FUSED_GRAD_FORWARDS = 4.5  # the fused kernel's forward + backward, in forwards (module docstring)


def reads_any(layout) -> np.ndarray:
    """[B, T] bool: the tokens of a Layout (numpy fields) that read a key (models.attention.reads_any)."""
    return ((np.asarray(layout.segment_ids) >= 0) | (np.asarray(layout.ctx1_segment) >= 0)
            | (np.asarray(layout.ctx2_segment) >= 0))


def _attention_calls(live: np.ndarray, widths: np.ndarray, row_class, micro_batches: int, reach=None) -> list:
    """(live [rows, width], reach [rows, width, 3, 2] or None) of each forward call the step makes
    over a batch's rows (micro-batches strided, rows m, m + M, ...; each length class its own call
    at its width)."""
    calls = []
    cls = np.zeros(live.shape[0], np.int32) if row_class is None else np.asarray(row_class)
    for m in range(micro_batches):
        rows = np.arange(m, live.shape[0], micro_batches)
        for c in np.unique(cls[rows]):
            sel = rows[cls[rows] == c]
            w = int(widths[sel[0]])
            calls.append((live[sel, :w], None if reach is None else reach[sel, :w]))
    return calls


def attention_pairs_executed(live: np.ndarray, widths: np.ndarray, q_chunk: int, *, row_group: int = 0,
                             row_class=None, micro_batches: int = 1, reach: np.ndarray | None = None,
                             key_block: int = 0) -> float:
    """Pairs the chunked kernel scores over a batch: live [B, W] bool (the queries that read a key),
    widths [B] (each row's forward width, `_row_widths`); reach [B, W, 3, 2] (`key_reach`) and
    key_block: the key blocks skipped too (`skipping_pairs`). Without skipping (row_group 0) each
    row costs chunked_pairs(its width)."""
    if row_group <= 0:
        return sum(chunked_pairs(int(w), q_chunk) for w in widths)
    return sum(skipping_pairs(x, q_chunk, row_group, reach=rx, key_block=key_block)
               for x, rx in _attention_calls(live, widths, row_class, micro_batches, reach))


@dataclasses.dataclass
class UpdateFlops:
    """FLOPs of one update (the fused step on one batch), by part. `parts` maps a part name to
    (necessary, executed)."""

    parts: dict[str, tuple[float, float]]

    @property
    def necessary(self) -> float:
        return sum(n for n, _ in self.parts.values())

    @property
    def executed(self) -> float:
        return sum(e for _, e in self.parts.values())

    @property
    def ratio(self) -> float:
        """executed / necessary (1.0: nothing wasted)."""
        return self.executed / max(self.necessary, 1.0)


def head_rows_executed(used: np.ndarray, chunk: int, *, micro_batches: int = 1, row_shards: int = 1,
                       row_class: np.ndarray | None = None) -> float:
    """Head rows rl.logprobs.chunked_logprobs computes for the slots `used` [B, S] bool: per
    micro-batch (strided rows), row shard (contiguous) and length class (row_class [B], when the
    batch has them: each class is its own call), the used slots are moved to the front and only
    chunks holding one run; a cell that fits in one chunk runs whole."""
    used = np.asarray(used, bool)
    cls = np.zeros(used.shape[0], np.int32) if row_class is None else np.asarray(row_class)
    total = 0.0
    for m in range(micro_batches):
        rows, rc = used[m::micro_batches], cls[m::micro_batches]
        per_shard = max(rows.shape[0] // row_shards, 1)
        for s in range(0, rows.shape[0], per_shard):
            for c in np.unique(rc[s:s + per_shard]):
                cell = rows[s:s + per_shard][rc[s:s + per_shard] == c]
                total += cell.size if cell.size <= chunk else -(-int(cell.sum()) // chunk) * chunk
    return total


def _row_widths(tokens, classes, row_class, packed=None, group_widths=None, groups=None) -> np.ndarray:
    """The width each row's forward runs at: [B] its length class's, or its micro-batch group's
    (rl.micro_groups: `group_widths` of `groups`), or the batch's; [Rp] each packed row's when the
    rows are packed (rl.packing)."""
    if group_widths is not None:
        return np.asarray(group_widths)[groups.row_groups(np.asarray(tokens).shape[0])]
    if packed is not None:
        rp, w = np.asarray(packed.tokens).shape
        return np.full(rp, w)
    b, t = np.asarray(tokens).shape
    if classes is None:
        return np.full(b, t)
    return np.asarray(classes.widths)[np.asarray(row_class)]


def update_flops(cfg: Qwen3Config, batch, *, updates: int, extra_forwards: int = 0, ref_forward: bool = False,
                 q_chunk: int, remat: bool, teacher_distinct_rows: float | None = None, logprob_chunk: int = 1024,
                 score_chunk: int | None = None, micro_batches: int = 1, mini_batches: int = 1,
                 teacher_micro_batches: int = 1,
                 row_shards: int = 1, teacher_cfg: Qwen3Config | None = None, critic: bool = False,
                 prm: bool = False, row_group: int = 0, key_block: int = 0, fused_block: int = 0) -> UpdateFlops:
    """FLOPs of the fused step (rl.step) on a numpy TrainBatch (rl.batch).

    updates: forward+backward passes over every row (ppo_epochs: each row is in one mini-batch per
    epoch); extra_forwards: no-gradient student forwards (π_old on the masked context);
    ref_forward: the reference is scored on the student's context (not in the packed views);
    teacher_distinct_rows: the real distinct (predictor, target) pairs (build_views' stats); by
    default every used slot of `pred` counts. logprob_chunk (the update's), score_chunk (the
    no-gradient forwards'; None: logprob_chunk), micro_batches, teacher_micro_batches, row_shards
    (the mesh's data x fsdp): how the head's chunks fall (`head_rows_executed`); mini_batches x
    micro_batches: the student's forward calls (strided rows), whose row groups skip padding.
    With length classes (rl.length_classes) each row runs at its class's width; packed rows
    (rl.packing) each at the packed width. teacher_cfg: the teacher's architecture when it is
    another model (teacher.weights='external'; default `cfg`). critic: the method trains a critic
    (methods.critic: a trunk of `cfg`'s architecture, no vocabulary head): one no-gradient forward for
    V_old and a forward+backward per update (part "critic"; the [D] value head's 2·D FLOPs per
    token are left out). prm: the method's step-PRM (methods.prm) reads the frozen reference trunk: one
    no-gradient trunk forward (part "prm"; its head's FLOPs left out). A batch with probe rows
    (methods.orchard) adds the teacher's forward over them and its two head columns per state (part
    "retrospective"). row_group: model.attn_row_group (the RL step's forwards, the student's,
    the critic's, the PRM's, the teacher's views and probes, skip the query chunks of padding per
    group of rows: their executed pairs count only the chunks run; packed rows under several
    forward calls are counted unskipped, an upper bound; under a gradient the skipping kernel's
    backward pass costs 2.5 forwards, the rematerialised unskipped chunk's 3). key_block:
    model.attn_key_block (with row groups, a scored chunk scores only the key blocks one of its
    group's queries reads). fused_block: model.attn_block when the forwards run the fused kernel
    (model.attn_impl "pallas"): attention counts its tiles (`fused_pairs`) and row_group /
    key_block do not apply."""
    if fused_block:
        row_group = key_block = 0
    trunk = trunk_flops_per_token(cfg)
    score_chunk = score_chunk or logprob_chunk
    tokens = float(np.asarray(batch.valid).sum())
    lay = getattr(batch, "layout", None)  # rows with several contexts (rl.context_rows): what each token reads
    pairs = readable_pairs(batch.valid) if lay is None else layout_pairs(
        lay.segment_ids, lay.ctx1_segment, lay.ctx1_end, lay.ctx2_segment, lay.ctx2_end)
    policy = float(np.asarray(batch.pol_valid).sum())
    need_fwd = forward_flops(cfg, tokens, pairs, policy)
    groups = getattr(batch, "micro_groups", None)  # rl.micro_groups: each micro-batch group at its own width
    grouped = groups is not None and groups.micro_batches == micro_batches
    widths = _row_widths(batch.tokens, getattr(batch, "classes", None), getattr(batch, "length_class", None),
                         getattr(batch, "packed", None), groups.widths if grouped else None, groups)
    slots = float(widths.sum())
    # a forward in another number of calls than the groups' runs every row at the batch's width
    full = widths if not grouped else _row_widths(batch.tokens, None, None)

    def row_widths(calls: int) -> np.ndarray:
        return widths if not grouped or calls == micro_batches else full

    # the RL step's student forwards (rl.logprobs.policy_logprobs) skip their padding's query chunks
    # per row group like the teacher's views (packed rows under several forward calls counted
    # unskipped, an upper bound), and so do the critic's and the PRM's trunks on the same rows
    student_packed = getattr(batch, "packed", None)
    every_chunk = lambda w: attention_flops(cfg, sum(chunked_pairs(int(x), q_chunk) for x in w))
    s_lay = student_packed.layout if student_packed is not None else lay
    s_live = (None if row_group <= 0 else np.asarray(batch.valid, bool) if s_lay is None else reads_any(s_lay))
    s_reach = (None if s_live is None or not key_block else causal_reach(batch.valid) if s_lay is None
               else key_reach(s_lay))

    s_tiles = (None if not fused_block else attention_flops(cfg, fused_pairs(
        causal_reach(batch.valid) if s_lay is None else key_reach(s_lay), fused_block)))

    def student_attn(calls: int) -> float:
        """Attention FLOPs of one student forward over the batch in `calls` strided calls."""
        if s_tiles is not None:
            return s_tiles
        if s_live is None or (student_packed is not None and calls > 1):
            return every_chunk(row_widths(calls))
        return attention_flops(cfg, attention_pairs_executed(
            s_live, row_widths(calls), q_chunk, row_group=row_group, micro_batches=calls, reach=s_reach, key_block=key_block,
            row_class=None if student_packed is not None else getattr(batch, "length_class", None)))

    exec_attn = student_attn(mini_batches * micro_batches)
    # the skipping kernel's own backward pass: one score product again, then four (3.5 forwards);
    # the unskipped chunk's rematerialised forward and its backward (4)
    # (under a rematerialised layer every kernel's forward runs once more in the backward pass)
    attn_grad = (FUSED_GRAD_FORWARDS if fused_block else 4.0 if s_live is None else 3.5) + float(remat)
    exec_head = head_flops(cfg, head_rows_executed(batch.pol_valid, logprob_chunk, micro_batches=micro_batches,
                                                   row_shards=row_shards,
                                                   row_class=getattr(batch, "length_class", None)))
    # a rematerialised piece runs its forward again in the backward pass; attention and log-prob
    # chunks are always checkpointed (models.attention, rl.logprobs), the layer only with remat
    grad_exec = (4.0 if remat else 3.0) * trunk * slots + attn_grad * exec_attn + 4.0 * exec_head
    parts = {"student": (3.0 * need_fwd * updates, grad_exec * updates)}
    if extra_forwards or ref_forward:
        k = extra_forwards + int(ref_forward)
        score_head = head_flops(cfg, head_rows_executed(batch.pol_valid, score_chunk, micro_batches=micro_batches,
                                                        row_shards=row_shards,
                                                        row_class=getattr(batch, "length_class", None)))
        fwd_attn = extra_forwards * student_attn(micro_batches) + int(ref_forward) * student_attn(teacher_micro_batches)
        fwd_slots = extra_forwards * slots + int(ref_forward) * float(row_widths(teacher_micro_batches).sum())
        parts["student_forward"] = (need_fwd * k, trunk * fwd_slots + score_head * k + fwd_attn)
    views = getattr(batch, "views", None)
    if views is not None:
        packed = getattr(views, "packed", None)
        lay = views.layout if packed is None else packed.layout
        seg = np.asarray(lay.segment_ids)
        used = distinct_slots_used(np.asarray(views.pred))
        distinct = teacher_distinct_rows if teacher_distinct_rows is not None else float(used.sum())
        tcfg = teacher_cfg or cfg
        reach = key_reach(lay)  # what each token reads: the necessary pairs and the key blocks that run
        need = forward_flops(tcfg, float((seg >= 0).sum()), reach_pairs(reach, seg), distinct)
        t_grouped = (groups is not None and groups.view_widths is not None and teacher_micro_batches > 1
                     and groups.micro_batches == teacher_micro_batches)
        vw = _row_widths(views.tokens, getattr(views, "classes", None), getattr(views, "row_class", None), packed,
                         groups.view_widths if t_grouped else None, groups)
        vlive = reads_any(lay)
        tgroup = row_group if packed is None or teacher_micro_batches == 1 else 0
        tpairs = attention_pairs_executed(
            vlive, vw, q_chunk, row_group=tgroup,
            row_class=None if packed is not None else getattr(views, "row_class", None),
            micro_batches=1 if packed is not None else teacher_micro_batches,
            reach=reach, key_block=key_block) if not fused_block else fused_pairs(reach, fused_block)
        executed = forward_flops(tcfg, float(vw.sum()), tpairs,
                                 head_rows_executed(used, score_chunk, micro_batches=teacher_micro_batches,
                                                    row_shards=row_shards, row_class=getattr(views, "row_class", None)))
        parts["teacher"] = (need, executed)
    if critic:
        need_trunk = forward_flops(cfg, tokens, pairs, 0.0)
        exec_trunk = trunk * slots + student_attn(micro_batches)  # V_old, micro-batched like the update
        grad_trunk = (4.0 if remat else 3.0) * trunk * slots + attn_grad * exec_attn
        parts["critic"] = (need_trunk * (1 + 3 * updates), exec_trunk + grad_trunk * updates)
    if prm:
        parts["prm"] = (forward_flops(cfg, tokens, pairs, 0.0),
                        trunk * float(row_widths(teacher_micro_batches).sum()) + student_attn(teacher_micro_batches))
    probes = (getattr(batch, "aux_rows", None) or {}).get("retrospective")
    if probes is not None:  # the retrospective teacher's probe rows (methods.orchard), 2 head columns per state
        lay, tcfg = probes.layout, teacher_cfg or cfg
        seg = np.asarray(lay.segment_ids)
        states = float(np.asarray(probes.exists).sum())
        width = int(seg.shape[1])
        parts["retrospective"] = (
            forward_flops(tcfg, float((seg >= 0).sum()), layout_pairs(seg, lay.ctx1_segment, lay.ctx1_end,
                                                                      lay.ctx2_segment, lay.ctx2_end), 0.0)
            + 4.0 * tcfg.hidden_size * states,
            forward_flops(tcfg, float(seg.size), fused_pairs(key_reach(lay), fused_block) if fused_block else
                          attention_pairs_executed(
                              reads_any(lay), np.full(seg.shape[0], width), q_chunk, row_group=row_group,
                              micro_batches=teacher_micro_batches,
                              reach=key_reach(lay) if row_group > 0 and key_block else None, key_block=key_block),
                          0.0)
            + 4.0 * tcfg.hidden_size * probes.exists.size)
    return UpdateFlops(parts)


def rollout_flops(cfg: Qwen3Config, lengths, decoded: float) -> float:
    """Necessary FLOPs of producing trajectories of `lengths` tokens (prompt, observations and
    decoded tokens each through the trunk once, causal attention over each trajectory) with the
    head at the `decoded` tokens. A group's shared prompt is counted once per trajectory."""
    lengths = [int(n) for n in lengths]
    return forward_flops(cfg, float(sum(lengths)), sum(causal_pairs(n) for n in lengths), decoded)
