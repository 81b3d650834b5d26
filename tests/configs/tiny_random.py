"""The tiny CPU experiment on the 2-layer `tiny` model (random init): the CLI tests' fast config.
(The embedded default's model layer fixes model.preset, so a test picks its model with a config.)"""

from turnsight_jax import embedded_default
from turnsight_jax.config import ModelLayer, layered


def get_config():
    return layered(model=ModelLayer("tests/configs/tiny_random.py", dict(embedded_default.TINY_DEFAULT_MODEL, preset="tiny")),
                   experiment=embedded_default.tiny_cpu)
