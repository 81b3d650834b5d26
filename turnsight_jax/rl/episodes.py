"""Running a rollout controller's episodes: the sampling policy of a RolloutContext
(`episode_policy`), batched calls with a stable numbering of the episodes (`run_episodes`), and
the prompt blocks of a controller that forms its own groups (`pad_prompt_rows`;
rl.methods.RolloutController). A leaf of rl.methods, so a controller module (methods.bar, methods.akbe)
imports these without the registries."""

from __future__ import annotations

import contextlib
from typing import Sequence

import jax
import numpy as np

from turnsight_jax.chat.trajectory import Trajectory, padding_trajectory
from turnsight_jax.chat.types import Task
from turnsight_jax.rollout.driver import ModelPolicy, ObservationWindow, RolloutResult, rollout
from turnsight_jax.rollout.engine import PagedEngine


def pad_prompt_rows(blocks: Sequence[Sequence[Trajectory]], rows: int) -> list[Trajectory]:
    """The batch rows of a controller that forms its own groups: each prompt's trajectories
    (`blocks[i]`, at least one) then padding rows (chat.trajectory.padding_trajectory) up to
    `rows`; ValueError when a prompt has more than `rows`."""
    out = []
    for i, block in enumerate(blocks):
        if not block or len(block) > rows:
            raise ValueError(f"prompt {i}: {len(block)} rows, expected 1 .. {rows} (the controller's rows per prompt)")
        out.extend(block)
        out.extend(padding_trajectory(block[0]) for _ in range(rows - len(block)))
    return out


def episode_policy(ctx, seed: int, rows, window: ObservationWindow | None = None):
    """The sampling policy of `ctx`: the paged engine (`ctx.engine`: continuous batching over its
    slots) or the lockstep `ModelPolicy` (its static cache holds one call's rows). Episode r draws
    from fold_in(key(seed), its global row): rows[r], or rows + r for an int. `window`: the
    backend holds the slack an observation window's contexts need (ObservationWindow.slack)."""
    kwargs = {} if ctx.cache_dtype is None else {"cache_dtype": ctx.cache_dtype}
    if window is not None:
        kwargs["context_slack"] = window.slack(ctx.config.max_turns)
    if ctx.engine is not None:
        return PagedEngine(ctx.graphdef, ctx.params, ctx.tokenizer, sampling=ctx.sampling, config=ctx.config,
                           engine=ctx.engine, seed=seed, mesh=ctx.mesh, row_offset=rows, **kwargs)
    return ModelPolicy(ctx.graphdef, ctx.params, ctx.tokenizer, sampling=ctx.sampling, config=ctx.config, seed=seed,
                       row_offset=rows, **kwargs)


def run_episodes(ctx, tasks: Sequence[Task], seed: int, *, group_size: int | None = None,
                 rows: Sequence[int] | None = None, env=None, policy=episode_policy,
                 window: ObservationWindow | None = None, hooks=None) -> RolloutResult:
    """`group_size` (default ctx.group_size) episodes of each task, `ctx.prompts_per_chunk`
    prompts per batched call (0: all), the calls' trajectories and stats joined. Episode j of task
    i is trajectory i*group_size + j, in group ctx.group_offset + i.

    rows: the global row of each episode (len(tasks) * group_size ids), which alone (with the
    seed) sets its draws and its environment's seed; default (ctx.group_offset + i) * group_size
    + j, the fixed layout's. A controller numbering its own episodes (e.g. prompt * cap + k) gets
    the same tokens for an episode whatever call or batch it runs in. env: default ctx.env.
    policy(ctx, seed, rows of one call) -> the backend (`episode_policy`; tests pass a scripted one).
    window: an observation window (rollout.driver.rollout; methods.mm_grpo). hooks:
    rollout.control.RolloutHooks of the rollout (one call: ctx.prompts_per_chunk must not split
    the tasks, the hooks' prompt indices being the call's)."""
    g = ctx.group_size if group_size is None else group_size
    if rows is None:
        rows = ctx.group_offset * g + np.arange(len(tasks) * g)
    rows = np.asarray(rows, np.int64)
    if rows.shape != (len(tasks) * g,):
        raise ValueError(f"run_episodes: {rows.shape} rows for {len(tasks)} tasks x {g} episodes")
    per = ctx.prompts_per_chunk or max(len(tasks), 1)
    if hooks is not None and per < len(tasks):
        raise ValueError(f"run_episodes: rollout hooks serve one call; {len(tasks)} tasks in chunks of {per}")
    trajs, stats = [], {}
    for i in range(0, len(tasks), per):
        part = rows[i * g:(i + per) * g]
        backend = policy(ctx, seed, part) if window is None else policy(ctx, seed, part, window)
        with jax.set_mesh(ctx.mesh) if ctx.mesh is not None else contextlib.nullcontext():
            res = rollout(backend, ctx.env if env is None else env, tasks[i:i + per], tokenizer=ctx.tokenizer,
                          group_size=g, config=ctx.config, seed=seed, group_offset=ctx.group_offset + i,
                          progress=ctx.progress, row_ids=part, window=window, hooks=hooks)
        trajs.extend(res.trajectories)
        for k, v in res.stats.items():
            stats[k] = stats.get(k, 0.0) + v if k != "compilations" else v
    return RolloutResult(trajs, stats)
