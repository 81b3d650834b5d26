"""Attention that skips its query chunks of padding (model.attn_row_group, models.attention):
the same values and gradients as the kernel that scores every chunk, only the chunks holding a
live query run, and the FLOP counter counts exactly those."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import pytest
from flax import nnx

from turnsight_jax import flops
from turnsight_jax.models.attention import NO_SEGMENT, PAD_SEGMENT, Layout, chunked_attention, layout_attention, packed_mask
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import RuntimeOptions, init_model
from turnsight_jax.models.sharding import make_mesh
from turnsight_jax.rl.batch import make_train_batch
from turnsight_jax.rl.logprobs import teacher_logprobs
from turnsight_jax.rl.methods import resolve_method

from _vocab import fold_batch
from test_rl_step import CFG, _cfg, setup  # noqa: F401  (the module fixture: trajectories, policy, reference)

T, CHUNK = 40, 8  # 5 query chunks in the kernel's 4 causal groups


def _plain(lengths, t=T) -> Layout:
    return Layout.causal(jnp.asarray(np.arange(t)[None, :] < np.asarray(lengths)[:, None]))


def _packed(rows) -> Layout:
    """Packed rows: each row a list of (segment length, ctx1 (segment, end) or None); a segment's
    tokens read themselves causally and their context segment up to its end, as the hindsight
    views do. Padding after the last segment."""
    fields = {k: np.full((len(rows), T), v, np.int32) for k, v in
              (("segment_ids", PAD_SEGMENT), ("ctx1_segment", NO_SEGMENT), ("ctx1_end", 0),
               ("ctx2_segment", NO_SEGMENT), ("ctx2_end", 0))}
    positions = np.zeros((len(rows), T), np.int32)
    for r, segs in enumerate(rows):
        at = 0
        for s, (n, ctx) in enumerate(segs):
            fields["segment_ids"][r, at:at + n] = s
            positions[r, at:at + n] = np.arange(n)
            if ctx is not None:
                fields["ctx1_segment"][r, at:at + n], fields["ctx1_end"][r, at:at + n] = ctx
            at += n
    return Layout(positions=jnp.asarray(positions), **{k: jnp.asarray(v) for k, v in fields.items()})


LAYOUTS = {
    # short rows beside long ones, a row of padding only, rows ending inside and at a chunk's edge
    "plain": lambda: _plain([40, 9, 0, 16, 33, 8]),
    # several segments per row, block segments reading segment 0 up to a turn's end
    "packed": lambda: _packed([[(12, None), (6, (0, 7)), (5, (0, 12))], [(7, None)], [(20, None), (9, (0, 15))],
                               [(3, None), (2, (0, 3))], [], [(30, None), (10, (0, 30))]]),
}


def _qkv(b, t=T, hq=4, hkv=2, dh=8):
    ks = jax.random.split(jax.random.key(3), 3)
    return (jax.random.normal(ks[0], (b, t, hq, dh)), jax.random.normal(ks[1], (b, t, hkv, dh)),
            jax.random.normal(ks[2], (b, t, hkv, dh)))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("row_group", [1, 4, 6])  # 4: groups of gcd(6, 4) = 2 rows; 6: the whole batch
def test_skipping_gives_the_values_and_gradients_of_the_full_kernel(layout, row_group):
    lay = LAYOUTS[layout]()
    q, k, v = _qkv(lay.segment_ids.shape[0])
    w = jax.random.normal(jax.random.key(7), q.shape)

    def loss(q, k, v, group):
        return jnp.sum(layout_attention(q, k, v, lay, q_chunk=CHUNK, row_group=group) * w)

    full = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    (want, want_g), (got, got_g) = full(q, k, v, 0), full(q, k, v, row_group)
    np.testing.assert_allclose(got, want, rtol=1e-5)  # a sum of ~2,000 terms of both signs
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    attend = jax.jit(lambda q, k, v, group: layout_attention(q, k, v, lay, q_chunk=CHUNK, row_group=group),
                     static_argnums=3)
    out, ref = np.asarray(attend(q, k, v, row_group)), np.asarray(attend(q, k, v, 0))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    dead = ~flops.reads_any(jax.tree.map(np.asarray, lay))
    assert dead.any() and np.all(out[dead] == 0.0)  # a query that reads nothing is exactly zero, skipped or not


def _reporting_attention(lay: Layout, row_group: int):
    """(attend(q, k, v), ran): chunked_attention over `lay` whose mask function reports each
    [rows, queries, keys] mask it builds into `ran` (from inside the chunk's `lax.cond` branch when the
    rows are grouped)."""
    from turnsight_jax.models.attention import reads_any

    ran = []

    def mask_fn(meta, q_index, k_index, kv_seg):
        mask = packed_mask(meta, kv_seg, q_index, k_index)
        jax.debug.callback(lambda shape=mask.shape: ran.append(shape))
        return mask

    def attend(q, k, v):
        return chunked_attention(q, k, v, lay, mask_fn, q_chunk=CHUNK, causal_bound=True,
                                 kv_meta=lay.segment_ids, live_fn=reads_any, row_group=row_group)

    return attend, ran


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("row_group", [0, 1, 2, 3])
def test_only_chunks_with_a_live_query_run_and_the_counter_counts_them(layout, row_group):
    """Every chunk the kernel runs reports its [rows, queries, keys] mask shape from inside the
    `lax.cond` branch; what ran is exactly the (row group, chunk) cells holding a live query, and
    its pairs are what turnsight_jax.flops counts for the call."""
    lay = LAYOUTS[layout]()
    b = lay.segment_ids.shape[0]
    q, k, v = _qkv(b)
    attend, ran = _reporting_attention(lay, row_group)
    jax.block_until_ready(jax.jit(attend)(q, k, v))
    live = flops.reads_any(jax.tree.map(np.asarray, lay))
    pairs = sum(rows * queries * keys for rows, queries, keys in ran)
    assert pairs == flops.skipping_pairs(live, CHUNK, row_group)
    if row_group == 0:
        assert pairs == b * flops.chunked_pairs(T, CHUNK)  # nothing skipped
    else:
        r = np.gcd(b, row_group)
        cells = [(g, c) for g in range(b // r) for c in range(T // CHUNK)
                 if live[g * r:(g + 1) * r, c * CHUNK:(c + 1) * CHUNK].any()]
        assert len(ran) == len(cells)
        if row_group == 1:  # one row per group: every row shorter than 33 tokens skips a chunk here
            assert len(cells) < b * (T // CHUNK) and pairs < b * flops.chunked_pairs(T, CHUNK)


def test_the_model_with_row_groups_equals_the_model_without():
    """Qwen3.hidden_states(skip_padding=True) (2 layers) and the gradient of every parameter, on
    padded rows, with row groups and with row groups and key blocks (model.attn_key_block);
    without skip_padding the options leave the forward's program as it was."""
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    lengths = [40, 11, 25, 3, 40, 17, 8, 30]
    lay = _plain(lengths)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (len(lengths), T)), jnp.int32)
    grads = {}
    for group, block in ((0, 0), (4, 0), (4, 8)):
        model = init_model(cfg, seed=1, options=RuntimeOptions(attn_q_chunk=CHUNK, attn_row_group=group,
                                                               attn_key_block=block))
        graphdef, params = nnx.split(model)

        def loss(p, graphdef=graphdef, skip=True):
            h = nnx.merge(graphdef, p).hidden_states(tokens, lay, skip_padding=skip)
            return jnp.sum(jnp.where(lay.segment_ids[..., None] >= 0, jnp.sin(h), 0.0))

        grads[group, block] = jax.jit(jax.value_and_grad(loss))(params)
        unasked = jax.jit(lambda p: loss(p, skip=False)).lower(params).as_text()
        assert "stablehlo.case" not in unasked  # no lax.cond: the unskipped kernel
        assert ("stablehlo.case" in jax.jit(loss).lower(params).as_text()) is (group > 0)
    want, want_g = grads[0, 0]
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want_g))
    for (group, block), (value, g) in grads.items():
        np.testing.assert_allclose(value, want, rtol=1e-6)
        # sums over rows in another order; with key blocks over keys too (1e-6 of the largest)
        atol = 1e-6 * scale  # float32 rounding of the summed terms: a fixed 1e-5 held on one CPU, not on
        # another (2.9e-5 on one element among gradients of ~250)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)


