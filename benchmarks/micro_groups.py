"""Micro-batches of one row, grouped by length (`train.micro_batch_groups`, rl.micro_groups), vs
one scan at the batch's width: the paper configs' split (512 trajectories in 64 micro-batches on 8
devices: one row per device per micro-batch) scaled to this CPU, the paper-like geometry's 16
trajectories in 16 micro-batches (teacher micro-batches alike).

    python benchmarks/micro_groups.py                   # groups 1 (today), 2, 4; 3 interleaved rounds
    python benchmarks/micro_groups.py --groups 1 4 8 --rounds 5

Every variant is the fused step (TurnSight over GRPO, one update; tiny-default, f32, the embedded
default's step and model settings otherwise) on the same trajectories, compiled first, then timed
once per round, the rounds interleaved (medians); the executed / necessary FLOPs of the update
(turnsight_jax.flops) counted for the timed model and for Qwen3-8B.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
from flax import nnx

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, table, time_fn  # noqa: E402
from geometries import GEOMETRIES, geometry_batch  # noqa: E402

from turnsight_jax.assets import default_tokenizer  # noqa: E402
from turnsight_jax.config import default_config, step_config  # noqa: E402
from turnsight_jax.flops import update_flops  # noqa: E402
from turnsight_jax.model_setup import runtime_options  # noqa: E402
from turnsight_jax.models.config import get_preset  # noqa: E402
from turnsight_jax.models.qwen3 import Qwen3  # noqa: E402
from turnsight_jax.rl.batch import make_train_batch  # noqa: E402
from turnsight_jax.rl.methods import resolve_method  # noqa: E402
from turnsight_jax.rl.step import make_optimizer, make_train_step  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", choices=GEOMETRIES, default="paper-like")
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1, help="steps timed per round (median)")
    args = ap.parse_args()
    print(f"machine: {machine()}", flush=True)
    tok = default_tokenizer()
    trajs, row_tasks, turns = geometry_batch(args.geometry, tok)
    cfg = default_config()
    m = len(trajs)  # one row per micro-batch, as the paper configs' one row per device
    model = Qwen3(get_preset("tiny-default"), rngs=nnx.Rngs(0), param_dtype=jnp.float32, options=runtime_options(cfg))
    graphdef, params = nnx.split(model)
    runs, rows = {}, []
    for g in args.groups:
        sc = dataclasses.replace(step_config(cfg), max_turns=turns, length_classes=1, micro_batches=m,
                                 teacher_micro_batches=m, micro_batch_groups=g)
        method = resolve_method(sc)
        batch, stats = make_train_batch(trajs, row_tasks, tok, sc, method)
        optimizer = make_optimizer(sc.optim)
        step = make_train_step(graphdef, sc, optimizer, method)
        dev = jax.tree.map(jnp.asarray, batch)
        holder = {"p": jax.tree.map(jnp.copy, params), "s": optimizer.init(params)}

        def full(step=step, dev=dev, holder=holder):
            holder["p"], holder["s"], out = step(holder["p"], holder["s"], params, dev)
            return out

        jax.block_until_ready(full())  # compile
        counts = {p: update_flops(get_preset(p), batch, updates=1, q_chunk=cfg.model.attn_q_chunk, remat=False,
                                  teacher_distinct_rows=stats["teacher_distinct_rows"], logprob_chunk=sc.logprob_chunk,
                                  score_chunk=sc.scoring_chunk, micro_batches=m, teacher_micro_batches=m,
                                  row_group=cfg.model.attn_row_group, key_block=cfg.model.attn_key_block)
                  for p in ("tiny-default", "qwen3-8b")}
        widths = (f"T={stats['T']:.0f}, P={stats['P']:.0f}" if g == 1 else
                  "T=" + "/".join(f"{stats[f'T{i}']:.0f}" for i in range(g)) + ", P="
                  + "/".join(f"{stats[f'P{i}']:.0f}" for i in range(g)))
        runs[g] = (full, counts, widths)
    walls = {g: [] for g in runs}
    for r in range(args.rounds):
        for g, (full, _, _) in runs.items():
            walls[g].append(time_fn(full, repeats=args.repeats, warmup=0))
        print(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"groups {g} {w[-1]:.2f} s" for g, w in walls.items()),
              flush=True)
    base = statistics.median(walls[args.groups[0]])
    for g, (_, counts, widths) in runs.items():
        med = statistics.median(walls[g])
        rows.append([f"{g} group{'s' if g > 1 else ''} ({widths})", f"{med:.2f} s ({min(walls[g]):.2f}-{max(walls[g]):.2f})",
                     f"{base / med:.2f}x",
                     *(" / ".join(f"{e / n:.2f}" for n, e in (c.parts["student"], c.parts["teacher"]))
                       + f" / **{c.ratio:.2f}**" for c in counts.values())])
    print(f"geometry {args.geometry}: {len(trajs)} trajectories in {m} micro-batches of one row (teacher alike); "
          f"tiny-default f32, one update; median of {args.rounds} interleaved rounds")
    print(table(rows, ["micro-batch groups (widths)", "fused step", f"speed vs {args.groups[0]} group(s)",
                       "executed / necessary: student / teacher / update (tiny-default)",
                       "same, counted for qwen3-8b"]))


if __name__ == "__main__":
    main()
