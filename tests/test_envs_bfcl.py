"""BFCL multi-turn: scripted ground-truth policy through the real parser, env and official checker."""

from __future__ import annotations

import gc
import os
import time

import pytest

pytest.importorskip("bfcl_eval")

from turnsight_jax.chat.parsing import parse_turn  # noqa: E402
from turnsight_jax.chat.types import CallError, ToolCall  # noqa: E402
from turnsight_jax.envs import bfcl  # noqa: E402
from turnsight_jax.envs import bfcl_selfcheck as sc  # noqa: E402


@pytest.fixture(scope="module")
def tasks():
    return {c: bfcl.load_tasks(c) for c in bfcl.BFCL_CATEGORIES}


@pytest.fixture(scope="module")
def env():
    return bfcl.BFCLEnv()


def _by_id(tasks, task_id):
    category = task_id.rsplit("_", 1)[0]
    return next(t for t in tasks[category] if t.task_id == task_id)


def test_scripted_ground_truth_passes_200_of_200_in_each_category_under_60s(tasks, env):
    t0 = time.monotonic()
    for category, ts in tasks.items():
        assert len(ts) == 200
        verdicts = [sc.scripted_episode(env, t) for t in ts]
        failed = [(t.task_id, v) for t, v in zip(ts, verdicts) if not v["valid"]]
        assert not failed, failed[:2]
    assert time.monotonic() - t0 < 60.0


def test_removing_or_altering_one_call_fails_each_entry(tasks, env):
    unaltered = []
    for category, ts in tasks.items():
        for t in ts:
            removed, _ = sc.first_detected_change(env, t, "remove")
            assert removed is not None, t.task_id
            altered, _ = sc.first_detected_change(env, t, "alter")
            if altered is None:
                unaltered.append(t.task_id)
    # The one entry (in three categories) whose only argument-bearing call is a no-op in the
    # ground truth (see bfcl_selfcheck's docstring); removal still fails it.
    assert unaltered == ["multi_turn_base_139", "multi_turn_miss_param_139",
                         "multi_turn_long_context_139"]


def test_repeated_passes_leave_nothing_behind(tasks, env):
    module_globals = vars(bfcl.import_bfcl()["mt_utils"])
    baseline = set(module_globals)
    subset = [t for ts in tasks.values() for t in ts[:40]]
    sizes, rss = [], []
    for _ in range(3):
        for t in subset:
            assert sc.scripted_episode(env, t)["valid"]
        gc.collect()
        sizes.append(len(module_globals))
        rss.append(sc.rss_bytes())
    assert set(module_globals) == baseline
    assert sizes == [len(baseline)] * 3
    assert rss[2] - rss[1] < 8 * 2**20


def test_user_messages_as_bfcl_sends_them(tasks, env):
    t = _by_id(tasks, "multi_turn_miss_func_0")
    ep = env.start(t)
    q = t.extra["bfcl_entry"]["question"]
    assert t.messages == tuple(q[0])
    assert "sort" not in {x["function"]["name"] for x in t.tools}  # held out at first
    results = []
    for calls in t.gold_calls:
        if calls:
            ep.step(parse_turn(sc.turn_text(calls)).calls)
        results.append(ep.step([]))
    assert results[0].user_message == q[1][0]["content"]
    held = results[2]  # the user turn after turn 2 is the held-out-function turn (index 3)
    assert held.user_message.endswith(
        "\nI have updated some more functions you can choose from. What about now?")
    assert held.user_message.startswith("[{'name': 'sort', 'description': ")
    assert [x["function"]["name"] for x in held.added_tools] == ["sort"]
    assert results[-1].done and results[-1].user_message is None
    assert bfcl.check_episode(ep)["valid"]

    # miss_param: the clarification turn is the next user message; the policy makes no call.
    t = _by_id(tasks, "multi_turn_miss_param_0")
    assert t.gold_calls[3] == ()
    ep = env.start(t)
    msgs = []
    for calls in t.gold_calls:
        if calls:
            ep.step(parse_turn(sc.turn_text(calls)).calls)
        msgs.append(ep.step([]).user_message)
    qs = t.extra["bfcl_entry"]["question"]
    assert msgs[:-1] == [qs[i][0]["content"] for i in range(1, len(qs))]
    assert bfcl.check_episode(ep)["valid"]


