"""Run output: one-line log messages, the metrics log (JSONL + TensorBoard + Weights & Biases),
progress lines, and the measured matmul peak that CPU MFU figures divide by. Only process 0 writes."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from turnsight_jax.errors import ConfigError


def log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)


class ConsoleLog:
    """Keeps a copy of this process's stderr (the trainer's log lines and progress) in a file of
    the run folder, appended to across resumes: `start(path)` until `stop()`. Output that child
    processes write to the file descriptor directly (tool sandboxes) is not copied."""

    def __init__(self):
        self._file = None
        self._stream = None

    def start(self, path: pathlib.Path) -> None:
        if self._file is not None:
            return
        self._file = open(path, "a", encoding="utf-8", buffering=1)
        self._file.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)}\n")
        self._stream, sys.stderr = sys.stderr, _Tee(sys.stderr, self._file)

    def stop(self) -> None:
        if self._file is None:
            return
        if isinstance(sys.stderr, _Tee) and sys.stderr.file is self._file:
            sys.stderr = self._stream
        self._file.close()
        self._file = None


def write_from_signal_handler(text: str) -> None:
    """Writes text to stderr (and to the run log that tees it) from a signal handler.

    A Python signal handler runs between two bytecodes of whatever the main thread was doing, a
    write to the same buffered stream included (a progress line, or the handler of a signal that
    arrived a moment earlier); the stream then refuses the handler's write ("reentrant call"
    RuntimeError), which would unwind through the interrupted code and end the run. So the bytes go
    to each stream's file descriptor directly (os.write takes no Python lock); a stream without a
    descriptor (a test's capture) gets a plain write, skipped if that one is mid-write."""
    streams = (sys.stderr.file, sys.stderr.stream) if isinstance(sys.stderr, _Tee) else (sys.stderr,)
    data = text.encode("utf-8", "replace")
    for stream in streams:
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
            fd = None
        try:
            if fd is None:
                stream.write(text)
                continue
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except (OSError, RuntimeError):  # a closed console or a busy capture: the flag still counts
            pass


class _Tee:
    def __init__(self, stream, file):
        self.stream, self.file = stream, file

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()

    def __getattr__(self, name):  # encoding, isatty, fileno, ...: the console's
        return getattr(self.stream, name)


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The plain numeric scalars of a metrics record (what the trackers plot)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _flat_numbers(tree: dict, prefix: str = "") -> dict[str, float]:
    """summary.json's numbers as flat "a/b/c" keys (lists, such as per-task scores, left out)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat_numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return out


class WandbRun:
    """The Weights & Biases run of a run folder (log.wandb): the resolved config, each step's numeric
    metrics at its step, and at the end the held-out summary (summary.json's numbers).

    Its files live in WORKDIR/wandb (offline: `wandb sync WORKDIR/wandb/offline-run-*` uploads
    them later) and its id in WORKDIR/wandb_run.json, so a resumed run continues the same W&B run.
    W&B keeps the first value logged at a step: the steps a resume redoes (those after the restored
    checkpoint) repeat the same numbers (a resumed run logs what the uninterrupted one would)."""

    ID_FILE = "wandb_run.json"

    def __init__(self, workdir: pathlib.Path, *, project: str, mode: str, name: str, config: dict):
        import secrets
        import string

        import wandb

        id_path = workdir / self.ID_FILE
        if id_path.exists():
            run_id = json.loads(id_path.read_text())["id"]
        else:  # W&B's own alphabet and length
            run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        try:
            self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(workdir), mode=mode,
                                  config=config)
        except wandb.errors.Error as e:  # no login, an unreachable server, ...: one line, before any step
            raise ConfigError(f"log.wandb: Weights & Biases could not start the run ({e}); run `wandb login`, or "
                              f"pass --config.log.wandb_mode=offline (a local run to `wandb sync` later)") from None
        id_path.write_text(json.dumps({"id": run_id, "project": project, "mode": mode}) + "\n")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(_numbers(metrics), step=step)

    def finish(self, summary: dict | None, exit_code: int) -> None:
        if summary:
            self.run.summary.update(_flat_numbers(summary))
        self.run.finish(exit_code=exit_code)


class MetricsLog:
    """JSONL metrics (and optionally TensorBoard and Weights & Biases), written by process 0 only.

    wandb: WandbRun's keyword arguments (project, mode, name, config), or None (off)."""

    def __init__(self, workdir: pathlib.Path, *, tensorboard: bool, resume_step: int | None,
                 wandb: dict | None = None):
        self.path = workdir / "metrics.jsonl"
        self.enabled = jax.process_index() == 0
        self.tb = None
        self.wandb = None
        if not self.enabled:
            return
        workdir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            # Resuming: drop records of steps after the restored checkpoint (they will be redone).
            keep = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if resume_step is not None and rec.get("step", 0) <= resume_step:
                    keep.append(line)
            self.path.write_text("".join(l + "\n" for l in keep))
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(workdir / "tensorboard"))
            except ImportError:
                log("tensorboardX not installed: TensorBoard logging off")
        if wandb is not None:
            self.wandb = WandbRun(workdir, **wandb)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(step, {k: v for k, v in rec.items() if k != "step"})

    def amend(self, step: int, metrics: dict[str, Any]) -> None:
        """Add `metrics` to the line of `step` already written (the last one holding it): the file
        is rewritten to a temporary name and renamed, so a kill leaves the old or the new file."""
        if not self.enabled:
            return
        lines = self.path.read_text().splitlines()
        for i in range(len(lines) - 1, -1, -1):
            try:
                rec = json.loads(lines[i])
            except json.JSONDecodeError:
                continue
            if rec.get("step") == step:
                rec.update({k: _jsonable(v) for k, v in metrics.items()})
                lines[i] = json.dumps(rec)
                break
        else:
            raise ValueError(f"{self.path}: no line of step {step} to amend")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, self.path)
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:  # the step just written, W&B's current one: its fields are added
            self.wandb.log(step, {k: _jsonable(v) for k, v in metrics.items()})

    def close(self, summary: dict | None = None, exit_code: int = 0):
        """summary: numbers for the trackers' run summary (W&B); exit_code: how the run ended."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish(summary, exit_code)
            self.wandb = None


def _jsonable(v):
    if isinstance(v, (jax.Array, np.ndarray)):
        v = np.asarray(v)
        return v.tolist() if v.ndim else float(v)
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


class Progress:
    """One line per step on stderr: position, key numbers, speed and ETA."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self.total, self.start, self.enabled = total, start, enabled and jax.process_index() == 0
        self.t0 = time.perf_counter()

    def update(self, step: int, fields: dict[str, float]) -> None:
        if not self.enabled:
            return
        done = step + 1 - self.start
        rate = (time.perf_counter() - self.t0) / max(done, 1)
        eta = rate * (self.total - step - 1)
        bar_w = 20
        filled = int(bar_w * (step + 1) / max(self.total, 1))
        parts = " | ".join(f"{k} {v:.3g}" for k, v in fields.items())
        print(f"[{'#' * filled}{'.' * (bar_w - filled)}] step {step + 1}/{self.total} | {parts} | "
              f"{rate:.1f} s/step | ETA {int(eta // 60)}m{int(eta % 60):02d}s", file=sys.stderr, flush=True)


@functools.lru_cache(maxsize=None)
def matmul_peak_flops(seconds: float = 0.5) -> float:
    """Measured float32 matmul throughput of device 0 (FLOP/s): the MFU denominator on CPU.
    Measured once per process (half a second of both cores per run otherwise): the machine does
    not change between the runs of one notebook, study or test process."""
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        f(a).block_until_ready()
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0)
