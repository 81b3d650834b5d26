"""Training checkpoints with orbax: parameters, optimizer state, and meta (the next step, the seed,
the data position). No RNG state is stored: every random stream is re-derived from seed and step.

Layout of a run folder (`--workdir`):

  checkpoints/<step>/{params,opt_state,meta}   orbax, one folder per step, keep-last-N
  turnsight.lock                               the running trainer's lock (pid, host, since when)
  config.json                                  the resolved run config (ml_collections JSON)
  model/config.json                            the policy architecture (Hugging Face form)
  tokenizer/                                   the tokenizer the run used
  export/                                      Hugging Face export of the trained policy

Orbax writes each step into a temporary folder and renames it only when complete. On top of that
a step is *valid* only when its manifest (`checkpoints/<step>/turnsight_manifest.json`: every
file's size and CRC-32, written last) is present and matches the files: a truncated or
bit-flipped file, a missing metadata file, an empty step folder or a save killed before the
manifest was written all make the step invalid. Resume and `evaluate` use the newest valid step
and say which newer steps they skipped and why (`latest_valid_step`); resume moves invalid steps
aside to `checkpoints/invalid-<step>-<n>` (nothing is deleted) so they are written again.
Verification reads every byte of the step it accepts (CRC-32 runs at ~3.7 GB/s on one core of
the 2-core box: an 8B run's ~100 GB of f32 parameters and Adam moments is about half a minute
plus the disk's read time), once at save and once per resume or evaluation.

Nothing in a run folder is trusted further than that check:
- a step folder is named by its step in ASCII digits without a leading zero (what orbax writes);
  "²" (str.isdigit() is true, int() fails) or "007" is no step and is ignored;
- the manifest must be a JSON object {"format": 1, "files": {path: [size, crc32]}} of at most
  64 MiB; any other shape (a list, a string where an object is expected, floats, nesting too
  deep to parse) is a reason naming the file, the key, what was expected and what was found;
- every manifest path is relative and inside the step folder (no "..", no absolute path), and
  only the step's own regular files are read: a symbolic link anywhere in the step (or the step
  folder itself being one), a named pipe, socket or device makes the step invalid, and files are
  opened without following links. `check_step` returns a reason for everything it finds and never
  raises on a folder's contents.
- Rotation (keep-last-N) runs after the new step's manifest is written, never inside orbax's
  save: a step that cannot be removed (a symbolic link, a permission) is reported and left, and
  the save still completes. A removed step loses its manifest first, so a removal cut short
  leaves an invalid step, never a valid-looking one.
- One trainer per run folder: `WorkdirLock` holds `turnsight.lock` (fcntl.flock, the holder's
  pid, host and start time in the file) from the moment the inputs are checked to the run's end.
  A second trainer exits 2 with one line naming the holder; a lock file whose flock is free (its
  process died: the kernel drops the lock) is taken over with a message naming the dead holder.
  Where the file system has no flock, the file decides: a live pid on this host, or any holder
  on another host, keeps it; a dead pid on this host is taken over. Evaluation reads a run
  folder without the lock (it writes nothing there).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import stat
import sys
import time
import zlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from turnsight_jax.errors import CheckpointError, WorkdirInUse
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import Qwen3, RuntimeOptions


MANIFEST = "turnsight_manifest.json"
MANIFEST_FORMAT = 1
MANIFEST_MAX_BYTES = 64 << 20  # a manifest lists a step's files: ~100 bytes each


def _crc32(fd: int) -> int:
    crc = 0
    with os.fdopen(fd, "rb") as fh:
        while chunk := fh.read(1 << 23):
            crc = zlib.crc32(chunk, crc)
    return crc


_KINDS = {stat.S_IFIFO: "a named pipe", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device"}


def _scan(step_dir: pathlib.Path) -> tuple[dict[str, int], str | None]:
    """({path relative to the step: size} of the step's regular files, the manifest excluded;
    the first entry that no step may hold, or None). Nothing is followed: a symbolic link, file
    or folder, anywhere under the step is named as the problem (it could point out of the step)."""
    files: dict[str, int] = {}
    for root, dirs, names in os.walk(step_dir, followlinks=False, onerror=_raise):
        base = pathlib.Path(root)
        for name in sorted(dirs) + sorted(names):
            path = base / name
            rel = path.relative_to(step_dir).as_posix()
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                return files, (f"{rel}: a symbolic link (to {_short(os.readlink(path), 200)}); a step's files "
                               f"must be its own, no link is followed out of the step folder")
            if stat.S_ISDIR(st.st_mode):
                continue
            if not stat.S_ISREG(st.st_mode):
                return files, f"{rel}: {_KINDS.get(stat.S_IFMT(st.st_mode), 'not a regular file')}, expected a file"
            if rel != MANIFEST:
                files[rel] = st.st_size
    return files, None


def _raise(err: OSError) -> None:
    raise err


def _what(value: Any) -> str:
    """A JSON value described for an error message (never its whole text)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return f"the number {value:.6g}" if isinstance(value, float) else f"the number {value}"
    if isinstance(value, str):
        return f"a string ({_short(value)})"
    if isinstance(value, list):
        return f"a list of {len(value)} item{'s' * (len(value) != 1)}"
    return f"an object of {len(value)} key{'s' * (len(value) != 1)}"


