"""What the trajectory records cost the embedded default's step: the fused step compiled with and
without its per-turn record arrays (make_train_step(records=True)), timed alternately in one
process on the default's batch (8 built-in tasks x 4 replayed siblings, tiny-default, f32), and
the host's share of a records step: fetching the arrays, building the JSON lines and writing the
gzip file (turnsight_jax.records).

    python benchmarks/records.py [--rounds 5]

Prints a table: the median step time of each variant, their ratio, and the host's time per
records step. The embedded default writes records every step (log.records_every = 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from common import block, machine, table  # noqa: E402
from geometries import geometry_batch  # noqa: E402

from turnsight_jax import records  # noqa: E402
from turnsight_jax.assets import default_tokenizer  # noqa: E402
from turnsight_jax.config import default_config, step_config  # noqa: E402
from turnsight_jax.model_setup import runtime_options  # noqa: E402
from turnsight_jax.models.config import get_preset  # noqa: E402
from turnsight_jax.models.qwen3 import Qwen3  # noqa: E402
from turnsight_jax.rl.batch import batch_row_order, make_train_batch  # noqa: E402
from turnsight_jax.rl.methods import resolve_method  # noqa: E402
from turnsight_jax.rl.step import make_optimizer, make_train_step  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed steps of each variant, alternating")
    args = ap.parse_args()
    tok = default_tokenizer()
    trajs, row_tasks, turns = geometry_batch("default", tok)
    cfg = default_config()
    sc = dataclasses.replace(step_config(cfg), max_turns=turns)
    method = resolve_method(sc)
    batch, _ = make_train_batch(trajs, row_tasks, tok, sc, method)
    model = Qwen3(get_preset("tiny-default"), rngs=nnx.Rngs(0), param_dtype=jnp.float32, options=runtime_options(cfg))
    graphdef, params = nnx.split(model)
    optimizer = make_optimizer(sc.optim)
    dev = jax.tree.map(jnp.asarray, batch)
    steps = {name: make_train_step(graphdef, sc, optimizer, method, records=name == "with records")
             for name in ("without records", "with records")}
    state = {name: [jax.tree.map(jnp.copy, params), optimizer.init(params)] for name in steps}
    times = {name: [] for name in steps}
    host = []
    out = pathlib.Path(tempfile.mkdtemp())

    def run(name):
        p, s = state[name]
        state[name][0], state[name][1], m = steps[name](p, s, params, dev)
        arrays = m.pop("records", None)
        return jax.device_get(m), arrays

    for name in steps:  # compile and warm up
        block(run(name))
    for i in range(args.rounds):
        for name in (steps if i % 2 == 0 else reversed(list(steps))):
            t0 = time.perf_counter()
            _, arrays = run(name)
            times[name].append(time.perf_counter() - t0)
            if arrays is not None:
                t0 = time.perf_counter()
                lines = records.build_step_records(i, trajs, row_tasks, batch, records.host_arrays(arrays), method, sc,
                                                   rows=range(len(trajs)), order=batch_row_order(trajs, sc),
                                                   text_chars=cfg.log.records_text_chars,
                                                   max_bytes=cfg.log.records_max_kib * 1024)
                path = records.write_records(records.records_path(out, i), lines)
                host.append(time.perf_counter() - t0)
    base = statistics.median(times["without records"])
    rows = [[name, f"{statistics.median(t):.3f} s", f"{statistics.median(t) / base:.3f}x"] for name, t in times.items()]
    rows.append(["host: fetch + build + write", f"{statistics.median(host):.3f} s",
                 f"{statistics.median(host) / base:.3f}x of a step"])
    print(f"{machine()}; {len(trajs)} trajectories, {args.rounds} alternating rounds; records file "
          f"{path.stat().st_size / 1024:.1f} KiB compressed")
    print(table(rows, ["fused step", "median", "vs without"]))
    for name, t in times.items():
        print(f"{name}: " + ", ".join(f"{x:.2f}" for x in t) + " s")


if __name__ == "__main__":
    main()
