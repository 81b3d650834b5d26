"""Memory-bounded attention over plain, padded and packed sequences.

One kernel serves three callers:

* plain causal batches with right padding (the student forward);
* packed hindsight sequences (docs/spec.md §4.2): each token carries a segment id and up to two
  "context" pairs (segment, end) naming earlier segments it may also read — a block token
  reads the original trajectory (segment 0) up to where its turn begins, and a depth branch
  reads the shared trunk of its block up to where its depth ends;
* decoding against a KV cache, where each query sits at a cache slot and reads every slot
  at or before it.

Queries are processed in chunks of `q_chunk` inside a `lax.scan` whose body is
rematerialised, so neither the forward nor the backward pass ever holds a [T, T] score or
mask array: the peak is [B, heads, q_chunk, S] for one chunk.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

PAD_SEGMENT = -1  # a padding token: never read, its own output is zero
NO_SEGMENT = -2  # an unused context slot
_MASKED = -1e30  # finite, so a row with no readable key stays NaN-free


@struct.dataclass
class Layout:
    """Per-token structure of a batch of (possibly packed) sequences, all [B, T] int32.

    positions: rotary position of each token.
    segment_ids: segment of each token; a token reads earlier tokens of its own segment.
      PAD_SEGMENT marks padding.
    ctx{1,2}_segment / ctx{1,2}_end: a token also reads tokens j of segment ctx_segment with
      packed index j < ctx_end (NO_SEGMENT when unused).
    """

    positions: jax.Array
    segment_ids: jax.Array
    ctx1_segment: jax.Array
    ctx1_end: jax.Array
    ctx2_segment: jax.Array
    ctx2_end: jax.Array

    @classmethod
    def causal(cls, valid_mask: jax.Array) -> "Layout":
        """Plain causal layout for right-padded rows; `valid_mask` [B, T] bool."""
        valid_mask = jnp.asarray(valid_mask, bool)
        b, t = valid_mask.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        seg = jnp.where(valid_mask, 0, PAD_SEGMENT).astype(jnp.int32)
        none = jnp.full((b, t), NO_SEGMENT, jnp.int32)
        zero = jnp.zeros((b, t), jnp.int32)
        return cls(positions, seg, none, zero, none, zero)

    @classmethod
    def full(cls, batch: int, length: int) -> "Layout":
        return cls.causal(jnp.ones((batch, length), bool))


def packed_mask(q: Layout, kv_segment: jax.Array, q_index: jax.Array, k_index: jax.Array | None = None
                ) -> jax.Array:
    """Which keys each query may read, for a chunk of queries.

    q: Layout fields sliced to the chunk, each [B, C]; kv_segment [B, S] (the keys considered);
    q_index [C] (packed index of each query); k_index [S] (packed index of each key; default
    0 .. S-1). Returns [B, C, S] bool.
    """
    s = kv_segment.shape[1]
    j = (jnp.arange(s, dtype=jnp.int32) if k_index is None else k_index)[None, None, :]
    kv_seg = kv_segment[:, None, :]
    own = (kv_seg == q.segment_ids[..., None]) & (j <= q_index[None, :, None])
    ctx1 = (kv_seg == q.ctx1_segment[..., None]) & (j < q.ctx1_end[..., None])
    ctx2 = (kv_seg == q.ctx2_segment[..., None]) & (j < q.ctx2_end[..., None])
    return (kv_seg >= 0) & (own | ctx1 | ctx2)


def _attend_chunk(q, k, v, mask, scale):
    """q [B, Hkv, G, C, Dh], k/v [B, Hkv, S, Dh], mask [B, C, S] -> (out [B, Hkv, G, C, Dh],
    lse [B, Hkv, G, C] float32: each query's log-sum-exp of its scaled scores, which the backward
    pass (`_grad_chunk`) turns the recomputed scores into probabilities with; a caller that does
    not read it leaves it to the compiler to drop).

    Heads lead every operand, so both products are plain batched matmuls (no per-chunk
    transposes), and the softmax is normalised after the value product: the division runs over
    [.., C, Dh] instead of [.., C, S] scores (on CPU about 25% less attention time at the
    default's shapes; the same values to float rounding)."""
    scores = jnp.einsum("bkgcd,bksd->bkgcs", q, k, preferred_element_type=jnp.float32) * scale
    m = mask[:, None, None, :, :]
    scores = jnp.where(m, scores, _MASKED)
    top = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))  # softmax is shift-invariant
    e = jnp.exp(scores - top)
    out = jnp.einsum("bkgcs,bksd->bkgcd", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
    # A query with nothing to read (padding) gets exactly zero output rather than an average.
    live = jnp.any(m, axis=-1, keepdims=True)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return (out * (live / total)).astype(q.dtype), (top + jnp.log(total))[..., 0]


def _grad_chunk(q, k, v, mask, scale, out, lse, dout):
    """The backward pass of `_attend_chunk` from its saved log-sum-exp (flash attention's): the
    probabilities from one recomputed score product, then the four gradient products; masked
    pairs (and so every pair of a query that reads nothing) get probability 0. Shapes as
    `_attend_chunk`, dout like out. Returns (dq [B, Hkv, G, C, Dh] float32, dk, dv
    [B, Hkv, S, Dh] float32)."""
    scores = jnp.einsum("bkgcd,bksd->bkgcs", q, k, preferred_element_type=jnp.float32) * scale
    p = jnp.where(mask[:, None, None, :, :], jnp.exp(scores - lse[..., None]), 0.0)
    dv = jnp.einsum("bkgcs,bkgcd->bksd", p.astype(v.dtype), dout, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkgcd,bksd->bkgcs", dout, v, preferred_element_type=jnp.float32)
    # d softmax: p * (dp - Σ_s p·dp), and Σ_s p·dp = Σ_d dout·out (out = p @ v)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    ds = (p * (dp - delta) * scale).astype(q.dtype)
    dq = jnp.einsum("bkgcs,bksd->bkgcd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgcs,bkgcd->bksd", ds, q, preferred_element_type=jnp.float32)
    return dq, dk, dv


def chunked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_meta,
    mask_fn: Callable[[object, jax.Array, jax.Array, object], jax.Array],
    *,
    q_chunk: int = 512,
    causal_bound: bool = False,
    kv_meta=None,
    live_fn: Callable[[object], jax.Array] | None = None,
    row_group: int = 0,
    key_block: int = 0,
) -> jax.Array:
    """Grouped-query attention, chunked over queries.

    q [B, T, Hq, Dh]; k, v [B, S, Hkv, Dh]; q_meta: a pytree of [B, T] arrays describing the
    queries; kv_meta: a pytree of [B, S] arrays describing the keys (or None);
    mask_fn(q_meta_chunk, q_index [C], k_index [K], kv_meta_keys) -> [B, C, K] bool: which of the
    keys at indices k_index (kv_meta_keys: kv_meta's [B, K] at those keys) each query reads.
    Returns [B, T, Hq, Dh] in q's dtype. Scores and softmax are float32.

    causal_bound: the query at index i reads no key beyond i (true of every packed layout, whose
    context segments precede the reader). Chunks are then grouped, and a group scores only the
    keys up to its own end. Otherwise every chunk scores all S keys. Either way chunks run in a
    rematerialised `lax.scan`, so one [B, H, q_chunk, keys] score block is alive at a time.

    live_fn, row_group: skip the padding. live_fn(q_meta_chunk) -> [B', C] bool marks the queries
    that read at least one key (a query outside it must read none: its output is zero either way).
    With row_group = r > 0 the rows run in groups of gcd(B, r) consecutive rows and a (group,
    chunk) whose queries are all dead is skipped (`lax.cond`), so a row shorter than the batch's
    width pays only for the chunks it reaches: rows padded to a floor that only grows, or a
    batch's short rows beside its long ones, cost what their own length needs, at chunk
    granularity. The values and gradients are those of the unskipped kernel to float rounding; the
    backward pass is the kernel's own (`_skipping_attention`) and skips the same cells. The groups
    run one after another (a `lax.scan` over the row axis): meant for unsharded rows (one device,
    CPU); rows sharded over devices would be gathered.

    key_block: with row groups, a live chunk scores its keys `key_block` at a time (flash
    attention's online softmax) and visits only the blocks one of its group's queries reads (one
    mask over the chunk's keys orders them first; a loop of as many steps runs them), forward and
    backward: a packed row's late queries then pay for their own item's keys, not for every
    earlier item's, and a chunk of a long row for the keys up to its own end rather than its
    chunk group's bound. 0: one score block per chunk over all the keys of its group.
    """
    b, t, hq, dh = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    # heads first, once per call: [B, Hkv, G, T, Dh] queries, [B, Hkv, S, Dh] keys and values
    qg = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 3, 1, 4)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    r = math.gcd(b, row_group) if row_group > 0 and live_fn is not None else 0
    if r:
        out = _skipping_attention(mask_fn, q_chunk, causal_bound, dh**-0.5, live_fn, r, key_block)(
            qg, k, v, q_meta, kv_meta)
    else:  # differentiated through its rematerialised chunk scan
        out = _attend_rows(qg, k, v, q_meta, kv_meta, mask_fn, q_chunk, causal_bound, dh**-0.5, None)[0]
    return out.transpose(0, 3, 1, 2, 4)[:, :t].reshape(b, t, hq, dh)  # from [B, Hkv, G, T', Dh]


