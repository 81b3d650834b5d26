"""Model layer: the embedded default's tiny Qwen3 (defined in turnsight_jax/embedded_default.py)."""

from turnsight_jax.embedded_default import TINY_DEFAULT_MODEL


def get_model():
    return dict(TINY_DEFAULT_MODEL)
