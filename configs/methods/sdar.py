"""SDAR (docs/baselines.md) on the tiny CPU experiment: GRPO plus the gated auxiliary NLL
-coef * sigmoid(beta * (teacher - student log-prob)) * log p(token), the teacher being the current
policy with a skill text for the task's category (privileged.skills; the bundled
turnsight_jax/assets/skills_builtin.json by default) shown after the prompt.

    python -m turnsight_jax.train --config configs/methods/sdar.py --workdir /tmp/sdar_run

Metrics: train/sdar_gate (mean gate), train/sdar_nll, teacher/gap_mean.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "sdar_tiny"
    c.rl.method, c.rl.base = "sdar", "grpo"
    c.sdar.coef, c.sdar.beta = 0.1, 1.0
    c.teacher.weights = "policy"
    c.privileged.source, c.privileged.placement = "skill", "prompt"
    c.train.steps = 8
    c.data.num_eval = 32
    return c
