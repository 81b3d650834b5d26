"""The fused attention kernel (model.attn_impl "pallas", models.fused_attention), run in Pallas's
interpreter: the values and gradients of the XLA kernel (models.attention, the reference) on
plain, packed and hindsight layouts, only the tiles the mask reads run (a tile it skips is never
loaded), the FLOP counter counts those tiles, and the model, the teacher's views and the fused
RL step give the XLA kernel's numbers with it. (On a GPU the same kernel compiles through
Triton: benchmarks/attention.py --impl pallas.)"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import pytest
from flax import nnx

from turnsight_jax import flops
from turnsight_jax.config import default_config, validate
from turnsight_jax.errors import ConfigError
from turnsight_jax.models.attention import Layout, layout_attention, packed_mask
from turnsight_jax.models.fused_attention import block_plan, fused_attention, fused_attention_fn
from turnsight_jax.models.qwen3 import RuntimeOptions, init_model
from turnsight_jax.models.sharding import make_mesh
from turnsight_jax.rl.batch import make_train_batch
from turnsight_jax.rl.logprobs import teacher_logprobs
from turnsight_jax.rl.methods import resolve_method

from _vocab import fold_batch
from test_attention_skip import LAYOUTS as SKIP_LAYOUTS, T, _packed, _qkv
from test_rl_step import CFG, _cfg, setup  # noqa: F401  (the module fixture: trajectories, policy, reference)


def _two_contexts() -> Layout:
    """A hindsight-like row: a trajectory (segment 0), a block reading it up to 9 (segment 1), and
    a depth branch (segment 2) reading segment 0 up to 9 and its block's trunk up to 16; then a
    second row of one short trajectory. Exercises ctx2, which the skip tests' layouts lack."""
    lay = _packed([[(12, None), (8, (0, 9)), (6, (0, 9))], [(5, None)]])
    c2s, c2e = np.asarray(lay.ctx2_segment).copy(), np.asarray(lay.ctx2_end).copy()
    c2s[0, 20:26], c2e[0, 20:26] = 1, 16
    return dataclasses.replace(lay, ctx2_segment=jnp.asarray(c2s), ctx2_end=jnp.asarray(c2e))


LAYOUTS = dict(SKIP_LAYOUTS, contexts=_two_contexts)
BLOCKS = [8, 16]  # 16: T = 40 padded to 48 inside the kernel


def _fused(lay, block):
    plan = block_plan(lay, block)
    return lambda q, k, v: fused_attention(q, k, v, plan, interpret=True)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("block", BLOCKS)
