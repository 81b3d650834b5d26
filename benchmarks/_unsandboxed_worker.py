"""BASELINE ONLY, NOT A SANDBOX: the tool worker the project used before issue 19.

One long-lived process per pool slot runs every task's tool code, and holds the protocol pipes:
tool code can forge replies, read later requests, lift its limits and leak state into later
tasks (the attacks in tests/test_sandbox.py). `benchmarks/envs.py` runs it next to the sandbox
to state the cost of isolation as a ratio; nothing in `turnsight_jax/` starts it.

Original description: worker process that runs dataset tool code in a subprocess.

This file is started as a *script* (``python -I _tool_worker.py``), never imported by the
trainer, so it depends on the standard library only: the worker must come up fast and must not
pull JAX or the project into a process that runs untrusted code.

Protocol (parent <-> worker): length-prefixed JSON frames (4-byte big-endian length, UTF-8
JSON). The parent writes requests to the worker's stdin; the worker answers on a private
duplicate of its original stdout. File descriptors 0/1/2 are pointed at /dev/null before any tool
code runs, so tool code that prints, reads input() or writes to fd 1 cannot corrupt the protocol.

Requests:
  {"op": "call", "key": <source hash>, "source": <str, optional>, "name": <tool name>,
   "args": <JSON value>, "seed": <int>, "timeout": <float s>, "cpu": <float s>}
  {"op": "batch", "calls": [<call request>, ...]}   (one reply frame per call, in order)
Replies (each carries the call's "id", echoed, as the sandbox host's do):
  {"ok": <result text>}            tool returned; text formatted the FTRL way
  {"err": <message>}               tool raised, timed out or exceeded a limit
  {"need_source": true}            the worker has no compiled code for `key`; resend with source

Tool source is compiled once per distinct source text (cached by `key`) and *executed into a
fresh namespace on every call*: FTRL re-`exec`s the tool source per call, so module-level state
never leaks from one call into the next; re-running a cached code object keeps that behaviour at
a fraction of the cost of recompiling.

Limits set here: address space (RLIMIT_AS), per-call CPU seconds (soft RLIMIT_CPU raised per
call, SIGXCPU -> exception), per-call wall clock (SIGALRM -> exception), no core dumps, bounded
file size and open files. The parent additionally enforces the wall limit from outside (it kills
and replaces a worker that does not answer in time), which covers code that blocks signals or
spins inside C.
"""

from __future__ import annotations

import collections
import json
import math
import os
import random
import resource
import signal
import struct
import sys

_HEADER = struct.Struct(">I")
_MAX_CACHED_SOURCES = 4096


class _WallTimeout(BaseException):
    """Raised by SIGALRM. A BaseException so that tool code's `except Exception` cannot swallow it."""


class _CpuTimeout(BaseException):
    """Raised by SIGXCPU when the per-call CPU budget is spent."""


def _on_alarm(signum, frame):
    raise _WallTimeout()


def _on_xcpu(signum, frame):
    raise _CpuTimeout()


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n > 0:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int):
    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    (length,) = _HEADER.unpack(header)
    body = _read_exact(fd, length)
    if body is None:
        return None
    return json.loads(body.decode("utf-8"))


def _write_frame(fd: int, obj) -> None:
    body = json.dumps(obj, ensure_ascii=False).encode("utf-8", errors="surrogatepass")
    data = _HEADER.pack(len(body)) + body
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _format_result(value) -> str:
    """FTRL's conversion of a tool's return value to observation text."""
    # `type(...) is` on purpose: FTRL tests `type(predict) == dict`, so dict subclasses
    # (OrderedDict, defaultdict) go through str(), exactly as there.
    if type(value) is dict or type(value) is list:
        return json.dumps(value, ensure_ascii=False)
    if type(value) is not str:
        return str(value)
    return value


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"... [output truncated: {len(text) - limit} more characters]"


def _set_limits(memory_mb: int, file_mb: int) -> None:
    # No core files: a segfaulting tool must not litter the disk.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    if file_mb > 0:
        limit = file_mb * 1024 * 1024
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))


