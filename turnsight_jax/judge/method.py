"""The model-judged reward's pieces (OpenWebRL; docs/signal_methods.md), registered as
`rl.method=judge` at the end of this module:

* `judge_rollout`, behind the rollout controller `judged`: the default sampler's rollouts, then
  the judge (`judge.*`) labels every trajectory; each trajectory's `metrics` records the label,
  whether the output was malformed, the judge's tokens and the verifier's success (the
  environment's own reward >= `judge.verifier_threshold`). `Trajectory.reward` is left as it is.
* `REWARDS`: `judge` fills the batch's `rewards` [B] with the label (0/1), so GRPO's advantage is
  computed on the judge, not on the verifier; `judge_verifier`, `judge_malformed`, `judge_tokens`
  and `judge_judged` fill arrays [B] the estimator reports from.
* the advantage estimator `judge_grpo` (registered here): GRPO's on the labels, plus the
  diagnostics `judge/agreement` (label == verifier success), `judge/positive_rate`,
  `judge/false_positive_rate` (label 1, verifier 0: what a hacked judge shows),
  `judge/false_negative_rate`, `judge/malformed_rate`, `judge/verifier_success_rate`,
  `judge/labelled` (trajectories judged) and `judge/generated_tokens` (the judge's decode cost),
  over the whole batch (every process's rows).
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp

from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import Task
from turnsight_jax.judge.model import cached_judge
from turnsight_jax.judge.settings import judge_settings
from turnsight_jax.rl.advantages import grpo_advantages, register_advantage

# The per-trajectory record the controller writes into Trajectory.metrics.
LABEL, MALFORMED, TOKENS, VERIFIER = "judge_label", "judge_malformed", "judge_generated_tokens", "judge_verifier_success"
ESTIMATOR = "judge_grpo"


def record_judgments(trajs, judgments, verifier_threshold: float) -> None:
    """Write each judgment into its trajectory's metrics (floats, as the rest of them)."""
    for traj, j in zip(trajs, judgments, strict=True):
        traj.metrics[LABEL] = float(j.label)
        traj.metrics[MALFORMED] = float(j.verdict.malformed)
        traj.metrics[TOKENS] = float(j.generated_tokens)
        traj.metrics[VERIFIER] = float(traj.reward >= verifier_threshold)


def judge_rollout(ctx, res, tasks: Sequence[Task]):
    """Label the trajectories of `res` (a RolloutResult of `tasks`, ctx.group_size rows each) with
    the `judge.checkpoint` model (loaded once per process); `ctx` is the controller's
    RolloutContext, whose `run_config` holds the judge section. Returns `res`, its stats with
    `judge_s` and `judge_tokens` added."""
    if ctx.run_config is None or "judge" not in ctx.run_config:
        raise ValueError("the 'judged' rollout controller needs the run config's judge section "
                         "(RolloutContext.run_config)")
    settings = judge_settings(ctx.run_config.judge, need_checkpoint=True)
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


def judge_reward(traj: Trajectory, task: Task, algo) -> float:
    """The judge's label, 0 or 1 (judge.default_label when its output was malformed)."""
    return _recorded(traj, LABEL)


def verifier_success(traj: Trajectory, task: Task, algo) -> float:
    """1.0 when the environment's reward reached judge.verifier_threshold (measured, not trained on)."""
    return _recorded(traj, VERIFIER)


def malformed(traj: Trajectory, task: Task, algo) -> float:
    """1.0 when the judge's output was malformed (its label is then the default)."""
    return _recorded(traj, MALFORMED)


def generated_tokens(traj: Trajectory, task: Task, algo) -> float:
    """The tokens the judge generated for this trajectory (its cost)."""
    return _recorded(traj, TOKENS)


def judged(traj: Trajectory, task: Task, algo) -> float:
    """1.0 when the trajectory was judged (`judge/labelled` counts them)."""
    return float(LABEL in traj.metrics)


# (reward name, the batch array it fills, fn), registered in this order at the end of this module.
REWARDS = (("judge", "rewards", judge_reward), ("judge_verifier", "judge_verifier", verifier_success),
           ("judge_malformed", "judge_malformed", malformed), ("judge_tokens", "judge_tokens", generated_tokens),
           ("judge_judged", "judge_judged", judged))


def judge_advantages(rewards, verifier, malformed_, tokens, judged_, group_ids, policy_mask, *, eps, num_groups):
    """The registered "judge_grpo" estimator: rewards (the judge's labels), verifier (success
    0/1), malformed_ (0/1), tokens (judge tokens generated), judged_ (1 per judged row), all [B]
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
            "judge/malformed_rate": mean(malformed_ > 0.5),
            "judge/labelled": jnp.sum(judged_),
            "judge/generated_tokens": jnp.sum(tokens)}


register_advantage(ESTIMATOR, tuple(out for _, out, _ in REWARDS) + ("group_ids", "policy_mask"),
                   ("eps", "num_groups"))(judge_advantages)


# ---- registration ----
from turnsight_jax.rl.methods import (Method, RolloutContext, register_config_section, register_method,  # noqa: E402
                                     register_reward, register_rollout, runs_controller, sampler_rollout, register_progress_metrics)
from turnsight_jax.judge.settings import JudgeSettings  # noqa: E402

# the judge's keys; its folder must exist when a stage judges (not for a dry run's plan)
register_config_section("judge", JudgeSettings, lambda cfg, stages, check_data: judge_settings(
    cfg.judge, need_checkpoint=check_data and runs_controller(stages, "judged")))

for _name, _output, _fn in REWARDS:
    register_reward(_name, _output)(_fn)


@register_rollout("judged")
def judged_rollout(ctx: RolloutContext, tasks, seed: int):
    """The default sampler's rollouts, each labelled by the judge model of the run config's judge.*
    section (ctx.run_config)."""
    return judge_rollout(ctx, sampler_rollout(ctx, tasks, seed), tasks)


register_method(Method("judge", advantage=ESTIMATOR, rewards=tuple(r[0] for r in REWARDS), rollout="judged",
                       description="OpenWebRL: a judge model's (rationale, 0/1) label as the reward, group-normalised"))

register_progress_metrics({"judge/agreement": "judge_agree"})
