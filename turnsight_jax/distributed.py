"""Multi-process start-up: `jax.distributed` under a launcher (launch/*.sh), and a check.

The launchers set TURNSIGHT_DISTRIBUTED=1 and, where no cluster manager tells JAX the layout,
JAX_COORDINATOR_ADDRESS=HOST:PORT, JAX_NUM_PROCESSES and JAX_PROCESS_ID (launch/slurm_multinode.sh,
launch/local_multiprocess.sh). JAX reads the coordinator address itself but not the other two, so
they are passed explicitly. On the CPU backend (JAX_PLATFORMS=cpu: the local mode) cross-process
collectives go through gloo.

    launch/local_multiprocess.sh 2 --devices 4 -- python -m turnsight_jax.distributed

runs `check()` in every process: each prints its place in the global mesh and the result of one
all-reduce across all processes, and exits non-zero if the processes do not form one mesh.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def maybe_initialize_distributed() -> None:
    """jax.distributed under a multi-process launcher (launch/*.sh set TURNSIGHT_DISTRIBUTED=1)."""
    if os.environ.get("TURNSIGHT_DISTRIBUTED") != "1":
        return
    kwargs = {}
    num, pid = _env_int("JAX_NUM_PROCESSES"), _env_int("JAX_PROCESS_ID")
    if num is not None:
        kwargs["num_processes"] = num
    if pid is not None:
        if num is not None and not 0 <= pid < num:
            raise ValueError(f"JAX_PROCESS_ID={pid} is outside 0..{num - 1} (JAX_NUM_PROCESSES={num})")
        kwargs["process_id"] = pid
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)


def to_host(x) -> np.ndarray:
    """A jax.Array as a numpy array on this process, whole. An array that spans other processes'
    devices (a multi-process run) is all-gathered first: every process then holds the same
    values, which is how rollout host work runs today (replicated on every process)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def check() -> int:
    """Each process contributes its index + 1 from each of its devices to one global array; the
    all-reduced sum must be sum over processes of (index + 1) x local devices. Returns 0 if so."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    maybe_initialize_distributed()
    me, n = jax.process_index(), jax.process_count()
    local = jax.local_device_count()
    mesh = Mesh(np.array(jax.devices()), ("all",))
    mine = np.full((local,), me + 1, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("all")), mine)
    total = float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x))
    expected = float(sum((p + 1) * local for p in range(n)))  # every process has the same local count
    ok = jax.device_count() == n * local and total == expected
    print(f"process {me} of {n}: {local} local of {jax.device_count()} {jax.devices()[0].platform} devices; "
          f"all-reduce {total:g} (expected {expected:g}) {'ok' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(check())
