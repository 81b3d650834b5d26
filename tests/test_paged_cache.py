"""The paged KV pool's pieces: the live-block listing, ragged decode attention against the dense
cache attention, and a decode step through the live blocks against the same step through a
dense window (hidden states and the pool written)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.models.attention import cache_attention
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.paged_cache import (LiveBlocks, empty_pool, live_blocks, paged_extend,
                                              ragged_decode_attention, storage_dtype)
from turnsight_jax.models.qwen3 import init_model

TINY = Qwen3Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16)


def test_live_blocks_lists_rows_back_to_back():
    got = live_blocks([[5, 6, 7], [], [2], [9, 1]], per=2, trash=99, block_size=4, size=6)
    # shard 0: row 0's three blocks, row 1 none; shard 1: row 0 (block 2), row 1 (9, 1)
    np.testing.assert_array_equal(got["block"], [[5, 6, 7, 99, 99, 99], [2, 9, 1, 99, 99, 99]])
    np.testing.assert_array_equal(got["row"], [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(got["first"][:, :3], [[0, 4, 8], [0, 0, 4]])
    assert (got["first"][0, 3:] > 10**6).all()  # padding entries are never readable
    np.testing.assert_array_equal(got["row_start"], [[0, 6], [0, 1]])
    with pytest.raises(ValueError, match="shard 0 lists over 2 live blocks"):
        live_blocks([[1, 2, 3], []], per=2, trash=99, block_size=4, size=2)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_ragged_attention_equals_dense_cache_attention(dtype, tol):
    """Rows of very different lengths, blocks scattered over the pool in random order."""
    rng = np.random.default_rng(0)
    r, hkv, g, dh, bs, nb = 5, 2, 3, 8, 4, 64
    lengths = np.array([1, 4, 5, 17, 30])  # the query sits at slot length - 1
    need = -(-lengths // bs)
    ids = rng.permutation(nb)
    tables, at = [], 0
    for n in need:
        tables.append(list(ids[at:at + n]))
        at += n
    k_pool = jnp.asarray(rng.standard_normal((nb, hkv, bs, dh)), dtype)
    v_pool = jnp.asarray(rng.standard_normal((nb, hkv, bs, dh)), dtype)
    q = jnp.asarray(rng.standard_normal((r, hkv * g, dh)), dtype)
    size = int(need.sum()) + 3  # some padding entries
    lb = live_blocks(tables, per=r, trash=nb - 1, block_size=bs, size=size)
    got = ragged_decode_attention(q, k_pool[lb["block"][0]], v_pool[lb["block"][0]], jnp.asarray(lb["row"][0]),
                                  jnp.asarray(lb["first"][0]), jnp.asarray(lengths - 1))
    width = int(need.max()) * bs
    dense = np.zeros((2, r, width, hkv, dh), np.float32)
    for i, t in enumerate(tables):
        for j, b in enumerate(t):
            dense[0, i, j * bs:(j + 1) * bs] = np.asarray(k_pool[b], np.float32).transpose(1, 0, 2)
            dense[1, i, j * bs:(j + 1) * bs] = np.asarray(v_pool[b], np.float32).transpose(1, 0, 2)
    want = cache_attention(q[:, None].astype(jnp.float32), jnp.asarray(dense[0]), jnp.asarray(dense[1]),
                           jnp.asarray(lengths - 1)[:, None])[:, 0]
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=tol, rtol=tol)


def test_decode_step_through_live_blocks_equals_dense_window():
    """One token per row appended to sequences of different lengths: the live-block path gives the
    window path's hidden states and writes the same keys and values into the pool."""
    model = init_model(TINY, seed=0)
    bs, nb, r = 4, 32, 3
    kv = empty_pool(TINY, 1, nb, bs, jnp.float32)
    assert kv.k.dtype == storage_dtype(jnp.float32) and kv.dtype == "float32"
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, TINY.vocab_size, n) for n in (3, 9, 6)]
    ids = rng.permutation(nb - 1)
    tables = np.full((r, 8), nb - 1, np.int32)
    at = 0
    for i, p in enumerate(prompts):
        n = -(-(len(p) + 1) // bs)
        tables[i, :n] = ids[at:at + n]
        at += n
    toks = np.zeros((r, 16), np.int32)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    _, kv = paged_extend(model, jnp.asarray(toks), lens, jnp.zeros(r, jnp.int32), jnp.asarray(tables), kv,
                         window_blocks=8, from_empty=True)
    new = jnp.asarray(rng.integers(0, TINY.vocab_size, (r, 1)), jnp.int32)
    one = jnp.ones(r, jnp.int32)
    h_win, kv_win = paged_extend(model, new, one, lens, jnp.asarray(tables), kv, window_blocks=4)
    listed = [list(tables[i, :-(-(int(lens[i]) + 1) // bs)]) for i in range(r)]
    lb = LiveBlocks(**{k: jnp.asarray(v) for k, v in live_blocks(listed, r, nb - 1, bs, 12).items()})
    h_live, kv_live = paged_extend(model, new, one, lens, jnp.asarray(tables), kv, live=lb)
    np.testing.assert_allclose(np.asarray(h_live), np.asarray(h_win), atol=1e-5)
    used = sorted({int(b) for t in listed for b in t})
    for a, b in ((kv_live.k, kv_win.k), (kv_live.v, kv_win.v)):
        a, b = (np.asarray(x).view(np.float32)[:, :, used] for x in (a, b))
        np.testing.assert_array_equal(a[:, 0], b[:, 0])  # layer 0's keys/values: identical inputs
        np.testing.assert_allclose(a, b, atol=1e-5)  # later layers: the two attentions' round-off
    with pytest.raises(ValueError, match="one new token per row"):
        paged_extend(model, jnp.asarray(toks), lens, jnp.zeros(r, jnp.int32), jnp.asarray(tables), kv, live=lb)
