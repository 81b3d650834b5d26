"""BFCL self-check: the environment + parser + official checker reproduce BFCL's verdicts.

Run::

    python -m turnsight_jax.envs.bfcl_selfcheck            # all 4 x 200 entries, 3 passes
    python -m turnsight_jax.envs.bfcl_selfcheck --limit 20 --passes 1   # quick look

For every entry of base, miss_func, miss_param and long_context a scripted policy writes the
ground-truth calls of each user turn as Qwen3 `<tool_call>` text; the text goes through the
project's parser (`turnsight_jax.chat.parsing.parse_turn`) and the BFCL environment, then a turn
without calls ends the user turn, and the episode is scored by BFCL's `multi_turn_checker`.

Checks (exit code 1 if any fails):
  1. every entry passes (200/200 per category);
  2. removing one non-empty ground-truth call fails every entry; altering one argument value
     of one call fails it too wherever the backend can observe such a change (per entry, the
     first change the checker rejects is used). Entries where no alteration is observable are
     listed: e.g. base_139's only argument-bearing call re-adds a stock already on the
     watchlist, and the backend silently ignores unknown symbols, so every altered value leaves
     state and responses unchanged. Each entry must fail under removal or alteration;
  3. the full 800-entry pass takes under 60 s;
  4. repeating the full pass (3 times by default) grows neither the checker module's globals
     nor the process's resident memory (beyond 16 MiB between the 2nd and last pass).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
from typing import Any, Callable, Iterable, Sequence

from turnsight_jax.chat.parsing import parse_turn, render_tool_call
from turnsight_jax.chat.types import Task
from turnsight_jax.envs.bfcl import BFCL_CATEGORIES, BFCLEnv, check_episode, import_bfcl, load_tasks

GoldTurns = Sequence[Sequence[dict]]


def turn_text(calls: Iterable[dict]) -> str:
    """A policy turn that makes `calls`, in Qwen3 format."""
    return "\n".join(render_tool_call(c["name"], c["arguments"]) for c in calls)


def scripted_episode(env: BFCLEnv, task: Task, gold: GoldTurns | None = None) -> dict:
    """Plays `gold` (default: the task's ground truth) through parser + env; returns the verdict."""
    gold = task.gold_calls if gold is None else gold
    episode = env.start(task)
    try:
        for calls in gold:
            if calls:
                episode.step(parse_turn(turn_text(calls)).calls)
            episode.step(parse_turn("Done.").calls)  # no calls: ends the user turn
        return check_episode(episode)
    finally:
        episode.close()


def _alter_value(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 7
    if isinstance(value, str):
        return value + "_altered"
    if isinstance(value, list):
        return value[:-1] if value else ["altered"]
    if isinstance(value, dict):
        return {**value, "altered": 1}
    return "altered"


def variants(gold: GoldTurns, kind: str) -> Iterable[tuple[str, list[list[dict]]]]:
    """Single-call changes of a gold chain: each removal, or each one-argument alteration."""
    for t, turn in enumerate(gold):
        for i, call in enumerate(turn):
            if kind == "remove":
                changed = [list(x) for x in gold]
                del changed[t][i]
                yield f"remove turn {t} call {i} ({call['name']})", changed
                continue
            for key in call["arguments"]:
                changed = [list(x) for x in gold]
                args = copy.deepcopy(dict(call["arguments"]))
                args[key] = _alter_value(args[key])
                changed[t][i] = {"name": call["name"], "arguments": args}
                yield f"alter turn {t} call {i} ({call['name']}.{key})", changed


def first_detected_change(env: BFCLEnv, task: Task, kind: str) -> tuple[str | None, int]:
    """The first single-call change the checker rejects, and how many changes were tried."""
    tried = 0
    for label, changed in variants(task.gold_calls, kind):
        tried += 1
        if not scripted_episode(env, task, changed)["valid"]:
            return label, tried
    return None, tried


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(limit: int | None = None, passes: int = 3, log: Callable[[str], None] = print) -> bool:
    """Runs all checks; logs a table; returns True when every check holds."""
    bfcl = import_bfcl()
    env = BFCLEnv()
    t0 = time.monotonic()
    tasks = {c: load_tasks(c, limit=limit) for c in BFCL_CATEGORIES}
    log(f"loaded {sum(map(len, tasks.values()))} entries in {time.monotonic() - t0:.1f} s")
    ok = True

    # 1 + 3: the full pass, timed.
    t0 = time.monotonic()
    failures: dict[str, list[str]] = {}
    for category, ts in tasks.items():
        failures[category] = [t.task_id for t in ts if not scripted_episode(env, t)["valid"]]
    full_pass_s = time.monotonic() - t0
    log(f"{'category':28s} {'pass':>9s} {'remove fails':>13s} {'alter fails':>12s}")

    # 2: removal and alteration.
    for category, ts in tasks.items():
        removed = [first_detected_change(env, t, "remove")[0] is not None for t in ts]
        altered = [first_detected_change(env, t, "alter")[0] is not None for t in ts]
        n = len(ts)
        passed = n - len(failures[category])
        log(f"{category:28s} {passed:>4d}/{n:<4d} {sum(removed):>7d}/{n:<5d} {sum(altered):>6d}/{n:<5d}")
        if failures[category]:
            log(f"  not passing: {failures[category][:10]}")
        unaltered = [t.task_id for t, a in zip(ts, altered) if not a]
        if unaltered:
            log(f"  no observable single-argument alteration: {unaltered}")
        undetected = [t.task_id for t, r, a in zip(ts, removed, altered) if not (r or a)]
        if passed != n or sum(removed) != n or undetected:
            ok = False
    n_all = sum(len(ts) for ts in tasks.values())
    log(f"full pass: {n_all} entries in {full_pass_s:.1f} s ({n_all / full_pass_s:.0f} episodes/s)")
    if limit is None and full_pass_s >= 60.0:
        log("FAIL: the full pass took 60 s or more")
        ok = False

    # 4: repeated passes leave nothing behind.
    module_globals = vars(bfcl["mt_utils"])
    sizes, rss = [], []
    for p in range(passes):
        for ts in tasks.values():
            for t in ts:
                scripted_episode(env, t)
        gc.collect()
        sizes.append(len(module_globals))
        rss.append(rss_bytes())
        log(f"pass {p + 1}: checker globals {sizes[-1]}, modules {len(sys.modules)}, "
            f"RSS {rss[-1] / 2**20:.1f} MiB")
    if len(set(sizes)) > 1:
        log(f"FAIL: checker module globals grew across passes: {sizes}")
        ok = False
    if passes >= 3 and rss[-1] - rss[1] > 16 * 2**20:
        log(f"FAIL: resident memory grew by {(rss[-1] - rss[1]) / 2**20:.1f} MiB after pass 2")
        ok = False
    log("OK" if ok else "SELF-CHECK FAILED")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None, help="entries per category (default all)")
    parser.add_argument("--passes", type=int, default=3, help="repeated passes for the leak check")
    args = parser.parse_args(argv)
    return 0 if run(limit=args.limit, passes=args.passes) else 1


if __name__ == "__main__":
    sys.exit(main())
