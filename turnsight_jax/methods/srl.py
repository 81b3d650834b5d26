"""SRL (supervised RL from expert steps; docs/signal_methods.md): a dense reward from the
similarity of each of the policy's actions to the expert's action at the same step.

The expert trajectory is the task's gold chain: one step per gold turn (`Task.gold_calls`, the
built-in tasks' chains and FTRL's `ground_truth`), then the answer step (`Task.answer`). The
policy's steps are its turns in order. An action is compared as text (`action_text`), the
thinking left out (SRL rewards the action, not the reasoning before it):

* a tool step: each call as one line of JSON, `{"arguments": {...}, "name": "..."}` with sorted
  keys at every level (`json.dumps(sort_keys=True, ensure_ascii=False)`), the calls in the order
  written; a call the parser refused is its raw text;
* an answer step (a turn without calls): the parsed answer (the text inside <answer>...</answer>;
  "" when none).

Step k of the policy is scored against step k of the expert with Python's
`difflib.SequenceMatcher(None, policy, expert, autojunk=False).ratio()` (Ratcliff-Obershelp:
2·matches / total length, in [0, 1]; autojunk off so that long arguments are not partly ignored);
a step only one side has scores 0. The trajectory's reward is the mean over max(policy steps,
expert steps): extra calls and missing steps both cost. Into GRPO's group normalisation, it has a
spread even when no rollout of the group solves the task, which is what SRL is for.
"""

from __future__ import annotations

import difflib
import json
from typing import Any, Mapping, Sequence

from turnsight_jax.chat.types import Call, CallError, ToolCall


def call_text(call: Call | Mapping[str, Any]) -> str:
    """One call as compared: sorted-key JSON of {"name", "arguments"}; a refused call's raw text."""
    if isinstance(call, CallError):
        return call.raw
    if isinstance(call, ToolCall):
        name, args = call.name, call.arguments
    else:
        name, args = call.get("name", ""), call.get("arguments", {})
    return json.dumps({"name": name, "arguments": args}, sort_keys=True, ensure_ascii=False)


def action_text(calls: Sequence[Call | Mapping[str, Any]], answer: str | None) -> str:
    """A step's action: its calls, one JSON line each; a step without calls: its answer ("" none)."""
    if calls:
        return "\n".join(call_text(c) for c in calls)
    return answer or ""


def expert_actions(gold_calls, gold_answer: str | None) -> list[str]:
    """The expert's steps: one per gold turn (a turn a list of calls, or one call when the chain
    is flat), then the answer."""
    steps = []
    for turn in gold_calls or ():
        steps.append(action_text([turn] if isinstance(turn, (Mapping, ToolCall)) else list(turn), None))
    steps.append(gold_answer or "")
    return steps


def similarity(a: str, b: str) -> float:
    """Ratcliff-Obershelp similarity in [0, 1] (difflib, autojunk off); two empty texts give 1."""
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def step_rewards(policy_steps: Sequence[str], expert_steps: Sequence[str]) -> list[float]:
    """Per aligned step k < max(len): similarity of the k-th actions, 0 where one side has none."""
    n = max(len(policy_steps), len(expert_steps))
    return [similarity(policy_steps[k], expert_steps[k]) if k < len(policy_steps) and k < len(expert_steps)
            else 0.0 for k in range(n)]


def srl_reward(pred_turns: Sequence[tuple[Sequence[Call], str | None]], gold_calls, gold_answer: str | None) -> float:
    """The trajectory's SRL reward: the mean of `step_rewards` over max(policy, expert) steps.
    pred_turns: each policy turn's (calls, parsed answer)."""
    rewards = step_rewards([action_text(c, a) for c, a in pred_turns], expert_actions(gold_calls, gold_answer))
    return float(sum(rewards) / len(rewards)) if rewards else 0.0


# ---- registration ----
from turnsight_jax.rl.methods import Method, register_method, register_reward  # noqa: E402


@register_reward("srl", "rewards", needs=("gold_calls",))
def srl_trajectory_reward(traj, task, algo) -> float:
    """SRL's dense reward: the mean over steps of the difflib similarity between each of the
    policy's actions (its calls, or its answer) and the expert's at that step (the task's gold
    chain, then its answer); in [0, 1]."""
    return srl_reward([(t.calls, t.answer) for t in traj.turns], task.gold_calls, task.answer)


register_method(Method("srl", advantage="grpo", rewards=("srl",),
                       description="SRL: similarity of each action to the expert's step, group-normalised"))
