"""Trainer runs from the methods' tiny configs (configs/methods/<name>.py) through
`python -m turnsight_jax.train`, on the built-in tasks, 3 RL steps each, for the tests of the methods' mechanisms (tests/test_baselines_train.py,
tests/test_signal_train.py, tests/test_rollout_train.py, ...). Each run is `main(argv)` of
`turnsight_jax.train` in one long-lived trainer process per test worker (tests/_trainer_worker.py:
the environment of a trainer subprocess, one CPU device), so the runs share the programs they
compile; the command line itself is tested by real subprocesses elsewhere (tests/test_train.py).

A random model never solves a built-in task, and every advantage would then be 0 (RLSD's weights
all 1, no successful sibling for SDPO, no gate pass for ToolOmni). So the runs start from one
short supervised warm-start (the `warm_start` fixture of tests/conftest.py: a smaller version of
the configs' own, 200 + 60 steps of 4 rows instead of 250 + 60 of 16, from 128 tasks, gold
demonstrations only), built once per test run and copied into each run folder (the trainer
reuses a completed `sft/` folder); SOD's external teacher is that warm-start
(`teacher.checkpoint=warm_start`, its tiny config's default). Only sizes are overridden."""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import subprocess
import sys

from _trainer_worker import TrainerWorker
from conftest import TRAINER_XLA_FLAGS

REPO = pathlib.Path(__file__).resolve().parents[1]
WARM_START = ["--config.sft.curriculum_steps=200", "--config.sft.steps=60", "--config.sft.batch_size=4",
              "--config.sft.num_tasks=128", "--config.sft.wrong_call_rate=0.0"]
SIZES = ["--config.data.num_eval=0", "--config.train.steps=3", "--config.train.prompts_per_step=2",
         "--config.train.group_size=4", "--config.checkpoint.every=0", "--config.log.tensorboard=False",
         "--config.checkpoint.export_at_end=False", "--config.data.num_train=64", *WARM_START]


def build_warm_start(workdir: pathlib.Path) -> pathlib.Path:
    """`python -m turnsight_jax.sft` at the WARM_START sizes -> workdir/sft. Its 260 steps execute
    far more than they compile, so this process runs XLA at full optimisation (measured: 100 s
    against 166 s at the tests' level 0, the box under load)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    args = [sys.executable, "-m", "turnsight_jax.sft", "--config", str(REPO / "configs" / "methods" / "rlsd.py"),
            "--workdir", str(workdir), *WARM_START]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"warm-start: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    assert (workdir / "sft" / "SFT_DONE").exists(), proc.stderr[-2000:]
    return workdir / "sft"


_WORKER: TrainerWorker | None = None


def trainer_worker() -> TrainerWorker:
    """This test process's trainer process (started at its first run, closed at exit)."""
    global _WORKER
    if _WORKER is None:
        _WORKER = TrainerWorker(dict(os.environ, XLA_FLAGS=TRAINER_XLA_FLAGS, JAX_PLATFORMS="cpu"), str(REPO))
        atexit.register(_WORKER.close)
    return _WORKER


class Ran:
    """What a run in the trainer process gave, named as subprocess.CompletedProcess names it."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_main(module: str, *argv, env: dict | None = None, timeout: float = 900.0) -> Ran:
    """`python -m <module> argv...` run in the trainer process (its `main(argv)`)."""
    return Ran(*trainer_worker().run(module, [str(a) for a in argv], env=env, cwd=str(REPO), timeout=timeout))


def train(method: str, workdir: pathlib.Path, warm_start: pathlib.Path | None, *more: str) -> list[dict]:
    """A 3-step run of configs/methods/<method>.py in `workdir` (from a copy of `warm_start`
    unless the folder already holds one) -> its metrics records."""
    if warm_start is not None and not (workdir / "sft").exists():
        shutil.copytree(warm_start, workdir / "sft")
    proc = run_main("turnsight_jax.train", "--config", REPO / "configs" / "methods" / f"{method}.py",
                    "--workdir", workdir, *SIZES, *more)
    assert proc.returncode == 0, f"{method}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    # the config's method, or its rollout controller (configs/methods/<controller>.py: rl.rollout=<controller>)
    assert f"method {method}:" in proc.stderr or f"rollout {method}," in proc.stderr
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def any_of(records, key, pred) -> bool:
    return any(pred(r[key]) for r in records if key in r)
