"""The one error type of the evaluation command line."""

from __future__ import annotations


class EvalError(ValueError):
    """A problem with the evaluation's inputs (benchmark names, data paths, model folders,
    replay scripts). `python -m turnsight_jax.evaluate` prints its message on one line and exits
    with status 2, before any weights are loaded or any rollout runs."""
