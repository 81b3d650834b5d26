"""Isolation of dataset tool code: limits, crashes and recovery (one fresh process per call)."""

from __future__ import annotations

import time

import pytest

from turnsight_jax.envs.executor import ToolExecutor, ToolRequest

ERR = "an error occured when call f: "


@pytest.fixture(scope="module")
def ex():
    # A short wall limit keeps the suite fast; the 10 s default is checked separately.
    with ToolExecutor(2, timeout_s=1.0, memory_mb=512) as executor:
        yield executor


def _f(body: str, args=None) -> ToolRequest:
    return ToolRequest("f", "def f(x=None):\n" + "\n".join("    " + l for l in body.splitlines()),
                       {"x": 1} if args is None else args)


def _healthy(ex: ToolExecutor) -> None:
    outs = ex.run_many([ToolRequest("g", "def g(i):\n    return {'i': i}", {"i": i}) for i in range(8)])
    assert outs == [f'{{"i": {i}}}' for i in range(8)]


def test_results_follow_ftrl_text_rules(ex):
    assert ex.run(_f("return {'a': 'é', 'b': [1, 2]}")) == '{"a": "é", "b": [1, 2]}'
    assert ex.run(_f("return [1, None]")) == "[1, null]"
    assert ex.run(_f("return 3.5")) == "3.5"
    assert ex.run(_f("return None")) == "None"
    assert ex.run(_f("return 'plain'")) == "plain"
    assert ex.run(_f("raise ValueError('bad city')")) == ERR + "bad city"
    assert ex.run(_f("return 1", {"y": 2})) == ERR + "f() got an unexpected keyword argument 'y'"


def test_infinite_loop_times_out_and_pool_recovers(ex):
    t = time.monotonic()
    out = ex.run(_f("while True:\n    pass"))
    assert time.monotonic() - t < 2.5
    assert out == ERR + "Function f timed out after 1.000000 seconds."
    _healthy(ex)


def test_loop_that_ignores_signals_is_killed(ex):
    restarts = ex.restarts
    t = time.monotonic()
    out = ex.run(_f("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
                    "signal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"))
    assert time.monotonic() - t < 3.0
    assert out.startswith(ERR) and "timed out" in out
    # the sandbox host killed the call process; the host itself never ran tool code, so it stays
    assert ex.restarts == restarts
    _healthy(ex)


def test_memory_bomb_is_an_error(ex):
    out = ex.run(_f("l = []\nwhile True:\n    l.append(' ' * 10**6)"))
    assert out.startswith(ERR)
    assert "memory" in out.lower() or "timed out" in out
    assert ex.run(_f("return 'a' * (10 ** 10)")) == ERR + "MemoryError: memory limit of 512 MiB exceeded"
    _healthy(ex)


def test_segfault_and_os_exit_cost_one_call(ex):
    before = set(ex.worker_pids)
    out = ex.run(_f("import ctypes\nctypes.string_at(0)"))
    assert out == ERR + "tool process was killed by SIGSEGV"
    out = ex.run(_f("import os\nos._exit(7)"))
    assert out == ERR + "tool process exited with code 7"
    out = ex.run(_f("import sys\nsys.exit(3)"))
    assert out == ERR + "3"  # SystemExit is caught inside the call process
    assert set(ex.worker_pids) == before  # each crash took only its own call process
    assert len(ex.worker_pids) == 2
    _healthy(ex)


def test_large_output_is_truncated(ex):
    out = ex.run(_f("return 'y' * (1 << 20)"))
    assert out.startswith("y" * 16384)
    assert len(out) < 16500
    assert out.endswith(f"[output truncated: {(1 << 20) - 16384} more characters]")


def test_printing_and_stdin_cannot_corrupt_the_protocol(ex):
    assert ex.run(_f("print('x' * 100000)\nimport os\nos.write(1, b'junk')\nreturn 'ok'")) == "ok"
    assert ex.run(_f("return input()")) == ERR + "EOF when reading a line"


def test_arguments_with_python_source_are_plain_strings(ex, tmp_path):
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    assert ex.run(_f("return x", {"x": payload})) == payload
    assert ex.run(_f("return type(x).__name__", {"x": payload})) == "str"
    assert not marker.exists()


def test_source_is_compiled_once_per_source_and_namespace_is_fresh_per_call(ex):
    src = "STATE = []\ndef f(x):\n    STATE.append(x)\n    return len(STATE)"
    # Fresh namespace every call (FTRL re-execs the source), so module state never accumulates.
    assert ex.run_many([ToolRequest("f", src, {"x": i}) for i in range(6)]) == ["1"] * 6
    assert ex.run(ToolRequest("f", "def f(:\n  pass", {})) == ERR + "invalid syntax (<string>, line 1)"


