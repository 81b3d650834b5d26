"""A stand-in teacher where no large judge is at hand: the environment's verifier, with a
rationale that states what the verifier found (`label --teacher verifier`).

It exists so that the whole recipe (label, distill, train on the distilled judge) runs on the
built-in tasks on a CPU, which have a verifier and no judge model to distil from. Its labels are
the verifier's success (reward >= `judge.verifier_threshold`); its rationales are one sentence
each, chosen from what the trajectory shows, never from the reference answer (the student, who
does not see the reference by default, could not write them):

* solved: "Solved: the final answer is right."
* no final answer (the last turn still calls tools, or wrote neither): "Not solved: the agent gave no final
  answer."
* an answer without a single tool call: "Not solved: the agent called no tool."
* otherwise: "Not solved: the final answer is wrong."

(the verdict first, then its ground: a small student commits to the class at the first word.)

A student distilled from it learns to imitate the verifier from the transcript; where a real
judge exists, `--teacher model` (judge.checkpoint) is the method.
"""

from __future__ import annotations

from turnsight_jax.chat.trajectory import Trajectory

SOLVED = "Solved: the final answer is right."
NO_ANSWER = "Not solved: the agent gave no final answer."
NO_TOOLS = "Not solved: the agent called no tool."
WRONG = "Not solved: the final answer is wrong."


def verifier_judgment(traj: Trajectory, threshold: float) -> tuple[str, int]:
    """(rationale, label) of one trajectory from its environment reward."""
    if traj.reward >= threshold:
        return SOLVED, 1
    last = traj.turns[-1] if traj.turns else None
    if last is None or last.calls or last.answer is None:
        return NO_ANSWER, 0
    if not any(t.calls for t in traj.turns):
        return NO_TOOLS, 0
    return WRONG, 0
