"""train.shapes (turnsight_jax.batch_shapes): which padded shape a step's batch takes.

"grow" keeps the largest widths so far; "batch" takes each batch's own buckets unless a shape
used before fits it within train.shape_reuse of its executed FLOPs. Checked on a model of
make_train_batch's buckets and on real batches (the FLOP counter as the cost)."""

from __future__ import annotations

import dataclasses

import pytest

from turnsight_jax import flops
from turnsight_jax.batch_shapes import ShapeHistory, choose_batch
from turnsight_jax.config import default_config, validate
from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.batch import make_train_batch, shape_keys
from turnsight_jax.rl.methods import resolve_method

from test_rl_step import CFG, _cfg, setup  # noqa: F401  (the module fixture)

BUCKETS = (64, 128, 256, 512)


def _bucket(n, floor=0):
    return min(b for b in BUCKETS if b >= max(n, floor))


def _fake(need):
    """build/cost over widths `need` ({"T": n, "N": m}): make_train_batch's rule (the smallest
    bucket at or above both the width and its floor); cost: the padded slots."""
    calls = []

    def build(floors):
        calls.append(dict(floors))
        stats = {k: float(_bucket(n, floors.get(k, 0))) for k, n in need.items()}
        return stats, stats

    return build, (lambda _b, st: st["T"] * 10 + st["N"]), calls


def test_grow_keeps_the_largest_widths_so_far():
    h = ShapeHistory("grow")
    assert choose_batch(*_fake({"T": 300, "N": 40})[:2], h)[2] == {"T": 512, "N": 64}
    # a shorter batch is padded to the run's widths; a longer policy part grows N alone
    assert choose_batch(*_fake({"T": 100, "N": 100})[:2], h)[2] == {"T": 512, "N": 128}
    assert h.floors() == {"T": 512, "N": 128}


def test_batch_takes_its_own_buckets_or_a_used_shape_within_the_slack():
    h = ShapeHistory("batch", reuse=0.1)
    assert choose_batch(*_fake({"T": 300, "N": 40})[:2], h)[2] == {"T": 512, "N": 64}
    # own (128, 64) costs 1,344; the used (512, 64) 5,184: far above 10%, so the batch's own
    assert choose_batch(*_fake({"T": 100, "N": 40})[:2], h)[2] == {"T": 128, "N": 64}
    # own (256, 64) 2,624 against the used (512, 64) 5,184: the batch's own again
    assert choose_batch(*_fake({"T": 200, "N": 40})[:2], h)[2] == {"T": 256, "N": 64}
    h.reuse = 1.0
    build, cost, calls = _fake({"T": 250, "N": 40})
    assert choose_batch(build, cost, h)[2] == {"T": 256, "N": 64}  # used before: no other is built
    assert calls == [{}]
    h.reuse = 1.5
    # own (64, 64) 704: the cheapest used shape that fits, (128, 64) 1,344 <= 2.5 x 704; of the
    # three that fit only the two nearest, (128, 64) and (256, 64), are built and costed
    build, cost, calls = _fake({"T": 60, "N": 40})
    assert choose_batch(build, cost, h)[2] == {"T": 128, "N": 64}
    assert calls == [{}, {"T": 128, "N": 64}, {"T": 256, "N": 64}]
    # a used shape that does not fit (N 64 < the batch's 128) is never a candidate
    assert choose_batch(*_fake({"T": 100, "N": 100})[:2], h)[2] == {"T": 128, "N": 128}
    assert h.used == [{"T": 512, "N": 64}, {"T": 128, "N": 64}, {"T": 256, "N": 64}, {"T": 128, "N": 128}]


def test_the_history_round_trips_through_the_checkpoint_metadata():
    h = ShapeHistory("batch", 0.2, [{"T": 512, "N": 64}, {"T": 128, "N": 128}])
    meta = h.to_meta()
    assert meta["batch_shapes"] == {"T": 512, "N": 128}  # the floors, as before the history was saved
    assert ShapeHistory.from_meta(meta, "batch", 0.2) == h
    # a checkpoint that saved only the floors resumes "grow" exactly
    old = ShapeHistory.from_meta({"batch_shapes": {"T": 512, "N": 64}}, "grow", 0.1)
    assert old.floors() == {"T": 512, "N": 64}
    assert ShapeHistory.from_meta({}, "grow", 0.1).used == []


PACKED = {"pack_rows": True, "pack_width": 1024}


def test_batch_shapes_on_real_batches_follow_the_batch(setup, tok):  # noqa: F811
    """A real packed batch after a run that used wider shapes: "grow" pads it to them, "batch"
    takes its own (fewer executed FLOPs, the same necessary ones), or the used shape when the
    slack allows."""
    trajs, row_tasks, _, _ = setup
    cfg = dataclasses.replace(_cfg(method="turnsight"), **PACKED)
    method = resolve_method(cfg)

    def build(floors):
        return make_train_batch(trajs, row_tasks, tok, cfg, method, min_shapes=floors)

    def work(b):
        return flops.update_flops(CFG, b, updates=1, q_chunk=64, remat=False)

    _, own = build({})
    wide = {k: int(own[k]) * (2 if k in ("N", "U", "P") else 1) for k in shape_keys(own)}
    wide["RT"], wide["RP"] = len(trajs), len(trajs)
    grown = choose_batch(build, lambda b, _s: work(b).executed, ShapeHistory("grow", used=[wide]))
    tight = choose_batch(build, lambda b, _s: work(b).executed, ShapeHistory("batch", 0.1, [wide]))
    assert grown[2] == wide and tight[2] == {k: int(own[k]) for k in shape_keys(own)}
    assert grown[0].packed.plan.rows == len(trajs) > tight[0].packed.plan.rows
    f_grown, f_tight = work(grown[0]), work(tight[0])
    assert f_tight.necessary == pytest.approx(f_grown.necessary)
    assert f_tight.executed < f_grown.executed
    slack = f_grown.executed / f_tight.executed - 1.0
    assert choose_batch(build, lambda b, _s: work(b).executed, ShapeHistory("batch", slack * 1.01, [wide]))[2] == wide


@pytest.mark.parametrize("key, value", [("shapes", "shrink"), ("shape_reuse", -0.5)])
def test_shape_settings_are_checked(key, value):
    cfg = default_config()
    cfg.train[key] = value
    with pytest.raises(ConfigError, match=f"train.{key}"):
        validate(cfg, 1, check_data=False)