def _short(text: str, limit: int = 60) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def _outside(rel: str) -> str | None:
    """Why a manifest path could reach outside the step folder (or is no path the writer makes)."""
    if not rel:
        return "an empty path"
    if not rel.isprintable():
        return "a path with unprintable characters"
    if rel.startswith("/"):
        return "an absolute path"
    if ".." in rel.split("/"):
        return "a path with a '..' component"
    if any(part in ("", ".") for part in rel.split("/")):
        return "not a normalised path (an empty or '.' component)"
    if rel == MANIFEST:
        return "the manifest itself"
    return None


_CRC_MAX = 2 ** 32 - 1


def _read_manifest(step_dir: pathlib.Path) -> tuple[dict[str, tuple[int, int]] | None, str | None]:
    """(path -> (size, crc32), None) from a step's manifest, or (None, why it is not one)."""
    path = step_dir / MANIFEST
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as fh:
            raw = fh.read(MANIFEST_MAX_BYTES + 1)
    except OSError as e:
        return None, f"unreadable {MANIFEST} ({e.strerror})"
    if len(raw) > MANIFEST_MAX_BYTES:
        return None, f"{MANIFEST}: larger than {MANIFEST_MAX_BYTES >> 20} MiB, expected a manifest of file sizes"
    try:
        doc = json.loads(raw)
    except RecursionError:
        return None, f"{MANIFEST}: JSON nested too deeply, expected {{\"format\": 1, \"files\": {{...}}}}"
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return None, f"unreadable {MANIFEST} ({e})"
    if not isinstance(doc, dict):
        return None, (f"{MANIFEST}: the top level is {_what(doc)}, expected an object "
                      f"{{\"format\": 1, \"files\": {{...}}}}")
    for key in ("format", "files"):
        if key not in doc:
            return None, f"{MANIFEST}: no key \"{key}\" (keys: {', '.join(map(_short, sorted(doc)[:5])) or 'none'})"
    if type(doc["format"]) is not int or doc["format"] != MANIFEST_FORMAT:
        return None, f"{MANIFEST}: \"format\" is {_what(doc['format'])}, expected {MANIFEST_FORMAT}"
    if not isinstance(doc["files"], dict):
        return None, f"{MANIFEST}: \"files\" is {_what(doc['files'])}, expected an object of path -> [size, crc32]"
    files = {}
    for rel, entry in doc["files"].items():
        where = f"{MANIFEST}: files[{_short(rel)}]"
        if why := _outside(rel):
            return None, f"{where}: {why}, expected a relative path inside the step folder"
        if not (isinstance(entry, list) and len(entry) == 2 and all(type(x) is int for x in entry)):
            return None, f"{where} is {_what(entry)}, expected [size, crc32] (two integers)"
        size, crc = entry
        if size < 0 or not 0 <= crc <= _CRC_MAX:
            return None, f"{where} is [{size}, {crc}], expected a size >= 0 and a CRC-32 in 0..{_CRC_MAX}"
        files[rel] = (size, crc)
    return files, None


