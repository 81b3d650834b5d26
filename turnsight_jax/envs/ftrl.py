"""FTRL tasks (docs/spec.md §3): loader, FTRL's answer check, Solve-P/R/F1 and the environment.

Row layout (jsonl, one object per line, or parquet with the same columns):
  messages      list of {"role", "content"} (one user message); parquet/verl files may call it
                `prompt`
  tools         JSON string (or decoded list) of OpenAI-style function schemas
  codes         JSON string (or decoded dict): tool name -> Python source defining that function
  unsolved_set  JSON string (or decoded dict): tool name -> list of gold intermediate answers
  answer        gold final answer (string)
  data_source   e.g. "self/multi_hop"; the part after "/" becomes `Task.category`
  ground_truth  optional (MatchTIR's training rows have it): JSON text (or a decoded list) of the
                gold call chain, a flat ordered list of {"name": str, "parameters": {...}}
                ("arguments" is accepted for "parameters"; its value may be JSON text of an
                object). It becomes `Task.gold_calls`, one call per gold turn (the flat chain does
                not say which calls were parallel; MatchTIR's matching is order-free, and a
                replayed gold trajectory then makes one call per turn). Absent or null: None.
                In parquet, store it as JSON text: a struct column merges the parameter names
                of all rows (missing ones become null).
  optional: solve_rate, split, id (kept in `Task.extra` / used as task id)

Errors name the file, the row (`line N`, 1-based, for JSONL; `row i`, the 0-based row index, for
parquet) and the key/column, with what was expected and what was found.

Metric semantics follow FTRL's evaluation code exactly (`Code/evaluation/evaluation_self.py`,
`Code/utils/utils.py: answer_verify`): see `answer_verify` and `solve_metrics`.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterable, Mapping, Sequence

from turnsight_jax.chat.types import Task
from turnsight_jax.envs.base import EpisodeScore
from turnsight_jax.envs.code_tools import CodeToolEnvironment, CodeToolEpisode

FTRL_CATEGORIES = ("single_hop", "parallel_single_hop", "multi_hop", "parallel_multi_hop")


class FTRLFormatError(ValueError):
    """A row of an FTRL file does not have the expected layout."""


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------
def _as_text(value: Any) -> str:
    if type(value) is dict or type(value) is list:
        return json.dumps(value, ensure_ascii=False)
    if type(value) is not str:
        return str(value)
    return value


def answer_verify(predict: Any, golden: str) -> bool:
    """FTRL's check that an output contains a gold answer.

    The gold answer is split on ", " (comma + space, FTRL's `golden.split(', ')`); the
    prediction is lower-cased, has all commas removed and is stripped; the check passes when every
    part, lower-cased, comma-free and stripped, is a substring of it. So "1,024" matches an
    output "1024 units", and "b, c, a" needs "b", "c" and "a" all present.
    """
    text = _as_text(predict).lower().replace(",", "").strip()
    for part in golden.split(", "):
        if part.lower().replace(",", "").strip() not in text:
            return False
    return True


def solve_metrics(
    call_outputs: Sequence[tuple[str, str]], unsolved_set: Mapping[str, Sequence[str]]
) -> dict[str, float]:
    """FTRL's Solve-P / Solve-R / Solve-F1 of one episode.

    call_outputs: every executed call of the episode in turn order, as (tool name, observation).
    unsolved_set: tool name -> gold intermediate answers (not modified).

    Each call may solve at most one still-unsolved gold answer *of its own tool*: the first one,
    in list order, for which `answer_verify(observation, gold)` holds; that answer is consumed.
    With `solved` answers, `n` calls and `g` gold answers:
    P = solved / n (1.0 when n = 0), R = solved / g, F1 = 2 * solved / (n + g).

    Returns {"solve_p", "solve_r", "solve_f1", "solved", "num_calls", "num_gold"}.
    Raises ValueError when the task has no gold answers (FTRL asserts the same).
    """
    remaining = {name: list(answers) for name, answers in unsolved_set.items()}
    num_gold = sum(len(v) for v in remaining.values())
    if num_gold <= 0:
        raise ValueError(
            f"solve_metrics: unsolved_set has no gold answers ({dict(unsolved_set)!r}); "
            "FTRL requires at least one"
        )
    solved = 0
    for name, text in call_outputs:
        answers = remaining.get(name)
        if not answers:
            continue
        for j, gold in enumerate(answers):
            if answer_verify(text, gold):
                del answers[j]
                solved += 1
                break
    num_calls = len(call_outputs)
    return {
        "solve_p": solved / num_calls if num_calls > 0 else 1.0,
        "solve_r": solved / num_gold,
        "solve_f1": 2.0 * solved / (num_calls + num_gold),
        "solved": float(solved),
        "num_calls": float(num_calls),
        "num_gold": float(num_gold),
    }


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------
def _decode(value: Any, where: str, key: str, expected: type) -> Any:
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("utf-8")
    if isinstance(value, str) and expected is not str:
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise FTRLFormatError(
                f"{where}: key {key!r}: expected a JSON {expected.__name__}, got unparseable "
                f"text ({e}): {value[:80]!r}"
            ) from None
    if hasattr(value, "tolist") and not isinstance(value, (str, dict)):
        value = value.tolist()  # numpy arrays from parquet list columns
    if expected is list and isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, expected):
        raise FTRLFormatError(
            f"{where}: key {key!r}: expected {expected.__name__}, got {type(value).__name__}"
        )
    return value


def gold_calls_from_ground_truth(value: Any, where: str) -> tuple[tuple[dict[str, Any], ...], ...] | None:
    """The `ground_truth` column (see the module docstring) as `Task.gold_calls`: one
    ({"name", "arguments"},) per gold call, in order; None for an absent (None) value."""
    if value is None:
        return None
    calls = _decode(value, where, "ground_truth", list)
    if not calls:
        raise FTRLFormatError(f"{where}: key 'ground_truth': expected a non-empty list of calls, got []")
    turns = []
    for i, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise FTRLFormatError(f"{where}: key 'ground_truth'[{i}]: expected {{'name', 'parameters'}}, "
                                  f"got {type(call).__name__}")
        name = call.get("name")
        if not isinstance(name, str) or not name:
            raise FTRLFormatError(f"{where}: key 'ground_truth'[{i}]: 'name' must be a non-empty string, "
                                  f"got {name!r:.80}")
        key = "parameters" if "parameters" in call else "arguments" if "arguments" in call else None
        if key is None:
            raise FTRLFormatError(f"{where}: key 'ground_truth'[{i}]: missing 'parameters' (or 'arguments'); "
                                  f"got keys {sorted(call)}")
        args = _decode(call[key], where, f"ground_truth[{i}].{key}", dict)
        turns.append(({"name": name, "arguments": dict(args)},))
    return tuple(turns)


def row_to_task(row: Mapping[str, Any], *, where: str, default_id: str,
                require: Sequence[str] = ()) -> Task:
    """Validates one FTRL row and converts it to a `Task`; errors name `where` and the key.

    require: Task fields the row must provide (only "gold_calls" is optional in FTRL rows):
    a row without `ground_truth` then raises instead of loading with gold_calls None.
    """
    if not isinstance(row, Mapping):
        raise FTRLFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
    unknown = [f for f in require if f != "gold_calls"]
    if unknown:
        raise ValueError(f"FTRL rows cannot provide Task fields {unknown} (only gold_calls, from 'ground_truth')")
    key_messages = "messages" if "messages" in row else "prompt"
    for key in (key_messages, "tools", "codes", "unsolved_set", "answer"):
        if key not in row:
            raise FTRLFormatError(
                f"{where}: missing key {key!r} (expected keys messages, tools, codes, "
                f"unsolved_set, answer; got {sorted(row)})"
            )
    gold_calls = gold_calls_from_ground_truth(row.get("ground_truth"), where)
    if gold_calls is None and "gold_calls" in require:
        raise FTRLFormatError(
            f"{where}: key 'ground_truth' is {'null' if 'ground_truth' in row else 'missing'}: the training "
            f"method's rewards need every row's gold tool calls (a list of {{'name', 'parameters'}})"
        )
    messages = _decode(row[key_messages], where, key_messages, list)
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise FTRLFormatError(
                f"{where}: key {key_messages!r}[{i}]: expected {{'role', 'content'}}, got {m!r:.80}"
            )
    tools = _decode(row["tools"], where, "tools", list)
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping) or not isinstance(t.get("function"), Mapping):
            raise FTRLFormatError(
                f"{where}: key 'tools'[{i}]: expected {{'type': 'function', 'function': {{...}}}}, "
                f"got {t!r:.80}"
            )
    names: list[str] = []
    for i, t in enumerate(tools):
        name = t["function"].get("name")
        if not isinstance(name, str) or not name:
            raise FTRLFormatError(f"{where}: key 'tools'[{i}].function.name: expected a non-empty string, got {name!r:.80}")
        if name in names:
            raise FTRLFormatError(f"{where}: key 'tools'[{i}]: the tool name {name!r} is declared twice")
        names.append(name)
    codes = _decode(row["codes"], where, "codes", dict)
    for name, src in codes.items():
        if not isinstance(src, str):
            raise FTRLFormatError(
                f"{where}: key 'codes'[{name!r}]: expected Python source text, got "
                f"{type(src).__name__}"
            )
    stray = sorted(set(codes) - set(names))
    if stray:
        raise FTRLFormatError(f"{where}: key 'codes' names tools absent from 'tools': {stray} (tools: {names})")
    unsolved = _decode(row["unsolved_set"], where, "unsolved_set", dict)
    unsolved_set: dict[str, list[str]] = {}
    for name, answers in unsolved.items():
        answers = answers.tolist() if hasattr(answers, "tolist") else answers
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise FTRLFormatError(
                f"{where}: key 'unsolved_set'[{name!r}]: expected a list of strings, got {answers!r:.80}"
            )
        unsolved_set[name] = list(answers)
    stray = sorted(set(unsolved_set) - set(names))
    if stray:
        raise FTRLFormatError(f"{where}: key 'unsolved_set' names tools absent from 'tools': {stray} (tools: {names})")
    if sum(len(v) for v in unsolved_set.values()) == 0:
        raise FTRLFormatError(f"{where}: key 'unsolved_set': expected at least one gold answer, got none")
    answer = row["answer"]
    if not isinstance(answer, str):
        raise FTRLFormatError(f"{where}: key 'answer': expected str, got {type(answer).__name__}")
    data_source = row.get("data_source") or ""
    if not isinstance(data_source, str):
        raise FTRLFormatError(
            f"{where}: key 'data_source': expected str, got {type(data_source).__name__}"
        )
    extra = {k: row[k] for k in ("solve_rate", "split") if k in row}
    return Task(
        task_id=str(row.get("id", default_id)),
        messages=tuple(dict(m) for m in messages),
        tools=tuple(dict(t) for t in tools),
        codes=dict(codes),
        unsolved_set=unsolved_set,
        answer=answer,
        data_source=data_source,
        category=data_source.rsplit("/", 1)[-1],
        gold_calls=gold_calls,
        extra=extra,
    )


def _iter_jsonl(path: pathlib.Path, *, keep_going: bool = False) -> Iterable[tuple[str, int, Any]]:
    """(where, 0-based row number, decoded row) per non-blank line; where = "path: line N" (1-based).
    A line that is not JSON raises FTRLFormatError, or with `keep_going` is yielded as that error in
    place of the row (a validator reports the lines after it too)."""
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            where = f"{path}: line {index + 1}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if not keep_going:
                    raise FTRLFormatError(f"{where}: invalid JSON ({e})") from None
                row = FTRLFormatError(f"{where}: invalid JSON ({e})")
            yield where, index, row


def _iter_parquet(path: pathlib.Path) -> Iterable[tuple[str, int, Any]]:
    """(where, row index, row) per row; where = "path: row i" (0-based row index)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            f"reading {path} needs pyarrow (pip install pyarrow)"
        ) from e
    table = pq.read_table(path)
    for index, row in enumerate(table.to_pylist()):
        yield f"{path}: row {index}", index, row


