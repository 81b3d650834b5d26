"""Top-k filter of the sampler: block-pruned k-th largest vs XLA's `lax.top_k`, per decoded token.

    python benchmarks/topk.py                 # 64 rows x 151,936 (one decode step of a 64-row batch)
    python benchmarks/topk.py --rows 8 --k 50

Both compute the k-th largest scaled logit of each row (the top-k threshold of
`turnsight_jax.rollout.sampler.truncated_logits`); results are checked equal before timing.
Median of `--repeats` calls after a warm-up (compilation excluded).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from turnsight_jax.rollout.sampler import kth_largest


def _time(fn, x, repeats: int) -> float:
    fn(x).block_until_ready()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x).block_until_ready()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, nargs="+", default=[20, 50])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    x = jax.random.normal(jax.random.key(0), (args.rows, args.vocab), jnp.float32) * 3.0
    print(f"{jax.devices()[0].platform}: {args.rows} rows x {args.vocab} logits, median of {args.repeats}")
    print(f"{'k':>4} {'lax.top_k ms':>13} {'ours ms':>9} {'speed-up':>9}")
    for k in args.k:
        base = jax.jit(lambda v, k=k: jax.lax.top_k(v, k)[0][:, -1])
        ours = jax.jit(lambda v, k=k: kth_largest(v, k))
        if not bool(jnp.all(base(x) == ours(x))):
            raise SystemExit(f"k={k}: results differ")
        tb, to = _time(base, x, args.repeats), _time(ours, x, args.repeats)
        print(f"{k:>4} {tb * 1e3:>13.1f} {to * 1e3:>9.1f} {tb / to:>8.1f}x")


if __name__ == "__main__":
    main()