def test_the_fused_kernel_gives_the_values_and_gradients_of_the_xla_kernel(layout, block):
    lay = LAYOUTS[layout]()
    q, k, v = _qkv(lay.segment_ids.shape[0])
    w = jax.random.normal(jax.random.key(7), q.shape)
    xla = lambda q, k, v: layout_attention(q, k, v, lay, q_chunk=8)
    loss = lambda fn: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), argnums=(0, 1, 2)))
    (want, want_g), (got, got_g) = loss(xla)(q, k, v), loss(_fused(lay, block))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-4)  # a sum of ~5,000 terms of both signs
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    out = np.asarray(jax.jit(_fused(lay, block))(q, k, v))
    np.testing.assert_allclose(out, np.asarray(jax.jit(xla)(q, k, v)), rtol=1e-5, atol=1e-5)
    dead = ~flops.reads_any(jax.tree.map(np.asarray, lay))
    assert dead.any() and np.all(out[dead] == 0.0)  # a query that reads nothing is exactly zero


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("block", BLOCKS)
def test_the_plan_lists_exactly_the_tiles_the_mask_reads_and_the_counter_counts_them(layout, block):
    lay = LAYOUTS[layout]()
    plan = block_plan(lay, block)
    n = -(-T // block)
    idx = jnp.arange(T, dtype=jnp.int32)
    mask = np.zeros((lay.segment_ids.shape[0], n * block, n * block), bool)
    mask[:, :T, :T] = np.asarray(packed_mask(lay, lay.segment_ids, idx, idx))
    tiles = mask.reshape(-1, n, block, n, block).any(axis=(2, 4))  # [B, nq, nk]
    kv, qv = np.asarray(plan.kv_visits), np.asarray(plan.q_visits)
    for b in range(tiles.shape[0]):
        for i in range(n):
            assert kv[b, i, 0] == tiles[b, i].sum()
            assert list(kv[b, i, 1:1 + kv[b, i, 0]]) == list(np.flatnonzero(tiles[b, i]))
            assert qv[b, i, 0] == tiles[b, :, i].sum()
            assert list(qv[b, i, 1:1 + qv[b, i, 0]]) == list(np.flatnonzero(tiles[b, :, i]))
    reach = flops.key_reach(jax.tree.map(np.asarray, lay))
    assert flops.fused_pairs(reach, block) == tiles.sum() * block * block
    assert tiles.sum() < tiles.size  # something is skipped on every layout here


def test_a_tile_the_plan_skips_is_never_read():
    """One packed row of two items (tokens 0-15, 16-39, the second reading only itself): NaN keys
    and values in the first item reach none of the second item's outputs or query gradients (its
    query blocks never visit key blocks 0-1), and do reach the first item's (the test can fail):
    a NaN propagates, it is not read as a query with nothing to read."""
    lay = _packed([[(16, None), (24, None)]])
    q, k, v = _qkv(1)
    first = (jnp.arange(T) < 16)[None, :, None, None]
    k, v = jnp.where(first, jnp.nan, k), jnp.where(first, jnp.nan, v)
    attend = _fused(lay, 8)
    out = np.asarray(jax.jit(attend)(q, k, v))
    dq = np.asarray(jax.jit(jax.grad(lambda q: jnp.sum(attend(q, k, v)[:, 16:] ** 2)))(q))
    assert np.isfinite(out[:, 16:]).all() and np.isnan(out[:, :16]).all()
    assert np.isfinite(dq[:, 16:]).all() and np.isnan(dq[:, :16]).all()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_fused_kernel_in_bf16_is_as_close_as_the_xla_kernel(layout):
    """bf16 operands (float32 scores and sums): outputs within 1e-3 of float32 on average and,
    like the gradients, about as close to float32 as the XLA kernel's own bf16 numbers (factor 2)."""
    lay = LAYOUTS[layout]()
    q, k, v = _qkv(lay.segment_ids.shape[0])
    w = jax.random.normal(jax.random.key(7), q.shape)
    xla = lambda q, k, v: layout_attention(q, k, v, lay, q_chunk=8)
    fused = _fused(lay, 16)
    half = [a.astype(jnp.bfloat16) for a in (q, k, v)]
    exact = np.asarray(jax.jit(xla)(q, k, v))
    got, ref = (np.asarray(jax.jit(fn)(*half)).astype(np.float32) for fn in (fused, xla))
    assert np.mean(np.abs(got - exact)) < 1e-3
    assert np.max(np.abs(got - exact)) <= 2 * np.max(np.abs(ref - exact)) + 1e-3
    grad = lambda fn, args: jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w),
                                             argnums=(0, 1, 2)))(*args)
    for a, b, want in zip(grad(fused, half), grad(xla, half), grad(xla, (q, k, v))):
        assert a.dtype == jnp.bfloat16
        err, ref_err = (float(jnp.max(jnp.abs(x.astype(jnp.float32) - want))) for x in (a, b))
        scale = float(jnp.max(jnp.abs(want)))
        assert err <= 2 * ref_err + 1e-3 * scale and err < 2e-2 * scale


def test_on_a_mesh_each_device_runs_its_own_rows():
    """Under an 8-device (data 2, fsdp 2, tensor 2) mesh the kernel runs in a shard_map over the
    rows and heads: the values of the unsharded call."""
    lay = _packed([[(12, None), (6, (0, 7))], [(20, None)], [(9, None)], [(30, None), (10, (0, 30))]])
    q, k, v = _qkv(4, hq=4, hkv=2)
    plan = block_plan(lay, 8)
    want = np.asarray(fused_attention(q, k, v, plan, interpret=True))
    mesh = make_mesh(2, 2, 2)
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(fused_attention_fn(plan, interpret=True))(q, k, v))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_refused_with_the_reason():
    lay = LAYOUTS["plain"]()
    q, k, v = _qkv(lay.segment_ids.shape[0], dh=12)
    with pytest.raises(ValueError, match="power-of-two head_dim.*12"):
        fused_attention(q, k, v, block_plan(lay, 8), interpret=True)
    q, k, v = _qkv(2)
    with pytest.raises(ValueError, match="does not fit"):
        fused_attention(q, k, v, block_plan(lay, 8), interpret=True)