def load_tasks(path: str | os.PathLike, *, require: Sequence[str] = ()) -> list[Task]:
    """Loads FTRL tasks from a .jsonl file, a .parquet file, or a folder of .parquet files.

    require: Task fields every row must provide (`row_to_task`); training under a reward that reads
    gold calls passes ("gold_calls",). Every error names the file, the row (see the module
    docstring) and the key, with the expected and actual types.
    """
    path = pathlib.Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.parquet")) + sorted(path.glob("*.jsonl"))
        if not files:
            raise FileNotFoundError(f"{path}: no .parquet or .jsonl files in this folder")
        return [t for f in files for t in load_tasks(f, require=require)]
    if not path.exists():
        raise FileNotFoundError(f"FTRL file not found: {path}")
    if path.suffix == ".parquet":
        rows = _iter_parquet(path)
    elif path.suffix in (".jsonl", ".json"):
        rows = _iter_jsonl(path)
    else:
        raise ValueError(f"{path}: unknown FTRL file type {path.suffix!r} (.jsonl or .parquet)")
    return [
        row_to_task(row, where=where, default_id=f"{path.stem}:{index}", require=require)
        for where, index, row in rows
    ]


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------
class FTRLEpisode(CodeToolEpisode):
    """An FTRL episode; `score` returns Solve-P/R/F1 and FTRL's final-answer check."""

    reward_key = "solve_f1"

    def score(self, final_text: str | None = None) -> EpisodeScore:
        metrics = solve_metrics(self.call_outputs, self.task.unsolved_set)
        metrics["answer_correct"] = float(
            bool(final_text) and bool(self.task.answer) and answer_verify(final_text, self.task.answer)
        )
        metrics["num_turns"] = float(len(self.turns))
        return EpisodeScore(reward=metrics[self.reward_key], metrics=metrics)


class FTRLEnv(CodeToolEnvironment):
    """FTRL tool environment: dataset tool code through the isolated executor; reward Solve-F1.

    Also used for the built-in synthetic tasks, which share FTRL's format.
    """

    name = "ftrl"
    episode_cls = FTRLEpisode
