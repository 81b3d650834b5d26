"""Sandbox host: runs each dataset tool call in a fresh, confined process (FTRL, ToolHop, built-in).

Started as a *script* (``python -I _sandbox_host.py CONFIG``) by `executor.ToolExecutor`, never
imported by the trainer: it depends on the standard library only, so no JAX and none of the
project enters a process tree that runs untrusted code.

Three kinds of process, and what each one may hold:

  host (this script's main process, trusted)
      Holds the protocol channel to the trainer (its stdin and a private duplicate of its stdout)
      and the source text of every task it has been sent. Never runs tool code.
  zygote (forked by the host before it reads any request, trusted)
      Has never seen a request: its memory holds no task's code or arguments. It forks one call
      process per call on the host's command (over a unix socket that passes the call's two pipe
      ends), kills a call's whole process tree and reports its exit status. When a private pid
      namespace is available the zygote is its init (pid 1): when it dies, the kernel kills every
      process in the namespace.
  call process (forked by the zygote, untrusted)
      Holds exactly two descriptors: a pipe carrying its one request and a pipe for its one reply.
      Before reading the request it starts a new session, joins a memory cgroup of its own (where
      the kernel delegates one), enters an IPC namespace of its own with capped System V limits,
      sets hard limits equal to the soft ones (address space, CPU seconds, file size, open files,
      processes, POSIX message queues, no core files), enters a private writable directory (a
      size-capped tmpfs when a mount namespace is available) as its root directory, drops
      privileges (a per-host unprivileged uid/gid when started as root; all capabilities when
      running in a user namespace) and installs a seccomp filter (no keyring, no socket family
      but AF_UNIX, no io_uring, no memfd; without a memory cgroup no new process either, threads
      only). Then it compiles the source, runs ``fn(**args)`` in a fresh namespace, writes one
      reply and exits. Nothing it does can reach another call: it shares no process, descriptor,
      writable file, IPC object or key with any.

Namespaces (network, mount, pid, ipc, uts; plus a user namespace when not root) are entered by
the host at start; the per-call layers (IPC namespace, seccomp filter, memory cgroup) are tried
once at start in a throwaway child. When the kernel refuses a layer the host runs without and
reports it in its first frame (the trainer prints the residual risk once, see `executor.py`).

Trainer <-> host protocol: length-prefixed JSON frames (4-byte big-endian length, UTF-8 JSON).
  first frame  {"ready": true, "isolation": {...}}
  requests     {"op": "call", "id": <int>, "key": <source hash>, "source": <str, optional>,
                "name": <tool>, "args": <JSON value>, "seed": <int>, "timeout": <s>, "cpu": <s>}
               {"op": "batch", "calls": [<call request>, ...]}   (one reply frame per call)
  replies      {"id": <the call's id>, "ok": <text>} | {..., "err": <message>}
               | {..., "need_source": true}
The trainer matches replies to calls by id. Sources are cached by key, first in first out, at most
config["max_cached_sources"]; the trainer keeps the same record (executor.py), and a call whose
source was evicted all the same is answered need_source and sent again with its source.
Call process -> host: one frame, 4-byte length + kind byte (b"o" result, b"e" error) + UTF-8
text, read with a byte cap; anything else is the call's own error.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import random
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import time

_HEADER = struct.Struct(">I")
_MAX_CACHED_SOURCES = 4096

# Modules a call may import. A call process's root directory is its empty private directory, so
# nothing can be imported from disk once it runs: what tool code needs is imported here, before
# the zygote is forked, and shared copy-on-write. (FTRL's and ToolHop's tool code imports
# datetime, math, re, cmath, decimal, fractions and json.) Every module here is paid for on each
# call: fork copies the zygote's page tables, so hashlib (3.6 MB of OpenSSL) is left out.
PRELOADED_MODULES = (
    "abc", "array", "base64", "binascii", "bisect", "calendar", "cmath", "collections",
    "collections.abc", "colorsys", "copy", "csv", "ctypes", "dataclasses", "datetime", "decimal",
    "difflib", "enum", "fnmatch", "fractions", "glob", "functools", "heapq", "html", "io",
    "itertools", "json", "math", "numbers", "operator", "pprint", "random", "re", "shutil", "socket",
    "statistics", "string", "struct", "tempfile", "textwrap", "threading", "time", "typing", "unicodedata", "urllib.parse",
    "zlib", "_strptime", "encodings.ascii", "encodings.latin_1", "encodings.cp1252",
    "encodings.utf_16", "encodings.utf_32", "encodings.idna", "encodings.unicode_escape",
    "encodings.raw_unicode_escape",
)

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MS_REC, _MS_PRIVATE = 0x4000, 0x40000
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong]


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int = 0) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


# -- isolation set-up (host, once) -------------------------------------------------------------
def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def enter_namespaces(want: bool) -> dict:
    """Enters what the kernel allows; returns the isolation report (what holds, what does not)."""
    is_root = os.geteuid() == 0
    report = {"root": is_root, "user_ns": False, "net_ns": False, "mount_ns": False,
              "pid_ns": False, "ipc_uts_ns": False, "uid_drop": is_root, "refused": []}
    if not want:
        report["refused"].append("namespaces disabled by configuration")
        return report
    uid, gid = os.geteuid(), os.getegid()
    if not is_root:
        if _libc.unshare(_CLONE_NEWUSER) != 0:
            report["refused"].append(f"user namespace: {os.strerror(ctypes.get_errno())}")
            return report
        try:
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"0 {uid} 1")
            _write("/proc/self/gid_map", f"0 {gid} 1")
        except OSError as e:
            report["refused"].append(f"user namespace id map: {e.strerror}")
            return report
        report["user_ns"] = True
    for key, flags in (("net_ns", _CLONE_NEWNET), ("mount_ns", _CLONE_NEWNS),
                       ("ipc_uts_ns", _CLONE_NEWIPC | _CLONE_NEWUTS), ("pid_ns", _CLONE_NEWPID)):
        if _libc.unshare(flags) == 0:
            report[key] = True
        else:
            report["refused"].append(f"{key}: {os.strerror(ctypes.get_errno())}")
    if report["mount_ns"]:
        # Our mounts (one tmpfs per call) must not propagate back to the machine's mount table.
        if _libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
            report["mount_ns"] = False
            report["refused"].append(f"private mounts: {os.strerror(ctypes.get_errno())}")
    return report


# -- per-call layers (set up by each call process; tried once at start by `probe_call_layers`) ----
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_SECCOMP_RET_ALLOW, _SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
_EPERM, _ENOSYS = 1, 38
_AF_UNIX, _CLONE_THREAD, _X32_SYSCALL_BIT = 1, 0x00010000, 0x40000000
# The ABIs the filter knows: (audit arch, numbers of the system calls it looks at). A system call
# made through any other ABI of the same kernel (i386 or x32 on x86_64, arm32 on aarch64) is
# refused whatever it is, so no second numbering can go around the filter.
_SECCOMP_ABIS = {
    "x86_64": (0xC000003E, {"socket": 41, "socketpair": 53, "clone": 56, "fork": 57, "vfork": 58,
                            "add_key": 248, "request_key": 249, "keyctl": 250,
                            "memfd_create": 319, "io_uring_setup": 425, "io_uring_enter": 426,
                            "io_uring_register": 427, "clone3": 435, "memfd_secret": 447}),
    "aarch64": (0xC00000B7, {"socket": 198, "socketpair": 199, "clone": 220, "add_key": 217,
                             "request_key": 218, "keyctl": 219, "memfd_create": 279,
                             "io_uring_setup": 425, "io_uring_enter": 426,
                             "io_uring_register": 427, "clone3": 435, "memfd_secret": 447}),
}
# Refused outright: the kernel keyring (one per uid, shared by every call of a host and outliving
# it), io_uring (it opens sockets without socket(2)) and memfds (memory outside the address space).
_REFUSED_SYSCALLS = ("add_key", "request_key", "keyctl", "io_uring_setup", "io_uring_enter",
                     "io_uring_register", "memfd_create", "memfd_secret")


def seccomp_program(machine: str, refuse_processes: bool) -> list[tuple[int, int, int, int]] | None:
    """A call's seccomp filter, classic BPF instructions (code, jt, jf, k); None for an ABI the
    filter does not know.

    socket/socketpair: AF_UNIX only (AF_VSOCK reaches the VM's port space whatever the network
    namespace; every other family goes with it). With `refuse_processes` (no memory cgroup, so
    memory is bounded per process only): fork and vfork are refused, clone only creates threads
    (CLONE_THREAD: they share the address space and its limit), and clone3, whose flags the
    filter cannot read, answers ENOSYS so that libc falls back to clone.
    """
    abi = _SECCOMP_ABIS.get(machine)
    if abi is None:
        return None
    arch, nr = abi
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|.., BPF_RET|K
    code: list[list] = []
    labels: dict[str, int] = {}

    def op(kind: int, k: int, jt=0, jf=0) -> None:
        code.append([kind, jt, jf, k])

    op(load, 4)  # seccomp_data.arch
    op(jeq, arch, jf="refuse")
    op(load, 0)  # seccomp_data.nr
    if machine == "x86_64":
        op(jge, _X32_SYSCALL_BIT, jt="refuse")
    for name in _REFUSED_SYSCALLS:
        op(jeq, nr[name], jt="refuse")
    op(jeq, nr["socket"], jt="family")
    op(jeq, nr["socketpair"], jt="family")
    if refuse_processes:
        for name in ("fork", "vfork"):
            if name in nr:
                op(jeq, nr[name], jt="refuse")
        op(jeq, nr["clone"], jt="clone")
        op(jeq, nr["clone3"], jt="enosys")
    op(ret, _SECCOMP_RET_ALLOW)
    labels["family"] = len(code)
    op(load, 16)  # the low 32 bits of args[0]: the address family (an int)
    op(jeq, _AF_UNIX, jt="allow", jf="refuse")
    labels["clone"] = len(code)
    op(load, 16)  # clone's flags
    op(jset, _CLONE_THREAD, jt="allow", jf="refuse")
    labels["allow"] = len(code)
    op(ret, _SECCOMP_RET_ALLOW)
    labels["refuse"] = len(code)
    op(ret, _SECCOMP_RET_ERRNO | _EPERM)
    labels["enosys"] = len(code)
    op(ret, _SECCOMP_RET_ERRNO | _ENOSYS)
    for i, ins in enumerate(code):  # labels to forward offsets (BPF jumps only forward)
        for j in (1, 2):
            if isinstance(ins[j], str):
                ins[j] = labels[ins[j]] - (i + 1)
                if not 0 <= ins[j] < 256:
                    raise ValueError("seccomp program too long for a jump")
    return [tuple(ins) for ins in code]


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _build_filter(program: list) -> tuple:
    """The kernel's structures for `program`, built once (the zygote's call processes share them)."""
    instructions = (_SockFilter * len(program))(*(_SockFilter(*ins) for ins in program))
    return instructions, _SockFprog(len(program), instructions)


def _install_filter(built: tuple) -> None:
    # no_new_privs is set first (_confine): an unprivileged process may install a filter then.
    _check(_libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(built[1]), 0, 0),
           "seccomp filter")


def _ipc_limits(limits: dict) -> dict[str, str]:
    """sysctls of a call's own IPC namespace: System V shared memory at most `file_bytes` in all
    (a segment is a file by another name), 16 message queues of 16 KiB, 16 semaphore sets."""
    shm = limits["file_bytes"]
    pages = max(1, shm // os.sysconf("SC_PAGE_SIZE"))
    return {"kernel/shmmax": str(shm), "kernel/shmall": str(pages), "kernel/shmmni": "16",
            "kernel/msgmni": "16", "kernel/msgmnb": "16384", "kernel/sem": "32 512 32 16"}


def _enter_call_ipc(limits: dict) -> None:
    """A fresh IPC namespace (System V objects and POSIX message queues) for this call alone; it
    and everything in it are freed when the call's last process is gone."""
    _check(_libc.unshare(_CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")
    for name, value in _ipc_limits(limits).items():
        _write("/proc/sys/" + name, value)  # sysctls of the namespace we are in


# Without a call IPC namespace: the call's System V objects are removed once it has ended.
_SYSV_ID_COLUMN = {"shm": "shmid", "msg": "msqid", "sem": "semid"}


def _sysv_objects(owner: int) -> set[tuple[str, int]]:
    """(kind, id) of the System V objects of our IPC namespace that `owner` created or owns."""
    found = set()
    for kind, column in _SYSV_ID_COLUMN.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as fh:
                header = fh.readline().split()
                at_id, at_uid, at_cuid = header.index(column), header.index("uid"), header.index("cuid")
                for line in fh:
                    fields = line.split()
                    if owner in (int(fields[at_uid]), int(fields[at_cuid])):
                        found.add((kind, int(fields[at_id])))
        except (OSError, ValueError, IndexError):
            pass
    return found


def _remove_sysv(objects: set[tuple[str, int]]) -> None:
    for kind, ident in objects:  # IPC_RMID (0); a segment still attached goes with its last user
        if kind == "shm":
            _libc.shmctl(ident, 0, None)
        elif kind == "msg":
            _libc.msgctl(ident, 0, None)
        else:
            _libc.semctl(ident, 0, 0)


# A memory cgroup (v2) per call, where the kernel has the memory and pids controllers and they
# can be enabled below our cgroup; `memory.max` counts every page the call's processes use,
# memfds, tmpfs files and System V memory included.
_CGROUP_PREFIX = "turnsight-sandbox-"


def _unescape_mountinfo(text: str) -> str:
    import re

    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def _cgroup_v2_dir() -> str:
    """This process's cgroup v2 directory (OSError when no v2 hierarchy is mounted)."""
    with open("/proc/self/cgroup") as fh:
        paths = [line[3:].rstrip("\n") for line in fh if line.startswith("0::")]
    if not paths:
        raise OSError("no cgroup v2 hierarchy")
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            if right.split(" ", 1)[0] != "cgroup2":
                continue
            fields = left.split()
            root, point = _unescape_mountinfo(fields[3]), _unescape_mountinfo(fields[4])
            if root == "/" or paths[0] == root or paths[0].startswith(root + "/"):
                inner = paths[0] if root == "/" else paths[0][len(root):]
                return os.path.join(point, inner.lstrip("/"))
    raise OSError("no cgroup2 file system mounted")


def _read_text(path: str) -> str:
    with open(path) as fh:
        return fh.read()


def _remove_cgroup_dir(path: str) -> bool:
    """Kills what is left in a call's cgroup and removes it; False when it is still busy."""
    try:
        _write(os.path.join(path, "cgroup.kill"), "1")
    except OSError:
        pass  # before Linux 5.14; the zygote has killed the call's processes already
    for _ in range(50):
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.001)
    return False


def host_cgroup(report: dict) -> str | None:
    """Our cgroup's child for this host's calls (each call gets a child of it); None, with the
    reason in report["refused"], where the kernel or the delegation refuses one."""
    created = None
    try:
        base = _cgroup_v2_dir()
        available = _read_text(os.path.join(base, "cgroup.controllers")).split()
        missing = [c for c in ("memory", "pids") if c not in available]
        if missing:
            raise OSError(f"no {' and '.join(missing)} controller in cgroup v2 at {base}")
        for entry in os.listdir(base):  # hosts that died without removing theirs
            pid = entry[len(_CGROUP_PREFIX):]
            if entry.startswith(_CGROUP_PREFIX) and pid.isascii() and pid.isdigit():  # "²".isdigit()
                try:
                    os.kill(int(entry[len(_CGROUP_PREFIX):]), 0)
                except ProcessLookupError:
                    stale = os.path.join(base, entry)
                    for call in os.listdir(stale):
                        if os.path.isdir(os.path.join(stale, call)):
                            _remove_cgroup_dir(os.path.join(stale, call))
                    _remove_cgroup_dir(stale)
                except OSError:
                    pass
        enabled = _read_text(os.path.join(base, "cgroup.subtree_control")).split()
        if not {"memory", "pids"} <= set(enabled):
            try:
                _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
            except OSError as e:
                raise OSError(f"cannot enable memory and pids below {base} ({e.strerror})") from e
        created = os.path.join(base, f"{_CGROUP_PREFIX}{os.getpid()}")
        os.mkdir(created, 0o755)
        _write(os.path.join(created, "cgroup.subtree_control"), "+memory +pids")
        return created
    except OSError as e:
        if created is not None:
            _remove_cgroup_dir(created)
        report["refused"].append(f"memory_cgroup: {e.strerror or e}")
        return None


def make_call_cgroup(parent: str, name: str, limits: dict) -> str:
    """A call's cgroup: memory.max (its memory and its disk together, no swap), pids.max, and
    the whole call killed when it runs out (memory.oom.group)."""
    path = os.path.join(parent, name)
    os.mkdir(path, 0o755)
    try:
        settings = (("memory.max", limits["memory_bytes"] + limits["disk_bytes"]),
                    ("memory.swap.max", 0), ("memory.oom.group", 1),
                    ("pids.max", limits["processes"]))
        for setting, value in settings:
            try:
                _write(os.path.join(path, setting), str(value))
            except FileNotFoundError:
                if setting != "memory.swap.max":  # absent without swap accounting: no swap
                    raise
    except OSError:
        _remove_cgroup_dir(path)
        raise
    return path


def _cgroup_oom_kills(path: str) -> int:
    try:
        for line in _read_text(os.path.join(path, "memory.events")).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def probe_call_layers(report: dict, config: dict, cgroup: str | None) -> None:
    """Sets report["ipc_per_call"], ["seccomp"] and ["memory_cgroup"]: each per-call layer is
    set up once in a throwaway child exactly as a call process does it (the reason for one that
    fails goes to report["refused"]); `cgroup` is removed when it does not hold. Runs in the
    zygote: the first process forked after unshare(CLONE_NEWPID) is the namespace's init, and a
    namespace whose init has exited forks no more."""
    limits = {"file_bytes": int(config["file_mb"]) << 20, "memory_bytes": int(config["memory_mb"]) << 20,
              "disk_bytes": int(config["disk_mb"]) << 20, "processes": int(config["processes"])}
    steps = {}
    probe_cgroup = None
    if cgroup is not None:
        try:
            probe_cgroup = make_call_cgroup(cgroup, "probe", limits)
            steps["memory_cgroup"] = lambda: _write(os.path.join(probe_cgroup, "cgroup.procs"), "0")
        except OSError as e:
            report["refused"].append(f"memory_cgroup: call cgroup: {e.strerror or e}")
    if report["ipc_uts_ns"]:  # the host could make one: a call can make its own
        steps["ipc_per_call"] = lambda: _enter_call_ipc(limits)
    else:
        report["refused"].append("ipc_per_call: no IPC namespace (namespaces refused or disabled)")
    program = seccomp_program(os.uname().machine, refuse_processes=cgroup is None)
    if program is None:
        report["refused"].append(f"seccomp: no filter for the {os.uname().machine} ABI")
    else:
        def seccomp_step():
            _prctl(_PR_SET_NO_NEW_PRIVS, 1)
            _install_filter(_build_filter(program))
            try:
                socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
            except PermissionError:
                return
            raise OSError("the filter did not refuse socket(AF_INET)")
        steps["seccomp"] = seccomp_step
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        failed = {}
        for layer, step in steps.items():
            try:
                step()
            except BaseException as e:  # noqa: BLE001 - reported as that layer's reason
                failed[layer] = getattr(e, "strerror", None) or str(e) or type(e).__name__
        os.write(write_fd, json.dumps(failed).encode())
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as fh:
        answer = fh.read()
    os.waitpid(pid, 0)
    try:
        failed = json.loads(answer)
    except ValueError:
        failed = {layer: "the probe process died" for layer in steps}
    if probe_cgroup is not None:
        _remove_cgroup_dir(probe_cgroup)
    for layer in ("ipc_per_call", "seccomp", "memory_cgroup"):
        report[layer] = layer in steps and layer not in failed
        if layer in failed:
            report["refused"].append(f"{layer}: {failed[layer]}")
    if cgroup is not None and not report["memory_cgroup"]:
        _remove_cgroup_dir(cgroup)


def _preload() -> None:
    import importlib

    for name in PRELOADED_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


# -- framing -------------------------------------------------------------------------------------
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
    return json.loads(body.decode("utf-8", errors="surrogatepass"))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_frame(fd: int, obj) -> None:
    body = json.dumps(obj, ensure_ascii=False).encode("utf-8", errors="surrogatepass")
    _write_all(fd, _HEADER.pack(len(body)) + body)


# -- the call process (untrusted from the moment it reads its request) --------------------------
class _WallTimeout(BaseException):
    """Raised by SIGALRM; a BaseException so tool code's `except Exception` cannot swallow it."""


def _on_alarm(signum, frame):
    raise _WallTimeout()


def _format_result(value) -> str:
    """FTRL's conversion of a tool's return value to observation text."""
    # `type(...) is` on purpose: FTRL tests `type(predict) == dict`, so dict subclasses
    # (OrderedDict, defaultdict) go through str(), exactly as there. `envs.ftrl._as_text` is the
    # same rule for scoring; the sandbox imports nothing of the project, so it keeps its own.
    if type(value) is dict or type(value) is list:
        return json.dumps(value, ensure_ascii=False)
    if type(value) is not str:
        return str(value)
    return value


# The longest note `truncate` appends (executor.NOTE_CHARS): a reply holds at most max_output_chars
# characters plus this many.
_NOTE_CHARS = 64


def truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"... [output truncated: {len(text) - limit} more characters]"


def _hard_limit(kind: int, value: int) -> None:
    resource.setrlimit(kind, (value, value))


def _drop_capabilities() -> None:
    """All capabilities off (effective, permitted, inheritable): for the user-namespace mode."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (Data * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def _confine(spawn: dict, seccomp_filter: tuple | None) -> None:
    """Everything a call process does before it sees its request (runs as root or ns-root)."""
    os.setsid()
    limits = spawn["limits"]
    if spawn.get("cgroup"):
        _write(os.path.join(spawn["cgroup"], "cgroup.procs"), "0")
    if spawn.get("ipc_ns"):
        _enter_call_ipc(limits)
    _hard_limit(resource.RLIMIT_MSGQUEUE, 0)  # no POSIX message queue can be created
    _hard_limit(resource.RLIMIT_CORE, 0)
    _hard_limit(resource.RLIMIT_AS, limits["memory_bytes"])
    _hard_limit(resource.RLIMIT_FSIZE, limits["file_bytes"])
    _hard_limit(resource.RLIMIT_NOFILE, limits["open_files"])
    _hard_limit(resource.RLIMIT_NPROC, limits["processes"])
    _hard_limit(resource.RLIMIT_CPU, limits["cpu_seconds"])
    if spawn["chroot"]:
        os.chroot(spawn["dir"])
        os.chdir("/")
    else:
        os.chdir(spawn["dir"])
    if spawn["uid"] is not None:
        os.setgroups([])
        os.setgid(spawn["uid"])
        os.setuid(spawn["uid"])  # from root: every capability is dropped with it
    elif spawn["drop_caps"]:
        _drop_capabilities()
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    os.environ.clear()
    os.environ.update({"HOME": "/", "TMPDIR": "/", "LANG": "C.UTF-8"})
    if seccomp_filter is not None:
        _install_filter(seccomp_filter)  # last: nothing above needs what it refuses


def _call_process(request_fd: int, reply_fd: int, spawn: dict, seccomp_filter: tuple | None) -> None:
    """Body of a call process; never returns."""
    kind, text = b"e", "the call process failed before running the tool"
    try:
        # Only the two pipes stay open: no descriptor of the host, the zygote or the trainer.
        os.dup2(request_fd, 3)
        os.dup2(reply_fd, 4)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(5, 1 << 16)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        _confine(spawn, seccomp_filter)
        chunks = []
        while True:
            chunk = os.read(3, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(3)
        request = json.loads(b"".join(chunks).decode("utf-8", errors="surrogatepass"))
        kind, text = _run_tool(request)
        text = truncate(text, int(request["max_chars"]))
    except BaseException as e:  # noqa: BLE001 - the reply must always be written
        try:
            kind, text = b"e", f"{type(e).__name__}: {e}"
        except BaseException:  # noqa: BLE001
            kind, text = b"e", "call process error"
    try:
        body = kind + text.encode("utf-8", errors="surrogatepass")
        _write_all(4, _HEADER.pack(len(body)) + body)
    finally:
        os._exit(0)


def _run_tool(request: dict) -> tuple[bytes, str]:
    name, timeout, memory_mb = request["name"], float(request["timeout"]), request["memory_mb"]
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        try:
            # Deterministic for a seed: the same (episode seed, call) sees the same stream.
            random.seed(int(request["seed"]))
            # "<string>" as the filename so SyntaxError text matches FTRL's exec(str).
            code = compile(request["source"], "<string>", "exec")
            namespace: dict = {}
            exec(code, namespace, namespace)  # dataset tool code, confined to this process
            if name not in namespace:
                raise NameError(f"name {name} is not defined")
            text = _format_result(namespace[name](**request["args"]))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        return b"o", text
    except _WallTimeout:
        return b"e", f"Function {name} timed out after {timeout:.6f} seconds."
    except MemoryError as e:
        detail = str(e)
        return b"e", f"MemoryError: memory limit of {memory_mb} MiB exceeded" + (
            f" ({detail})" if detail else "")
    except BaseException as e:  # noqa: BLE001 - SystemExit/KeyboardInterrupt from tool code too
        try:
            return b"e", str(e)
        except BaseException:  # noqa: BLE001 - an exception whose __str__ itself fails
            return b"e", type(e).__name__


# -- the zygote ----------------------------------------------------------------------------------
def _zygote(sock: socket.socket, isolation: dict) -> None:
    """Forks call processes on command; kills and reaps them. Never returns."""
    # Non-dumpable: a call process under the same uid (user-namespace mode) cannot ptrace it or
    # open its descriptors through /proc; orphans of calls are re-parented here and reaped.
    _prctl(_PR_SET_DUMPABLE, 0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    seccomp_filter = None
    if isolation["seccomp"]:
        seccomp_filter = _build_filter(seccomp_program(
            os.uname().machine, refuse_processes=not isolation["memory_cgroup"]))
    # Without an IPC namespace per call: System V objects of the call's uid (or, without a uid of
    # its own, the ones that appeared while it ran) are removed after it.
    sysv_before: dict[int, set] = {}
    # Everything allocated so far is shared copy-on-write with each call process; a collection
    # there would touch (and copy) every page of it.
    gc.freeze()
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
        except OSError:
            os._exit(1)
        if not msg:
            os._exit(0)
        command = json.loads(msg)
        if command["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                sock.close()
                _call_process(fds[0], fds[1], command, seccomp_filter)
            for fd in fds:
                os.close(fd)
            if not isolation["ipc_per_call"]:
                sysv_before[pid] = set() if command["uid"] is not None else _sysv_objects(os.geteuid())
            sock.send(json.dumps({"pid": pid}).encode())
        elif command["op"] == "finish":
            uid = command.get("uid")
            _kill_tree(command["pid"], uid, isolation)
            status, cpu = _wait(command["pid"])
            _reap_tree(command["pid"], uid, isolation)
            if not isolation["ipc_per_call"]:
                owner = uid if uid is not None else os.geteuid()
                _remove_sysv(_sysv_objects(owner) - sysv_before.pop(command["pid"], set()))
            sock.send(json.dumps({"status": status, "cpu": cpu}).encode())


def _kill_tree(pid: int, uid: int | None, isolation: dict) -> None:
    """Kills the call process and everything it started, daemons and new sessions included."""
    if isolation["pid_ns"]:
        # We are init of a namespace that holds only call processes: -1 is all of them.
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    elif uid is not None:
        # Every process with the call's uid, wherever it went: kill(-1) as that (real and
        # effective) uid reaches exactly those; the saved root uid lets us switch back.
        os.setresuid(uid, uid, 0)
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.setresuid(0, 0, 0)
    else:
        try:
            os.killpg(pid, signal.SIGKILL)  # its session; a setsid() grandchild escapes this
        except (ProcessLookupError, PermissionError):
            pass
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _wait(pid: int) -> tuple[int, float]:
    try:
        _, status, usage = os.wait4(pid, 0)
    except ChildProcessError:
        return 0, 0.0
    return status, usage.ru_utime + usage.ru_stime


def _reap_tree(pid: int, uid: int | None, isolation: dict) -> None:
    """Kills and reaps until none of the call's processes is left, zombies included.

    Orphans of the call are re-parented to us (init of the namespace, or child subreaper), so
    "no child left" means "nothing of the call is left". Killing again on every round covers a
    process that was being forked while the first signal went out.
    """
    complete = isolation["pid_ns"] or uid is not None
    deadline = time.monotonic() + 5.0
    while True:
        try:
            reaped, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if reaped == 0:
            if not complete or time.monotonic() > deadline:
                return  # fallback mode: a setsid() escapee is not ours to wait for (reported)
            _kill_tree(pid, uid, isolation)
            time.sleep(0.0005)


# -- the host ------------------------------------------------------------------------------------
class Host:
    def __init__(self, config: dict, isolation: dict, zygote_sock: socket.socket,
                 cgroup: str | None = None):
        self.config = config
        self.cgroup = cgroup  # the host's memory cgroup (each call gets a child of it), or None
        self.busy_cgroups: list[str] = []  # call cgroups not yet empty when their call ended
        self.isolation = isolation
        self.zygote = zygote_sock
        self.cache: dict[str, str] = {}
        self.base = config["workdir"]
        self.uid = (1_000_000 + os.getpid()) if isolation["uid_drop"] else None
        self.seq = 0
        mb = 1024 * 1024
        self.limits = {
            "memory_bytes": int(config["memory_mb"]) * mb,
            "file_bytes": int(config["file_mb"]) * mb,
            "open_files": int(config["open_files"]),
            "processes": int(config["processes"]),
        }
        if isolation["user_ns"]:
            # The kernel counts processes per user namespace: ours holds the host, the zygote
            # and the call process (the cap counts the call itself).
            self.limits["processes"] += 2
        elif not isolation["uid_drop"]:
            # The process cap counts every process of the uid; without a uid of our own, leave
            # room for the ones the user already runs.
            self.limits["processes"] += _count_own_processes()
        self.max_chars = int(config["max_output_chars"])
        self.reply_cap = 4 * self.max_chars + 4096
        # pids.max counts the call's own tasks only (its cgroup holds nothing else).
        self.cgroup_limits = dict(self.limits, processes=int(config["processes"]),
                                  disk_bytes=int(config["disk_mb"]) * mb)

    def _make_cgroup(self) -> str | None:
        if self.cgroup is None:
            return None
        self.busy_cgroups = [p for p in self.busy_cgroups if not _remove_cgroup_dir(p)]
        return make_call_cgroup(self.cgroup, f"call-{self.seq}", self.cgroup_limits)

    def close(self) -> None:
        if self.cgroup is not None:
            for path in self.busy_cgroups:
                _remove_cgroup_dir(path)
            _remove_cgroup_dir(self.cgroup)

    # One private directory per call: a size-capped tmpfs in the mount namespace, else a plain
    # directory (no total quota: file size only, see the report).
    def _make_dir(self) -> str:
        self.seq += 1
        os.makedirs(self.base, mode=0o711, exist_ok=True)
        path = os.path.join(self.base, f"call-{self.seq}")
        os.mkdir(path, 0o700)
        owner = self.uid if self.uid is not None else os.geteuid()
        if self.isolation["mount_ns"]:
            options = f"size={int(self.config['disk_mb'])}m,nr_inodes=4096,mode=0700,uid={owner},gid={owner}"
            _check(_libc.mount(b"tmpfs", path.encode(), b"tmpfs",
                               _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options.encode()),
                   "mount tmpfs")
        elif self.uid is not None:
            os.chown(path, self.uid, self.uid)
        return path

    def _remove_dir(self, path: str) -> None:
        if self.isolation["mount_ns"]:
            _libc.umount2(path.encode(), _MNT_DETACH)
        else:
            shutil.rmtree(path, ignore_errors=True)
        try:
            os.rmdir(path)
        except OSError:
            pass

    def serve(self, call: dict) -> dict:
        key = call["key"]
        source = call.get("source")
        if source is not None:
            self.cache[key] = source
            if len(self.cache) > int(self.config.get("max_cached_sources", _MAX_CACHED_SOURCES)):
                self.cache.pop(next(iter(self.cache)))
        elif key in self.cache:
            source = self.cache[key]
        else:
            return {"need_source": True}
        name = str(call["name"])
        timeout, cpu = float(call["timeout"]), float(call["cpu"])
        request = {"source": source, "name": name, "args": call["args"],
                   "seed": int(call.get("seed", 0)), "timeout": timeout,
                   "max_chars": self.max_chars, "memory_mb": int(self.config["memory_mb"])}
        path = self._make_dir()
        try:
            cgroup = self._make_cgroup()
        except OSError as e:  # this call fails closed; the next one tries again
            self._remove_dir(path)
            return {"err": f"tool sandbox: cannot make the call's memory cgroup: {e.strerror or e}"}
        try:
            return self._run(path, name, request, timeout, cpu, cgroup)
        finally:
            self._remove_dir(path)
            if cgroup is not None and not _remove_cgroup_dir(cgroup):
                self.busy_cgroups.append(cgroup)

    def _run(self, path: str, name: str, request: dict, timeout: float, cpu: float,
             cgroup: str | None = None) -> dict:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        spawn = {"op": "spawn", "dir": path, "uid": self.uid,
                 "chroot": self.isolation["chroot"], "drop_caps": self.isolation["user_ns"],
                 "limits": dict(self.limits, cpu_seconds=_cpu_rlimit(cpu)),
                 "cgroup": cgroup, "ipc_ns": self.isolation["ipc_per_call"]}
        try:
            socket.send_fds(self.zygote, [json.dumps(spawn).encode()], [req_r, rep_w])
        finally:
            os.close(req_r)
            os.close(rep_w)
        pid = json.loads(self.zygote.recv(1 << 16))["pid"]
        deadline = time.monotonic() + timeout + float(self.config["kill_grace_s"])
        timed_out = False
        reply = None
        try:
            body = json.dumps(request, ensure_ascii=False).encode("utf-8", errors="surrogatepass")
            try:
                sent = _write_with_deadline(req_w, body, deadline)
            finally:
                os.close(req_w)  # EOF: the call process has its whole request
            if sent:
                reply = _read_reply(rep_r, self.reply_cap, deadline)
                timed_out = reply == "timeout"
            else:
                timed_out = True
        finally:
            os.close(rep_r)
        self.zygote.send(json.dumps({"op": "finish", "pid": pid, "uid": self.uid}).encode())
        result = json.loads(self.zygote.recv(1 << 16))
        if timed_out:
            return {"err": f"Function {name} timed out after {timeout:.6f} seconds."}
        if isinstance(reply, tuple):
            kind, text = reply
            # The byte cap bounds what is read; the observation's cap counts characters, after
            # decoding (a forged frame or a patched str.encode can bypass the call's own cut).
            if len(text) > self.max_chars + _NOTE_CHARS:
                text = truncate(text, self.max_chars)
            if kind == "o":
                return {"ok": text}
            return {"err": text}
        if cgroup is not None and _cgroup_oom_kills(cgroup):
            return {"err": f"MemoryError: memory limit of {self.config['memory_mb']} MiB exceeded "
                           "(the call's processes, files and IPC together)"}
        return {"err": _death_message(result["status"], result["cpu"], cpu)}


def _cpu_rlimit(cpu: float) -> int:
    """RLIMIT_CPU (soft = hard) for a call with a `cpu`-second budget.

    One second above the budget: a busy loop reaches the wall-clock limit (same seconds) first
    and gets the timeout message; only code burning CPU faster than the clock (threads) is
    killed by the kernel at the CPU limit.
    """
    return int(math.ceil(cpu)) + 1


def _write_with_deadline(fd: int, data: bytes, deadline: float) -> bool:
    """False when the call process did not take its request in time (or is gone)."""
    os.set_blocking(fd, False)
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        _, ready, _ = select.select([], [fd], [], remaining)
        if not ready:
            return False
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue
        except BrokenPipeError:
            return True  # it died first; its exit status tells the story
    return True


def _read_reply(fd: int, cap: int, deadline: float):
    """(kind, text) for a well-formed reply; "timeout"; or None (no or malformed reply)."""
    buffer = b""
    need = _HEADER.size
    truncated = False
    while len(buffer) < need:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "timeout"
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            return "timeout"
        chunk = os.read(fd, min(1 << 20, cap + _HEADER.size - len(buffer) + 1))
        if not chunk:
            return None
        buffer += chunk
        if need == _HEADER.size and len(buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer)
            if length < 1:
                return None
            # A reply larger than any honest one is cut at the cap.
            need = _HEADER.size + min(length, cap)
            truncated = length > cap
    body = buffer[_HEADER.size:need]
    kind = body[:1]
    if kind not in (b"o", b"e"):
        return None
    try:
        text = body[1:].decode("utf-8", errors="surrogatepass")
    except UnicodeDecodeError:
        text = body[1:].decode("utf-8", errors="replace")
    if truncated:
        text += "... [output truncated]"
    return kind.decode(), text


def _death_message(status: int, cpu_used: float, cpu_limit: float) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGKILL and cpu_used >= _cpu_rlimit(cpu_limit) - 0.05:
            return f"Function exceeded its CPU time limit of {cpu_limit:g} seconds."
        try:
            sig_name = signal.Signals(sig).name
        except ValueError:
            sig_name = f"signal {sig}"
        return f"tool process was killed by {sig_name}"
    if os.WIFEXITED(status):
        return f"tool process exited with code {os.WEXITSTATUS(status)}"
    return "tool process stopped responding"


def _count_own_processes() -> int:
    uid = os.getuid()
    count = 0
    try:
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}").st_uid == uid:
                        count += 1
                except OSError:
                    pass
    except OSError:
        return 64
    return count


def main() -> None:
    config = json.loads(sys.argv[1])
    # Private protocol descriptors, then 0/1/2 point at /dev/null.
    in_fd = os.dup(0)
    out_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    # No parent-death signal here: it would fire when the trainer *thread* that started us
    # ends. A dead trainer closes our stdin instead; we return, and the zygote's own
    # parent-death signal (its parent is this single-threaded process) takes every call with it.
    isolation = enter_namespaces(bool(config.get("namespaces", True)))
    cgroup = host_cgroup(isolation)
    _preload()
    host_sock, zygote_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        host_sock.close()
        os.close(in_fd)
        os.close(out_fd)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        probe_call_layers(isolation, config, cgroup)
        zygote_sock.send(json.dumps(isolation).encode())
        _zygote(zygote_sock, isolation)
    zygote_sock.close()
    isolation = json.loads(host_sock.recv(1 << 16))  # with the per-call layers the zygote tried
    if not isolation["memory_cgroup"]:
        cgroup = None
    # chroot needs CAP_SYS_CHROOT: root, or root of our own user namespace.
    isolation["chroot"] = isolation["root"] or isolation["user_ns"]
    isolation["disk_quota"] = isolation["mount_ns"]
    host = Host(config, isolation, host_sock, cgroup)
    _write_frame(out_fd, {"ready": True, "isolation": isolation})
    try:
        while True:
            request = _read_frame(in_fd)
            if request is None:
                return  # trainer closed the pipe; the zygote's death takes the namespace with it
            calls = request["calls"] if request.get("op") == "batch" else [request]
            for call in calls:
                reply = host.serve(call)
                reply["id"] = call.get("id")
                _write_frame(out_fd, reply)
    finally:
        host.close()


if __name__ == "__main__":
    main()
