"""Training checkpoints with orbax: parameters, optimizer state, and meta (the next step, the seed,
the data position). No RNG state is stored: every random stream is re-derived from seed and step.

Layout of a run folder (`--workdir`):

  checkpoints/<step>/{params,opt_state,meta}   orbax, one folder per step, keep-last-N
  config.json                                  the resolved run config (ml_collections JSON)
  model/config.json                            the policy architecture (Hugging Face form)
  tokenizer/                                   the tokenizer the run used
  export/                                      Hugging Face export of the trained policy

Orbax writes each step into a temporary folder and renames it only when complete, so a write cut
short (a killed process, a full disk) never appears as a valid step; `latest_step` only sees
finished ones.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import Qwen3, RuntimeOptions


class Checkpointer:
    """Save and restore (params, opt_state, meta) by step under `workdir/checkpoints`."""

    def __init__(self, workdir: str | pathlib.Path, *, keep: int = 3, async_save: bool = False):
        self.workdir = pathlib.Path(workdir).absolute()
        self.manager = ocp.CheckpointManager(
            self.workdir / "checkpoints",
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=async_save),
            item_names=("params", "opt_state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, params, opt_state, meta: dict[str, Any]) -> None:
        self.manager.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta),
            ),
            force=True,
        )
        self.manager.wait_until_finished()

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
    ckpt = Checkpointer(workdir)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"{workdir}: no finished checkpoint under checkpoints/")
        step = max(steps) if step is None else step
        if step not in steps:
            raise FileNotFoundError(f"{workdir}: no checkpoint for step {step}; have {sorted(steps)}")
        abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), options=options))
        graphdef, template = nnx.split(abstract)
        params = ckpt.restore_params(step, template)
    finally:
        ckpt.close()
    return nnx.merge(graphdef, params), workdir / "tokenizer", step
