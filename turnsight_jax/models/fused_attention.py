"""Fused (flash) attention on GPUs for every `Layout`: a Pallas kernel, forward and backward.

The XLA kernel (`models.attention`) is the reference and the CPU path; this one runs where
`model.attn_impl = "pallas"` asks for it, on a GPU (Triton), or anywhere in Pallas's interpreter
(`interpret=True`, what the tests run). Its mask is `packed_mask`'s, evaluated inside the kernel
from per-token metadata: a query reads a key of its own segment at or before it, or of one of its
two context segments below that context's end. So one kernel serves the student (plain causal or
packed trajectories: segment ids and causal) and the teacher's packed hindsight views (whose
queries read up to three key ranges).

Work is skipped at the granularity of (query block, key block) tiles: `block_plan` lists, for
each query block, the key blocks at least one of its queries reads (and for each key block the
query blocks that read it, for the key/value gradients), computed once per forward from the
layout and shared by every layer. A tile that is listed is computed in full under the mask; one
that is not is never loaded. turnsight_jax.flops.fused_pairs counts them (from the layout's key
ranges, host side).

Shapes: q [B, T, Hq, Dh]; k, v [B, T, Hkv, Dh] (grouped-query: Hq a multiple of Hkv); Dh a power
of two (Triton's tiles). Scores, softmax and accumulation are float32; the products take the
inputs' dtype (bfloat16 on accelerators; float32 runs at full precision, no TF32).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from turnsight_jax.models.attention import NO_SEGMENT, PAD_SEGMENT, Layout, packed_mask
from turnsight_jax.models.sharding import ACTIVATION_SPECS, AXES, fit_spec

_NEG = -1e30  # finite: a query that reads nothing keeps NaN-free sums
_LOG2E = math.log2(math.e)
META_FIELDS = 5  # segment, ctx1 segment, ctx1 end, ctx2 segment, ctx2 end


@struct.dataclass
class BlockPlan:
    """Which tiles run, for blocks of `block` tokens (the padded width Tp = nq * block).

    meta: [B, 5, Tp] int32, the layout's mask inputs (padding: PAD_SEGMENT / NO_SEGMENT).
    kv_visits: [B, nq, nk + 1] int32: for query block i, [count, key blocks read (ascending),
      then the unread ones].
    q_visits: [B, nk, nq + 1] int32: for key block j, [count, query blocks that read it, ...].
    """

    meta: jax.Array
    kv_visits: jax.Array
    q_visits: jax.Array
    block: int = struct.field(pytree_node=False)

    @property
    def width(self) -> int:
        return self.meta.shape[2]


def _pad_to(a, width: int, value):
    return jnp.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=value)


def block_plan(layout: Layout, block: int) -> BlockPlan:
    """The tiles a layout's mask reads, at `block` tokens per tile side. Exact: a tile is listed
    iff one of its (query, key) pairs is readable (`packed_mask`, evaluated one query block at a
    time: a [B, block, Tp] mask alive at once)."""
    b, t = layout.segment_ids.shape
    n = -(-t // block)
    width = n * block
    meta = jnp.stack([_pad_to(layout.segment_ids, width, PAD_SEGMENT),
                      _pad_to(layout.ctx1_segment, width, NO_SEGMENT), _pad_to(layout.ctx1_end, width, 0),
                      _pad_to(layout.ctx2_segment, width, NO_SEGMENT), _pad_to(layout.ctx2_end, width, 0)],
                     axis=1).astype(jnp.int32)
    k_index = jnp.arange(width, dtype=jnp.int32)

    def reads(i):  # [B, nk]: the key blocks query block i reads (packed_mask reads no positions)
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, i * block, block, axis=1)
        q = Layout(positions=sl(meta[:, 0]), segment_ids=sl(meta[:, 0]), ctx1_segment=sl(meta[:, 1]),
                   ctx1_end=sl(meta[:, 2]), ctx2_segment=sl(meta[:, 3]), ctx2_end=sl(meta[:, 4]))
        q_index = i * block + jnp.arange(block, dtype=jnp.int32)
        mask = packed_mask(q, meta[:, 0], q_index, k_index)
        return jnp.any(mask.reshape(b, block, n, block), axis=(1, 3))

    read = jnp.moveaxis(jax.lax.map(reads, jnp.arange(n)), 0, 1)  # [B, nq, nk]
    return BlockPlan(meta, _visits(read), _visits(jnp.swapaxes(read, 1, 2)), block)


def _visits(read):
    """read [B, n, m] bool -> [B, n, m + 1] int32: per row, the count, then the read columns in
    ascending order, then the rest."""
    order = jnp.argsort(~read, axis=-1, stable=True).astype(jnp.int32)
    return jnp.concatenate([jnp.sum(read, axis=-1, dtype=jnp.int32)[..., None], order], axis=-1)


def _mask(meta_q, q_index, k_seg, k_index):
    """[bq, bk] bool from the query block's metadata (5 arrays [bq]), q_index [bq], and the key
    block's segments and indices [bk]: `packed_mask` inside a tile."""
    seg, c1s, c1e, c2s, c2e = (m[:, None] for m in meta_q)
    ks, kj = k_seg[None, :], k_index[None, :]
    own = (ks == seg) & (kj <= q_index[:, None])
    ctx1 = (ks == c1s) & (kj < c1e)
    ctx2 = (ks == c2s) & (kj < c2e)
    return (ks >= 0) & (own | ctx1 | ctx2)