def write_manifest(step_dir: str | pathlib.Path) -> None:
    """Records every file of a finished step (size, CRC-32); written atomically, last."""
    step_dir = pathlib.Path(step_dir)
    sizes, problem = _scan(step_dir)
    if problem is not None:  # never a manifest over what check_step refuses: the step stays invalid
        raise CheckpointError(f"{step_dir}: not writing {MANIFEST}: {problem}")
    files = {rel: [size, _crc32(os.open(step_dir / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))]
             for rel, size in sizes.items()}
    tmp = step_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"format": MANIFEST_FORMAT, "files": files}, fh, indent=0, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, step_dir / MANIFEST)


def check_step(step_dir: str | pathlib.Path) -> str | None:
    """Why the step in `step_dir` is not valid, or None when it is (see the module docstring).

    Never raises on what it finds: a manifest of the wrong shape, a path that leaves the step
    folder, a symbolic link or an unreadable file are each a reason. Only the step's own regular
    files are read, each through a descriptor that follows no link."""
    step_dir = pathlib.Path(step_dir)
    try:
        if step_dir.is_symlink():
            return (f"the step folder is a symbolic link (to {_short(os.readlink(step_dir), 200)}); a step is read "
                    f"from its own folder only")
        if not step_dir.is_dir():
            return "not a folder"
        sizes, problem = _scan(step_dir)
        if problem is not None:
            return problem
        if not sizes and not os.path.lexists(step_dir / MANIFEST):
            return "empty folder"
        if not os.path.lexists(step_dir / MANIFEST):
            return f"no {MANIFEST} (the save did not finish)"
        files, problem = _read_manifest(step_dir)
        if problem is not None:
            return problem
        for rel, (size, crc) in files.items():
            if rel not in sizes:
                return f"missing file {rel}"
            if sizes[rel] != size:
                return f"{rel}: {sizes[rel]} bytes, expected {size} (truncated or replaced)"
            if _crc32(os.open(step_dir / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)) != crc:
                return f"{rel}: checksum mismatch (corrupt bytes)"
        extra = [rel for rel in sizes if rel not in files]
        if extra:
            return f"files not in the manifest: {', '.join(extra[:3])}"
        return None
    except OSError as e:  # unreadable folders or files, a file removed while being checked
        where = pathlib.Path(e.filename).relative_to(step_dir).as_posix() if e.filename and \
            pathlib.Path(e.filename).is_relative_to(step_dir) else step_dir.name
        return f"{where}: unreadable ({e.strerror or e})"


# A step folder's name: the step in ASCII digits, as orbax writes it (str(step)): "²" or "٣" pass
# str.isdigit() but are no step, and "007" would be read as step 7 while orbax reads "7".
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")


def step_folders(workdir: str | pathlib.Path) -> dict[int, pathlib.Path]:
    """Step number -> folder, for every folder under `workdir/checkpoints` named by a step number
    (ASCII digits, no leading zero). A symbolic link so named is listed too: `check_step` refuses
    it with its reason, rather than it being skipped unseen."""
    root = pathlib.Path(workdir) / "checkpoints"
    if not root.is_dir():
        return {}
    try:
        return {int(p.name): p for p in root.iterdir()
                if _STEP_NAME.fullmatch(p.name) and (p.is_symlink() or p.is_dir())}
    except OSError as e:
        raise CheckpointError(f"{root}: cannot list the checkpoints ({e.strerror or e})") from None


