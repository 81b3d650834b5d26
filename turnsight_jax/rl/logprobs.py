"""Log-probs of policy tokens: the student on its own context, the frozen teacher on the packed
hindsight views, both through a chunked log-softmax that never forms a [B, T, V] float32 array.

For each chunk of rows the logits [C, V] are formed in float32, reduced by log-sum-exp and
gathered at the target, inside a rematerialised `lax.scan` body: the peak extra memory is one
[C, V] float32 block in the forward and in the backward pass, whatever B * T is. With
`model.vocab_block = W` the block is [C, W]: the vocabulary's columns in a scan of their own,
reduced by an online log-sum-exp (a CPU's cache holds [C, W], never [C, V]).

On a mesh (`jax.set_mesh` with the axes of models.sharding) the projection runs per device
(`shard_map`): each device gathers the head weight's `fsdp` shards once, runs the chunk loop over
its *own* rows, and the backward pass reduce-scatters the head gradient once. Left to the
partitioner, the chunk loop over batch-sharded rows replicated the rows, sharded the contraction
and all-reduced every chunk's [C, V] float32 logits (and, with the weight gathered outside the
loop, the [D, V] head gradient once per chunk). With a `tensor` axis the vocabulary stays split
over it and the log-softmax is distributed: per row, a max, a sum of exponentials and the target
logit cross devices, [C] values, never [C, V].
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from turnsight_jax.models.attention import Layout
from turnsight_jax.models.qwen3 import Qwen3
from turnsight_jax.models.sharding import AXES, BATCH, fit_spec
from turnsight_jax.rl.length_classes import run_by_class
from turnsight_jax.rl.packing import PackedRows, packed_index
from turnsight_jax.rl.views import PackedViews, distinct_slots_used


def _scan_rows(rows, skipped, args, *, chunk: int, used, remat: bool = True):
    """rows(*chunk_args) over chunks of `chunk` rows of `args` (each [N, ...]), in a lax.scan
    (rematerialised unless `remat` is False: rows then keeps its own small residuals); with `used`
    [N] bool the used rows go first and a chunk holding none runs `skipped` (the same output
    structure) instead. Returns rows' outputs [N, ...] in the rows' own order, 0 on unused rows."""
    n = args[0].shape[0]
    if n <= chunk:
        out = rows(*args)
        return out if used is None else jax.tree.map(lambda o: _zero_unused(o, used), out)
    num = -(-n // chunk)
    pad = num * chunk - n
    if used is not None:
        order = jnp.argsort(~used, stable=True)  # used rows first, each part in its own order
        args = tuple(a[order] for a in args)
    xs = tuple(jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)).reshape(num, chunk, *a.shape[1:]) for a in args)

    def body(_, x):
        if used is None:
            return None, rows(*x)
        *chunk_args, live = x
        return None, jax.lax.cond(live, rows, skipped, *chunk_args)

    if remat:
        body = jax.checkpoint(body)

    if used is not None:
        xs = xs + (jnp.arange(num) * chunk < jnp.sum(used),)
    _, out = jax.lax.scan(body, None, xs)
    out = jax.tree.map(lambda o: o.reshape(num * chunk, *o.shape[2:])[:n], out)
    if used is None:
        return out
    back = jnp.argsort(order)
    return jax.tree.map(lambda o: _zero_unused(o[back], used), out)


def _zero_unused(o, used):
    return jnp.where(used.reshape(used.shape + (1,) * (o.ndim - 1)), o, jnp.zeros((), o.dtype))


def _zeros_like_rows(t_chunk, shape, dtype):
    """Zeros [C, *shape] that vary like the computed branch under shard_map (derived from a
    chunk input, not a constant)."""
    z = (t_chunk * 0).astype(dtype)
    return z.reshape(z.shape + (1,) * len(shape)) + jnp.zeros((1,) + tuple(shape), dtype)


# the carry's starting max: exp(NEG - max) is 0 and NEG * 0 is 0 (with -inf, -inf - -inf is a NaN)
NEG = -1e30


def _pick(logits, ids, first):
    """logits [C, W] of the global ids first .. first + W at ids [C] or [C, J]; 0 where an id is
    outside those columns."""
    local = ids - first
    here = (local >= 0) & (local < logits.shape[1])
    flat = local.reshape(local.shape[0], -1)
    got = jnp.take_along_axis(logits, jnp.clip(flat, 0, logits.shape[1] - 1), axis=-1).reshape(local.shape)
    return jnp.where(here, got, 0.0)


def _block_stats(h, w, first, targets, extra, *, inv_t: float, with_entropy: bool):
    """Softmax statistics of the logits l = h @ w / T over one block of columns (global ids
    first .. first + w.shape[1]): (m = max l [C] without gradient, Σ exp(l - m) [C],
    Σ exp(l - m)·l [C] or None, l at each target [C] and at each extra target [C, J] or None, 0
    where the id is outside the block). h [C, D], w [D, W]; float32 statistics."""
    logits = jnp.einsum("nd,dv->nv", h, w, preferred_element_type=jnp.float32) * inv_t
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    e = jnp.exp(logits - m[:, None])
    return (m, jnp.sum(e, axis=-1), jnp.sum(e * logits, axis=-1) if with_entropy else None,
            _pick(logits, targets, first), None if extra is None else _pick(logits, extra, first))


def _merge_stats(a, b):
    """The statistics of two disjoint column blocks -> those of their union (the online
    log-sum-exp: each sum rescaled to the larger max)."""
    m = jnp.maximum(a[0], b[0])
    ra, rb = jnp.exp(a[0] - m), jnp.exp(b[0] - m)
    return (m, a[1] * ra + b[1] * rb, None if a[2] is None else a[2] * ra + b[2] * rb, a[3] + b[3],
            None if a[4] is None else a[4] + b[4])


def _vocab_blocks(w, block: int):
    """w [D, V] -> (blocks [V // block, D, block], the remaining columns [D, V % block] or None);
    None when one block holds every column (block 0 or >= V)."""
    v = w.shape[1]
    if not block or block >= v:
        return None
    nb = v // block
    blocks = w[:, :nb * block].reshape(w.shape[0], nb, block).transpose(1, 0, 2)
    return blocks, (w[:, nb * block:] if nb * block < v else None)


def _vocab_stats(h, w, blocks, first, targets, extra, *, block: int, inv_t: float, with_entropy: bool):
    """_block_stats over all of w's columns: at once (blocks None), else block by block
    (_vocab_blocks) in a scan whose body is rematerialised, so the backward pass recomputes each
    [C, block] logits block rather than keeping [C, V]; the remaining V % block columns after it.
    The carry starts from constants, not from a peeled first block (one copy of the block's code
    fewer to compile in every step program)."""
    stats = functools.partial(_block_stats, inv_t=inv_t, with_entropy=with_entropy)
    if blocks is None:
        return stats(h, w, first, targets, extra)
    full, rest = blocks
    # zeros [C] that vary (under shard_map) like the body's outputs: over the rows' axes and the
    # vocabulary's (through the weight blocks and the shard's first id); no gradient
    zero = jax.lax.stop_gradient(h[:, 0].astype(jnp.float32) * 0 + jnp.sum(full[0, 0, :1]).astype(jnp.float32) * 0
                                 + first * 0)
    init = (zero + NEG, zero, zero if with_entropy else None, zero,
            None if extra is None else zero[:, None] + jnp.zeros(extra.shape[1:], jnp.float32))

    @jax.checkpoint
    def body(acc, x):
        wb, j = x
        return _merge_stats(acc, stats(h, wb, first + j * block, targets, extra)), None

    acc, _ = jax.lax.scan(body, init, (full, jnp.arange(full.shape[0])))
    if rest is not None:
        acc = _merge_stats(acc, stats(h, rest, first + full.shape[0] * block, targets, extra))
    return acc


def chunked_logprobs(
    hidden: jax.Array,
    targets: jax.Array,
    weight: jax.Array,
    *,
    chunk: int = 1024,
    temperature: float = 1.0,
    with_entropy: bool = False,
    vocab_axis: str | None = None,
    used: jax.Array | None = None,
    extra_targets: jax.Array | None = None,
    vocab_block: int = 0,
):
    """log softmax(hidden @ weight / temperature)[target] per row.

    hidden [N, D] (any float dtype); targets [N] int32; weight [D, V]. Returns [N] float32, or a
    tuple (log-probs [N], entropy [N] with `with_entropy`, extra [N, J] with `extra_targets`) in
    that order: the entropy -Σ_v p_v log p_v of each row's tempered distribution, and the
    log-probs of extra_targets [N, J] int32 (e.g. a teacher's top-K ids) under the same
    log-softmax, all from the same logits and differentiable like the log-probs.

    vocab_axis: inside a `shard_map`, the mesh axis the vocabulary is split over; `weight` is then
    this device's [D, V / n] columns (device i holds ids [i·V/n, (i+1)·V/n)) and the max, the sum
    of exponentials and the target logits of each row are combined over that axis.

    used [N] bool: the rows whose values are read (the others come back 0). The used rows are
    moved to the front, and a chunk holding none is skipped (`lax.cond`), so the projection runs
    on ceil(used / chunk) chunks, not on every padding slot of a [B, N] layout.

    vocab_block W > 0: each chunk's logits are formed W columns at a time and reduced by an online
    log-sum-exp, so the largest float32 block is [chunk, W], not [chunk, V]. On a CPU a
    [chunk, V] block is far larger than the cache and every pass over it (max, exponentials,
    their gradient) goes to memory; the [C, W] block stays in cache (BENCHMARKS.md). The same
    matmuls run either way; values agree to float rounding.
    """
    inv_t = 1.0 / float(temperature)
    w = weight.astype(hidden.dtype)
    first_id = 0 if vocab_axis is None else jax.lax.axis_index(vocab_axis) * w.shape[1]
    with_extra = extra_targets is not None
    blocks = _vocab_blocks(w, vocab_block)  # sliced once, outside the chunk loop

    def rows(h, t, *e):
        m, s, u, tl, xl = _vocab_stats(h, w, blocks, first_id, t, e[0] if with_extra else None, block=vocab_block,
                                       inv_t=inv_t, with_entropy=with_entropy)
        if vocab_axis is not None:  # [C] values cross devices, never [C, V]
            top = jax.lax.pmax(m, vocab_axis)
            r = jnp.exp(m - top)
            s, m = jax.lax.psum(s * r, vocab_axis), top
            u = None if u is None else jax.lax.psum(u * r, vocab_axis)
            tl = jax.lax.psum(tl, vocab_axis)
            xl = None if xl is None else jax.lax.psum(xl, vocab_axis)
        lse = m + jnp.log(s)
        out = [tl - lse]
        if with_entropy:  # H = lse - Σ p·logits, p = exp(l - m) / s
            out.append(lse - u / s)
        if with_extra:
            out.append(xl - lse[:, None])
        return out[0] if len(out) == 1 else tuple(out)

    def skipped(_h, t, *e):
        out = [_zeros_like_rows(t, (), jnp.float32)]
        if with_entropy:
            out.append(_zeros_like_rows(t, (), jnp.float32))
        if with_extra:
            out.append(_zeros_like_rows(t, e[0].shape[1:], jnp.float32))
        return out[0] if len(out) == 1 else tuple(out)

    args = (hidden, targets) + ((extra_targets,) if with_extra else ())
    # with vocabulary blocks the chunk keeps only [C]-sized residuals (its block scan is
    # rematerialised): rematerialising the chunk too would run its projection a fifth time
    return _scan_rows(rows, skipped, args, chunk=chunk, used=used, remat=blocks is None)


def chunked_topk(hidden: jax.Array, weight: jax.Array, k: int, *, chunk: int = 1024, temperature: float = 1.0,
                 vocab_axis: str | None = None, used: jax.Array | None = None):
    """The k most likely tokens of each row's tempered distribution softmax(hidden @ weight / T):
    (ids [N, k] int32, log-probs [N, k] float32), descending, without gradient; lax.top_k's order
    among equal logits (the lower id first). Chunked like chunked_logprobs (no [N, V] array;
    unused rows skipped and 0). With vocab_axis each shard takes its local top k, then the [C, k]
    candidates of every shard (values and global ids, [C, k·n]) are combined and the top k of
    those kept: never a [C, V] array across devices."""
    inv_t = 1.0 / float(temperature)
    w = jax.lax.stop_gradient(weight).astype(hidden.dtype)
    first_id = 0 if vocab_axis is None else jax.lax.axis_index(vocab_axis) * w.shape[1]
    if k > w.shape[1]:
        raise ValueError(f"top_k={k} exceeds the vocabulary ({w.shape[1]} ids per shard)")

    def rows(h, t):
        logits = jnp.einsum("nd,dv->nv", jax.lax.stop_gradient(h), w, preferred_element_type=jnp.float32) * inv_t
        top = jnp.max(logits, axis=-1)
        if vocab_axis is not None:
            top = jax.lax.pmax(top, vocab_axis)
        lse = jnp.log(jnp.sum(jnp.exp(logits - top[:, None]), axis=-1))
        vals, idx = jax.lax.top_k(logits, k)
        ids = idx.astype(jnp.int32) + first_id
        if vocab_axis is not None:
            lse = jnp.log(jax.lax.psum(jnp.exp(lse), vocab_axis))
            vals, ids = gather_candidates(vals), gather_candidates(ids)  # [C, n·k]
            vals, pos = jax.lax.top_k(vals, k)
            ids = jnp.take_along_axis(ids, pos, axis=1)
        return ids, vals - (top + lse)[:, None]

    def gather_candidates(x):
        """[C, k] per shard -> [C, n·k], every shard's block at its index. A psum of one-hot
        placed blocks rather than an all_gather: the result is the same on every shard and typed
        so (shard_map's replication check), as the log-probs' psums are."""
        n = jax.lax.axis_size(vocab_axis)
        here = (jnp.arange(n) == jax.lax.axis_index(vocab_axis)).astype(x.dtype)
        return jax.lax.psum(here[None, :, None] * x[:, None, :], vocab_axis).reshape(x.shape[0], n * k)

    def skipped(_h, t):
        return _zeros_like_rows(t, (k,), jnp.int32), _zeros_like_rows(t, (k,), jnp.float32)

    dummy = (hidden[:, 0] * 0).astype(jnp.int32)  # varies like the rows under shard_map
    return jax.tree.map(jax.lax.stop_gradient, _scan_rows(rows, skipped, (hidden, dummy), chunk=chunk, used=used))


def gather_rows(hidden: jax.Array, index: jax.Array) -> jax.Array:
    """hidden [B, P, D], index [B, N] int32 -> [B, N, D] (per-row gather; shards along B)."""
    return jnp.take_along_axis(hidden, index[..., None], axis=1)


def _varying(x) -> frozenset:
    """The mesh axes a value inside `shard_map` varies over (JAX's manual-axis type)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # the attribute's name before JAX 0.10
    return frozenset(vma if vma is not None else aval.manual_axis_type.varying)


def _active_mesh():
    """The mesh set with `jax.set_mesh`, when it has this package's axes and more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(AXES) <= set(mesh.axis_names) or math.prod(mesh.axis_sizes) == 1:
        return None
    return mesh


def logprobs_at(model: Qwen3, hidden: jax.Array, pred_index: jax.Array, targets: jax.Array, *,
                chunk: int, temperature: float = 1.0, with_entropy: bool = False, used: jax.Array | None = None,
                extra_targets: jax.Array | None = None, top_k: int = 0):
    """log p(targets[b, n] | hidden[b, pred_index[b, n]]); pred_index, targets [B, N] -> [B, N] f32.
    Options add outputs, in this order (a tuple when any is on): with_entropy, the entropy of
    each predicted distribution [B, N]; extra_targets [B, N, J] int32, their log-probs [B, N, J]
    under the same distribution; top_k = K > 0, the distribution's K most likely tokens
    (ids [B, N, K] int32, log-probs [B, N, K] f32; no gradient). used [B, N] bool: the slots
    read (others come back 0, and chunks of padding are skipped).

    On a mesh, per device (module docstring): no vocabulary-sized array crosses devices."""
    b, n = targets.shape
    weight = model.output_weight()
    kw = dict(chunk=chunk, temperature=temperature)
    vocab_block = model.options.vocab_block
    with_extra = extra_targets is not None

    def compute(rows, tgt, w, u, extra, vocab_axis):
        lb, ln = tgt.shape
        flat = rows.reshape(lb * ln, -1)
        uf = None if u is None else u.reshape(-1)
        out = chunked_logprobs(flat, tgt.reshape(-1), w, with_entropy=with_entropy, vocab_axis=vocab_axis, used=uf,
                               extra_targets=None if extra is None else extra.reshape(lb * ln, -1),
                               vocab_block=vocab_block, **kw)
        out = list(out) if (with_entropy or with_extra) else [out]
        if top_k:
            out.extend(chunked_topk(flat, w, top_k, vocab_axis=vocab_axis, used=uf, **kw))
        out = [o.reshape(lb, ln, *o.shape[1:]) for o in out]
        return out[0] if len(out) == 1 else tuple(out)

    mesh = _active_mesh()
    if mesh is None:
        return compute(gather_rows(hidden, pred_index), targets, weight, used, extra_targets, None)

    row_spec = fit_spec(P(BATCH, None), (b, n), mesh)
    hidden_spec = P(row_spec[0], None, None)
    extra_spec = P(row_spec[0], None, None)
    # the head's own layout ([D, V]: D over fsdp, V over tensor), where the axes divide
    w_spec = fit_spec(P(*(a if mesh.shape[a] > 1 else None for a in ("fsdp", "tensor"))), weight.shape, mesh)
    gather_axis, vocab_axis = w_spec[0], w_spec[1]

    def local(h, idx, tgt, w, u=None, extra=None):
        w = w.astype(h.dtype)  # gather in the compute dtype
        if gather_axis is not None:
            # once; its transpose reduce-scatters. Rows too few to split over the gather axis (the
            # released MatchTIR recipe's micro-batches on 8 devices) are replicated over it: the
            # gathered weight is then typed invariant, so the outputs are replicated as out_specs says
            to = "varying" if gather_axis in _varying(h) else "invarying"
            w = jax.lax.all_gather(w, gather_axis, axis=0, tiled=True, to=to)
        # Mark the weight as varying over the axes the rows vary over, here, outside the chunk
        # loop: left implicit, that cast happens inside each chunk, and its transpose (a psum of
        # the [D, V] gradient) with it.
        missing = tuple(sorted(_varying(h) - _varying(w)))
        if missing:
            w = jax.lax.pcast(w, missing, to="varying")
        return compute(gather_rows(h, idx), tgt, w, u, extra, vocab_axis)

    out_spec = [row_spec] + [row_spec] * with_entropy + [extra_spec] * with_extra + [extra_spec, extra_spec] * bool(top_k)
    out_spec = out_spec[0] if len(out_spec) == 1 else tuple(out_spec)
    args, specs = [hidden, pred_index, targets, weight], [hidden_spec, row_spec, row_spec, w_spec]
    fn = local
    if used is not None or with_extra:
        args.append(used if used is not None else jnp.ones((b, n), bool))
        specs.append(row_spec)
    if with_extra:
        args.append(extra_targets)
        specs.append(extra_spec)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(specs), out_specs=out_spec)(*args)


def packed_logprobs_at(model: Qwen3, hidden: jax.Array, packed: PackedRows, cols: jax.Array, targets: jax.Array, *,
                       chunk: int, temperature: float = 1.0, with_entropy: bool = False,
                       used: jax.Array | None = None, extra_targets: jax.Array | None = None, top_k: int = 0):
    """logprobs_at for items packed into rows (rl.packing): hidden [Rc, W, D] of the call's packed
    rows; cols, targets [Bc, K]: each item's predictor columns in its own coordinates and the
    targets -> [Bc, K] f32 (and logprobs_at's optional outputs). Each shard block's rows are
    flattened and gathered from by the block's items only, so on a mesh the gather stays on the
    device that holds both."""
    s = packed.plan.shards
    bc, k = targets.shape
    flat = packed_index(packed, cols)
    out = logprobs_at(model, hidden.reshape(s, -1, hidden.shape[-1]), flat, targets.reshape(s, -1), chunk=chunk,
                      temperature=temperature, with_entropy=with_entropy,
                      used=None if used is None else used.reshape(s, -1),
                      extra_targets=None if extra_targets is None else extra_targets.reshape(s, bc * k // s, -1),
                      top_k=top_k)
    return jax.tree.map(lambda o: o.reshape(bc, k, *o.shape[2:]), out)


def predictor_positions(valid_mask: jax.Array, pol_pos: jax.Array) -> jax.Array:
    """Index of the token whose hidden state predicts each policy token: the last readable token
    before it. valid_mask [B, T] bool (the tokens the forward reads), pol_pos [B, N] -> [B, N] int32.

    With every token readable this is pol_pos - 1. With observation tokens masked out
    (rl.student_sees_observations=False) the first token of turn k > 0 is predicted by the last
    policy token of turn k - 1, as in the released code, whose forward drops the masked tokens."""
    t = valid_mask.shape[1]
    last_readable = jax.lax.cummax(jnp.where(valid_mask, jnp.arange(t, dtype=jnp.int32)[None], 0), axis=1)
    return jnp.take_along_axis(last_readable, jnp.maximum(pol_pos - 1, 0), axis=1)


def row_layout(valid_mask: jax.Array, layout: Layout | None = None) -> Layout:
    """The layout of the student's rows: `layout` when the batch has one (rl.batch.TrainBatch.layout:
    rows with several contexts, rl.context_rows), else plain causal over valid_mask [B, T]."""
    return Layout.causal(valid_mask) if layout is None else layout


def layout_fields(layout: Layout | None) -> tuple:
    """A layout's [B, T] arrays in field order (() for None): for a per-class cut (run_by_class)."""
    return () if layout is None else tuple(getattr(layout, f.name) for f in dataclasses.fields(Layout))


def student_logprobs(model: Qwen3, tokens: jax.Array, valid_mask: jax.Array, pol_pos: jax.Array, *,
                     chunk: int = 1024, temperature: float = 1.0, with_entropy: bool = False,
                     pol_valid: jax.Array | None = None, extra_targets: jax.Array | None = None,
                     layout: Layout | None = None, skip_padding: bool = False):
    """Student log-probs of its policy tokens. tokens, valid_mask [B, T]; pol_pos [B, N] -> [B, N]
    (with `with_entropy`: (log-probs, token entropies), both [B, N]). pol_valid [B, N]: the real
    slots; padding slots then come back 0 and the head skips chunks of them.

    valid_mask names the tokens the forward reads (rl.batch.TrainBatch.valid); an unreadable token
    is neither attended to nor a predictor. Rotary positions stay the tokens' own indices, so a
    masked span leaves a gap in the positions, as in the released code (docs/spec.md §1.9).
    layout: the rows' own segments (rows holding several contexts, rl.context_rows; every policy
    token's predictor is the token before it there); None: plain causal rows. skip_padding:
    attention skips the rows' query chunks of padding (Qwen3.hidden_states; the same values to
    float rounding)."""
    hidden = model.hidden_states(tokens, row_layout(valid_mask, layout), skip_padding=skip_padding)
    targets = jnp.take_along_axis(tokens, pol_pos, axis=1)
    return logprobs_at(model, hidden, predictor_positions(valid_mask, pol_pos), targets, chunk=chunk,
                       temperature=temperature, with_entropy=with_entropy, used=pol_valid,
                       extra_targets=extra_targets)


def policy_logprobs(model: Qwen3, batch, *, chunk: int = 1024, temperature: float = 1.0,
                    with_entropy: bool = False, extra_targets: jax.Array | None = None):
    """student_logprobs of a TrainBatch's (or a micro-batch's) rows [B, N], each length class
    (rl.length_classes) run at its own width when the batch has them, or several trajectories
    per row when it is packed (rl.packing); the same values every way. extra_targets [B, N, J]:
    also their log-probs [B, N, J] (the last output; logprobs_at).

    The RL step's student forwards (its update, π_old, the reference on the student's context) all
    come here, and attention skips their query chunks of padding per `model.attn_row_group` rows
    (Qwen3.hidden_states(skip_padding=True); its backward pass skips them too)."""
    kw = dict(chunk=chunk, temperature=temperature, with_entropy=with_entropy)
    if batch.packed is not None:  # several trajectories per row (rl.packing)
        pk = batch.packed
        hidden = model.hidden_states(pk.tokens, pk.layout, skip_padding=True)
        targets = jnp.take_along_axis(batch.tokens, batch.pol_pos, axis=1)
        return packed_logprobs_at(model, hidden, pk, predictor_positions(batch.valid, batch.pol_pos), targets,
                                  used=batch.pol_valid, extra_targets=extra_targets, **kw)
    if batch.classes is None:
        return student_logprobs(model, batch.tokens, batch.valid, batch.pol_pos, pol_valid=batch.pol_valid,
                                extra_targets=extra_targets, layout=batch.layout, skip_padding=True, **kw)

    fields = layout_fields(batch.layout)

    def one(_, pos, pv, *rest):
        extra = rest[:len(rest) - 2 - len(fields)]
        tokens, valid, *lay = rest[len(extra):]
        return student_logprobs(model, tokens, valid, pos, pol_valid=pv, extra_targets=extra[0] if extra else None,
                                layout=Layout(*lay) if lay else None, skip_padding=True, **kw)

    per_row = (batch.pol_pos, batch.pol_valid) + (() if extra_targets is None else (extra_targets,))
    return run_by_class(one, batch.classes, batch.length_class, per_row, (batch.tokens, batch.valid, *fields))


def teacher_logprobs(model: Qwen3, views: PackedViews, *, chunk: int = 1024, temperature: float = 1.0,
                     top_k: int = 0):
    """Teacher log-probs of the policy tokens under every view of `views.view_pred` (the
    hindsight depths or the privileged view, then the plain reference row when built
    with_reference): [R, B, N]. With top_k = K > 0 the tuple (log-probs, top-K ids [R, B, N, K]
    int32, top-K log-probs [R, B, N, K]): each predicted distribution's K most likely tokens.

    One forward over the packed rows (per length class, each at its own width, when the views
    have them); the vocabulary projection runs once per distinct (predictor, target) pair and is
    gathered into [R, B, N] float32, outside the gradient. Packed views (views.packed, rl.packing)
    run several trajectories' rows per row."""
    kw = dict(chunk=chunk, temperature=temperature, top_k=top_k)
    if views.packed is not None:
        pk = views.packed
        hidden = model.hidden_states(pk.tokens, pk.layout, skip_padding=True)
        distinct = packed_logprobs_at(model, hidden, pk, views.pred, views.pred_target,
                                      used=distinct_slots_used(views.pred), **kw)
        return _gather_slots(distinct, views.slot)
    if views.classes is None:
        return _teacher_logprobs(model, views.tokens, views.layout, views.pred, views.pred_target, views.slot, **kw)

    def one(_, pred, target, slot, tokens, *layout):
        return _teacher_logprobs(model, tokens, Layout(*layout), pred, target, jnp.moveaxis(slot, 0, 1), **kw)

    lay = views.layout
    return run_by_class(one, views.classes, views.row_class, (views.pred, views.pred_target,
                                                              jnp.moveaxis(views.slot, 1, 0)),
                        (views.tokens, lay.positions, lay.segment_ids, lay.ctx1_segment, lay.ctx1_end,
                         lay.ctx2_segment, lay.ctx2_end), out_axis=1)


def _teacher_logprobs(model, tokens, layout, pred, pred_target, slot, *, chunk, temperature, top_k):
    hidden = model.hidden_states(tokens, layout, skip_padding=True)  # no gradient flows here
    distinct = logprobs_at(model, hidden, pred, pred_target, chunk=chunk, temperature=temperature,
                           used=distinct_slots_used(pred), top_k=top_k)
    return _gather_slots(distinct, slot)


def _gather_slots(distinct, slot):
    """distinct [B, U] log-probs (or a tuple of [B, U, ...] arrays), slot [R, B, N] -> [R, B, N, ...],
    no gradient."""
    def one(d):
        idx = slot.reshape(*slot.shape, *([1] * (d.ndim - 2)))
        return jax.vmap(lambda s: jnp.take_along_axis(d, s, axis=1))(idx)

    return jax.lax.stop_gradient(jax.tree.map(one, distinct))
