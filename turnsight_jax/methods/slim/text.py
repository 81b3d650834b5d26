"""SLIM's texts: the skills block in the policy's prompt, the writer's prompt, and the cleaning
of the writer's output (docs/signal_methods.md, "SLIM"). Pure string work on the host.

The skills block is the system message's content (before the tool schemas the chat template
adds), or is appended to a task's own system message after a blank line:

    # Skills

    Use these skills when they apply to the task:
    <skill>
    {text of the first skill shown to this task}
    </skill>
    <skill>
    ...
    </skill>

A task that is shown no skill keeps its messages unchanged. Skill texts are model output: they
are never evaluated, and `clean_skill` removes every control-token spelling (`<|im_start|>`,
...) before a text enters the library, so a skill can never open or close a chat turn in the
prompt (the prompt's markup is encoded with its control tokens).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.chat.template import generation_prompt
from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import Task
from turnsight_jax.methods.slim.library import SkillLibrary

SKILLS_HEADER = "# Skills\n\nUse these skills when they apply to the task:"
SKILL_ITEM = "\n<skill>\n{text}\n</skill>"

WRITER_INSTRUCTION = (
    "You write skills for an assistant that solves tasks by calling tools. A skill is a short, general "
    "instruction (a few sentences) for one type of task: which tools to call, in which order, with which "
    "arguments, and how to write the final answer.\n\n"
    "The assistant failed these tasks of type \"{task_type}\":\n\n{attempts}\n"
    "Write one skill for tasks of type \"{task_type}\" that avoids these failures. Reply with the skill "
    "text only.")
WRITER_ATTEMPT = "<attempt>\nTask: {question}\n{transcript}Score: {score:.2f}\n</attempt>\n"
WRITER_TURN = "Assistant: {text}\n"
WRITER_RESULT = "Tool result: {result}\n"


def skills_block(texts: Sequence[str]) -> str:
    """The block's text for these skill texts (in order); "" for none."""
    if not texts:
        return ""
    return SKILLS_HEADER + "".join(SKILL_ITEM.format(text=t.strip()) for t in texts)


def with_skills(task: Task, library: SkillLibrary, *, without: str | None = None) -> Task:
    """`task` whose prompt shows the active skills of its type (less skill `without`): the block
    as a new first system message, or appended to the task's own one. Unchanged when none apply."""
    block = skills_block([s.text for s in library.shown_to(task.category, without=without)])
    if not block:
        return task
    messages = list(task.messages)
    if messages and messages[0].get("role") == "system":
        own = messages[0].get("content")
        own = own if isinstance(own, str) else ""
        messages[0] = {**messages[0], "content": (own.rstrip("\n") + "\n\n" if own.strip() else "") + block}
    else:
        messages.insert(0, {"role": "system", "content": block})
    return dataclasses.replace(task, messages=tuple(messages))


# ---- the writer's prompt ----

def _question(task: Task) -> str:
    users = [m.get("content") for m in task.messages if m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else ""


def _transcript(traj: Trajectory, limit: int) -> str:
    """The policy's turns (stop token dropped) and tool results, cut to `limit` characters."""
    parts = []
    for turn in traj.turns:
        parts.append(WRITER_TURN.format(text=turn.text.replace(tok_lib.IM_END, "").strip()))
        for r in turn.results:
            parts.append(WRITER_RESULT.format(result=r.strip()))
    text = "".join(parts)
    return text if len(text) <= limit else text[:limit] + " [...]\n"


def writer_prompt(task_type: str, failed: Sequence[tuple[Task, Trajectory]], *, transcript_chars: int) -> str:
    """The writer's user message: the instruction and one <attempt> per failed (task, trajectory)."""
    attempts = "".join(WRITER_ATTEMPT.format(question=_question(task).strip(),
                                             transcript=_transcript(traj, transcript_chars),
                                             score=float(traj.reward))
                       for task, traj in failed)
    return WRITER_INSTRUCTION.format(task_type=task_type, attempts=attempts)


def writer_prompt_ids(tokenizer: Any, content: str) -> list[int]:
    """The writer's prompt as ids: one user turn and the assistant header with thinking off. The
    content quotes model text and tool results, so it is encoded as plain text (a spelled control
    token stays text); only the markup is encoded with its control tokens."""
    return (tok_lib.encode(tokenizer, tok_lib.IM_START + "user\n") + tok_lib.encode_plain(tokenizer, content)
            + tok_lib.encode(tokenizer, tok_lib.IM_END + "\n" + generation_prompt(enable_thinking=False)))


# ---- cleaning the writer's output ----

_THINK = re.compile(r"<think>.*?</think>", re.S)


def clean_skill(raw: str, tokenizer: Any, *, max_tokens: int) -> str:
    """The writer's text as a skill: thinking removed (a closed <think> block; an unclosed one
    from <think> on), every control-token spelling removed (repeatedly, so that removing one
    cannot join two halves into another), whitespace runs tidied, cut to `max_tokens` tokens."""
    text = _THINK.sub("", raw)
    if "</think>" in text:  # the generation prompt opened the (empty) block; keep what follows it
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    specials = [s for s in tok_lib.special_token_texts(tokenizer) if s]
    while True:
        before = text
        for s in specials:
            text = text.replace(s, "")
        if text == before:
            break
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    ids = tok_lib.encode_plain(tokenizer, text)
    if len(ids) > max_tokens:
        text = tokenizer.decode(ids[:max_tokens], skip_special_tokens=False).strip()
    return text


# A text of at least REPEAT_MIN_TOKENS tokens of which fewer than this share are distinct is a
# loop ("vb vb vb ...", what a weak greedy writer falls into), not an instruction.
MIN_DISTINCT_SHARE = 0.25
REPEAT_MIN_TOKENS = 8


def degenerate(text: str, ids: Sequence[int], active_texts: Sequence[str], *, min_chars: int) -> str | None:
    """Why `text` (its plain token ids `ids`) cannot be a skill, None when it can: fewer than
    `min_chars` non-space characters, a repetition loop (fewer than MIN_DISTINCT_SHARE distinct
    tokens), or the text of an active skill again."""
    if sum(not c.isspace() for c in text) < min_chars:
        return f"empty or too short (fewer than slim.min_skill_chars={min_chars} non-space characters)"
    if len(ids) >= REPEAT_MIN_TOKENS and len(set(ids)) < MIN_DISTINCT_SHARE * len(ids):
        return f"a repetition loop ({len(set(ids))} distinct of {len(ids)} tokens)"
    if text.strip() in {t.strip() for t in active_texts}:
        return "duplicate of an active skill"
    return None
