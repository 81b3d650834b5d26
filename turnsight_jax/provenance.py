"""A run folder's config provenance: what a re-run into an existing run may change.

`python -m turnsight_jax.train` resumes from the newest checkpoint of its workdir. Before this
module, a re-run with another config continued the old run under the new settings and rewrote
`config.json`, so the folder claimed a config that no step (or only some steps) used. Now, when
the folder already holds a run (`config.json` and any checkpoint, metrics line or summary):

- keys that do not change what the steps compute (HARMLESS: logging, checkpoint cadence, the dry
  run's plan, the run's name, how often held-out evaluation runs, `train.steps` unless a cosine
  schedule's length depends on it, and the layout of the same math: mesh, chunk sizes,
  micro-batches, packing, padding shapes) may change; the change is written to
  `config_history.jsonl` and logged;
- any other difference is refused with one line naming every key (old -> new), before the folder
  is touched, unless the user passes `--allow-config-change` (recorded the same way, marked
  allowed) or picks a new workdir.

Keys the stored config lacks (a folder written by an older version) are not compared: the old run
cannot say what it used; they are recorded as `added`.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any

from turnsight_jax.errors import ConfigError

HISTORY = "config_history.jsonl"

# Dotted prefixes / keys whose change leaves every step's computation as it was: what is logged
# and saved, and the layout of the same math (the mesh, chunking, micro-batching, packing, padding
# shapes, the engine's blocks; each tested equal to its plain form in tests/, float rounding aside),
# so a run can resume on another machine or with more micro-batches after running out of memory.
HARMLESS_PREFIXES = ("log.", "checkpoint.", "plan.", "mesh.")
HARMLESS_KEYS = frozenset({
    "name", "eval.every", "train.steps",
    "model.attn_block", "model.attn_q_chunk", "model.attn_key_block", "model.attn_row_group", "model.attn_impl",
    "model.vocab_block", "model.remat",
    "train.micro_batches", "train.micro_batch_groups", "train.teacher_micro_batches", "train.logprob_chunk",
    "train.score_chunk", "train.pack_rows", "train.pack_width", "train.teacher_pack_width", "train.length_classes",
    "train.shapes", "train.shape_reuse",
    "rollout.decode_chunk", "rollout.decode_slots", "rollout.kv_block_size", "rollout.kv_pool_blocks",
    "rollout.prompts_per_chunk",
})


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{'a.b.c': leaf} of a nested dict (lists are leaves)."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _holds_a_run(workdir: pathlib.Path) -> bool:
    ckpts = workdir / "checkpoints"
    return ((ckpts.is_dir() and any(ckpts.iterdir())) or (workdir / "metrics.jsonl").is_file()
            or (workdir / "summary.json").is_file())


def harmless(key: str, new: dict[str, Any]) -> bool:
    """Whether changing `key` leaves every step's computation as it was (`new`: the flat config)."""
    if key == "train.steps":  # a cosine schedule decays over train.steps: a longer run changes each step's lr
        return new.get("optim.schedule") != "cosine"
    return key in HARMLESS_KEYS or key.startswith(HARMLESS_PREFIXES)


def config_changes(stored: dict, new: dict) -> tuple[dict[str, tuple[Any, Any]], list[str]]:
    """(changed: key -> (stored, new) for keys in both that differ, and key -> (stored, None) for
    keys the new config dropped; added: keys only in `new`), flat keys."""
    old, cur = flatten(stored), flatten(new)
    changed = {k: (old[k], cur[k]) for k in sorted(cur) if k in old and old[k] != cur[k]}
    # a key the new config dropped is a change too (its behaviour is now the code's default)
    changed.update({k: (old[k], None) for k in sorted(old) if k not in cur})
    return changed, sorted(k for k in cur if k not in old)


def check_resume(workdir: str | pathlib.Path, cfg, *, allow_change: bool = False, log=print) -> dict | None:
    """Compare `cfg` with the run already in `workdir`; raise ConfigError (one line, every key)
    when a result-changing key differs and `allow_change` is off; otherwise append the change to
    `config_history.jsonl` and return the entry (None: a new run, or nothing changed). Writes
    nothing when it raises."""
    workdir = pathlib.Path(workdir)
    path = workdir / "config.json"
    if not path.is_file() or not _holds_a_run(workdir):
        return None
    try:
        stored = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: not a run config ({e}); move the folder aside or use a new --workdir") from None
    if not isinstance(stored, dict):
        raise ConfigError(f"{path}: not a run config (a JSON object expected, got {type(stored).__name__})")
    new = json.loads(cfg.to_json())
    changed, added = config_changes(stored, new)
    if not changed and not added:
        return None
    flat_new = flatten(new)
    result = {k: v for k, v in changed.items() if not harmless(k, flat_new)}
    if result and not allow_change:
        listed = ", ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in result.items())
        raise ConfigError(f"{workdir} holds a run with another config ({listed}); resuming would continue it under "
                          f"changed settings. Use a new --workdir, or pass --allow-config-change to continue it "
                          f"anyway (recorded in {HISTORY})")
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "changed": {k: [a, b] for k, (a, b) in changed.items()},
             "result_changing": sorted(result), "allowed_by": "--allow-config-change" if result else "harmless",
             "added": added}
    with open(workdir / HISTORY, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
    shown = ", ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, (a, b) in changed.items()) or "none"
    log(f"config changed since this run's last start ({shown}"
        f"{'; new keys ' + ', '.join(added) if added else ''}"
        f"{'; RESULT-CHANGING, allowed by --allow-config-change' if result else ''}); recorded in {workdir / HISTORY}")
    return entry


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
