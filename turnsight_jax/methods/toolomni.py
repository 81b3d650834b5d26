"""ToolOmni (docs/signal_methods.md): tool use as two separately normalised stages with a
multiplicative retrieval reward, for FTRL-format tasks (docs/signal_methods.md).

The paper's retrieval stage and answer stage are, in a multi-turn trajectory, its tool turns and
its answer turn (the last turn, when it has no calls). Each gets its own reward and its own group
normalisation:

* **Retrieval reward** R_ret = InfoRecall × AnswerTran + 0.2 · format (a zero factor zeroes the
  main score), defined here for FTRL-format tasks:
  - InfoRecall: the share of the task's gold sub-answers (`Task.unsolved_set`, every value of
    every tool) found in the trajectory's tool results (each normalised as answers are,
    rewards.normalize_answer, and found as a substring of some normalised result); 1 for a task
    with none;
  - AnswerTran: the order agreement of the trajectory's tool sequence with the gold chain's, the
    longest common subsequence of the called tool names (in call order) over the longer of the two
    sequences, in [0, 1] (a missing call and an extra one both cost; 1 when both are empty);
  - format: 1 when every call parsed and the last turn gives an answer, else 0.
* **Answer reward**: the token F1 of the parsed answer against the gold answer (the paper's
  reward model is FTRL's verifier here).
* **The gate**: only trajectories with R_ret >= `toolomni.gate` (0.95) pass to the answer
  stage: the answer stage's group statistics pool the passing siblings only, and a trajectory
  that did not pass gets no answer-stage advantage.

Advantage (estimator "toolomni", [B, N]): on tool-turn tokens, R_ret normalised within the prompt
group (GRPO's statistics); on answer-turn tokens of passing trajectories, the answer reward
normalised within the group's passing members; 0 elsewhere.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax.numpy as jnp

from turnsight_jax.chat.types import Call, CallError, ToolCall
from turnsight_jax.errors import ConfigError
from turnsight_jax.rewards import flatten_gold, normalize_answer
from turnsight_jax.rl.groups import group_normalize

FORMAT_WEIGHT = 0.2


def info_recall(results: Sequence[str], unsolved_set: Mapping[str, Sequence[str]]) -> float:
    """Share of the gold sub-answers found (normalised, as a substring) in the tool results."""
    gold = [normalize_answer(str(v)) for values in unsolved_set.values() for v in values]
    gold = [g for g in gold if g]
    if not gold:
        return 1.0
    seen = [normalize_answer(r) for r in results]
    return sum(any(g in r for r in seen) for g in gold) / len(gold)


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b):
            prev, row[j + 1] = row[j + 1], (prev + 1 if x == y else max(row[j + 1], row[j]))
    return row[-1]


def answer_tran(called: Sequence[str], gold: Sequence[str]) -> float:
    """LCS(called tool names, gold tool names) / max(len): the order agreement in [0, 1]."""
    if not called and not gold:
        return 1.0
    return _lcs(list(called), list(gold)) / max(len(called), len(gold))


def well_formed(turn_calls: Sequence[Sequence[Call]], final_answer: str | None) -> float:
    """1.0 when no call failed to parse and the last turn answers, else 0.0."""
    if any(isinstance(c, CallError) for calls in turn_calls for c in calls):
        return 0.0
    return 1.0 if final_answer is not None and turn_calls and not turn_calls[-1] else 0.0


def retrieval_parts(turn_calls: Sequence[Sequence[Call]], results: Sequence[str], final_answer: str | None,
                    unsolved_set, gold_calls) -> dict[str, float]:
    """{"info_recall", "answer_tran", "format", "retrieval"} of one trajectory."""
    called = [c.name for calls in turn_calls for c in calls if isinstance(c, ToolCall)]
    gold = [str(g["name"] if isinstance(g, Mapping) else g.name) for g in flatten_gold(gold_calls)]
    ir, at, fm = info_recall(results, unsolved_set or {}), answer_tran(called, gold), well_formed(turn_calls,
                                                                                              final_answer)
    return {"info_recall": ir, "answer_tran": at, "format": fm, "retrieval": ir * at + FORMAT_WEIGHT * fm}


def toolomni_advantages(retrieval_rewards, answer_rewards, answer_turn, info_recall_, answer_tran_, group_ids,
                        policy_mask, turn_ids, *, eps, num_groups, toolomni_gate):
    """The registered "toolomni" estimator. retrieval_rewards, answer_rewards [B]; answer_turn
    [B, K] (1.0 on the answer turn); info_recall_, answer_tran_ [B] (diagnostics only); group_ids
    [B]; policy_mask, turn_ids [B, N] -> {"advantages" [B, N], "toolomni/..." diagnostics}."""
    k = answer_turn.shape[1]
    on_answer = jnp.take_along_axis(answer_turn > 0, jnp.clip(turn_ids, 0, k - 1), axis=1) & (turn_ids >= 0)
    passed = retrieval_rewards >= toolomni_gate
    a_ret = group_normalize(retrieval_rewards, group_ids, num_groups=num_groups, ddof=1, eps=eps)
    a_ans = group_normalize(answer_rewards, group_ids, mask=passed, num_groups=num_groups, ddof=1, eps=eps)
    adv = jnp.where(on_answer, a_ans[:, None], a_ret[:, None])
    adv = jnp.where(policy_mask, adv, 0.0)
    n_pass = jnp.sum(passed)
    return {"advantages": adv,
            "toolomni/gate_pass_rate": jnp.mean(passed.astype(jnp.float32)),
            "toolomni/retrieval_reward_mean": jnp.mean(retrieval_rewards),
            "toolomni/info_recall_mean": jnp.mean(info_recall_),
            "toolomni/answer_tran_mean": jnp.mean(answer_tran_),
            "toolomni/answer_reward_passed_mean": jnp.sum(jnp.where(passed, answer_rewards, 0.0))
            / jnp.maximum(n_pass, 1),
            "toolomni/answer_token_frac": jnp.sum(on_answer & policy_mask) / jnp.maximum(policy_mask.sum(), 1)}


def _register() -> None:
    from turnsight_jax.rl.advantages import register_advantage

    # the knob "toolomni.gate" (the config section below) arrives as the keyword toolomni_gate
    register_advantage("toolomni", ("retrieval_rewards", "answer_rewards", "answer_turn", "info_recall",
                                    "answer_tran", "group_ids", "policy_mask", "turn_ids"),
                       ("eps", "num_groups", "toolomni.gate"))(toolomni_advantages)


_register()


# ---- registration ----
import numpy as np  # noqa: E402

from turnsight_jax.rewards import token_f1  # noqa: E402
from turnsight_jax.rl.config import section_settings  # noqa: E402
from turnsight_jax.rl.methods import (Method, register_config_section, register_method,  # noqa: E402
                                     register_reward)


@dataclasses.dataclass(frozen=True)
class ToolOmniConfig:
    """The run config's `toolomni.*` section."""

    gate: float = 0.95  # the retrieval reward R_ret from which a trajectory's answer turn trains (paper: 0.95)

    def validate(self) -> "ToolOmniConfig":
        if isinstance(self.gate, bool) or not isinstance(self.gate, (int, float)) or not math.isfinite(self.gate):
            raise ConfigError(f"toolomni.gate must be a finite number, got {self.gate!r}")
        return self


