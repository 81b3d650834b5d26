"""Privileged blocks: what a privileged-context teacher (RLSD, SDPO, SDAR; docs/baselines.md) is
shown that the student is not, as one user message of token ids.

The block is inserted into the student's context either once right after the prompt (placement
"prompt": the teacher reads prompt + block + the whole trajectory) or before each turn's assistant
header (placement "turn", as TurnSight's hindsight block); methods.privileged_views packs those views.
Sources (`privileged.source`):

* "gold_answer": ``The correct final answer is: {answer}`` (the task's answer);
* "sibling": a successful sibling rollout of the same prompt (`choose_sibling`): each of its turns'
  text and tool results; the same block before every turn with placement "turn";
* "feedback": the environment's output: with placement "turn", that turn's own tool results (no
  block when the turn called nothing); with "prompt", every turn's calls and results and the
  outcome score (the hindsight of the whole episode);
* "skill": a text for the task's category from a skills file (`load_skills`; the bundled
  turnsight_jax/assets/skills_builtin.json by default), else its "default" entry;
* "none": no block (the teacher, another model, reads the student's own context: SOD).

A missing block (None: no successful sibling, no skill, a turn without results) means the view is
skipped: those tokens keep the base method's update. Everything quoted from the rollout or the
data (answers, model text, tool results) is tokenised as plain text, so a spelled control token
stays text (chat.tokenizer.encode_plain), as in the rollout itself.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Sequence

from turnsight_jax.chat import budget as budget_lib
from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.chat.parsing import render_tool_call
from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import CallError, Task, ToolCall

PRIVILEGED_SOURCES = ("gold_answer", "sibling", "feedback", "skill", "none")
PLACEMENTS = ("prompt", "turn")


@dataclasses.dataclass(frozen=True)
class PrivilegedTemplate:
    """The block's format strings. message_open / message_close are chat markup (encoded with
    the special tokens); the content between them is encoded as plain text. Every piece ends with
    a newline, so the three tokenise as they would together."""

    message_open: str = "<|im_start|>user\n<privileged>\n"
    message_close: str = "</privileged><|im_end|>\n"
    gold_answer: str = "The correct final answer is: {answer}\n"
    sibling: str = "A successful attempt at this task:\n{transcript}"
    feedback: str = "Feedback from the environment on this attempt:\n{feedback}"
    score: str = "Outcome score: {score:.2f}\n"
    skill: str = "{skill}\n"
    turn: str = "<turn>\n{text}{results}</turn>\n"
    call: str = "<tool_call>\n{call}\n</tool_call>\n"
    result: str = "<tool_response>\n{result}\n</tool_response>\n"


def default_skills_path() -> pathlib.Path:
    """The bundled skill texts of the built-in task categories."""
    return pathlib.Path(__file__).resolve().parents[1] / "assets" / "skills_builtin.json"


def load_skills(path: str | pathlib.Path) -> dict[str, str]:
    """{task category: skill text} from a JSON object; ValueError naming the file and the key."""
    path = pathlib.Path(path)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object {{category: text}}, got {type(raw).__name__}")
    for key, text in raw.items():
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path}: skill {key!r} must be a non-empty string, got {text!r}")
    return dict(raw)


def choose_sibling(rewards: Sequence[float], group_ids: Sequence[int], lengths: Sequence[int],
                   min_reward: float) -> list[int | None]:
    """For each row, the sibling whose rollout the teacher is shown: another row of the same group
    with reward >= min_reward; the highest reward, then the fewest tokens, then the lowest index.
    None when no sibling qualifies (a row is never its own sibling). rewards, group_ids, lengths [B]."""
    out: list[int | None] = []
    for i, g in enumerate(group_ids):
        cands = [j for j, h in enumerate(group_ids) if h == g and j != i and rewards[j] >= min_reward]
        out.append(min(cands, key=lambda j: (-rewards[j], lengths[j], j)) if cands else None)
    return out


def _call_text(call) -> str:
    if isinstance(call, ToolCall):
        return render_tool_call(call.name, call.arguments)[len("<tool_call>\n"):-len("\n</tool_call>")]
    assert isinstance(call, CallError)
    return call.raw.strip()


def _results(template: PrivilegedTemplate, turn) -> str:
    return "".join(template.result.format(result=r) for r in turn.results)


def _transcript(template: PrivilegedTemplate, traj: Trajectory) -> str:
    """Each turn's policy text (its stop token dropped) and tool results."""
    parts = []
    for turn in traj.turns:
        text = turn.text.replace("<|im_end|>", "").rstrip() + "\n"
        parts.append(template.turn.format(text=text, results=_results(template, turn)))
    return "".join(parts)


