"""Model layer: the embedded default's tiny Qwen3 (defined in turnsight_jax/experiments.py)."""

from turnsight_jax.experiments import TINY_DEFAULT_MODEL


def get_model():
    return dict(TINY_DEFAULT_MODEL)