def latest_valid_step(workdir: str | pathlib.Path) -> tuple[int | None, list[tuple[int, str]]]:
    """(newest valid step or None, [(newer invalid step, why)], newest first)."""
    skipped = []
    for step, folder in sorted(step_folders(workdir).items(), reverse=True):
        reason = check_step(folder)
        if reason is None:
            return step, skipped
        skipped.append((step, reason))
    return None, skipped


def quarantine(workdir: str | pathlib.Path, step: int) -> pathlib.Path:
    """Moves an invalid step aside (`checkpoints/invalid-<step>-<n>`); nothing is deleted."""
    folder = step_folders(workdir)[step]
    n = 0
    while os.path.lexists(target := folder.parent / f"invalid-{step}-{n}"):
        n += 1
    folder.rename(target)  # a symbolic link is moved as the link
    return target


def resume_step(workdir: str | pathlib.Path, log=print) -> int | None:
    """The step a run in `workdir` resumes from: the newest valid one (None: start afresh).

    Newer invalid steps are logged and moved aside (process 0) so that the run writes them again;
    a folder whose every step is invalid is a `CheckpointError` (nothing is guessed)."""
    latest, skipped = latest_valid_step(workdir)
    if skipped and latest is None:
        raise no_valid_checkpoint(workdir, skipped)
    for bad, why in skipped:
        if jax.process_index() == 0:
            try:
                moved = quarantine(workdir, bad)
            except OSError as e:  # the run would write this step again over it
                raise CheckpointError(f"{pathlib.Path(workdir) / 'checkpoints' / str(bad)}: invalid ({why}) and "
                                      f"cannot be moved aside ({e.strerror or e}); move or remove it") from None
            log(f"resume: skipping checkpoint step {bad}: {why} (moved to {moved.name})")
    return latest


def no_valid_checkpoint(workdir, skipped: list[tuple[int, str]]) -> CheckpointError:
    detail = "; ".join(f"step {s}: {why}" for s, why in skipped)
    return CheckpointError(f"{pathlib.Path(workdir) / 'checkpoints'}: no valid checkpoint ({detail})")


LOCK_FILE = "turnsight.lock"


class WorkdirLock:
    """One trainer per run folder: `workdir/turnsight.lock`, held with `fcntl.flock` for the life
    of the run and naming its holder (pid, host, since when) for the error the next one gets.

    The kernel drops a flock when its process dies, however it dies, so a lock file whose lock is
    free is stale: its holder is gone (SIGKILL, a crash, a preempted machine); it is taken over with
    a message naming that holder. On a file system without flock (some network mounts) the lock
    file alone decides: a holder on this host is checked for life (a dead one is taken over), a
    holder on another host is believed. `release` removes the file (a normal exit)."""

    def __init__(self, workdir: str | pathlib.Path, log=None):
        self.workdir = pathlib.Path(workdir)
        self.path = self.workdir / LOCK_FILE
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock or raises `WorkdirInUse` (one line naming the holder)."""
        import fcntl

        if self._fd is not None:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as e:  # a symbolic link, a folder, no permission
                raise CheckpointError(f"{self.path}: cannot open the workdir lock ({e.strerror or e})") from None
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                except BlockingIOError:
                    raise self._in_use(_read_holder(fd)) from None
                except OSError:  # no flock here (ENOLCK, EOPNOTSUPP...): the file's word is all there is
                    locked = False
                # The holder's release removes the file: a lock taken on a removed file is no lock.
                try:
                    same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                previous = _read_holder(fd)
                if not locked and previous is not None and _alive(previous):
                    raise self._in_use(previous)
            except BaseException:
                os.close(fd)
                raise
            break
        if previous is not None or os.fstat(fd).st_size:
            self.log(f"workdir lock: taking over the stale lock {self.path} of "
                     f"{_describe(previous)} (that process is gone)")
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        os.ftruncate(fd, 0)
        os.pwrite(fd, (record + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def _in_use(self, holder: dict | None) -> WorkdirInUse:
        return WorkdirInUse(f"{self.workdir} is in use by another trainer: {_describe(holder)} (lock file "
                            f"{self.path}; two trainers on one run folder overwrite each other's checkpoints)")

    def release(self) -> None:
        """Removes the lock file and drops the lock (removed first: no one takes a dying lock)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)

    def __enter__(self) -> "WorkdirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> dict | None:
    """The holder a lock file names ({"pid", "host", "since"}), or None (empty or not ours)."""
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"null")
    except (OSError, ValueError, RecursionError):
        return None
    if not (isinstance(doc, dict) and type(doc.get("pid")) is int and isinstance(doc.get("host"), str)):
        return None
    return {"pid": doc["pid"], "host": doc["host"], "since": str(doc.get("since", "?"))}


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "a holder the lock file does not name"
    return f"pid {holder['pid']} on host {holder['host']} since {holder['since']}"


