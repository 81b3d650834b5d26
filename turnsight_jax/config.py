"""Run configuration: the embedded default, config files, command-line overrides, validation, and
the translation of the ConfigDict into the typed configs each part takes (the one such seam).

A config file is a Python file defining `get_config()` that returns an `ml_collections`
ConfigDict (see configs/). Overrides use dotted keys: `--config.rl.lam=0.3`. Values are parsed
as Python literals and must match the type of the key they replace; an unknown key is an error
that names the closest known keys.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import pathlib
from typing import Any, Sequence

import ml_collections as mlc

from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.config import AlgoConfig, LossConfig, OptimConfig, StepConfig
from turnsight_jax.rl.methods import ResolvedMethod, resolve_method
from turnsight_jax.rollout.driver import RolloutConfig
from turnsight_jax.rollout.sampler import SamplingParams
from turnsight_jax.sources import get_source


def default_config() -> mlc.ConfigDict:
    """The embedded default: a tiny Qwen3 with the real tokenizer on built-in tasks, CPU, minutes."""
    c = mlc.ConfigDict()
    c.name = "tiny_cpu"
    c.seed = 0

    c.model = mlc.ConfigDict()
    c.model.preset = "tiny-default"  # a preset name, or "" when hf_path is set
    c.model.hf_path = ""  # a Hugging Face Qwen3 folder to start from
    c.model.param_dtype = "float32"  # the trained policy (and optimizer moments)
    c.model.ref_dtype = "float32"  # the frozen reference/teacher copy (bfloat16 halves its memory)
    c.model.allow_random_init = True  # large presets without hf_path are refused unless this is set
    c.model.compute_dtype = "float32"
    c.model.remat = False
    c.model.attn_q_chunk = 128  # small chunks: cheaper on CPU (static causal bounds skip more)
    c.tokenizer_path = ""  # "" = the bundled Qwen3 tokenizer (or the HF folder's own)

    c.data = mlc.ConfigDict()
    c.data.source = "builtin"  # builtin | ftrl | toolhop
    c.data.path = ""
    c.data.eval_source = "builtin"
    c.data.eval_path = ""
    c.data.num_train = 2000  # built-in tasks generated for training
    c.data.num_eval = 64  # held-out tasks (built-in: a disjoint seed)
    c.data.categories = ("single_hop", "multi_hop")
    c.data.hops = 2
    c.data.width = 2
    c.data.min_distractors = 1
    c.data.max_distractors = 1
    c.data.vocab_size = 10  # entity names
    c.data.entity_style = "names"  # single-token first names: a tiny model learns to copy them quickly
    c.data.num_relations = 4  # relation names (tools)
    c.data.extra_rows = 1
    c.data.prompt_style = "short"

    c.rollout = mlc.ConfigDict()
    c.rollout.max_turns = 4
    c.rollout.max_prompt_tokens = 1024
    c.rollout.max_response_tokens = 256
    c.rollout.max_turn_tokens = 48
    c.rollout.enable_thinking = False
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 20  # Qwen3's recommended top-k; also keeps the 151,936-token tail out of rollouts
    c.rollout.prompts_per_chunk = 0  # rollouts run this many prompts (x group) at a time; 0 = all

    c.rl = mlc.ConfigDict()  # the method and its knobs: turnsight_jax.rl.config.AlgoConfig
    c.rl.method = "turnsight"  # a registered method (turnsight_jax.rl.methods)
    c.rl.base = "grpo"
    c.rl.gamma = 0.9
    c.rl.lam = 0.5
    c.rl.eps_w = 0.5
    c.rl.selection = "vote"
    c.rl.aggregation = "turn"
    c.rl.group_norm = True
    c.rl.turns = "all"
    c.rl.depths = (1, 2, 3)
    c.rl.source = "tool_results"
    c.rl.matchtir_matching = "assignment"  # MatchTIR turn rewards: optimal assignment | transport (Sinkhorn)

    c.loss = mlc.ConfigDict()
    c.loss.clip_eps = 0.2
    c.loss.clip_eps_high = 0.28
    c.loss.kl_coef = 0.0
    c.loss.kl_estimator = "low_var_kl"
    c.loss.kl_clip = 10.0  # low_var_kl is clipped to [-kl_clip, kl_clip]
    c.loss.aggregation = "seq_mean_token_mean"

    c.optim = mlc.ConfigDict()
    c.optim.lr = 3e-4
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 2
    c.optim.min_lr_ratio = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.99
    c.optim.weight_decay = 0.0
    c.optim.max_grad_norm = 1.0

    c.train = mlc.ConfigDict()
    c.train.steps = 12
    c.train.prompts_per_step = 8
    c.train.group_size = 4
    c.train.micro_batches = 1
    c.train.mini_batches = 1
    c.train.ppo_epochs = 1
    c.train.teacher_micro_batches = 1
    c.train.logprob_chunk = 256  # rows per vocabulary-projection chunk (256 is fastest on CPU)

    c.eval = mlc.ConfigDict()
    c.eval.every = 0  # 0: only before and after RL
    c.eval.max_turns = 4
    c.eval.batch_size = 64  # rollouts per batch
    c.eval.temperature = 1.0  # 0: greedy; > 0: the sampled policy's expected Solve-F1 (what RL maximises)
    c.eval.samples = 4  # rollouts per held-out task when sampling (per-task F1 = their mean)
    c.eval.top_k = 20  # sampling filters of the evaluation (0 / 1.0: off); the same as the rollouts'
    c.eval.top_p = 1.0

    c.sft = mlc.ConfigDict()  # supervised warm-start on gold built-in trajectories (see sft.py)
    c.sft.curriculum_steps = 250  # stage 1: short rows, softmax over the task vocabulary
    c.sft.curriculum_lr = 3e-3
    c.sft.steps = 60  # stage 2: full rows, full vocabulary
    c.sft.lr = 3e-3
    c.sft.batch_size = 16
    c.sft.num_tasks = 1024
    # Stage 2 imitates an imperfect demonstrator: this fraction of its demonstrations make one wasted
    # call to a wrong tool before the gold chain. Gold-perfect SFT leaves RL nothing to improve on
    # the built-in tasks (BENCHMARKS.md); removing the wasted calls is what the default RL learns.
    c.sft.wrong_call_rate = 0.5

    c.checkpoint = mlc.ConfigDict()
    c.checkpoint.every = 10
    c.checkpoint.keep = 2
    c.checkpoint.export_at_end = True

    c.mesh = mlc.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1

    c.plan = mlc.ConfigDict()  # --dry_run: the worst-case geometry and the device budget
    c.plan.packed_factor = 2.0  # packed teacher row length / trajectory length
    c.plan.distinct_factor = 3.0  # distinct teacher predictors / policy tokens
    c.plan.device_memory_gib = 80.0

    c.log = mlc.ConfigDict()
    c.log.tensorboard = True
    c.log.progress = True
    return c


def load_config_file(path: str | pathlib.Path) -> mlc.ConfigDict:
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"turnsight_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)  # a config file is the user's own Python, like absl's config_flags
    except Exception as e:  # noqa: BLE001 - report any failure of the user's file in one line
        raise ConfigError(f"config file {path} failed to load: {type(e).__name__}: {e}") from e
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path} defines no get_config()")
    cfg = module.get_config()
    if not isinstance(cfg, mlc.ConfigDict):
        raise ConfigError(f"{path}: get_config() returned {type(cfg).__name__}, expected ml_collections.ConfigDict")
    return cfg


def _parse_value(text: str, old: Any, key: str) -> Any:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text  # a bare word: a string
    if isinstance(old, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if not isinstance(value, bool):
            raise ConfigError(f"--config.{key}: expected a bool, got {text!r}")
        return value
    if isinstance(old, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(old, tuple) and isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(old, tuple) and isinstance(value, int):
        return (value,)
    if old is not None and not isinstance(value, type(old)) and not (isinstance(old, str) and value is None):
        # `selection` may be a depth index or a mode name
        if not (key.endswith("selection") and isinstance(value, (int, str))):
            raise ConfigError(f"--config.{key}: expected {type(old).__name__}, got {text!r}")
    return value


def apply_overrides(cfg: mlc.ConfigDict, overrides: Sequence[str]) -> mlc.ConfigDict:
    """Apply `key=value` overrides (dotted keys) in place; unknown keys are errors."""
    flat = set(_flat_keys(cfg))
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like --config.key=value")
        if key not in flat:
            close = difflib.get_close_matches(key, sorted(flat), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}")
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        with node.unlocked() if hasattr(node, "unlocked") else _null():
            node[leaf] = _parse_value(text, node[leaf], key)
    return cfg


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _flat_keys(cfg: mlc.ConfigDict, prefix: str = ""):
    for k, v in cfg.items():
        if isinstance(v, mlc.ConfigDict):
            yield from _flat_keys(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def load_run_config(path: str | None, overrides: list[str]) -> mlc.ConfigDict:
    """The config file (or the embedded default) with `--config.key=value` overrides applied."""
    cfg = load_config_file(path) if path else default_config()
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        raise ConfigError(f"unknown argument {bad[0]!r} (overrides look like --config.rl.lam=0.3)")
    return apply_overrides(cfg, [o[len("--config."):] for o in overrides])


# ---- ConfigDict -> typed configs ----

def step_config(cfg: mlc.ConfigDict) -> StepConfig:
    """The train step's typed config from a run config."""
    r, l, o, t = cfg.rl, cfg.loss, cfg.optim, cfg.train
    args = tuple(sorted(r.args.items())) if "args" in r else ()
    return StepConfig(
        algo=AlgoConfig(method=r.method, base=r.base, gamma=r.gamma, lam=r.lam, eps_w=r.eps_w, selection=r.selection,
                        aggregation=r.aggregation, group_norm=r.group_norm, turns=r.turns,
                        depths=tuple(int(d) for d in r.depths), source=r.source,
                        matchtir_matching=r.matchtir_matching, args=args),
        loss=LossConfig(clip_eps=l.clip_eps, clip_eps_high=l.clip_eps_high, kl_coef=l.kl_coef,
                        kl_estimator=l.kl_estimator, kl_clip=l.kl_clip, aggregation=l.aggregation,
                        temperature=cfg.rollout.temperature),
        optim=OptimConfig(lr=o.lr, schedule=o.schedule, warmup_steps=o.warmup_steps, total_steps=t.steps,
                          min_lr_ratio=o.min_lr_ratio, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay,
                          max_grad_norm=o.max_grad_norm),
        group_size=t.group_size, micro_batches=t.micro_batches, mini_batches=t.mini_batches, ppo_epochs=t.ppo_epochs,
        teacher_micro_batches=t.teacher_micro_batches, logprob_chunk=t.logprob_chunk, max_turns=cfg.rollout.max_turns,
    )


