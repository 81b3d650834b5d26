"""Supervised warm-start on gold built-in trajectories: `python -m turnsight_jax.sft`.

The gold call chains of built-in tasks are replayed through the real environment (so the
observations are the tools' own outputs), and the model is trained with cross-entropy on the
policy tokens only. The embedded default runs this before RL; the result is a Hugging Face folder
`WORKDIR/sft` that RL starts from and that serves as the frozen reference.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import optax
from flax import nnx

from turnsight_jax.chat.trajectory import make_batch
from turnsight_jax.chat.types import Task
from turnsight_jax.envs.synthetic import generate_tasks, gold_turn_texts
from turnsight_jax.models.weights import save_pretrained
from turnsight_jax.rollout.driver import ReplayPolicy, rollout
from turnsight_jax.teacher import student_logprobs
from turnsight_jax.views import policy_bucket, policy_positions


def gold_trajectories(tasks: list[Task], tok, cfg: mlc.ConfigDict, env, chunk: int = 256):
    from turnsight_jax import runtime

    rc = runtime.rollout_config(cfg)
    out = []
    for i in range(0, len(tasks), chunk):
        part = tasks[i:i + chunk]
        res = rollout(ReplayPolicy(tok, [gold_turn_texts(t) for t in part]), env, part, tokenizer=tok,
                      group_size=1, config=rc)
        out.extend(t for t in res.trajectories if not t.truncated)
    if not out:
        raise ValueError("no gold trajectory fits the rollout budgets; raise rollout.max_response_tokens")
    return out


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(2, 3))
def _sft_step(graphdef, optimizer, params, opt_state, tokens, valid, pol_pos, pol_valid):
    def loss_fn(p):
        lp = student_logprobs(nnx.merge(graphdef, p), tokens, valid, pol_pos, chunk=1024)
        return -jnp.sum(lp * pol_valid) / jnp.maximum(pol_valid.sum(), 1)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def run_sft(cfg: mlc.ConfigDict, workdir: pathlib.Path, mesh, tok, tokdir: pathlib.Path) -> pathlib.Path:
    """Warm-start the configured model; returns the HF folder (reused if already complete)."""
    from turnsight_jax import runtime

    out = workdir / "sft"
    if (out / "SFT_DONE").is_file():
        runtime.log(f"sft: reusing {out}")
        return out
    t0 = time.perf_counter()
    s = cfg.sft
    tasks = generate_tasks(s.num_tasks, seed=2 * cfg.seed, categories=tuple(cfg.data.categories),
                           config=runtime.synthetic_config(cfg))
    with runtime.make_env("builtin") as env:
        trajs = gold_trajectories(tasks, tok, cfg, env)
    runtime.log(f"sft: {len(trajs)} gold trajectories in {time.perf_counter() - t0:.1f}s; {s.steps} steps")
    model = runtime.build_model(cfg, mesh, seed=cfg.seed)
    graphdef, params = nnx.split(model)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(optax.warmup_cosine_decay_schedule(0.0, s.lr, 10, max(s.steps, 11), s.lr * 0.1),
                                        weight_decay=0.0))
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(cfg.seed)
    progress = runtime.Progress(s.steps, 0, cfg.log.progress)
    # One shape for every step (the longest gold trajectory): a single compilation.
    width = [max(t.length for t in trajs)]
    pol_width = policy_bucket(max(int(t.policy_mask.sum()) for t in trajs))
    for step in range(s.steps):
        pick = [trajs[i] for i in rng.choice(len(trajs), size=min(s.batch_size, len(trajs)), replace=False)]
        tb = make_batch(pick, pad_id=0, buckets=width)
        pol_pos, pol_valid = policy_positions(pick, pol_width)
        with jax.set_mesh(mesh):
            params, opt_state, loss = _sft_step(graphdef, optimizer, params, opt_state, jnp.asarray(tb.tokens),
                                                jnp.asarray(tb.valid_mask), jnp.asarray(pol_pos),
                                                jnp.asarray(pol_valid))
        if step % 10 == 0 or step == s.steps - 1:
            progress.update(step, {"sft_loss": float(loss)})
    tmp = workdir / "sft.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(nnx.merge(graphdef, params), tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokdir / name, tmp / name)
    (tmp / "SFT_DONE").write_text(f"steps={s.steps} final_loss={float(loss):.4f}\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    runtime.log(f"sft: done in {time.perf_counter() - t0:.1f}s, final loss {float(loss):.3f} -> {out}")
    return out


def main(argv=None) -> int:
    from turnsight_jax import runtime
    from turnsight_jax.train import load_run_config
    from turnsight_jax.sharding import make_mesh
    from turnsight_jax.train_step import ConfigError

    ap = argparse.ArgumentParser(prog="python -m turnsight_jax.sft", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="config file (default: the embedded tiny CPU config)")
    ap.add_argument("--workdir", default=None)
    args, rest = ap.parse_known_args(argv)
    try:
        cfg = load_run_config(args.config, rest)
        mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
        qcfg = runtime.model_config(cfg)
        tok, tokdir = runtime.setup_tokenizer(cfg, qcfg.vocab_size)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workdir = pathlib.Path(args.workdir or f"runs/{cfg.name}")
    workdir.mkdir(parents=True, exist_ok=True)
    print(run_sft(cfg, workdir, mesh, tok, tokdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
