"""Run by tests/test_launch.py under launch/local_multiprocess.sh 2 --devices 4: the pieces of the
split rollouts on a real 2-process job. Prints one `ok` line per check; raises on a failure."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from turnsight_jax import distributed as dist
from turnsight_jax.models.sharding import make_mesh

dist.maybe_initialize_distributed()
me = jax.process_index()
mesh = make_mesh(1, -1, 1)  # fsdp over all 8 devices of both processes

# whole groups, a partition of the rows, in process order
assert dist.rollout_share(mesh, 4, 2) == ((0, 2) if me == 0 else (2, 2)), dist.rollout_share(mesh, 4, 2)
try:
    dist.rollout_share(mesh, 4, 4)  # 16 rows: each process holds 8, i.e. two groups of 4: fine
    dist.rollout_share(mesh, 2, 8)  # 16 rows of groups of 8: fine, one group each
    dist.rollout_share(mesh, 1, 16)  # one group of 16 split over the processes: refused
    raise SystemExit("a group split over processes was accepted")
except ValueError as e:
    assert "split a group of 16" in str(e), e
print(f"process {me}: rollout_share ok", flush=True)

# the policy's copy: whole on this process, on its own device(s), equal to the global array
w = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp", None)))
local = dist.local_mesh(mesh)
copy = dist.local_replica({"w": w}, mesh, local)["w"]
assert copy.is_fully_addressable and {d.process_index for d in copy.devices()} == {me}
np.testing.assert_array_equal(np.asarray(copy), np.arange(64.0).reshape(8, 8))
print(f"process {me}: local_replica ok ({len(local.devices.flat)} device(s))", flush=True)

# each process's rows become one global batch, in process order
rows = np.full((4, 3), me, np.int32) + np.arange(4, dtype=np.int32)[:, None] * 10
glob = dist.assemble_rows({"x": rows, "none": None}, mesh, 8)
assert glob["none"] is None and glob["x"].shape == (8, 3)
total = jax.jit(lambda x: jnp.sum(x, axis=1), out_shardings=NamedSharding(mesh, P()))(glob["x"])
want = np.concatenate([np.full((4,), 3 * p) + np.arange(4) * 30 for p in range(2)])
np.testing.assert_array_equal(np.asarray(total), want)
print(f"process {me}: assemble_rows ok", flush=True)

assert dist.any_process(me == 1) and not dist.any_process(False)
np.testing.assert_array_equal(dist.gather(np.array([me, 2 * me])), [[0, 0], [1, 2]])
print(f"process {me}: any_process and gather ok", flush=True)
sys.exit(0)