def _skipping_attention(mask_fn, q_chunk: int, causal_bound: bool, scale: float, live_fn, r: int, key_block: int):
    """chunked_attention with row groups of r on heads-first operands, (qg [B, Hkv, G, T, Dh],
    k, v [B, Hkv, S, Dh], q_meta, kv_meta) -> [B, Hkv, G, T', Dh], with a backward pass of its
    own that skips the same (row group, chunk) cells as the forward.

    Differentiating the row scan itself cost about what the skipped chunks saved (its stacked
    residuals; measured). Here the forward keeps each query's log-sum-exp and the backward, a scan
    over the same row groups, recomputes one score product per live chunk (`_grad_chunk`, flash
    attention's backward) where differentiating the rematerialised chunk recomputed the whole
    forward of the chunk first. With key_block > 0 both passes visit only the key blocks a chunk
    reads (`_attend_blocks`, `_grad_blocks`). Gradients equal the unskipped kernel's to float
    rounding."""

    def grouped(fn, *arrays):  # fn over groups of r rows, one group after another
        b = arrays[0].shape[0]
        rows = jax.tree.map(lambda a: a.reshape(b // r, r, *a.shape[1:]), arrays)
        _, out = jax.lax.scan(lambda _, xs: (None, fn(*xs)), None, rows)
        return jax.tree.map(lambda o: o.reshape(b, *o.shape[2:]), out)

    def forward(qg, k, v, q_meta, kv_meta):
        return grouped(lambda *a: _attend_rows(*a, mask_fn, q_chunk, causal_bound, scale, live_fn, key_block),
                       qg, k, v, q_meta, kv_meta)

    @jax.custom_vjp
    def attend(qg, k, v, q_meta, kv_meta):
        return forward(qg, k, v, q_meta, kv_meta)[0]

    def attend_fwd(qg, k, v, q_meta, kv_meta):
        out, lse = forward(qg, k, v, q_meta, kv_meta)
        return out, (qg, k, v, q_meta, kv_meta, out, lse)

    def attend_bwd(res, dout):
        qg, k, v, q_meta, kv_meta, out, lse = res
        dq, dk, dv = grouped(lambda *a: _grad_rows(*a, mask_fn, q_chunk, causal_bound, scale, live_fn, key_block),
                             qg, k, v, q_meta, kv_meta, out, lse, dout)
        return (dq[:, :, :, :qg.shape[3]].astype(qg.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
                _no_cotangent(q_meta), _no_cotangent(kv_meta))

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def _no_cotangent(meta):
    """Zero cotangents for the mask's inputs (integer arrays: float0)."""
    def zero(a):
        if jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.zeros_like(a)
        return np.zeros(a.shape, jax.dtypes.float0)
    return jax.tree.map(zero, meta)


CHUNK_GROUPS = 4


def chunk_plan(t: int, s_len: int, q_chunk: int, causal_bound: bool):
    """How `t` queries against `s_len` keys run (and what turnsight_jax.flops counts): (chunk size
    C, number of chunks n, [(first chunk, last chunk, keys)]):
    one chunk of all t queries when t <= q_chunk; with causal_bound the chunks in at most
    `CHUNK_GROUPS` groups, each scoring only the keys up to its own end (static key bounds need
    static shapes; few groups keep the compiled program small; the saving over full-key chunks is
    (G - 1) / (2G) of the attention work); else every chunk against all s_len keys."""
    if t <= q_chunk:
        return t, 1, [(0, 1, s_len)]
    n = -(-t // q_chunk)
    if not causal_bound:
        return q_chunk, n, [(0, n, s_len)]
    groups = min(n, CHUNK_GROUPS)
    bounds = [round(n * (g + 1) / groups) for g in range(groups)]
    return q_chunk, n, [(first, last, min(last * q_chunk, s_len)) for first, last in zip([0] + bounds[:-1], bounds)]


def _pad_queries(pad: int, q_meta, qg):
    """Queries padded to whole chunks: qg [B, Hkv, G, T, Dh] on its query axis with zeros, q_meta's
    [B, T] leaves with PAD_SEGMENT (the mask functions' inputs: padded queries read nothing).
    Returns (q_meta, qg)."""
    if not pad:
        return q_meta, qg
    return (jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, pad)), constant_values=PAD_SEGMENT), q_meta),
            jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0))))


