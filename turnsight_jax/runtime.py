"""Shared run plumbing: model/tokenizer setup, task sources, evaluation, logging, progress."""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
from flax import nnx

from turnsight_jax.assets import default_tokenizer_dir
from turnsight_jax.chat.tokenizer import check_vocab_fits, load_tokenizer
from turnsight_jax.chat.types import Task
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_tasks
from turnsight_jax.models.config import PRESETS, Qwen3Config, get_preset
from turnsight_jax.models.qwen3 import Qwen3, RuntimeOptions
from turnsight_jax.models.weights import load_pretrained
from turnsight_jax.rollout.driver import ModelPolicy, RolloutConfig, rollout
from turnsight_jax.rollout.sampler import SamplingParams
from turnsight_jax.sharding import state_shardings
from turnsight_jax.train_step import ConfigError

# The embedded default's model: the real Qwen3 vocabulary (so the real tokenizer works) on a tiny
# trunk; the 151,936 x 64 embedding is most of its 10M parameters and most of its compute.
# head_dim 64 (> hidden/heads, as in Qwen3 itself): q and k are RMS-normalised per head, so an
# attention logit is at most ~sqrt(head_dim); at 16 that is 4, too flat to single out one entity
# token among hundreds, and the copy the built-in tasks need did not form.
PRESETS.setdefault("tiny-default", Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=256,
                                               num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                                               tie_word_embeddings=True))

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)


def runtime_options(cfg: mlc.ConfigDict) -> RuntimeOptions:
    return RuntimeOptions(compute_dtype=DTYPES[cfg.model.compute_dtype], remat=cfg.model.remat,
                          attn_q_chunk=cfg.model.attn_q_chunk)


def tokenizer_dir(cfg: mlc.ConfigDict) -> pathlib.Path:
    if cfg.tokenizer_path:
        return pathlib.Path(cfg.tokenizer_path)
    if cfg.model.hf_path and (pathlib.Path(cfg.model.hf_path) / "tokenizer.json").is_file():
        return pathlib.Path(cfg.model.hf_path)
    return default_tokenizer_dir()


def model_config(cfg: mlc.ConfigDict) -> Qwen3Config:
    if cfg.model.hf_path:
        return Qwen3Config.from_pretrained(cfg.model.hf_path)
    try:
        return get_preset(cfg.model.preset)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_model(cfg: mlc.ConfigDict, mesh, *, hf_path: str | None = None, seed: int = 0) -> Qwen3:
    """Load `hf_path` (or cfg.model.hf_path) or initialise the preset, sharded over `mesh`."""
    dtype = DTYPES[cfg.model.param_dtype]
    opts = runtime_options(cfg)
    path = hf_path or cfg.model.hf_path
    if path:
        return load_pretrained(path, dtype=dtype, mesh=mesh, options=opts)
    qcfg = model_config(cfg)
    abstract = nnx.eval_shape(lambda: Qwen3(qcfg, rngs=nnx.Rngs(seed), param_dtype=dtype, options=opts))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = state_shardings(abstract_state, mesh)
    # Initialise directly into the target shardings: no host ever holds the whole model.
    init = jax.jit(lambda: nnx.split(Qwen3(qcfg, rngs=nnx.Rngs(seed), param_dtype=dtype, options=opts))[1],
                   out_shardings=shardings)
    with jax.set_mesh(mesh):
        state = init()
    return nnx.merge(graphdef, state)


def setup_tokenizer(cfg: mlc.ConfigDict, vocab_size: int):
    path = tokenizer_dir(cfg)
    tok = load_tokenizer(path)
    try:
        check_vocab_fits(tok, vocab_size)
    except ValueError as e:
        raise ConfigError(f"tokenizer {path} does not fit the model: {e}") from None
    return tok, path


def synthetic_config(cfg: mlc.ConfigDict) -> SyntheticConfig:
    d = cfg.data
    return SyntheticConfig(hops=d.hops, width=d.width, min_distractors=d.min_distractors,
                           max_distractors=d.max_distractors, vocab_size=d.vocab_size, extra_rows=d.extra_rows,
                           num_relations=d.num_relations, entity_style=d.entity_style,
                           prompt_style=d.prompt_style)


def load_tasks(cfg: mlc.ConfigDict, split: str) -> list[Task]:
    """Training or held-out tasks. Built-in held-out tasks use a disjoint seed stream."""
    source = cfg.data.source if split == "train" else cfg.data.eval_source
    path = cfg.data.path if split == "train" else cfg.data.eval_path
    if source == "builtin":
        n = cfg.data.num_train if split == "train" else cfg.data.num_eval
        seed = 2 * cfg.seed + (0 if split == "train" else 1)
        return generate_tasks(n, seed=seed, categories=tuple(cfg.data.categories), config=synthetic_config(cfg))
    if not path:
        raise ConfigError(f"data.{'path' if split == 'train' else 'eval_path'} is required for source {source!r}")
    if source == "ftrl":
        from turnsight_jax.envs import ftrl

        tasks = ftrl.load_tasks(path)
    elif source == "toolhop":
        from turnsight_jax.envs import toolhop

        tasks = toolhop.load_tasks(path)
    else:
        raise ConfigError(f"unknown data source {source!r}")
    if split == "eval" and cfg.data.num_eval:
        tasks = tasks[: cfg.data.num_eval]
    return tasks


def make_env(source: str):
    if source in ("builtin", "ftrl"):
        from turnsight_jax.envs.ftrl import FTRLEnv

        return FTRLEnv(num_workers=2)
    from turnsight_jax.envs.toolhop import ToolHopEnv

    return ToolHopEnv()


