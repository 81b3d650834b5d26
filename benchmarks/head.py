"""The log-prob head alone: rl.logprobs.chunked_logprobs over the whole vocabulary per row chunk
(vocab_block 0) vs in vocabulary blocks (model.vocab_block), forward and forward + backward,
same inputs, same run.

    python benchmarks/head.py                       # the embedded default's shapes (D = 64, V = 151,936)
    python benchmarks/head.py --rows 2560 --dim 64  # a teacher-sized call

Rows are all used (no skipped chunks); the hidden states and weight are random, scaled like a
trained model's logits (std ~1)."""

from __future__ import annotations

import argparse
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from common import machine, table, time_fn  # noqa: E402
from turnsight_jax.rl.logprobs import chunked_logprobs  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1280, help="used rows (the default's update: ~1,240 policy tokens)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default="256:0,32:0", help="chunk:vocab_block pairs of the whole-vocabulary head")
    ap.add_argument("--blocked", default="640:1024,1280:1024,1280:4096", help="chunk:vocab_block pairs, blocked")
    args = ap.parse_args()
    keys = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(keys[0], (args.rows, args.dim))
    w = jax.random.normal(keys[1], (args.dim, args.vocab)) / args.dim ** 0.5
    t = jax.random.randint(keys[2], (args.rows,), 0, args.vocab)
    g = jax.random.normal(keys[3], (args.rows,))
    print(f"machine: {machine()}; {args.rows} rows, D = {args.dim}, V = {args.vocab}, float32")
    rows, base = [], {}
    for spec in args.baseline.split(",") + args.blocked.split(","):
        chunk, block = map(int, spec.split(":"))

        def head(h, w, chunk=chunk, block=block):
            return chunked_logprobs(h, t, w, chunk=chunk, vocab_block=block)

        fwd = jax.jit(head)
        both = jax.jit(jax.value_and_grad(lambda h, w: jnp.sum(head(h, w) * g), argnums=(0, 1)))
        tf = time_fn(lambda: fwd(h, w), repeats=args.repeats)
        tb = time_fn(lambda: both(h, w), repeats=args.repeats)
        if block == 0:  # each baseline's best time is the reference of its column
            base["fwd"] = min(base.get("fwd", tf), tf)
            base["both"] = min(base.get("both", tb), tb)
        rows.append((f"chunk {chunk}, " + (f"vocab_block {block}" if block else "whole vocabulary"), tf, tb))
    print(table([[name, f"{tf:.3f} s", f"{base['fwd'] / tf:.2f}x", f"{tb:.3f} s", f"{base['both'] / tb:.2f}x"]
                 for name, tf, tb in rows],
                ["head", "forward", "vs the best whole-vocabulary forward", "forward + backward",
                 "vs the best whole-vocabulary forward + backward"]))


if __name__ == "__main__":
    main()
