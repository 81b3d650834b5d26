"""Sandboxed, pooled execution of dataset tool code (FTRL, ToolHop, built-in tasks).

Tool source from datasets is never run in the trainer's process, nor in any process that holds a
channel to it. A `ToolExecutor` keeps a pool of sandbox hosts (`_sandbox_host.py`, started with
`python -I`); each host runs every call in a *fresh process* forked from a clean zygote, with hard
limits, a private size-capped root directory, no network, a private pid space and an
unprivileged uid where the kernel allows it (see `_sandbox_host.py` for the process model, and
docs/sandbox.md for what holds where). Per call it enforces a wall-clock limit (10 s default,
FTRL's), a CPU-seconds limit, an address-space limit and an output-size cap. A hang, infinite
loop, memory bomb, segfault, fork bomb, `os._exit` or forged reply costs only that call: the call
returns an error observation and the call's whole process tree is killed.

Observation text follows FTRL (`Code/utils/utils.py: call_function/get_feedback`):
  * dict / list result -> `json.dumps(value, ensure_ascii=False)`; other non-str -> `str(value)`;
  * any exception or timeout -> `an error occured when call {name}: {message}` (FTRL's spelling).

Arguments are the JSON-decoded object of the parsed call, passed as keyword arguments
(`fn(**arguments)`); they are shipped as JSON data, so an argument that contains Python source is
just a string to the tool. Nothing here evaluates model text.

Usage::

    with ToolExecutor(num_workers=2) as ex:
        texts = ex.run_many([ToolRequest("f", "def f(x):\\n    return x * 2", {"x": 3})])
        ex.isolation  # what the kernel granted: namespaces, uid drop, disk quota
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Sequence

from turnsight_jax.chat.parsing import json_depth

_HOST_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_host.py")
_HEADER = struct.Struct(">I")
# Sources a sandbox host keeps compiled, first in first out; the trainer keeps the same record.
MAX_CACHED_SOURCES = 4096
ERROR_TEMPLATE = "an error occured when call {name}: {message}"
# A tool name is model text: echoed in an error observation it is cut to this many characters.
MAX_NAME_CHARS = 200
# The longest truncation note `cap_chars` appends: an observation's text (a result, or an error
# message) is at most max_output_chars + NOTE_CHARS characters.
NOTE_CHARS = 64
# Arguments nested deeper than this are refused before they are sent: the trainer's, the host's
# and the call process's JSON coders recurse once per level (Python's limit is 1,000 frames).
# parse_turn refuses model text nested deeper still (chat.parsing.MAX_JSON_DEPTH).
MAX_ARGUMENT_DEPTH = 256


def short_name(name: str) -> str:
    """`name` cut to MAX_NAME_CHARS characters, with a note of how much was cut."""
    if len(name) <= MAX_NAME_CHARS:
        return name
    return name[:MAX_NAME_CHARS] + f"... [name truncated: {len(name) - MAX_NAME_CHARS} more characters]"


def error_text(name: str, message: str) -> str:
    """FTRL's error observation for a failed call of tool `name` (a long name is cut, `short_name`)."""
    return ERROR_TEMPLATE.format(name=short_name(name), message=message)


def cap_chars(text: str, limit: int) -> str:
    """`text` when it has at most `limit` + NOTE_CHARS characters (an honest reply the call
    process already cut, with its note), else its first `limit` characters and a note."""
    if len(text) <= limit + NOTE_CHARS:
        return text
    return text[:limit] + f"... [output truncated: {len(text) - limit} more characters]"


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """One tool call to run.

    name: the tool (function) name the policy called.
    source: Python source that defines a function called `name` (dataset tool code).
    arguments: the JSON-decoded arguments (normally a dict), passed as `fn(**arguments)`.
    seed: seeds Python's `random` in the call process before the call (determinism for a seed).
    """

    name: str
    source: str
    arguments: Any
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class ExecutorLimits:
    """Per-call limits, each a hard limit the tool code cannot raise.

    `cpu_s=None` means: the same number of seconds as `timeout_s`. `disk_mb` caps all files of
    one call together (a tmpfs of that size; without a mount namespace only `file_mb` per file
    holds). `processes` caps the call's process tree (threads count too).
    """

    timeout_s: float = 10.0
    cpu_s: float | None = None
    memory_mb: int = 1024
    max_output_chars: int = 16384
    file_mb: int = 16
    disk_mb: int = 64
    open_files: int = 64
    processes: int = 16
    # Extra wall time the host waits beyond `timeout_s` before it kills the call process: the
    # in-process alarm normally answers first, this only covers code stuck inside C.
    kill_grace_s: float = 0.75


