"""Train-step benchmark: time split (teacher views / student forward+backward / optimizer) and
MFU against a matmul peak measured in the same run.

    python benchmarks/train_step.py                      # CPU: bench-100m trunk, 16 trajectories
    python benchmarks/train_step.py --preset qwen3-0.6b --bf16 --rows 64 --peak-tflops 989   # GPU

Trajectories are real: built-in multi-hop tasks replayed through the environment (gold chains),
so the packed hindsight views have the real layout.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import machine, table, time_fn  # noqa: E402

from turnsight_jax.assets import default_tokenizer  # noqa: E402
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
    args = ap.parse_args()
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
