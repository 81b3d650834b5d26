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


def packed_mask(q: Layout, kv_segment: jax.Array, q_index: jax.Array) -> jax.Array:
    """Which keys each query may read, for a chunk of queries.

    q: Layout fields sliced to the chunk, each [B, C]; kv_segment [B, S] (the keys considered);
    q_index [C] (packed index of each query). Returns [B, C, S] bool.
    """
    s = kv_segment.shape[1]
    j = jnp.arange(s, dtype=jnp.int32)[None, None, :]
    kv_seg = kv_segment[:, None, :]
    own = (kv_seg == q.segment_ids[..., None]) & (j <= q_index[None, :, None])
    ctx1 = (kv_seg == q.ctx1_segment[..., None]) & (j < q.ctx1_end[..., None])
    ctx2 = (kv_seg == q.ctx2_segment[..., None]) & (j < q.ctx2_end[..., None])
    return (kv_seg >= 0) & (own | ctx1 | ctx2)


def _attend_chunk(q, k, v, mask, scale):
    """q [B, Hkv, G, C, Dh], k/v [B, Hkv, S, Dh], mask [B, C, S] -> [B, Hkv, G, C, Dh].

    Heads lead every operand, so both products are plain batched matmuls (no per-chunk
    transposes), and the softmax is normalised after the value product: the division runs over
    [.., C, Dh] instead of [.., C, S] scores, and its backward pass with it (on CPU about 25% less
    attention time at the default's shapes; the same values to float rounding)."""
    scores = jnp.einsum("bkgcd,bksd->bkgcs", q, k, preferred_element_type=jnp.float32) * scale
    m = mask[:, None, None, :, :]
    scores = jnp.where(m, scores, _MASKED)
    top = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))  # softmax is shift-invariant
    e = jnp.exp(scores - top)
    out = jnp.einsum("bkgcs,bksd->bkgcd", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
    # A query with nothing to read (padding) gets exactly zero output rather than an average.
    live = jnp.any(m, axis=-1, keepdims=True)
    return (out * (live / jnp.sum(e, axis=-1, keepdims=True))).astype(q.dtype)


def chunked_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_meta,
    mask_fn: Callable[[object, jax.Array, int, object], jax.Array],
    *,
    q_chunk: int = 512,
    causal_bound: bool = False,
    kv_meta=None,
    live_fn: Callable[[object], jax.Array] | None = None,
    row_group: int = 0,
) -> jax.Array:
    """Grouped-query attention, chunked over queries.

    q [B, T, Hq, Dh]; k, v [B, S, Hkv, Dh]; q_meta: a pytree of [B, T] arrays describing the
    queries; kv_meta: a pytree of [B, S] arrays describing the keys (or None);
    mask_fn(q_meta_chunk, q_index [C], num_keys, kv_meta) -> [B, C, num_keys] bool over the first
    num_keys keys. Returns [B, T, Hq, Dh] in q's dtype. Scores and softmax are float32.

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
    granularity. The values and gradients are those of the unskipped kernel. The groups run one
    after another (a `lax.scan` over the row axis): meant for unsharded rows (one device, CPU);
    rows sharded over devices would be gathered.
    """
    b, t, hq, dh = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    scale = dh**-0.5
    # heads first, once per call: [B, Hkv, G, T, Dh] queries, [B, Hkv, S, Dh] keys and values
    qg = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 3, 1, 4)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def back(out):  # [B, Hkv, G, T', Dh] -> [B, T, Hq, Dh]
        return out.transpose(0, 3, 1, 2, 4)[:, :t].reshape(b, t, hq, dh)

    r = math.gcd(b, row_group) if row_group > 0 and live_fn is not None else 0
    if not r:
        return back(_attend_rows(qg, k, v, q_meta, kv_meta, mask_fn, q_chunk, causal_bound, scale, None))

    def group(a):  # [B, ...] -> [B / r, r, ...]
        return a.reshape(b // r, r, *a.shape[1:])

    def body(_, xs):  # one group of rows, every chunk skipped that holds no live query
        q_r, k_r, v_r, meta_r, kv_r = xs
        return None, _attend_rows(q_r, k_r, v_r, meta_r, kv_r, mask_fn, q_chunk, causal_bound, scale, live_fn)

    _, out = jax.lax.scan(body, None, jax.tree.map(group, (qg, k, v, q_meta, kv_meta)))
    return back(out.reshape(b, *out.shape[2:]))


CHUNK_GROUPS = 4  # turnsight_jax.flops counts the pairs this grouping scores


def _attend_rows(qg, k, v, q_meta, kv_meta, mask_fn, q_chunk: int, causal_bound: bool, scale: float, live_fn):
    """chunked_attention on heads-first operands: qg [B, Hkv, G, T, Dh], k, v [B, Hkv, S, Dh] ->
    [B, Hkv, G, T', Dh] (T' >= T: the queries padded to whole chunks)."""
    t, s_len = qg.shape[3], k.shape[2]
    if t <= q_chunk:
        return _chunk(qg, k, v, q_meta, kv_meta, mask_fn, 0, t, s_len, scale, live_fn)

    n = -(-t // q_chunk)
    pad = n * q_chunk - t
    if pad:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
        # Padded queries read nothing: give them PAD/NO segments via the mask function's inputs.
        q_meta = jax.tree.map(lambda a: jnp.pad(a, ((0, 0), (0, pad)), constant_values=PAD_SEGMENT), q_meta)

    if causal_bound:
        # Static key bounds need static shapes: chunks are grouped (at most `CHUNK_GROUPS` groups, one
        # chunk per group for short rows), each group scans its chunks over the keys up to the
        # group's end. Few groups keep the compiled program small and at most a few score blocks
        # alive; the saving over full-key chunks is (G - 1) / (2G) of the attention work.
        groups = min(n, CHUNK_GROUPS)
        bounds = [round(n * (g + 1) / groups) for g in range(groups)]
        outs, first = [], 0
        for last in bounds:
            hi = min(last * q_chunk, s_len)
            sub = lambda a, f=first, l=last: a[:, f * q_chunk:l * q_chunk]
            outs.append(_scan_chunks(qg[:, :, :, first * q_chunk:last * q_chunk], jax.tree.map(sub, q_meta),
                                     k[:, :, :hi], v[:, :, :hi], kv_meta, mask_fn, first * q_chunk, q_chunk, hi,
                                     scale, live_fn))
            first = last
        return jnp.concatenate(outs, axis=3)

    return _scan_chunks(qg, q_meta, k, v, kv_meta, mask_fn, 0, q_chunk, s_len, scale, live_fn)


def _chunk(qc, k, v, meta_c, kv_meta, mask_fn, start, size: int, keys: int, scale: float, live_fn):
    """One chunk of `size` queries from index `start` against the first `keys` keys; with live_fn,
    zeros without computing when none of its queries is live."""
    def run(qc, meta_c, start):
        return _attend_chunk(qc, k, v, mask_fn(meta_c, start + jnp.arange(size, dtype=jnp.int32), keys, kv_meta),
                             scale)

    if live_fn is None:
        return run(qc, meta_c, start)
    return jax.lax.cond(jnp.any(live_fn(meta_c)), run, lambda qc, *_: jnp.zeros_like(qc), qc, meta_c, start)


def _scan_chunks(qg, q_meta, k, v, kv_meta, mask_fn, start: int, q_chunk: int, keys: int, scale: float, live_fn):
    """Queries qg [B, Hkv, G, n*C, Dh] in chunks of C, each against k, v [B, Hkv, keys, Dh],
    inside a rematerialised lax.scan (one chunk's scores alive at a time, forward and backward);
    q_meta leaves are [B, n*C]."""
    n = qg.shape[3] // q_chunk
    if n == 1:
        return _chunk(qg, k, v, q_meta, kv_meta, mask_fn, start, q_chunk, keys, scale, live_fn)

    def to_chunks(a, axis):  # [.., n*C, ..] on `axis` -> [n, .., C, ..]
        a = a.reshape(*a.shape[:axis], n, q_chunk, *a.shape[axis + 1:])
        return jnp.moveaxis(a, axis, 0)

    starts = start + jnp.arange(n, dtype=jnp.int32) * q_chunk

    @jax.checkpoint
    def body(_, xs):
        qc, meta_c, st = xs
        return None, _chunk(qc, k, v, meta_c, kv_meta, mask_fn, st, q_chunk, keys, scale, live_fn)

    _, out = jax.lax.scan(body, None, (to_chunks(qg, 3), jax.tree.map(lambda a: to_chunks(a, 1), q_meta), starts))
    return jnp.moveaxis(out, 0, 3).reshape(*qg.shape)


def layout_attention(q, k, v, layout: Layout, *, q_chunk: int = 512, row_group: int = 0) -> jax.Array:
    """Attention of a (packed) sequence with itself, per `layout`. Shapes as chunked_attention.
    row_group > 0: chunks of padding skipped per group of rows (chunked_attention)."""
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
        q, k, v, q_meta, lambda meta, idx, n, kv_seg: packed_mask(meta, kv_seg[:, :n], idx), q_chunk=q_chunk,
        causal_bound=True, kv_meta=kv_segment, live_fn=reads_any, row_group=row_group,
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

    def mask_fn(q_slots, _, n, __):
        j = jnp.arange(n, dtype=jnp.int32)[None, None, :]
        return (j <= q_slots[..., None]) & (q_slots[..., None] >= 0)

    return chunked_attention(q, k_cache, v_cache, slots, mask_fn, q_chunk=q_chunk, causal_bound=from_empty)