def rollout_config(cfg: mlc.ConfigDict, *, max_turns: int | None = None) -> RolloutConfig:
    r = cfg.rollout
    return RolloutConfig(max_turns=max_turns or r.max_turns, max_prompt_tokens=r.max_prompt_tokens,
                         max_response_tokens=r.max_response_tokens, max_turn_tokens=r.max_turn_tokens,
                         enable_thinking=r.enable_thinking)


def sampling_params(cfg: mlc.ConfigDict) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def evaluate_policy(graphdef, state, tok, tasks: Sequence[Task], cfg: mlc.ConfigDict, env, *,
                    greedy: bool | None = None) -> dict[str, Any]:
    """Held-out rollouts: per-task Solve-F1 and means with standard errors.

    Greedy (argmax) when `cfg.eval.temperature` is 0 or `greedy=True`; otherwise `cfg.eval.samples`
    rollouts per task at that temperature, each task's metrics averaged over its samples: the
    expected Solve-F1 of the sampled policy, the quantity RL maximises. The sampling seed is fixed,
    so evaluations before and after training share their random numbers (a lower-variance paired
    difference)."""
    greedy = cfg.eval.temperature <= 0 if greedy is None else greedy
    samples = 1 if greedy else int(cfg.eval.samples)
    sampling = SamplingParams(greedy=True) if greedy else SamplingParams(
        temperature=cfg.eval.temperature, top_k=int(cfg.eval.top_k), top_p=float(cfg.eval.top_p))
    rc = rollout_config(cfg, max_turns=cfg.eval.max_turns)
    per_task: list[dict[str, float]] = []
    bs = max(1, cfg.eval.batch_size // samples)
    for i in range(0, len(tasks), bs):
        chunk = tasks[i:i + bs]
        policy = ModelPolicy(graphdef, state, tok, sampling=sampling, config=rc, seed=cfg.seed + i)
        res = rollout(policy, env, chunk, tokenizer=tok, group_size=samples, config=rc, seed=cfg.seed)
        for j in range(len(chunk)):
            group = [t.metrics for t in res.trajectories[j * samples:(j + 1) * samples]]
            per_task.append({k: float(np.mean([m[k] for m in group])) for k in group[0]
                             if all(isinstance(m.get(k), (int, float)) for m in group)})
    out: dict[str, Any] = {"n": len(per_task), "mode": "greedy" if greedy else
                           f"{samples} samples at temperature {cfg.eval.temperature:g}"
                           + (f", top-k {cfg.eval.top_k}" if cfg.eval.top_k else "")
                           + (f", top-p {cfg.eval.top_p:g}" if cfg.eval.top_p < 1 else "")}
    for key in ("solve_f1", "solve_p", "solve_r", "answer_correct", "num_turns"):
        vals = np.array([m.get(key, np.nan) for m in per_task], np.float64)
        vals = vals[np.isfinite(vals)]
        if vals.size:
            out[key] = float(vals.mean())
            out[key + "_se"] = float(vals.std(ddof=1) / math.sqrt(vals.size)) if vals.size > 1 else 0.0
    out["per_task_solve_f1"] = [float(m.get("solve_f1", 0.0)) for m in per_task]
    return out


class MetricsLog:
    """JSONL (and optionally TensorBoard) metrics, written by process 0 only."""

    def __init__(self, workdir: pathlib.Path, *, tensorboard: bool, resume_step: int | None):
        self.path = workdir / "metrics.jsonl"
        self.enabled = jax.process_index() == 0
        self.tb = None
        if not self.enabled:
            return
        workdir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            # Resuming: drop records of steps after the restored checkpoint (they will be redone).
            keep = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if resume_step is not None and rec.get("step", 0) <= resume_step:
                    keep.append(line)
            self.path.write_text("".join(l + "\n" for l in keep))
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(workdir / "tensorboard"))
            except ImportError:
                log("tensorboardX not installed: TensorBoard logging off")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def close(self):
        if self.tb is not None:
            self.tb.close()


def _jsonable(v):
    if isinstance(v, (jax.Array, np.ndarray)):
        v = np.asarray(v)
        return v.tolist() if v.ndim else float(v)
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v


class Progress:
    """One line per step on stderr: position, key numbers, speed and ETA."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        self.total, self.start, self.enabled = total, start, enabled and jax.process_index() == 0
        self.t0 = time.perf_counter()

    def update(self, step: int, fields: dict[str, float]) -> None:
        if not self.enabled:
            return
        done = step + 1 - self.start
        rate = (time.perf_counter() - self.t0) / max(done, 1)
        eta = rate * (self.total - step - 1)
        bar_w = 20
        filled = int(bar_w * (step + 1) / max(self.total, 1))
        parts = " | ".join(f"{k} {v:.3g}" for k, v in fields.items())
        print(f"[{'#' * filled}{'.' * (bar_w - filled)}] step {step + 1}/{self.total} | {parts} | "
              f"{rate:.1f} s/step | ETA {int(eta // 60)}m{int(eta % 60):02d}s", file=sys.stderr, flush=True)


def matmul_peak_flops(seconds: float = 0.5) -> float:
    """Measured float32 matmul throughput of device 0 (FLOP/s): the MFU denominator on CPU."""
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        f(a).block_until_ready()
        reps += 1
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def maybe_initialize_distributed() -> None:
    """jax.distributed under a multi-process launcher (launch/*.sh set TURNSIGHT_DISTRIBUTED=1)."""
    if os.environ.get("TURNSIGHT_DISTRIBUTED") == "1":
        jax.distributed.initialize()
