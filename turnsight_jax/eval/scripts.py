"""Replay scripts: fixed policy turns per task, for evaluating without a model.

`--replay gold` plays each task's ground truth:

* BFCL: for every user turn, one policy turn making that turn's ground-truth calls (Qwen3
  `<tool_call>` blocks; none when the turn's ground truth is empty), then a turn without calls
  ("Done.") that ends the user turn, exactly as `envs/bfcl_selfcheck.py` scripts it;
* tasks with a gold call chain (built-in tasks): one turn per gold tool turn, then
  `<answer>{gold answer}</answer>` (`synthetic.gold_turn_texts`);
* BFCL Memory and Web Search: a question answers its first accepted answer in BFCL's answer
  format ({"answer": ..., "context": ...}) without calling a tool (Web Search still needs a
  backend to run at all); a Memory prerequisite conversation has no ground truth: every user
  turn ends with an empty reply (a script file may give one, keyed by the prerequisite's id);
* FTRL and ToolHop rows carry no per-turn gold calls, so there is no gold script for them: use
  `--replay FILE.jsonl`.

`--replay FILE.jsonl` reads one JSON object per line: {"task_id": str, "turns": [str, ...]} and
optionally "benchmark" (one of the benchmark names) to scope the script to that benchmark when
task ids repeat across benchmarks. A task evaluated without a script is an error.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Mapping, Sequence

from turnsight_jax.chat.parsing import render_tool_call
from turnsight_jax.chat.types import Task
from turnsight_jax.eval.errors import EvalError

DONE_TEXT = "Done."


def _calls_text(calls: Sequence[Mapping]) -> str:
    return "\n".join(render_tool_call(c["name"], dict(c["arguments"])) for c in calls)


def agentic_answer_text(answer: str, context: str) -> str:
    """A final answer in the format BFCL's agentic system prompt asks for."""
    return json.dumps({"answer": answer, "context": context})


def gold_script(benchmark: str, task: Task) -> list[str]:
    """The ground-truth turn texts of `task` (see the module docstring)."""
    if "bfcl_answers" in task.extra:
        answers = task.extra["bfcl_answers"]
        # A Memory or Web Search question: its first accepted answer; a prerequisite conversation
        # has no ground truth, so each of its user turns ends at once (the snapshot stays as it was).
        if answers is None:
            return []
        context = "found by web search" if "web_search_category" in task.extra else "retrieved from memory"
        return [agentic_answer_text(answers[0], context)]
    if task.gold_calls is None:
        raise EvalError(
            f"--replay gold: {benchmark} task {task.task_id} has no ground-truth calls "
            f"({benchmark} rows carry none); pass --replay FILE.jsonl with {{\"task_id\", \"turns\"}} lines"
        )
    if benchmark == "bfcl":
        turns: list[str] = []
        for calls in task.gold_calls:
            if calls:
                turns.append(_calls_text(calls))
            turns.append(DONE_TEXT)  # a turn without calls ends BFCL's user turn
        return turns
    return [_calls_text(calls) for calls in task.gold_calls] + [f"<answer>{task.answer}</answer>"]


def check_gold_supported(benchmarks: Sequence[str]) -> None:
    """`--replay gold` needs per-turn ground truth, which FTRL and ToolHop files do not have."""
    for name in benchmarks:
        if name in ("ftrl", "toolhop"):
            raise EvalError(
                f"--replay gold is not supported for {name}: its rows have no per-turn ground-truth "
                f"calls; pass --replay FILE.jsonl with {{\"task_id\", \"turns\"}} lines instead"
            )


def load_script_file(path: str | os.PathLike) -> dict[tuple[str | None, str], list[str]]:
    """Reads a replay file: (benchmark or None, task id) -> turn texts. Errors name the line."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise EvalError(f"--replay {path}: no such file")
    scripts: dict[tuple[str | None, str], list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--replay {path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise EvalError(f"{where}: invalid JSON ({e})") from None
            if not isinstance(row, dict):
                raise EvalError(f"{where}: expected an object {{\"task_id\", \"turns\"}}, got {type(row).__name__}")
            task_id, turns, bench = row.get("task_id"), row.get("turns"), row.get("benchmark")
            if not isinstance(task_id, str) or not task_id:
                raise EvalError(f"{where}: \"task_id\" must be a non-empty string, got {task_id!r:.60}")
            if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                raise EvalError(f"{where}: \"turns\" must be a list of strings")
            if bench is not None and not isinstance(bench, str):
                raise EvalError(f"{where}: \"benchmark\" must be a string, got {bench!r:.60}")
            key = (bench, task_id)
            if key in scripts:
                raise EvalError(f"{where}: a second script for task {task_id!r}")
            scripts[key] = list(turns)
    if not scripts:
        raise EvalError(f"--replay {path}: the file has no scripts")
    return scripts


def file_script(scripts: Mapping[tuple[str | None, str], list[str]], benchmark: str, task: Task) -> list[str]:
    """The script of `task` from a replay file (benchmark-scoped entries first)."""
    for key in ((benchmark, task.task_id), (None, task.task_id)):
        if key in scripts:
            return scripts[key]
    raise EvalError(f"--replay: no script for {benchmark} task {task.task_id!r}")
