"""Row packing (rl.packing): first-fit decreasing fills rows without overflow; rows are reordered
only within their mini-batch, to even the cells; every cell's items land in that cell's own packed rows, found again by `packed_index` after any strided split; a
packed row lets no token read another item; the fused step on packed batches (several
trajectories, and several hindsight rows, per row) equals the step on the plain batch
(micro-/mini-batched, masked context with the KL reference, sharded); the FLOP counter counts
the packed rows; the config refuses what cannot be packed."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax import flops
from turnsight_jax.errors import ConfigError
from turnsight_jax.models.attention import PAD_SEGMENT, Layout
from turnsight_jax.models.sharding import make_mesh
from turnsight_jax.rl import packing as pk
from turnsight_jax.rl.batch import DEFAULT_BUCKETS, make_train_batch, shape_keys
from turnsight_jax.rl.views import pick_bucket
from turnsight_jax.rl.config import LossConfig, StepConfig
from turnsight_jax.rl.methods import resolve_method
from turnsight_jax.rl.micro_batches import split_rows

from test_rl_step import CFG, _cfg, _max_diff, _reference_grads, _sgd_step, setup  # noqa: F401  (the module fixture)
from _vocab import fold_batch


@pytest.mark.parametrize("seed", range(4))
def test_first_fit_decreasing_never_overflows_and_never_overlaps(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 100, 40)
    bins, offset, n = pk.first_fit_decreasing(lengths, 128)
    assert n < len(lengths) and n >= -(-lengths.sum() // 128)  # items shared rows; no fewer than the floor
    for j in range(n):
        idx = np.flatnonzero(bins == j)
        spans = sorted((int(offset[i]), int(offset[i] + lengths[i])) for i in idx)
        assert spans[0][0] == 0 and spans[-1][1] <= 128
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # end to end, no gap, no overlap
    with pytest.raises(ValueError, match="an item of 129 tokens does not fit a packed row of 128"):
        pk.first_fit_decreasing([5, 129], 128)


@pytest.mark.parametrize("seed", range(20))
def test_the_dry_runs_row_bound_holds_for_first_fit_decreasing(seed):
    """rl.batch._worst_rows: FFD of `cell` items of at most `item` tokens never needs more rows."""
    from turnsight_jax.rl.batch import _worst_rows

    rng = np.random.default_rng(seed)
    cell, item = int(rng.integers(1, 40)), int(rng.integers(8, 300))
    width = item + int(rng.integers(0, 4 * item))
    for lengths in (np.full(cell, item), rng.integers(1, item + 1, cell), rng.integers(item // 2, item + 1, cell)):
        assert first_fit_rows(lengths, width) <= _worst_rows(cell, item, width) <= cell


def first_fit_rows(lengths, width):
    return pk.first_fit_decreasing(lengths, width)[2]


def test_rows_bucket_takes_few_values():
    assert [pk.rows_bucket(n, 32) for n in (1, 4, 8, 9, 13, 31, 32)] == [1, 4, 8, 12, 16, 32, 32]
    assert len({pk.rows_bucket(n, 64) for n in range(1, 65)}) <= 16
    assert all(n <= pk.rows_bucket(n, 64) <= 64 for n in range(1, 65))
    assert pk.rows_bucket(3, 3) == 3 and pk.rows_bucket(5, 4) == 4


@pytest.mark.parametrize("shards,modulus,split", [(1, 1, 1), (2, 2, 2), (1, 4, 2), (2, 4, 4)])
def test_packed_index_finds_every_item_after_a_strided_split(shards, modulus, split):
    """Items packed per cell; a strided split of the items and of the packed rows (as the step's
    micro-batches take them) still finds each item's tokens through packed_index."""
    rng = np.random.default_rng(shards * 7 + modulus)
    b = shards * modulus * 5
    lengths = rng.integers(3, 40, b)
    width = 64
    row, offset, plan = pk.plan_packing(lengths, width, shards=shards, modulus=modulus)
    assert plan.rows < plan.cell  # several items per row
    items = [{"tokens": 1000 * i + np.arange(n), "positions": np.arange(n), "segment_ids": np.zeros(n, np.int32)}
             for i, n in enumerate(lengths)]
    tokens, layout = pk.assemble(items, row, offset, plan, width, shards=shards, modulus=modulus)
    assert tokens.shape == (shards * modulus * plan.rows, width)
    packed = pk.PackedRows(jnp.asarray(tokens), layout, jnp.asarray(row), jnp.asarray(offset), plan)
    cols = np.minimum(np.arange(8)[None], lengths[:, None] - 1)  # [B, 8] columns inside each item
    want = 1000 * np.arange(b)[:, None] + cols
    for part in range(split):
        sub = pk.PackedRows(split_rows(packed.tokens, split)[part], None, split_rows(packed.row, split)[part],
                            split_rows(packed.offset, split)[part], plan)
        c = split_rows(jnp.asarray(cols), split)[part]
        flat = pk.packed_index(sub, c)
        got = jnp.take_along_axis(sub.tokens.reshape(shards, -1), flat, axis=1).reshape(c.shape)
        np.testing.assert_array_equal(got, want[part::split])


