"""The model-judged reward as a method (OpenWebRL; docs/signal_methods.md): `rl.method=judge`.

* rollout controller `judged`: the default sampler's rollouts, then the judge (`judge.*`) labels
  every trajectory; each trajectory's `metrics` records the label, whether the output was
  malformed, the judge's tokens and the verifier's success (the environment's own reward >=
  `judge.verifier_threshold`). The environment's reward (`Trajectory.reward`) is left as it is.
* rewards: `judge` fills the batch's `rewards` [B] with the label (0/1), so GRPO's advantage is
  computed on the judge, not on the verifier; `judge_verifier`, `judge_malformed`,
  `judge_tokens` and `judge_judged` fill arrays [B] the estimator reports from.
* advantage `judge_grpo`: GRPO's on the judge's label, plus the diagnostics `judge/agreement`
  (label == verifier success), `judge/positive_rate`, `judge/false_positive_rate` (label 1,
  verifier 0: what a hacked judge shows), `judge/false_negative_rate`, `judge/malformed_rate`,
  `judge/verifier_success_rate`, `judge/labelled` (trajectories judged) and
  `judge/generated_tokens` (the judge's decode cost, summed over the batch); over the whole batch
  (every process's rows).

Registered when turnsight_jax.rl.methods is imported (its last line imports this module).
"""

from __future__ import annotations

import jax.numpy as jnp

from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import Task
from turnsight_jax.judge.model import cached_judge
from turnsight_jax.judge.settings import judge_settings
from turnsight_jax.rl.advantages import grpo_advantages, register_advantage
from turnsight_jax.rl.config import AlgoConfig
from turnsight_jax.rl.methods import (METHODS, Method, RolloutContext, register_method, register_reward,
                                      register_rollout, sampler_rollout)
from turnsight_jax.rollout.driver import RolloutResult

# The per-trajectory record the controller writes into Trajectory.metrics.
LABEL, MALFORMED, TOKENS, VERIFIER = "judge_label", "judge_malformed", "judge_generated_tokens", "judge_verifier_success"


def record_judgments(trajs, judgments, verifier_threshold: float) -> None:
    """Write each judgment into its trajectory's metrics (floats, as the rest of them)."""
    for traj, j in zip(trajs, judgments, strict=True):
        traj.metrics[LABEL] = float(j.label)
        traj.metrics[MALFORMED] = float(j.verdict.malformed)
        traj.metrics[TOKENS] = float(j.generated_tokens)
        traj.metrics[VERIFIER] = float(traj.reward >= verifier_threshold)


def judged_rollout(ctx: RolloutContext, tasks, seed: int) -> RolloutResult:
    """The sampler's rollouts, each judged by the `judge.checkpoint` model (loaded once)."""
    if ctx.run_config is None or "judge" not in ctx.run_config:
        raise ValueError("the 'judged' rollout controller needs the run config's judge section "
                         "(RolloutContext.run_config)")
    settings = judge_settings(ctx.run_config.judge, need_checkpoint=True)
    res = sampler_rollout(ctx, tasks, seed)
    judge = cached_judge(settings, ctx.mesh)
    row_tasks = [t for t in tasks for _ in range(ctx.group_size)]
    before = judge.seconds
    judgments = judge.judge_trajectories(res.trajectories, row_tasks)
    record_judgments(res.trajectories, judgments, settings.verifier_threshold)
    res.stats["judge_s"] = res.stats.get("judge_s", 0.0) + judge.seconds - before
    res.stats["judge_tokens"] = res.stats.get("judge_tokens", 0.0) + sum(j.generated_tokens for j in judgments)
    return res


def _recorded(traj: Trajectory, key: str) -> float:
    if key not in traj.metrics:
        raise ValueError(f"trajectory {traj.task_id!r} has no judgment ({key}): the judge's rewards need the "
                         f"'judged' rollout controller (rl.method=judge, or a method over rl.base=judge)")
    return float(traj.metrics[key])


def judge_reward(traj: Trajectory, task: Task, algo: AlgoConfig) -> float:
    """The judge's label, 0 or 1 (judge.default_label when its output was malformed)."""
    return _recorded(traj, LABEL)


def judge_advantages(rewards, verifier, malformed, tokens, judged, group_ids, policy_mask, *, eps, num_groups):
    """The registered "judge_grpo" estimator: rewards (the judge's labels), verifier (success
    0/1), malformed (0/1), tokens (judge tokens generated), judged (1 per judged row), all [B]
    float32; group_ids [B]; policy_mask [B, N] -> {"advantages" [B, N] (GRPO's on the labels),
    "judge/..." diagnostics (scalars)}."""
    label, ok = rewards > 0.5, verifier > 0.5
    mean = lambda x: jnp.mean(x.astype(jnp.float32))  # noqa: E731
    return {"advantages": grpo_advantages(rewards, group_ids, policy_mask, eps=eps, num_groups=num_groups),
            "judge/agreement": mean(label == ok),
            "judge/positive_rate": mean(label),
            "judge/false_positive_rate": mean(label & ~ok),
            "judge/false_negative_rate": mean(~label & ok),
            "judge/verifier_success_rate": mean(ok),
            "judge/malformed_rate": mean(malformed > 0.5),
            "judge/labelled": jnp.sum(judged),
            "judge/generated_tokens": jnp.sum(tokens)}


def register() -> None:
    """Register the controller, the rewards, the estimator and the method (once)."""
    if "judge" in METHODS:
        return
    register_rollout("judged")(judged_rollout)
    register_reward("judge", "rewards")(judge_reward)
    register_reward("judge_verifier", "judge_verifier")(lambda traj, task, algo: _recorded(traj, VERIFIER))
    register_reward("judge_malformed", "judge_malformed")(lambda traj, task, algo: _recorded(traj, MALFORMED))
    register_reward("judge_tokens", "judge_tokens")(lambda traj, task, algo: _recorded(traj, TOKENS))
    register_reward("judge_judged", "judge_judged")(lambda traj, task, algo: float(LABEL in traj.metrics))
    register_advantage("judge_grpo", ("rewards", "judge_verifier", "judge_malformed", "judge_tokens", "judge_judged",
                                      "group_ids", "policy_mask"), ("eps", "num_groups"))(judge_advantages)
    register_method(Method("judge", advantage="judge_grpo",
                           rewards=("judge", "judge_verifier", "judge_malformed", "judge_tokens", "judge_judged"),
                           rollout="judged",
                           description="OpenWebRL: a judge model's (rationale, 0/1) label as the reward, "
                                       "group-normalised"))


register()