def _alive(holder: dict) -> bool:
    """Whether a lock file's holder may still run: on this host, whether its pid exists; on
    another host it cannot be told from here, so yes."""
    if holder["host"] != socket.gethostname():
        return True
    pid = holder["pid"]
    if pid <= 0 or pid == os.getpid():  # not a process / one this process left (a pid reused in a fresh container)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OverflowError:
        return False
    return True


# The step's learned auxiliaries (rl.step.init_aux), each an optional item of a step's checkpoint.
AUX_ITEMS = ("critic", "prm", "previous_policy")  # previous_policy: a rollout controller's old policy (methods.appo)


class Checkpointer:
    """Save and restore (params, opt_state, meta) by step under `workdir/checkpoints`."""

    def __init__(self, workdir: str | pathlib.Path, *, keep: int = 3, async_save: bool = False, log=None):
        if keep < 1:
            raise ValueError(f"Checkpointer: keep must be >= 1 (keep={keep} would delete every save)")
        self.workdir = pathlib.Path(workdir).absolute()
        self.keep = keep
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        # Rotation is ours (`_rotate`, after the new step's manifest), not orbax's max_to_keep: orbax
        # removes old steps inside `save`, before the manifest exists, and one step it cannot remove
        # (a symbolic link) raised out of the save and left the new step without its manifest.
        self.manager = ocp.CheckpointManager(
            self.workdir / "checkpoints",
            options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                                 enable_async_checkpointing=async_save),
            item_names=("params", "opt_state", "meta", "teacher", *AUX_ITEMS),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, params, opt_state, meta: dict[str, Any], *, teacher=None, aux=None,
             files: dict[str, str] | None = None) -> None:
        """`teacher`: the EMA teacher's parameters (teacher.weights='ema'); `aux`: the step's
        learned auxiliaries ({"critic": ..., "prm": ...}, rl.step.init_aux); each saved as its own
        item (AUX_ITEMS). `files`: {name: text} written into the step folder (process 0) before
        its manifest, so they are verified with it (SLIM's skill library); `read_file` reads one."""
        for name in files or {}:  # refused before anything is written
            if "/" in name or "\x00" in name or name in ("", ".", "..", MANIFEST, MANIFEST + ".tmp"):
                raise ValueError(f"checkpoint file name {name!r}: a plain file name is expected")
        items = dict(params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
                     meta=ocp.args.JsonSave(meta))
        if teacher is not None:
            items["teacher"] = ocp.args.StandardSave(teacher)
        for name, state in (aux or {}).items():
            if name not in AUX_ITEMS:
                raise ValueError(f"unknown auxiliary {name!r}; checkpoint items: {AUX_ITEMS}")
            items[name] = ocp.args.StandardSave(state)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self.manager.wait_until_finished()
        if os.environ.get("TURNSIGHT_FAULT_KILL_BEFORE_MANIFEST") == str(step):
            # Test hook (tests/test_train.py chaos test): the worst moment to die, every file of
            # the step written and none of it verified yet.
            os.kill(os.getpid(), signal.SIGKILL)
        if jax.process_index() == 0:
            for name, text in (files or {}).items():
                (self.workdir / "checkpoints" / str(step) / name).write_text(text, encoding="utf-8")
            write_manifest(self.workdir / "checkpoints" / str(step))
            self._rotate(step)

    def _rotate(self, saved: int) -> None:
        """Removes the steps older than the newest `keep` (process 0, after `saved`'s manifest).
        Never raises: a step that cannot be removed (a symbolic link, a permission) is reported
        and left. Its manifest goes first, so a removal cut short leaves an invalid step."""
        try:
            steps = sorted(step_folders(self.workdir), reverse=True)
        except CheckpointError as e:
            self.log(f"checkpoint rotation skipped: {e}")
            return
        removed = False
        for step in steps[self.keep:]:
            folder = self.workdir / "checkpoints" / str(step)
            if step == saved:
                continue
            try:
                if folder.is_symlink():
                    self.log(f"checkpoint rotation: step {step} left in place: {folder} is a symbolic link "
                             f"(to {_short(os.readlink(folder), 200)}); nothing is removed through a link")
                    continue
                if os.path.lexists(folder / MANIFEST):
                    os.unlink(folder / MANIFEST)
                shutil.rmtree(folder)
                removed = True
            except OSError as e:
                self.log(f"checkpoint rotation: step {step} left in place: cannot remove {e.filename or folder} "
                         f"({e.strerror or e})")
        if removed:
            try:
                self.manager.reload()  # orbax's list of steps, as the folder now holds them
            except Exception as e:  # noqa: BLE001 - a stale list costs nothing: every read checks the folder
                self.log(f"checkpoint rotation: orbax could not re-read {self.workdir / 'checkpoints'} ({e})")

    def restore(self, step: int, params_template, opt_template) -> tuple[Any, Any, dict[str, Any]]:
        """Restore onto the shardings/dtypes of the templates (abstract or concrete pytrees)."""
        abstract = lambda tree: jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        out = self.manager.restore(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardRestore(abstract(params_template)),
                opt_state=ocp.args.StandardRestore(abstract(opt_template)),
                meta=ocp.args.JsonRestore(),
            ),
        )
        return out["params"], out["opt_state"], dict(out["meta"])

    def restore_teacher(self, step: int, template):
        """The EMA teacher saved with step `step` onto `template`'s shardings/dtypes; None when the
        step has none (a run that switched teacher.weights to 'ema': it starts from the policy)."""
        return self.restore_item(step, "teacher", template)

    def restore_item(self, step: int, name: str, template):
        """An optional item ("teacher", "critic") saved with step `step`, onto `template`'s
        shardings/dtypes; None when the step has none."""
        if not (self.workdir / "checkpoints" / str(step) / name).is_dir():
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        return self.manager.restore(step, args=ocp.args.Composite(**{name: ocp.args.StandardRestore(abstract)}))[name]

    def read_file(self, step: int, name: str) -> str | None:
        """A file `save(files=...)` wrote into step `step`'s folder; None when the step has none."""
        path = self.workdir / "checkpoints" / str(step) / name
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def restore_params(self, step: int, params_template):
        out = self.manager.restore(
            step, args=ocp.args.Composite(params=ocp.args.StandardRestore(
                jax.tree.map(ocp.utils.to_shape_dtype_struct, params_template)))
        )
        return out["params"]

    def close(self) -> None:
        self.manager.close()