def _episode_feedback(template: PrivilegedTemplate, traj: Trajectory) -> str:
    parts = []
    for turn in traj.turns:
        calls = "".join(template.call.format(call=_call_text(c)) for c in turn.calls)
        if calls or turn.results:
            parts.append(template.turn.format(text=calls, results=_results(template, turn)))
    return "".join(parts) + template.score.format(score=float(traj.reward))


def privileged_texts(trajs: Sequence[Trajectory], tasks: Sequence[Task], *, source: str, placement: str,
                     template: PrivilegedTemplate = PrivilegedTemplate(), skills: dict[str, str] | None = None,
                     rewards: Sequence[float] | None = None, group_ids: Sequence[int] | None = None,
                     min_reward: float = 1.0) -> list:
    """The blocks' plain-text content (between message_open and message_close): per trajectory a
    str or None (placement "prompt"), or a list with one str or None per turn ("turn")."""
    if source not in PRIVILEGED_SOURCES:
        raise ValueError(f"unknown privileged source {source!r}; expected one of {PRIVILEGED_SOURCES}")
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown privileged placement {placement!r}; expected one of {PLACEMENTS}")
    if len(tasks) != len(trajs):
        raise ValueError(f"{len(trajs)} trajectories but {len(tasks)} row tasks")
    if source == "skill" and skills is None:
        raise ValueError("privileged source 'skill' needs the skill texts (load_skills)")
    siblings: list[int | None] = [None] * len(trajs)
    if source == "sibling":
        rewards = [float(t.reward) for t in trajs] if rewards is None else list(rewards)
        group_ids = [t.group_id for t in trajs] if group_ids is None else list(group_ids)
        siblings = choose_sibling(rewards, group_ids, [t.length for t in trajs], min_reward)
    out = []
    for i, (traj, task) in enumerate(zip(trajs, tasks)):
        if source == "none":
            whole = None
        elif source == "gold_answer":
            whole = template.gold_answer.format(answer=task.answer)
        elif source == "sibling":
            j = siblings[i]
            whole = None if j is None else template.sibling.format(transcript=_transcript(template, trajs[j]))
        elif source == "skill":
            text = skills.get(task.category, skills.get("default"))
            whole = None if text is None else template.skill.format(skill=text.strip())
        else:  # feedback
            whole = template.feedback.format(feedback=_episode_feedback(template, traj))
        if placement == "prompt":
            out.append(whole)
        elif source == "feedback":  # that turn's own results
            out.append([template.feedback.format(feedback=_results(template, t)) if t.results else None
                        for t in traj.turns])
        else:
            out.append([whole] * traj.num_turns)
    return out


def privileged_blocks(trajs: Sequence[Trajectory], tasks: Sequence[Task], tokenizer: Any, *, source: str,
                      placement: str, template: PrivilegedTemplate = PrivilegedTemplate(),
                      skills: dict[str, str] | None = None, rewards: Sequence[float] | None = None,
                      group_ids: Sequence[int] | None = None, min_reward: float = 1.0, budget: int = 0,
                      filler: str = budget_lib.DEFAULT_FILLER) -> list:
    """privileged_texts as token ids: per trajectory a list of ids or None ("prompt"), or one such
    entry per turn ("turn"). The markup is encoded with its special tokens, the content as plain
    text. budget > 0 (privileged.block_budget): every block exactly that many tokens, its content
    cut to its head or padded with the tiled `filler` (chat.budget)."""
    open_ids = tok_lib.encode(tokenizer, template.message_open)
    close_ids = tok_lib.encode(tokenizer, template.message_close)
    if budget < 0:
        raise ValueError(f"privileged.block_budget must be >= 0 (0: off), got {budget}")
    if budget and len(open_ids) + len(close_ids) > budget:
        raise ValueError(f"privileged.block_budget={budget}: the privileged block's markup alone has "
                         f"{len(open_ids) + len(close_ids)} tokens; raise the budget")
    pad = budget_lib.filler_ids(tokenizer, filler) if budget else []
    cache: dict[str, list[int]] = {}

    def ids(text):
        if text is None:
            return None
        if text not in cache:
            content = tok_lib.encode_plain(tokenizer, text)
            if budget:
                content = budget_lib.fit(content, budget - len(open_ids) - len(close_ids), pad)
            cache[text] = open_ids + content + close_ids
        return cache[text]

    texts = privileged_texts(trajs, tasks, source=source, placement=placement, template=template, skills=skills,
                             rewards=rewards, group_ids=group_ids, min_reward=min_reward)
    return [ids(t) if placement == "prompt" else [ids(x) for x in t] for t in texts]
