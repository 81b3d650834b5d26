"""Training checkpoints with orbax: parameters, optimizer state, and meta (the next step, the seed,
the data position). No RNG state is stored: every random stream is re-derived from seed and step.

Layout of a run folder (`--workdir`):

  checkpoints/<step>/{params,opt_state,meta}   orbax, one folder per step, keep-last-N
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
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import sys
import zlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from turnsight_jax.errors import CheckpointError
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import Qwen3, RuntimeOptions


MANIFEST = "turnsight_manifest.json"


def _crc32(path: pathlib.Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 23):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(step_dir: str | pathlib.Path) -> None:
    """Records every file of a finished step (size, CRC-32); written atomically, last."""
    step_dir = pathlib.Path(step_dir)
    files = {str(p.relative_to(step_dir)): [p.stat().st_size, _crc32(p)] for p in _files(step_dir)}
    tmp = step_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"format": 1, "files": files}, fh, indent=0, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, step_dir / MANIFEST)


def check_step(step_dir: str | pathlib.Path) -> str | None:
    """Why the step in `step_dir` is not valid, or None when it is (see the module docstring)."""
    step_dir = pathlib.Path(step_dir)
    manifest = step_dir / MANIFEST
    if not step_dir.is_dir():
        return "not a folder"
    if not any(step_dir.iterdir()):
        return "empty folder"
    if not manifest.is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST} ({e})"
    for rel, (size, crc) in files.items():
        path = step_dir / rel
        if not path.is_file():
            return f"missing file {rel}"
        if path.stat().st_size != size:
            return f"{rel}: {path.stat().st_size} bytes, expected {size} (truncated or replaced)"
        if _crc32(path) != crc:
            return f"{rel}: checksum mismatch (corrupt bytes)"
    extra = [str(p.relative_to(step_dir)) for p in _files(step_dir) if str(p.relative_to(step_dir)) not in files]
    if extra:
        return f"files not in the manifest: {', '.join(extra[:3])}"
    return None


def step_folders(workdir: str | pathlib.Path) -> dict[int, pathlib.Path]:
    """Step number -> folder, for every numeric folder under `workdir/checkpoints`."""
    root = pathlib.Path(workdir) / "checkpoints"
    if not root.is_dir():
        return {}
    return {int(p.name): p for p in root.iterdir() if p.is_dir() and p.name.isdigit()}


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
    while (target := folder.parent / f"invalid-{step}-{n}").exists():
        n += 1
    folder.rename(target)
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
            moved = quarantine(workdir, bad)
            log(f"resume: skipping checkpoint step {bad}: {why} (moved to {moved.name})")
    return latest


def no_valid_checkpoint(workdir, skipped: list[tuple[int, str]]) -> CheckpointError:
    detail = "; ".join(f"step {s}: {why}" for s, why in skipped)
    return CheckpointError(f"{pathlib.Path(workdir) / 'checkpoints'}: no valid checkpoint ({detail})")


# The step's learned auxiliaries (rl.step.init_aux), each an optional item of a step's checkpoint.
AUX_ITEMS = ("critic", "prm", "previous_policy")  # previous_policy: a rollout controller's old policy (rl.appo)


class Checkpointer:
    """Save and restore (params, opt_state, meta) by step under `workdir/checkpoints`."""

    def __init__(self, workdir: str | pathlib.Path, *, keep: int = 3, async_save: bool = False):
        if keep < 1:
            raise ValueError(f"Checkpointer: keep must be >= 1 (keep={keep} would delete every save)")
        self.workdir = pathlib.Path(workdir).absolute()
        self.manager = ocp.CheckpointManager(
            self.workdir / "checkpoints",
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
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
                if "/" in name or name in ("", ".", "..", MANIFEST):
                    raise ValueError(f"checkpoint file name {name!r}: a plain file name is expected")
                (self.workdir / "checkpoints" / str(step) / name).write_text(text, encoding="utf-8")
            write_manifest(self.workdir / "checkpoints" / str(step))

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


def read_run_config(workdir: str | pathlib.Path):
    """The run's ml_collections ConfigDict from `workdir/config.json`, or None when the run has none
    (JSON turns tuples into lists; consumers convert where they need tuples)."""
    import ml_collections as mlc

    path = pathlib.Path(workdir) / RUN_CONFIG
    if not path.is_file():
        return None
    try:
        return mlc.ConfigDict(json.loads(path.read_text()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: not a run config ({e})") from None


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
