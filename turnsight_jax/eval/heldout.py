"""Held-out evaluation during training: per-task Solve-F1 of the policy, sampled or greedy.

A thin layer over the evaluation runner (`eval.runner.run_batches`, the seeding contract shared
with `python -m turnsight_jax.evaluate`): it builds the run's `ModelPolicy` per batch and
summarises the per-task metrics (`summarise_tasks`, also used by the command line).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import ml_collections as mlc
import numpy as np

from turnsight_jax.chat.types import Task
from turnsight_jax.config import eval_sampling, rollout_config
from turnsight_jax.eval.runner import describe_sampling, mean_metrics, run_batches
from turnsight_jax.model_setup import DTYPES
from turnsight_jax.rollout.driver import ModelPolicy, ProgressCallback

SUMMARY_KEYS = ("solve_f1", "solve_p", "solve_r", "answer_correct", "num_turns")


def summarise_tasks(per_task: Sequence[Mapping[str, float]], mode: str) -> dict[str, Any]:
    """{n, mode, <key>, <key>_se for SUMMARY_KEYS present, per_task_solve_f1}: means over tasks
    (each task's metrics already averaged over its samples) and their standard errors."""
    out: dict[str, Any] = {"n": len(per_task), "mode": mode}
    for key in SUMMARY_KEYS:
        vals = np.array([m.get(key, np.nan) for m in per_task], np.float64)
        vals = vals[np.isfinite(vals)]
        if vals.size:
            out[key] = float(vals.mean())
            out[key + "_se"] = float(vals.std(ddof=1) / math.sqrt(vals.size)) if vals.size > 1 else 0.0
    out["per_task_solve_f1"] = [float(m.get("solve_f1", 0.0)) for m in per_task]
    return out


def evaluate_policy(graphdef, state, tok, tasks: Sequence[Task], cfg: mlc.ConfigDict, env, *,
                    greedy: bool | None = None, progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Held-out rollouts: per-task Solve-F1 and means with standard errors.

    Greedy (argmax) when `cfg.eval.temperature` is 0 or `greedy=True`; otherwise `cfg.eval.samples`
    rollouts per task at that temperature (top-k/top-p from cfg.eval), each task's metrics averaged
    over its samples: the expected Solve-F1 of the sampled policy, the quantity RL maximises. The
    sampling seed is fixed (cfg.seed), so evaluations before and after training share their random
    numbers (a lower-variance paired difference). Batches of cfg.eval.batch_size rollouts."""
    greedy = cfg.eval.temperature <= 0 if greedy is None else greedy
    samples = 1 if greedy else int(cfg.eval.samples)
    sampling = eval_sampling(cfg, greedy=greedy)
    rc = rollout_config(cfg, max_turns=cfg.eval.max_turns)
    per_task, _ = run_batches(
        lambda chunk, g, seed: ModelPolicy(graphdef, state, tok, sampling=sampling, config=rc, seed=seed,
                                           cache_dtype=DTYPES[cfg.model.compute_dtype]),
        env, tasks, tokenizer=tok, config=rc, group_size=samples, batch_size=cfg.eval.batch_size, seed=cfg.seed,
        progress=progress)
    mode = describe_sampling(0.0 if greedy else cfg.eval.temperature, samples, int(cfg.eval.top_k),
                             float(cfg.eval.top_p))
    return summarise_tasks([mean_metrics(group) for group in per_task], mode)
