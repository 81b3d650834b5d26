"""Two JAX processes x 4 CPU devices against one process x 8: equality, the split of the rollouts,
a preemption and its resume, and the wall times.

    python benchmarks/multiprocess.py                 # ~16 minutes on the 2-core box
    python benchmarks/multiprocess.py --warm RUN      # reuse RUN/sft, a finished warm start (~5 minutes)
    python benchmarks/multiprocess.py --args "--config.rl.method=grpo --config.rl.rollout=bar"  # another method

Warm-starts the tiny config once (its default SFT, one process), then trains 3 RL steps from
that checkpoint three ways: (a) 2 processes (launch/local_multiprocess.sh),
(b) 1 process, (c) 2 processes, one of them sent SIGTERM once step 1 is logged, then the same
command again (it resumes from the checkpoint the stop wrote). Checks, and exits 1 if any fails:
- every non-timing metric of (a) and (c) equals (b)'s, and the final parameters too;
- each process of (a) ran only its own episodes' tool calls: the per-process episode counts add
  up to the step's episodes and the per-process tool calls to (b)'s (the split is by batch rows,
  whole prompt groups, a partition of the rows: `distributed.rollout_share`);
- (c) stopped cleanly (exit 0 with a checkpoint before step 3), and its resumed steps equal (a)'s.

Sampling uses top-k 20 (Qwen3's recommended setting): at top-k 0 a random model's distribution
over 151,936 tokens is so flat that the last-bit differences between a 4-device and an 8-device
rollout (the policy's copy is sharded differently) move draws to neighbouring token ids, and the
runs would diverge for that reason alone. (Not a pytest test: these trainings are too long for
`.ci/run`, which allows no skips.)
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import machine, table  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 3
PROMPTS, GROUP = 4, 2
# The RL runs start from the warm-started checkpoint (a random model calls no tools: the split of
# the tool calls would go untested); entropy_coef > 0 keeps the gradient non-zero in any case.
ARGS = [f"--config.train.steps={STEPS}",
        f"--config.train.prompts_per_step={PROMPTS}", f"--config.train.group_size={GROUP}",
        "--config.data.num_eval=2", "--config.eval.max_turns=2", "--config.loss.entropy_coef=0.1",
        "--config.rollout.top_k=20"]
TRAIN = [sys.executable, "-m", "turnsight_jax.train"]


def _env(**extra):
    drop = ("XLA_", "JAX_", "TURNSIGHT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


ONE_PROCESS = dict(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")


def _two(workdir: pathlib.Path, port: int, args: list[str]) -> list[str]:
    return [str(REPO_ROOT / "launch" / "local_multiprocess.sh"), "2", "--devices", "4", "--port", str(port), "--",
            *TRAIN, "--workdir", str(workdir), *args]


def _run(cmd, env, what: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0, proc.stdout + proc.stderr


def _pid_of_process(workdir: pathlib.Path, index: int) -> int | None:
    """The trainer process with JAX_PROCESS_ID=index working in `workdir` (from /proc)."""
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"turnsight_jax.train" in cmd and str(workdir).encode() in cmd and f"JAX_PROCESS_ID={index}".encode() in env:
            return int(d.name)
    return None


def _preempted(workdir: pathlib.Path, port: int, args: list[str]) -> tuple[float, str, int]:
    """Run (c): SIGTERM to process 1 once step 1 is in metrics.jsonl. Returns (wall, output, step
    of the checkpoint the stop wrote)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(_two(workdir, port, args), cwd=REPO_ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = workdir / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        time.sleep(0.5)
    pid = _pid_of_process(workdir, 1)
    if pid is None:
        proc.kill()
        sys.exit("preemption run: process 1 not found (did the run end before step 2?)")
    os.kill(pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"preempted run did not stop cleanly (exit {proc.returncode}):\n{out[-3000:]}")
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    return time.perf_counter() - t0, out, steps[-1] if steps else -1


def _params(run: pathlib.Path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(glob.glob(str(run / "export" / "*.safetensors"))):
        out.update(load_file(f))
    return out


def _metrics(run: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _compare(a: list[dict], b: list[dict], name: str, problems: list[str]) -> tuple[int, float]:
    """Every non-timing metric of b's steps in a; returns (values compared, worst relative diff)."""
    compared, worst = 0, 0.0
    if len(a) != len(b):
        problems.append(f"{name}: steps logged {len(a)} vs {len(b)}")
    for step, (x, y) in enumerate(zip(a, b)):
        if not x["train/grad_norm"] > 0:
            problems.append(f"{name} step {step}: zero gradient, the comparison proves nothing")
        for k, v in y.items():  # timings and the sampler/trainer round-off diagnostics aside
            if isinstance(v, (int, float)) and not k.startswith(("perf/", "train/tis/logprob_diff", "dist/")):
                if k not in x:
                    problems.append(f"{name} step {step}: {k} missing")
                    continue
                compared += 1
                d = abs(x[k] - v)
                worst = max(worst, d / max(abs(v), 1e-7))
                if d > 1e-5 * abs(v) + 1e-7:
                    problems.append(f"{name} step {step} {k}: {x[k]} vs {v}")
    return compared, worst


def _param_diff(a: pathlib.Path, b: pathlib.Path, name: str, problems: list[str]) -> float:
    pa, pb = _params(a), _params(b)
    if pa.keys() != pb.keys() or not pa:
        problems.append(f"{name}: exported parameters differ in names")
        return float("nan")
    diff = max(float(np.abs(pa[k].astype(np.float32) - pb[k].astype(np.float32)).max()) for k in pa)
    if diff > 1e-6:
        problems.append(f"{name}: final parameters differ by {diff:.3g}")
    return diff


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm", default="", help="reuse this warm-start run folder (its sft/ is complete) instead of "
                                             "making one (~11 minutes)")
    ap.add_argument("--args", default="", help="more --config overrides for the three RL runs (e.g. a rollout "
                                              "controller: groups of unequal size, a batch of prompts x R rows)")
    opts = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="multiprocess-"))
    warm, two, one, cut = tmp / "warm", tmp / "two", tmp / "one", tmp / "preempted"
    if opts.warm:
        warm, t_warm = pathlib.Path(opts.warm).absolute(), 0.0
        if not (warm / "sft" / "SFT_DONE").is_file():
            sys.exit(f"--warm {warm}: no finished warm start there ({warm / 'sft' / 'SFT_DONE'} is missing)")
    else:
        t_warm, _ = _run([*TRAIN, "--workdir", str(warm), "--config.train.steps=0", "--config.data.num_eval=0"],
                         _env(**ONE_PROCESS), "warm-start")
    print(f"warm-start (SFT, 1 process): {t_warm:.1f} s{' (reused)' if opts.warm else ''}", flush=True)
    import shlex

    args = [f"--config.model.hf_path={warm / 'sft'}", *ARGS, *shlex.split(opts.args)]
    t_two, _ = _run(_two(two, 12611, args), _env(), "2-process run")
    print(f"(a) 2 processes: {t_two:.1f} s", flush=True)
    t_one, _ = _run([*TRAIN, "--workdir", str(one), *args], _env(**ONE_PROCESS), "1-process run")
    print(f"(b) 1 process: {t_one:.1f} s", flush=True)
    t_cut, out_cut, saved = _preempted(cut, 12613, args)
    print(f"(c) 2 processes, SIGTERM to process 1 after step 1: stopped in {t_cut:.1f} s, checkpoint {saved}",
          flush=True)
    t_resume, out_resume = _run(_two(cut, 12615, args), _env(), "resumed run")
    print(f"(c) resumed: {t_resume:.1f} s", flush=True)

    problems: list[str] = []
    a, b, c = _metrics(two), _metrics(one), _metrics(cut)
    n_ab, worst_ab = _compare(a, b, "2 vs 1 process", problems)
    n_cb, worst_cb = _compare(c, b, "preempted + resumed vs 1 process", problems)
    diff_ab = _param_diff(two, one, "2 vs 1 process", problems)
    diff_cb = _param_diff(cut, one, "preempted + resumed vs 1 process", problems)

    calls_two = [[x.get(f"dist/tool_calls_p{p}", float("nan")) for p in (0, 1)] for x in a]
    calls_one = [x["rollout/tool_calls"] for x in b]
    for step, x in enumerate(a):
        # the episodes in groups (a controller that forms its own groups: as many as the 1-process run's)
        episodes = b[step].get("rollout/rows_in_groups", PROMPTS * GROUP)
        eps = [x.get(f"dist/episodes_p{p}", 0.0) for p in (0, 1)]
        if sum(eps) != episodes or min(eps) <= 0:
            problems.append(f"step {step}: episodes per process {eps}, expected a split of {episodes}")
        if sum(calls_two[step]) != calls_one[step]:
            problems.append(f"step {step}: tool calls per process {calls_two[step]} do not add up to the "
                            f"1-process run's {calls_one[step]}")
    if sum(calls_one) == 0:
        problems.append("no tool calls at all: the split of the tool calls went untested")
    signalled = "[p1] process 1: received SIGTERM" in out_cut and "[p0] process 0: received SIG" not in out_cut
    if not 0 < saved < STEPS or f"stopped after step {saved} (checkpoint {saved} written by all processes)" not in out_cut \
            or not signalled:
        problems.append(f"preemption: checkpoint {saved} (expected one before step {STEPS}, written after the signal "
                        f"to process 1 only: {signalled})")
    if f"resumed from {cut}/checkpoints/{saved}" not in out_resume:
        problems.append(f"the restart did not resume from checkpoint {saved}")

    print(f"\n{STEPS} RL steps of the tiny config from its warm start ({t_warm:.0f} s), {PROMPTS} prompts x {GROUP}; "
          f"{machine()}")
    print(table([
        ["wall (start-up, evaluation, 3 steps, export)", f"{t_two:.1f} s", f"{t_one:.1f} s",
         f"{t_cut:.1f} + {t_resume:.1f} s", f"{t_two / t_one:.2f}x"],
        ["metrics compared with the 1-process run (non-timing)", f"{n_ab}", "", f"{n_cb}",
         f"worst relative difference {max(worst_ab, worst_cb):.2g}"],
        ["final parameters: max abs difference from the 1-process run", f"{diff_ab:.2g}", "", f"{diff_cb:.2g}", ""],
        ["tool calls per step (process 0 + process 1)", ", ".join(f"{p0:g} + {p1:g}" for p0, p1 in calls_two),
         ", ".join(f"{x:g}" for x in calls_one), "", "sums equal" if all(
             sum(x) == y for x, y in zip(calls_two, calls_one)) else "MISMATCH"],
        ["episodes per step (process 0 + process 1)", " + ".join(
            f"{a[0].get(f'dist/episodes_p{p}', 0):g}" for p in (0, 1)), f"{episodes}", "", ""],
        ["preemption", "", "", f"SIGTERM to process 1 during step 2: both stopped after step {saved}, "
         "exit 0; the restart resumed there", ""],
    ], ["", "(a) 2 processes x 4 devices", "(b) 1 process x 8 devices", "(c) 2 processes, preempted + resumed",
        "ratio / check"]))
    for p in problems:
        print("MISMATCH:", p)
    print("equal: yes" if not problems else "equal: NO")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
