"""Trajectory records: what the trainer writes every `log.records_every` steps so that a reader can
see, turn by turn, where the credit went (docs/records.md holds the schema; the viewer is
`python -m turnsight_jax.viewer RUN`).

One gzip-compressed JSONL file per step and process, `RUN/records/step_000011.jsonl.gz` (the `step`
of metrics.jsonl, 0-based; process p > 0 writes `step_000011.p<p>.jsonl.gz`): a header line,
then one line per sampled trajectory with its turns (policy text, calls, observations, tool
errors, the gold chain's step), its rewards, and per turn the numbers the step computed (rl.
turn_records: base and mixed advantage, TurnSight's per-depth gaps, signs, vote, chosen depth, δ̂
and weight; a privileged teacher's gap; the loss terms' values). Files are written to a temporary
name and renamed, so a killed run leaves whole files or none; a file cut short anyway is reported
by `read_records` with its name and the reason, never half-read.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import pathlib
import re
import zlib
from typing import Any, Iterable, Sequence

import numpy as np

from turnsight_jax.chat.trajectory import is_padding
from turnsight_jax.chat.types import CallError, ToolCall
from turnsight_jax.rewards import call_similarity
from turnsight_jax.rollout.driver import TOOL_ERROR_PREFIX

SCHEMA = 1
FOLDER = "records"
# The per-turn fields taken from rl.turn_records' summaries, in record order ("term/<name>" go
# under "terms").
TURN_FIELDS = ("base_adv", "adv", "weight", "delta_star", "delta_hat", "rlsd_weight", "gap")


class RecordsError(ValueError):
    """A records file that cannot be read; the message names the file and the problem."""


def records_path(workdir: pathlib.Path, step: int, process: int = 0) -> pathlib.Path:
    suffix = "" if process == 0 else f".p{process}"
    return pathlib.Path(workdir) / FOLDER / f"step_{step:06d}{suffix}.jsonl.gz"


# records_path's names, and a killed write's temporary name: ASCII digits only (str.isdigit() also
# accepts "²", which int() refuses); any other file in the folder is not ours and is left alone
_NAME = re.compile(r"step_([0-9]+)(?:\.p([0-9]+))?\.jsonl\.gz(\.tmp)?")


def _name_match(path: pathlib.Path) -> re.Match:
    m = _NAME.fullmatch(pathlib.Path(path).name)
    if m is None:
        raise RecordsError(f"{path}: not a records file name (step_<step>[.p<process>].jsonl.gz)")
    return m


def file_step(path: pathlib.Path) -> int:
    """The step of a records file's name (records_path)."""
    return int(_name_match(path).group(1))


def file_process(path: pathlib.Path) -> int:
    """The process of a records file's name (records_path): 0, or p of ".p<p>"."""
    return int(_name_match(path).group(2) or 0)


def due(step: int, every: int) -> bool:
    """Whether step `step` (0-based) writes records at cadence `every` (0: never)."""
    return every > 0 and (step + 1) % every == 0


# ---- building ----

def _clip(text: str | None, limit: int) -> str | None:
    """`text` cut to `limit` characters, saying how many were left out."""
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"… [{len(text) - limit} more characters]"


def _number(x: float) -> float | None:
    """A finite float, or None (JSON has no NaN / inf)."""
    x = float(x)
    return x if math.isfinite(x) else None


def turn_value(summary: dict, b: int, k: int, count: float):
    """One per-turn value from rl.turn_records' {"min", "max", "sum"(, "n")} [B, K]: the exact value
    when it is constant over the turn's (masked) tokens, its mean when it is constant to float32
    rounding (a spread of at most _ROUNDING_ULPS ulps: vectorised code can compute one token's copy
    of a per-turn product a last bit apart from another's), {"mean", "min", "max"} when it varies,
    None when the turn has no such token."""
    n = float(summary["n"][b, k]) if "n" in summary else count
    if n <= 0:
        return None
    lo, hi = float(summary["min"][b, k]), float(summary["max"][b, k])
    if lo == hi:
        return _number(lo)
    mean = float(summary["sum"][b, k]) / n
    if hi - lo <= _ROUNDING_ULPS * float(np.spacing(np.float32(max(abs(lo), abs(hi))))):
        return _number(min(max(mean, lo), hi))
    return {"mean": _number(mean), "min": _number(lo), "max": _number(hi)}


