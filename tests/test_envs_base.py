"""The batched episode protocol: VectorEnv equals sequential stepping and is seed-deterministic."""

from __future__ import annotations

import dataclasses

import pytest

from turnsight_jax.chat.types import CallError, ToolCall
from turnsight_jax.envs.base import VectorEnv
from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import generate_tasks, gold_tool_calls

RANDOM_TOOL = "import random\ndef roll(name):\n    return random.randint(1, 10**9)\n"


def _with_random_tool(task):
    tools = task.tools + ({"type": "function", "function": {"name": "roll", "parameters": {}}},)
    return dataclasses.replace(task, tools=tools, codes={**task.codes, "roll": RANDOM_TOOL})


def _policy(task, turn):
    gold = gold_tool_calls(task)
    calls = list(gold[turn]) if turn < len(gold) else []
    return calls + [ToolCall("roll", {"name": "x"}), CallError("tool call 9: empty body")]


@pytest.fixture(scope="module")
def env():
    with FTRLEnv(num_workers=2, timeout_s=5.0) as e:
        yield e


def _play_vector(env, tasks, seeds):
    venv = VectorEnv(env)
    try:
        venv.start(tasks, seeds)
        log = []
        for turn in range(2):
            res = venv.step([_policy(t, turn) if i % 3 else None for i, t in enumerate(tasks)])
            log.append([None if r is None else r.observations for r in res])
        venv.step([[] for _ in tasks])
        return log, [s.metrics for s in venv.score([t.answer for t in tasks])]
    finally:
        venv.close()


def test_vector_env_equals_sequential_and_is_deterministic(env):
    tasks = [_with_random_tool(t) for t in generate_tasks(24, seed=1)]
    seeds = [100 + i for i in range(len(tasks))]
    log_a, metrics_a = _play_vector(env, tasks, seeds)
    log_b, metrics_b = _play_vector(env, tasks, seeds)
    assert log_a == log_b and metrics_a == metrics_b  # same seeds: same random draws
    log_c, _ = _play_vector(env, tasks, [s + 1 for s in seeds])
    assert log_c != log_a  # other seeds: other draws

    # Sequential episodes give exactly the vectorised observations.
    for i, task in enumerate(tasks):
        ep = env.start(task, seed=seeds[i])
        for turn in range(2):
            if i % 3 == 0:
                assert log_a[turn][i] is None
                continue
            obs = ep.step(_policy(task, turn)).observations
            assert obs == log_a[turn][i]
            assert obs[-1] == "tool call 9: empty body"
            assert obs[-2].isdigit()


def test_vector_env_checks_lengths(env):
    venv = VectorEnv(env)
    try:
        venv.start(generate_tasks(2))
        with pytest.raises(ValueError, match="2 episodes but 1 call lists"):
            venv.step([[]])
        with pytest.raises(ValueError, match="2 tasks but 1 seeds"):
            venv.start(generate_tasks(2), [0])
    finally:
        venv.close()
