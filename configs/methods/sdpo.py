"""SDPO (Self-Distillation Policy Optimization; docs/baselines.md) on the tiny CPU experiment: GRPO
plus the KL from the student to the stop-gradient teacher, the current policy shown a successful
sibling rollout of the same prompt after the prompt, on the teacher's top-K tokens at every
sampled position (teacher.top_k; the rest of the vocabulary is one more category, sdpo.tail).
A trajectory with no successful sibling (reward >= privileged.sibling_min_reward) gets no
distillation and is counted (teacher/views_skipped).

    python -m turnsight_jax.train --config configs/methods/sdpo.py --workdir /tmp/sdpo_run

The sampled-token advantage form: `--config.rl.method=sdpo_advantage`. Metrics: train/sdpo_kl,
teacher/gap_mean, teacher/covered_frac, teacher/views_skipped.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "sdpo_tiny"
    c.rl.method, c.rl.base = "sdpo", "grpo"
    c.sdpo.coef = 0.1
    c.teacher.weights = "policy"
    c.privileged.source, c.privileged.placement = "sibling", "prompt"
    c.privileged.sibling_min_reward = 1.0  # Solve-F1 1: a sibling that solved the task
    c.teacher.top_k = 20
    c.train.steps = 8
    c.data.num_eval = 32
    return c