def _arm_cpu_limit(cpu_s: float) -> None:
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = used.ru_utime + used.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(math.ceil(spent + cpu_s))
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _disarm_cpu_limit() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))


def _run_call(code, name: str, args, seed: int, timeout: float, cpu: float, memory_mb: int):
    """Runs one tool call; returns ("ok", text) or ("err", message). Never raises."""
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        _arm_cpu_limit(cpu)
        try:
            # Deterministic for a seed: tool code that draws random numbers sees the same stream
            # for the same (episode seed, call) wherever the call lands in the pool.
            random.seed(seed)
            if isinstance(code, BaseException):
                raise code  # the source did not compile; FTRL reports that at exec time
            namespace: dict = {}
            exec(code, namespace, namespace)  # dataset tool source, isolated in this process
            if name not in namespace:
                raise NameError(f"name {name} is not defined")
            result = namespace[name](**args)
            text = _format_result(result)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _disarm_cpu_limit()
        return "ok", text
    except _WallTimeout:
        return "err", f"Function {name} timed out after {timeout:.6f} seconds."
    except _CpuTimeout:
        return "err", f"Function {name} exceeded its CPU time limit of {cpu:g} seconds."
    except MemoryError as e:
        detail = str(e)
        return "err", f"MemoryError: memory limit of {memory_mb} MiB exceeded" + (
            f" ({detail})" if detail else ""
        )
    except RecursionError as e:
        return "err", str(e)
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from tool code too
        try:
            return "err", str(e)
        except BaseException:  # noqa: BLE001 - an exception whose __str__ itself fails
            return "err", type(e).__name__


def main() -> None:
    config = json.loads(sys.argv[1])
    memory_mb = int(config.get("memory_mb", 1024))
    max_chars = int(config.get("max_output_chars", 16384))

    # Private protocol descriptors, then point 0/1/2 at /dev/null (see module docstring).
    in_fd = os.dup(0)
    out_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    sys.stdin = open(os.devnull)
    sys.stdout = open(os.devnull, "w")
    sys.stderr = open(os.devnull, "w")

    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGXCPU, _on_xcpu)
    _set_limits(memory_mb, int(config.get("file_mb", 16)))
    sys.setrecursionlimit(int(config.get("recursion_limit", 3000)))

    cache: collections.OrderedDict = collections.OrderedDict()
    _write_frame(out_fd, {"ready": True})
    while True:
        try:
            request = _read_frame(in_fd)
        except MemoryError:
            _write_frame(out_fd, {"err": "request too large for the worker's memory limit"})
            continue
        if request is None:
            return  # parent closed the pipe
        # A frame holds one call or a batch of calls; results stream back one frame per call,
        # in order, so the parent can tell which call a crash or hang belongs to.
        calls = request["calls"] if request.get("op") == "batch" else [request]
        for call in calls:
            reply = _serve_call(call, cache, memory_mb, max_chars)
            # the executor matches replies to calls by id (issue 57): echo it as the sandbox host does
            reply["id"] = call.get("id")
            _write_frame(out_fd, reply)


def _serve_call(request: dict, cache: collections.OrderedDict, memory_mb: int, max_chars: int) -> dict:
    key = request["key"]
    code = cache.get(key)
    if code is None:
        source = request.get("source")
        if source is None:
            return {"need_source": True}
        try:
            # "<string>" as the filename so SyntaxError text matches FTRL's exec(str).
            code = compile(source, "<string>", "exec")
        except BaseException as e:  # noqa: BLE001 - SyntaxError, MemoryError, ...
            code = e
        cache[key] = code
        if len(cache) > _MAX_CACHED_SOURCES:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    status, text = _run_call(
        code,
        request["name"],
        request["args"],
        int(request.get("seed", 0)),
        float(request["timeout"]),
        float(request["cpu"]),
        memory_mb,
    )
    return {status: _truncate(text, max_chars)}

if __name__ == "__main__":
    main()