@pytest.mark.parametrize("shards,modulus,keep", [(1, 4, 1), (2, 4, 2), (2, 6, 3), (1, 2, 2)])
def test_balanced_order_keeps_mini_batches_and_evens_the_cells(shards, modulus, keep):
    """Rows move only within their shard block and mini-batch (residue modulo `keep`); the
    fullest cell needs no more packed rows than in the given order, and with lopsided cells
    (every long row in one cell) strictly fewer where rows may move between cells."""
    rng = np.random.default_rng(modulus * 10 + keep)
    b = shards * modulus * 4
    block = b // shards
    lopsided = np.arange(b) % block % modulus == 0  # the first cell of every block gets every long row
    lengths = np.where(lopsided, rng.integers(150, 200, b), rng.integers(10, 40, b))
    order = pk.balanced_order(lengths, shards=shards, modulus=modulus, keep=keep)
    assert sorted(order.tolist()) == list(range(b))
    pos = np.arange(b)
    np.testing.assert_array_equal(order // block, pos // block)
    np.testing.assert_array_equal(order % block % keep, pos % block % keep)

    def rows_needed(ls):
        return max(pk.first_fit_decreasing(ls[idx], 256)[2] for idx in pk.cell_items(b, shards, modulus))

    assert rows_needed(lengths[order]) <= rows_needed(lengths)
    if modulus > keep:
        assert rows_needed(lengths[order]) < rows_needed(lengths)


def test_assemble_offsets_segments_and_context_ends():
    """Two two-segment items in one row: the second's segments and context come after the first's,
    its context end moves by its start column, positions stay its own."""
    item = {"tokens": np.arange(5), "positions": np.array([0, 1, 2, 2, 3]), "segment_ids": np.array([0, 0, 0, 1, 1]),
            "ctx1_segment": np.array([-2, -2, -2, 0, 0]), "ctx1_end": np.array([0, 0, 0, 2, 2]),
            "ctx2_segment": np.full(5, -2), "ctx2_end": np.zeros(5, np.int32)}
    row, offset, plan = pk.plan_packing([5, 5], 12, shards=1, modulus=1)
    tokens, lay = pk.assemble([item, item], row, offset, plan, 12, shards=1, modulus=1)
    assert plan.rows == 1 and sorted(offset.tolist()) == [0, 5]
    np.testing.assert_array_equal(lay.segment_ids[0], [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, PAD_SEGMENT, PAD_SEGMENT])
    np.testing.assert_array_equal(lay.ctx1_segment[0, 5:10], [-2, -2, -2, 2, 2])
    np.testing.assert_array_equal(lay.ctx1_end[0, 5:10], [0, 0, 0, 7, 7])
    np.testing.assert_array_equal(lay.positions[0, :10], [0, 1, 2, 2, 3] * 2)


def test_packed_forward_equals_each_trajectory_alone():
    """The model on a packed row gives each item the hidden states it has alone."""
    from turnsight_jax.models.qwen3 import init_model

    model = init_model(CFG, seed=0)
    rng = np.random.default_rng(0)
    lengths = [20, 33, 7, 40]
    seqs = [rng.integers(0, CFG.vocab_size, n) for n in lengths]
    row, offset, plan = pk.plan_packing(lengths, 64, shards=1, modulus=1)
    items = [{"tokens": s, "positions": np.arange(len(s)), "segment_ids": np.zeros(len(s), np.int32)} for s in seqs]
    tokens, lay = pk.assemble(items, row, offset, plan, 64, shards=1, modulus=1)
    assert plan.rows == 2
    packed = model.hidden_states(jnp.asarray(tokens), jax.tree.map(jnp.asarray, lay))
    for i, s in enumerate(seqs):
        alone = model.hidden_states(jnp.asarray(s)[None], Layout.full(1, len(s)))[0]
        k = int(row[i])
        np.testing.assert_allclose(packed[k, offset[i]:offset[i] + len(s)], alone, atol=1e-5)


def _batch(trajs, row_tasks, tok, cfg, **kw):
    batch, stats = make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg), **kw)
    return fold_batch(batch), stats