_ROUNDING_ULPS = 4


def call_failures(turn) -> list[bool]:
    """Per call of a chat.trajectory.TurnRecord: it failed to parse, or the tool answered with an
    error (FTRL's error observation). A call without an observation (the episode ended) is not
    counted as failed."""
    out = []
    for i, call in enumerate(turn.calls):
        result = turn.results[i] if i < len(turn.results) else ""
        out.append(isinstance(call, CallError) or result.startswith(TOOL_ERROR_PREFIX))
    return out


def _gold_step(task, k: int):
    gold = getattr(task, "gold_calls", None)
    if gold is None:
        return None
    return list(gold[k]) if k < len(gold) else []


def _equal(call, gold) -> bool:
    return isinstance(call, ToolCall) and call_similarity(call, gold) == 1.0


def gold_match(calls: Sequence, step_gold: list | None) -> bool | None:
    """The turn's calls are exactly the gold chain's step (the same calls, any order); None when the
    task has no gold chain, or when the turn makes no call past the chain's end (the answer turn)."""
    if step_gold is None or (not calls and not step_gold):
        return None
    left = list(step_gold)
    for call in calls:
        hit = next((i for i, g in enumerate(left) if _equal(call, g)), None)
        if hit is None:
            return False
        left.pop(hit)
    return not left


def _in_gold(call, task) -> bool | None:
    gold = getattr(task, "gold_calls", None)
    if gold is None:
        return None
    return any(_equal(call, g) for step in gold for g in step)


def outcome(failed: list[bool], in_gold: list) -> str:
    """"none" (no call), "error" (a call failed to parse or errored), "wrong" (a call outside the
    task's gold chain), else "ok"."""
    if not failed:
        return "none"
    if any(failed):
        return "error"
    if any(g is False for g in in_gold):
        return "wrong"
    return "ok"


def _finite_list(x: np.ndarray):
    """A number or nested list with every non-finite entry as None."""
    return _number(x) if x.ndim == 0 else [_finite_list(v) for v in x]


def _call_json(call, failed: bool, in_gold) -> dict:
    if isinstance(call, CallError):
        return {"error": call.message, "raw": call.raw, "failed": True, "in_gold": in_gold}
    return {"name": call.name, "arguments": call.arguments, "failed": failed, "in_gold": in_gold}


