"""The embedded default (what `python -m turnsight_jax.train` runs with no --config): the tiny CPU
experiment on the tiny-default model, both defined in turnsight_jax/embedded_default.py."""

from turnsight_jax.config import default_config


def get_config():
    return default_config()