def test_the_config_names_the_kernel_and_refuses_what_cannot_run():
    from turnsight_jax.model_setup import runtime_options

    cfg = default_config()
    assert cfg.model.attn_impl == "xla" and runtime_options(cfg).attn_impl == "xla"
    for key, value, match in (("attn_impl", "flash", "attn_impl must be one of"),
                              ("attn_block", 48, "attn_block must be a power of two")):
        bad = mlc.ConfigDict(cfg.to_dict())
        bad.model[key] = value
        with pytest.raises(ConfigError, match=match):
            validate(bad, check_data=False)
    bad = mlc.ConfigDict(cfg.to_dict())
    bad.model.attn_impl = "pallas"
    if jax.default_backend() != "gpu":
        with pytest.raises(ConfigError, match="backend is 'cpu'"):
            runtime_options(bad)


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_teacher_logprobs_with_the_fused_kernel_equal_the_xla_kernels(setup, tok, layout):  # noqa: F811
    """The teacher's views on real hindsight rows (two context segments per block token): the same
    log-probs as the XLA kernel; the counter's executed teacher pairs are its tiles."""
    trajs, row_tasks, _, _ = setup
    cfg = dataclasses.replace(_cfg(method="turnsight"), **({"pack_rows": True} if layout == "packed" else {}))
    batch, _ = make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg))
    batch = fold_batch(batch)
    views = jax.tree.map(jnp.asarray, batch.views)
    got = {}
    for impl in ("xla", "pallas_interpret"):
        model = init_model(CFG, seed=1, options=RuntimeOptions(attn_q_chunk=16, attn_impl=impl, attn_block=16))
        graphdef, params = nnx.split(model)
        got[impl] = np.asarray(jax.jit(lambda p, v, g=graphdef: teacher_logprobs(nnx.merge(g, p), v, chunk=64))(
            params, views))
    np.testing.assert_allclose(got["pallas_interpret"], got["xla"], rtol=1e-5, atol=1e-5)
    lay = batch.views.layout if getattr(batch.views, "packed", None) is None else batch.views.packed.layout
    assert (np.asarray(lay.ctx2_segment) >= 0).any()  # depth branches: the kernel's second context ran
    counted = flops.update_flops(CFG, batch, updates=1, q_chunk=16, remat=False, fused_block=16).parts["teacher"]
    unfused = flops.update_flops(CFG, batch, updates=1, q_chunk=16, remat=False).parts["teacher"]
    assert counted[0] == unfused[0] and counted[1] < unfused[1]


def test_the_fused_step_with_the_fused_kernel_equals_the_xla_step(setup, tok):  # noqa: F811
    """One TurnSight step with SGD(1) on real packed rows (student and teacher both through the
    kernel): the gradients and loss of the XLA kernel's step."""
    from test_rl_step import _batch, _max_diff, _sgd_step, _with_options

    trajs, row_tasks, policy, ref = setup
    cfg = dataclasses.replace(_cfg(method="turnsight"), pack_rows=True)
    batch = _batch(trajs, row_tasks, tok, cfg)
    out = {}
    for impl in ("xla", "pallas_interpret"):
        pol = nnx.merge(*_with_options(policy, attn_q_chunk=16, attn_impl=impl, attn_block=16))
        rf = nnx.merge(*_with_options(ref, attn_q_chunk=16, attn_impl=impl, attn_block=16))
        out[impl] = _sgd_step(cfg, pol, rf, batch)
    (g0, m0), (g1, m1) = out["xla"], out["pallas_interpret"]
    scale = max(jax.tree.leaves(jax.tree.map(lambda x: float(np.abs(np.asarray(x)).max()), g0)))
    assert scale > 1e-4
    assert _max_diff(g0, g1) < 1e-5 * max(1.0, scale)
    assert abs(float(m0["pg_loss"]) - float(m1["pg_loss"])) < 1e-6


def test_the_kernels_lower_for_gpus_through_triton():
    """With no GPU here, the next best check of the GPU path: exporting for CUDA runs Pallas's
    Triton lowering of the three kernels (forward, dq, dk/dv), bf16 and float32, at Qwen3's head
    dimension and the default tiles, and of a model's gradient with model.attn_impl="pallas"
    (Triton's own compiler, on a device, comes after this)."""
    import re

    ok = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    names = ["turnsight_attention_forward", "turnsight_attention_dq", "turnsight_attention_dkv"]
    lay = _two_contexts()
    plan = block_plan(lay, 64)
    for dtype in (jnp.bfloat16, jnp.float32):
        q, k, v = (a.astype(dtype) for a in _qkv(2, hq=16, hkv=8, dh=128))
        grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fused_attention(q, k, v, plan).astype(jnp.float32)),
                                argnums=(0, 1, 2)))
        text = jax.export.export(grad, platforms=["cuda"], disabled_checks=ok)(q, k, v).mlir_module()
        assert re.findall(r'name = "(turnsight_attention_[a-z]+)"', text) == names
    model = init_model(CFG, seed=0, options=RuntimeOptions(attn_impl="pallas", attn_block=16))
    graphdef, params = nnx.split(model)
    tokens = jnp.zeros((2, T), jnp.int32)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p).hidden_states(tokens, lay, skip_padding=True))
    text = jax.export.export(jax.jit(jax.grad(loss)), platforms=["cuda"], disabled_checks=ok)(params).mlir_module()
    # one forward kernel per layer's scan body, and its two backward kernels
    assert sorted(set(re.findall(r'name = "(turnsight_attention_[a-z]+)"', text))) == sorted(names)
