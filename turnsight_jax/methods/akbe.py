"""AKBE: when to call a tool, learned from a 2-bit label (docs/rollout_methods.md, "AKBE").

For every prompt the controller samples a with-tool group (the normal prompt, G rollouts) and a
no-tool group (the same task with its tool schemas removed from the prompt, G rollouts; any call
is refused: `NoToolEnvironment`). WT / NT: at least one rollout of the group is correct
(`correct`: the trajectory metric `correct` >= `correct_min`). The exemplar y* per quadrant
(WT, NT) (`choose_exemplar`):

  (1, 1)  the correct no-tool rollout with the fewest policy tokens: don't over-call
  (0, 1)  the correct no-tool rollout with the fewest policy tokens: tools hurt
  (1, 0)  the correct with-tool rollout with the fewest calls (ties: fewest policy tokens): a real
          knowledge gap
  (0, 0)  none
  (remaining ties: the earliest rollout)

The method that runs (GRPO, TurnSight, ...) trains on the with-tool group unchanged; the no-tool
rollouts enter the batch only as the exemplar, a row in no group (no advantage, no
policy-gradient loss), on its own no-tool prompt (what was sampled). The auxiliary loss
λ · CE(π_θ | y*) (`akbe_ce`, λ = akbe.coef) is a loss term with its own rows: the exemplar's
policy tokens, aggregated like loss.aggregation over the exemplars alone, so the RL terms'
normalisation is exactly as without them. The batch holds G + 1 rows per prompt (the with-tool
group, then the no-tool exemplar or a padding row).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from turnsight_jax import distributed
from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import Task
from turnsight_jax.envs.base import Environment, Episode, EpisodeScore, StepResult
from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.config import AlgoConfig, LossConfig
from turnsight_jax.rl.episodes import episode_policy, pad_prompt_rows, run_episodes
from turnsight_jax.rl.losses import register_loss_term
from turnsight_jax.rollout.driver import RolloutResult

NO_TOOL = "akbe_no_tool"  # Task.extra flag of a no-tool copy
EXEMPLAR = "akbe_exemplar"  # Trajectory.metrics flag (1.0) of the chosen exemplar; also its batch array
REFUSED = "refused_calls"  # Trajectory.metrics: calls a no-tool episode refused
NO_TOOL_CALLS = ("refuse", "end")
# What a refused call is answered with (akbe.no_tool_calls = "refuse").
REFUSAL = "Tools are not available for this question; answer it directly."
# The no-tool episodes' global rows start here (their sampling keys), after any with-tool row.
NO_TOOL_ROWS = 2**30
QUADRANTS = ((1, 1), (1, 0), (0, 1), (0, 0))


@dataclasses.dataclass(frozen=True)
class AkbeConfig:
    """The run config's akbe.* section (docs/rollout_methods.md, "AKBE"). coef: λ of the CE on
    the exemplar. correct: the trajectory metric that says a rollout is correct ("reward": the
    outcome reward); the default "answer_correct" is the environment's final-answer check, which
    a no-tool rollout can pass (Solve-F1, the built-in outcome, credits tool calls only, so no
    no-tool rollout would ever count as correct). correct_min: the value from which it is.
    no_tool_calls: a call in a no-tool rollout is answered with REFUSAL and the episode goes on
    ("refuse"), or ends the episode ("end"); never executed."""

    coef: float = 0.05
    correct: str = "answer_correct"
    correct_min: float = 1.0
    no_tool_calls: str = "refuse"

    def validate(self) -> "AkbeConfig":
        if isinstance(self.coef, bool) or not isinstance(self.coef, (int, float)) or not (
                math.isfinite(self.coef) and self.coef >= 0):
            raise ConfigError(f"akbe.coef must be a finite number >= 0, got {self.coef!r}")
        if not isinstance(self.correct, str) or not self.correct:
            raise ConfigError(f"akbe.correct must name a trajectory metric (or 'reward'), got {self.correct!r}")
        v = self.correct_min
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"akbe.correct_min must be a finite number, got {v!r}")
        if self.no_tool_calls not in NO_TOOL_CALLS:
            raise ConfigError(f"akbe.no_tool_calls must be one of {NO_TOOL_CALLS}, got {self.no_tool_calls!r}")
        return self


def akbe_settings(section) -> AkbeConfig:
    """The run config's `akbe` ConfigDict (or any mapping of its keys) -> a checked AkbeConfig."""
    fields = {f.name for f in dataclasses.fields(AkbeConfig)}
    unknown = sorted(set(section.keys()) - fields)
    if unknown:
        raise ConfigError(f"akbe.{unknown[0]} is not an AKBE key; keys: {', '.join(sorted(fields))}")
    return AkbeConfig(**dict(section.items())).validate()