def test_the_trainer_turns_row_groups_off_on_sharded_rows():
    from turnsight_jax.train import fit_row_group

    cfg = mlc.ConfigDict({"model": {"attn_row_group": 4}})
    assert fit_row_group(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1])) is None
    assert cfg.model.attn_row_group == 4
    note = fit_row_group(cfg, make_mesh(1, len(jax.devices()), 1))
    assert cfg.model.attn_row_group == 0 and "shards the rows 8 ways" in note


def test_the_counter_counts_fewer_pairs_only_where_chunks_are_padding():
    """update_flops's attention pairs with row groups, for rows at one width: equal to the
    unskipped count when every group reaches the last chunk, fewer when a group stops early."""
    even = np.arange(T)[None, :] < np.array([36, 34, 40, 33])[:, None]  # every row reaches chunk 4
    short = np.arange(T)[None, :] < np.array([36, 34, 10, 12])[:, None]  # rows 2-3 end in chunk 1
    widths = np.full(4, T)
    full = 4 * flops.chunked_pairs(T, CHUNK)
    assert flops.attention_pairs_executed(even, widths, CHUNK, row_group=2) == full
    # 5 chunks in 4 causal groups score keys up to 8, 16, 32, 32, 40: rows 2-3 skip chunks 2, 3
    # and 4, 8 queries each
    saved = 2 * CHUNK * (32 + 32 + 40)
    assert flops.attention_pairs_executed(short, widths, CHUNK, row_group=2) == full - saved
    assert flops.attention_pairs_executed(short, widths, CHUNK, row_group=0) == full


