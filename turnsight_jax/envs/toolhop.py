"""ToolHop (995 multi-hop queries with executable tools): loader, answer-match scoring, env.

ToolHop is not downloaded here; `load_tasks(path)` reads the file a user supplies: a JSON list
or JSON lines, one object per query with
  question   the query text
  answer     the gold answer (numbers are turned into text)
  tools      tool schemas: {name: schema} or [schema, ...] (schema = the "function" object, or
             an OpenAI-style {"type": "function", "function": {...}})
  functions  tool code: {name: python source} or [python source, ...] (a list is keyed by the
             name of each source's top-level function, found by parsing, not running, it)
  optional: messages (used as the prompt instead of the template), id.

Scenarios (the ToolHop paper's three, as MatchTIR's released `evaluation_toolhop.py` builds them;
`scenario_task` applies one to a loaded task):
  direct     no tools; the "direct" prompt asks for the answer from the model's own knowledge; one
             generation (the released default: `eval_toolhop.sh` sets scenario="Direct")
  mandatory  the tools; the prompt says to call a tool at every step and take the final answer
             from a tool (what `load_tasks` builds, and what training on ToolHop uses)
  free       the tools; the same prompt without the must-call sentences
A row with its own `messages` keeps them in every scenario (the released code does the same).
Tools run in the isolated executor exactly like FTRL's. Scoring follows that evaluation's
`_answer_correct`: correct when FTRL's `answer_verify` finds the gold answer in the final answer
turn, or (tool scenarios) in the last tool observation right before it.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import pathlib
from typing import Any, Mapping

from turnsight_jax.chat.types import Task
from turnsight_jax.envs.base import EpisodeScore
from turnsight_jax.envs.code_tools import CodeToolEnvironment, CodeToolEpisode
from turnsight_jax.envs.ftrl import answer_verify
from turnsight_jax.envs.answers import extract_answer, token_f1

SCENARIOS = ("direct", "mandatory", "free")
# The released evaluation's default scenario (Scripts/eval_toolhop.sh: scenario="Direct").
DEFAULT_SCENARIO = "direct"
# Policy turns per scenario in the released evaluation: one generation for direct, --max_turns 9
# (its argparse default) for the tool scenarios.
SCENARIO_MAX_TURNS = {"direct": 1, "mandatory": 9, "free": 9}

DIRECT_PROMPT = (
    "You will be asked a question, and should provide a short answer.\n"
    "If the answer is a date, format is as follows: YYYY-MM-DD (ISO standard)\n"
    "If the answer is a name, format it as follows: Firstname Lastname\n"
    "If the answer contains any number, format it as a number, not a word, and only output that number. "
    "Do not include leading 0s.\n\n"
    "Please provide the answer in the following format: <answer>your answer here</answer>\n"
    "Answer as short as possible.\nQuestion: {question}"
)
# The "free" prompt is the mandatory one without its must-call sentences (typo "nswer" as released).
FREE_PROMPT = (
    "You will be asked a question with some tools, and should provide a short final answer.\n"
    "If the final answer is a date, format is as follows: YYYY-MM-DD (ISO standard)\n"
    "If the final nswer is a name, format it as follows: Firstname Lastname\n"
    "If the final answer contains any number, format it as a number, not a word, and only "
    "output that number. Do not include leading 0s.\n\n"
    "Please provide the final answer in the following format: <answer>final answer here</answer>\n"
    "Answer as short as possible.\nQuestion: {question}"
)
MANDATORY_PROMPT = (
    "You will be asked a question with some tools, and should provide a short final answer.\n"
    "Please note that you must call the tool at every step, you must not use your own knowledge. "
    "Your final answer must also be returned from the tool.\n"
    "If the final answer is a date, format is as follows: YYYY-MM-DD (ISO standard)\n"
    "If the final nswer is a name, format it as follows: Firstname Lastname\n"
    "If the final answer contains any number, format it as a number, not a word, and only "
    "output that number. Do not include leading 0s.\n\n"
    "Please provide the final answer in the following format: <answer>final answer here</answer>\n"
    "Answer as short as possible.\nQuestion: {question}"
)


class ToolHopFormatError(ValueError):
    """A ToolHop row does not have the expected layout."""


def _function_names(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _schema(tool: Any, where: str, key: str) -> dict:
    if isinstance(tool, Mapping) and isinstance(tool.get("function"), Mapping):
        tool = tool["function"]
    if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
        raise ToolHopFormatError(f"{where}: key {key}: expected a function schema with a name, got {tool!r:.80}")
    return {"type": "function", "function": dict(tool)}


def row_to_task(row: Any, *, where: str, default_id: str) -> Task:
    """Validates one ToolHop row and converts it to a `Task`; errors name `where` and the key."""
    if not isinstance(row, Mapping):
        raise ToolHopFormatError(f"{where}: expected an object, got {type(row).__name__}")
    for key in ("question", "answer", "tools", "functions"):
        if key not in row:
            raise ToolHopFormatError(f"{where}: missing key {key!r} (got {sorted(row)})")
    question = row["question"]
    if not isinstance(question, str):
        raise ToolHopFormatError(f"{where}: key 'question': expected str, got {type(question).__name__}")
    answer = row["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ToolHopFormatError(
            f"{where}: key 'answer': expected str or number, got {type(answer).__name__}"
        )
    tools_raw = row["tools"]
    if isinstance(tools_raw, Mapping):
        tools = [_schema(t, where, f"'tools'[{n!r}]") for n, t in tools_raw.items()]
    elif isinstance(tools_raw, list):
        tools = [_schema(t, where, f"'tools'[{i}]") for i, t in enumerate(tools_raw)]
    else:
        raise ToolHopFormatError(f"{where}: key 'tools': expected dict or list, got {type(tools_raw).__name__}")
    funcs = row["functions"]
    codes: dict[str, str] = {}
    if isinstance(funcs, Mapping):
        for name, src in funcs.items():
            if not isinstance(src, str):
                raise ToolHopFormatError(f"{where}: key 'functions'[{name!r}]: expected source text, got {type(src).__name__}")
            codes[name] = src
    elif isinstance(funcs, list):
        for i, src in enumerate(funcs):
            if not isinstance(src, str):
                raise ToolHopFormatError(f"{where}: key 'functions'[{i}]: expected source text, got {type(src).__name__}")
            names = _function_names(src)
            if not names:
                raise ToolHopFormatError(f"{where}: key 'functions'[{i}]: expected a top-level def, found none")
            for name in names:
                codes[name] = src
    else:
        raise ToolHopFormatError(f"{where}: key 'functions': expected dict or list, got {type(funcs).__name__}")
    missing = [t["function"]["name"] for t in tools if t["function"]["name"] not in codes]
    if missing:
        raise ToolHopFormatError(f"{where}: key 'functions': no code for tools {missing}")
    messages = row.get("messages")
    if messages:
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise ToolHopFormatError(f"{where}: key 'messages': expected a list of messages")
        messages = tuple(dict(m) for m in messages)
    else:
        messages = ({"role": "user", "content": MANDATORY_PROMPT.format(question=question)},)
    return Task(
        task_id=str(row.get("id", default_id)),
        messages=messages,
        tools=tuple(tools),
        codes=codes,
        unsolved_set={},
        answer=str(answer),
        data_source="toolhop",
        category="toolhop",
        extra={"question": question, "own_messages": bool(row.get("messages")), "scenario": "mandatory"},
    )


def scenario_task(task: Task, scenario: str) -> Task:
    """`task` (as `row_to_task` built it: the mandatory scenario) in another ToolHop scenario.

    direct: no tools and no tool code, the direct prompt; mandatory: unchanged; free: the tools
    with the free prompt. A row's own `messages` are kept in every scenario.
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown ToolHop scenario {scenario!r}; expected one of {', '.join(SCENARIOS)}")
    if task.extra.get("scenario") != "mandatory":
        raise ValueError(f"task {task.task_id}: scenario_task expects a freshly loaded (mandatory) ToolHop task")
    if scenario == "mandatory":
        return task
    messages = task.messages
    if not task.extra.get("own_messages"):
        template = DIRECT_PROMPT if scenario == "direct" else FREE_PROMPT
        messages = ({"role": "user", "content": template.format(question=task.extra["question"])},)
    tools, codes = (task.tools, task.codes) if scenario == "free" else ((), {})
    return dataclasses.replace(task, messages=messages, tools=tools, codes=codes,
                               extra={**task.extra, "scenario": scenario})