# Rows wider than the batch's own, so that several trajectories (and hindsight rows) share a row
WIDE = {"pack_rows": True, "pack_width": 1024}


def test_batch_packs_several_per_row_and_counts_the_flops(setup, tok):  # noqa: F811
    trajs, row_tasks, _, _ = setup
    cfg = dataclasses.replace(_cfg(method="turnsight"), **WIDE)
    batch, stats = _batch(trajs, row_tasks, tok, cfg)
    assert batch.packed.tokens.shape[1] == 1024 and batch.packed.plan.rows < len(trajs)
    assert batch.views.tokens is None and batch.views.packed.plan.rows < len(trajs)
    assert shape_keys(stats) == ["T", "N", "RT", "P", "U", "RP"]
    for t, r, o in zip(trajs, batch.packed.row, batch.packed.offset):
        k = int(r)  # one cell: the packed row is the bin
        np.testing.assert_array_equal(np.asarray(batch.packed.tokens)[k, o:o + t.length], np.asarray(t.tokens) % 1024)
    # the floors only grow the rows per cell
    again, _ = _batch(trajs, row_tasks, tok, cfg, min_shapes={"RT": len(trajs), "RP": len(trajs)})
    assert again.packed.plan.rows == len(trajs) and again.views.packed.plan.rows == len(trajs)
    # necessary FLOPs do not move; executed ones count the packed rows
    plain, _ = _batch(trajs, row_tasks, tok, _cfg(method="turnsight"))
    f_pack, f_plain = (flops.update_flops(CFG, b, updates=1, q_chunk=64, remat=False) for b in (batch, plain))
    assert f_pack.necessary == pytest.approx(f_plain.necessary)
    rp, w = batch.packed.tokens.shape
    trunk = flops.trunk_flops_per_token(CFG)
    extra_slots = rp * w - plain.tokens.size
    extra_pairs = rp * flops.chunked_pairs(w, 64) - plain.tokens.shape[0] * flops.chunked_pairs(plain.tokens.shape[1], 64)
    # the student's executed work moves by exactly the packed rows' slots and attention pairs
    assert f_pack.parts["student"][1] - f_plain.parts["student"][1] == pytest.approx(
        3.0 * trunk * extra_slots + 4.0 * flops.attention_flops(CFG, extra_pairs), rel=1e-9)


def test_the_teachers_pack_width_widens_only_the_teachers_rows(setup, tok):  # noqa: F811
    """train.teacher_pack_width: the hindsight rows (longer than the trajectories) pack into their
    own wider rows, fewer of them; the student's packed rows are as with pack_width alone (the
    teacher's log-probs are the same: tests/test_attention_key_blocks.py)."""
    trajs, row_tasks, _, _ = setup
    base = dataclasses.replace(_cfg(method="turnsight"), **WIDE)
    narrow, _ = _batch(trajs, row_tasks, tok, base)
    wide, _ = _batch(trajs, row_tasks, tok, dataclasses.replace(base, teacher_pack_width=2048))
    np.testing.assert_array_equal(np.asarray(wide.packed.tokens), np.asarray(narrow.packed.tokens))
    assert narrow.views.packed.tokens.shape[1] == 1024 and wide.views.packed.tokens.shape[1] == 2048
    assert wide.views.packed.plan.rows < narrow.views.packed.plan.rows



