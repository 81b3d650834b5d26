"""SOD (step-wise on-policy distillation; docs/baselines.md) on the tiny CPU experiment: GRPO plus
the top-K KL to an external teacher scoring the student's own trajectories, each turn's strength
multiplied by exp(-turn divergence / sod.tau), so turns where the two diverge most are damped.

The method's teacher is a second, larger Hugging Face Qwen3 with the same tokenizer: pass it with
`--config.teacher.checkpoint=/path/to/folder`. So that this file runs anywhere, its default is
`warm_start`: the run's own supervised warm-start (the SFT stage's folder) scored as an external
model. That teacher equals the policy's starting point; the mechanism (per-turn divergences and
weights) runs the same, but it is not the paper's larger teacher.

    python -m turnsight_jax.train --config configs/methods/sod.py --workdir /tmp/sod_run

Metrics: train/sod_kl, train/sod_weight.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "sod_tiny"
    c.rl.method, c.rl.base = "sod", "grpo"
    c.sod.coef, c.sod.tau = 0.1, 1.0
    c.teacher.weights = "external"
    c.teacher.checkpoint = "warm_start"
    c.privileged.source = "none"  # the teacher reads the student's own context
    c.train.steps = 8
    c.data.num_eval = 32
    return c
