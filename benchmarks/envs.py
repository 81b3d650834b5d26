"""Throughput of the tool environments.

    python benchmarks/envs.py [--ftrl PATH] [--calls 4000] [--bfcl-limit N]

Prints a markdown table:
  * FTRL tool calls per second through the isolated `ToolExecutor` with 1 and 2 worker processes
    (real FTRL tool code from the fixture rows, valid arguments built from each tool's schema;
    every call sent in one `run_many` batch), and the 2-vs-1 worker ratio;
  * the same for the built-in synthetic tasks (gold calls; a fresh tool source per task, so this
    includes compiling each source once), and for a CPU-bound tool (about 1 ms of Python work
    per call), where the tool code rather than the pipe round trip dominates;
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

from turnsight_jax.envs.executor import ToolExecutor, ToolRequest  # noqa: E402

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


def calls_per_second(requests: list[ToolRequest], workers: int, repeats: int = 3) -> float:
    best = 0.0
    with ToolExecutor(workers) as ex:
        ex.run_many(requests[: 4 * workers])  # warm the workers
        for _ in range(repeats):
            t0 = time.perf_counter()
            ex.run_many(requests)
            best = max(best, len(requests) / (time.perf_counter() - t0))
    return best


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
        print(f"timing {label}: {len(reqs)} calls x 3 ...", flush=True)
        one = calls_per_second(reqs, 1)
        two = calls_per_second(reqs, 2)
        rows.append([label, f"{one:,.0f}", f"{two:,.0f}", f"{two / one:.2f}x"])
    print()
    print(_table(rows, ["tool calls / s", "1 worker", "2 workers", "2 vs 1"]))
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
