"""Key blocks in the skipping attention kernel (model.attn_key_block, models.attention): a live
chunk scores its keys a block at a time and skips the blocks none of its group's queries reads,
with the values and gradients of the kernel that scores every key, and the FLOP counter counts
exactly the blocks that run. (The model with key blocks: tests/test_attention_skip.py.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from turnsight_jax import flops
from turnsight_jax.models.attention import Layout, layout_attention, packed_mask
from turnsight_jax.models.qwen3 import RuntimeOptions, init_model
from turnsight_jax.rl.batch import make_train_batch
from turnsight_jax.rl.logprobs import teacher_logprobs
from turnsight_jax.rl.methods import resolve_method

from _vocab import fold_batch
from test_attention_skip import CHUNK, LAYOUTS, T, _packed, _plain, _qkv
from test_rl_step import CFG, _cfg, setup  # noqa: F401  (the module fixture: trajectories, policy, reference)

# (row group, key block): one row per group, two, the whole batch; blocks of one chunk, of two,
# and of 5 keys (not a divisor of the chunk's key bounds: the last block is padded)
SETTINGS = [(1, 8), (2, 16), (6, 5)]


def _np(lay: Layout):
    return jax.tree.map(np.asarray, lay)


def _full_mask(lay: Layout) -> np.ndarray:
    """[B, T, T] bool: which key each query reads (packed_mask over every key)."""
    idx = jnp.arange(T, dtype=jnp.int32)
    return np.asarray(packed_mask(lay, lay.segment_ids, idx, idx))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("row_group,key_block", SETTINGS)
def test_key_blocks_give_the_values_and_gradients_of_the_full_kernel(layout, row_group, key_block):
    lay = LAYOUTS[layout]()
    q, k, v = _qkv(lay.segment_ids.shape[0])
    w = jax.random.normal(jax.random.key(7), q.shape)

    def loss(q, k, v, group, block):
        return jnp.sum(layout_attention(q, k, v, lay, q_chunk=CHUNK, row_group=group, key_block=block) * w)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=(3, 4))
    (want, want_g), (got, got_g) = grad(q, k, v, 0, 0), grad(q, k, v, row_group, key_block)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    out = np.asarray(jax.jit(lambda q, k, v: layout_attention(q, k, v, lay, q_chunk=CHUNK, row_group=row_group,
                                                              key_block=key_block))(q, k, v))
    dead = ~flops.reads_any(_np(lay))
    assert dead.any() and np.all(out[dead] == 0.0)  # a query that reads nothing is exactly zero


def test_a_block_no_query_of_the_chunk_reads_is_never_touched():
    """One packed row of two items (tokens 0-15 and 16-39, the second reading only itself): NaN
    keys and values in the first item reach none of the second item's outputs or query
    gradients with key blocks (the second item's chunks skip blocks 0-1, forward and backward),
    and do reach them with one block per chunk (the test can fail)."""
    lay = _packed([[(16, None), (24, None)]])
    q, k, v = _qkv(1)
    first = (jnp.arange(T) < 16)[None, :, None, None]
    bad_k, bad_v = jnp.where(first, jnp.nan, k), jnp.where(first, jnp.nan, v)
    w = jax.random.normal(jax.random.key(7), q.shape)

    def second_item(q, k, v, block):
        out = layout_attention(q, k, v, lay, q_chunk=CHUNK, row_group=1, key_block=block)
        return jnp.sum(out[:, 16:] * w[:, 16:]), out

    run = jax.jit(jax.value_and_grad(second_item, has_aux=True), static_argnums=3)
    (_, ref_out), ref_dq = run(q, k, v, 8)
    (loss, out), dq = run(q, bad_k, bad_v, 8)
    assert np.isfinite(float(loss))
    np.testing.assert_allclose(out[:, 16:], ref_out[:, 16:], rtol=1e-6)
    np.testing.assert_allclose(dq[:, 16:], ref_dq[:, 16:], rtol=1e-6)
    (loss_all, _), dq_all = run(q, bad_k, bad_v, 0)
    assert np.isnan(float(loss_all)) and np.isnan(np.asarray(dq_all[:, 16:])).any()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_key_reach_is_exactly_what_the_mask_reads(layout):
    """flops.key_reach's three ranges per query, as a set of keys, are the keys packed_mask lets
    it read; causal_reach is key_reach of Layout.causal."""
    lay = LAYOUTS[layout]()
    reach = flops.key_reach(_np(lay))
    j = np.arange(T)
    from_reach = ((j >= reach[..., 0, None]) & (j < reach[..., 1, None])).any(axis=2)  # [B, T, T]
    np.testing.assert_array_equal(from_reach, _full_mask(lay))
    valid = np.arange(T)[None, :] < np.array([40, 9, 0, 16])[:, None]
    np.testing.assert_array_equal(flops.causal_reach(valid), flops.key_reach(_np(_plain([40, 9, 0, 16]))))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("row_group,key_block", SETTINGS)
def test_the_counter_counts_the_blocks_the_mask_makes_live(layout, row_group, key_block):
    """skipping_pairs with key blocks, against a count from the full mask: per (row group, chunk
    with a live query), each block of `key_block` keys below the chunk's key bound that one of
    the group's queries reads costs rows x chunk x key_block; fewer pairs than without blocks
    when the blocks tile the chunks' key bounds (blocks of 5 or 16 keys pad a bound's last block)."""
    lay = LAYOUTS[layout]()
    b = lay.segment_ids.shape[0]
    mask, live = _full_mask(lay), flops.reads_any(_np(lay))
    r = np.gcd(b, row_group)
    size, _, plan = flops.chunk_plan(T, T, CHUNK, True)
    want = 0
    for first, last, keys in plan:
        for c in range(first, last):
            for g in range(b // r):
                rows, cols = slice(g * r, (g + 1) * r), slice(c * size, (c + 1) * size)
                if not live[rows, cols].any():
                    continue
                if keys <= key_block:
                    want += r * size * keys
                    continue
                for start in range(0, keys, key_block):
                    want += r * size * key_block * bool(mask[rows, cols, start:min(start + key_block, keys)].any())
    got = flops.skipping_pairs(live, CHUNK, row_group, reach=flops.key_reach(_np(lay)), key_block=key_block)
    assert got == want
    if CHUNK % key_block == 0:
        assert got < flops.skipping_pairs(live, CHUNK, row_group)


def test_wide_packed_teacher_rows_with_key_blocks_score_the_same_for_fewer_pairs(setup, tok):  # noqa: F811
    """Real hindsight rows packed into rows of 2,048 (train.teacher_pack_width) and scored with
    key blocks: the teacher's log-probs equal those of the rows packed at the batch's width
    without them, and the counter's executed teacher pairs at 2,048 fall with the key blocks
    below what those rows cost without them (necessary FLOPs the same)."""
    trajs, row_tasks, _, _ = setup
    base = dataclasses.replace(_cfg(method="turnsight"), pack_rows=True)
    got, batches = {}, {}
    for name, width, block in (("narrow", 0, 0), ("wide", 2048, 16)):
        cfg = dataclasses.replace(base, teacher_pack_width=width)
        batch, _ = make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg))
        batches[name] = batch = fold_batch(batch)
        model = init_model(CFG, seed=1, options=RuntimeOptions(attn_q_chunk=16, attn_row_group=1,
                                                               attn_key_block=block))
        graphdef, params = nnx.split(model)
        got[name] = np.asarray(jax.jit(lambda p, v, g=graphdef: teacher_logprobs(nnx.merge(g, p), v, chunk=64))(
            params, jax.tree.map(jnp.asarray, batch.views)))
    assert batches["wide"].views.packed.tokens.shape[1] == 2048
    assert batches["wide"].views.packed.plan.rows < batches["narrow"].views.packed.plan.rows
    np.testing.assert_allclose(got["wide"], got["narrow"], rtol=1e-5, atol=1e-5)
    count = {kb: flops.update_flops(CFG, batches["wide"], updates=1, q_chunk=16, remat=False, row_group=1,
                                    key_block=kb).parts["teacher"] for kb in (0, 16)}
    assert count[16][0] == count[0][0] and count[16][1] < 0.5 * count[0][1]
