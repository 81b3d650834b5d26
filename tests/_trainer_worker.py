"""One long-lived Python process that runs the package's command-line entry points in-process,
for the tests' trainer runs (tests/_train_runs.py).

A trainer subprocess per run pays the interpreter, `import turnsight_jax.train` (~2.5 CPU-s), the
JAX backend's start and the tracing of every program again; this process pays them once and then
runs `main(argv)` of the asked module for each request, so programs of equal shapes (the rollout
engine's, the SFT and optimizer programs) are traced, lowered and compiled once for all the runs
of a test worker. The command-line path itself (argument parsing, exit codes, signals, several
processes) stays covered by real subprocesses in tests/test_train.py, tests/test_docs.py and
tests/test_launch.py.

Protocol (the parent is `TrainerWorker` below): one length-prefixed JSON request on stdin,
{"module", "argv", "env", "cwd"}; one length-prefixed JSON reply on the original stdout,
{"rc", "stdout", "stderr", "cpu_s"}: what the run wrote to file descriptors 1 and 2, and cpu_s the worker's CPU-seconds so far (itself and the processes it waited for: the tool
sandboxes), which the tests' cost table (tests/conftest.py) adds to the test that asked. The
process is started with the environment of a trainer subprocess (one CPU device, the tests' XLA
flags and compilation cache); a request's `env` sets or (None) removes variables for that run only.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
import threading

_HEADER = struct.Struct("<Q")
# pid -> CPU-seconds last reported by each live worker of this (parent) process; a closed worker's
# CPU is in the parent's RUSAGE_CHILDREN once it is reaped, and leaves this table then.
LIVE_CPU_S: dict[int, float] = {}


def _own_cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _read(stream) -> dict | None:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    return json.loads(stream.read(n))


def _write(stream, obj: dict) -> None:
    body = json.dumps(obj).encode()
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def _run(request: dict) -> dict:
    """main(argv) of request["module"] with fds 1 and 2 captured -> {"rc", "stdout", "stderr"}."""
    saved_env = {k: os.environ.get(k) for k in request.get("env", {})}
    for k, v in request.get("env", {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    cwd = os.getcwd()
    os.chdir(request.get("cwd") or cwd)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            rc = importlib.import_module(request["module"]).main(list(request["argv"]))
        except SystemExit as e:  # argparse and explicit exits
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # a traceback, as the subprocess would have printed it
            import traceback

            traceback.print_exc()
            rc = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            os.chdir(cwd)
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode("utf-8", errors="replace"))
    return {"rc": 0 if rc is None else int(rc), "stdout": texts[0], "stderr": texts[1], "cpu_s": _own_cpu_s()}


def _serve() -> None:
    # Replies go to a private copy of the original stdout; fd 1 itself is the runs' output.
    replies = os.fdopen(os.dup(1), "wb")
    requests = sys.stdin.buffer
    while (request := _read(requests)) is not None:
        _write(replies, _run(request))


class TrainerWorker:
    """The parent's handle: `run(module, argv, env, cwd, timeout)` -> (rc, stdout, stderr); a worker
    that died or timed out is replaced by a fresh one for the next run."""

    def __init__(self, env: dict[str, str], cwd: str):
        self._env, self._cwd = env, cwd
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, env=self._env, cwd=self._cwd)

    def run(self, module: str, argv: list[str], *, env: dict | None = None, cwd: str | None = None,
            timeout: float = 900.0) -> tuple[int, str, str]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            timer = threading.Timer(timeout, proc.kill)
            timer.start()
            try:
                _write(proc.stdin, {"module": module, "argv": argv, "env": env or {}, "cwd": cwd})
                reply = _read(proc.stdout)
            except (BrokenPipeError, OSError, ValueError):
                reply = None
            finally:
                timer.cancel()
            if reply is None:
                code = proc.wait()
                LIVE_CPU_S.pop(proc.pid, None)
                self._proc = None
                return (code if code != 0 else 1), "", f"trainer worker died (exit {code}) during {module} {argv}"
            LIVE_CPU_S[proc.pid] = reply["cpu_s"]
            return reply["rc"], reply["stdout"], reply["stderr"]

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.stdin.close()
                try:
                    self._proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            if self._proc is not None:
                LIVE_CPU_S.pop(self._proc.pid, None)
            self._proc = None


if __name__ == "__main__":
    _serve()
