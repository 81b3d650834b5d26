"""turnsight_jax.rl.batch: trajectories -> the compact TrainBatch; rewards from the record; errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.chat.trajectory import QWEN3_IM_END_ID as END, QWEN3_IM_START_ID as START, TrajectoryBuilder
from turnsight_jax.chat.types import Task, ToolCall
from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.batch import compute_signals, group_index, make_train_batch, pad_tokens, row_axis
from turnsight_jax.rl.config import AlgoConfig, StepConfig
from turnsight_jax.rl.methods import Method, METHODS, REWARDS, register_method, register_reward, resolve_method

PROMPT = [START, 10, 11, END, 12, START, 13, 14]


def _traj(n_turns: int, group_id: int, reward: float, n_policy: int = 3):
    b = TrajectoryBuilder(PROMPT, group_id=group_id, task_id=f"t{group_id}")
    for k in range(n_turns):
        ids = list(range(100 + 10 * k, 100 + 10 * k + n_policy - 1)) + [END]
        last = k == n_turns - 1
        b.add_policy_turn(ids, [-0.01 * (i + 1 + k) for i in range(n_policy)], "x", [] if last else
                          [ToolCall("f", {"x": k}, raw="")], answer="a" if last else None)
        if not last:
            b.add_observation([30, START, 31, START, 13, 14], ["r"], [(2, 3)], header_offset=3)
    return b.build(reward=reward, metrics={})


def _task(i: int) -> Task:
    return Task(task_id=f"t{i}", messages=({"role": "user", "content": "q"},), tools=(), codes={}, unsolved_set={},
                answer="a", category="single_hop")


def _cfg(method="grpo", **kw):
    return StepConfig(algo=AlgoConfig(method=method), group_size=2, max_turns=4, **kw)


if "turn_index_test" not in REWARDS:  # a per-turn reward whose values are easy to check
    register_reward("turn_index_test", "turn_index", per="turn")(
        lambda traj, task, algo: np.arange(traj.num_turns, dtype=np.float32) + 1.0)
    register_method(Method("turn_index_test", advantage="grpo", rewards=("outcome", "turn_index_test")))


def test_compact_layout_gathers_policy_tokens_and_fills_signals(tok):
    trajs = [_traj(3, 7, 1.0), _traj(1, 7, 0.0, n_policy=5), _traj(2, 3, 0.5), _traj(1, 3, 0.25)]
    tasks = [_task(i) for i in (7, 7, 3, 3)]
    cfg = _cfg("turn_index_test")
    batch, stats = make_train_batch(trajs, tasks, tok, cfg, resolve_method(cfg))
    assert batch.tokens.shape == (4, 128) and batch.tokens.dtype == np.int32  # longest 34 -> bucket 128
    assert batch.valid.sum(axis=1).tolist() == [t.length for t in trajs]
    assert batch.pol_pos.shape == (4, 32)  # policy widths: multiples of 32
    for i, t in enumerate(trajs):
        n = int(t.policy_mask.sum())
        assert batch.pol_valid[i].sum() == n and not batch.pol_valid[i, n:].any()
        np.testing.assert_array_equal(batch.pol_pos[i, :n], np.flatnonzero(t.policy_mask))
        np.testing.assert_array_equal(batch.turn_ids[i, :n], t.turn_ids[t.policy_mask.astype(bool)])
        np.testing.assert_array_equal(batch.old_logprobs[i, :n], t.old_logprobs[t.policy_mask.astype(bool)])
        assert (batch.turn_ids[i, n:] == -1).all() and (batch.old_logprobs[i, n:] == 0).all()
    assert batch.group_ids.tolist() == [0, 0, 1, 1]  # renumbered in order of appearance
    assert batch.num_turns.tolist() == [3, 1, 2, 1]
    assert sorted(batch.signals) == ["rewards", "turn_index"]
    np.testing.assert_array_equal(batch.signals["rewards"], [1.0, 0.0, 0.5, 0.25])
    np.testing.assert_array_equal(batch.signals["turn_index"], [[1, 2, 3, 0], [1, 0, 0, 0], [1, 2, 0, 0], [1, 0, 0, 0]])
    assert batch.views is None  # GRPO reads no teacher
    assert stats["policy_tokens"] == sum(int(t.policy_mask.sum()) for t in trajs)
    # a pytree that goes through jit
    total = jax.jit(lambda b: jnp.sum(jnp.where(b.pol_valid, b.old_logprobs, 0.0)))(batch)
    assert np.isclose(float(total), sum(float(t.old_logprobs.sum()) for t in trajs), rtol=1e-5)


def test_shapes_only_grow_with_min_shapes(tok):
    trajs, tasks = [_traj(1, 0, 0.0), _traj(1, 0, 1.0)], [_task(0)] * 2
    cfg = _cfg()
    batch, stats = make_train_batch(trajs, tasks, tok, cfg, resolve_method(cfg),
                                    min_shapes={"T": 300, "N": 64})
    assert batch.tokens.shape[1] == 384 and batch.pol_pos.shape[1] == 64
    assert (stats["T"], stats["N"]) == (384, 64)


def test_row_axis_is_one_only_for_view_leaves(tok):
    trajs, tasks = [_traj(2, 0, 0.0), _traj(2, 0, 1.0)], [_task(0)] * 2
    cfg = _cfg("turnsight")
    batch, _ = make_train_batch(trajs, tasks, tok, cfg, resolve_method(cfg))
    axes = {jax.tree_util.keystr(p): row_axis(p) for p, _ in jax.tree_util.tree_flatten_with_path(batch)[0]}
    assert {k for k, a in axes.items() if a == 1} == {".views.view_pred", ".views.slot"}
    assert all(x.shape[row_axis(p)] == 2 for p, x in jax.tree_util.tree_flatten_with_path(batch)[0])


def test_errors_name_the_problem(tok):
    trajs = [_traj(1, 0, 0.0), _traj(1, 1, 1.0)]
    with pytest.raises(ConfigError, match="group 0 has 1 trajectories, expected group_size=2"):
        group_index(trajs, 2)
    with pytest.raises(ValueError, match="over the batch width 8"):
        pad_tokens(trajs, 8)
    cfg = dataclasses.replace(_cfg(), max_turns=2)
    with pytest.raises(ValueError, match="2 trajectories but 1 row tasks"):
        compute_signals(resolve_method(cfg), trajs, [_task(0)], cfg)
    long = [_traj(3, 0, 0.0), _traj(3, 0, 0.0)]
    method = resolve_method(_cfg("turn_index_test"))
    with pytest.raises(ValueError, match="3 turns, over max_turns 2"):
        compute_signals(method, long, [_task(0)] * 2, dataclasses.replace(_cfg("turn_index_test"), max_turns=2))


def test_matchtir_turn_rewards_come_from_the_record_and_warn_without_gold(tok, caplog):
    """The rollout driver computes no rewards: MatchTIR's turn rewards are the reward stage's, and a
    task without gold calls is said out loud (its turn rewards stay 0)."""
    gold = (({"name": "f", "arguments": {"x": 0}},),)
    task = dataclasses.replace(_task(0), gold_calls=gold)
    trajs = [_traj(2, 0, 1.0), _traj(2, 0, 0.0)]
    cfg = _cfg("matchtir")
    signals = compute_signals(resolve_method(cfg), trajs, [task, _task(0)], cfg)
    assert signals["turn_rewards"][0, 0] == pytest.approx(1.0)  # f(x=0) is the gold call exactly
    assert (signals["turn_rewards"][1] == 0).all()
    assert "1 of 2 trajectories' tasks lack gold_calls" in caplog.text


def test_methods_registry_refuses_unprovided_inputs():
    assert {"grpo", "matchtir", "turnsight"} <= set(METHODS)
    assert resolve_method(_cfg("turnsight")).describe() == (
        "method turnsight: rollout sampler, rewards [outcome], advantage turnsight(grpo), loss [clipped_surrogate]")
    mt = resolve_method(dataclasses.replace(_cfg("turnsight"), algo=AlgoConfig(method="turnsight", base="matchtir")))
    assert [r.name for r in mt.rewards] == ["outcome", "matchtir_turns"] and mt.needs_views and not mt.needs_ref
    if "needs_turn_rewards_test" not in METHODS:
        register_method(Method("needs_turn_rewards_test", advantage="matchtir", rewards=("outcome",)))
    with pytest.raises(ConfigError, match=r"advantage 'matchtir' reads \['turn_rewards'\], which no reward"):
        resolve_method(_cfg("needs_turn_rewards_test"))
    with pytest.raises(ConfigError, match="rl.base='turnsight' itself wraps a base method"):
        resolve_method(dataclasses.replace(_cfg(), algo=AlgoConfig(method="turnsight", base="turnsight")))
