"""Multi-process runs: `jax.distributed` under a launcher (launch/*.sh), the split of a step's
rollouts over processes, the host-side agreements it needs, and a check.

The launchers set TURNSIGHT_DISTRIBUTED=1 and, where no cluster manager tells JAX the layout,
JAX_COORDINATOR_ADDRESS=HOST:PORT, JAX_NUM_PROCESSES and JAX_PROCESS_ID (launch/slurm_multinode.sh,
launch/local_multiprocess.sh). JAX reads the coordinator address itself but not the other two, so
they are passed explicitly. On the CPU backend (JAX_PLATFORMS=cpu: the local mode) cross-process
collectives go through gloo.

    launch/local_multiprocess.sh 2 --devices 4 -- python -m turnsight_jax.distributed

runs `check()` in every process: each prints its place in the global mesh and the result of one
all-reduce across all processes, and exits non-zero if the processes do not form one mesh.

Split rollouts (what the trainer does with more than one process): the step's batch rows are
split over the (data, fsdp) devices; the rows whose shards live on a process's devices are that
process's episodes (`rollout_share`: whole prompt groups, or an error). Each process rolls them out
alone, on its own devices (`local_mesh`) with its own copy of the policy (`local_replica`), runs
only their tool calls, builds their batch rows and contributes them to the global batch
(`assemble_rows`). The few host decisions every process must make alike (batch widths, the
preemption stop, metrics over all episodes) go through small all-gathers (`gather`).
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
    devices is all-gathered first, so every process holds the same values (the held-out
    evaluation decodes on the global mesh; training rollouts decode on `local_mesh` and need no
    gather)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def gather(x) -> np.ndarray:
    """Every process's `x` (a number or array of the same shape everywhere), stacked in process
    order: [P, ...]. One process: x[None]."""
    x = np.asarray(x)
    if not is_multiprocess():
        return x[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def summed(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over the processes (counts each one made); one process: as given."""
    keys = sorted(values)
    total = gather(np.array([values[k] for k in keys], np.float64)).reshape(-1, len(keys)).sum(axis=0)
    return dict(zip(keys, total.tolist()))


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is True on any (e.g. one process got SIGTERM)."""
    return bool(gather(np.int32(bool(flag))).any())


def process_rows(mesh, rows: int) -> tuple[int, int]:
    """[start, stop) of the rows of a [rows, ...] array split over the mesh's (data, fsdp) axes
    that live on this process's devices. ValueError unless they are one contiguous range and the
    processes' ranges partition the rows (no row on two processes)."""
    from turnsight_jax.models.sharding import row_sharding

    index = row_sharding((rows,), 0, mesh).addressable_devices_indices_map((rows,))
    spans = sorted({(sl[0].start or 0, rows if sl[0].stop is None else sl[0].stop) for sl in index.values()})
    start, stop = spans[0][0], spans[-1][1]
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise ValueError(f"process {jax.process_index()}: its batch rows {spans} are not one contiguous range")
    ranges = gather(np.array([start, stop]))
    order = ranges[np.argsort(ranges[:, 0])]
    if order[0, 0] != 0 or order[-1, 1] != rows or np.any(order[1:, 0] != order[:-1, 1]):
        raise ValueError(f"the processes' batch rows {ranges.tolist()} do not split the {rows} rows: with "
                         f"{jax.process_count()} processes the batch rows must be split over the (data, fsdp) "
                         f"mesh axes across processes (mesh {dict(mesh.shape)}; rows must divide over data x fsdp, "
                         f"and the tensor axis must stay inside a process)")
    return start, stop


def rollout_share(mesh, prompts: int, group_size: int) -> tuple[int, int]:
    """(first prompt, prompts) this process rolls out of a step's `prompts` x `group_size` rows:
    the prompts whose rows live on its devices, always whole groups (a group's statistics are
    computed over its siblings: they must be rolled out together). One process: (0, prompts)."""
    if not is_multiprocess():
        return 0, prompts
    start, stop = process_rows(mesh, prompts * group_size)
    if start % group_size or stop % group_size:
        raise ValueError(f"process {jax.process_index()} holds batch rows {start}..{stop - 1}, which split a "
                         f"group of {group_size}: make train.prompts_per_step a multiple of the number of "
                         f"processes ({jax.process_count()}) times the row shards per process")
    return start // group_size, (stop - start) // group_size


def _local_devices_in_mesh_order(mesh) -> list:
    me = jax.process_index()
    return [d for d in mesh.devices.flat if d.process_index == me]


