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

    python benchmarks/test_trainer_runs.py --trim-vocab 8192 rlsd rlsd

`--trim-vocab N` measures what a smaller head would save (the tests' model spends most of an
update in its 151,936 x 64 tied head): the bundled Qwen3 BPE cut to its first N tokens and the
merges among them (a valid byte-level BPE: any text still tokenizes, in more pieces), its special
tokens renumbered after them, and the tiny-default preset's vocabulary patched in this process
to fit. The warm-start is then built here too (`turnsight_jax.sft.main`, same sizes, this
process's XLA flags), and its time printed. A measurement, not a supported configuration.
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


def trimmed_tokenizer(n: int, out: pathlib.Path) -> int:
    """The bundled tokenizer cut to ids < n (+ its specials, renumbered n, n + 1, ...) -> out/;
    returns the model vocabulary that fits it (a multiple of 128)."""
    from turnsight_jax.assets import default_tokenizer_dir

    src = default_tokenizer_dir()
    tj = json.loads((src / "tokenizer.json").read_text())
    keep = {t: i for t, i in tj["model"]["vocab"].items() if i < n}
    tj["model"]["vocab"] = keep
    tj["model"]["merges"] = [m for m in tj["model"]["merges"] if m[0] in keep and m[1] in keep and m[0] + m[1] in keep]
    for k, added in enumerate(tj["added_tokens"]):
        added["id"] = n + k
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    decoder = sorted(cfg.get("added_tokens_decoder", {}).items(), key=lambda kv: int(kv[0]))
    cfg["added_tokens_decoder"] = {str(n + k): v for k, (_, v) in enumerate(decoder)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return -(-(n + len(tj["added_tokens"])) // 128) * 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("methods", nargs="+", help="configs/methods/<name>.py, run in this order")
    ap.add_argument("--warm-start", type=pathlib.Path, default=None)
    ap.add_argument("--xla-flags", default=None)
    ap.add_argument("--trim-vocab", type=int, default=0, help="N: the bundled tokenizer cut to N tokens (above)")
    args = ap.parse_args()
    if args.trim_vocab and args.warm_start:
        ap.error("--trim-vocab builds its own warm-start (a full-vocabulary one does not fit the trimmed model); "
                 "drop --warm-start")

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

        from _train_runs import SIZES, WARM_START, build_warm_start
        from turnsight_jax import train

        extra = []
        if args.trim_vocab:
            import dataclasses

            from turnsight_jax.models import config as model_config

            vocab = trimmed_tokenizer(args.trim_vocab, scratch / "tokenizer")
            model_config.PRESETS["tiny-default"] = dataclasses.replace(model_config.PRESETS["tiny-default"],
                                                                       vocab_size=vocab)
            extra = [f"--config.tokenizer_path={scratch / 'tokenizer'}"]
            print(f"trimmed tokenizer: {args.trim_vocab} tokens + specials, model vocabulary {vocab}")

        events: dict[str, list[float]] = collections.defaultdict(list)
        jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **_: events[name].append(secs))
        if args.trim_vocab and not args.warm_start:
            from turnsight_jax import sft

            c0, w0 = _cpu_s(), time.perf_counter()
            sft.main(["--config", str(REPO / "configs" / "methods" / "rlsd.py"), "--workdir", str(scratch / "warm"),
                      *WARM_START, *extra])
            print(f"warm-start (in this process): {time.perf_counter() - w0:.1f} s wall, {_cpu_s() - c0:.1f} CPU-s")
            warm = scratch / "warm" / "sft"
        else:
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
                                 *extra, *(f"--config.{o}" for o in overrides)])
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
                         " / ".join(f"{r['perf/rollout_s']:.2f}" for r in steps),
                         " / ".join(f"{r['rollout/reward_mean']:.2f}" for r in steps)))
        print(f"XLA_FLAGS={os.environ['XLA_FLAGS']}")
        print("| run | CPU-s | wall s | backend compile s (programs) | trace + lower s | update s per step | "
              "rollout s per step | mean reward per step |")
        print("|---|---|---|---|---|---|---|---|")
        for m, cpu, wall, comp, n, trace, upd, roll, reward in rows:
            print(f"| {m} | {cpu:.1f} | {wall:.1f} | {comp:.1f} ({n}) | {trace:.1f} | {upd} | {roll} | {reward} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
