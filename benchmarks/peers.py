"""Side by side with google/tunix: the same Qwen3 weights, the same inputs, one run, three ratios.

    python benchmarks/peers.py --quick     # tiny model, small batches: < 15 min from nothing on 2 cores
    python benchmarks/peers.py             # the recorded run: bench-100m (~100M, real vocabulary)

tunix (PyPI `google-tunix`) pins safetensors<0.8, which conflicts with ours, so it runs in its own
virtual environment, created on first use (default `~/.cache/turnsight_jax/peers-tunix-<ver>`,
`--venv` to choose) with jax, jaxlib, flax and optax pinned to the versions this environment runs,
so both sides compile with the same XLA. Each side runs in its own subprocess, one after the other
(never concurrently), on the same Hugging Face safetensors checkpoint (written here with random
weights) and the same inputs (written here to one .npz). Times are medians after a warm-up.

1. **log-probs**: teacher-forced log-probs of the sampled tokens, B x (prompt + completion) random
   ids. tunix: `rl.common.compute_per_token_logps` (its GRPO learner's old/reference log-prob
   path: full [B, T, V] float32 logits). Ours: `rl.logprobs.student_logprobs` (the head projected
   only at the completion positions, in chunks). Checked equal to 1e-4 (float32) before timing.
2. **decode**: greedy, N new tokens for B text prompts of different lengths. tunix:
   `generate.sampler.Sampler` (strings in, its tokenizer adapter; an EOS id that never occurs, so
   every row decodes N tokens). Ours: `rollout.sampler.append_tokens` + `decode_turn` (the
   lockstep sampler, same tokenizer files). Twice: the tokens only (tunix's default; ours with
   `SamplingParams(logprobs=False)`, as our evaluation decodes), and recording each token's
   log-prob (what a rollout needs for the ratio: tunix `return_logprobs=True`; ours by default).
   The prompt ids and the generated ids are checked identical, the log-probs equal to 1e-4.
3. **GRPO update**: one optimizer step on identical multi-turn trajectories (built-in multi-hop
   tasks replayed through the real environment), identical advantages (our GRPO estimator on
   random rewards) and identical old log-probs (the teacher-forced ones plus fixed noise, so
   ratios differ from 1 and clipping acts). tunix: its registered "grpo" policy loss
   (`rl.algo_core.grpo_loss_fn`, beta 0, "sequence-mean-token-mean") as the loss of a
   `sft.peft_trainer.PeftTrainer` train step (value_and_grad + `nnx.Optimizer.update`). Ours: the
   fused step (`rl.step.make_train_step`, method grpo). Both with the same optax chain
   (global-norm clip 1.0, AdamW). Checked: loss and gradient norm equal to 1e-4. Ours with
   TurnSight (three hindsight depths, packed teacher views) is timed next to them: the method's cost.

What tunix's API cannot express exactly, and how it was matched: our trajectories mask tool
observations out of the loss; tunix's TrainExample takes the prompt (left-padded) and the rest of
the trajectory as the "completion" with `completion_mask` = our policy mask, which is the same
loss (its log-probs are computed at every completion position, ours at policy positions only).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
TUNIX_VERSION = "0.1.7"
# the tokenizer's <|endoftext|>: tunix's pad id (its masks are `ids != pad_id`), never a real token here
PAD_ID = 151643

SHAPES = {
    # model preset, log-prob batch (B, prompt, completion), decode (B, new tokens), RL rows / group
    "quick": dict(preset="tiny", lp=(4, 64, 192), decode=(4, 32), rl_tasks=2, group=4, hops=2, repeats=3),
    "full": dict(preset="bench-100m", lp=(8, 128, 384), decode=(8, 128), rl_tasks=2, group=4, hops=3, repeats=5),
}
GRPO = dict(clip_eps=0.2, lr=1e-5, b1=0.9, b2=0.999, weight_decay=0.01, max_grad_norm=1.0)


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# the tunix environment
# ---------------------------------------------------------------------------------------------
def default_venv() -> pathlib.Path:
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return base / "turnsight_jax" / f"peers-tunix-{TUNIX_VERSION}"


def ensure_venv(path: pathlib.Path) -> pathlib.Path:
    """The tunix venv's python, creating the venv on first use. A marker file records a finished
    install, so an interrupted one is redone rather than half-used."""
    import importlib.metadata as md

    py = path / "bin" / "python"
    pins = [f"google-tunix=={TUNIX_VERSION}"] + [f"{p}=={md.version(p)}" for p in ("jax", "jaxlib", "flax", "optax")]
    marker = path / ".turnsight-peers"
    if marker.is_file() and marker.read_text() == " ".join(pins):
        log(f"tunix venv: reusing {path}")
        return py
    t0 = time.perf_counter()
    log(f"tunix venv: creating {path} ({' '.join(pins)}); about a minute with a warm pip cache, a few without")
    if path.exists():
        shutil.rmtree(path)
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check", *pins],
                   check=True)
    marker.write_text(" ".join(pins))
    log(f"tunix venv: ready in {time.perf_counter() - t0:.0f} s")
    return py


# ---------------------------------------------------------------------------------------------
# inputs (this process, our environment)
# ---------------------------------------------------------------------------------------------
PROMPT_WORDS = ("the tool returned a value that the next call needs so look it up and compare it with the "
                "question before answering in one short line").split()


def rl_trajectories(shape: dict):
    """Built-in multi-hop tasks replayed through the environment (gold chains), random rewards."""
    from turnsight_jax.assets import default_tokenizer
    from turnsight_jax.envs.ftrl import FTRLEnv
    from turnsight_jax.envs.synthetic import SyntheticConfig, generate_tasks, gold_turn_texts
    from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout

    tok = default_tokenizer()
    g = shape["group"]
    tasks = generate_tasks(shape["rl_tasks"], seed=5, categories=("multi_hop",),
                           config=SyntheticConfig(hops=shape["hops"]))
    scripts = [gold_turn_texts(t) for t in tasks for _ in range(g)]
    with FTRLEnv(num_workers=1) as env:
        trajs = rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=g,
                        config=RolloutConfig(max_turns=6, max_response_tokens=2048)).trajectories
    rng = np.random.default_rng(1)
    for t in trajs:
        t.reward = float(rng.random())
        t.old_logprobs = np.zeros(t.length, np.float32)
    return trajs, [t for t in tasks for _ in range(g)], tok


def step_config(method: str, group: int):
    from turnsight_jax.rl.config import AlgoConfig, LossConfig, OptimConfig, StepConfig

    opt = OptimConfig(lr=GRPO["lr"], b1=GRPO["b1"], b2=GRPO["b2"], weight_decay=GRPO["weight_decay"],
                      max_grad_norm=GRPO["max_grad_norm"])
    return StepConfig(algo=AlgoConfig(method=method), loss=LossConfig(clip_eps=GRPO["clip_eps"]), optim=opt,
                      group_size=group, max_turns=6, logprob_chunk=256)


def write_inputs(work: pathlib.Path, shape: dict) -> None:
    """The checkpoint, the tokenizer, inputs.npz / prompts.json / settings.json, and the two
    TrainBatches of our side (pickled)."""
    import pickle

    import jax
    import jax.numpy as jnp

    from turnsight_jax.assets import default_tokenizer_dir
    from turnsight_jax.chat.tokenizer import endoftext_id, im_end_id
    from turnsight_jax.models.config import get_preset
    from turnsight_jax.models.qwen3 import init_model
    from turnsight_jax.models.weights import save_pretrained
    from turnsight_jax.rl.batch import make_train_batch
    from turnsight_jax.rl.logprobs import student_logprobs
    from turnsight_jax.rl.methods import resolve_method
    from turnsight_jax.rl.step import compute_advantages

    cfg = get_preset(shape["preset"])
    model = init_model(cfg, seed=0)
    save_pretrained(model, work / "model")
    shutil.copytree(default_tokenizer_dir(), work / "tokenizer")
    rng = np.random.default_rng(0)
    b, tp, tc = shape["lp"]
    ids = rng.integers(0, PAD_ID, (b, tp + tc)).astype(np.int32)
    x = {"lp_prompt": ids[:, :tp], "lp_completion": ids[:, tp:]}

    db, _ = shape["decode"]
    prompts = [" ".join(rng.choice(PROMPT_WORDS, size=int(rng.integers(12, 40)))) for _ in range(db)]

    trajs, tasks, tok = rl_trajectories(shape)
    if endoftext_id(tok) != PAD_ID:
        raise RuntimeError(f"the tokenizer's <|endoftext|> is {endoftext_id(tok)}, expected {PAD_ID}")
    g = shape["group"]
    batches = {}
    for method in ("grpo", "turnsight"):
        sc = step_config(method, g)
        batches[method], _ = make_train_batch(trajs, tasks, tok, sc, resolve_method(sc))
    grpo = batches["grpo"]
    # old log-probs: the teacher-forced ones (this model) plus fixed noise, so ratios are not 1
    lp = jax.jit(lambda t, v, p: student_logprobs(model, t, v, p, chunk=256))(grpo.tokens, grpo.valid, grpo.pol_pos)
    old = np.where(grpo.pol_valid, np.asarray(lp) + rng.normal(0, 0.15, lp.shape), 0.0).astype(np.float32)
    for method in batches:
        batches[method] = batches[method].replace(old_logprobs=old)
    sc = step_config("grpo", g)
    adv, _ = compute_advantages(jax.tree.map(jnp.asarray, grpo), None, sc, resolve_method(sc))
    adv = np.asarray(adv)
    # tunix layout: the prompt left-padded, the rest of the trajectory right-padded
    plen = max(t.prompt_len for t in trajs)
    clen = max(t.length - t.prompt_len for t in trajs)
    rl_prompt = np.full((len(trajs), plen), PAD_ID, np.int32)
    rl_completion = np.full((len(trajs), clen), PAD_ID, np.int32)
    rl_mask = np.zeros((len(trajs), clen), np.int32)
    rl_old = np.zeros((len(trajs), clen), np.float32)
    rl_adv = np.zeros(len(trajs), np.float32)
    for i, t in enumerate(trajs):
        if (t.tokens == PAD_ID).any():
            raise RuntimeError(f"trajectory {i} holds the pad id {PAD_ID}: tunix's masks would drop it")
        n = t.length - t.prompt_len
        rl_prompt[i, plen - t.prompt_len:] = t.tokens[:t.prompt_len]
        rl_completion[i, :n] = t.tokens[t.prompt_len:]
        rl_mask[i, :n] = t.policy_mask[t.prompt_len:]
        k = int(grpo.pol_valid[i].sum())
        pos = grpo.pol_pos[i, :k] - t.prompt_len
        rl_old[i, pos] = old[i, :k]
        rl_adv[i] = adv[i, 0]  # GRPO: one advantage per trajectory, broadcast over its tokens
        if not np.allclose(adv[i, :k], adv[i, 0]):
            raise RuntimeError("GRPO advantages are not constant within a trajectory")
    x.update(rl_prompt=rl_prompt, rl_completion=rl_completion, rl_mask=rl_mask, rl_advantages=rl_adv,
             rl_old=rl_old)
    enc = [tok.encode(p) for p in prompts]
    x["dec_prompt_lens"] = np.array([len(e) for e in enc], np.int32)
    np.savez(work / "inputs.npz", **x)
    (work / "prompts.json").write_text(json.dumps(prompts))
    settings = {"repeats": shape["repeats"], "pad_id": PAD_ID, "eos_id": im_end_id(tok),
                "decode_new_tokens": shape["decode"][1], "grpo": {**GRPO, "group_size": g}, "preset": shape["preset"]}
    (work / "settings.json").write_text(json.dumps(settings, indent=1))
    with open(work / "batches.pkl", "wb") as f:
        pickle.dump(batches, f)
    stats = {"rl_rows": len(trajs), "rl_tokens": int(sum(t.length for t in trajs)),
             "rl_policy_tokens": int(grpo.pol_valid.sum()), "rl_width": int(plen + clen),
             "params_m": cfg.num_params() / 1e6}
    (work / "inputs.json").write_text(json.dumps(stats))


# ---------------------------------------------------------------------------------------------
# our side (a subprocess of this script, our environment)
# ---------------------------------------------------------------------------------------------
def run_ours(work: pathlib.Path) -> None:
    import pickle

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from common import time_fn
    from turnsight_jax.chat.tokenizer import load_tokenizer
    from turnsight_jax.models.qwen3 import KVCache
    from turnsight_jax.models.weights import load_pretrained
    from turnsight_jax.rl.logprobs import student_logprobs
    from turnsight_jax.rl.methods import resolve_method
    from turnsight_jax.rl.step import make_optimizer, make_train_step
    from turnsight_jax.rollout.sampler import SamplingParams, append_tokens, decode_turn

    settings = json.loads((work / "settings.json").read_text())
    repeats = settings["repeats"]
    x = dict(np.load(work / "inputs.npz"))
    model = load_pretrained(work / "model")
    cfg = model.config
    graphdef, params = nnx.split(model)
    out, times = {}, {}

    # 1. log-probs of every completion token
    tokens = jnp.asarray(np.concatenate([x["lp_prompt"], x["lp_completion"]], axis=1))
    b, tp = x["lp_prompt"].shape
    pos = jnp.broadcast_to(jnp.arange(tp, tokens.shape[1], dtype=jnp.int32), (b, tokens.shape[1] - tp))
    valid = jnp.ones(tokens.shape, bool)
    lp_fn = jax.jit(lambda p, t, v, q: student_logprobs(nnx.merge(graphdef, p), t, v, q, chunk=1024))
    out["lp"] = np.asarray(lp_fn(params, tokens, valid, pos))
    times["logprobs"] = time_fn(lambda: lp_fn(params, tokens, valid, pos), repeats=repeats)
    print(f"ours: log-probs {times['logprobs'] * 1e3:.0f} ms", flush=True)

    # 2. greedy decode of the text prompts
    tok = load_tokenizer(work / "tokenizer")
    prompts = json.loads((work / "prompts.json").read_text())
    enc = [tok.encode(p) for p in prompts]
    n_new = settings["decode_new_tokens"]
    width = max(len(e) for e in enc)
    prompt = np.zeros((len(enc), width), np.int32)
    for i, e in enumerate(enc):
        prompt[i, :len(e)] = e
    lens = jnp.asarray([len(e) for e in enc], jnp.int32)
    prompt = jnp.asarray(prompt)
    rows = len(enc)
    never = jnp.array([-1], jnp.int32)
    active, budget = jnp.ones((rows,), bool), jnp.full((rows,), n_new, jnp.int32)

    def decode(logprobs: bool):
        cache = KVCache.zeros(cfg, rows, width + n_new + 1, jnp.float32)
        hidden = jnp.zeros((rows, cfg.hidden_size), jnp.float32)
        cache, hidden = append_tokens(graphdef, params, prompt, lens, cache, hidden, from_empty=True)
        res, *_ = decode_turn(graphdef, params, cache, hidden, jax.random.key(0), n_new,
                              SamplingParams(greedy=True, logprobs=logprobs), never, active, budget)
        return res

    out["dec_tokens"] = np.asarray(decode(False).tokens)
    out["dec_prompt_ids"] = np.asarray(prompt)
    out["dec_prompt_lens"] = np.asarray(lens)
    times["decode"] = time_fn(lambda: decode(False).tokens, repeats=repeats, warmup=0)
    print(f"ours: decode {times['decode'] * 1e3:.0f} ms", flush=True)
    res = decode(True)
    out["dec_lp_tokens"], out["dec_logprobs"] = np.asarray(res.tokens), np.asarray(res.logprobs)
    times["decode_logprobs"] = time_fn(lambda: decode(True).tokens, repeats=repeats, warmup=0)
    print(f"ours: decode with log-probs {times['decode_logprobs'] * 1e3:.0f} ms", flush=True)

    # 3. one update: GRPO (the comparison) and TurnSight (the method's cost), the fused step
    with open(work / "batches.pkl", "rb") as f:
        batches = pickle.load(f)
    for method in ("grpo", "turnsight"):
        sc = step_config(method, settings["grpo"]["group_size"])
        batch = jax.tree.map(jnp.asarray, batches[method])
        optimizer = make_optimizer(sc.optim)
        step = make_train_step(graphdef, sc, optimizer, resolve_method(sc))
        ref = jax.tree.map(jnp.copy, params)
        holder = {"p": jax.tree.map(jnp.copy, params), "s": optimizer.init(params)}

        def one():
            holder["p"], holder["s"], m = step(holder["p"], holder["s"], ref, batch)
            return m

        first = one()
        if method == "grpo":
            out["rl_loss"], out["rl_grad_norm"] = np.float64(first["pg_loss"]), np.float64(first["grad_norm"])
        times[f"{method}_update"] = time_fn(one, repeats=repeats)
        print(f"ours: {method} update {times[f'{method}_update'] * 1e3:.0f} ms", flush=True)
    np.savez(work / "ours.npz", **out)
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("jax", "jaxlib", "flax", "optax")}
    (work / "ours.json").write_text(json.dumps({"times": times, "versions": versions}, indent=1))


# ---------------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------------
def checks(work: pathlib.Path) -> list[tuple[str, bool, str]]:
    ours, theirs = np.load(work / "ours.npz"), np.load(work / "tunix.npz")
    out = []
    d = float(np.max(np.abs(ours["lp"] - theirs["lp"])))
    out.append(("log-probs equal (max abs diff <= 1e-4, f32)", d <= 1e-4, f"{d:.1e}"))
    same_prompts = all(
        np.array_equal(ours["dec_prompt_ids"][i, :n], theirs["dec_prompt_ids"][i][theirs["dec_prompt_ids"][i] != PAD_ID])
        for i, n in enumerate(ours["dec_prompt_lens"]))
    out.append(("decode: prompt ids identical", same_prompts, ""))
    eq = ours["dec_tokens"] == theirs["dec_tokens"]
    out.append(("decode: greedy tokens identical", bool(eq.all()), f"{int(eq.sum())}/{eq.size} equal"))
    eq = (ours["dec_lp_tokens"] == theirs["dec_lp_tokens"]) & (ours["dec_lp_tokens"] == ours["dec_tokens"])
    out.append(("decode with log-probs: same tokens", bool(eq.all()), f"{int(eq.sum())}/{eq.size} equal"))
    d = float(np.max(np.abs(ours["dec_logprobs"] - theirs["dec_logprobs"])))
    out.append(("decode: per-token log-probs equal (max abs diff <= 1e-4)", d <= 1e-4, f"{d:.1e}"))
    dl = abs(float(ours["rl_loss"]) - float(theirs["rl_loss"]))
    out.append(("GRPO loss equal (abs diff <= 1e-4)", dl <= 1e-4,
                f"{float(ours['rl_loss']):.6f} vs {float(theirs['rl_loss']):.6f}"))
    gn_o, gn_t = float(ours["rl_grad_norm"]), float(theirs["rl_grad_norm"])
    dg = abs(gn_o - gn_t) / max(abs(gn_t), 1e-12)
    out.append(("GRPO gradient norm equal (rel diff <= 1e-4)", dg <= 1e-4, f"{gn_o:.6f} vs {gn_t:.6f}"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and batches (the CI-sized run)")
    ap.add_argument("--venv", type=pathlib.Path, default=None, help="tunix venv (created if missing)")
    ap.add_argument("--work", type=pathlib.Path, default=None, help="keep inputs and outputs here")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--side", choices=("ours",), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side == "ours":
        run_ours(args.work)
        return 0
    from common import machine, table

    t_start = time.perf_counter()
    shape = dict(SHAPES["quick" if args.quick else "full"])
    if args.repeats:
        shape["repeats"] = args.repeats
    work = args.work or pathlib.Path(tempfile.mkdtemp(prefix="peers-"))
    if work.exists() and any(work.iterdir()):
        if not (work / "settings.json").is_file():
            sys.exit(f"--work {work}: the folder is not empty and holds no earlier peers run; choose another")
        shutil.rmtree(work)  # an earlier run of this script: replaced
    work.mkdir(parents=True, exist_ok=True)
    py = ensure_venv(args.venv or default_venv())
    log(f"writing the {shape['preset']} checkpoint and the inputs to {work}")
    write_inputs(work, shape)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one device on each side, whatever the caller set
    log("ours: running (its own subprocess)")
    subprocess.run([sys.executable, __file__, "--side", "ours", "--work", str(work)], check=True, env=env)
    log("tunix: running (its own subprocess, its own venv)")
    subprocess.run([str(py), str(HERE / "_peers_tunix.py"), str(work)], check=True, env=env)

    ours, theirs = json.loads((work / "ours.json").read_text()), json.loads((work / "tunix.json").read_text())
    info = json.loads((work / "inputs.json").read_text())
    to, tt = ours["times"], theirs["times"]
    b, tp, tc = shape["lp"]
    db, n_new = shape["decode"]
    ms = lambda s: f"{s * 1e3:.0f} ms"  # noqa: E731
    rows = [
        [f"1. log-probs, {b} x ({tp} + {tc}) tokens", ms(tt["logprobs"]), ms(to["logprobs"]),
         f"{tt['logprobs'] / to['logprobs']:.2f}x"],
        [f"2. greedy decode, {db} prompts x {n_new} new tokens", ms(tt["decode"]), ms(to["decode"]),
         f"{tt['decode'] / to['decode']:.2f}x"],
        ["   the same, recording each token's log-prob (a rollout)", ms(tt["decode_logprobs"]),
         ms(to["decode_logprobs"]), f"{tt['decode_logprobs'] / to['decode_logprobs']:.2f}x"],
        [f"3. GRPO update, {info['rl_rows']} trajectories ({info['rl_tokens']} tokens, {info['rl_policy_tokens']} policy)",
         ms(tt["grpo_update"]), ms(to["grpo_update"]), f"{tt['grpo_update'] / to['grpo_update']:.2f}x"],
        ["   ours with TurnSight (3 hindsight depths), same trajectories", "", ms(to["turnsight_update"]),
         f"{to['turnsight_update'] / to['grpo_update']:.2f}x our GRPO"],
    ]
    print(f"\nmachine: {machine()}; model {shape['preset']} ({info['params_m']:.0f}M parameters, vocabulary 151,936, "
          f"f32); medians of {shape['repeats']} after a warm-up")
    print(f"tunix {theirs['versions']['google-tunix']} (jax {theirs['versions']['jax']}, flax {theirs['versions']['flax']}); "
          f"ours: jax {ours['versions']['jax']}, flax {ours['versions']['flax']}\n")
    print(table(rows, ["case", "tunix", "ours", "tunix / ours (> 1: ours faster)"]))
    results = checks(work)
    print()
    print(table([[name, "pass" if ok else "FAIL", detail] for name, ok, detail in results], ["check", "", "value"]))
    print(f"\ntotal wall time {time.perf_counter() - t_start:.0f} s")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