def _attend_rows(qg, k, v, q_meta, kv_meta, mask_fn, q_chunk: int, causal_bound: bool, scale: float, live_fn,
                 key_block: int = 0):
    """The forward pass on heads-first operands: qg [B, Hkv, G, T, Dh], k, v [B, Hkv, S, Dh] ->
    (out [B, Hkv, G, T', Dh], lse [B, Hkv, G, T'] float32), T' >= T: the queries padded to whole
    chunks."""
    size, n, plan = chunk_plan(qg.shape[3], k.shape[2], q_chunk, causal_bound)
    q_meta, qg = _pad_queries(n * size - qg.shape[3], q_meta, qg)
    outs = []
    for first, last, hi in plan:
        sub = lambda a, f=first, l=last: a[:, f * size:l * size]
        outs.append(_scan_chunks(qg[:, :, :, first * size:last * size], jax.tree.map(sub, q_meta), k[:, :, :hi],
                                 v[:, :, :hi], _first_keys(kv_meta, hi), mask_fn, first * size, size, scale,
                                 live_fn, key_block))
    if len(outs) == 1:
        return outs[0]
    return tuple(jnp.concatenate(parts, axis=3) for parts in zip(*outs))


def _grad_rows(qg, k, v, q_meta, kv_meta, out, lse, dout, mask_fn, q_chunk: int, causal_bound: bool, scale: float,
               live_fn, key_block: int = 0):
    """The backward pass of `_attend_rows` (out, lse its outputs, dout [B, Hkv, G, T', Dh] the
    cotangent of out) -> (dq [B, Hkv, G, T', Dh], dk, dv [B, Hkv, S, Dh]), float32. The chunks
    as the forward ran them: each group's keys up to its own bound, one chunk at a time in a
    lax.scan that sums the key and value gradients in its carry."""
    s_len = k.shape[2]
    size, n, plan = chunk_plan(qg.shape[3], s_len, q_chunk, causal_bound)
    q_meta, qg = _pad_queries(n * size - qg.shape[3], q_meta, qg)
    dqs, dk, dv = [], 0.0, 0.0
    for first, last, hi in plan:
        sub = lambda a, f=first, l=last: a[:, :, :, f * size:l * size]
        meta = jax.tree.map(lambda a, f=first, l=last: a[:, f * size:l * size], q_meta)
        dq_g, dk_g, dv_g = _scan_grad_chunks(sub(qg), meta, k[:, :, :hi], v[:, :, :hi], _first_keys(kv_meta, hi),
                                             sub(out), sub(lse), sub(dout), mask_fn, first * size, size, scale,
                                             live_fn, key_block)
        widen = ((0, 0), (0, 0), (0, s_len - hi), (0, 0))
        dqs.append(dq_g)
        dk, dv = dk + jnp.pad(dk_g, widen), dv + jnp.pad(dv_g, widen)
    return jnp.concatenate(dqs, axis=3) if len(dqs) > 1 else dqs[0], dk, dv


