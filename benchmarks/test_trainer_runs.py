"""Where a test suite's trainer run spends its time (issue 56): the method runs of
tests/_train_runs.py (the tests' sizes: 3 RL steps of 2 prompts x 4, from the supervised
warm-start) one after another in this one process, as the tests' trainer process runs them, with
JAX's compile events counted per run.

    python benchmarks/test_trainer_runs.py --warm-start DIR [--xla-flags FLAGS] rlsd sdpo
    python benchmarks/test_trainer_runs.py --warm-start DIR sdar sdar+model.attn_row_group=0

A run named METHOD+KEY=VALUE+... adds those config overrides (`--config.KEY=VALUE`) to the run of
configs/methods/METHOD.py, so one process compares a setting against its baseline.

DIR: a completed `sft/` folder (a test run's `<run folder>/warm-start/sft`, or one built with
`python -m turnsight_jax.sft` at tests/_train_runs.py's WARM_START sizes); without it the
warm-start is built first (about 100 CPU-s). XLA flags default to the tests' trainer process's
(tests/conftest.py TRAINER_XLA_FLAGS); the compilation cache is a fresh folder, as in a cold CI
run. Prints one row per run: CPU-seconds, wall seconds, XLA backend compile seconds and programs,
tracing + lowering seconds, and per step the update and rollout seconds the trainer logged.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import resource
import shutil
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("methods", nargs="+", help="configs/methods/<name>.py, run in this order")
    ap.add_argument("--warm-start", type=pathlib.Path, default=None)
    ap.add_argument("--xla-flags", default=None)
    args = ap.parse_args()

    scratch = pathlib.Path(tempfile.mkdtemp(prefix="trainer-runs-"))
    # tests/conftest.py (imported for the tests' flags, one definition) keeps its run's files in
    # this folder, which is removed at the end; the compilation cache starts empty, as in CI
    os.environ["TURNSIGHT_TEST_RUN_ROOT"] = str(scratch)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(scratch / "jax-cache")
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import TRAINER_XLA_FLAGS  # noqa: E402

    os.environ["XLA_FLAGS"] = args.xla_flags if args.xla_flags is not None else TRAINER_XLA_FLAGS
    os.environ["JAX_PLATFORMS"] = "cpu"
    try:
        import jax

        from _train_runs import SIZES, build_warm_start
        from turnsight_jax import train

        events: dict[str, list[float]] = collections.defaultdict(list)
        jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **_: events[name].append(secs))
        warm = args.warm_start or build_warm_start(scratch / "warm")
        rows = []
        for i, run in enumerate(args.methods):
            method, *overrides = run.split("+")
            workdir = scratch / f"{i}-{method}"
            shutil.copytree(warm, workdir / "sft")
            events.clear()
            c0, w0 = _cpu_s(), time.perf_counter()
            try:
                rc = train.main(["--config", str(REPO / "configs" / "methods" / f"{method}.py"),
                                 "--workdir", str(workdir), *SIZES, "--config.log.records_every=1",
                                 *(f"--config.{o}" for o in overrides)])
            except SystemExit as e:
                rc = e.code
            cpu, wall = _cpu_s() - c0, time.perf_counter() - w0
            if rc not in (None, 0):
                raise SystemExit(f"{method}: the trainer exited {rc}")
            steps = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in steps if "perf/update_s" in r]
            compile_s = events["/jax/core/compile/backend_compile_duration"]
            trace_s = sum(events["/jax/core/compile/jaxpr_trace_duration"]) + \
                sum(events["/jax/core/compile/jaxpr_to_mlir_module_duration"])
            rows.append((run, cpu, wall, sum(compile_s), len(compile_s), trace_s,
                         " / ".join(f"{r['perf/update_s']:.2f}" for r in steps),
                         " / ".join(f"{r['perf/rollout_s']:.2f}" for r in steps)))
        print(f"XLA_FLAGS={os.environ['XLA_FLAGS']}")
        print("| run | CPU-s | wall s | backend compile s (programs) | trace + lower s | update s per step | rollout s per step |")
        print("|---|---|---|---|---|---|---|")
        for m, cpu, wall, comp, n, trace, upd, roll in rows:
            print(f"| {m} | {cpu:.1f} | {wall:.1f} | {comp:.1f} ({n}) | {trace:.1f} | {upd} | {roll} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