def _prompt_text(task) -> str:
    users = [m.get("content") for m in task.messages if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def trajectory_record(traj, task, row: int, batch_row: dict, turns: dict, extras: dict, *, depths: Sequence[int],
                      selection, text_chars: int) -> dict:
    """One trajectory's record. batch_row: this row's {"group", "signals"}; turns: rl.turn_records'
    per-turn summaries (numpy, global rows), read at `row`; extras: "depth_turn_means" [D, B, K],
    "group_mean" / "group_std" [G] when the estimator gave them."""
    count = turns["count"]
    g = batch_row["group"]
    rec = {"kind": "trajectory", "row": row, "group": g, "task_id": str(traj.task_id),
           "category": getattr(task, "category", "") or "", "data_source": getattr(task, "data_source", "") or "",
           "reward": _number(traj.reward), "finish_reason": traj.finish_reason, "truncated": bool(traj.truncated),
           "num_turns": traj.num_turns, "prompt": _clip(_prompt_text(task), text_chars),
           "gold_answer": _clip(getattr(task, "answer", None), text_chars),
           "signals": batch_row["signals"],
           "metrics": {k: _number(v) for k, v in traj.metrics.items() if isinstance(v, (int, float))}}
    if "group_mean" in extras and g >= 0:  # -1: a row in no group (rl.batch)
        rec["group_mean"] = _number(extras["group_mean"][g])
        rec["group_std"] = _number(extras["group_std"][g])
    out_turns = []
    for k, turn in enumerate(traj.turns):
        failed = call_failures(turn)
        in_gold = [_in_gold(c, task) for c in turn.calls]
        step_gold = _gold_step(task, k)
        t = {"k": k, "tokens": int(count[row, k]) if k < count.shape[1] else 0,
             "text": _clip(turn.text, text_chars),
             "calls": [_call_json(c, f, ig) for c, f, ig in zip(turn.calls, failed, in_gold)],
             "observations": [_clip(r, text_chars) for r in turn.results],
             "outcome": outcome(failed, in_gold), "gold_step": step_gold, "gold_match": gold_match(turn.calls, step_gold),
             "faults": turn.env_info.get("faults")}
        if k < count.shape[1] and count[row, k] > 0:
            for field in TURN_FIELDS:
                if field in turns:
                    t[field] = turn_value(turns[field], row, k, float(count[row, k]))
            if "depth" in turns:
                d = turn_value(turns["depth"], row, k, float(count[row, k]))
                t["depth_index"] = int(d) if isinstance(d, float) else None
                t["depth"] = int(depths[int(d)]) if isinstance(d, float) and d >= 0 else None
            if "horizon" in turns:  # the dependency rule's h (rl.horizon); -1: not computed (another selection)
                h = turn_value(turns["horizon"], row, k, float(count[row, k]))
                t["horizon"] = int(h) if isinstance(h, float) and h >= 1 else None
            if "depth_turn_means" in extras:
                means = [_number(x) for x in extras["depth_turn_means"][:, row, k]]
                t["delta"] = means
                t["signs"] = [1 if x >= 0 else -1 for x in extras["depth_turn_means"][:, row, k]]
                t["agree"] = len(set(t["signs"])) == 1
                if selection == "vote" and t.get("depth_index") is not None:  # v: the sign d* was chosen from
                    t["vote"] = t["signs"][t["depth_index"]]
            terms = {name[5:]: turn_value(s, row, k, float(count[row, k]))
                     for name, s in turns.items() if name.startswith("term/")}
            if terms:
                t["terms"] = terms
        out_turns.append(t)
    rec["turns"] = out_turns
    return rec


def step_header(step: int, method, step_cfg, *, process: int, written: int, dropped: int) -> dict:
    algo = step_cfg.algo
    selection = algo.selection if isinstance(algo.selection, str) else int(algo.selection)
    return {"kind": "header", "schema": SCHEMA, "step": step, "process": process, "method": method.name,
            "advantage": method.advantage.name, "base": method.base.name if method.base else None,
            "teacher": method.teacher if method.needs_views else None, "depths": [int(d) for d in algo.depths],
            "selection": selection, "aggregation": algo.aggregation, "lam": float(algo.lam),
            "eps_w": float(algo.eps_w), "group_size": int(step_cfg.group_size), "max_turns": int(step_cfg.max_turns),
            "trajectories": written, "dropped": dropped}


def build_step_records(step: int, trajs: Sequence, tasks: Sequence, batch, arrays: dict, method, step_cfg, *,
                       rows: Sequence[int], order: Sequence[int], text_chars: int, max_bytes: int,
                       process: int = 0) -> list[str]:
    """The JSON lines of one step's records file (header first).

    trajs / tasks: this process's trajectories and their tasks (rollout order); batch: its host
    TrainBatch (group ids and signals by batch row); order[i]: the trajectory of local batch row i
    (rl.batch.batch_row_order); rows[i]: that row's index in the step's global arrays; arrays: the
    step's metrics["records"] on the host. Whole prompt groups are kept, in batch order, while the
    lines fit in `max_bytes`; the header counts the trajectories left out. Padding rows (a
    controller's groups of unequal size, rl.batch) are not recorded; rows in no group (group -1)
    are, without group statistics."""
    turns, extras = arrays["turns"], {k: v for k, v in arrays.items() if k != "turns"}
    algo = step_cfg.algo
    lines, size, dropped = [], 0, 0
    group_lines: list[str] = []
    group_of = np.asarray(batch.group_ids)

    def flush():
        nonlocal size, dropped, group_lines
        cost = sum(len(x) + 1 for x in group_lines)
        if size + cost <= max_bytes:
            lines.extend(group_lines)
            size += cost
        else:
            dropped += len(group_lines)
        group_lines = []

    for i, (row, t) in enumerate(zip(rows, order)):
        if i > 0 and group_of[i] != group_of[i - 1]:
            flush()
        if is_padding(trajs[t]):  # a row that only fills a prompt's block (rl.batch): nothing to record
            continue
        signals = {k: _finite_list(np.asarray(v[i])) for k, v in batch.signals.items()}
        brow = {"group": int(group_of[i]), "signals": signals}
        rec = trajectory_record(trajs[t], tasks[t], int(row), brow, turns, extras, depths=algo.depths,
                                selection=algo.selection, text_chars=text_chars)
        # ASCII: tool observations may hold lone surrogates (the sandbox's surrogatepass), which
        # only an escaped JSON string can carry
        group_lines.append(json.dumps(rec, allow_nan=False))
    flush()
    header = step_header(step, method, step_cfg, process=process, written=len(lines), dropped=dropped)
    return [json.dumps(header, allow_nan=False)] + lines


def write_records(path: pathlib.Path, lines: Iterable[str]) -> pathlib.Path:
    """Write the lines gzip-compressed to a temporary name, fsync, rename into place."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz:
            for line in lines:
                gz.write(line.encode("utf-8") + b"\n")
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(tmp, path)
    return path


# ---- reading ----

def read_records(path: pathlib.Path) -> tuple[dict, list[dict]]:
    """(header, trajectory records) of one file; RecordsError naming the file, and the line, when
    it is cut short, not gzip, not JSON, or not this schema."""
    path = pathlib.Path(path)
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise RecordsError(f"{path}: not a complete gzip file ({e}); the run was probably killed while "
                           "writing it") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise RecordsError(f"{path}: empty records file")
    out = []
    for n, line in enumerate(lines, start=1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise RecordsError(f"{path}: line {n}: invalid JSON ({e.msg})") from None
    header, trajs = out[0], out[1:]
    if not isinstance(header, dict) or header.get("kind") != "header":
        raise RecordsError(f"{path}: line 1: expected the header record (kind 'header')")
    if header.get("schema") != SCHEMA:
        raise RecordsError(f"{path}: schema {header.get('schema')!r}, this version reads schema {SCHEMA}")
    for n, rec in enumerate(trajs, start=2):
        if not isinstance(rec, dict) or rec.get("kind") != "trajectory" or not isinstance(rec.get("turns"), list):
            raise RecordsError(f"{path}: line {n}: expected a trajectory record with a 'turns' list")
    if header.get("trajectories") != len(trajs):
        raise RecordsError(f"{path}: the header announces {header.get('trajectories')} trajectories, the file "
                           f"holds {len(trajs)}")
    return header, trajs


def run_record_files(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """The records files of a run folder, by step then process."""
    folder = pathlib.Path(run_dir) / FOLDER
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob("step_*.jsonl.gz") if _is_name(p, tmp=False))


def _is_name(path: pathlib.Path, *, tmp: bool) -> bool:
    m = _NAME.fullmatch(path.name)
    return m is not None and bool(m.group(3)) == tmp


def clear_from(run_dir: pathlib.Path, step: int, process: int) -> None:
    """Remove `process`'s records of steps >= `step` (a resumed run redoes them) and any file a
    killed write left under its temporary name."""
    folder = pathlib.Path(run_dir) / FOLDER
    for path in run_record_files(run_dir):
        if file_step(path) >= step and file_process(path) == process:
            path.unlink()
    for tmp in folder.glob("step_*.jsonl.gz.tmp") if folder.is_dir() else ():
        if _is_name(tmp, tmp=True) and file_process(tmp) == process:
            tmp.unlink(missing_ok=True)


def host_arrays(tree: Any):
    """metrics["records"] as numpy (all-gathered across processes: every process then holds the
    step's global rows)."""
    import jax

    from turnsight_jax.distributed import to_host

    return jax.tree.map(to_host, tree)
