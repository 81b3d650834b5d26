"""Task files: check one, convert one from verl's RL parquet layout, write the sample.

    python -m turnsight_jax.taskfile validate FILE [--require-gold]
    python -m turnsight_jax.taskfile convert-verl IN.parquet OUT.jsonl
    python -m turnsight_jax.taskfile sample OUT.jsonl

The layout a training or held-out file must have (`data.source=ftrl`, `data.path=FILE`; JSONL or
parquet) is FTRL's row, documented in docs/data.md and enforced by `envs.ftrl.row_to_task`; the
package ships a sample (`turnsight_jax/assets/sample_tasks.jsonl`, built-in tasks written as rows).

`validate` reads every row and reports every bad one (file, row, key, expected vs got), not only
the first as the trainer does; exit 0 when all rows load, 1 otherwise. `--require-gold` also
requires `ground_truth` (the gold call chain MatchTIR / TurnSight rewards read).

`convert-verl` maps verl's RL rows (`data_source`, `prompt`, `reward_model` {`style`,
`ground_truth`}, `extra_info` {...}) to this layout: messages <- `prompt`; ground_truth <-
`reward_model.ground_truth`; tools, codes, unsolved_set, answer <- the row's own column, else
`extra_info`'s key of that name; id <- `extra_info.index` (else the row number); split <-
`extra_info.split`. A row missing what the layout needs is reported with its number and left
out; the output is written only when every row converts (exit 1 otherwise, nothing written).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any, Iterable, Mapping, Sequence

from turnsight_jax.envs.ftrl import FTRLFormatError, _iter_jsonl, _iter_parquet, row_to_task

SAMPLE = pathlib.Path(__file__).parent / "assets" / "sample_tasks.jsonl"
CONTENT_KEYS = ("tools", "codes", "unsolved_set", "answer")


def _rows(path: pathlib.Path) -> Iterable[tuple[str, int, Any]]:
    """(where, index, row) of a .jsonl or .parquet file; a line that is not JSON is yielded as an
    error string (so that the rows after it are still checked)."""
    if path.suffix == ".parquet":
        yield from _iter_parquet(path)
        return
    if path.suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: unknown task file type {path.suffix!r} (.jsonl or .parquet)")
    yield from _iter_jsonl(path, keep_going=True)


def validate(path: str | pathlib.Path, *, require_gold: bool = False) -> tuple[int, list[str]]:
    """(rows read, one message per bad row) of a task file."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file not found: {path}")
    n, bad = 0, []
    for where, index, row in _rows(path):
        n += 1
        if isinstance(row, Exception):
            bad.append(str(row))
            continue
        try:
            row_to_task(row, where=where, default_id=f"{path.stem}:{index}",
                        require=("gold_calls",) if require_gold else ())
        except (FTRLFormatError, ValueError, TypeError) as e:
            bad.append(str(e))
    return n, bad


def verl_row(row: Mapping[str, Any], where: str, index: int) -> dict:
    """One verl RL row as a task row (module docstring); FTRLFormatError naming what is missing."""
    if not isinstance(row, Mapping):
        raise FTRLFormatError(f"{where}: expected a row object, got {type(row).__name__}")
    extra = row.get("extra_info") or {}
    reward = row.get("reward_model") or {}
    if not isinstance(extra, Mapping) or not isinstance(reward, Mapping):
        raise FTRLFormatError(f"{where}: 'extra_info' and 'reward_model' must be objects (verl's layout)")
    if "prompt" not in row:
        raise FTRLFormatError(f"{where}: missing column 'prompt' (verl's list of chat messages)")
    out: dict[str, Any] = {"messages": row["prompt"]}
    missing = []
    for key in CONTENT_KEYS:
        value = row[key] if row.get(key) is not None else extra.get(key)
        if value is None:
            missing.append(key)
        out[key] = value
    if missing:
        raise FTRLFormatError(f"{where}: no {', '.join(missing)} in the row or its extra_info (a task row needs "
                              f"{', '.join(CONTENT_KEYS)}; got columns {sorted(row)}, extra_info keys {sorted(extra)})")
    out["ground_truth"] = reward.get("ground_truth")
    out["data_source"] = row.get("data_source") or ""
    out["id"] = str(extra.get("index", index))
    if "split" in extra:
        out["split"] = extra["split"]
    for key in ("tools", "codes", "unsolved_set", "ground_truth"):  # JSON text, as FTRL's files store them
        if out[key] is not None and not isinstance(out[key], str):
            out[key] = json.dumps(_plain(out[key]))
    out["messages"] = _plain(out["messages"])
    return out


def _plain(value):
    """numpy arrays (parquet list columns) as lists, recursively."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def convert_verl(src: str | pathlib.Path, dst: str | pathlib.Path) -> tuple[int, list[str]]:
    """verl parquet -> task JSONL: (rows written, one message per row that did not convert);
    nothing is written unless every row converts and loads."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if not src.is_file():
        raise FileNotFoundError(f"verl file not found: {src}")
    rows, bad = [], []
    for where, index, row in _iter_parquet(src):
        try:
            converted = verl_row(row, where, index)
            row_to_task(converted, where=where, default_id=f"{src.stem}:{index}")
            rows.append(converted)
        except (FTRLFormatError, ValueError, TypeError) as e:
            bad.append(str(e))
    if not bad:
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return len(rows), bad


def task_row(task) -> dict:
    """A `Task` as a task-file row (the inverse of row_to_task)."""
    row = {"id": task.task_id, "messages": [dict(m) for m in task.messages], "tools": json.dumps(list(task.tools)),
           "codes": json.dumps(dict(task.codes)), "unsolved_set": json.dumps(task.unsolved_set),
           "answer": task.answer, "data_source": task.data_source}
    if task.gold_calls is not None:
        chain = [{"name": c["name"], "parameters": c["arguments"]} for turn in task.gold_calls for c in turn]
        row["ground_truth"] = json.dumps(chain)
    return row


def write_sample(dst: str | pathlib.Path, per_category: int = 1) -> int:
    """`per_category` built-in tasks of each category as rows (the shipped sample's source)."""
    from turnsight_jax.envs.synthetic import SYNTHETIC_CATEGORIES, generate_tasks

    tasks = generate_tasks(per_category * len(SYNTHETIC_CATEGORIES), seed=0)
    pathlib.Path(dst).write_text("".join(json.dumps(task_row(t)) + "\n" for t in tasks), encoding="utf-8")
    return len(tasks)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m turnsight_jax.taskfile", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="report every bad row of a task file (.jsonl or .parquet)")
    v.add_argument("file")
    v.add_argument("--require-gold", action="store_true", help="rows must carry ground_truth (training rewards)")
    c = sub.add_parser("convert-verl", help="verl RL parquet -> task JSONL")
    c.add_argument("src")
    c.add_argument("dst")
    s = sub.add_parser("sample", help="write built-in tasks as a task file (the shipped sample)")
    s.add_argument("dst")
    args = ap.parse_args(argv)
    try:
        if args.command == "validate":
            n, bad = validate(args.file, require_gold=args.require_gold)
        elif args.command == "convert-verl":
            n, bad = convert_verl(args.src, args.dst)
        else:
            print(f"wrote {write_sample(args.dst)} rows to {args.dst}")
            return 0
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for message in bad:
        print(message, file=sys.stderr)
    if args.command == "validate":
        print(f"{args.file}: {n} rows, {n - len(bad)} valid, {len(bad)} bad")
    else:
        print(f"{args.src}: {n} rows converted" + (f"; {len(bad)} did not, nothing written" if bad
                                                      else f" -> {args.dst}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
