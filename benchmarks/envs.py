"""Throughput of the tool environments.

    python benchmarks/envs.py [--ftrl PATH] [--calls 4000] [--bfcl-limit N]

Prints markdown tables:
  * the cost of the sandbox: FTRL tool calls per second through `ToolExecutor` with 1 and 2
    sandbox hosts (one fresh confined process per call), next to the same calls through the
    pre-issue-19 unsandboxed worker pool (`benchmarks/_unsandboxed_worker.py`, baseline only) in
    the same run, as a ratio (real FTRL tool code from the fixture rows, valid arguments built
    from each tool's schema; every call sent in one `run_many` batch);
  * the same for the built-in synthetic tasks (gold calls; a fresh tool source per task, so this
    includes compiling each source once), and for a CPU-bound tool (about 1 ms of Python work
    per call), where the tool code rather than the pipe round trip dominates;
  * latency: pool start (first call answered) and one call's round trip, sandbox vs baseline;
  * BFCL multi-turn episodes per second: ground-truth episodes through the parser and the
    environment, with and without the official checker (all four categories).

Everything runs on the CPU; no JAX is imported.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from turnsight_jax.envs import executor as executor_lib  # noqa: E402
from turnsight_jax.envs.executor import ToolExecutor, ToolRequest  # noqa: E402

SANDBOX = executor_lib._HOST_SCRIPT
BASELINE = str(REPO / "benchmarks" / "_unsandboxed_worker.py")

_SAMPLE = {"string": "ABC Factory", "integer": 2020, "number": 2.5, "boolean": True,
           "array": ["Paris"], "object": {"key": "value"}}


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [fmt(r) for r in rows])


def ftrl_requests(path: pathlib.Path, n: int) -> list[ToolRequest]:
    from turnsight_jax.envs.ftrl import load_tasks

    base = []
    for task in load_tasks(path):
        for tool in task.tools:
            fn = tool["function"]
            props = (fn.get("parameters") or {}).get("properties") or {}
            args = {k: (v["enum"][0] if v.get("enum") else _SAMPLE.get(v.get("type"), "x"))
                    for k, v in props.items()}
            base.append(ToolRequest(fn["name"], task.codes[fn["name"]], args))
    return [base[i % len(base)] for i in range(n)]


def synthetic_requests(n: int) -> list[ToolRequest]:
    from turnsight_jax.envs.synthetic import generate_tasks, gold_tool_calls

    out = []
    for task in generate_tasks(n):
        for turn in gold_tool_calls(task):
            for call in turn:
                out.append(ToolRequest(call.name, task.codes[call.name], call.arguments))
    return out[:n]


BUSY = "def busy(n):\n    s = 0\n    for i in range(n):\n        s += i * i\n    return s\n"


def cpu_bound_requests(n: int) -> list[ToolRequest]:
    """Calls whose tool code itself costs about a millisecond (20,000 loop iterations)."""
    return [ToolRequest("busy", BUSY, {"n": 20_000}) for _ in range(n)]


def _executor(workers: int, script: str) -> ToolExecutor:
    # The baseline speaks the same frames; pointing the pool at it is a benchmark-only switch.
    executor_lib._HOST_SCRIPT = script
    warn = executor_lib._warn_once
    if script == BASELINE:
        executor_lib._warn_once = lambda isolation: None  # it has no isolation to report
    try:
        return ToolExecutor(workers)
    finally:
        executor_lib._HOST_SCRIPT = SANDBOX
        executor_lib._warn_once = warn


def calls_per_second(requests: list[ToolRequest], workers: int, script: str = SANDBOX,
                     repeats: int = 3) -> float:
    best = 0.0
    with _executor(workers, script) as ex:
        ex.run_many(requests[: 4 * workers])  # warm the workers
        for _ in range(repeats):
            t0 = time.perf_counter()
            ex.run_many(requests)
            best = max(best, len(requests) / (time.perf_counter() - t0))
    return best


def latencies(script: str, calls: int = 200) -> tuple[float, float]:
    """(ms from creating a 1-host pool to its first answer, median ms of one call's round trip)."""
    req = ToolRequest("f", "def f(x):\n    return x + 1", {"x": 1})
    t0 = time.perf_counter()
    with _executor(1, script) as ex:
        ex.run(req)
        start = (time.perf_counter() - t0) * 1e3
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            ex.run(req)
            times.append((time.perf_counter() - t) * 1e3)
    return start, sorted(times)[len(times) // 2]


def bfcl_episodes_per_second(limit: int | None) -> tuple[float, float, int]:
    from turnsight_jax.chat.parsing import parse_turn
    from turnsight_jax.envs import bfcl
    from turnsight_jax.envs.bfcl_selfcheck import turn_text

    tasks = [t for c in bfcl.BFCL_CATEGORIES for t in bfcl.load_tasks(c, limit=limit)]
    env = bfcl.BFCLEnv()

    def play(task, check: bool):
        ep = env.start(task)
        for calls in task.gold_calls:
            if calls:
                ep.step(parse_turn(turn_text(calls)).calls)
            ep.step([])
        if check:
            assert bfcl.check_episode(ep)["valid"], task.task_id

    rates = []
    for check in (False, True):
        t0 = time.perf_counter()
        for task in tasks:
            play(task, check)
        rates.append(len(tasks) / (time.perf_counter() - t0))
    return rates[0], rates[1], len(tasks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ftrl", type=pathlib.Path,
                        default=REPO.parent / "shared" / "fixtures" / "ftrl" / "ftrl_test_sample.jsonl")
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--bfcl-limit", type=int, default=None, help="entries per category")
    args = parser.parse_args()

    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}")
    rows = []
    sources = []
    if args.ftrl.exists():
        sources.append(("FTRL fixture tools", ftrl_requests(args.ftrl, args.calls)))
    else:
        print(f"(no FTRL file at {args.ftrl}; skipping the FTRL row)")
    sources.append(("built-in synthetic tools", synthetic_requests(args.calls)))
    sources.append(("CPU-bound tool (~1 ms each)", cpu_bound_requests(args.calls // 4)))
    for label, reqs in sources:
        print(f"timing {label}: {len(reqs)} calls x 3, sandbox and baseline ...", flush=True)
        one = calls_per_second(reqs, 1)
        two = calls_per_second(reqs, 2)
        base = calls_per_second(reqs, 2, BASELINE)
        rows.append([label, f"{one:,.0f}", f"{two:,.0f}", f"{base:,.0f}", f"{two / base:.3f}x"])
    print()
    print(_table(rows, ["tool calls / s", "sandbox, 1 host", "sandbox, 2 hosts",
                        "baseline (unsandboxed), 2 workers", "sandbox / baseline"]))
    (s_start, s_call), (b_start, b_call) = latencies(SANDBOX), latencies(BASELINE)
    print()
    print(_table([["pool start to first answer (1 host)", f"{s_start:.1f}", f"{b_start:.1f}",
                   f"{s_start / b_start:.2f}x"],
                  ["one call, round trip (median of 200)", f"{s_call:.2f}", f"{b_call:.2f}",
                   f"{s_call / b_call:.2f}x"]],
                 ["latency, ms", "sandbox", "baseline (unsandboxed)", "sandbox / baseline"]))
    with ToolExecutor(1) as ex:
        print(f"\nsandbox isolation on this machine: {ex.isolation}")
    try:
        import bfcl_eval  # noqa: F401
    except ImportError:
        print("\n(bfcl-eval not installed; skipping BFCL)")
        return
    print("\ntiming BFCL episodes ...", flush=True)
    act, full, n = bfcl_episodes_per_second(args.bfcl_limit)
    print()
    print(_table([[f"BFCL multi-turn ({n} ground-truth episodes)", f"{act:,.0f}", f"{full:,.0f}"]],
                 ["episodes / s", "env only", "env + official checker"]))


if __name__ == "__main__":
    main()