def test_seeded_randomness_is_deterministic(ex):
    src = "import random\ndef f(x):\n    return random.random()"
    a = ex.run_many([ToolRequest("f", src, {"x": 0}, seed=s) for s in (1, 2, 1, 2)])
    assert a[0] == a[2] and a[1] == a[3] and a[0] != a[1]


@pytest.mark.slow
def test_default_limit_is_ten_seconds():
    with ToolExecutor(1) as executor:
        assert executor.limits.timeout_s == 10.0
        t = time.monotonic()
        out = executor.run(_f("import time\ntime.sleep(60)"))
        elapsed = time.monotonic() - t
    assert out == ERR + "Function f timed out after 10.000000 seconds."
    assert 9.9 <= elapsed < 11.0


def test_failures_inside_a_batch_cost_only_their_own_call(ex):
    ok = [ToolRequest("g", "def g(i):\n    return i * 10", {"i": i}) for i in range(40)]
    bad = {5: _f("import ctypes\nctypes.string_at(0)"), 17: _f("while True:\n    pass"),
           23: _f("import os\nos._exit(1)"), 31: _f("raise KeyError('k')")}
    reqs = [bad.get(i, r) for i, r in enumerate(ok)]
    t = time.monotonic()
    outs = ex.run_many(reqs)
    assert time.monotonic() - t < 4.0
    assert outs[5] == ERR + "tool process was killed by SIGSEGV"
    assert outs[17] == ERR + "Function f timed out after 1.000000 seconds."
    assert outs[23] == ERR + "tool process exited with code 1"
    assert outs[31] == ERR + "'k'"
    assert [o for i, o in enumerate(outs) if i not in bad] == [
        str(i * 10) for i in range(40) if i not in bad]
    _healthy(ex)


def _numbered(i: int) -> ToolRequest:
    """A tool of its own source per i, whose result names both its source and its call."""
    return ToolRequest("f", f"def f(x):\n    return 'src{i}-' + str(x)", {"x": i})


def test_every_reply_lands_with_its_call_past_the_hosts_source_cache():
    """Issue 57, item 1, at its real threshold: one host sees 4,100 distinct tool sources (its
    cache holds 4,096, first in first out); then frames of 10 calls mixing evicted sources with
    new and cached ones. Every reply is its own call's (before the fix the reply of the call after an
    evicted one came back as its answer, and every later one shifted)."""
    from turnsight_jax.envs.executor import MAX_CACHED_SOURCES

    n = MAX_CACHED_SOURCES + 4
    with ToolExecutor(1, timeout_s=5.0) as one:
        for start in range(0, n, 64):
            batch = [_numbered(i) for i in range(start, min(start + 64, n))]
            assert one.run_many(batch) == [f"src{r.arguments['x']}-{r.arguments['x']}" for r in batch]
        assert len(one._all[0].known_keys) == MAX_CACHED_SOURCES  # the host's record, as the host keeps it
        # 40 calls a run_many: frames of 10 calls (executor chunks of len / 4 per worker)
        evicted, cached, new = list(range(40)), list(range(n - 40, n)), list(range(9000, 9040))
        for mix in (evicted[:20] + new[:20], [x for pair in zip(evicted[20:], cached[:20]) for x in pair],
                    new[20:] + evicted[:10] + cached[20:30]):
            assert one.run_many([_numbered(i) for i in mix]) == [f"src{i}-{i}" for i in mix]
        # random compositions (seeded): any order of sources the host evicted, holds and never saw,
        # each round evicting more of what the host held before it
        import random

        rng = random.Random(57)
        for round_ in range(8):
            pool = rng.sample(range(n), 30) + list(range(20_000 + 40 * round_, 20_000 + 40 * round_ + 10))
            mix = rng.sample(pool, len(pool))
            assert one.run_many([_numbered(i) for i in mix]) == [f"src{i}-{i}" for i in mix], (round_, mix)


def test_a_source_the_host_lost_is_sent_again_without_shifting_the_batch():
    """The trainer believes the host holds sources it does not (the need_source path: a host that
    forgot, whatever the reason): each such call is answered need_source, the host goes on with
    the batch, and the calls are sent again with their sources; replies are matched by id."""
    import hashlib
    import random

    rng = random.Random(0)
    with ToolExecutor(1, timeout_s=5.0) as one:
        worker = one._all[0]
        for round_ in range(6):
            ids = rng.sample(range(10_000 * (round_ + 1), 10_000 * (round_ + 1) + 200), 36)  # frames of 9
            lost = set(rng.sample(ids, rng.randint(1, 20)))
            for i in lost:  # claimed known, never sent
                worker.sent_source(hashlib.sha256(_numbered(i).source.encode()).hexdigest())
            assert one.run_many([_numbered(i) for i in ids]) == [f"src{i}-{i}" for i in ids], (round_, lost)
        _healthy(one)
