"""Multi-process start-up: `jax.distributed` under a launcher (launch/*.sh)."""

from __future__ import annotations

import os

import jax


def maybe_initialize_distributed() -> None:
    """jax.distributed under a multi-process launcher (launch/*.sh set TURNSIGHT_DISTRIBUTED=1)."""
    if os.environ.get("TURNSIGHT_DISTRIBUTED") == "1":
        jax.distributed.initialize()
