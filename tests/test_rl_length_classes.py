"""Length classes (rl.length_classes): every cell holds its classes in the configured sizes, the
shortest rows first; running a forward by class equals running it on the whole batch; the fused
step with classes equals the step without them (micro-/mini-batched, masked context, KL reference;
sharded: tests/test_rl_step.py::test_sharded_step_equals_unsharded); the FLOP counter counts the
classes' widths."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax import flops
from turnsight_jax.errors import ConfigError
from turnsight_jax.rl import length_classes as lc
from turnsight_jax.rl.batch import make_train_batch, shape_keys
from turnsight_jax.rl.methods import resolve_method

from test_rl_step import CFG, _cfg, _max_diff, _sgd_step, setup  # noqa: F401  (the module fixture)
from _vocab import fold_batch


@pytest.mark.parametrize("shards,modulus,classes", [(1, 1, 2), (2, 2, 2), (1, 3, 3), (2, 1, 4)])
def test_every_cell_holds_each_class_in_its_size_shortest_first(shards, modulus, classes):
    rng = np.random.default_rng(shards * 10 + modulus)
    rows = lc.split_cell(4 * classes, classes)
    b = shards * modulus * sum(rows)
    lengths = rng.integers(10, 500, b)
    lengths[:3] = lengths[3]  # ties
    cls = lc.assign(lengths, rows, shards=shards, modulus=modulus)
    block = b // shards
    for s in range(shards):
        for r in range(modulus):
            idx = s * block + np.arange(r, block, modulus)
            np.testing.assert_array_equal(np.bincount(cls[idx], minlength=classes), rows)
            for i in range(classes - 1):  # no row of class i is longer than a row of class i + 1
                assert lengths[idx][cls[idx] == i].max() <= lengths[idx][cls[idx] == i + 1].min()


def test_cell_split_refuses_more_classes_than_rows():
    assert lc.split_cell(7, 3) == (3, 2, 2)
    with pytest.raises(ConfigError, match="length_classes=4 but each cell of the batch holds 3 rows"):
        lc.split_cell(3, 4)
    with pytest.raises(ConfigError, match="must be >= 1"):
        lc.split_cell(3, 0)


@pytest.mark.parametrize("shards", [1, 2])
def test_run_by_class_equals_the_whole_batch(shards):
    """A per-row function of cut arrays, run by class, equals it on the whole batch in row order
    (and after a strided split, as the step's micro-batches see the rows)."""
    rng = np.random.default_rng(0)
    rows = (3, 3)
    b = shards * 2 * sum(rows)
    lengths = rng.integers(1, 64, b)
    cls = lc.assign(lengths, rows, shards=shards, modulus=2)
    widths = tuple(int(w) for w in lc.class_widths(lengths, cls, 2))
    spec = lc.LengthClasses(rows, widths, shards)
    x = np.where(np.arange(64)[None] < lengths[:, None], rng.normal(size=(b, 64)), 0.0).astype(np.float32)
    scale = rng.normal(size=b).astype(np.float32)

    def fn(_, s, xc):
        return {"sum": jnp.sum(xc, axis=1) * s, "first": xc[:, 0], "cols": jnp.stack([s, s], axis=0)}

    got = lc.run_by_class(fn, spec, jnp.asarray(cls), (jnp.asarray(scale),), (jnp.asarray(x),))
    cols = jax.jit(lambda c, s, v: lc.run_by_class(lambda _, s, xc: jnp.stack([s, xc.sum(1)], 0), spec, c, (s,), (v,),
                                                   out_axis=1))(jnp.asarray(cls), jnp.asarray(scale), jnp.asarray(x))
    np.testing.assert_allclose(got["sum"], x.sum(1) * scale, atol=1e-5)
    np.testing.assert_array_equal(got["first"], x[:, 0])
    np.testing.assert_allclose(cols, np.stack([scale, x.sum(1)]), atol=1e-5)
    # a strided half of the rows (a micro-batch): the same spec serves it
    half = slice(0, None, 2)
    got = lc.run_by_class(fn, spec, jnp.asarray(cls[half]), (jnp.asarray(scale[half]),), (jnp.asarray(x[half]),))
    np.testing.assert_allclose(got["sum"], x[half].sum(1) * scale[half], atol=1e-5)


def _batch(trajs, row_tasks, tok, cfg, **kw):
    batch, stats = make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg), **kw)
    return fold_batch(batch), stats


