"""Held-out evaluation during training: per-task Solve-F1 of the policy, sampled or greedy."""

from __future__ import annotations

import math
from typing import Any, Sequence

import ml_collections as mlc
import numpy as np

from turnsight_jax.chat.types import Task
from turnsight_jax.config import rollout_config
from turnsight_jax.rollout.driver import ModelPolicy, rollout
from turnsight_jax.rollout.sampler import SamplingParams


def evaluate_policy(graphdef, state, tok, tasks: Sequence[Task], cfg: mlc.ConfigDict, env, *,
                    greedy: bool | None = None) -> dict[str, Any]:
    """Held-out rollouts: per-task Solve-F1 and means with standard errors.

    Greedy (argmax) when `cfg.eval.temperature` is 0 or `greedy=True`; otherwise `cfg.eval.samples`
    rollouts per task at that temperature, each task's metrics averaged over its samples: the
    expected Solve-F1 of the sampled policy, the quantity RL maximises. The sampling seed is fixed,
    so evaluations before and after training share their random numbers (a lower-variance paired
    difference)."""
    greedy = cfg.eval.temperature <= 0 if greedy is None else greedy
    samples = 1 if greedy else int(cfg.eval.samples)
    sampling = SamplingParams(greedy=True) if greedy else SamplingParams(
        temperature=cfg.eval.temperature, top_k=int(cfg.eval.top_k), top_p=float(cfg.eval.top_p))
    rc = rollout_config(cfg, max_turns=cfg.eval.max_turns)
    per_task: list[dict[str, float]] = []
    bs = max(1, cfg.eval.batch_size // samples)
    for i in range(0, len(tasks), bs):
        chunk = tasks[i:i + bs]
        policy = ModelPolicy(graphdef, state, tok, sampling=sampling, config=rc, seed=cfg.seed + i)
        res = rollout(policy, env, chunk, tokenizer=tok, group_size=samples, config=rc, seed=cfg.seed)
        for j in range(len(chunk)):
            group = [t.metrics for t in res.trajectories[j * samples:(j + 1) * samples]]
            per_task.append({k: float(np.mean([m[k] for m in group])) for k in group[0]
                             if all(isinstance(m.get(k), (int, float)) for m in group)})
    out: dict[str, Any] = {"n": len(per_task), "mode": "greedy" if greedy else
                           f"{samples} samples at temperature {cfg.eval.temperature:g}"
                           + (f", top-k {cfg.eval.top_k}" if cfg.eval.top_k else "")
                           + (f", top-p {cfg.eval.top_p:g}" if cfg.eval.top_p < 1 else "")}
    for key in ("solve_f1", "solve_p", "solve_r", "answer_correct", "num_turns"):
        vals = np.array([m.get(key, np.nan) for m in per_task], np.float64)
        vals = vals[np.isfinite(vals)]
        if vals.size:
            out[key] = float(vals.mean())
            out[key + "_se"] = float(vals.std(ddof=1) / math.sqrt(vals.size)) if vals.size > 1 else 0.0
    out["per_task_solve_f1"] = [float(m.get("solve_f1", 0.0)) for m in per_task]
    return out
