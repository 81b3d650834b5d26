"""The teacher's labels: one JSON object per line, what `python -m turnsight_jax.judge label`
writes and `distill` reads.

    {"prompt": str, "label": 0 | 1, "rationale": str, "malformed": bool, "output": str,
     "verifier_reward": float | null, "task_id": str}

`prompt` is the judge's user message (turnsight_jax.judge.prompt.user_text: the question, the
transcript, the reference answer when it was shown); the instruction is not stored, a student is
distilled under the instruction of its own format (`judge.rationale`). `label` / `rationale` are
the teacher's parsed verdict (its `judge.default_label` and "" when its output was `malformed`);
`output` its raw text; `verifier_reward` the environment's reward of the trajectory. Only
`prompt`, `label` and `rationale` are required; a bad row is a `LabelsError` naming the file,
the line, the key, what was expected and what was there.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

from turnsight_jax.judge.model import Judgment


class LabelsError(ValueError):
    """A labels file that cannot be read: the message names the file, the line and the key."""


@dataclasses.dataclass(frozen=True)
class LabelRow:
    """One labelled trajectory (see the module docstring); `line`: its 1-based line in the file
    it was read from (0 when built in memory)."""

    prompt: str
    label: int
    rationale: str
    malformed: bool = False
    output: str = ""
    verifier_reward: float | None = None
    task_id: str = ""
    line: int = 0

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("line")
        return d


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__


def _parse_row(obj, where: str, line: int) -> LabelRow:
    if not isinstance(obj, dict):
        raise LabelsError(f"{where}: expected a JSON object, got {_kind(obj)}")

    def get(key: str, check, expected: str, *, required: bool, default=None):
        if key not in obj:
            if required:
                raise LabelsError(f"{where}: missing key {key!r} (expected {expected})")
            return default
        value = obj[key]
        if not check(value):
            raise LabelsError(f"{where}: key {key!r}: expected {expected}, got {json.dumps(value)[:60]} ({_kind(value)})")
        return value

    prompt = get("prompt", lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string", required=True)
    label = get("label", lambda v: type(v) is int and v in (0, 1), "0 or 1 (an integer)", required=True)
    rationale = get("rationale", lambda v: isinstance(v, str), "a string", required=True)
    malformed = get("malformed", lambda v: isinstance(v, bool), "true or false", required=False, default=False)
    output = get("output", lambda v: isinstance(v, str), "a string", required=False, default="")
    verifier = get("verifier_reward", lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)),
                   "a number or null", required=False)
    task_id = get("task_id", lambda v: isinstance(v, (str, int)) and not isinstance(v, bool), "a string",
                  required=False, default="")
    return LabelRow(prompt, label, rationale, malformed, output, None if verifier is None else float(verifier),
                    str(task_id), line)


def read_labels(path: str | pathlib.Path) -> list[LabelRow]:
    """Every row of a labels JSONL (blank lines skipped); LabelsError on the first bad one."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"labels file {path} does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue
            where = f"{path}:{line}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise LabelsError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
            rows.append(_parse_row(obj, where, line))
    if not rows:
        raise LabelsError(f"{path}: no labelled rows")
    return rows


def write_labels(path: str | pathlib.Path, rows: Sequence[LabelRow]) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def rows_from_judgments(users: Sequence[str], judgments: Sequence[Judgment], *, verifier_rewards=None,
                        task_ids=None) -> list[LabelRow]:
    """Label rows of judged user messages (the teacher's judgments of them)."""
    n = len(users)
    verifier_rewards = [None] * n if verifier_rewards is None else list(verifier_rewards)
    task_ids = [""] * n if task_ids is None else list(task_ids)
    return [LabelRow(u, j.label, j.verdict.rationale or "", j.verdict.malformed, j.text,
                     None if v is None else float(v), str(t))
            for u, j, v, t in zip(users, judgments, verifier_rewards, task_ids, strict=True)]