def test_packed_step_equals_the_unfused_reference(setup, tok):  # noqa: F811
    """Several trajectories and hindsight rows per row: the fused step's gradient equals the
    unfused reference's, which scores every trajectory and every hindsight view on its own."""
    trajs, row_tasks, policy, ref = setup
    cfg = dataclasses.replace(_cfg(method="turnsight", depths=(1, 2, 3)), **WIDE)
    batch, _ = _batch(trajs, row_tasks, tok, cfg)
    assert batch.packed.plan.rows < len(trajs) and batch.views.packed.plan.rows < len(trajs)
    grads, _ = _sgd_step(cfg, policy, ref, batch)
    want = _reference_grads(cfg, policy, ref, trajs, [t.answer for t in row_tasks], tok)
    scale = max(jax.tree.leaves(jax.tree.map(lambda x: float(np.abs(np.asarray(x)).max()), want)))
    assert scale > 1e-4
    assert _max_diff(grads, want) < 1e-5 * max(1.0, scale) + 1e-6


def test_packed_step_equals_the_plain_step(setup, tok):  # noqa: F811
    """Micro-batched student and teacher: the cells follow the strided splits."""
    trajs, row_tasks, policy, ref = setup
    cfg = dataclasses.replace(_cfg(method="turnsight"), micro_batches=2, teacher_micro_batches=2)
    want, m0 = _sgd_step(cfg, policy, ref, _batch(trajs, row_tasks, tok, cfg)[0])
    packed = dataclasses.replace(cfg, **WIDE)
    batch, _ = _batch(trajs, row_tasks, tok, packed)
    assert batch.packed.plan.rows < batch.packed.plan.cell  # several trajectories per row in each cell
    plain = _batch(trajs, row_tasks, tok, cfg)[0]
    # the rows were reordered across the two micro-batches (balanced_order), not changed
    assert not np.array_equal(batch.tokens, plain.tokens)
    assert sorted(map(tuple, np.asarray(batch.tokens))) == sorted(map(tuple, np.asarray(plain.tokens)))
    got, m1 = _sgd_step(packed, policy, ref, batch)
    assert _max_diff(got, want) < 1e-6
    for k in ("pg_loss", "adv_mean", "kl", "delta_mean"):
        np.testing.assert_allclose(np.asarray(m1[k]), np.asarray(m0[k]), atol=1e-6)


def test_masked_context_packed_step_equals_the_plain_step(setup, tok):  # noqa: F811
    """Observation masking: π_old and the KL reference are separate packed forwards of the masked
    rows (two mini-batches); the masked tokens are padding inside their trajectory's span."""
    trajs, row_tasks, policy, ref = setup
    cfg = dataclasses.replace(_cfg(method="turnsight", student_sees_observations=False), mini_batches=2)
    want, m0 = _sgd_step(cfg, policy, ref, _batch(trajs, row_tasks, tok, cfg)[0])
    packed = dataclasses.replace(cfg, **WIDE)
    got, m1 = _sgd_step(packed, policy, ref, _batch(trajs, row_tasks, tok, packed)[0])
    assert _max_diff(got, want) < 1e-6
    np.testing.assert_allclose(float(m1["kl"]), float(m0["kl"]), atol=1e-7)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (tests/conftest.py)")
def test_sharded_packed_step_equals_the_unsharded_plain_step(setup, tok):  # noqa: F811
    trajs, row_tasks, policy, ref = setup
    cfg = _cfg(method="turnsight")
    plain, m0 = _sgd_step(cfg, policy, ref, _batch(trajs, row_tasks, tok, cfg)[0])
    packed = dataclasses.replace(cfg, **WIDE)
    batch, _ = _batch(trajs, row_tasks, tok, packed, row_shards=2)
    assert batch.packed.plan.shards == 2 and batch.packed.plan.rows < batch.packed.plan.cell
    sharded, m1 = _sgd_step(packed, policy, ref, batch, mesh=make_mesh(fsdp=2, tensor=4))
    assert _max_diff(plain, sharded) < 1e-6
    assert abs(float(m0["pg_loss"]) - float(m1["pg_loss"])) < 1e-6