# ---- the no-tool group ----

def no_tool_task(task: Task) -> Task:
    """The same task with no tool schema in its prompt (its episodes refuse every call)."""
    return dataclasses.replace(task, tools=(), extra={**task.extra, NO_TOOL: True})


class NoToolEpisode(Episode):
    """An episode of a no-tool task: a turn with calls is refused (never executed): each call
    answered with REFUSAL, or the episode ended (`mode`); a turn without calls, the score and
    the rest are the wrapped episode's. Its metrics gain REFUSED."""

    def __init__(self, inner: Episode, mode: str):
        self.inner, self.mode, self.task = inner, mode, inner.task
        self.refused = 0
        self._ended = False

    def step(self, calls) -> StepResult:
        if not calls:
            return self.inner.step(calls)
        self.refused += len(calls)
        if self.mode == "end":
            self._ended = True
            return StepResult(observations=(), done=True)
        return StepResult(observations=(REFUSAL,) * len(calls), done=False)

    def score(self, final_text: str | None = None) -> EpisodeScore:
        score = self.inner.score(final_text)
        return EpisodeScore(score.reward, {**score.metrics, REFUSED: float(self.refused)})

    def close(self) -> None:
        self.inner.close()

    @property
    def done(self) -> bool:
        return self._ended or self.inner.done


class NoToolEnvironment(Environment):
    """`env`, except that the episodes of no-tool tasks (`no_tool_task`) refuse every call."""

    def __init__(self, env: Environment, mode: str):
        self.env, self.mode, self.name = env, mode, env.name

    def start(self, task: Task, *, seed: int = 0) -> Episode:
        episode = self.env.start(task, seed=seed)
        return NoToolEpisode(episode, self.mode) if task.extra.get(NO_TOOL) else episode


# ---- the label and the exemplar ----

def correct(traj: Trajectory, cfg: AkbeConfig) -> bool:
    """The rollout is correct: its metric `cfg.correct` (or the outcome reward for "reward") is
    at least cfg.correct_min; a rollout without the metric (an environment error) is not."""
    value = traj.reward if cfg.correct == "reward" else traj.metrics.get(cfg.correct)
    return value is not None and float(value) >= cfg.correct_min


def num_calls(traj: Trajectory) -> int:
    """Call blocks the policy wrote (malformed ones included)."""
    return sum(len(t.calls) for t in traj.turns)


def choose_exemplar(with_tool: Sequence[Trajectory], no_tool: Sequence[Trajectory],
                    cfg: AkbeConfig) -> tuple[tuple[int, int], Trajectory | None]:
    """((WT, NT), y*) for one prompt's two groups (the module docstring's rule); y* is one of
    the given trajectories, or None in (0, 0)."""
    wt_ok = [(i, t) for i, t in enumerate(with_tool) if correct(t, cfg)]
    nt_ok = [(i, t) for i, t in enumerate(no_tool) if correct(t, cfg)]
    label = (int(bool(wt_ok)), int(bool(nt_ok)))
    if nt_ok:
        return label, min(nt_ok, key=lambda it: (int(it[1].policy_mask.sum()), it[0]))[1]
    if wt_ok:
        return label, min(wt_ok, key=lambda it: (num_calls(it[1]), int(it[1].policy_mask.sum()), it[0]))[1]
    return label, None