def write_run_files(workdir: str | pathlib.Path, model_config: Qwen3Config, tokenizer_dir: str | pathlib.Path) -> None:
    """Record the architecture and tokenizer next to the checkpoints (process 0 only)."""
    workdir = pathlib.Path(workdir)
    if jax.process_index() != 0:
        return
    (workdir / "model").mkdir(parents=True, exist_ok=True)
    (workdir / "model" / "config.json").write_text(json.dumps(model_config.to_hf_dict(), indent=2))
    dst = workdir / "tokenizer"
    if not dst.exists():
        shutil.copytree(tokenizer_dir, dst)


RUN_CONFIG = "config.json"


def write_run_config(workdir: str | pathlib.Path, cfg) -> None:
    """The resolved run config as `workdir/config.json` (process 0 only); `read_run_config` reads it."""
    if jax.process_index() == 0:
        pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(workdir) / RUN_CONFIG).write_text(cfg.to_json(indent=2) + "\n")


EXPORT_RUN_CONFIG = "turnsight_run.json"  # the run's config inside its Hugging Face export (train.export)


def read_export_run_config(folder: str | pathlib.Path):
    """The config of the training run a Hugging Face export came from (its turnsight_run.json),
    or None for any other folder."""
    return _read_config_file(pathlib.Path(folder) / EXPORT_RUN_CONFIG)