def _live(live_fn, meta_c):
    return None if live_fn is None else jnp.any(live_fn(meta_c))


def _first_keys(kv_meta, n: int):
    """kv_meta's [B, S] leaves at the first n keys."""
    return jax.tree.map(lambda a: a[:, :n], kv_meta)


def _key_blocks(k, v, block: int):
    """Keys and values [B, Hkv, S, Dh] in blocks of `block` keys, the last padded with zero keys:
    [n, B, Hkv, block, Dh] each."""
    n = -(-k.shape[2] // block)
    widen = ((0, 0), (0, 0), (0, n * block - k.shape[2]), (0, 0))
    return tuple(_to_chunks(jnp.pad(a, widen), 2, n) for a in (k, v))


def _live_blocks(mask_fn, meta_c, q_index, kv_meta, keys: int, block: int):
    """The blocks of `block` keys a chunk's queries read: (mask [B, C, n, block] bool, order [n]
    int32 with the read blocks first, their count). One mask over all the keys, built at once
    (no score product), so the loops that follow visit only the blocks that are read."""
    n = -(-keys // block)
    pad = n * block - keys
    k_index = jnp.arange(n * block, dtype=jnp.int32)
    meta = jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, pad)), constant_values=PAD_SEGMENT), kv_meta)
    mask = mask_fn(meta_c, q_index, k_index, meta) & (k_index < keys)[None, None, :]
    mask = mask.reshape(*mask.shape[:2], n, block)
    read = jnp.any(mask, axis=(0, 1, 3))
    return mask, jnp.argsort(~read, stable=True).astype(jnp.int32), jnp.sum(read, dtype=jnp.int32)