def load_tasks(path: str | os.PathLike) -> list[Task]:
    """Loads ToolHop from a .json list or a .jsonl file; errors name the file, row and key."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"ToolHop file not found: {path}")
    text = path.read_text(encoding="utf-8")
    rows: list[tuple[int, Any]]
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = list(enumerate(json.loads(text)))
        except json.JSONDecodeError as e:
            raise ToolHopFormatError(f"{path}: invalid JSON ({e})") from None
    else:
        rows = []
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    rows.append((i, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ToolHopFormatError(f"{path}: row {i}: invalid JSON ({e})") from None
    return [row_to_task(r, where=f"{path}: row {i}", default_id=f"toolhop:{i}") for i, r in rows]


class ToolHopEpisode(CodeToolEpisode):
    """A ToolHop episode; reward = answer correctness (FTRL/MatchTIR's ToolHop rule)."""

    def score(self, final_text: str | None = None) -> EpisodeScore:
        correct = False
        if self.task.extra.get("scenario") == "direct":
            # One generation, no tools: the released rule checks the assistant message alone.
            correct = bool(final_text) and answer_verify(final_text, self.task.answer)
        elif self.done and final_text:
            if answer_verify(final_text, self.task.answer):
                correct = True
            elif self.turns and self.turns[-1] and answer_verify(self.turns[-1][-1][1], self.task.answer):
                correct = True  # the last tool result (right before the answer turn) holds it
        metrics = {
            "answer_correct": float(correct),
            "answer_f1": token_f1(extract_answer(final_text), self.task.answer),
            "num_calls": float(len(self.call_outputs)),
            "num_turns": float(len(self.turns)),
        }
        return EpisodeScore(reward=metrics["answer_correct"], metrics=metrics)


class ToolHopEnv(CodeToolEnvironment):
    """ToolHop environment: the ToolHop functions through the isolated executor."""

    name = "toolhop"
    episode_cls = ToolHopEpisode