def _check_section(cfg, stages, check_data: bool) -> None:
    if any(m.name == "toolomni" for _, m in stages):
        section_settings(ToolOmniConfig, cfg.toolomni, "toolomni", "a ToolOmni")


register_config_section("toolomni", ToolOmniConfig, _check_section)


def _parts(traj, task) -> dict[str, float]:
    turns = traj.turns
    return retrieval_parts([t.calls for t in turns], [r for t in turns for r in t.results],
                           turns[-1].answer if turns else None, task.unsolved_set, task.gold_calls)


@register_reward("toolomni_retrieval", "retrieval_rewards", needs=("gold_calls",))
def toolomni_retrieval_reward(traj, task, algo) -> float:
    """ToolOmni's R_ret = InfoRecall x AnswerTran + 0.2 format."""
    return _parts(traj, task)["retrieval"]


@register_reward("toolomni_info_recall", "info_recall", needs=("gold_calls",))
def toolomni_info_recall(traj, task, algo) -> float:
    """R_ret's InfoRecall factor (reported, not optimised on its own)."""
    return _parts(traj, task)["info_recall"]


@register_reward("toolomni_answer_tran", "answer_tran", needs=("gold_calls",))
def toolomni_answer_tran(traj, task, algo) -> float:
    """R_ret's AnswerTran factor (reported, not optimised on its own)."""
    return _parts(traj, task)["answer_tran"]


@register_reward("toolomni_answer", "answer_rewards")
def toolomni_answer_reward(traj, task, algo) -> float:
    """ToolOmni's answer-stage reward: the token F1 of the parsed answer (0 without an answer turn)."""
    last = traj.turns[-1] if traj.turns else None
    return token_f1(last.answer, task.answer) if last is not None and not last.calls and last.answer is not None else 0.0


@register_reward("toolomni_answer_turn", "answer_turn", per="turn")
def toolomni_answer_turn(traj, task, algo) -> np.ndarray:
    """1.0 on the answer turn (the last turn, when it has no calls), 0 on the tool turns."""
    out = np.zeros(len(traj.turns), np.float32)
    if traj.turns and not traj.turns[-1].calls:
        out[-1] = 1.0
    return out


register_method(Method("toolomni", advantage="toolomni",
                       rewards=("toolomni_retrieval", "toolomni_answer", "toolomni_answer_turn", "toolomni_info_recall",
                                "toolomni_answer_tran"),
                       description="ToolOmni: tool turns and the answer turn normalised apart; R_ret gates the answer"))
