"""What a training step costs: the wall-clock split, the peak memory, and the optimizer probe that
the split of the fused step needs (docs/records.md, "Cost accounting"; the report's cost table is
turnsight_jax.cost_report).

Measured, per step (seconds): the rollout's prefill (prompts and observations appended to the KV
cache) and decode (the compiled decode loop), each timed around its compiled call up to the
host's copy of the results; the tools (environment steps, as the driver times them; with the paged
engine they overlap decoding); the host's batch building (trajectories -> TrainBatch, packed
views, FLOP counting, device placement); the fused step itself (`perf/step_fn_s`: from its call
to its metrics on the host); the records, the in-loop evaluation and the checkpoint.

Estimated: the fused step is one XLA program, so its parts cannot be timed inside it. Its wall
time is apportioned: the optimizer gets `updates` x the time of one separately jitted optimizer
update of the run's own parameters and state (`OptimizerProbe`, measured once per process at its
first step), the rest goes to the FLOP counter's parts (turnsight_jax.flops: teacher, student
forward+backward, extra student forwards, critic, PRM, retrospective teacher) in proportion to
their executed FLOPs. These metrics end in `_s_est`.
"""

from __future__ import annotations

import resource
import sys
import time

import jax
import jax.numpy as jnp
import optax

GIB = 2.0 ** 30


def rollout_split(stats: dict) -> dict[str, float]:
    """The rollout's measured prefill / decode seconds from the driver's stats (lockstep sampler
    or paged engine timings: prompt prefill + observation appends, decode)."""
    return {"perf/rollout_prefill_s": float(stats.get("prefill_s", 0.0) + stats.get("append_s", 0.0)),
            "perf/rollout_decode_s": float(stats.get("decode_s", 0.0))}


def step_fn_split(step_fn_s: float, executed: dict[str, float], optimizer_s: float | None,
                  updates: int) -> dict[str, float]:
    """The fused step's wall time apportioned (module docstring): `executed` {part: executed FLOPs}
    (flops.UpdateFlops parts), `optimizer_s` one optimizer update's probe time (None: not measured,
    everything apportioned by FLOPs), `updates` optimizer updates per step."""
    opt = 0.0 if optimizer_s is None else min(optimizer_s * updates, step_fn_s)
    rest = step_fn_s - opt
    total = sum(executed.values())
    out = {f"perf/step_fn_{part}_s_est": rest * v / total if total > 0 else 0.0 for part, v in executed.items()}
    if optimizer_s is not None:
        out["perf/step_fn_optimizer_s_est"] = opt
    return out


def memory_metrics() -> dict[str, float]:
    """Peak memory: the devices' own peak (`perf/device_peak_gib`, the largest over this process's
    devices) where the backend reports memory stats (GPU, TPU; the CPU backend does not: the key
    is then absent, never guessed), and the process's peak resident set (`perf/host_rss_peak_gib`,
    getrusage: on the CPU backend the arrays live there)."""
    out = {}
    peaks = []
    for d in jax.local_devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(float(stats["peak_bytes_in_use"]))
    if peaks:
        out["perf/device_peak_gib"] = max(peaks) / GIB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out["perf/host_rss_peak_gib"] = rss * (1.0 if sys.platform == "darwin" else 1024.0) / GIB
    return out


class OptimizerProbe:
    """One optimizer update (`optimizer.update` then `optax.apply_updates`) of the run's parameters
    and optimizer state on zero gradients, jitted on its own, timed once (after a compile and a
    warm-up call); nothing it computes is kept. AdamW's work does not depend on the gradient's
    values, so this is the time the fused step spends in each of its updates' optimizer, up to
    the fusion the fused program may do."""

    def __init__(self, optimizer: optax.GradientTransformation):
        self.optimizer = optimizer
        self.seconds: float | None = None

    def measure(self, params, opt_state) -> float:
        if self.seconds is None:
            def update(p, o):
                grads = jax.tree.map(jnp.zeros_like, p)
                upd, new_o = self.optimizer.update(grads, o, p)
                return optax.apply_updates(p, upd), new_o

            fn = jax.jit(update)
            jax.block_until_ready(fn(params, opt_state))  # compile and warm up
            t0 = time.perf_counter()
            jax.block_until_ready(fn(params, opt_state))
            self.seconds = time.perf_counter() - t0
        return self.seconds
