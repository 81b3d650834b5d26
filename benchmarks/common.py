"""Timing helpers shared by the benchmark scripts."""

from __future__ import annotations

import platform
import statistics
import time
from typing import Callable

import jax


def block(x):
    return jax.block_until_ready(x)


def time_fn(fn: Callable[[], object], *, repeats: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of fn() over `repeats` runs after `warmup` runs (outputs blocked on)."""
    for _ in range(warmup):
        block(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine() -> str:
    import os

    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, JAX {jax.__version__} on {kind}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep] + [line(r) for r in rows])
