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
    mask_fn: Callable[[object, jax.Array, int], jax.Array],
    *,
    q_chunk: int = 512,
    causal_bound: bool = False,
) -> jax.Array:
    """Grouped-query attention, chunked over queries.

    q [B, T, Hq, Dh]; k, v [B, S, Hkv, Dh]; q_meta: a pytree of [B, T] arrays describing the
    queries; mask_fn(q_meta_chunk, q_index [C], num_keys) -> [B, C, num_keys] bool over the first
    num_keys keys. Returns [B, T, Hq, Dh] in q's dtype. Scores and softmax are float32.

    causal_bound: the query at index i reads no key beyond i (true of every packed layout, whose
    context segments precede the reader). Chunks are then grouped, and a group scores only the
    keys up to its own end. Otherwise every chunk scores all S keys. Either way chunks run in a
    rematerialised `lax.scan`, so one [B, H, q_chunk, keys] score block is alive at a time.
    """
    b, t, hq, dh = q.shape
    s_len, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = dh**-0.5
    # heads first, once per call: [B, Hkv, G, T, Dh] queries, [B, Hkv, S, Dh] keys and values
    qg = q.reshape(b, t, hkv, g, dh).transpose(0, 2, 3, 1, 4)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def back(out):  # [B, Hkv, G, T', Dh] -> [B, T, Hq, Dh]
        return out.transpose(0, 3, 1, 2, 4)[:, :t].reshape(b, t, hq, dh)

    if t <= q_chunk:
        mask = mask_fn(q_meta, jnp.arange(t, dtype=jnp.int32), s_len)
        return back(_attend_chunk(qg, k, v, mask, scale))

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
                                     k[:, :, :hi], v[:, :, :hi], lambda meta, idx, m=hi: mask_fn(meta, idx, m),
                                     first * q_chunk, q_chunk, scale))
            first = last
        return back(jnp.concatenate(outs, axis=3))

    return back(_scan_chunks(qg, q_meta, k, v, lambda meta, idx: mask_fn(meta, idx, s_len), 0, q_chunk, scale))


CHUNK_GROUPS = 4  # turnsight_jax.flops counts the pairs this grouping scores


def _scan_chunks(qg, q_meta, k, v, mask_fn, start: int, q_chunk: int, scale: float):
    """Queries qg [B, Hkv, G, n*C, Dh] in chunks of C, each against all of k, v [B, Hkv, S, Dh],
    inside a rematerialised lax.scan (one chunk's scores alive at a time, forward and backward);
    q_meta leaves are [B, n*C]."""
    total = qg.shape[3]
    n = total // q_chunk
    if n == 1:
        return _attend_chunk(qg, k, v, mask_fn(q_meta, start + jnp.arange(q_chunk, dtype=jnp.int32)), scale)

    def to_chunks(a, axis):  # [.., n*C, ..] on `axis` -> [n, .., C, ..]
        a = a.reshape(*a.shape[:axis], n, q_chunk, *a.shape[axis + 1:])
        return jnp.moveaxis(a, axis, 0)

    starts = start + jnp.arange(n, dtype=jnp.int32) * q_chunk

    @jax.checkpoint
    def body(_, xs):
        qc, meta_c, st = xs
        return None, _attend_chunk(qc, k, v, mask_fn(meta_c, st + jnp.arange(q_chunk, dtype=jnp.int32)), scale)

    _, out = jax.lax.scan(body, None, (to_chunks(qg, 3), jax.tree.map(lambda a: to_chunks(a, 1), q_meta), starts))
    return jnp.moveaxis(out, 0, 3).reshape(*qg.shape)


def layout_attention(q, k, v, layout: Layout, *, q_chunk: int = 512) -> jax.Array:
    """Attention of a (packed) sequence with itself, per `layout`. Shapes as chunked_attention."""
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
        q, k, v, q_meta, lambda meta, idx, n: packed_mask(meta, kv_segment[:, :n], idx), q_chunk=q_chunk,
        causal_bound=True,
    )


def cache_attention(q, k_cache, v_cache, slots: jax.Array, *, q_chunk: int = 512, from_empty: bool = False
                    ) -> jax.Array:
    """Attention of new queries against a KV cache that already holds their own keys.

    q [B, N, Hq, Dh]; k_cache, v_cache [B, S, Hkv, Dh]; slots [B, N] int32 (cache slot of each
    query; slot -1 marks a padding query). A query reads every slot j <= its own slot.
    from_empty: the queries were appended to an empty cache (a prefill), so query i sits in slot i
    and reads no key beyond i: chunk groups score only the keys up to their own end
    (`chunked_attention`'s causal_bound), 3/8 less score work than every chunk over all keys.
    """

    def mask_fn(q_slots, _, n):
        j = jnp.arange(n, dtype=jnp.int32)[None, None, :]
        return (j <= q_slots[..., None]) & (q_slots[..., None] >= 0)

    return chunked_attention(q, k_cache, v_cache, slots, mask_fn, q_chunk=q_chunk, causal_bound=from_empty)
