"""Train-step benchmark: time split (teacher views / student forward+backward / optimizer) and
MFU against a matmul peak measured in the same run; and the padding the update pays for.

    python benchmarks/train_step.py                      # CPU: bench-100m trunk, 16 trajectories
    python benchmarks/train_step.py --preset qwen3-0.6b --bf16 --rows 64 --peak-tflops 989   # GPU
    python benchmarks/train_step.py --geometry default       # the filing revision vs today's, same run
    python benchmarks/train_step.py --geometry default --rounds 3   # the same, every variant timed 3 times, interleaved
    python benchmarks/train_step.py --geometry paper-like    # the same at a paper-like length spread
    python benchmarks/train_step.py --geometry default --pack-width 2304 --teacher-pack-width 3584 --key-block 64 --kb-q-chunk 64
    python benchmarks/train_step.py --geometry default --pack-width 2304 --teacher-pack-width 3584 --key-block 32 \
        --kb-q-chunk 32 --kb-row-group 1 --kb-logprob-chunk 128

Trajectories are real: built-in multi-hop tasks replayed through the environment (gold chains),
so the packed hindsight views have the real layout.

`--geometry` compares, on one batch, the fused step at the revision issue 21 was filed against
(BEFORE_REV, extracted with `git archive`), today's with every row padded to the longest
(train.length_classes = 1), today's with `--classes` length classes and
today's with the rows packed (train.pack_rows, train.pack_width = `--pack-width`,
train.teacher_pack_width = `--teacher-pack-width`), and packed with the attention's key blocks
(model.attn_key_block = `--key-block`, model.attn_q_chunk = `--kb-q-chunk`, model.attn_row_group =
`--kb-row-group`, train.logprob_chunk = `--kb-logprob-chunk`), each timed in its own
process by benchmarks/_step_worker.py (the embedded default's step and model settings, with the
variant's fields on top), `--rounds` times interleaved (medians; per-round ratios); for
today's rows also the executed / necessary FLOPs of the update (turnsight_jax.flops) for the timed
model and, counted only, for Qwen3-8B at the same geometry. The geometries: benchmarks/geometries.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, table, time_fn  # noqa: E402
from geometries import GEOMETRIES, geometry_batch  # noqa: E402

from turnsight_jax.assets import default_tokenizer  # noqa: E402
from turnsight_jax.config import default_config, step_config  # noqa: E402
from turnsight_jax.rl.batch import make_train_batch  # noqa: E402
from turnsight_jax.envs.ftrl import FTRLEnv  # noqa: E402
from turnsight_jax.flops import update_flops  # noqa: E402
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_tasks, gold_turn_texts  # noqa: E402
from turnsight_jax.models.config import get_preset  # noqa: E402
from turnsight_jax.models.qwen3 import Qwen3, RuntimeOptions  # noqa: E402
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout  # noqa: E402
from turnsight_jax.rl.logprobs import student_logprobs, teacher_logprobs  # noqa: E402
from turnsight_jax.rl.config import AlgoConfig, StepConfig  # noqa: E402
from turnsight_jax.rl.losses import clipped_surrogate  # noqa: E402
from turnsight_jax.rl.methods import resolve_method  # noqa: E402
from turnsight_jax.rl.step import make_optimizer, make_train_step  # noqa: E402


BEFORE_REV = "f375277"  # the step issue 21 was filed against


def _worker(geometry: str, repeats: int, *, sets: dict | None = None, model: dict | None = None,
            tree: str | None = None) -> dict:
    """Time one fused step in a fresh process (benchmarks/_step_worker.py), with the package of
    `tree` first on the path (an extracted revision) or the current one; `sets`: StepConfig fields;
    `model`: cfg.model fields (ints)."""
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, str(HERE / "_step_worker.py"), "--geometry", geometry, "--repeats", str(repeats)]
    for key, value in (sets or {}).items():
        cmd += ["--set", f"{key}={str(value).lower()}"]
    for key, value in (model or {}).items():
        cmd += ["--model", f"{key}={value}"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"step worker failed ({' '.join(cmd)}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _extract(rev: str, into: str) -> str | None:
    """The package at git revision `rev`, extracted under `into`; None when git or the revision is missing."""
    repo = HERE.parent
    try:
        archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "turnsight_jax"], capture_output=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def compare_classes(args):
    """The step at the filing revision vs today's (one width, length classes, packed) on one batch:
    wall time (each in its own process, the variants interleaved `--rounds` times, medians) and,
    for today's rows, executed / necessary FLOPs."""
    print(f"machine: {machine()}")
    tok = default_tokenizer()
    trajs, row_tasks, turns = geometry_batch(args.geometry, tok)
    lengths = np.array([t.length for t in trajs])
    cfg = default_config()
    default_classes = cfg.train.length_classes
    q_chunk = cfg.model.attn_q_chunk
    # the head as it was before vocabulary blocks: the whole vocabulary per chunk, in the chunks
    # the embedded default then used (256 rows for the update, 32 for the no-gradient forwards)
    whole = ({"length_classes": 1, "logprob_chunk": 256, "score_chunk": 32}, {"vocab_block": 0})
    packing = {"length_classes": 1, "pack_rows": True, "pack_width": args.pack_width,
               "teacher_pack_width": args.teacher_pack_width}
    variants = {"whole-vocabulary head": whole, "one width": ({"length_classes": 1}, {}),
                "classes": ({"length_classes": args.classes}, {}),
                "packed": (packing, {})}
    if args.key_block:
        kb_sets = {**packing, **({"logprob_chunk": args.kb_logprob_chunk} if args.kb_logprob_chunk else {})}
        variants["packed, key blocks"] = (kb_sets, {"attn_key_block": args.key_block,
                                                    "attn_q_chunk": args.kb_q_chunk or q_chunk,
                                                    "attn_row_group": args.kb_row_group or cfg.model.attn_row_group})
    walls: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tree = _extract(BEFORE_REV, tmp)
        if tree is None:
            print(f"(git revision {BEFORE_REV} not available: the filing revision's row is left out)")
        before_shape = None
        # interleaved rounds: this box's speed drifts by 10-20% between minutes, so every variant
        # is timed once per round and the ratios are taken within rounds as well as of the medians
        for r in range(args.rounds):
            if tree is not None:
                res = _worker(args.geometry, args.repeats, tree=tree)
                walls.setdefault("before", []).append(res["wall"])
                before_shape = res
            for name, (sets, model_sets) in variants.items():
                walls.setdefault(name, []).append(_worker(args.geometry, args.repeats, sets=sets,
                                                          model=model_sets)["wall"])
            print(f"  round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in walls.items()),
                  flush=True)
    med = {k: float(np.median(v)) for k, v in walls.items()}
    rows = []
    if before_shape is not None:
        rows.append([f"the step at {BEFORE_REV}, issue 21's filing (T={before_shape['T']:.0f}, "
                     f"P={before_shape['P']:.0f})", _spread(walls["before"]), "-", "(not counted: an earlier revision)",
                     "-"])
    for name, (sets, model_sets) in variants.items():
        k = sets.get("length_classes", 1)
        sc = dataclasses.replace(step_config(cfg), max_turns=turns, **sets)
        batch, stats = make_train_batch(trajs, row_tasks, tok, sc, resolve_method(sc))
        model = {**cfg.model.to_dict(), **model_sets}
        counts = {p: update_flops(get_preset(p), batch, updates=1, q_chunk=model["attn_q_chunk"], remat=model["remat"],
                                  teacher_distinct_rows=stats["teacher_distinct_rows"], logprob_chunk=sc.logprob_chunk,
                                  score_chunk=sc.scoring_chunk, row_group=model["attn_row_group"],
                                  key_block=model["attn_key_block"])
                  for p in ("tiny-default", "qwen3-8b")}
        widths = (f"T={stats['T']:.0f}, P={stats['P']:.0f}" if k == 1 else
                  "T=" + "/".join(f"{stats[f'T{i}']:.0f}" for i in range(k)) + ", P=" +
                  "/".join(f"{stats[f'P{i}']:.0f}" for i in range(k)))
        b_, v_ = len(trajs), batch.views
        if batch.packed is not None:
            (rt, wt), (rp, wp) = batch.packed.tokens.shape, v_.packed.tokens.shape
            slots_t, slots_p = rt * wt, rp * wp
            label = (f"today, packed (train.pack_rows, pack_width={args.pack_width}, teacher_pack_width="
                     f"{args.teacher_pack_width}): {b_} trajectories in {rt} rows of {wt}, {b_} hindsight rows in "
                     f"{rp} of {wp}")
            if model_sets:
                label += (f", key blocks of {model['attn_key_block']} (query chunks of {model['attn_q_chunk']}, "
                          f"row groups of {model['attn_row_group']}, head chunks of {sc.logprob_chunk})")
        else:
            slots_t = sum(batch.classes.widths[c] for c in batch.length_class) if k > 1 else b_ * batch.tokens.shape[1]
            slots_p = sum(v_.classes.widths[c] for c in v_.row_class) if k > 1 else b_ * v_.tokens.shape[1]
            label = f"today, {k} class{'es' if k > 1 else ''} ({widths})"
            if model_sets:
                label += ", the whole-vocabulary head (vocab_block 0; chunks 256 / 32)"
            elif k == default_classes:
                label += " (the embedded default)"
        rows.append([label, _spread(walls[name]),
                     f"{slots_t / lengths.sum():.2f} / {slots_p / stats['view_tokens']:.2f}",
                     *(" / ".join(f"{e / n:.2f}" for n, e in (c.parts["student"], c.parts["teacher"]))
                       + f" / **{c.ratio:.2f}**" for c in counts.values())])
    print(f"geometry {args.geometry}: {len(trajs)} trajectories of {lengths.min()}-{lengths.max()} tokens "
          f"(mean {lengths.mean():.0f}), {sum(t.num_turns for t in trajs) / len(trajs):.1f} turns on average; "
          f"timed model tiny-default (f32, the embedded default's step and model settings), one update; "
          f"median of {args.rounds} interleaved round(s), each the median of {args.repeats} steps")
    print(table(rows, ["step", "fused step (tiny-default)", "token slots / real tokens: student / teacher",
                       "executed / necessary: student / teacher / update (tiny-default)",
                       "same, counted for qwen3-8b"]))
    print(f"the head in vocabulary blocks over the whole-vocabulary head (one width): "
          f"{med['whole-vocabulary head'] / med['one width']:.2f}x")
    print(f"speed-up over one width: {med['one width'] / med['classes']:.2f}x ({args.classes} length classes), "
          f"{med['one width'] / med['packed']:.2f}x (packed)"
          + (f", {med['one width'] / med['packed, key blocks']:.2f}x (packed, key blocks)" if "packed, key blocks" in med
             else ""))
    if "before" in walls:
        print(f"today's step over the step at {BEFORE_REV} (medians): "
              f"{med['before'] / med['whole-vocabulary head']:.2f}x (one width, whole-vocabulary head), "
              f"{med['before'] / med['one width']:.2f}x (one width), "
              f"{med['before'] / med['classes']:.2f}x ({args.classes} classes), "
              f"{med['before'] / med['packed']:.2f}x (packed)"
              + (f", {med['before'] / med['packed, key blocks']:.2f}x (packed, key blocks)"
                 if "packed, key blocks" in med else ""))
        default = "classes" if default_classes == args.classes else "one width" if default_classes == 1 else None
        if default is not None:
            per_round = [b / t for b, t in zip(walls["before"], walls[default])]
            print(f"the embedded default's setting ({default}) over the step at {BEFORE_REV}, round by round: "
                  + ", ".join(f"{x:.2f}x" for x in per_round))


