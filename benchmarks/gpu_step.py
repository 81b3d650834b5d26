"""Accelerator step benchmark (issue 21): the fused TurnSight step at a Qwen3 shape in bf16 with the
XLA attention kernel (models.attention) against the fused Pallas kernel (models.fused_attention,
model.attn_impl = "pallas"), in one run on one device:

1. parity: the fused kernel against the XLA kernel in float32 (the reference) on the batch's own
   packed layouts, values and gradients, in float32 and in bf16;
2. attention alone: one layer's attention (the model's heads) over the student's and the
   teacher's packed rows, forward and forward + backward, each kernel, time and the necessary
   pairs' TFLOP/s;
0. counted only (any machine): the update's executed / necessary FLOPs under each kernel;
3. the step: the teacher's forward over its packed views, the student's forward + backward (its
   log-probs under a gradient), and the whole fused step (one jit), each kernel; MFU = the
   necessary FLOPs of turnsight_jax.flops (the trainer's counter) / time / peak, and the
   executed / necessary ratio of each part.

The peak: a bf16 matmul (8192^3, `--peak-size`) measured in the same run, and the chip's dense bf16 figure
(`--spec-tflops`). The batch is built here (a CPU; the rollout's tools run sandboxed) and
carried:

    python benchmarks/gpu_step.py --save-batch .devdata/paper_like.pkl            # here
    python benchmarks/gpu_step.py --load-batch .devdata/paper_like.pkl --preset qwen3-0.6b   # on the GPU

Every variant is compiled first, then timed `--repeats` times (medians). A section that fails
prints its error and the rest still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import pickle
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, table, time_fn  # noqa: E402

from turnsight_jax import flops  # noqa: E402
from turnsight_jax.config import default_config, step_config  # noqa: E402
from turnsight_jax.models.attention import Layout, layout_attention  # noqa: E402
from turnsight_jax.models.config import get_preset  # noqa: E402
from turnsight_jax.models.fused_attention import block_plan, fused_attention  # noqa: E402
from turnsight_jax.models.qwen3 import Qwen3, RuntimeOptions  # noqa: E402
from turnsight_jax.rl.batch import packed_reference  # noqa: E402
from turnsight_jax.rl.logprobs import policy_logprobs, teacher_logprobs  # noqa: E402
from turnsight_jax.rl.methods import resolve_method  # noqa: E402
from turnsight_jax.rl.step import make_optimizer, make_train_step  # noqa: E402


def build_batch(args):
    """(numpy TrainBatch, build stats, StepConfig): the geometry's trajectories packed at the
    given widths, under the embedded default's step settings with a GPU's head chunk."""
    from geometries import geometry_batch

    from turnsight_jax.assets import default_tokenizer
    from turnsight_jax.rl.batch import make_train_batch

    tok = default_tokenizer()
    trajs, row_tasks, turns = geometry_batch(args.geometry, tok)
    sc = dataclasses.replace(step_config(default_config()), max_turns=turns, length_classes=1, pack_rows=True,
                             pack_width=args.pack_width, teacher_pack_width=args.teacher_pack_width,
                             logprob_chunk=args.logprob_chunk, score_chunk=args.logprob_chunk)
    batch, stats = make_train_batch(trajs, row_tasks, tok, sc, resolve_method(sc))
    return jax.tree.map(np.asarray, batch), dict(stats), sc


def _lay(layout) -> Layout:
    return jax.tree.map(jnp.asarray, layout)


def _qkv(layout: Layout, cfg, dtype, seed=0):
    b, t = layout.segment_ids.shape
    ks = jax.random.split(jax.random.key(seed), 3)
    shape_q, shape_kv = (b, t, cfg.num_heads, cfg.head_dim), (b, t, cfg.num_kv_heads, cfg.head_dim)
    return tuple(jax.random.normal(k, s, jnp.float32).astype(dtype)
                 for k, s in zip(ks, (shape_q, shape_kv, shape_kv)))


def _attend(impl: str, layout: Layout, args, block: int = 0):
    if impl == "xla":
        return lambda q, k, v: layout_attention(q, k, v, layout, q_chunk=args.q_chunk, row_group=args.row_group,
                                                key_block=args.key_block)
    plan = block_plan(layout, block or args.block)
    return lambda q, k, v: fused_attention(q, k, v, plan, interpret=impl == "pallas_interpret")


def parity(batch, cfg, args, out: dict):
    """The fused kernel against float32 XLA on the first rows of the student's and the teacher's
    packed layouts: max |error| / max |reference| of the outputs and the q, k, v gradients."""
    rows = []
    for name, layout in (("student", batch.packed.layout), ("teacher", batch.views.packed.layout)):
        lay = _lay(jax.tree.map(lambda a: a[:2], layout))
        q32, k32, v32 = _qkv(lay, cfg, jnp.float32)
        w = jax.random.normal(jax.random.key(9), q32.shape)
        ref_fn = _attend("xla", lay, args)
        grad = lambda fn: jax.jit(jax.value_and_grad(
            lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2)))
        want, want_g = grad(ref_fn)(q32, k32, v32)
        want_out = jax.jit(ref_fn)(q32, k32, v32)
        fused = _attend([i for i in args.impls if i != "xla"][-1], lay, args)
        for dtype in (jnp.float32, jnp.bfloat16):
            args_ = [a.astype(dtype) for a in (q32, k32, v32)]
            got_out = jax.jit(fused)(*args_).astype(jnp.float32)
            _, got_g = grad(fused)(*args_)
            rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))
            errs = [rel(got_out, want_out)] + [rel(a, b) for a, b in zip(got_g, want_g)]
            rows.append([name, jnp.dtype(dtype).name, *(f"{e:.1e}" for e in errs)])
            out.setdefault("parity", []).append({"rows": name, "dtype": jnp.dtype(dtype).name, "out": errs[0],
                                                 "dq": errs[1], "dk": errs[2], "dv": errs[3]})
    print("parity: the fused kernel vs float32 XLA (max |error| / max |reference|)")
    print(table(rows, ["rows", "dtype", "out", "dq", "dk", "dv"]), flush=True)


def attention_alone(batch, cfg, args, out: dict):
    rows = []
    for name, layout in (("student", batch.packed.layout), ("teacher", batch.views.packed.layout)):
        lay = _lay(layout)
        need = flops.attention_flops(cfg, flops.layout_pairs(*(np.asarray(getattr(layout, f)) for f in (
            "segment_ids", "ctx1_segment", "ctx1_end", "ctx2_segment", "ctx2_end")))) / cfg.num_layers
        q, k, v = _qkv(lay, cfg, jnp.bfloat16)
        times = {}
        variants = [(impl, 0) for impl in args.impls] + [(impl, b) for impl in args.impls if impl != "xla"
                                                         for b in args.attn_blocks if b != args.block]
        for impl, block in variants:
            fn = _attend(impl, lay, args, block)
            fwd = jax.jit(fn)
            both = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
            label = impl if impl == "xla" else f"{impl} tiles {block or args.block}"
            times[label] = (time_fn(lambda: fwd(q, k, v), repeats=args.repeats),
                            time_fn(lambda: both(q, k, v), repeats=args.repeats))
        base = times.get("xla", next(iter(times.values())))
        for impl, (tf, tb) in times.items():
            rows.append([name, f"{tuple(lay.segment_ids.shape)}", impl, f"{tf * 1e3:.2f} ms", f"{tb * 1e3:.2f} ms",
                         f"{need / tf / 1e12:.1f}", f"{3 * need / tb / 1e12:.1f}",
                         f"{base[0] / tf:.2f}x / {base[1] / tb:.2f}x"])
            out.setdefault("attention", []).append({"rows": name, "impl": impl, "forward_s": tf, "grad_s": tb,
                                                    "necessary_flops_forward": need})
    print(f"attention alone: one layer ({cfg.num_heads} query / {cfg.num_kv_heads} kv heads, head_dim {cfg.head_dim}), "
          "bf16; TFLOP/s of the necessary pairs (forward + backward = 3 forwards)")
    print(table(rows, ["rows", "[B, T]", "kernel", "forward", "fwd + bwd", "TFLOP/s fwd", "TFLOP/s fwd+bwd",
                       "speed vs xla (fwd / fwd+bwd)"]), flush=True)


def step_parts(batch, stats, sc, cfg, args, peak: float, out: dict):
    method = resolve_method(sc)
    dev = jax.tree.map(jnp.asarray, batch)
    rows = []
    for impl in sorted(args.impls, key=lambda i: i == "xla"):  # the fused kernel first
        opts = RuntimeOptions(compute_dtype=jnp.bfloat16, remat=args.remat, attn_q_chunk=args.q_chunk,
                              attn_row_group=args.row_group if impl == "xla" else 0,
                              attn_key_block=args.key_block if impl == "xla" else 0, attn_impl=impl,
                              attn_block=args.block)
        model = Qwen3(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32, options=opts)
        graphdef, params = nnx.split(model)
        ref = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
        work = flops.update_flops(cfg, batch, updates=1, q_chunk=args.q_chunk, remat=args.remat,
                                  ref_forward=method.needs_ref and not packed_reference(sc, method),
                                  teacher_distinct_rows=stats["teacher_distinct_rows"],
                                  logprob_chunk=sc.logprob_chunk, score_chunk=sc.scoring_chunk,
                                  row_group=opts.attn_row_group, key_block=opts.attn_key_block,
                                  fused_block=args.block if impl != "xla" else 0)
        teacher = jax.jit(lambda r, v: teacher_logprobs(nnx.merge(graphdef, r), v, chunk=sc.scoring_chunk))
        t_teacher = time_fn(lambda: teacher(ref, dev.views), repeats=args.repeats)

        def student_loss(p, b):  # the policy's log-probs under a gradient, as the update takes them
            lp = policy_logprobs(nnx.merge(graphdef, p), b.replace(views=None), chunk=sc.logprob_chunk)
            return jnp.sum(jnp.where(b.pol_valid, lp, 0.0)) / jnp.maximum(b.pol_valid.sum(), 1)

        student = jax.jit(jax.grad(student_loss))
        t_student = time_fn(lambda: student(params, dev), repeats=args.repeats)
        del student
        optimizer = make_optimizer(sc.optim)
        step = make_train_step(graphdef, sc, optimizer, method)
        holder = {"p": jax.tree.map(jnp.copy, params), "s": optimizer.init(params)}

        def full():
            holder["p"], holder["s"], m = step(holder["p"], holder["s"], ref, dev)
            return m

        t_step = time_fn(full, repeats=args.repeats)
        n_teacher, e_teacher = work.parts["teacher"]
        n_student, e_student = work.parts["student"]
        rows.append([impl, "teacher forward (packed views)", f"{t_teacher * 1e3:.0f} ms",
                     f"{n_teacher / t_teacher / peak['measured']:.1%}", f"{n_teacher / t_teacher / peak['spec']:.1%}",
                     f"{e_teacher / n_teacher:.2f}"])
        rows.append([impl, "student forward + backward (packed rows)", f"{t_student * 1e3:.0f} ms",
                     f"{n_student / t_student / peak['measured']:.1%}", f"{n_student / t_student / peak['spec']:.1%}",
                     f"{e_student / n_student:.2f}"])
        rows.append([impl, "whole fused step (one jit)", f"{t_step * 1e3:.0f} ms",
                     f"{work.necessary / t_step / peak['measured']:.1%}",
                     f"{work.necessary / t_step / peak['spec']:.1%}", f"{work.ratio:.2f}"])
        out.setdefault("step", []).append({"impl": impl, "teacher_s": t_teacher, "student_s": t_student, "step_s": t_step,
                                           "necessary": {k: v[0] for k, v in work.parts.items()},
                                           "executed": {k: v[1] for k, v in work.parts.items()},
                                           "student_ratio": e_student / n_student})
        print(f"  {impl}: teacher {t_teacher * 1e3:.0f} ms, student {t_student * 1e3:.0f} ms, step {t_step * 1e3:.0f} ms",
              flush=True)
        del holder, step, teacher
    print(f"the step: {cfg.num_layers} layers, bf16 compute, remat={args.remat}; MFU = necessary FLOPs "
          f"(turnsight_jax.flops) / time / peak (measured {peak['measured'] / 1e12:.0f}, spec {peak['spec'] / 1e12:.0f} "
          "TFLOP/s)")
    print(table(rows, ["kernel", "part", "time (median)", "MFU (measured peak)", "MFU (spec peak)",
                       "executed / necessary"]), flush=True)


def count(batch, stats, sc, args, out: dict):
    """The update's executed / necessary FLOPs (the trainer's counter) under each kernel, counted
    only (any machine): the XLA kernel as --q-chunk/--row-group/--key-block set it and with
    chunks and key blocks of 32, the fused kernel at --block and --attn-blocks."""
    method = resolve_method(sc)
    variants = [(f"xla, query chunks of {args.q_chunk}, row groups of {args.row_group}, key blocks of {args.key_block}",
                 dict(q_chunk=args.q_chunk, row_group=args.row_group, key_block=args.key_block)),
                ("xla, query chunks of 32, row groups of 1, key blocks of 32", dict(q_chunk=32, row_group=1, key_block=32))]
    variants += [(f"fused, tiles of {b}", dict(q_chunk=args.q_chunk, fused_block=b))
                 for b in dict.fromkeys([args.block, *args.attn_blocks])]
    rows = []
    for name, kw in variants:
        cells = [name]
        for preset in args.count_presets:
            w = flops.update_flops(get_preset(preset), batch, updates=1, remat=args.remat,
                                   ref_forward=method.needs_ref and not packed_reference(sc, method),
                                   teacher_distinct_rows=stats["teacher_distinct_rows"], logprob_chunk=sc.logprob_chunk,
                                   score_chunk=sc.scoring_chunk, **kw)
            (ns, es), (nt, et) = w.parts["student"], w.parts["teacher"]
            cells.append(f"{w.ratio:.2f} / {es / ns:.2f} / {et / nt:.2f}")
            out.setdefault("count", []).append({"kernel": name, "preset": preset, "update": w.ratio,
                                                "student": es / ns, "teacher": et / nt})
        rows.append(cells)
    print(f"counted (not timed): the update's executed / necessary FLOPs, remat={args.remat}")
    print(table(rows, ["kernel"] + [f"{p}: update / student / teacher" for p in args.count_presets]), flush=True)


def measure_peak(args) -> dict:
    n = args.peak_size
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x: (x @ x).astype(jnp.bfloat16))
    t = time_fn(lambda: mm(a), repeats=10, warmup=3)
    return {"measured": 2 * n**3 / t, "spec": args.spec_tflops * 1e12}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="paper-like")
    ap.add_argument("--pack-width", type=int, default=3328)
    ap.add_argument("--teacher-pack-width", type=int, default=10240)
    ap.add_argument("--logprob-chunk", type=int, default=2048)
    ap.add_argument("--save-batch", default="", help="build the batch (here, a CPU), save it there and stop")
    ap.add_argument("--load-batch", default="", help="the batch --save-batch wrote")
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--impls", nargs="+", default=["xla", "pallas"],
                    help="xla | pallas | pallas_interpret (the kernel interpreted: a CPU check of this script)")
    ap.add_argument("--block", type=int, default=64, help="model.attn_block of the fused kernel")
    ap.add_argument("--attn-blocks", type=int, nargs="*", default=[128],
                    help="attention alone: the fused kernel also at these tile sides")
    ap.add_argument("--q-chunk", type=int, default=512, help="model.attn_q_chunk of the XLA kernel")
    ap.add_argument("--row-group", type=int, default=1, help="model.attn_row_group of the XLA kernel")
    ap.add_argument("--key-block", type=int, default=0, help="model.attn_key_block of the XLA kernel")
    ap.add_argument("--remat", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-size", type=int, default=8192,
                    help="the measured peak's bf16 matmul side (8192 on an accelerator; a CPU check of this script: ~512)")
    ap.add_argument("--spec-tflops", type=float, default=989.0, help="the chip's dense bf16 peak (H100/H200: 989)")
    ap.add_argument("--sections", nargs="+", default=["count", "parity", "attention", "step"],
                    help="count (FLOPs counted only, any machine) | parity | attention | step")
    ap.add_argument("--count-presets", nargs="+", default=["qwen3-0.6b", "qwen3-8b"])
    ap.add_argument("--json", default="", help="also write the figures here")
    args = ap.parse_args()
    if args.save_batch:
        batch, stats, sc = build_batch(args)
        pathlib.Path(args.save_batch).parent.mkdir(parents=True, exist_ok=True)
        with open(args.save_batch, "wb") as f:
            pickle.dump({"batch": batch, "stats": stats, "step_config": sc}, f)
        print(f"saved {args.save_batch}: packed student rows {batch.packed.tokens.shape}, teacher rows "
              f"{batch.views.packed.tokens.shape}")
        return
    print(f"machine: {machine()}", flush=True)
    if args.load_batch:
        with open(args.load_batch, "rb") as f:
            saved = pickle.load(f)
        batch, stats, sc = saved["batch"], saved["stats"], saved["step_config"]
    else:
        batch, stats, sc = build_batch(args)
    cfg = get_preset(args.preset)
    print(f"model {args.preset} ({cfg.num_params() / 1e6:.0f}M params); {int(np.asarray(batch.valid).sum())} trajectory "
          f"tokens in {batch.valid.shape[0]} trajectories; packed student rows {batch.packed.tokens.shape}, teacher "
          f"rows {batch.views.packed.tokens.shape}; kernels {args.impls} (fused tiles of {args.block})", flush=True)
    out: dict = {"machine": machine(), "preset": args.preset, "args": vars(args)}
    t0 = time.time()
    sections = {"count": lambda: count(batch, stats, sc, args, out),
                "parity": lambda: parity(batch, cfg, args, out),
                "attention": lambda: attention_alone(batch, cfg, args, out),
                "step": lambda: step_parts(batch, stats, sc, cfg, args, out.setdefault("peak", measure_peak(args)), out)}
    for name in args.sections:
        try:
            sections[name]()
        except Exception:  # report and go on: one failing section must not cost the others' figures
            print(f"section {name} failed:\n{traceback.format_exc()}", flush=True)
            out.setdefault("failed", []).append(name)
        print(f"[{time.time() - t0:.0f} s]", flush=True)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
