"""The baselines' train step (the self-distillation methods of issue 23, PPO with its critic)
against GRPO's, in one process, at the embedded default's geometry (8 built-in tasks x 4 replayed
gold chains, random rewards).

    python benchmarks/baselines.py [--repeats 5] [--methods grpo,turnsight,rlsd,sdpo,sdar,sod,ppo]

Each method's step and teacher settings are its tiny config's (configs/methods/<name>.py; GRPO
and TurnSight are the embedded default's): the same model (tiny-default, f32), the same batch of
trajectories, one fused update each. SOD's external teacher is the `warm_start` of its tiny config:
a second model of the policy's architecture (its own parameters; another random init here). The
rewards are uniform in [0, 1), so SDPO's sibling source counts a sibling as successful at reward
>= 0.5 (the tiny config's 1.0 would skip every view on these rewards). Prints a table: median
wall seconds per step, the ratio to GRPO, the packed teacher tokens and the teacher's share of the
update's necessary FLOPs (turnsight_jax.flops, the counter the trainer logs), and the critic's
(PPO: a trunk forward for V_old and a forward+backward of the value loss; "turnsight(ppo)" is
TurnSight over PPO as its base; PiCA adds its step-PRM, a frozen-trunk forward and a head update),
and the host seconds of the method's rewards on the batch (SRL's difflib similarities are all
host-side: its step is GRPO's). Orchard's teacher columns are its retrospective probe rows (the
trajectory once plus one question per state, methods.orchard)."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from common import machine, table, time_fn  # noqa: E402
from geometries import geometry_batch  # noqa: E402

from turnsight_jax import flops  # noqa: E402
from turnsight_jax.assets import default_tokenizer  # noqa: E402
from turnsight_jax.config import default_config, load_config_file, step_config  # noqa: E402
from turnsight_jax.model_setup import runtime_options  # noqa: E402
from turnsight_jax.models.config import get_preset  # noqa: E402
from turnsight_jax.models.qwen3 import Qwen3  # noqa: E402
from turnsight_jax.rl.batch import compute_signals, make_train_batch, packed_reference  # noqa: E402
from turnsight_jax.rl.methods import resolve_method  # noqa: E402
from turnsight_jax.rl.step import init_aux, make_aux_optimizers, make_optimizer, make_train_step  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
METHODS = ("grpo", "turnsight", "rlsd", "sdpo", "sdpo_advantage", "sdar", "sod", "ppo", "turnsight(ppo)", "pica", "srl",
           "toolomni", "orchard")


def method_config(name: str):
    """The run config of a method: its tiny config file, the default for grpo / turnsight."""
    if name in ("grpo", "turnsight"):
        cfg = default_config()
        cfg.rl.method = name
        return cfg
    if name == "turnsight(ppo)":
        cfg = load_config_file(REPO / "configs" / "methods" / "ppo.py")
        cfg.rl.method, cfg.rl.base = "turnsight", "ppo"
        return cfg
    cfg = load_config_file(REPO / "configs" / "methods" / f"{'sdpo' if name == 'sdpo_advantage' else name}.py")
    if name == "sdpo_advantage":
        cfg.rl.method = name
    if cfg.privileged.source == "sibling":
        cfg.privileged.sibling_min_reward = 0.5
    return cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--methods", default=",".join(METHODS))
    args = ap.parse_args()
    names = args.methods.split(",")
    if "grpo" not in names:
        names.insert(0, "grpo")
    tok = default_tokenizer()
    trajs, row_tasks, turns = geometry_batch("default", tok)
    qcfg = get_preset("tiny-default")
    rows, walls = [], {}
    for name in names:
        cfg = method_config(name)
        sc = dataclasses.replace(step_config(cfg), max_turns=turns)
        method = resolve_method(sc)
        batch, stats = make_train_batch(trajs, row_tasks, tok, sc, method)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            compute_signals(method, trajs, row_tasks, sc)
        host = (time.perf_counter() - t0) / args.repeats
        model = Qwen3(qcfg, rngs=nnx.Rngs(0), param_dtype=jnp.float32, options=runtime_options(cfg))
        graphdef, params = nnx.split(model)
        external = method.needs_views and sc.teacher.weights == "external"
        tgraph = tparams = None
        if external:
            tgraph, tparams = nnx.split(Qwen3(qcfg, rngs=nnx.Rngs(1), param_dtype=jnp.float32,
                                              options=runtime_options(cfg)))
        optimizer = make_optimizer(sc.optim)
        aux_opts = make_aux_optimizers(sc, method)
        step = make_train_step(graphdef, sc, optimizer, method, teacher_graphdef=tgraph, aux_optimizers=aux_opts)
        dev = jax.tree.map(jnp.asarray, batch)
        holder = {"p": jax.tree.map(jnp.copy, params), "s": optimizer.init(params),
                  "c": init_aux(method, params, qcfg.hidden_size, aux_opts) if method.aux else None}

        def full():
            if method.aux:
                holder["p"], holder["s"], m, holder["c"] = step(holder["p"], holder["s"], params, dev, tparams,
                                                                holder["c"])
            else:
                holder["p"], holder["s"], m = step(holder["p"], holder["s"], params, dev, tparams)
            return m

        walls[name] = time_fn(full, repeats=args.repeats)
        work = flops.update_flops(qcfg, batch, updates=sc.ppo_epochs,
                                  ref_forward=method.needs_ref and not packed_reference(sc, method),
                                  q_chunk=cfg.model.attn_q_chunk, remat=cfg.model.remat,
                                  teacher_distinct_rows=stats.get("teacher_distinct_rows"),
                                  logprob_chunk=sc.logprob_chunk, score_chunk=sc.scoring_chunk,
                                  micro_batches=sc.micro_batches, mini_batches=sc.mini_batches,
                                  teacher_micro_batches=sc.teacher_micro_batches,
                                  teacher_cfg=qcfg if external else None, critic=method.uses("critic"), prm=method.uses("prm"),
                                  row_group=cfg.model.attn_row_group, key_block=cfg.model.attn_key_block)
        teacher = work.parts.get("teacher", (0.0, 0.0))[0] + work.parts.get("retrospective", (0.0, 0.0))[0]
        critic = work.parts.get("critic", (0.0, 0.0))[0] + work.parts.get("prm", (0.0, 0.0))[0]
        teacher_tokens = int(stats.get("view_tokens", 0))
        if method.uses("retrospective"):
            teacher_tokens += int((batch.aux_rows["retrospective"].layout.segment_ids >= 0).sum())
        rows.append([name, sc.teacher.weights if method.uses_teacher else "-",
                     sc.algo.section("privileged").source if method.teacher == "privileged" and method.needs_views else "-",
                     f"{walls[name]:.3f}", None, f"{teacher_tokens:,}",
                     f"{teacher / max(work.necessary, 1.0):.0%}", f"{critic / max(work.necessary, 1.0):.0%}",
                     f"{host * 1e3:.1f}"])
        print(f"{name}: {walls[name]:.3f} s/step", file=sys.stderr)
    for r in rows:
        r[4] = f"{walls[r[0]] / walls['grpo']:.2f}"
    print(f"# train step per method, default geometry ({len(trajs)} trajectories), {machine()}")
    print(table(rows, ["method", "teacher", "block", "s/step", "vs GRPO", "teacher tokens", "teacher FLOP share",
                       "critic + PRM FLOP share", "host rewards ms"]))


if __name__ == "__main__":
    main()
