"""Supervised warm-start on gold built-in trajectories: `python -m turnsight_jax.sft`.

The gold call chains of built-in tasks are replayed through the real environment (so the
observations are the tools' own outputs), and the model is trained with cross-entropy on the
policy tokens only. The embedded default runs this before RL; the result is a Hugging Face folder
`WORKDIR/sft` that RL starts from and that serves as the frozen reference.

Two stages:
1. `sft.curriculum_steps` steps on short rows (each trajectory from its first user message on,
   without the system block of tool schemas) with the softmax restricted to the task vocabulary
   (the tokens that occur in the gold policy turns, a few dozen). A randomly initialised model has
   to learn to copy an entity name from the question or a tool result; measured on the default
   task (tiny-default, head_dim 64), this forms in 200-250 such steps, while full-vocabulary SFT
   on full rows still guesses the name at chance after 800 steps, and each change alone stays at
   chance too (BENCHMARKS.md; our reading: the 151,936-way normaliser and the ~280 schema tokens
   dilute the one signal that teaches the copy). Restricted steps on short rows are also several
   times cheaper on a CPU.
2. `sft.steps` steps of ordinary SFT: full rows, full vocabulary. This calibrates the model
   against the rest of the vocabulary so that sampling and RL see a proper distribution. With
   `sft.wrong_call_rate` > 0 this stage imitates an imperfect demonstrator (that share of its
   demonstrations waste one call on a wrong tool, then follow the gold chain): the embedded
   default uses 0.5, so that RL has a mistake to remove; a gold-perfect warm-start leaves the
   tiny model nothing that 12-20 RL steps improve (BENCHMARKS.md). Stage 1 always sees gold
   chains (the copy does not form from the noisy ones: measured, Solve-F1 0.14 at T = 1).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import optax
from flax import nnx

import turnsight_jax.methods  # noqa: F401  (the composition root: the built-in methods register themselves)
from turnsight_jax import model_setup, sources
from turnsight_jax.chat.types import Task
from turnsight_jax.config import load_run_config, rollout_config
from turnsight_jax.envs.synthetic import generate_tasks, gold_turn_texts, tool_call_text
from turnsight_jax.errors import ConfigError
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.sharding import make_mesh
from turnsight_jax.models.weights import save_pretrained
from turnsight_jax.rl.batch import pad_tokens
from turnsight_jax.rl.logprobs import gather_rows
from turnsight_jax.rl.supervised import flatten_policy, pad_demonstrations, sft_optimizer, sft_update, state_pinned
from turnsight_jax.rl.views import policy_bucket, policy_positions
from turnsight_jax.rollout.driver import ReplayPolicy, rollout
from turnsight_jax.runlog import Progress, log


def demonstration_turn_texts(task: Task, rng: np.random.Generator, wrong_call_rate: float,
                             max_turns: int) -> list[str]:
    """The gold turn texts, or with probability `wrong_call_rate` an imperfect demonstration: one
    gold tool turn is preceded by a call to another of the task's tools with the same arguments
    (a wasted call; the demonstrator then recovers and finishes the gold chain). Skipped when the
    extra turn would exceed `max_turns` or the task offers no other tool."""
    turns = gold_turn_texts(task)
    calls = task.gold_calls or ()
    if wrong_call_rate <= 0 or not calls or len(turns) + 1 > max_turns or rng.random() >= wrong_call_rate:
        return turns
    i = int(rng.integers(len(calls)))
    call = calls[i][0]
    others = sorted(t["function"]["name"] for t in task.tools if t["function"]["name"] != call["name"])
    if not others:
        return turns
    wrong = tool_call_text(others[int(rng.integers(len(others)))], dict(call["arguments"]))
    return turns[:i] + [wrong] + turns[i:]


def gold_trajectories(tasks: list[Task], tok, cfg: mlc.ConfigDict, env, chunk: int = 256,
                      wrong_call_rate: float = 0.0, seed: int = 0):
    """Demonstrations replayed through `env` (observations are the tools' own outputs); with
    `wrong_call_rate` > 0 some are imperfect (see `demonstration_turn_texts`)."""
    rc = rollout_config(cfg)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(0, len(tasks), chunk):
        part = tasks[i:i + chunk]
        texts = [demonstration_turn_texts(t, rng, wrong_call_rate, rc.max_turns) for t in part]
        res = rollout(ReplayPolicy(tok, texts), env, part, tokenizer=tok, group_size=1, config=rc)
        out.extend(t for t in res.trajectories if not t.truncated)
    if not out:
        raise ValueError("no gold trajectory fits the rollout budgets; raise rollout.max_response_tokens")
    return out


def drop_system_block(tokens: np.ndarray, policy_mask: np.ndarray, user_start: Sequence[int]):
    """tokens, policy_mask [T] -> the same from the first `<|im_start|>user` on (the tool-schema
    system block removed; the policy tokens are untouched)."""
    n = len(user_start)
    for i in range(len(tokens) - n + 1):
        if tokens[i] == user_start[0] and list(tokens[i:i + n]) == list(user_start):
            return tokens[i:], policy_mask[i:]
    raise ValueError("a gold trajectory has no '<|im_start|>user' message")


def task_vocabulary(trajs) -> np.ndarray:
    """Sorted ids of every token that occurs in a gold policy turn: the restricted softmax's classes."""
    return np.unique(np.concatenate([t.tokens[t.policy_mask.astype(bool)] for t in trajs])).astype(np.int32)


def _restricted_update(graphdef, optimizer, params, opt_state, classes, tokens, valid, pol_pos, pol_valid):
    """One step of cross-entropy over `classes` [C] only; targets are the policy tokens, which
    all lie in `classes`. tokens, valid [B, T]; pol_pos, pol_valid [B, N]."""
    def loss_fn(p):
        model = nnx.merge(graphdef, p)
        hidden = model.hidden_states(tokens, Layout.causal(valid))
        rows = gather_rows(hidden, jnp.maximum(pol_pos - 1, 0))  # [B, N, D]
        w = model.output_weight()[:, classes]  # [D, C]
        logp = jax.nn.log_softmax(jnp.einsum("bnd,dc->bnc", rows, w.astype(rows.dtype),
                                             preferred_element_type=jnp.float32), axis=-1)
        target = jnp.searchsorted(classes, jnp.take_along_axis(tokens, pol_pos, axis=1))
        lp = jnp.take_along_axis(logp, target[..., None], axis=-1)[..., 0]
        return -jnp.sum(lp * pol_valid) / jnp.maximum(pol_valid.sum(), 1)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


_restricted_step = jax.jit(_restricted_update, static_argnums=(0, 1), donate_argnums=(2, 3))


def run_sft(cfg: mlc.ConfigDict, workdir: pathlib.Path, mesh, tok, tokdir: pathlib.Path) -> pathlib.Path:
    """Warm-start the configured model; returns the HF folder (reused if already complete)."""
    out = workdir / "sft"
    if (out / "SFT_DONE").is_file():
        log(f"sft: reusing {out}")
        return out
    t0 = time.perf_counter()
    s = cfg.sft
    tasks = generate_tasks(s.num_tasks, seed=2 * cfg.seed, categories=tuple(cfg.data.categories),
                           config=sources.synthetic_config(cfg))
    with sources.make_env("builtin") as env:
        trajs = gold_trajectories(tasks, tok, cfg, env)
        # Stage 2 imitates the (possibly imperfect) demonstrator; stage 1 always sees the gold chains.
        demos = (gold_trajectories(tasks, tok, cfg, env, wrong_call_rate=s.wrong_call_rate, seed=cfg.seed)
                 if s.wrong_call_rate > 0 else trajs)
    log(f"sft: {len(trajs)} gold trajectories in {time.perf_counter() - t0:.1f}s; "
                f"{s.curriculum_steps} + {s.steps} steps")
    model = model_setup.build_model(cfg, mesh, seed=cfg.seed)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(cfg.seed)
    bs = min(s.batch_size, len(trajs))
    pol_width = policy_bucket(max(int(t.policy_mask.sum()) for t in trajs))
    loss = float("nan")
    if s.curriculum_steps > 0:
        t1 = time.perf_counter()
        user_start = tok.encode("<|im_start|>user")
        short = [drop_system_block(t.tokens, t.policy_mask.astype(bool), user_start) for t in trajs]
        classes = jnp.asarray(task_vocabulary(trajs))
        width = max(len(ids) for ids, _ in short)
        optimizer = sft_optimizer(s.curriculum_lr, s.curriculum_steps)
        with jax.set_mesh(mesh):
            opt_state = jax.jit(optimizer.init)(params)
        restricted_step = state_pinned(_restricted_update, params, opt_state)
        log(f"sft stage 1: {s.curriculum_steps} steps on rows without the system block (<= {width} "
                    f"tokens), softmax over the {classes.size} task-vocabulary tokens")
        progress = Progress(s.curriculum_steps, 0, cfg.log.progress)
        for step in range(s.curriculum_steps):
            batch = pad_demonstrations([short[i] for i in rng.choice(len(short), size=bs, replace=False)], width,
                                       pol_width)
            with jax.set_mesh(mesh):
                params, opt_state, loss = restricted_step(graphdef, optimizer, params, opt_state, classes,
                                                           *map(jnp.asarray, batch))
            if step % 25 == 0 or step == s.curriculum_steps - 1:
                progress.update(step, {"sft_task_vocab_loss": float(loss)})
        log(f"sft stage 1: done in {time.perf_counter() - t1:.1f}s, loss {float(loss):.3f}")
    if s.steps > 0:
        optimizer = sft_optimizer(s.lr, s.steps)
        with jax.set_mesh(mesh):
            opt_state = jax.jit(optimizer.init)(params)
        sft_step = state_pinned(sft_update, params, opt_state)
        progress = Progress(s.steps, 0, cfg.log.progress)
        # One row width for every step (the longest demonstration); the flattened policy tokens come
        # in multiples of 256, so only a few shapes compile.
        width = max(t.length for t in demos)
        pol_width = policy_bucket(max(int(t.policy_mask.sum()) for t in demos))
        for step in range(s.steps):
            pick = [demos[i] for i in rng.choice(len(demos), size=bs, replace=False)]
            tokens, valid = pad_tokens(pick, width)
            flat = flatten_policy(*policy_positions(pick, pol_width))
            with jax.set_mesh(mesh):
                params, opt_state, loss = sft_step(graphdef, optimizer, params, opt_state, jnp.asarray(tokens),
                                                   jnp.asarray(valid), *map(jnp.asarray, flat))
            if step % 10 == 0 or step == s.steps - 1:
                progress.update(step, {"sft_loss": float(loss)})
    # Every process takes part in save_pretrained's gathers; process 0 alone touches the files (the
    # processes of one host share the workdir: each clearing and renaming the folder raced), and
    # the others wait until the folder is whole before they read it back.
    tmp = workdir / "sft.tmp"
    primary = jax.process_index() == 0
    if primary:
        shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(nnx.merge(graphdef, params), tmp)
    if primary:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tokdir / name, tmp / name)
        (tmp / "SFT_DONE").write_text(f"curriculum_steps={s.curriculum_steps} steps={s.steps} "
                                      f"final_loss={float(loss):.4f}\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("sft: the warm-start folder is written")
    log(f"sft: done in {time.perf_counter() - t0:.1f}s, final loss {float(loss):.3f} -> {out}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m turnsight_jax.sft", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="config file (default: the embedded tiny CPU config)")
    ap.add_argument("--workdir", default=None)
    args, rest = ap.parse_known_args(argv)
    try:
        cfg = load_run_config(args.config, rest)
        mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
        qcfg = model_setup.model_config(cfg)
        tok, tokdir = model_setup.setup_tokenizer(cfg, qcfg.vocab_size)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    workdir = pathlib.Path(args.workdir or f"runs/{cfg.name}")
    workdir.mkdir(parents=True, exist_ok=True)
    print(run_sft(cfg, workdir, mesh, tok, tokdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