class _WorkerCrashed(Exception):
    pass


# The residual risk of each layer the kernel refused, printed once per process (docs/sandbox.md).
_RISKS = {
    "net_ns": "tool code can open network connections (loopback included)",
    "pid_ns": "tool code can see other processes' ids",
    "mount_ns": "no total disk quota per call (file size is still capped)",
    "chroot": "tool code can read and write files the trainer's user can",
    "uid_drop": ("tool code runs as the trainer's uid: it can signal the trainer's processes, and a "
                 "setsid() grandchild can outlive its call"),
    "ipc_per_call": ("a call's System V IPC objects can be reached by other processes while it runs and "
                     "their memory is not capped (they are removed when it ends)"),
    "seccomp": ("tool code can use the kernel keyring (one per uid, outliving the call), AF_VSOCK and "
                "other socket families the network namespace does not cover, io_uring and memfds"),
    "memory_cgroup": ("a call's memory is bounded per process, not per call: its processes can hold up to "
                      "processes x memory_mb, plus memfds of file_mb each"),
}
# Without a memory cgroup but with the seccomp filter, calls cannot start processes or memfds.
_MEMORY_RISK_FILTERED = ("a call's memory is bounded per process, not per call: it cannot start processes "
                         "(threads only) or memfds, so it holds about memory_mb plus its disk_mb of files "
                         "and its pipes' and sockets' buffers")
_warned: set[str] = set()


def isolation_gaps(isolation: dict) -> list[str]:
    """The residual risks of a host's isolation report (empty when every layer holds)."""
    gaps = []
    for layer, risk in _RISKS.items():
        held = isolation.get(layer)
        if layer == "uid_drop":
            held = held or isolation.get("pid_ns") and isolation.get("user_ns")
        if layer == "memory_cgroup" and isolation.get("seccomp"):
            risk = _MEMORY_RISK_FILTERED
        if not held:
            gaps.append(risk)
    return gaps


def _warn_once(isolation: dict) -> None:
    gaps = isolation_gaps(isolation)
    line = "; ".join(gaps)
    if gaps and line not in _warned:
        _warned.add(line)
        refused = ", ".join(isolation.get("refused", [])) or "not available"
        print(f"turnsight_jax: tool sandbox degraded ({refused}): {line}. See docs/sandbox.md.",
              file=sys.stderr, flush=True)


