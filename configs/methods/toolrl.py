"""ToolRL (docs/spec.md §1.12) on the tiny CPU experiment: the embedded
default's model, built-in tasks and warm-start, with the method switched to `toolrl` (reward
R_format + R_correct from the trajectory's calls against the task's gold calls, GRPO advantage,
clipped surrogate).

    python -m turnsight_jax.train --config configs/methods/toolrl.py --workdir /tmp/toolrl_run

Shorter than the default so that it runs in minutes on a shared CPU: 8 RL steps instead of 12 and
32 held-out tasks instead of 64 (the warm-start is the default's). `--config.rl.toolrl_format=False`
trains on the released code's R_correct alone.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "toolrl_tiny"
    c.rl.method = "toolrl"
    c.rl.toolrl_format = True  # R_format + R_correct (the ToolRL paper); False: the released compute_toolrl
    c.train.steps = 8
    c.data.num_eval = 32
    return c