def _spread(values: list[float]) -> str:
    """The median of `values` in seconds, with their range when there are several."""
    med = f"{np.median(values):.2f} s"
    return med if len(values) == 1 else f"{med} ({min(values):.2f}-{max(values):.2f})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench-100m")
    ap.add_argument("--rows", type=int, default=16, help="trajectories per step")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--q-chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="device peak for MFU; 0 = measure a float32 matmul peak in this run (CPU)")
    ap.add_argument("--geometry", choices=GEOMETRIES, default=None,
                    help="compare the step at the filing revision, one width and length classes on this geometry")
    ap.add_argument("--classes", type=int, default=2, help="length classes of the --geometry comparison")
    ap.add_argument("--rounds", type=int, default=1,
                    help="--geometry: time every variant this many times, interleaved (medians and per-round ratios)")
    ap.add_argument("--pack-width", type=int, default=0,
                    help="train.pack_width of the --geometry comparison's packed rows (0: the batch's width)")
    ap.add_argument("--teacher-pack-width", type=int, default=0,
                    help="train.teacher_pack_width of the packed rows (0: --pack-width)")
    ap.add_argument("--key-block", type=int, default=0,
                    help="> 0: also time the packed rows with model.attn_key_block of this many keys")
    ap.add_argument("--kb-q-chunk", type=int, default=0,
                    help="model.attn_q_chunk of the key-block variant (0: the embedded default's)")
    ap.add_argument("--kb-row-group", type=int, default=0,
                    help="model.attn_row_group of the key-block variant (0: the embedded default's)")
    ap.add_argument("--kb-logprob-chunk", type=int, default=0,
                    help="train.logprob_chunk of the key-block variant (0: the embedded default's)")
    args = ap.parse_args()
    if args.geometry:
        return compare_classes(args)
    print(f"machine: {machine()}")
    tok = default_tokenizer()
    n_tasks = args.rows // args.group
    tasks = generate_tasks(n_tasks, seed=5, categories=("multi_hop",), config=SyntheticConfig(hops=3))
    scripts = [gold_turn_texts(t) for t in tasks for _ in range(args.group)]
    with FTRLEnv(num_workers=1) as env:
        trajs = rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=args.group,
                        config=RolloutConfig(max_turns=6, max_response_tokens=2048)).trajectories
    rng = np.random.default_rng(0)
    for i, t in enumerate(trajs):
        t.reward = float(rng.random())
        t.old_logprobs = np.where(t.policy_mask, -1.0, 0.0).astype(np.float32)

    dtype = jnp.bfloat16 if args.bf16 else jnp.float32
    cfg = get_preset(args.preset)
    opts = RuntimeOptions(compute_dtype=dtype, attn_q_chunk=args.q_chunk)
    model = Qwen3(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32, options=opts)
    graphdef, params = nnx.split(model)
    ref = jax.tree.map(lambda x: x.astype(dtype), params)
    sc = StepConfig(algo=AlgoConfig(method="turnsight"), group_size=args.group, max_turns=6, logprob_chunk=256)
    batch, stats = make_train_batch(trajs, [t for t in tasks for _ in range(args.group)], tok, sc, resolve_method(sc))
    batch = jax.tree.map(jnp.asarray, batch)
    optimizer = make_optimizer(sc.optim)
    opt_state = optimizer.init(params)

    ref_model = nnx.merge(graphdef, ref)
    teacher = jax.jit(lambda v: teacher_logprobs(ref_model, v, chunk=256))

    def student_loss(p, b):
        lp = student_logprobs(nnx.merge(graphdef, p), b.tokens, b.valid, b.pol_pos, chunk=256)
        loss, _ = clipped_surrogate(lp, b.old_logprobs, jnp.ones_like(lp), sc.loss)
        return jnp.sum(loss * b.pol_valid) / jnp.maximum(b.pol_valid.sum(), 1)

    student = jax.jit(jax.grad(student_loss))
    grads = student(params, batch)
    update = jax.jit(lambda g, s, p: optimizer.update(g, s, p))
    step = make_train_step(graphdef, sc, optimizer)

    t_teacher = time_fn(lambda: teacher(batch.views), repeats=args.repeats)
    t_student = time_fn(lambda: student(params, batch), repeats=args.repeats)
    t_opt = time_fn(lambda: update(grads, opt_state, params), repeats=args.repeats)
    p2, s2 = jax.tree.map(jnp.copy, params), optimizer.init(params)
    holder = {"p": p2, "s": s2}

    def full():
        holder["p"], holder["s"], m = step(holder["p"], holder["s"], ref, batch)
        return m

    t_full = time_fn(full, repeats=args.repeats)

    # FLOPs: the one counter (turnsight_jax.flops): necessary work for MFU, executed for the padding ratio
    nb = jax.tree.map(np.asarray, batch)
    work = update_flops(cfg, nb, updates=1, q_chunk=args.q_chunk, remat=opts.remat,
                        teacher_distinct_rows=stats["teacher_distinct_rows"])
    rows = int(nb.pol_valid.sum())
    distinct = stats["teacher_distinct_rows"]
    f_teacher, f_student = work.parts["teacher"][0], work.parts["student"][0]
    peak = args.peak_tflops * 1e12
    if not peak:
        n = 2048
        a = jnp.ones((n, n), jnp.float32)
        mm = jax.jit(lambda x: x @ x)
        t_mm = time_fn(lambda: mm(a), repeats=5)
        peak = 2 * n**3 / t_mm
        print(f"measured float32 matmul peak: {peak / 1e9:.1f} GFLOP/s (2048^3, jit, same run)")
    f_total = f_teacher + f_student
    rows_out = [
        ["teacher: packed 3-depth views (forward)", f"{t_teacher * 1e3:.0f} ms", f"{f_teacher / t_teacher / peak:.1%}"],
        ["student forward + backward", f"{t_student * 1e3:.0f} ms", f"{f_student / t_student / peak:.1%}"],
        ["optimizer (AdamW + clip)", f"{t_opt * 1e3:.0f} ms", ""],
        ["fused step (all of the above, one jit)", f"{t_full * 1e3:.0f} ms", f"{f_total / t_full / peak:.1%}"],
        ["executed / necessary FLOPs (teacher, student, step)",
         " / ".join(f"{e / n:.2f}x" for n, e in (work.parts["teacher"], work.parts["student"])) + f" / {work.ratio:.2f}x",
         ""],
        ["sum of the separately jitted parts", f"{(t_teacher + t_student + t_opt) * 1e3:.0f} ms",
         f"fused/sum = {t_full / (t_teacher + t_student + t_opt):.2f}x"],
    ]
    print(f"model {args.preset} ({cfg.num_params() / 1e6:.0f}M params), {'bf16' if args.bf16 else 'f32'}; "
          f"{len(trajs)} trajectories, T={stats['batch_width']:.0f}, policy tokens {rows}, packed row "
          f"{stats['packed_width']:.0f} ({stats['view_overhead']:.2f}x the trajectory tokens), distinct teacher rows "
          f"{distinct:.0f}")
    print(table(rows_out, ["part", "time (median)", "MFU"]))


if __name__ == "__main__":
    main()
