"""Two JAX processes x 4 CPU devices against one process x 8, same run: wall time and equality.

    python benchmarks/multiprocess.py        # ~7 minutes on the 2-core box

Trains the tiny config for 3 RL steps both ways (launch/local_multiprocess.sh for the first) and
checks that every non-timing metric and the final parameters agree; exits 1 if not. Rollout host
work is replicated on every process today (`distributed.to_host` all-gathers the decode outputs),
so this checks the global mesh, the step and the export across processes, not a split of the
rollouts. (Not a pytest test: two trainings are too long for `.ci/run`, which allows no skips.)
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import machine, table  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
# entropy_coef > 0: a random tiny model earns no reward, so without it the gradient is zero and
# equal parameters would prove nothing
ARGS = ["--config.sft.steps=0", "--config.sft.curriculum_steps=0", "--config.train.steps=3",
        "--config.train.prompts_per_step=4", "--config.train.group_size=2", "--config.data.num_eval=2",
        "--config.eval.max_turns=2", "--config.loss.entropy_coef=0.1"]


def _env(**extra):
    drop = ("XLA_", "JAX_", "TURNSIGHT_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


def _params(run: pathlib.Path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(glob.glob(str(run / "export" / "*.safetensors"))):
        out.update(load_file(f))
    return out


def main() -> int:
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="multiprocess-"))
    two, one = tmp_path / "two", tmp_path / "one"
    train = [sys.executable, "-m", "turnsight_jax.train"]
    t0 = time.perf_counter()
    proc = subprocess.run([str(REPO_ROOT / "launch" / "local_multiprocess.sh"), "2", "--devices", "4", "--port", "12611",
                           "--", *train, "--workdir", str(two), *ARGS], cwd=REPO_ROOT, env=_env(), capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        sys.exit(f"2-process run failed:\n{proc.stderr[-3000:]}")
    t_two = time.perf_counter() - t0
    t0 = time.perf_counter()
    proc = subprocess.run([*train, "--workdir", str(one), *ARGS], cwd=REPO_ROOT, capture_output=True, text=True,
                          env=_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8"), timeout=900)
    if proc.returncode != 0:
        sys.exit(f"1-process run failed:\n{proc.stderr[-3000:]}")
    t_one = time.perf_counter() - t0
    a = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    problems, compared, worst = [], 0, 0.0
    if not len(a) == len(b) == 3:
        problems.append(f"steps logged: {len(a)} vs {len(b)}")
    for step, (x, y) in enumerate(zip(a, b)):
        if not x["train/grad_norm"] > 0:
            problems.append(f"step {step}: zero gradient, the comparison proves nothing")
        for k, v in y.items():  # timings and the sampler/trainer round-off diagnostics aside
            if isinstance(v, (int, float)) and not k.startswith(("perf/", "train/tis/logprob_diff")):
                compared += 1
                d = abs(x[k] - v)
                worst = max(worst, d / max(abs(v), 1e-7))
                if d > 1e-5 * abs(v) + 1e-7:
                    problems.append(f"step {step} {k}: {x[k]} vs {v}")
    pa, pb = _params(two), _params(one)
    if pa.keys() != pb.keys() or not pa:
        problems.append("exported parameters differ in names")
        diff = float("nan")
    else:
        diff = max(float(np.abs(pa[k].astype(np.float32) - pb[k].astype(np.float32)).max()) for k in pa)
        if diff > 1e-6:
            problems.append(f"final parameters differ by {diff:.3g}")
    print(f"\n3 RL steps of the tiny config; {machine()}")
    print(table([["wall (start-up, evaluation, 3 steps, export)", f"{t_two:.1f} s", f"{t_one:.1f} s",
                  f"{t_two / t_one:.2f}x"],
                 ["metrics compared (non-timing)", f"{compared}", "", f"worst relative difference {worst:.2g}"],
                 ["final parameters: max abs difference", f"{diff:.2g}", "", ""]],
                ["", "2 processes x 4 devices", "1 process x 8 devices", "ratio / check"]))
    for p in problems:
        print("MISMATCH:", p)
    print("equal: yes" if not problems else "equal: NO")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
