"""Attention kernel benchmark: one layer's attention over a geometry's real rows, forward and
forward + backward, with `model.attn_row_group` = 0 (every chunk; autodiff through the
rematerialised chunk scan, the baseline) against row groups (chunks of padding skipped, the
skipping kernel's own backward pass: models.attention._skipping_attention), each without and with
key blocks (`model.attn_key_block`: the blocks of keys no query of a chunk reads skipped too).

    python benchmarks/attention.py                       # the default geometry's student rows, tiny-default heads
    python benchmarks/attention.py --rows teacher        # its packed hindsight views (forward only matters there)
    python benchmarks/attention.py --rounds 20 --groups 4 8 --key-blocks 64 128
    python benchmarks/attention.py --rows teacher --pack-width 3584 --groups 1   # several views per row (train.pack_rows)

Every variant is compiled first, then timed once per round, the rounds interleaved (this box's
speed drifts between minutes); medians and interquartile ranges, and each variant over the
baseline as a ratio of medians. Also the pairs each variant scores (turnsight_jax.flops) over
the necessary ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, table  # noqa: E402
from geometries import GEOMETRIES, geometry_batch  # noqa: E402

from turnsight_jax import flops  # noqa: E402
from turnsight_jax.assets import default_tokenizer  # noqa: E402
from turnsight_jax.config import default_config, step_config  # noqa: E402
from turnsight_jax.models.attention import Layout, layout_attention  # noqa: E402
from turnsight_jax.models.config import get_preset  # noqa: E402
from turnsight_jax.rl.batch import make_train_batch  # noqa: E402
from turnsight_jax.rl.methods import resolve_method  # noqa: E402


def rows_layout(geometry: str, which: str, pack_width: int | None = None) -> Layout:
    """The Layout [B, T] of the geometry's student rows (plain causal) or packed hindsight views;
    with pack_width (train.pack_rows; 0: the batch's width) those rows packed several per row."""
    tok = default_tokenizer()
    trajs, row_tasks, turns = geometry_batch(geometry, tok)
    packing = {} if pack_width is None else {"pack_rows": True, "pack_width": pack_width}
    sc = dataclasses.replace(step_config(default_config()), max_turns=turns, length_classes=1, **packing)
    batch, _ = make_train_batch(trajs, row_tasks, tok, sc, resolve_method(sc))
    if which == "student":
        return (Layout.causal(jnp.asarray(batch.valid)) if pack_width is None
                else jax.tree.map(jnp.asarray, batch.packed.layout))
    views = batch.views
    return jax.tree.map(jnp.asarray, views.layout if pack_width is None else views.packed.layout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="default", choices=sorted(GEOMETRIES))
    ap.add_argument("--rows", default="student", choices=["student", "teacher"])
    ap.add_argument("--preset", default="tiny-default", help="the heads (query, key-value, head dim) of this preset")
    ap.add_argument("--q-chunk", type=int, default=128, help="model.attn_q_chunk (the embedded default's 128)")
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 8], help="model.attn_row_group values to compare")
    ap.add_argument("--key-blocks", type=int, nargs="*", default=[128],
                    help="model.attn_key_block values to compare, each with every row group")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--pack-width", type=int, default=None,
                    help="pack the rows (train.pack_rows) in rows at least this wide (0: the batch's width)")
    args = ap.parse_args()

    lay = rows_layout(args.geometry, args.rows, args.pack_width)
    b, t = lay.segment_ids.shape
    cfg = get_preset(args.preset)
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, t, cfg.num_heads, cfg.head_dim))
    k = jax.random.normal(ks[1], (b, t, cfg.num_kv_heads, cfg.head_dim))
    v = jax.random.normal(ks[2], (b, t, cfg.num_kv_heads, cfg.head_dim))
    w = jax.random.normal(ks[3], q.shape)
    live = flops.reads_any(jax.tree.map(np.asarray, lay))
    reach = flops.key_reach(jax.tree.map(np.asarray, lay))
    necessary = flops.layout_pairs(*(np.asarray(a) for a in (lay.segment_ids, lay.ctx1_segment, lay.ctx1_end,
                                                             lay.ctx2_segment, lay.ctx2_end)))
    print(f"machine: {machine()}")
    packed = "" if args.pack_width is None else ", packed"
    print(f"{args.geometry} geometry, {args.rows} rows{packed} [{b}, {t}], {int(live.sum())} live tokens, "
          f"{cfg.num_heads} / {cfg.num_kv_heads} heads of {cfg.head_dim}, query chunk {args.q_chunk}")

    programs = {}
    for group, kb in [(0, 0)] + [(g, kb) for g in args.groups for kb in [0] + list(args.key_blocks)]:
        def out(q, k, v, group=group, kb=kb):
            return layout_attention(q, k, v, lay, q_chunk=args.q_chunk, row_group=group, key_block=kb)

        def loss(q, k, v, out=out):
            return jnp.sum(out(q, k, v) * w)

        programs[group, kb] = (jax.jit(out), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))))
        for fn in programs[group, kb]:
            jax.block_until_ready(fn(q, k, v))
    times = {(g, p): [] for g in programs for p in (0, 1)}
    for _ in range(args.rounds):
        for g, fns in programs.items():
            for p, fn in enumerate(fns):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(q, k, v))
                times[g, p].append(time.perf_counter() - t0)

    def cell(g, p):
        xs = times[g, p]
        q1, _, q3 = statistics.quantiles(xs, n=4)
        return f"{statistics.median(xs):.3f} s ({q1:.3f}-{q3:.3f})", statistics.median(times[(0, 0), p]) / statistics.median(xs)

    rows = []
    for g, kb in programs:
        (fwd, rf), (both, rb) = cell((g, kb), 0), cell((g, kb), 1)
        scored = flops.skipping_pairs(live, args.q_chunk, g, reach=reach, key_block=kb)
        name = ("every chunk (autodiff, the baseline)" if g == 0 else f"row groups of {np.gcd(b, g)} (own backward)"
                + (f", key blocks of {kb}" if kb else ""))
        rows.append([name, fwd, f"{rf:.2f}x", both, f"{rb:.2f}x", f"{scored / necessary:.2f}"])
    print(table(rows, ["kernel", "forward", "over baseline", "forward + backward", "over baseline",
                       "pairs scored / necessary"]))
    print(f"medians of {args.rounds} interleaved rounds (interquartile ranges)")


if __name__ == "__main__":
    main()
