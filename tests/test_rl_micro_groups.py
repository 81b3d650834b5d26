"""Micro-batches grouped by length (train.micro_batch_groups, rl.micro_groups): the host's row order
puts the shortest rows in the first micro-batches of every shard, each group of micro-batches runs
at its own width, the fused step's gradients and loss are the ungrouped step's (one device and a
mesh), and the FLOP counter counts the groups' widths."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax import flops
from turnsight_jax.errors import ConfigError
from turnsight_jax.models.sharding import make_mesh
from turnsight_jax.rl.batch import batch_row_order, make_train_batch
from turnsight_jax.rl.methods import resolve_method
from turnsight_jax.rl.micro_groups import MicroGroups, length_order, split_counts

from _vocab import fold_batch
from test_rl_step import CFG, _cfg, _max_diff, _sgd_step, setup  # noqa: F401  (the module fixture)


@pytest.mark.parametrize("b,shards,m", [(8, 1, 4), (8, 2, 4), (24, 3, 2), (16, 1, 16)])
def test_the_order_puts_each_shards_shortest_rows_in_the_first_micro_batches(b, shards, m):
    lengths = np.random.default_rng(b + shards + m).integers(1, 50, size=b)
    order = length_order(lengths, shards, m)
    assert sorted(order.tolist()) == list(range(b))
    block = b // shards
    for s in range(shards):
        rows = order[s * block:(s + 1) * block]
        assert ((rows >= s * block) & (rows < (s + 1) * block)).all()  # rows stay in their shard block
        got = lengths[rows]
        per_micro = [got[j::m] for j in range(m)]  # micro-batch j: the block's rows j, j + m, ...
        for j in range(m - 1):
            assert per_micro[j].max() <= per_micro[j + 1].min()
    with pytest.raises(ValueError, match="whole micro-batches"):
        length_order(lengths[:6], 2, 4)


def test_groups_split_the_micro_batches_in_order():
    assert split_counts(64, 4) == (16, 16, 16, 16) and split_counts(5, 2) == (3, 2)
    g = MicroGroups((3, 2), (128, 256))
    assert g.bounds() == [(0, 3), (3, 5)]
    assert g.row_groups(10).tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]


def _grouped(trajs, row_tasks, tok, groups, teacher_m=4, shards=1, **extra):
    cfg = dataclasses.replace(_cfg(method="turnsight"), micro_batches=4, teacher_micro_batches=teacher_m,
                              micro_batch_groups=groups, **extra)
    batch, stats = make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg), row_shards=shards)
    return cfg, fold_batch(batch), stats


def test_the_batch_holds_each_groups_width(setup, tok):  # noqa: F811
    trajs, row_tasks, _, _ = setup
    cfg, batch, stats = _grouped(trajs, row_tasks, tok, 2)
    g = batch.micro_groups
    assert g.counts == (2, 2) and len(g.widths) == 2 and len(g.view_widths) == 2
    assert g.widths[0] <= g.widths[1] == batch.tokens.shape[1] and g.view_widths[1] == batch.views.tokens.shape[1]
    rows = g.row_groups(8)
    lengths = np.asarray(batch.valid).sum(axis=1)
    views = (np.asarray(batch.views.layout.segment_ids) >= 0).sum(axis=1)
    for k in (0, 1):  # every row fits its group's widths
        assert lengths[rows == k].max() <= g.widths[k] and views[rows == k].max() <= g.view_widths[k]
    assert g.widths[0] < g.widths[1]  # the short micro-batches are cut here
    assert (stats["T0"], stats["T1"], stats["P0"], stats["P1"]) == (*map(float, g.widths), *map(float, g.view_widths))
    order = batch_row_order(trajs, cfg)
    assert [trajs[i].length for i in order] == lengths.tolist()


def test_each_group_of_micro_batches_runs_at_its_own_width(setup, tok):  # noqa: F811
    from turnsight_jax.rl.micro_batches import in_micro_batches as _in_micro_batches

    trajs, row_tasks, _, _ = setup
    _, batch, _ = _grouped(trajs, row_tasks, tok, 2)
    seen = []

    def fn(rows):
        seen.append(rows.tokens.shape)
        return jnp.sum(rows.tokens, axis=-1)

    out = _in_micro_batches(fn, jax.tree.map(jnp.asarray, batch), 4)
    assert seen == [(2, w) for w in batch.micro_groups.widths]  # a micro-batch: 8 rows / 4
    np.testing.assert_array_equal(np.asarray(out), np.asarray(batch.tokens).sum(axis=-1))


@pytest.mark.parametrize("groups,teacher_m", [(2, 4), (4, 4), (2, 1)])
def test_the_grouped_step_equals_the_ungrouped_step(setup, tok, groups, teacher_m, monkeypatch):  # noqa: F811
    """One TurnSight step with SGD(1) (the update is minus the gradient, KL on the student's
    context): 4 micro-batches in `groups` groups against one scan at the batch's width, the
    teacher's micro-batches grouped too (4) or one call (1): the same gradients and loss; the
    counter's executed FLOPs fall, its necessary ones do not move."""
    trajs, row_tasks, policy, ref = setup
    kl = dict(loss=dataclasses.replace(_cfg().loss, kl_coef=0.05))
    c0, b0, _ = _grouped(trajs, row_tasks, tok, 1, teacher_m, **kl)
    c1, b1, _ = _grouped(trajs, row_tasks, tok, groups, teacher_m, **kl)
    assert b1.micro_groups is not None and b0.micro_groups is None
    g0, m0 = _sgd_step(c0, policy, ref, b0)
    from turnsight_jax.rl import micro_groups

    cuts = {"rows": [], "views": []}  # the widths the traced step cuts its micro-batches to
    for kind in cuts:
        real = getattr(micro_groups, f"cut_{kind}")
        monkeypatch.setattr(micro_groups, f"cut_{kind}", lambda x, w, real=real, kind=kind: (cuts[kind].append(w),
                                                                                              real(x, w))[1])
    g1, m1 = _sgd_step(c1, policy, ref, b1)
    assert set(cuts["rows"]) == set(b1.micro_groups.widths)
    assert set(cuts["views"]) == (set(b1.micro_groups.view_widths) if teacher_m == 4 else set())
    scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(g0))
    assert scale > 1e-4
    assert _max_diff(g0, g1) < 1e-5 * max(1.0, scale)
    for key in ("pg_loss", "kl"):
        if key in m0:
            assert abs(float(m0[key]) - float(m1[key])) < 1e-6, key
    count = lambda b: flops.update_flops(CFG, b, updates=1, q_chunk=16, remat=False, ref_forward=True,
                                         micro_batches=4, teacher_micro_batches=teacher_m)
    w0, w1 = count(b0), count(b1)
    for part in ("student", "teacher"):
        assert w1.parts[part][0] == pytest.approx(w0.parts[part][0])
    assert w1.parts["student"][1] < w0.parts["student"][1]
    if teacher_m == 4:
        assert w1.parts["teacher"][1] < w0.parts["teacher"][1]
    else:
        assert w1.parts["teacher"][1] == pytest.approx(w0.parts["teacher"][1])