@pytest.mark.parametrize("layout", ["plain", "classes", "packed"])
def test_teacher_logprobs_with_row_groups_equal_those_without(setup, tok, layout):  # noqa: F811
    """The teacher's views (rl.logprobs.teacher_logprobs, the forward that skips padding) on real
    packed hindsight rows: the same log-probs, and the counter's executed teacher pairs fall."""
    trajs, row_tasks, _, _ = setup
    extra = {"plain": {}, "classes": {"length_classes": 2}, "packed": {"pack_rows": True}}[layout]
    cfg = dataclasses.replace(_cfg(method="turnsight"), **extra)
    batch, stats = make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg))
    batch = fold_batch(batch)
    views = jax.tree.map(jnp.asarray, batch.views)
    got = {}
    for group in (0, 2):
        model = init_model(CFG, seed=1, options=RuntimeOptions(attn_q_chunk=16, attn_row_group=group))
        graphdef, params = nnx.split(model)
        got[group] = np.asarray(jax.jit(lambda p, v, g=graphdef: teacher_logprobs(nnx.merge(g, p), v, chunk=64))(
            params, views))
    np.testing.assert_allclose(got[2], got[0], rtol=1e-5, atol=1e-5)
    counted = {g: flops.update_flops(CFG, batch, updates=1, q_chunk=16, remat=False, row_group=g).parts["teacher"]
               for g in (0, 2)}
    assert counted[2][0] == counted[0][0] and counted[2][1] < counted[0][1]