class _Worker:
    """One sandbox host process plus the source keys it has been sent."""

    def __init__(self, limits: ExecutorLimits, workdir: str, namespaces: bool,
                 max_cached_sources: int = MAX_CACHED_SOURCES):
        config = {
            "workdir": os.path.join(workdir, f"host-{time.monotonic_ns()}"),
            "namespaces": namespaces,
            "memory_mb": limits.memory_mb,
            "max_output_chars": limits.max_output_chars,
            "file_mb": limits.file_mb,
            "disk_mb": limits.disk_mb,
            "open_files": limits.open_files,
            "processes": limits.processes,
            "kill_grace_s": limits.kill_grace_s,
            "max_cached_sources": max_cached_sources,
        }
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            # Thread pools of numeric libraries reserve address space per thread; keep one.
            "OPENBLAS_NUM_THREADS": "1",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-I", _HOST_SCRIPT, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=workdir,
            env=env,
            start_new_session=True,  # own process group: kill() takes the zygote with it
        )
        # The host's source cache as the host keeps it: insertion order, first in first out at
        # max_cached_sources (a key sent again keeps its place, as in the host's dict).
        self.known_keys: dict[str, None] = {}
        self.max_cached_sources = max_cached_sources
        self._buffer = b""
        try:
            ready = self._read_frame(deadline=time.monotonic() + 60.0)
        except (TimeoutError, _WorkerCrashed, ValueError):
            ready = None
        if not isinstance(ready, dict) or ready.get("ready") is not True:
            self.kill()
            raise RuntimeError(f"tool sandbox failed to start (first frame: {ready!r})")
        self.isolation: dict = ready.get("isolation", {})

    def _read_frame(self, deadline: float) -> dict:
        fd = self.proc.stdout.fileno()
        while True:
            if len(self._buffer) >= _HEADER.size:
                (length,) = _HEADER.unpack_from(self._buffer)
                if len(self._buffer) >= _HEADER.size + length:
                    body = self._buffer[_HEADER.size : _HEADER.size + length]
                    self._buffer = self._buffer[_HEADER.size + length :]
                    try:
                        return json.loads(body.decode("utf-8", errors="surrogatepass"))
                    except ValueError as e:  # a host that writes garbage is replaced
                        raise _WorkerCrashed from e
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise _WorkerCrashed
            self._buffer += chunk

    def sent_source(self, key: str) -> None:
        """Record that the host now caches `key` (and evicted its oldest past the cap)."""
        self.known_keys[key] = None
        if len(self.known_keys) > self.max_cached_sources:
            self.known_keys.pop(next(iter(self.known_keys)))

    def send(self, obj: dict) -> None:
        body = json.dumps(obj, ensure_ascii=False).encode("utf-8", errors="surrogatepass")
        try:
            self.proc.stdin.write(_HEADER.pack(len(body)) + body)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise _WorkerCrashed from e

    def death_message(self) -> str:
        """Why the sandbox host stopped answering, once it has exited."""
        try:
            code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return "tool process stopped responding"
        if code < 0:
            try:
                sig = signal.Signals(-code).name
            except ValueError:
                sig = f"signal {-code}"
            return f"tool process was killed by {sig}"
        return f"tool process exited with code {code}"

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # EOF: the worker loop returns
            self.proc.wait(timeout=2.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


def _observation(name: str, reply: Any, max_chars: int | None = None) -> str:
    """The observation text of a host reply, which must be {"ok": str} or {"err": str}; the text
    is cut to `max_chars` characters (`cap_chars`) whatever the host sent."""
    if isinstance(reply, dict) and len(reply) == 1:
        ((kind, text),) = reply.items()
        if isinstance(text, str) and kind in ("ok", "err"):
            if max_chars is not None:
                text = cap_chars(text, max_chars)
            return text if kind == "ok" else error_text(name, text)
    return error_text(name, f"malformed reply from the tool sandbox: {str(reply)[:200]}")


class ToolExecutor:
    """A pool of sandbox hosts running dataset tool code, one fresh process per call.

    Thread-safe: `run_many` may be called from several threads (e.g. one per rollout); calls are
    spread over the hosts and run concurrently (one call per host at a time).

    Args:
      num_workers: sandbox hosts (and calls in flight).
      timeout_s: per-call wall-clock limit (FTRL: 10 s); the call's observation is a timeout
        error when it is exceeded.
      cpu_s: per-call CPU-seconds limit (default: `timeout_s`).
      memory_mb: address-space limit of each call process (RLIMIT_AS).
      max_output_chars: longer observation texts are cut to this many characters plus a note.
      file_mb, disk_mb, open_files, processes: see `ExecutorLimits`.
      namespaces: enter Linux namespaces where the kernel allows (False: limits, fresh
        processes and uid drop only; for kernels or containers that forbid them).
    """

    def __init__(
        self,
        num_workers: int = 2,
        *,
        timeout_s: float = 10.0,
        cpu_s: float | None = None,
        memory_mb: int = 1024,
        max_output_chars: int = 16384,
        file_mb: int = 16,
        disk_mb: int = 64,
        open_files: int = 64,
        processes: int = 16,
        kill_grace_s: float = 0.75,
        namespaces: bool = True,
    ):
        if num_workers < 1:
            raise ValueError(f"ToolExecutor: num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"ToolExecutor: timeout_s must be > 0, got {timeout_s}")
        self.limits = ExecutorLimits(
            timeout_s=timeout_s,
            cpu_s=cpu_s,
            memory_mb=memory_mb,
            max_output_chars=max_output_chars,
            file_mb=file_mb,
            disk_mb=disk_mb,
            open_files=open_files,
            processes=processes,
            kill_grace_s=kill_grace_s,
        )
        for field in ("memory_mb", "max_output_chars", "file_mb", "disk_mb", "open_files", "processes"):
            if getattr(self.limits, field) < 1:
                raise ValueError(f"ToolExecutor: {field} must be >= 1, got {getattr(self.limits, field)}")
        self._namespaces = namespaces
        self.num_workers = num_workers
        self._tmp = tempfile.TemporaryDirectory(prefix="turnsight_tools_")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.restarts = 0  # how many times a sandbox host was replaced (it died or went silent)
        self.max_chunk = 16  # calls per frame sent to one worker
        self._key_cache: dict[str, str] = {}
        for _ in range(num_workers):
            worker = self._spawn()
            self._idle.put(worker)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_workers, thread_name_prefix="tool-exec"
        )

    # -- lifecycle -------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        worker = _Worker(self.limits, self._tmp.name, self._namespaces)
        _warn_once(worker.isolation)
        with self._lock:
            self._all.append(worker)
        return worker

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
            self.restarts += 1
        return self._spawn()

    def close(self) -> None:
        """Stops all workers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            workers = list(self._all)
            self._all.clear()
        for worker in workers:
            worker.close()
        self._tmp.cleanup()

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def isolation(self) -> dict:
        """The isolation report of the sandbox hosts (what the kernel granted; see `_sandbox_host`)."""
        with self._lock:
            return dict(self._all[0].isolation) if self._all else {}

    @property
    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._all]

    # -- calls -----------------------------------------------------------------------------
    def run(self, request: ToolRequest) -> str:
        """Runs one call; returns its observation text. Never raises for tool failures."""
        return self.run_many([request])[0]

    def run_many(self, requests: Sequence[ToolRequest]) -> list[str]:
        """Runs calls concurrently over the pool; returns observation texts in request order.

        Each busy worker is driven by one pool thread that keeps taking the next chunk of
        pending requests of this batch and sends the chunk as one frame; the worker streams one
        result per call back. At a few thousand calls per second the parent's per-call
        bookkeeping and the pipe round trips, not the tool code, limit throughput, so calls
        are not handed from thread to thread one by one.
        """
        if self._closed:
            raise RuntimeError("ToolExecutor.run_many: the executor is closed")
        if not requests:
            return []
        if len(requests) == 1:
            return [self._run_one(requests[0])]
        results: list[str | None] = [None] * len(requests)
        # Small enough chunks to balance the workers, large enough to amortise the round trips.
        chunk = max(1, min(self.max_chunk, len(requests) // (4 * self.num_workers)))
        starts = iter(range(0, len(requests), chunk))
        lock = threading.Lock()

        def drain() -> None:
            worker = self._idle.get()
            try:
                while True:
                    with lock:
                        first = next(starts, None)
                    if first is None:
                        return
                    texts, worker = self._guarded_chunk(worker, requests[first : first + chunk])
                    results[first : first + len(texts)] = texts
            finally:
                self._idle.put(worker)

        futures = [self._pool.submit(drain) for _ in range(min(self.num_workers, len(requests)))]
        for future in futures:
            future.result()
        return results  # type: ignore[return-value]

    def _run_one(self, request: ToolRequest) -> str:
        worker = self._idle.get()
        try:
            texts, worker = self._guarded_chunk(worker, [request])
            return texts[0]
        finally:
            self._idle.put(worker)

    def _guarded_chunk(
        self, worker: _Worker, requests: Sequence[ToolRequest]
    ) -> tuple[list[str], _Worker]:
        """`_call_chunk`, but anything it raises (a bug, MemoryError, RecursionError from a caller's
        deep stack) costs only these calls: each gets an error observation and the worker, whose
        protocol state is then unknown, is replaced."""
        try:
            return self._call_chunk(worker, requests)
        except Exception as e:  # noqa: BLE001 - these calls pay, never the batch
            why = f"tool sandbox error: {type(e).__name__}: {e}"[:500]
            try:
                worker = self._replace(worker)
            except Exception:  # noqa: BLE001 - no replacement: the next caller's call tries again
                pass
            return [error_text(r.name, why) for r in requests], worker

    def _message(self, request: ToolRequest, worker: _Worker) -> tuple[dict | None, str, str | None]:
        """(wire message or None, source key, error text when the arguments are not JSON)."""
        # Arguments come from model text: whatever they make the coders raise (RecursionError,
        # MemoryError, OverflowError, ...) is this call's error observation.
        try:
            if json_depth(request.arguments, MAX_ARGUMENT_DEPTH) > MAX_ARGUMENT_DEPTH:
                return None, "", error_text(
                    request.name, f"arguments are nested too deeply (more than {MAX_ARGUMENT_DEPTH} levels)")
            args = json.loads(json.dumps(request.arguments, ensure_ascii=False, allow_nan=True))
        except Exception as e:  # noqa: BLE001 - the call's own error, never the batch's
            return None, "", error_text(request.name, f"arguments are not JSON data: {type(e).__name__}: {e}"[:500])
        key = self._key_cache.get(request.source)
        if key is None:
            key = hashlib.sha256(request.source.encode("utf-8", errors="surrogatepass")).hexdigest()
            if len(self._key_cache) > 8192:
                self._key_cache.clear()
            self._key_cache[request.source] = key
        limits = self.limits
        message = {
            "op": "call",
            "key": key,
            "name": request.name,
            "args": args,
            "seed": int(request.seed),
            "timeout": float(limits.timeout_s),
            "cpu": float(limits.cpu_s if limits.cpu_s is not None else limits.timeout_s),
        }
        if key not in worker.known_keys:
            message["source"] = request.source
        return message, key, None

    def _call_chunk(
        self, worker: _Worker, requests: Sequence[ToolRequest]
    ) -> tuple[list[str], _Worker]:
        """Runs `requests` in order on `worker`; returns (observations, the worker to use next).

        A call that hangs or kills the worker gets its error observation; the worker is replaced
        and the calls after it run on the replacement.
        """
        limits = self.limits
        out: list[str | None] = [None] * len(requests)
        messages, keys, slots = [], [], []
        for i, request in enumerate(requests):
            message, key, error = self._message(request, worker)
            if error is not None:
                out[i] = error
                continue
            message["id"] = len(messages)
            messages.append(message)
            keys.append(key)
            slots.append(i)
            if "source" in message:
                worker.sent_source(key)  # later calls of this chunk reuse the compiled code
        if not messages:
            return out, worker  # type: ignore[return-value]
        # Replies are matched to calls by id. A call whose source the host no longer holds is
        # answered need_source and the host goes on with the batch; such calls are sent again,
        # with their sources, once the batch's other replies are in.
        unanswered = list(range(len(messages)))
        current = 0
        try:
            batch = messages
            while batch:
                worker.send(batch[0] if len(batch) == 1 else {"op": "batch", "calls": batch})
                again = []
                for message in batch:
                    current = message["id"]
                    # The host enforces the call's limits itself; this only catches a silent host.
                    deadline = time.monotonic() + limits.timeout_s + 2 * limits.kill_grace_s + 5.0
                    reply = worker._read_frame(deadline)
                    if not isinstance(reply, dict) or reply.pop("id", None) != current:
                        raise _WorkerCrashed  # out of step with its requests: never trusted again
                    if reply.get("need_source") and "source" not in message:
                        again.append(dict(message, source=requests[slots[current]].source))
                        worker.sent_source(keys[current])
                        continue
                    name = requests[slots[current]].name
                    out[slots[current]] = _observation(name, reply, limits.max_output_chars)
                    unanswered.remove(current)
                batch = again
        except (TimeoutError, _WorkerCrashed) as e:
            name = requests[slots[current]].name
            if isinstance(e, TimeoutError):
                out[slots[current]] = error_text(
                    name, f"Function {name} timed out after {limits.timeout_s:.6f} seconds."
                )
            else:
                out[slots[current]] = error_text(name, worker.death_message())
            worker = self._replace(worker)
            rest = [j for j in unanswered if j != current]
            if rest:
                texts, worker = self._call_chunk(worker, [requests[slots[j]] for j in rest])
                for j, text in zip(rest, texts):
                    out[slots[j]] = text
        return out, worker  # type: ignore[return-value]