def read_run_config(workdir: str | pathlib.Path):
    """The run's ml_collections ConfigDict from `workdir/config.json`, or None when the run has none
    (JSON turns tuples into lists; consumers convert where they need tuples)."""
    return _read_config_file(pathlib.Path(workdir) / RUN_CONFIG)


RUN_CONFIG_SECTIONS = ("data", "model", "rl", "rollout", "train")


def _read_config_file(path: pathlib.Path):
    """A run config's ConfigDict from `path`, None when there is no such file; ValueError naming
    the file when it is not one (a Hugging Face model's config.json: pointed at --hf)."""
    import ml_collections as mlc

    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not a run config ({e})") from None
    if isinstance(raw, dict) and "model_type" in raw and "rl" not in raw:  # an export / HF model folder
        raise ValueError(f"{path.parent} is a Hugging Face model folder (its config.json is a model config), not a "
                         f"training run folder: pass it as --hf {path.parent}")
    missing = [k for k in RUN_CONFIG_SECTIONS if not isinstance(raw, dict) or k not in raw]
    if missing:
        raise ValueError(f"{path}: not a run config (no {', '.join(missing)} section)")
    return mlc.ConfigDict(raw)


def load_policy_from_run(
    workdir: str | pathlib.Path, *, step: int | None = None, options: RuntimeOptions = RuntimeOptions()
) -> tuple[Qwen3, pathlib.Path, int]:
    """The policy of a training run at `step` (latest by default): (model, tokenizer dir, step)."""
    workdir = pathlib.Path(workdir)
    cfg_path = workdir / "model" / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{workdir}: not a turnsight_jax run folder (no model/config.json)")
    cfg = Qwen3Config.from_pretrained(workdir / "model")
    folders = step_folders(workdir)
    if step is None:
        step, skipped = latest_valid_step(workdir)
        for bad, why in skipped:
            print(f"{workdir}: skipping checkpoint step {bad}: {why}", file=sys.stderr, flush=True)
        if step is None:
            if not skipped:
                raise FileNotFoundError(f"{workdir}: no finished checkpoint under checkpoints/")
            raise no_valid_checkpoint(workdir, skipped)
        if skipped:
            print(f"{workdir}: using checkpoint step {step}", file=sys.stderr, flush=True)
    elif step not in folders:
        raise FileNotFoundError(f"{workdir}: no checkpoint for step {step}; have {sorted(folders)}")
    elif (why := check_step(folders[step])) is not None:
        raise CheckpointError(f"{workdir}: checkpoint step {step} is not valid: {why}")
    ckpt = Checkpointer(workdir)
    try:
        abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), options=options))
        graphdef, template = nnx.split(abstract)
        params = ckpt.restore_params(step, template)
    finally:
        ckpt.close()
    return nnx.merge(graphdef, params), workdir / "tokenizer", step