def test_rows_within_one_chunk_skip_whole_groups_of_padding():
    """Rows no wider than one query chunk (one chunk per group): a group of padding rows is
    skipped whole, the values and gradients are the unskipped kernel's."""
    lay = _plain([8, 3, 0, 0, 5, 1], t=8)
    q, k, v = _qkv(6, t=8)

    def loss(q, k, v, group):
        return jnp.sum(layout_attention(q, k, v, lay, q_chunk=16, row_group=group) ** 2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    (want, want_g), (got, got_g) = grad(q, k, v, 0), grad(q, k, v, 2)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(got_g, want_g):
        # a query that sees one key has dq = 0 exactly (a softmax over one score); both kernels
        # give float noise there, ~1e-6 against gradients up to ~20 (an AMD EPYC box gave 1.5e-6
        # and 3.0e-6): the absolute tolerance scales with the gradient's magnitude
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))
    live = flops.reads_any(jax.tree.map(np.asarray, lay))
    assert flops.skipping_pairs(live, 16, 2) == 4 * 8 * 8  # rows 2-3 (a group of padding) are skipped


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("row_group", [1, 2, 3])
def test_the_backward_pass_runs_the_forwards_cells_only(layout, row_group):
    """Under a gradient the skipping kernel's own backward pass (models.attention
    `_skipping_attention`) builds each cell's mask once more: every (row group, chunk) with a
    live query, none other, so the work is the counter's pairs twice (one mask per pass)."""
    lay = LAYOUTS[layout]()
    b = lay.segment_ids.shape[0]
    q, k, v = _qkv(b)
    attend, ran = _reporting_attention(lay, row_group)
    jax.block_until_ready(jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a) ** 2), argnums=(0, 1, 2)))(q, k, v))
    live = flops.reads_any(jax.tree.map(np.asarray, lay))
    r = np.gcd(b, row_group)
    cells = sum(bool(live[g * r:(g + 1) * r, c * CHUNK:(c + 1) * CHUNK].any())
                for g in range(b // r) for c in range(T // CHUNK))
    assert len(ran) == 2 * cells
    if row_group == 1:  # one row per group: rows shorter than 33 tokens skip a chunk in both passes
        assert cells < b * (T // CHUNK)
    assert sum(rows * queries * keys for rows, queries, keys in ran) == 2 * flops.skipping_pairs(live, CHUNK, row_group)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_skipping_backward_in_bf16_is_as_close_as_autodiff(layout):
    """bf16 operands (float32 scores and sums): the skipping kernel's gradients are as close to the
    float32 gradients as the autodiff kernel's own bf16 gradients are (within a factor 2)."""
    lay = LAYOUTS[layout]()
    q, k, v = _qkv(lay.segment_ids.shape[0])
    w = jax.random.normal(jax.random.key(7), q.shape)

    def loss(q, k, v, group):
        out = layout_attention(q, k, v, lay, q_chunk=CHUNK, row_group=group)
        return jnp.sum(out.astype(jnp.float32) * w)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    exact = grad(q, k, v, 0)
    half = [a.astype(jnp.bfloat16) for a in (q, k, v)]
    for got, plain, want in zip(grad(*half, 4), grad(*half, 0), exact):
        assert got.dtype == jnp.bfloat16
        err, ref_err = (float(jnp.max(jnp.abs(a.astype(jnp.float32) - want))) for a in (got, plain))
        scale = float(jnp.max(jnp.abs(want)))
        assert err <= 2 * ref_err + 1e-3 * scale and err < 2e-2 * scale


@pytest.mark.parametrize("layout", ["plain", "classes", "packed"])
def test_the_fused_step_with_row_groups_equals_the_step_without(setup, tok, layout):  # noqa: F811
    """The RL step's student forwards skip their padding too (rl.logprobs.policy_logprobs): one
    TurnSight step with SGD(1) (the update is minus the gradient, KL reference on the student's
    context) on real rows, plain, in 2 length classes and packed: the same gradients and loss,
    and the counter's executed student FLOPs fall with its necessary ones unchanged."""
    from test_rl_step import _batch, _max_diff, _sgd_step, _with_options

    trajs, row_tasks, policy, ref = setup
    extra = {"plain": {}, "classes": {"length_classes": 2}, "packed": {"pack_rows": True}}[layout]
    cfg = dataclasses.replace(_cfg(method="turnsight"), **extra)
    batch = _batch(trajs, row_tasks, tok, cfg)
    out = {}
    # row groups of 2, and (packed rows) row groups with key blocks of 16 (model.attn_key_block)
    for group, block in ((0, 0), (2, 0)) + (((2, 16),) if layout == "packed" else ()):
        pol = nnx.merge(*_with_options(policy, attn_q_chunk=16, attn_row_group=group, attn_key_block=block))
        rf = nnx.merge(*_with_options(ref, attn_q_chunk=16, attn_row_group=group, attn_key_block=block))
        out[group, block] = _sgd_step(cfg, pol, rf, batch)
    g0, m0 = out[0, 0]
    scale = max(jax.tree.leaves(jax.tree.map(lambda x: float(np.abs(np.asarray(x)).max()), g0)))
    assert scale > 1e-4
    for key, (g, m) in out.items():
        assert _max_diff(g0, g) < 1e-5 * max(1.0, scale), key
        assert abs(float(m0["pg_loss"]) - float(m["pg_loss"])) < 1e-6, key
    nb = jax.tree.map(np.asarray, batch)
    counted = {g: flops.update_flops(CFG, nb, updates=1, q_chunk=16, remat=False, ref_forward=True,
                                     row_group=g).parts for g in (0, 2)}
    for part in ("student", "student_forward"):
        assert counted[2][part][0] == counted[0][part][0] and counted[2][part][1] < counted[0][part][1]


@pytest.mark.parametrize("layout", ["plain", "packed"])
def test_the_critics_trunk_with_row_groups_equals_the_trunk_without(setup, tok, layout):  # noqa: F811
    """methods.critic.hidden_at (the critic's values under a gradient, the PRM's features) skips the
    padding too: the hidden states at the policy positions and the trunk's gradient are the
    same with and without row groups."""
    from turnsight_jax.methods.critic import hidden_at
    from turnsight_jax.rl.logprobs import predictor_positions
    from test_rl_step import _batch, _max_diff, _with_options

    trajs, row_tasks, policy, _ = setup
    cfg = dataclasses.replace(_cfg(method="turnsight"), **({"pack_rows": True} if layout == "packed" else {}))
    batch = jax.tree.map(jnp.asarray, _batch(trajs, row_tasks, tok, cfg))
    pos = predictor_positions(batch.valid, batch.pol_pos)
    out = {}
    for group in (0, 2):
        graphdef, params = _with_options(policy, attn_q_chunk=16, attn_row_group=group)

        def loss(p, graphdef=graphdef):
            h = hidden_at(nnx.merge(graphdef, p), batch, pos)
            return jnp.sum(jnp.where(batch.pol_valid[..., None], jnp.sin(h), 0.0)), h

        out[group] = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    ((_, h0), g0), ((_, h2), g2) = out[0], out[2]
    used = np.asarray(batch.pol_valid)
    np.testing.assert_allclose(np.asarray(h2)[used], np.asarray(h0)[used], rtol=1e-5, atol=1e-5)
    scale = max(jax.tree.leaves(jax.tree.map(lambda x: float(np.abs(np.asarray(x)).max()), g0)))
    assert scale > 1.0 and _max_diff(g0, g2) < 1e-5 * scale  # sums over ~3,000 tokens
