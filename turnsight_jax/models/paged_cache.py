"""A paged KV cache, split into row shards, and the Qwen3 forward pass that reads and writes it.

The pool is [S, L, NB, Hkv, BS, Dh]: S row shards (one per data x fsdp device; 1 on one device),
each with NB blocks of BS slots. A sequence lives in one shard and owns a *block table*: the
ids of its blocks, in order, inside its shard. Slot p of the sequence is slot p % BS of block
table[p // BS]. Block NB - 1 of every shard is the *trash block*: padding tokens and table
entries past a sequence's end point there, so nothing is ever written into another sequence's
block, and the keys read from it are masked by position.

Rows of a call are shard-major: with R rows and S shards, row r belongs to shard r // (R / S).

Decoding (one token per row) reads only each row's live blocks: the host lists them per shard
(`LiveBlocks`: every row's blocks back to back, padded to a bucketed length), attention scores
each listed block against its row's query and normalises per row with segment reductions, so a
step reads sum(row lengths) slots instead of rows x the longest row (`ragged_decode_attention`).
Prefills and observation appends attend over a dense window of the first W blocks per row.
Under a mesh the pool is sharded over its S axis (and KV heads over `tensor`) and the rows over
(data, fsdp), so every block read and write stays on its device (tests/test_rollout_engine.py scans
the compiled program for collectives on the pool).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from turnsight_jax.models.attention import _MASKED, cache_attention
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import rms_norm
from turnsight_jax.models.sharding import BATCH, fit_spec


@struct.dataclass
class PagedKV:
    """Keys and values of every layer: k, v [S, L, NB, Hkv, BS, Dh]. The shard axis leads (vmapping
    the block reads/writes over it needs no transpose of the pool); a block is [Hkv, BS, Dh], so a
    gathered block is already in the (batch, head, slot, dim) order the score matmul wants.

    The arrays hold the raw bits of `dtype` values (uint16 for bfloat16, uint32 for float32):
    XLA's CPU backend has no bf16 gather/scatter and otherwise widens the whole pool to f32 around
    every block read and write (two f32 copies of the pool in the decode's temporaries); integer
    gathers and scatters run on every backend, and the bitcasts of the read windows and written
    tokens are free."""

    k: jax.Array
    v: jax.Array
    dtype: str = struct.field(pytree_node=False)  # the values' dtype name, e.g. "bfloat16"

    @property
    def shards(self) -> int:
        return self.k.shape[0]

    @property
    def blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[4]

    @property
    def trash(self) -> int:
        return self.k.shape[2] - 1

    def nbytes_per_shard(self) -> int:
        return 2 * self.k.nbytes // self.shards


def storage_dtype(dtype) -> jnp.dtype:
    """The unsigned integer type a pool of `dtype` values is stored as (PagedKV)."""
    return {1: jnp.dtype(jnp.uint8), 2: jnp.dtype(jnp.uint16), 4: jnp.dtype(jnp.uint32)}[jnp.dtype(dtype).itemsize]


def pool_shape(cfg: Qwen3Config, shards: int, blocks: int, block_size: int) -> tuple[int, ...]:
    return (shards, cfg.num_layers, blocks, cfg.num_kv_heads, block_size, cfg.head_dim)


def pool_spec(shape, mesh: Mesh | None) -> P:
    """Shards over (data, fsdp), KV heads over tensor (where they divide)."""
    spec = P(BATCH, None, None, "tensor", None, None)
    return spec if mesh is None else fit_spec(spec, shape, mesh)


def bytes_per_token(cfg: Qwen3Config, dtype) -> int:
    """K and V of one token over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def empty_pool(cfg: Qwen3Config, shards: int, blocks: int, block_size: int, dtype, mesh: Mesh | None = None
               ) -> PagedKV:
    """A zero pool, created directly in its sharding (never materialised whole on one device)."""
    shape = pool_shape(cfg, shards, blocks, block_size)

    bits, name = storage_dtype(dtype), jnp.dtype(dtype).name

    def make():
        return PagedKV(jnp.zeros(shape, bits), jnp.zeros(shape, bits), name)

    if mesh is None:
        return jax.jit(make)()
    s = NamedSharding(mesh, pool_spec(shape, mesh))
    return jax.jit(make, out_shardings=PagedKV(s, s, name))()


@struct.dataclass
class LiveBlocks:
    """The blocks a decode step reads, listed per shard: all [S, P] int32 unless noted.

    block: block ids, every row's live blocks back to back in row order (padding: the trash block);
    row: the local row (0 .. R/S - 1) each entry belongs to, ascending (padding: the last row);
    first: the sequence slot of each block's first token (padding: a huge value, so masked);
    row_start [S, R/S]: the entry index of each row's first block (padding rows: P, dropped).
    Built by the engine's host side (`live_blocks`), which lists blocks up to each row's length
    after the whole decode chunk."""

    block: jax.Array
    row: jax.Array
    first: jax.Array
    row_start: jax.Array


_NO_SLOT = 2**30


def live_blocks(tables: list[list[int]], per: int, trash: int, block_size: int, size: int) -> dict[str, np.ndarray]:
    """Host side of `LiveBlocks` for one decode call: tables[r] the live blocks of row r (rows
    shard-major, `per` per shard; padding rows have none); size: the static entries per shard
    (>= every shard's total). Returns numpy arrays keyed like LiveBlocks' fields."""
    shards = len(tables) // per
    block = np.full((shards, size), trash, np.int32)
    row = np.full((shards, size), per - 1, np.int32)
    first = np.full((shards, size), _NO_SLOT, np.int32)
    row_start = np.full((shards, per), size, np.int32)
    for s in range(shards):
        at = 0
        for i in range(per):
            blocks = tables[s * per + i]
            if not blocks:
                continue
            n = len(blocks)
            if at + n > size:
                raise ValueError(f"shard {s} lists over {size} live blocks")
            block[s, at:at + n] = blocks
            row[s, at:at + n] = i
            first[s, at:at + n] = np.arange(n, dtype=np.int32) * block_size
            row_start[s, i] = at
            at += n
        # padding entries belong to the last row (rows stay sorted); their slots are masked
    return {"block": block, "row": row, "first": first, "row_start": row_start}


def ragged_decode_attention(q: jax.Array, k_blocks: jax.Array, v_blocks: jax.Array, row: jax.Array, first: jax.Array,
                            q_slot: jax.Array, k_new: jax.Array | None = None, v_new: jax.Array | None = None
                            ) -> jax.Array:
    """One query per row against that row's listed blocks (one shard).

    q [R, Hq, Dh]; k_blocks, v_blocks [P, Hkv, BS, Dh] (entry p belongs to row[p], its slots are
    first[p] + 0 .. BS - 1); q_slot [R] the query's slot (it reads slots <= q_slot). k_new, v_new
    [R, Hkv, Dh] optional: the query's own key and value, not yet in the blocks (their slot
    q_slot is then read from these, not from the blocks). Scores and the per-row softmax in
    float32 (segment max / sum over the row's entries). Returns [R, Hq, Dh] in q's dtype. Equals
    `cache_attention` over the row's dense window."""
    r, hq, dh = q.shape
    _, hkv, bs, _ = k_blocks.shape
    g = hq // hkv
    scale = dh**-0.5
    qr = q.reshape(r, hkv, g, dh)
    qg = qr[row]  # [P, Hkv, G, Dh]
    # Operand orders chosen for XLA's CPU dot (the block is the matmul's row-major lhs) and a
    # fused multiply-reduce for the tiny per-block (G x BS) x (BS x Dh) products: written as
    # batched matmuls both ran 2-3x slower on CPU.
    scores = jnp.einsum("pksd,pkgd->pksg", k_blocks.astype(q.dtype), qg,
                        preferred_element_type=jnp.float32) * scale  # [P, Hkv, BS, G]
    slots = first[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]  # [P, BS]
    own = k_new is not None
    readable = (slots < q_slot[row][:, None]) if own else (slots <= q_slot[row][:, None])
    scores = jnp.where(readable[:, None, :, None], scores, _MASKED)
    top = jax.ops.segment_max(jnp.max(scores, axis=2), row, r, indices_are_sorted=True)  # [R, Hkv, G]
    if own:
        self_score = jnp.einsum("rkgd,rkd->rkg", qr, k_new.astype(q.dtype), preferred_element_type=jnp.float32) * scale
        top = jnp.maximum(top, self_score)
    e = jnp.exp(scores - top[row][:, :, None, :])
    total = jax.ops.segment_sum(jnp.sum(e, axis=2), row, r, indices_are_sorted=True)
    per_block = jnp.sum(e[..., None] * v_blocks.astype(jnp.float32)[:, :, :, None, :], axis=2)  # [P, Hkv, G, Dh]
    out = jax.ops.segment_sum(per_block, row, r, indices_are_sorted=True)
    if own:
        e_self = jnp.exp(self_score - top)
        total = total + e_self
        out = out + e_self[..., None] * v_new.astype(jnp.float32)[:, :, None, :]
    return (out / total[..., None]).reshape(r, hq, dh).astype(q.dtype)


def paged_extend(model, tokens: jax.Array, num_new: jax.Array, start: jax.Array, tables: jax.Array, kv: PagedKV,
                 *, window_blocks: int = 0, from_empty: bool = False, live: LiveBlocks | None = None
                 ) -> tuple[jax.Array, PagedKV]:
    """Append tokens to paged sequences; return their hidden states (final norm) and the pool.

    model: a Qwen3. tokens [R, N] int32, row r appends its first num_new[r] tokens at slots
    start[r] ... start[r] + num_new[r] - 1; tables [R, MB] int32 block ids (blocks for every slot
    written must already be in the table); rows shard-major over kv.shards (module docstring).
    Attention reads either
    * live (N = 1, decoding): each row's listed blocks only (`ragged_decode_attention`), or
    * window_blocks (static): the first window_blocks * BS slots of each sequence (every row's
      new length must fit), so attention costs O(window) per token whatever the pool size.
    from_empty (static, window path): every start is 0 (a prefill), see `cache_attention`.
    Returns (hidden [R, N, D], kv)."""
    r, n = tokens.shape
    cfg = model.config
    bs, trash, shards = kv.block_size, kv.trash, kv.shards
    per = r // shards
    offs = jnp.arange(n, dtype=jnp.int32)[None, :]
    pos = start[:, None] + offs  # [R, N] slot (= rotary position) of each new token
    valid = offs < num_new[:, None]
    col = jnp.clip(pos // bs, 0, tables.shape[1] - 1)
    blk = jnp.where(valid, jnp.take_along_axis(tables, col, axis=1), trash)
    within = pos % bs
    query_slots = jnp.where(valid, pos, -1)
    chunk = model.options.attn_q_chunk
    by_shard = lambda a: a.reshape(shards, per, *a.shape[1:])  # noqa: E731
    blk_s, within_s = by_shard(blk), by_shard(within)
    dtype = jnp.dtype(kv.dtype)
    if live is not None and n != 1:
        raise ValueError(f"live blocks serve one new token per row, got {n}")
    if live is None and window_blocks <= 0:
        raise ValueError("paged_extend needs window_blocks > 0 or live blocks")

    # The layer scan only *reads* the pool (a loop invariant: no copy of it is ever made); each
    # layer's new keys/values are overlaid on what it gathered and stacked as the scan's outputs,
    # then written into the pool in one scatter after the scan. Writing inside the scan instead
    # made XLA carry the whole pool through the loop (two extra pool copies of temporaries).
    # Reads and writes are vmapped over the shard axis: batched gathers/scatters whose batch
    # dimension is the pool's sharded one, which the partitioner keeps on each device (indexing
    # the shard axis with an index array instead made it all-reduce the gathered window).
    def gather(pool, i, ids):  # ids [S, ...] block ids -> [S, ..., Hkv, BS, Dh] of dtype
        return jax.lax.bitcast_convert_type(jax.vmap(lambda p, t: p[i, t])(pool, ids), dtype)

    if live is None:
        width = window_blocks * bs
        rows = jnp.arange(r, dtype=jnp.int32)[:, None]
        overlay_at = jnp.where(valid & (pos < width), pos, width)  # out of range: dropped
        window_s = by_shard(tables[:, :window_blocks])

        def attend(pool_k, pool_v, i, q, k, v):
            def window(pool):  # [R, W * BS, Hkv, Dh]
                got = gather(pool, i, window_s)  # [S, per, W, Hkv, BS, Dh]
                return jnp.swapaxes(got, 3, 4).reshape(r, width, cfg.num_kv_heads, cfg.head_dim)

            k_win = window(pool_k).at[rows, overlay_at].set(k, mode="drop")
            v_win = window(pool_v).at[rows, overlay_at].set(v, mode="drop")
            return cache_attention(q, k_win.astype(q.dtype), v_win.astype(q.dtype), query_slots, q_chunk=chunk,
                                   from_empty=from_empty)
    else:
        q_slot_s = by_shard(query_slots[:, 0])

        def attend(pool_k, pool_v, i, q, k, v):
            # the new token's own key/value join the softmax directly (no scatter into the
            # gathered blocks, whose copy of that slot is stale until the write after the scan)
            out = jax.vmap(ragged_decode_attention)(
                by_shard(q[:, 0]), gather(pool_k, i, live.block), gather(pool_v, i, live.block), live.row, live.first,
                q_slot_s, by_shard(k[:, 0]), by_shard(v[:, 0]))
            return out.reshape(r, 1, cfg.num_heads, cfg.head_dim)

    def layer(carry, p):
        x, i = carry
        q, k, v = model._qkv(p, x, pos)
        k, v = k.astype(dtype), v.astype(dtype)
        attn = attend(kv.k, kv.v, i, q, k, v)
        return (model._finish_layer(p, x, attn), i + 1), (k, v)

    (x, _), (k_new, v_new) = jax.lax.scan(layer, (model.embed_tokens(tokens), jnp.int32(0)), model._layer_params())

    def write(pool, new):  # new [L, R, N, Hkv, Dh] -> per shard [per, N, L, Hkv, Dh] at (block, slot)
        new = jax.lax.bitcast_convert_type(by_shard(jnp.moveaxis(new, 0, 2)), pool.dtype)
        return jax.vmap(lambda p, b, w, x: p.at[:, b, :, w].set(x))(pool, blk_s, within_s, new)

    return rms_norm(x, model.final_norm[...], cfg.rms_norm_eps), kv.replace(k=write(kv.k, k_new), v=write(kv.v, v_new))