def test_packing_refusals(setup, tok):  # noqa: F811
    trajs, row_tasks, _, _ = setup
    with pytest.raises(ConfigError, match="train.pack_rows=True and train.length_classes=2: choose one"):
        StepConfig(pack_rows=True, length_classes=2, group_size=2).validate(8)
    with pytest.raises(ConfigError, match="train.pack_width must be an int >= 0"):
        StepConfig(pack_width=-1, group_size=2).validate(8)
    with pytest.raises(ConfigError, match=r"train.teacher_pack_width must be an int >= 0 \(0: train.pack_width\)"):
        StepConfig(teacher_pack_width=True, group_size=2).validate(8)
    with pytest.raises(ConfigError, match="train.pack_rows must be True or False"):
        StepConfig(pack_rows=1, group_size=2).validate(8)
    cfg = dataclasses.replace(_cfg(method="grpo"), pack_rows=True)
    with pytest.raises(ConfigError, match="train.pack_rows: 8 rows do not split into 3 row shard"):
        make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg), row_shards=3)
    with pytest.raises(ValueError, match="train.pack_width: length 999999 exceeds the largest bucket"):
        make_train_batch(trajs, row_tasks, tok, dataclasses.replace(cfg, pack_width=999999), resolve_method(cfg))


def test_dry_run_geometry_plans_one_trajectory_per_packed_row():
    from turnsight_jax import config as C
    from turnsight_jax.rl.batch import abstract_batch, worst_case_geometry

    cfg = C.default_config()
    cfg.train.pack_rows = True
    sc, method = C.validate(cfg, 8, check_data=False)
    geo = worst_case_geometry(cfg, method, sc, 8)  # 32 rows over 8 row shards: cells of 4
    assert geo.pack_cell == 4
    batch = abstract_batch(geo, make_mesh(fsdp=jax.device_count()), method)
    assert batch.packed.tokens.shape == batch.tokens.shape and batch.packed.plan == pk.RowPacking(4, 4, 8)
    # wider packed rows hold several of the longest trajectories: fewer rows, each as wide
    cfg.train.pack_width = 3 * geo.length
    wide = worst_case_geometry(cfg, method, dataclasses.replace(sc, pack_width=3 * geo.length), 8)
    w = pick_bucket(3 * geo.length, DEFAULT_BUCKETS, "test")
    assert wide.pack_student == (2, w)  # 4 of T in rows of >= 3T: every row but the last holds > 2T, so 2
    batch = abstract_batch(wide, make_mesh(fsdp=jax.device_count()), method)
    assert batch.packed.tokens.shape == (16, w) and batch.packed.plan == pk.RowPacking(2, 4, 8)
    cfg.train.pack_width = 0
    cfg.train.length_classes = 2
    with pytest.raises(ConfigError, match="choose one"):
        C.validate(cfg, 8, check_data=False)


def test_packed_step_with_the_entropy_term_equals_the_plain_step(setup, tok):  # noqa: F811
    """The entropy of each predicted distribution comes back through the packed gather too."""
    trajs, row_tasks, policy, ref = setup
    cfg = dataclasses.replace(_cfg(method="grpo"), loss=LossConfig(kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01))
    want, m0 = _sgd_step(cfg, policy, ref, _batch(trajs, row_tasks, tok, cfg)[0])
    packed = dataclasses.replace(cfg, **WIDE)
    got, m1 = _sgd_step(packed, policy, ref, _batch(trajs, row_tasks, tok, packed)[0])
    assert float(m0["entropy"]) > 0.1
    np.testing.assert_allclose(float(m1["entropy"]), float(m0["entropy"]), rtol=1e-6)
    assert _max_diff(got, want) < 1e-6
