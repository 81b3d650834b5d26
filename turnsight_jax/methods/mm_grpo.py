"""MM-GRPO (OpenWebRL; docs/rollout_methods.md) as a rollout controller: `rl.rollout=mm_grpo` next to
any method (`rl.method=grpo`, or TurnSight over a base).

The controller (registered in rl.methods as "mm_grpo") changes what is sampled in two ways:

* **an observation window** (`mm_grpo.window = n`): when the policy generates a turn, its
  context shows the most recent n observations in full; every older one is replaced by a
  placeholder tool response (`mm_grpo.placeholder`). The rollout driver re-renders the context
  (rollout.driver.rollout, `window=`), the trajectory records what each turn saw
  (Trajectory.contexts), and the trainer scores every turn under that context
  (rl.context_rows: the student's rows and the teacher's hindsight views).
* **dynamic sampling** (`mm_grpo.refill_rounds = R`): after a round, the groups whose outcome
  rewards (the environment's score, `Trajectory.reward`) are all equal carry no GRPO signal; each
  such group's slot gets a new prompt, drawn from the training tasks, and is sampled again, for
  at most R rounds. A slot keeps the first group whose rewards differ; after R rounds a slot still
  without one keeps its last group (zero-variance, counted in `mm_grpo/zero_variance_kept`), so
  the batch always holds train.prompts_per_step groups of G.

The dry-run plan (`--dry-run`) sizes the training rows and the engine's KV reservation for the
window (`planned_extra`).

Refill draws: the step's refill stream is a permutation of the training tasks seeded by the
step's rollout seed; the i-th group dropped in a step (in slot order within a round, rounds in
order) gets refill index j = i and the task at position j of the stream. Its G rollouts draw as
the sampler's rows of group index prompts_per_step + j (rl.methods.sampler_rollout: the keys of
(seed, global row)), so a refill's tokens depend on (step, j) only, not on the round or the slot it
fills, nor on chunking. With several processes the dropped slots are numbered over all of them
(each process refills its own), so the batch is the one-process batch. A resumed run redraws the
same refills: everything depends on the step index.

The trajectory-broadcast advantage is GRPO's (each trajectory's group-normalised outcome on every
one of its tokens) and the asymmetric clip is loss.clip_eps (low) / loss.clip_eps_high (high):
configs/methods/mm_grpo.py sets them; the controller adds no reward or loss term.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from turnsight_jax import distributed
from turnsight_jax.chat import template as tmpl
from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import Task
from turnsight_jax.errors import ConfigError
from turnsight_jax.rollout.driver import ObservationWindow, RolloutResult, placeholder_suffix

PLACEHOLDER = "[earlier tool output omitted]"


@dataclasses.dataclass(frozen=True)
class MMGRPOSettings:
    """window: observations a turn's context keeps in full, the most recent ones (0: all; the
    paper keeps one screenshot). placeholder: the text of the tool response that replaces each
    older observation. refill_rounds: dynamic sampling's rounds of new prompts for zero-variance
    groups (0: off)."""

    window: int = 1
    placeholder: str = PLACEHOLDER
    refill_rounds: int = 3

    def observation_window(self, tokenizer, *, enable_thinking: bool,
                           template: str = "project") -> ObservationWindow | None:
        if self.window == 0:
            return None
        return ObservationWindow(self.window, placeholder_suffix(tokenizer, self.placeholder,
                                                                 enable_thinking=enable_thinking, template=template))


def mm_grpo_settings(node) -> MMGRPOSettings:
    """The run config's `mm_grpo` section -> MMGRPOSettings; a one-line ConfigError naming a bad key."""
    fields = {f.name for f in dataclasses.fields(MMGRPOSettings)}
    unknown = sorted(set(node.keys()) - fields)
    if unknown:
        raise ConfigError(f"mm_grpo.{unknown[0]} is not an MM-GRPO key; keys: {', '.join(sorted(fields))}")
    for key in ("window", "refill_rounds"):
        value = node[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"mm_grpo.{key} must be an int >= 0, got {value!r}")
    if not isinstance(node["placeholder"], str) or not node["placeholder"].strip():
        raise ConfigError(f"mm_grpo.placeholder must be a non-empty string, got {node['placeholder']!r}")
    return MMGRPOSettings(window=node["window"], placeholder=node["placeholder"], refill_rounds=node["refill_rounds"])