def local_mesh(mesh):
    """A (data, fsdp, tensor) mesh over this process's devices of `mesh`, with its tensor size
    (data folded into fsdp). One process: `mesh` itself. On the CPU backend: one device only.
    XLA's CPU collectives (gloo) deadlock when a collective among one process's devices runs
    while a cross-process one starts (reproduced: two programs in flight hang both processes),
    and a one-device rollout has no collectives at all; the CPU devices share the host's cores
    anyway. (Accelerator meshes keep all of the process's devices: not run here.)"""
    if not is_multiprocess():
        return mesh
    from turnsight_jax.models.sharding import make_mesh

    local = _local_devices_in_mesh_order(mesh)
    if local[0].platform == "cpu":
        return make_mesh(1, 1, 1, devices=local[:1])
    tensor = mesh.shape["tensor"]
    if len(local) % tensor:
        raise ValueError(f"the tensor axis ({tensor}) spans processes of {len(local)} devices each: split rollouts "
                         f"need it inside a process")
    return make_mesh(1, -1, tensor, devices=local)


def local_replica(tree, mesh, local):
    """A copy of `tree` (arrays on the global `mesh`) held whole by every process, sharded over
    its own devices like the model's rules shard it on `local` (`local_mesh(mesh)`), as arrays on
    `local`: rollouts then run with no cross-process traffic. One process: `tree` itself.
    (One all-gather of the tree per call.)"""
    if not is_multiprocess():
        return tree
    from jax.sharding import Mesh, NamedSharding

    from turnsight_jax.models.sharding import AXES, fit_spec

    per_process = {}
    for d in mesh.devices.flat:  # every process's devices, in the order its local mesh takes them
        per_process.setdefault(d.process_index, []).append(d)
    if local.devices.size < len(per_process[jax.process_index()]):
        # a local mesh on some of the process's devices (the CPU backend's one): a whole copy on
        # every device, and this process keeps the ones on its local mesh
        from jax.sharding import PartitionSpec as P

        mine = set(local.devices.flat)
        copied = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(tree)
        jax.block_until_ready(copied)
        return jax.tree.map(lambda y: jax.make_array_from_single_device_arrays(
            y.shape, NamedSharding(local, P()), [s.data for s in y.addressable_shards if s.device in mine]), copied)
    grid = np.array([per_process[p] for p in sorted(per_process)]).reshape(
        (len(per_process), *local.devices.shape))
    stacked = Mesh(grid, ("process", *AXES))

    def spec(x):
        return fit_spec(x.sharding.spec, x.shape, local)

    copied = jax.jit(lambda t: t, out_shardings=jax.tree.map(lambda x: NamedSharding(stacked, spec(x)), tree))(tree)
    jax.block_until_ready(copied)  # a cross-process collective: done before any local one starts (`settle`)
    return jax.tree.map(
        lambda x, y: jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(local, spec(x)), [s.data for s in y.addressable_shards]), tree, copied)


def settle() -> None:
    """Wait for every computation this process dispatched (multi-process runs only). On the CPU
    backend a collective among one process's devices that is still running when a cross-process
    one starts can deadlock both (gloo; reproduced with two programs in flight), so the split
    rollouts' local work is finished before the step's collectives are dispatched."""
    if is_multiprocess():
        for x in jax.live_arrays():
            x.block_until_ready()


def assemble_rows(tree, mesh, rows: int, row_axis_of=lambda path: 0):
    """Global arrays from each process's rows: numpy leaves holding this process's
    `process_rows(mesh, rows)` along their row axis become arrays of `rows` rows split over the
    mesh's (data, fsdp) axes (`models.sharding.shard_rows`'s layout). None leaves stay None."""
    from turnsight_jax.models.sharding import row_sharding

    def put(path, x):
        if x is None:
            return None
        axis = row_axis_of(path)
        shape = list(x.shape)
        shape[axis] = rows
        return jax.make_array_from_process_local_data(row_sharding(shape, axis, mesh), np.asarray(x), tuple(shape))

    return jax.tree_util.tree_map_with_path(put, tree)


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


def main(argv=None) -> int:
    import argparse

    argparse.ArgumentParser(
        prog="python -m turnsight_jax.distributed",
        description="Check a multi-process JAX job: every process contributes its index + 1 from each local device "
                    "to one all-reduce and prints the sum against the expected one (exit 0: all processes joined). "
                    "Run under a launcher (launch/local_multiprocess.sh N, launch/slurm_multinode.sh), which sets "
                    "TURNSIGHT_DISTRIBUTED=1, JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID; alone it "
                    "checks one process.",
    ).parse_args(argv)
    return check()


if __name__ == "__main__":
    sys.exit(main())
