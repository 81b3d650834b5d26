"""BAR, Orchard's adaptive group sampling (docs/rollout_methods.md, "BAR"): sample a prompt's
rollouts s at a time and stop as soon as its running success share lies in a band.

For every prompt, round j samples rollouts j*s .. j*s+s-1. After each round the prompt's
success share ρ = successes / rollouts so far (success: outcome reward >= `success`) is
checked: ρ in [low, high] stops the prompt (its group is what it has); otherwise it continues
until it holds `cap` rollouts. At the cap a mixed group (ρ outside the band, but not all equal)
is kept; an all-success or all-failure group falls back (`fallback`): "keep" trains on the cap's
rollouts as a group (GRPO's advantages are then 0), "drop" leaves the prompt out of the batch
(padding rows). Each round is one batched call over the prompts still open. Rollout k of the
prompt with global index p is episode p * cap + k of the step (its draws and its environment
seed; rl.episodes.run_episodes), so what a prompt samples never depends on the other prompts or
on how the step is split over processes.

The batch holds `cap` rows per prompt (rl.methods.RolloutController.rows_per_prompt): the group,
then padding rows in no group.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from turnsight_jax import distributed
from turnsight_jax.chat.trajectory import Trajectory, padding_trajectory
from turnsight_jax.chat.types import Task
from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.episodes import episode_policy, pad_prompt_rows, run_episodes
from turnsight_jax.rollout.driver import RolloutResult

FALLBACKS = ("keep", "drop")
# What ended a prompt's sampling (`decide`)
CONTINUE, IN_BAND, CAP_MIXED, FALLBACK = "continue", "in_band", "cap_mixed", "fallback"


@dataclasses.dataclass(frozen=True)
class BarConfig:
    """The run config's bar.* section (docs/rollout_methods.md, "BAR"). chunk: s, rollouts per
    prompt per round. cap: the most rollouts of a prompt, a multiple of chunk (0, the default:
    train.group_size, which `bar_settings` puts in its place; `validate` needs it resolved). low / high: the band of the success share that stops a prompt. success:
    the outcome reward from which a rollout is a success. fallback: a group still all-success or
    all-failure at the cap is kept ("keep") or left out of the batch ("drop")."""

    chunk: int = 4
    cap: int = 0
    low: float = 0.375
    high: float = 0.625
    success: float = 1.0
    fallback: str = "keep"

    def validate(self) -> "BarConfig":
        for key in ("chunk", "cap"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"bar.{key} must be an int >= 1, got {v!r}")
        if self.cap % self.chunk:
            raise ConfigError(f"bar.cap={self.cap} must be a multiple of bar.chunk={self.chunk} (whole rounds)")
        for key in ("low", "high", "success"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"bar.{key} must be a finite number, got {v!r}")
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise ConfigError(f"bar.low={self.low} and bar.high={self.high} must satisfy 0 <= low <= high <= 1")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"bar.fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        return self


def bar_settings(section, group_size: int) -> BarConfig:
    """The run config's `bar` ConfigDict (or any mapping of its keys) -> a checked BarConfig; a
    cap of 0 becomes `group_size` (train.group_size)."""
    fields = {f.name for f in dataclasses.fields(BarConfig)}
    unknown = sorted(set(section.keys()) - fields)
    if unknown:
        raise ConfigError(f"bar.{unknown[0]} is not a BAR key; keys: {', '.join(sorted(fields))}")
    values = dict(section.items())
    if values.get("cap", 0) == 0 and not isinstance(values.get("cap"), bool):
        values["cap"] = group_size
    return BarConfig(**values).validate()


def decide(successes: int, n: int, cfg: BarConfig) -> str:
    """What a prompt does after `n` rollouts (a whole number of rounds), `successes` of them
    successful: IN_BAND (ρ = successes / n in [low, high]: stop), CONTINUE (below the cap),
    CAP_MIXED (at the cap, mixed but outside the band: kept), FALLBACK (at the cap, all equal)."""
    if cfg.low <= successes / n <= cfg.high:
        return IN_BAND
    if n < cfg.cap:
        return CONTINUE
    return FALLBACK if successes in (0, n) else CAP_MIXED


def bar_rollout(ctx, tasks: Sequence[Task], seed: int, cfg: BarConfig, *, policy=episode_policy) -> RolloutResult:
    """BAR's rollouts of `tasks` (the module docstring): len(tasks) * cfg.cap rows, prompt i's
    group (group id ctx.group_offset + i) first in its block, padding after. Each trajectory's
    metrics gain "bar_round" (the round that sampled it). RolloutResult.metrics (counts over every
    process): bar/prompts, bar/rollouts, bar/rounds (summed over prompts), bar/early_stops
    (prompts stopped below the cap), bar/in_band, bar/cap_mixed, bar/fallbacks, bar/dropped,
    bar/rows_in_groups, and bar/group_size_mean (over the groups kept). `policy`:
    rl.episodes.run_episodes'."""
    s, cap = cfg.chunk, cfg.cap
    sampled: list[list[Trajectory]] = [[] for _ in tasks]
    ended: dict[int, str] = {}
    open_ = list(range(len(tasks)))
    stats: dict[str, float] = {}
    j = 0
    while open_:
        rows = [(ctx.group_offset + i) * cap + j * s + k for i in open_ for k in range(s)]
        res = run_episodes(ctx, [tasks[i] for i in open_], seed, group_size=s, rows=rows, policy=policy)
        for key, v in res.stats.items():
            stats[key] = stats.get(key, 0.0) + v if key != "compilations" else v
        still = []
        for slot, i in enumerate(open_):
            for t in res.trajectories[slot * s:(slot + 1) * s]:
                t.group_id = ctx.group_offset + i  # run_episodes numbered the open prompts, not the step's
                t.metrics["bar_round"] = float(j)
                sampled[i].append(t)
            n = len(sampled[i])
            verdict = decide(sum(t.reward >= cfg.success for t in sampled[i]), n, cfg)
            if verdict == CONTINUE:
                still.append(i)
            else:
                ended[i] = verdict
        open_ = still
        j += 1
    blocks = []
    for i, group in enumerate(sampled):
        drop = ended[i] == FALLBACK and cfg.fallback == "drop"
        blocks.append([padding_trajectory(group[0])] if drop else group)
    kept = [len(b) for i, b in enumerate(blocks) if not (ended[i] == FALLBACK and cfg.fallback == "drop")]
    verdicts = list(ended.values())
    metrics = distributed.summed({
        "bar/prompts": float(len(tasks)),
        "bar/rollouts": float(sum(len(g) for g in sampled)),
        "bar/rounds": float(sum(len(g) // s for g in sampled)),
        "bar/early_stops": float(sum(len(g) < cap for g in sampled)),
        "bar/in_band": float(verdicts.count(IN_BAND)),
        "bar/cap_mixed": float(verdicts.count(CAP_MIXED)),
        "bar/fallbacks": float(verdicts.count(FALLBACK)),
        "bar/dropped": float(len(tasks) - len(kept)),
        "bar/rows_in_groups": float(sum(kept)),
    })
    groups = metrics["bar/prompts"] - metrics["bar/dropped"]
    metrics["bar/group_size_mean"] = metrics["bar/rows_in_groups"] / groups if groups else 0.0
    return RolloutResult(pad_prompt_rows(blocks, cap), stats, metrics=metrics)


# ---- registration ----
from turnsight_jax.rl.methods import (  # noqa: E402
    RolloutContext, register_config_section, register_progress_metrics, register_rollout, run_section, runs_controller)


def _check_section(cfg, stages, check_data: bool) -> None:
    if runs_controller(stages, "bar"):
        bar_settings(cfg.bar, cfg.train.group_size)


register_config_section("bar", BarConfig, _check_section)


@register_rollout("bar", rows_per_prompt=lambda cfg: bar_settings(cfg.bar, cfg.train.group_size).cap,
                  episodes_per_call=lambda cfg: bar_settings(cfg.bar, cfg.train.group_size).chunk)
def bar_controller(ctx: RolloutContext, tasks: Sequence[Task], seed: int) -> RolloutResult:
    """BAR: each prompt sampled bar.chunk rollouts at a time until its success share lies in
    [bar.low, bar.high], or bar.cap rollouts; groups of unequal size, padded to the cap."""
    return bar_rollout(ctx, tasks, seed, bar_settings(run_section(ctx, "bar"), ctx.group_size))

register_progress_metrics({"bar/group_size_mean": "group"})