def check_method(settings: MMGRPOSettings, method) -> None:
    """ConfigError when the method (rl.methods.ResolvedMethod) reads something the observation
    window cannot give it: each of its turns must be scored under its own context, which the
    privileged views, Orchard's probe rows and the step-PRM's states do not do."""
    if settings.window == 0:
        return
    why = ("its privileged teacher views" if method.needs_views and method.teacher == "privileged" else
           "its retrospective probe rows" if method.uses("retrospective") else
           "its step-PRM's states" if method.uses("prm") else None)
    if why:
        raise ConfigError(f"rl.rollout=mm_grpo with mm_grpo.window={settings.window}: rl.method={method.name!r} reads "
                          f"{why} on the whole trajectory, not on each turn's windowed context; set "
                          f"mm_grpo.window=0 (no window) or choose another method")


def placeholder_tokens_bound(settings: MMGRPOSettings, *, enable_thinking: bool, template: str = "project") -> int:
    """The placeholder's tokens at most, without a tokenizer: the UTF-8 bytes of its rendered
    observation suffix (a byte-level BPE token, a control token too, spans at least one byte)."""
    return len(tmpl.observation_suffix([settings.placeholder], enable_thinking=enable_thinking,
                                       template=template).encode())


def planned_extra(cfg) -> tuple[int, int]:
    """For the dry-run plan (the controller's `plan_extra`): (KV slots per episode, tokens per
    training row) that MM-GRPO's window may need beyond prompt + max_response_tokens; (0, 0)
    without a window. A context holds at most max_turns - 1 - n placeholders more than its
    trajectory; a row (rl.context_rows) holds each response token at most n + 1 times, plus
    segment 0's placeholders."""
    settings = mm_grpo_settings(cfg.mm_grpo)
    n = settings.window
    if n == 0:
        return 0, 0
    r = cfg.rollout
    slack = max(0, r.max_turns - 1 - n) * placeholder_tokens_bound(
        settings, enable_thinking=r.enable_thinking, template=r.get("observation_template", "project"))
    return slack, slack + n * r.max_response_tokens


def zero_variance(group: Sequence[Trajectory]) -> bool:
    """Whether a group's outcome rewards are all equal (GRPO gives it zero advantage)."""
    rewards = [t.reward for t in group]
    return max(rewards) == min(rewards)


def refill_stream(seed: int, pool_size: int) -> np.ndarray:
    """The step's refill order: a permutation [pool_size] of the training tasks, from the step's
    rollout seed (refill j takes task stream[j % pool_size])."""
    return np.random.default_rng(np.random.SeedSequence([seed, 0x6D6D])).permutation(pool_size)


SampleFn = Callable[..., RolloutResult]  # (ctx, tasks, seed, window) -> RolloutResult


