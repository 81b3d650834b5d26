"""BAR, Orchard's adaptive group sampling (turnsight_jax.methods.bar; docs/rollout_methods.md) under
GRPO on the tiny CPU experiment: each prompt is sampled bar.chunk = 2 rollouts at a time until
the share of its rollouts that succeed (Solve-F1 >= bar.success) lies in [0.375, 0.625], or it
holds bar.cap = 8; a group still all-success or all-failure at the cap is kept as it is
(bar.fallback). Groups thus have 2, 4, 6 or 8 rows; the batch pads each prompt to 8 rows with
rows that train nothing.

    python -m turnsight_jax.train --config configs/methods/bar.py --workdir /tmp/bar_run

TurnSight as the method instead of GRPO: `--config.rl.method=turnsight --config.rl.base=grpo`
(the controller is rl.rollout, whatever the method). Metrics: bar/early_stops (prompts stopped
below the cap), bar/in_band, bar/cap_mixed, bar/fallbacks, bar/rollouts, bar/rounds,
bar/group_size_mean; rollout/group_size_min, rollout/group_size_max, rollout/groups.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "bar_tiny"
    c.rl.method = "grpo"
    c.rl.rollout = "bar"
    c.bar.chunk = 2
    c.bar.cap = 8
    c.train.steps = 8
    c.data.num_eval = 32
    return c
