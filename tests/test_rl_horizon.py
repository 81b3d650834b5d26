"""Adaptive hindsight horizons (rl.horizon; rl.selection = "dependency" | "saturation"): the rules
against hand-computed choices on scripted gaps and scripted trajectories."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.chat import template as T
from turnsight_jax.chat.parsing import parse_turn, render_tool_call
from turnsight_jax.chat.tokenizer import encode, special_ids
from turnsight_jax.chat.trajectory import TrajectoryBuilder
from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts, tool_call_text
from turnsight_jax.rl.horizon import (dependency_batch, dependency_horizon, depth_index, gold_horizons, result_values,
                                      saturation_index, turn_dependencies)
from turnsight_jax.rl.turnsight import turnsight_advantages
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout


def test_saturation_rule_hand_computed():
    x = np.array([[0.10, 0.10, 0.10, -0.2],   # depth 1
                  [0.12, 0.30, 0.30, -0.2],   # depth 2
                  [0.50, 0.31, 0.60, -0.2]])  # depth 3
    # unit 0: |0.12-0.10| <= 0.05 -> depth 1; unit 1: 0.20 > tol, then 0.01 -> depth 2; unit 2: never
    # -> the largest depth; unit 3: equal gaps (depths clipped to one block) -> depth 1
    assert np.asarray(saturation_index(jnp.asarray(x), (1, 2, 3), 0.05)).tolist() == [0, 1, 2, 0]
    # the depths in another order: the same depths chosen, as indices into that order
    perm = [2, 0, 1]  # config (3, 1, 2)
    got = np.asarray(saturation_index(jnp.asarray(x[perm]), (3, 1, 2), 0.05))
    assert [(3, 1, 2)[i] for i in got] == [1, 2, 3, 1]
    # a larger tolerance stops earlier
    assert np.asarray(saturation_index(jnp.asarray(x), (1, 2, 3), 0.25)).tolist() == [0, 0, 0, 0]
    assert np.asarray(saturation_index(jnp.asarray(x[:1]), (1,), 0.05)).tolist() == [0, 0, 0, 0]
    # inside TurnSight: four turns of two tokens whose gaps are the columns above (turn means)
    tids = np.repeat(np.arange(4), 2)[None].astype(np.int32)
    delta = np.repeat(x, 2, axis=1)[:, None, :].astype(np.float32)
    mask = np.ones((1, 8), bool)
    out = turnsight_advantages(jnp.asarray(delta), jnp.asarray(mask), jnp.asarray(tids), jnp.zeros(1, jnp.int32),
                               jnp.ones((1, 8), jnp.float32), selection="saturation", horizon_tol=0.05, max_turns=4,
                               num_groups=1)
    assert np.asarray(out["selected_depth"])[0, ::2].tolist() == [0, 1, 2, 0]
    np.testing.assert_allclose(np.asarray(out["delta_bar"])[0, ::2], [0.10, 0.30, 0.60, -0.2], atol=1e-6)
    assert (np.asarray(out["horizon"]) == -1).all()  # no dependency matrix given


def test_depth_index_covers_the_horizon():
    h = jnp.asarray([1, 2, 3, 4, 7])
    assert np.asarray(depth_index(h, (1, 2, 3))).tolist() == [0, 1, 2, 2, 2]
    assert [(1, 3)[i] for i in np.asarray(depth_index(h, (1, 3)))] == [1, 3, 3, 3, 3]
    assert [(4, 2)[i] for i in np.asarray(depth_index(h, (4, 2)))] == [2, 2, 4, 4, 4]


def test_dependency_horizon_hand_computed():
    # 5 turns: 1 uses 0; 2 uses 1; 3 uses 0 only; 4 uses nothing
    uses = np.zeros((1, 5, 5), bool)
    uses[0, 1, 0] = uses[0, 2, 1] = uses[0, 3, 0] = True
    # h0: 1 uses {0}, 2 uses {0,1} (1), 3 uses {0..2} (0), 4 uses none -> 4; h1: 2 uses {1}, 3 uses {1,2}? no -> 2
    # h2: 3 uses {2}? no -> 1; h3: 4 -> 1; h4 -> 1
    assert np.asarray(dependency_horizon(jnp.asarray(uses))).tolist() == [[4, 2, 1, 1, 1]]
    # a use of a turn after k never counts for turns before it: entries j <= i are ignored
    uses[0, 0, 3] = uses[0, 2, 2] = True
    assert np.asarray(dependency_horizon(jnp.asarray(uses))).tolist() == [[4, 2, 1, 1, 1]]


def test_result_values():
    assert result_values("Bob") == {"bob"}
    assert result_values('{"city": "Paris", "temp": 18, "ok": true, "x": "a"}') == {"paris", "18"}
    assert result_values("an error occured when call get_city: 'Bob'") == set()
    assert result_values("  ") == set()


@pytest.fixture(scope="module")
def chains(tok):
    """A 3-hop gold chain, and the same chain after a wasted call whose result nothing uses."""
    task = generate_task("multi_hop", 5, SyntheticConfig(hops=3))
    gold = gold_turn_texts(task)
    first = task.gold_calls[0][0]
    other = next(t["function"]["name"] for t in task.tools if t["function"]["name"] != first["name"]
                 and t["function"]["name"] not in {c[0]["name"] for c in task.gold_calls})
    wasted = [tool_call_text(other, dict(first["arguments"]))] + gold
    with FTRLEnv(num_workers=1) as env:
        res = rollout(ReplayPolicy(tok, [gold, wasted]), env, [task], tokenizer=tok, group_size=2,
                      config=RolloutConfig(max_turns=6, max_response_tokens=4096))
    return task, res.trajectories


def test_dependency_rule_on_scripted_trajectories(chains):
    task, (gold, wasted) = chains
    uses = turn_dependencies(gold)
    want = np.zeros((4, 4), bool)
    want[1, 0] = want[2, 1] = True  # each hop's call takes the previous hop's result
    np.testing.assert_array_equal(uses, want)
    assert np.asarray(dependency_horizon(jnp.asarray(uses)[None]))[0].tolist() == [3, 2, 1, 1]
    # the wasted call's result feeds nothing: horizon 1; the chain after it as before
    assert np.asarray(dependency_horizon(jnp.asarray(turn_dependencies(wasted))[None]))[0].tolist() == [1, 3, 2, 1, 1]
    assert gold_horizons(task) == [3, 2, 1, 1]
    assert gold_horizons(generate_task("parallel_multi_hop", 1, SyntheticConfig(hops=4))) == [4, 3, 2, 1, 1]

    # inside TurnSight: the chosen depth per turn, with scripted gaps the rule ignores
    trajs = [gold, wasted]
    k = 6
    turn_uses = dependency_batch(trajs, k)
    t = max(x.length for x in trajs)
    mask = np.zeros((2, t), bool)
    tids = np.full((2, t), -1, np.int32)
    for b, x in enumerate(trajs):
        mask[b, :x.length] = x.policy_mask
        tids[b, :x.length] = x.turn_ids
    delta = np.random.default_rng(0).normal(size=(2, 2, t)).astype(np.float32)
    base = np.where(mask, 1.0, 0.0).astype(np.float32)
    out = turnsight_advantages(jnp.asarray(delta), jnp.asarray(mask), jnp.asarray(tids), jnp.zeros(2, jnp.int32),
                               jnp.asarray(base), selection="dependency", depths=(1, 3), max_turns=k,
                               turn_uses=jnp.asarray(turn_uses), num_groups=1)
    sel, hor = np.asarray(out["selected_depth"]), np.asarray(out["horizon"])
    per_turn = [[int(sel[b, np.flatnonzero(tids[b] == j)[0]]) for j in range(x.num_turns)] for b, x in enumerate(trajs)]
    # h = 3, 2, 1, 1 -> the smallest of depths (1, 3) covering it: 3, 3, 1, 1 (indices 1, 1, 0, 0)
    assert per_turn == [[1, 1, 0, 0], [0, 1, 1, 0, 0]]
    assert [[int(hor[b, np.flatnonzero(tids[b] == j)[0]]) for j in range(x.num_turns)] for b, x in enumerate(trajs)] \
        == [[3, 2, 1, 1], [1, 3, 2, 1, 1]]
    assert (hor[~mask] == -1).all()
    # the selected gap is the chosen depth's turn mean
    x_star = np.asarray(out["delta_bar"])
    for b, x in enumerate(trajs):
        for j in range(x.num_turns):
            at = tids[b] == j
            assert x_star[b, at][0] == pytest.approx(delta[per_turn[b][j], b, at].mean(), abs=1e-6)
    with pytest.raises(ValueError, match="needs turn_uses"):
        turnsight_advantages(jnp.asarray(delta), jnp.asarray(mask), jnp.asarray(tids), jnp.zeros(2, jnp.int32),
                             jnp.asarray(base), selection="dependency", depths=(1, 3), max_turns=k, num_groups=1)


def test_dependency_reads_arguments_and_json_results(tok):
    """Hand-built: a JSON result whose value a later argument contains as a word; an error result
    and a malformed call offer nothing; a one-character value is ignored."""
    sp = special_ids(tok)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    b = TrajectoryBuilder(T.prompt_ids(tok, [{"role": "user", "content": "q"}], tools, enable_thinking=False), 0, "t",
                          im_start_id=sp.im_start, im_end_id=sp.im_end)
    turns = [
        (render_tool_call("find", {"q": "x"}), [json.dumps({"city": "Paris", "n": "7"})]),
        (render_tool_call("err", {"q": "y"}), ["an error occured when call err: 'Lyon'"]),
        (render_tool_call("weather", {"where": "old town of paris", "days": 7}), ["sunny"]),
        (render_tool_call("g", {"q": "Lyon"}) + "\n" + render_tool_call("h", {"q": "Sunny"}), ["a", "b"]),
        ("<answer>done</answer>", None),
    ]
    for text, results in turns:
        parsed = parse_turn(text)
        ids = encode(tok, text + "<|im_end|>")
        b.add_policy_turn(ids, [-0.1] * len(ids), text, parsed.calls, parsed.answer)
        if results is not None:
            s = T.observation_suffix_ids(tok, results, enable_thinking=False)
            b.add_observation(s.ids, results, s.result_spans, s.header_offset)
    uses = turn_dependencies(b.build(finish_reason="answer"))
    assert np.argwhere(uses).tolist() == [[2, 0], [3, 2]]  # "paris" in turn 2; "sunny" in turn 3 (not "Lyon")
    # "7" is one character: not a value; an "unavailable" fault's result offers nothing either
    assert turn_dependencies(b.build(finish_reason="answer"), faults=[[[]], [[]], [["unavailable"]], [[], []], []]) \
        .nonzero()[0].tolist() == [2]


def test_dependency_selection_through_the_batch_and_the_step(tok, chains):
    """make_train_batch carries turn_uses for rl.selection="dependency" (only then); the step's
    advantage stage chooses per turn the depth covering the rule's horizon, reported per turn."""
    from turnsight_jax.rl.batch import make_train_batch
    from turnsight_jax.rl.config import AlgoConfig, StepConfig
    from turnsight_jax.rl.methods import resolve_method
    from turnsight_jax.rl.step import compute_advantages
    from turnsight_jax.rl.turn_records import turn_summaries

    task, trajs = chains
    cfg = StepConfig(algo=AlgoConfig(method="turnsight", base="grpo", selection="dependency", depths=(1, 3)),
                     group_size=2, max_turns=6)
    method = resolve_method(cfg)
    batch, _ = make_train_batch(trajs, [task, task], tok, cfg, method)
    np.testing.assert_array_equal(batch.turn_uses, dependency_batch(trajs, 6))
    vote = StepConfig(algo=AlgoConfig(method="turnsight", base="grpo"), group_size=2, max_turns=6)
    assert make_train_batch(trajs, [task, task], tok, vote, resolve_method(vote))[0].turn_uses is None
    teacher = np.random.default_rng(1).normal(size=(2,) + batch.pol_valid.shape).astype(np.float32)
    _, _, out = compute_advantages(batch, jnp.asarray(teacher), cfg, method, with_outputs=True)
    # per turn, as the trajectory records summarise them (rl.turn_records): the horizon and the
    # chosen depth index are constant over each turn
    turns = turn_summaries({"horizon": out["horizon"], "depth": out["selected_depth"]}, jnp.asarray(batch.turn_ids),
                           jnp.asarray(batch.pol_valid), 6)
    h_min, d_min = (np.asarray(turns[n]["min"]) for n in ("horizon", "depth"))
    assert (h_min == np.asarray(turns["horizon"]["max"]))[np.asarray(turns["count"]) > 0].all()
    got_h = [[int(h_min[b, k]) for k in range(t.num_turns)] for b, t in enumerate(trajs)]
    got_d = [[(1, 3)[int(d_min[b, k])] for k in range(t.num_turns)] for b, t in enumerate(trajs)]
    assert got_h == [[3, 2, 1, 1], [1, 3, 2, 1, 1]] and got_d == [[3, 3, 1, 1], [1, 3, 3, 1, 1]]
