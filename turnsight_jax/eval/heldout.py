"""Held-out evaluation during training: the paper's FTRL metrics of the policy, sampled or greedy.

A thin layer over the evaluation runner (`eval.runner.run_batches`, the seeding contract shared
with `python -m turnsight_jax.evaluate`): it builds the run's `ModelPolicy` per batch and
summarises the per-task metrics (`summarise_tasks`, also used by the command line): the paper's
per-category and category-averaged Solve-P/R/F1 and Avg (`ftrl`, computed by
`eval.ftrl_metrics.ftrl_scores`, as the evaluate command's tables), and the task-pooled means
with standard errors (`task_mean_*`, the paired before/after comparison's scale).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import ml_collections as mlc
import numpy as np

from turnsight_jax.chat.types import Task
from turnsight_jax.config import eval_sampling, rollout_config
from turnsight_jax.eval.ftrl_metrics import ftrl_scores
from turnsight_jax.eval.runner import describe_sampling, mean_metrics, run_batches
from turnsight_jax.model_setup import DTYPES
from turnsight_jax.rollout.driver import ModelPolicy, ProgressCallback

SUMMARY_KEYS = ("solve_f1", "solve_p", "solve_r", "answer_correct", "num_turns")
TASK_MEAN = "task_mean_"  # prefix of the task-pooled means (not the paper's category averages)


def summarise_tasks(per_task: Sequence[Mapping[str, float]], mode: str,
                    categories: Sequence[str | None]) -> dict[str, Any]:
    """{n, mode, ftrl, task_mean_<key>, task_mean_<key>_se for SUMMARY_KEYS present, per_task_solve_f1}.

    `ftrl`: the paper's FTRL metrics of the tasks (`ftrl_scores`: per category Solve-P/R/F1, their
    averages over the categories present, `avg` = the paper's FTRL Avg, `averaged_over`,
    `missing`, `paper_categories`); `categories[i]` is task i's category (None: "uncategorised").
    `task_mean_*`: means over all tasks pooled, whatever their category, and their standard
    errors. Each task's metrics are already averaged over its samples."""
    if len(categories) != len(per_task):
        raise ValueError(f"{len(per_task)} tasks but {len(categories)} categories")
    out: dict[str, Any] = {"n": len(per_task), "mode": mode, "ftrl": ftrl_scores(zip(categories, per_task))}
    for key in SUMMARY_KEYS:
        vals = np.array([m.get(key, np.nan) for m in per_task], np.float64)
        vals = vals[np.isfinite(vals)]
        if vals.size:
            out[TASK_MEAN + key] = float(vals.mean())
            out[TASK_MEAN + key + "_se"] = (float(vals.std(ddof=1) / math.sqrt(vals.size)) if vals.size > 1
                                            else 0.0)
    out["per_task_solve_f1"] = [float(m.get("solve_f1", 0.0)) for m in per_task]
    return out


def flat_ftrl(summary: Mapping[str, Any]) -> dict[str, float]:
    """The headline FTRL numbers of a `summarise_tasks` result as flat keys (metrics.jsonl's
    `eval/ftrl_*`): ftrl_solve_p, ftrl_solve_r, ftrl_solve_f1 (category averages) and ftrl_avg."""
    ftrl = summary.get("ftrl") or {}
    if not ftrl:
        return {}
    return {**{f"ftrl_{k}": float(v) for k, v in ftrl["average"].items()}, "ftrl_avg": float(ftrl["avg"])}


def evaluate_policy(graphdef, state, tok, tasks: Sequence[Task], cfg: mlc.ConfigDict, env, *,
                    greedy: bool | None = None, progress: ProgressCallback | None = None) -> dict[str, Any]:
    """Held-out rollouts: the paper's FTRL metrics (`ftrl`), task-pooled means with standard
    errors (`task_mean_*`) and per-task Solve-F1 (`summarise_tasks`).

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
    return summarise_tasks([mean_metrics(group) for group in per_task], mode,
                           [getattr(t, "category", None) for t in tasks])
