"""A paged KV cache, split into row shards, and the Qwen3 forward pass that reads and writes it.

The pool is [S, L, NB, BS, Hkv, Dh]: S row shards (one per data x fsdp device; 1 on one device),
each with NB blocks of BS slots. A sequence lives in one shard and owns a *block table*: the
ids of its blocks, in order, inside its shard. Slot p of the sequence is slot p % BS of block
table[p // BS]. Block NB - 1 of every shard is the *trash block*: padding tokens and table
entries past a sequence's end point there, so nothing is ever written into another sequence's
block, and the keys read from it are masked by position.

Rows of a call are shard-major: with R rows and S shards, row r belongs to shard r // (R / S).
Under a mesh the pool is sharded over its S axis (and KV heads over `tensor`) and the rows over
(data, fsdp), so every block read and write stays on its device (tests/test_paged_cache.py scans
the compiled program for collectives on the pool).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from turnsight_jax.models.attention import cache_attention
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import rms_norm
from turnsight_jax.models.sharding import BATCH, fit_spec


@struct.dataclass
class PagedKV:
    """Keys and values of every layer: k, v [S, L, NB, BS, Hkv, Dh] (the shard axis leads: vmapping
    the block reads/writes over it needs no transpose of the pool)."""

    k: jax.Array
    v: jax.Array

    @property
    def shards(self) -> int:
        return self.k.shape[0]

    @property
    def blocks(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def trash(self) -> int:
        return self.k.shape[2] - 1

    def nbytes_per_shard(self) -> int:
        return 2 * self.k.nbytes // self.shards


def pool_shape(cfg: Qwen3Config, shards: int, blocks: int, block_size: int) -> tuple[int, ...]:
    return (shards, cfg.num_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_dim)


def pool_spec(shape, mesh: Mesh | None) -> P:
    """Shards over (data, fsdp), KV heads over tensor (where they divide)."""
    spec = P(BATCH, None, None, None, "tensor", None)
    return spec if mesh is None else fit_spec(spec, shape, mesh)


def bytes_per_token(cfg: Qwen3Config, dtype) -> int:
    """K and V of one token over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def empty_pool(cfg: Qwen3Config, shards: int, blocks: int, block_size: int, dtype, mesh: Mesh | None = None
               ) -> PagedKV:
    """A zero pool, created directly in its sharding (never materialised whole on one device)."""
    shape = pool_shape(cfg, shards, blocks, block_size)

    def make():
        return PagedKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    if mesh is None:
        return jax.jit(make)()
    s = NamedSharding(mesh, pool_spec(shape, mesh))
    return jax.jit(make, out_shardings=PagedKV(s, s))()


def paged_extend(model, tokens: jax.Array, num_new: jax.Array, start: jax.Array, tables: jax.Array, kv: PagedKV,
                 *, window_blocks: int, from_empty: bool = False) -> tuple[jax.Array, PagedKV]:
    """Append tokens to paged sequences; return their hidden states (final norm) and the pool.

    model: a Qwen3. tokens [R, N] int32, row r appends its first num_new[r] tokens at slots
    start[r] ... start[r] + num_new[r] - 1; tables [R, MB] int32 block ids (blocks for every slot
    written must already be in the table); rows shard-major over kv.shards (module docstring).
    window_blocks (static): each query reads the first window_blocks * BS slots of its sequence
    (every row's new length must fit), so attention costs O(window) per token whatever the pool
    size. from_empty (static): every start is 0 (a prefill), see `cache_attention`.
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
    blk_s, within_s, window_s = by_shard(blk), by_shard(within), by_shard(tables[:, :window_blocks])

    # Reads and writes are vmapped over the shard axis: batched gathers/scatters whose batch
    # dimension is the pool's sharded one, which the partitioner keeps on each device (indexing
    # the shard axis with an index array instead made it all-reduce the gathered window).
    def write(pool, i, new):  # per shard: pool [L, NB, BS, H, Dh], new [per, N, H, Dh]
        return jax.vmap(lambda p, b, w, x: p.at[i, b, w].set(x))(
            pool, blk_s, within_s, new)

    def read(pool, i):  # -> [R, W * BS, H, Dh]
        got = jax.vmap(lambda p, t: p[i, t])(pool, window_s)  # [S, per, W, BS, H, Dh]
        return got.reshape(r, window_blocks * bs, cfg.num_kv_heads, cfg.head_dim)

    def layer(carry, p):
        x, k_all, v_all, i = carry
        q, k, v = model._qkv(p, x, pos)
        # Scatters into the pool carried by the scan: in place, no copy of the pool.
        k_all = write(k_all, i, by_shard(k.astype(k_all.dtype)))
        v_all = write(v_all, i, by_shard(v.astype(v_all.dtype)))
        attn = cache_attention(q, read(k_all, i).astype(q.dtype), read(v_all, i).astype(q.dtype), query_slots,
                               q_chunk=chunk, from_empty=from_empty)
        return (model._finish_layer(p, x, attn), k_all, v_all, i + 1), None

    init = (model.embed_tokens(tokens), kv.k, kv.v, jnp.int32(0))
    (x, k_all, v_all, _), _ = jax.lax.scan(layer, init, model._layer_params())
    return rms_norm(x, model.final_norm[...], cfg.rms_norm_eps), PagedKV(k_all, v_all)
