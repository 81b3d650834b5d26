"""The embedded default (also what `python -m turnsight_jax.train` runs with no --config):
a tiny Qwen3 with the real Qwen3 tokenizer, supervised warm-start, TurnSight RL on built-in tasks,
on one CPU in minutes."""

from turnsight_jax.config import default_config


def get_config():
    return default_config()