def akbe_rollout(ctx, tasks: Sequence[Task], seed: int, cfg: AkbeConfig, *, policy=episode_policy) -> RolloutResult:
    """AKBE's rollouts of `tasks` (the module docstring) in one batched call: G with-tool episodes
    per task (global rows (ctx.group_offset + i) * G + j, the default sampler's, so the with-tool
    group is the one rl.rollout=sampler would draw), then G no-tool episodes per task (rows
    NO_TOOL_ROWS + the same). Returns len(tasks) * (G + 1) rows: task i's with-tool group (group
    ctx.group_offset + i), then its no-tool exemplar (group -1) or a padding row; the exemplar,
    with-tool or no-tool, carries metrics[EXEMPLAR] = 1.0. RolloutResult.metrics (over every
    process): akbe/q11, akbe/q10, akbe/q01, akbe/q00 (prompts per quadrant), akbe/exemplars,
    akbe/exemplar_tokens_mean, akbe/exemplar_calls_mean (over the exemplars),
    akbe/no_tool_rollouts, akbe/no_tool_tokens (tokens after the prompt in the no-tool group),
    akbe/no_tool_correct, akbe/refused_calls. `policy`: rl.episodes.run_episodes'."""
    g, n = ctx.group_size, len(tasks)
    base = (ctx.group_offset * g + np.arange(n * g)).tolist()
    env = NoToolEnvironment(ctx.env, cfg.no_tool_calls)
    res = run_episodes(ctx, list(tasks) + [no_tool_task(t) for t in tasks], seed, group_size=g,
                       rows=base + [NO_TOOL_ROWS + r for r in base], env=env, policy=policy)
    trajs = res.trajectories
    with_tool, no_tool = trajs[:n * g], trajs[n * g:]
    if cfg.correct != "reward" and not any(cfg.correct in t.metrics for t in trajs):
        raise ConfigError(f"akbe.correct={cfg.correct!r}: no rollout has that metric; the environment's metrics are "
                          f"{sorted({k for t in trajs for k in t.metrics})} (or 'reward': the outcome)")
    counts = {q: 0 for q in QUADRANTS}
    blocks, lengths, calls = [], [], []
    for i in range(n):
        wt, nt = with_tool[i * g:(i + 1) * g], no_tool[i * g:(i + 1) * g]
        for t in nt:
            t.group_id = -1  # the no-tool rollouts train only as the exemplar
        label, exemplar = choose_exemplar(wt, nt, cfg)
        counts[label] += 1
        block = list(wt)
        if exemplar is not None:
            exemplar.metrics[EXEMPLAR] = 1.0
            lengths.append(int(exemplar.policy_mask.sum()))
            calls.append(num_calls(exemplar))
            if any(exemplar is t for t in nt):
                block.append(exemplar)
        blocks.append(block)
    metrics = distributed.summed({
        **{f"akbe/q{a}{b}": float(counts[(a, b)]) for a, b in QUADRANTS},
        "akbe/exemplars": float(len(lengths)),
        "akbe/exemplar_tokens": float(sum(lengths)),
        "akbe/exemplar_calls": float(sum(calls)),
        "akbe/no_tool_rollouts": float(len(no_tool)),
        "akbe/no_tool_tokens": float(sum(t.length - t.prompt_len for t in no_tool)),
        "akbe/no_tool_correct": float(sum(correct(t, cfg) for t in no_tool)),
        "akbe/refused_calls": float(sum(t.metrics.get(REFUSED, 0.0) for t in no_tool)),
    })
    n_ex = metrics["akbe/exemplars"]
    for key in ("akbe/exemplar_tokens", "akbe/exemplar_calls"):  # totals -> means over the exemplars
        metrics[key + "_mean"] = metrics.pop(key) / n_ex if n_ex else 0.0
    return RolloutResult(pad_prompt_rows(blocks, g + 1), res.stats, metrics=metrics)


def exemplar_flag(traj: Trajectory, task: Task, algo: AlgoConfig) -> float:
    """The registered reward "akbe_exemplar": 1.0 on the row of the prompt's exemplar."""
    return float(traj.metrics.get(EXEMPLAR, 0.0))


@register_loss_term("akbe_ce", ("logprobs", "pol_valid", EXEMPLAR), ("akbe_ce",), rows=EXEMPLAR)
def _akbe_ce_term(x, cfg: LossConfig, algo: AlgoConfig):
    """AKBE's auxiliary CE: λ · (−log π_θ) on the exemplars' policy tokens (its rows: the rows
    flagged akbe_exemplar, aggregated over them alone: rl.losses.loss_weights)."""
    mask = x["pol_valid"] & (x[EXEMPLAR] > 0)[:, None]
    nll = jnp.where(mask, -x["logprobs"], 0.0)
    return algo.section("akbe").coef * nll, {"akbe_ce": nll}


# ---- registration ----
from turnsight_jax.rl.methods import (  # noqa: E402
    RolloutContext, register_config_section, register_progress_metrics, register_reward, register_rollout, run_section,
    runs_controller)

register_config_section("akbe", AkbeConfig,
                        lambda cfg, stages, check_data: runs_controller(stages, "akbe") and akbe_settings(cfg.akbe))
register_reward(EXEMPLAR, EXEMPLAR)(exemplar_flag)


@register_rollout("akbe", rewards=(EXEMPLAR,), loss_terms=("akbe_ce",),
                  rows_per_prompt=lambda cfg: cfg.train.group_size + 1)
def akbe_controller(ctx: RolloutContext, tasks: Sequence[Task], seed: int) -> RolloutResult:
    """AKBE: a with-tool and a no-tool group per prompt, the 2-bit label, one exemplar per prompt for
    the auxiliary CE (akbe.coef) next to the method's unchanged update."""
    return akbe_rollout(ctx, tasks, seed, akbe_settings(run_section(ctx, "akbe")))

register_progress_metrics({"akbe/exemplars": "exemplars"})