def _attend_blocks(qc, k, v, meta_c, kv_meta, mask_fn, q_index, block: int, scale: float):
    """`_attend_chunk` over the keys `block` at a time (the online softmax), visiting only the
    blocks some query of the chunk reads (a loop of as many steps as there are) -> (out, lse). A
    query that reads nothing gets out 0, lse _MASKED."""
    kb, vb = _key_blocks(k, v, block)
    mask, order, count = _live_blocks(mask_fn, meta_c, q_index, kv_meta, k.shape[2], block)
    shape = qc.shape[:-1]  # [B, Hkv, G, C]

    def step(i, carry):
        m, total, acc, seen = carry
        j = order[i]
        mj = mask[:, :, j]
        scores = jnp.einsum("bkgcd,bksd->bkgcs", qc, kb[j], preferred_element_type=jnp.float32) * scale
        scores = jnp.where(mj[:, None, None, :, :], scores, _MASKED)
        top = jnp.maximum(m, jnp.max(scores, axis=-1))
        fade = jnp.exp(m - top)  # the earlier blocks' sums, rescaled to the new maximum
        e = jnp.exp(scores - top[..., None])
        acc = acc * fade[..., None] + jnp.einsum("bkgcs,bksd->bkgcd", e.astype(vb.dtype), vb[j],
                                                 preferred_element_type=jnp.float32)
        return top, total * fade + jnp.sum(e, axis=-1), acc, seen | jnp.any(mj, axis=-1)[:, None, None, :]

    init = (jnp.full(shape, _MASKED, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(qc.shape, jnp.float32), jnp.zeros((shape[0], 1, 1, shape[3]), bool))
    m, total, acc, seen = jax.lax.fori_loop(0, count, step, init)
    safe = jnp.where(seen, total, 1.0)
    out = jnp.where(seen[..., None], acc / safe[..., None], 0.0)
    return out.astype(qc.dtype), jnp.where(seen, m + jnp.log(safe), _MASKED)


def _grad_blocks(qc, k, v, meta_c, kv_meta, mask_fn, q_index, block: int, scale: float, out, lse, dout):
    """The backward pass of `_attend_blocks`: `_grad_chunk` on each block a query reads, the
    others never visited -> (dq like qc, dk, dv [B, Hkv, S, Dh]) float32."""
    keys = k.shape[2]
    kb, vb = _key_blocks(k, v, block)
    mask, order, count = _live_blocks(mask_fn, meta_c, q_index, kv_meta, keys, block)

    def step(i, carry):
        dq, dk, dv = carry
        j = order[i]
        dq_b, dk_b, dv_b = _grad_chunk(qc, kb[j], vb[j], mask[:, :, j], scale, out, lse, dout)
        return dq + dq_b, dk.at[j].set(dk_b), dv.at[j].set(dv_b)  # each block visited once

    zero_kv = jnp.zeros(kb.shape, jnp.float32)
    dq, dk, dv = jax.lax.fori_loop(0, count, step, (jnp.zeros(qc.shape, jnp.float32), zero_kv, zero_kv))
    return dq, _from_chunks(dk, 2)[:, :, :keys], _from_chunks(dv, 2)[:, :, :keys]


def _chunk(qc, k, v, meta_c, kv_meta, mask_fn, start, size: int, scale: float, live_fn, key_block: int = 0):
    """One chunk of `size` queries from index `start` against the keys k, v [B, Hkv, K, Dh] (the
    first K; kv_meta at them) -> (out, lse); with live_fn, zeros (and lse _MASKED) without
    computing when none of its queries is live; with key_block (and more keys than one block),
    the keys a block at a time (`_attend_blocks`)."""
    keys = k.shape[2]

    def run(qc, meta_c, start):
        q_index = start + jnp.arange(size, dtype=jnp.int32)
        if key_block and keys > key_block:
            return _attend_blocks(qc, k, v, meta_c, kv_meta, mask_fn, q_index, key_block, scale)
        return _attend_chunk(qc, k, v, mask_fn(meta_c, q_index, jnp.arange(keys, dtype=jnp.int32), kv_meta), scale)

    live = _live(live_fn, meta_c)
    if live is None:
        return run(qc, meta_c, start)
    return jax.lax.cond(live, run, lambda qc, *_: (jnp.zeros_like(qc), jnp.full(qc.shape[:-1], _MASKED, jnp.float32)),
                        qc, meta_c, start)


def _scan_chunks(qg, q_meta, k, v, kv_meta, mask_fn, start: int, q_chunk: int, scale: float, live_fn,
                 key_block: int = 0):
    """Queries qg [B, Hkv, G, n*C, Dh] in chunks of C, each against k, v [B, Hkv, K, Dh] (kv_meta
    [B, K] at those keys), inside a lax.scan (one chunk's scores alive at a time) -> (out, lse);
    q_meta leaves are [B, n*C]."""
    n = qg.shape[3] // q_chunk
    if n == 1:
        return _chunk(qg, k, v, q_meta, kv_meta, mask_fn, start, q_chunk, scale, live_fn, key_block)

    starts = start + jnp.arange(n, dtype=jnp.int32) * q_chunk

    @jax.checkpoint  # under autodiff (row_group 0) the backward pass recomputes one chunk at a time
    def body(_, xs):
        qc, meta_c, st = xs
        return None, _chunk(qc, k, v, meta_c, kv_meta, mask_fn, st, q_chunk, scale, live_fn, key_block)

    _, (out, lse) = jax.lax.scan(body, None, (_to_chunks(qg, 3, n), jax.tree.map(lambda a: _to_chunks(a, 1, n), q_meta),
                                              starts))
    return _from_chunks(out, 3), _from_chunks(lse, 3)


def _scan_grad_chunks(qg, q_meta, k, v, kv_meta, out, lse, dout, mask_fn, start: int, q_chunk: int, scale: float,
                      live_fn, key_block: int = 0):
    """The backward pass of `_scan_chunks` -> (dq like qg, dk, dv [B, Hkv, K, Dh]) float32;
    a chunk with no live query adds nothing and its dq is 0."""
    n = qg.shape[3] // q_chunk
    keys = k.shape[2]
    starts = start + jnp.arange(n, dtype=jnp.int32) * q_chunk
    zero_kv = jnp.zeros(k.shape, jnp.float32)

    def grads(qc, meta_c, st, oc, lc, dc):
        q_index = st + jnp.arange(q_chunk, dtype=jnp.int32)
        if key_block and keys > key_block:
            return _grad_blocks(qc, k, v, meta_c, kv_meta, mask_fn, q_index, key_block, scale, oc, lc, dc)
        mask = mask_fn(meta_c, q_index, jnp.arange(keys, dtype=jnp.int32), kv_meta)
        return _grad_chunk(qc, k, v, mask, scale, oc, lc, dc)

    def body(carry, xs):
        live = _live(live_fn, xs[1])
        if live is None:
            dq, dk, dv = grads(*xs)
        else:
            dq, dk, dv = jax.lax.cond(live, grads, lambda qc, *_: (jnp.zeros(qc.shape, jnp.float32), zero_kv, zero_kv),
                                      *xs)
        return (carry[0] + dk, carry[1] + dv), dq

    xs = (_to_chunks(qg, 3, n), jax.tree.map(lambda a: _to_chunks(a, 1, n), q_meta), starts,
          _to_chunks(out, 3, n), _to_chunks(lse, 3, n), _to_chunks(dout, 3, n))
    if n == 1:
        (dk, dv), dq = body((zero_kv, zero_kv), jax.tree.map(lambda a: a[0], xs))
        return dq, dk, dv
    (dk, dv), dq = jax.lax.scan(body, (zero_kv, zero_kv), xs)
    return _from_chunks(dq, 3), dk, dv


def _to_chunks(a, axis: int, n: int):
    """[.., n*C, ..] on `axis` -> [n, .., C, ..]."""
    a = a.reshape(*a.shape[:axis], n, a.shape[axis] // n, *a.shape[axis + 1:])
    return jnp.moveaxis(a, axis, 0)


def _from_chunks(a, axis: int):
    """The inverse of _to_chunks: [n, .., C, ..] -> [.., n*C, ..] on `axis`."""
    a = jnp.moveaxis(a, 0, axis)
    return a.reshape(*a.shape[:axis], a.shape[axis] * a.shape[axis + 1], *a.shape[axis + 2:])


def layout_attention(q, k, v, layout: Layout, *, q_chunk: int = 512, row_group: int = 0, key_block: int = 0
                     ) -> jax.Array:
    """Attention of a (packed) sequence with itself, per `layout`. Shapes as chunked_attention.
    row_group > 0: chunks of padding skipped per group of rows, and with key_block > 0 the key
    blocks no query of a chunk reads (chunked_attention)."""
    kv_segment = layout.segment_ids
    q_meta = Layout(
        positions=layout.positions,
        segment_ids=layout.segment_ids,
        ctx1_segment=layout.ctx1_segment,
        ctx1_end=layout.ctx1_end,
        ctx2_segment=layout.ctx2_segment,
        ctx2_end=layout.ctx2_end,
    )
    return chunked_attention(
        q, k, v, q_meta, lambda meta, q_index, k_index, kv_seg: packed_mask(meta, kv_seg, q_index, k_index),
        q_chunk=q_chunk, causal_bound=True, kv_meta=kv_segment, live_fn=reads_any, row_group=row_group,
        key_block=key_block,
    )


def reads_any(q: Layout) -> jax.Array:
    """[B, C] bool: the queries that may read a key. packed_mask lets a query read only keys of its
    own or a context segment, all >= 0, so a query whose three segments are negative reads none."""
    return (q.segment_ids >= 0) | (q.ctx1_segment >= 0) | (q.ctx2_segment >= 0)


def cache_attention(q, k_cache, v_cache, slots: jax.Array, *, q_chunk: int = 512, from_empty: bool = False
                    ) -> jax.Array:
    """Attention of new queries against a KV cache that already holds their own keys.

    q [B, N, Hq, Dh]; k_cache, v_cache [B, S, Hkv, Dh]; slots [B, N] int32 (cache slot of each
    query; slot -1 marks a padding query). A query reads every slot j <= its own slot.
    from_empty: the queries were appended to an empty cache (a prefill), so query i sits in slot i
    and reads no key beyond i: chunk groups score only the keys up to their own end
    (`chunked_attention`'s causal_bound), 3/8 less score work than every chunk over all keys.
    """

    def mask_fn(q_slots, _, k_index, __):
        j = k_index[None, None, :]
        return (j <= q_slots[..., None]) & (q_slots[..., None] >= 0)

    return chunked_attention(q, k_cache, v_cache, slots, mask_fn, q_chunk=q_chunk, causal_bound=from_empty)