def test_batch_carries_the_classes_and_their_widths(setup, tok):  # noqa: F811
    trajs, row_tasks, _, _ = setup
    cfg = dataclasses.replace(_cfg(method="turnsight"), length_classes=2)
    batch, stats = _batch(trajs, row_tasks, tok, cfg)
    lengths = np.array([t.length for t in trajs])
    assert batch.classes.rows == (4, 4) and batch.views.classes.rows == (4, 4)
    for i, w in enumerate(batch.classes.widths):
        assert lengths[batch.length_class == i].max() <= w <= batch.tokens.shape[1]
        assert stats[f"T{i}"] == w
    packed = (np.asarray(batch.views.layout.segment_ids) >= 0).sum(1)
    for i, w in enumerate(batch.views.classes.widths):
        assert packed[batch.views.row_class == i].max() <= w <= batch.views.tokens.shape[1]
    assert batch.classes.widths[0] < batch.classes.widths[1]  # these rows' lengths spread: a real saving
    assert shape_keys(stats) == ["T", "N", "T0", "T1", "P0", "P1", "P", "U"]
    # floors per class: the widths only grow
    floors = {k: int(stats[k]) for k in shape_keys(stats)}
    floors["T0"] = floors["T1"]
    again, st2 = _batch(trajs, row_tasks, tok, cfg, min_shapes=floors)
    assert again.classes.widths == (floors["T1"], floors["T1"])
    # executed FLOPs fall with the classes; the necessary ones do not move
    plain, _ = _batch(trajs, row_tasks, tok, _cfg(method="turnsight"))
    f_cls, f_plain = (flops.update_flops(CFG, b, updates=1, q_chunk=64, remat=False) for b in (batch, plain))
    assert f_cls.necessary == pytest.approx(f_plain.necessary)
    assert f_cls.executed < f_plain.executed


def test_step_with_length_classes_equals_the_step_without(setup, tok):  # noqa: F811
    """Micro-batched student and teacher (the cells follow the strided splits); mini-batches are
    covered by the masked-context test below."""
    trajs, row_tasks, policy, ref = setup
    cfg = dataclasses.replace(_cfg(method="turnsight"), micro_batches=2, teacher_micro_batches=2)
    want, m0 = _sgd_step(cfg, policy, ref, _batch(trajs, row_tasks, tok, cfg)[0])
    classed = dataclasses.replace(cfg, length_classes=2)
    got, m1 = _sgd_step(classed, policy, ref, _batch(trajs, row_tasks, tok, classed)[0])
    assert _max_diff(got, want) < 1e-6
    for k in ("pg_loss", "adv_mean", "kl", "delta_mean"):
        np.testing.assert_allclose(np.asarray(m1[k]), np.asarray(m0[k]), atol=1e-6)


def test_masked_context_step_with_classes_equals_without(setup, tok):  # noqa: F811
    """Observation masking: π_old and the KL reference are separate forwards on the masked rows
    (two mini-batches), each run by class."""
    trajs, row_tasks, policy, ref = setup
    cfg = dataclasses.replace(_cfg(method="turnsight", student_sees_observations=False), mini_batches=2)
    want, m0 = _sgd_step(cfg, policy, ref, _batch(trajs, row_tasks, tok, cfg)[0])
    classed = dataclasses.replace(cfg, length_classes=2)
    got, m1 = _sgd_step(classed, policy, ref, _batch(trajs, row_tasks, tok, classed)[0])
    assert _max_diff(got, want) < 1e-6
    np.testing.assert_allclose(float(m1["kl"]), float(m0["kl"]), atol=1e-7)


def test_rows_that_do_not_form_cells_are_refused(setup, tok):  # noqa: F811
    trajs, row_tasks, _, _ = setup
    cfg = dataclasses.replace(_cfg(method="grpo"), length_classes=2)
    with pytest.raises(ConfigError, match="8 rows do not split into 3 row shard"):
        make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg), row_shards=3)
    with pytest.raises(ConfigError, match="length_classes=5 but each cell of the batch holds 4 rows"):
        make_train_batch(trajs, row_tasks, tok, dataclasses.replace(cfg, length_classes=5), resolve_method(cfg),
                         row_shards=2)


def test_dry_run_geometry_plans_every_class_at_the_widest_width():
    """The memory plan's worst case for a mesh given as fsdp = -1 (every device): the classes'
    cells come from the resolved row shards, each class as wide as the widest row."""
    from turnsight_jax import config as C
    from turnsight_jax.rl.batch import worst_case_geometry

    cfg = C.default_config()
    cfg.train.length_classes = 2
    sc, method = C.validate(cfg, 8, check_data=False)
    geo = worst_case_geometry(cfg, method, sc, 8)  # 32 rows over 8 row shards: cells of 4
    assert geo.class_rows == (2, 2) and geo.row_shards == 8
    with pytest.raises(ConfigError, match="32 rows do not split into 64 row shard"):
        worst_case_geometry(cfg, method, sc, 64)