def test_calls_outside_the_whitelist_are_refused(tasks, env):
    t = _by_id(tasks, "multi_turn_base_0")
    ep = env.start(t)
    state_before = dict(vars(ep.instances["GorillaFileSystem"]))
    res = ep.step([
        ToolCall("__import__", {"name": "os"}),
        ToolCall("_load_scenario", {"scenario": {}}),
        ToolCall("eval", {"source": "1+1"}),
        ToolCall("exit", {}),
        ToolCall("cd", {"folder": "document", "__class__": 1}),
        ToolCall("cd", {"folder": "__import__('os').system('touch /tmp/pwned_bfcl')"}),
        CallError("tool call 7: invalid JSON"),
    ])
    assert res.observations[0] == "Error during execution: name '__import__' is not defined"
    assert res.observations[1] == "Error during execution: name '_load_scenario' is not defined"
    assert res.observations[2] == "Error during execution: name 'eval' is not defined"
    assert res.observations[3] == "Error during execution: Function call exit is not allowed."
    assert res.observations[4] == "Error during execution: invalid argument name '__class__' for cd"
    # The argument is just a (bad) folder name to the backend.
    assert res.observations[5].startswith('{"error": "cd: __import__(')
    assert res.observations[6] == "tool call 7: invalid JSON"
    assert dict(vars(ep.instances["GorillaFileSystem"])).keys() == state_before.keys()
    # Only the whitelisted call with literal arguments becomes a checker call string.
    assert ep.call_strings == [[["cd(folder=\"__import__('os').system('touch /tmp/pwned_bfcl')\")"]]]


def test_call_string_is_literal_only():
    assert bfcl.call_string("cd", {"folder": "a'b"}) == "cd(folder=\"a'b\")"
    assert bfcl.call_string("f", {"x": [1, 2.5, None, True], "y": {"k": "v"}}) == (
        "f(x=[1, 2.5, None, True],y={'k': 'v'})")
    assert bfcl.call_string("f", {"x": float("nan")}) is None
    assert bfcl.call_string("f", {"a b": 1}) is None
    assert bfcl.call_string("f", {"lambda": 1}) is None
    assert bfcl.call_string("f", {"__class__": 1}) is None
    assert bfcl.call_string("os.system", {}) is None
    assert bfcl.call_string("__import__", {}) is None


def test_fresh_backend_per_rollout_and_wrong_calls_fail(tasks, env):
    t = _by_id(tasks, "multi_turn_base_0")
    a, b = env.start(t), env.start(t)
    a.step(parse_turn(sc.turn_text(t.gold_calls[0])).calls)
    assert a.instances["GorillaFileSystem"] is not b.instances["GorillaFileSystem"]
    assert vars(a.instances["GorillaFileSystem"]) != vars(b.instances["GorillaFileSystem"])
    # A policy that never calls anything fails.
    for _ in t.gold_calls:
        b.step([])
    assert b.done and not bfcl.check_episode(b)["valid"]
    assert b.score().reward == 0.0


def test_more_than_20_steps_in_a_turn_force_quits(tasks, env):
    t = _by_id(tasks, "multi_turn_base_0")
    ep = env.start(t)
    for i in range(21):
        res = ep.step([ToolCall("pwd", {})])
    assert res.done and ep.force_quit
    assert bfcl.check_episode(ep)["error_type"] == "multi_turn:force_terminated"


def test_the_bfcl_project_root_is_removed_when_its_process_exits(tmp_path):
    """bfcl-eval writes under BFCL_PROJECT_ROOT on import; the folder import_bfcl makes for it is the
    process's to remove at exit (an evaluate run used to leave one in the temporary folder each time)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "BFCL_PROJECT_ROOT"}
    env["TMPDIR"] = str(tmp_path)
    code = ("import os; from turnsight_jax.envs.bfcl import import_bfcl; import_bfcl(); "
            "root = os.environ['BFCL_PROJECT_ROOT']; print(root, os.path.isdir(root))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    root, existed = out.stdout.split()
    assert existed == "True" and root.startswith(str(tmp_path))
    assert not os.path.exists(root) and list(tmp_path.iterdir()) == []