def test_the_grouped_step_on_a_mesh_equals_the_step_on_one_device(setup, tok):  # noqa: F811
    """Rows ordered within each of 2 row shards (fsdp 2 x tensor 4): the sharded grouped step's
    gradients are the unsharded ungrouped step's."""
    trajs, row_tasks, policy, ref = setup
    c0, b0, _ = _grouped(trajs, row_tasks, tok, 1)
    c1, b1, _ = _grouped(trajs, row_tasks, tok, 2, shards=2)
    g0, m0 = _sgd_step(c0, policy, ref, b0)
    g1, m1 = _sgd_step(c1, policy, ref, b1, mesh=make_mesh(fsdp=2, tensor=4))
    scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(g0))
    assert _max_diff(g0, g1) < 1e-5 * max(1.0, scale)
    assert abs(float(m0["pg_loss"]) - float(m1["pg_loss"])) < 1e-6


@pytest.mark.parametrize("fields,match", [
    (dict(micro_batches=2, micro_batch_groups=3), "at most that many groups"),
    (dict(micro_batches=4, mini_batches=2, micro_batch_groups=2), "mini_batches=1"),
    (dict(micro_batches=4, micro_batch_groups=2, pack_rows=True), "choose one"),
    (dict(micro_batches=4, teacher_micro_batches=2, micro_batch_groups=2), "teacher_micro_batches 1 or equal"),
    (dict(micro_batch_groups=0), "micro_batch_groups must be an int >= 1"),
])
def test_settings_that_cannot_group_are_refused_with_the_reason(fields, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(_cfg(method="turnsight"), **fields).validate(16)


def test_rows_that_do_not_split_into_whole_micro_batches_per_shard_are_refused(setup, tok):  # noqa: F811
    trajs, row_tasks, _, _ = setup
    with pytest.raises(ConfigError, match="micro_batch_groups=2.*8 rows do not split into 4 row shard"):
        _grouped(trajs, row_tasks, tok, 2, shards=4)