def dynamic_rollout(ctx, tasks: Sequence[Task], seed: int, *, sample: SampleFn,
                    settings: MMGRPOSettings | None = None) -> RolloutResult:
    """MM-GRPO's rollout (module docstring): `sample(ctx, tasks, seed, window)` rolls out G per
    task (rl.methods.sampler_rollout with a window); ctx: rl.methods.RolloutContext. Returns the
    slots' final groups in slot order, their tasks (RolloutResult.tasks, refills in their slots),
    the summed stats and the mm_grpo/* metrics (over every process)."""
    if settings is None:
        node = getattr(ctx.run_config, "mm_grpo", None) if ctx.run_config is not None else None
        settings = MMGRPOSettings() if node is None else mm_grpo_settings(node)
    g = ctx.group_size
    window = settings.observation_window(ctx.tokenizer, enable_thinking=ctx.config.enable_thinking,
                                         template=ctx.config.observation_template)
    res = sample(ctx, tasks, seed, window)
    stats = dict(res.stats)
    slots = [res.trajectories[i * g:(i + 1) * g] for i in range(len(tasks))]
    slot_tasks = list(tasks)
    # every process's slots, in global order: (first slot, count) per process
    firsts = distributed.gather(ctx.group_offset).reshape(-1)
    counts = distributed.gather(len(tasks)).reshape(-1)
    total = int(counts.sum())
    stream = None
    refilled = rounds = 0  # global counts: refill indices used, rounds run
    for _ in range(settings.refill_rounds):
        flat = [i for i, grp in enumerate(slots) if zero_variance(grp)]
        per_process = distributed.gather(len(flat)).reshape(-1)
        if per_process.sum() == 0:
            break
        if not ctx.task_pool:
            raise ValueError("mm_grpo: dynamic sampling draws new prompts from the training tasks, but the rollout "
                             "context has none (RolloutContext.task_pool)")
        if stream is None:
            stream = refill_stream(seed, len(ctx.task_pool))
        # this process's dropped slots are numbered after those of the processes before it
        first = refilled + int(np.sum(per_process[firsts < ctx.group_offset]))
        if flat:
            new = [ctx.task_pool[int(stream[(first + i) % stream.size])] for i in range(len(flat))]
            if hasattr(ctx.progress, "total"):  # the step's progress line counts the refills too
                ctx.progress.total += len(flat) * g
            sub = sample(dataclasses.replace(ctx, group_offset=total + first), new, seed, window)
            for k, v in sub.stats.items():
                stats[k] = stats.get(k, 0.0) + v if k != "compilations" else v
            for i, slot in enumerate(flat):
                slots[slot] = sub.trajectories[i * g:(i + 1) * g]
                slot_tasks[slot] = new[i]
        refilled += int(per_process.sum())
        rounds += 1
    kept_flat = sum(zero_variance(grp) for grp in slots)
    local = np.array([kept_flat, stats.get("elided_observations", 0.0), stats.get("reprefill_tokens", 0.0)],
                     np.float64)
    kept_flat, elided, reprefill = distributed.gather(local).sum(axis=0).tolist()
    metrics = {"mm_grpo/dropped_groups": float(refilled), "mm_grpo/refill_rounds": float(rounds),
               "mm_grpo/extra_rollouts": float(refilled * g), "mm_grpo/zero_variance_kept": kept_flat,
               "mm_grpo/elided_observations": elided, "mm_grpo/reprefill_tokens": reprefill}
    trajs = [t for grp in slots for t in grp]
    return RolloutResult(trajs, stats, tasks=slot_tasks, metrics=metrics)


# ---- registration ----
from turnsight_jax.rl.methods import (  # noqa: E402
    RolloutContext, register_config_section, register_progress_metrics, register_rollout, sampler_rollout)


def _check_section(cfg, stages, check_data: bool) -> None:
    """MM-GRPO's keys; the window needs every turn scored under its own context."""
    settings = mm_grpo_settings(cfg.mm_grpo)
    for _, method in stages:
        if method.rollout.name == "mm_grpo":
            check_method(settings, method)


register_config_section("mm_grpo", MMGRPOSettings, _check_section)


@register_rollout("mm_grpo", plan_extra=planned_extra)
def mm_grpo_rollout(ctx: RolloutContext, tasks: Sequence[Task], seed: int) -> RolloutResult:
    """MM-GRPO: the default sampler under an observation window (mm_grpo.window), with dynamic
    sampling (zero-variance groups refilled with new prompts, mm_grpo.refill_rounds)."""
    return dynamic_rollout(ctx, tasks, seed, sample=lambda c, t, s, w: sampler_rollout(c, t, s, window=w))

register_progress_metrics({"mm_grpo/dropped_groups": "dropped", "mm_grpo/elided_observations": "elided"})