def _load_meta(meta_ref, sl):
    return tuple(meta_ref[f, sl] for f in range(META_FIELDS))


def _dot(a, b, *, trans_a=False, trans_b=False):
    """A tile product accumulated in float32; float32 operands at full precision (no TF32)."""
    precise = a.dtype == jnp.float32
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=jax.lax.Precision.HIGHEST if precise else None)


def _forward_kernel(meta_ref, visits_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block: int, scale: float):
    """One query block of one head against the key blocks it reads (online softmax in base 2).
    lse is stored in base 2 (log2 of the sum of 2^scores); _NEG for a query that reads nothing."""
    i = pl.program_id(0)
    q_sl = pl.ds(i * block, block)
    q = q_ref[...]
    meta_q = _load_meta(meta_ref, q_sl)
    q_index = i * block + jnp.arange(block, dtype=jnp.int32)

    def step(t, carry):
        acc, top, total, reads = carry
        j = visits_ref[t + 1]
        k_sl = pl.ds(j * block, block)
        k, v = k_ref[k_sl, :], v_ref[k_sl, :]
        mask = _mask(meta_q, q_index, meta_ref[0, k_sl], j * block + jnp.arange(block, dtype=jnp.int32))
        s = jnp.where(mask, _dot(q, k, trans_b=True) * (scale * _LOG2E), _NEG)
        new_top = jnp.maximum(top, jnp.max(s, axis=1))
        p = jnp.where(mask, jnp.exp2(s - new_top[:, None]), 0.0)
        fade = jnp.exp2(top - new_top)
        acc = acc * fade[:, None] + _dot(p.astype(v.dtype), v)
        return acc, new_top, total * fade + jnp.sum(p, axis=1), reads + jnp.sum(mask.astype(jnp.float32), axis=1)

    zero = jnp.zeros((block,), jnp.float32)
    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((block,), _NEG, jnp.float32), zero, zero)
    acc, top, total, reads = jax.lax.fori_loop(0, visits_ref[0], step, init)
    seen = reads > 0  # by the mask, not the sum: a NaN score propagates rather than reading as nothing
    safe = jnp.where(seen, total, 1.0)
    o_ref[...] = jnp.where(seen[:, None], acc / safe[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, top + jnp.log2(safe), _NEG)


def _dq_kernel(meta_ref, visits_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, block: int,
               scale: float):
    """dq of one query block of one head, over the key blocks it reads (flash attention's)."""
    i = pl.program_id(0)
    q_sl = pl.ds(i * block, block)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    meta_q = _load_meta(meta_ref, q_sl)
    q_index = i * block + jnp.arange(block, dtype=jnp.int32)

    def step(t, dq):
        j = visits_ref[t + 1]
        k_sl = pl.ds(j * block, block)
        k, v = k_ref[k_sl, :], v_ref[k_sl, :]
        mask = _mask(meta_q, q_index, meta_ref[0, k_sl], j * block + jnp.arange(block, dtype=jnp.int32))
        p = jnp.where(mask, jnp.exp2(_dot(q, k, trans_b=True) * (scale * _LOG2E) - lse[:, None]), 0.0)
        ds = p * (_dot(do, v, trans_b=True) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = jax.lax.fori_loop(0, visits_ref[0], step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(meta_ref, visits_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                block: int, scale: float):
    """dk, dv of one key block for one query head, over the query blocks that read it (the
    caller sums a group's heads)."""
    j = pl.program_id(0)
    k_sl = pl.ds(j * block, block)
    k, v = k_ref[k_sl, :], v_ref[k_sl, :]
    k_seg = meta_ref[0, k_sl]
    k_index = j * block + jnp.arange(block, dtype=jnp.int32)

    def step(t, carry):
        dk, dv = carry
        i = visits_ref[t + 1]
        q_sl = pl.ds(i * block, block)
        q, do = q_ref[q_sl, :], do_ref[q_sl, :]
        lse, delta = lse_ref[q_sl], delta_ref[q_sl]
        mask = _mask(_load_meta(meta_ref, q_sl), i * block + jnp.arange(block, dtype=jnp.int32), k_seg, k_index)
        p = jnp.where(mask, jnp.exp2(_dot(q, k, trans_b=True) * (scale * _LOG2E) - lse[:, None]), 0.0)
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (_dot(do, v, trans_b=True) - delta[:, None])
        return dk + _dot(ds.astype(q.dtype), q, trans_a=True), dv

    zero = jnp.zeros(k.shape, jnp.float32)
    dk, dv = jax.lax.fori_loop(0, visits_ref[0], step, (zero, zero))
    dk_ref[...] = dk * scale
    dv_ref[...] = dv


def _compiler_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _specs(plan: BlockPlan, hq: int, hkv: int, dh: int, visits: str):
    """BlockSpecs over the grid (block index, row b, query head h)."""
    g = hq // hkv
    w = plan.width
    meta = pl.BlockSpec((None, META_FIELDS, w), lambda x, b, h: (b, 0, 0))
    n_other = getattr(plan, visits).shape[2]
    vis = pl.BlockSpec((None, None, n_other), lambda x, b, h: (b, x, 0))
    rows_q = pl.BlockSpec((None, w, None, dh), lambda x, b, h: (b, 0, h, 0))
    rows_kv = pl.BlockSpec((None, w, None, dh), lambda x, b, h: (b, 0, h // g, 0))
    blk_q = pl.BlockSpec((None, plan.block, None, dh), lambda x, b, h: (b, x, h, 0))
    blk_kv = pl.BlockSpec((None, plan.block, None, dh), lambda x, b, h: (b, x, h // g, 0))
    row_stat = pl.BlockSpec((None, None, w), lambda x, b, h: (b, h, 0))
    blk_stat = pl.BlockSpec((None, None, plan.block), lambda x, b, h: (b, h, x))
    return dict(meta=meta, vis=vis, rows_q=rows_q, rows_kv=rows_kv, blk_q=blk_q, blk_kv=blk_kv, row_stat=row_stat,
                blk_stat=blk_stat)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(q, k, v, plan, interpret, num_warps, num_stages):
    return _fused_forward(q, k, v, plan, interpret, num_warps, num_stages)[0]


def _fused_forward(q, k, v, plan: BlockPlan, interpret: bool, num_warps: int, num_stages: int):
    b, w, hq, dh = q.shape
    hkv = k.shape[2]
    nq = w // plan.block
    s = _specs(plan, hq, hkv, dh, "kv_visits")
    kernel = functools.partial(_forward_kernel, block=plan.block, scale=dh**-0.5)
    out, lse = pl.pallas_call(
        kernel, grid=(nq, b, hq),
        in_specs=[s["meta"], s["vis"], s["blk_q"], s["rows_kv"], s["rows_kv"]],
        out_specs=[s["blk_q"], s["blk_stat"]],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, w), jnp.float32)],
        interpret=interpret, compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
        name="turnsight_attention_forward",
    )(plan.meta, plan.kv_visits, q, k, v)
    return out, lse


def _fused_fwd(q, k, v, plan, interpret, num_warps, num_stages):
    out, lse = _fused_forward(q, k, v, plan, interpret, num_warps, num_stages)
    return out, (q, k, v, plan, out, lse)


def _fused_bwd(interpret, num_warps, num_stages, res, dout):
    q, k, v, plan, out, lse = res
    b, w, hq, dh = q.shape
    hkv = k.shape[2]
    n = w // plan.block
    scale = dh**-0.5
    params = None if interpret else _compiler_params(num_warps, num_stages)
    # Σ_d dout·out per query: the softmax gradient's row term, [B, Hq, W] float32
    delta = jnp.einsum("bthd,bthd->bht", dout.astype(jnp.float32), out.astype(jnp.float32))
    dout = dout.astype(q.dtype)
    sq = _specs(plan, hq, hkv, dh, "kv_visits")
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block=plan.block, scale=scale), grid=(n, b, hq),
        in_specs=[sq["meta"], sq["vis"], sq["blk_q"], sq["rows_kv"], sq["rows_kv"], sq["blk_q"], sq["blk_stat"],
                  sq["blk_stat"]],
        out_specs=sq["blk_q"], out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        interpret=interpret, compiler_params=params, name="turnsight_attention_dq",
    )(plan.meta, plan.kv_visits, q, k, v, dout, lse, delta)
    sk = _specs(plan, hq, hkv, dh, "q_visits")
    per_head = jax.ShapeDtypeStruct((b, w, hq, dh), jnp.float32)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, block=plan.block, scale=scale), grid=(n, b, hq),
        in_specs=[sk["meta"], sk["vis"], sk["rows_q"], sk["rows_kv"], sk["rows_kv"], sk["rows_q"], sk["row_stat"],
                  sk["row_stat"]],
        out_specs=[sk["blk_q"], sk["blk_q"]], out_shape=[per_head, per_head],
        interpret=interpret, compiler_params=params, name="turnsight_attention_dkv",
    )(plan.meta, plan.q_visits, q, k, v, dout, lse, delta)
    group = lambda d: d.reshape(b, w, hkv, hq // hkv, dh).sum(axis=3).astype(k.dtype)  # a group's heads share k, v
    zero_plan = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), plan)
    return dq.astype(q.dtype), group(dk), group(dv), zero_plan


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_attention(q, k, v, plan: BlockPlan, *, interpret: bool = False, num_warps: int = 4,
                    num_stages: int = 2) -> jax.Array:
    """Attention of a (packed) sequence with itself under the plan's layout, as
    `models.attention.layout_attention` computes it: q [B, T, Hq, Dh]; k, v [B, T, Hkv, Dh];
    plan from `block_plan(layout, block)`. Returns [B, T, Hq, Dh] in q's dtype (a query that
    reads nothing: zeros). Differentiable in q, k, v (the kernel's own backward pass)."""
    b, t, hq, dh = q.shape
    hkv = k.shape[2]
    if dh & (dh - 1):
        raise ValueError(f"fused attention needs a power-of-two head_dim (Triton tiles), got {dh}")
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of key/value heads {hkv}")
    if plan.meta.shape[0] != b or plan.width < t:
        raise ValueError(f"block plan for [B={plan.meta.shape[0]}, width {plan.width}] does not fit q [B={b}, T={t}]")
    widen = lambda a: jnp.pad(a, ((0, 0), (0, plan.width - t), (0, 0), (0, 0)))
    out = _fused(widen(q), widen(k), widen(v), plan, interpret, num_warps, num_stages)
    return out[:, :t]


def fused_attention_fn(plan: BlockPlan, *, interpret: bool = False):
    """(q, k, v) -> fused_attention(q, k, v, plan): on a mesh (`jax.set_mesh` with the model's
    axes) inside a `shard_map`, each device running the kernel on its own rows and heads (a
    Pallas call is opaque to the partitioner, which would otherwise gather its operands); a
    plain call otherwise."""
    def attend(q, k, v):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty or not set(AXES) <= set(mesh.axis_names) or mesh.size == 1:
            return fused_attention(q, k, v, plan, interpret=interpret)
        heads = ACTIVATION_SPECS["heads"]
        q_spec, kv_spec = fit_spec(heads, q.shape, mesh), fit_spec(heads, k.shape, mesh)
        if q_spec[2] != kv_spec[2]:  # query heads split but not key/value heads: keep groups whole
            q_spec = kv_spec = P(q_spec[0], None, None, None)
        rows = P(q_spec[0])
        fn = lambda q, k, v, plan: fused_attention(q, k, v, plan, interpret=interpret)
        # check_vma off: a Pallas call's outputs carry no record of the axes they vary over
        return jax.shard_map(fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, rows), out_specs=q_spec,
                             check_vma=False)(q, k, v, plan)

    return attend