def rollout_config(cfg: mlc.ConfigDict, *, max_turns: int | None = None) -> RolloutConfig:
    r = cfg.rollout
    return RolloutConfig(max_turns=max_turns or r.max_turns, max_prompt_tokens=r.max_prompt_tokens,
                         max_response_tokens=r.max_response_tokens, max_turn_tokens=r.max_turn_tokens,
                         enable_thinking=r.enable_thinking)


def sampling_params(cfg: mlc.ConfigDict) -> SamplingParams:
    """The rollouts' sampling."""
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def eval_sampling(cfg: mlc.ConfigDict, *, greedy: bool = False) -> SamplingParams:
    """The held-out evaluation's sampling: greedy when eval.temperature is 0 (or `greedy`)."""
    e = cfg.eval
    if greedy or e.temperature <= 0:
        return SamplingParams(greedy=True)
    return SamplingParams(temperature=e.temperature, top_k=int(e.top_k), top_p=float(e.top_p))


def validate(cfg: mlc.ConfigDict, num_devices: int | None = None, *,
             check_data: bool = True) -> tuple[StepConfig, ResolvedMethod]:
    """Check a run config; raise ConfigError with one line naming the problem. Returns the step's
    typed config and the resolved method. `check_data=False` (the dry run) skips the data paths,
    which a memory plan does not need."""
    source = get_source(cfg.data.source, key="data.source", trainable=True)
    get_source(cfg.data.eval_source, key="data.eval_source", trainable=True)
    if check_data and source.needs_path and not cfg.data.path:
        raise ConfigError(f"data.source={cfg.data.source!r} needs data.path")
    if not cfg.model.preset and not cfg.model.hf_path:
        raise ConfigError("set model.preset or model.hf_path")
    for key in ("param_dtype", "compute_dtype", "ref_dtype"):
        if cfg.model[key] not in ("float32", "bfloat16"):
            raise ConfigError(f"model.{key} must be float32 or bfloat16, got {cfg.model[key]!r}")
    if cfg.train.steps < 0 or cfg.train.prompts_per_step < 1:
        raise ConfigError("train.steps must be >= 0 and train.prompts_per_step >= 1")
    if num_devices is not None:
        shape = [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor]
        known = [s for s in shape if s != -1]
        prod = 1
        for s in known:
            prod *= s
        if shape.count(-1) > 1 or prod <= 0 or num_devices % prod or (-1 not in shape and prod != num_devices):
            raise ConfigError(
                f"mesh data={shape[0]} x fsdp={shape[1]} x tensor={shape[2]} does not divide {num_devices} devices"
            )
    for section in ("rollout", "eval"):  # the evaluation samples only when its temperature is > 0
        c = cfg[section]
        if section == "eval" and c.temperature <= 0:
            continue
        try:
            SamplingParams(temperature=c.temperature, top_k=int(c.top_k), top_p=float(c.top_p))
        except ValueError as e:
            raise ConfigError(f"{section}: {e}") from None
    sc = step_config(cfg)
    sc.validate(cfg.train.prompts_per_step * cfg.train.group_size)
    return sc, resolve_method(sc)
