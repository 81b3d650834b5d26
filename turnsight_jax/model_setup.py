"""The run's tokenizer and model from a config: dtypes, runtime options, presets, HF folders."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import ml_collections as mlc
from flax import nnx

from turnsight_jax.assets import default_tokenizer_dir
from turnsight_jax.chat.tokenizer import check_vocab_fits, load_tokenizer
from turnsight_jax.errors import ConfigError
from turnsight_jax.models.config import Qwen3Config, get_preset, teacher_architecture
from turnsight_jax.models.qwen3 import Qwen3, RuntimeOptions
from turnsight_jax.models.sharding import state_shardings
from turnsight_jax.models.weights import load_pretrained

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def runtime_options(cfg: mlc.ConfigDict) -> RuntimeOptions:
    if cfg.model.attn_impl == "pallas" and jax.default_backend() != "gpu":
        raise ConfigError(f"model.attn_impl='pallas' runs a Triton kernel on GPUs; this process's JAX backend is "
                          f"{jax.default_backend()!r}: use 'xla' (or 'pallas_interpret' to run the kernel interpreted)")
    return RuntimeOptions(compute_dtype=DTYPES[cfg.model.compute_dtype], remat=cfg.model.remat,
                          attn_q_chunk=cfg.model.attn_q_chunk, vocab_block=cfg.model.vocab_block,
                          attn_row_group=cfg.model.attn_row_group, attn_key_block=cfg.model.attn_key_block,
                          attn_impl=cfg.model.attn_impl, attn_block=cfg.model.attn_block)


def tokenizer_folder(explicit: str | pathlib.Path | None, hf_path: str | pathlib.Path | None) -> pathlib.Path:
    """`explicit`, else the HF folder's own tokenizer (a tokenizer.json there), else the bundled
    Qwen3 tokenizer. The one rule for training (`tokenizer_path`, `model.hf_path`) and `--hf`."""
    if explicit:
        return pathlib.Path(explicit)
    if hf_path and (pathlib.Path(hf_path) / "tokenizer.json").is_file():
        return pathlib.Path(hf_path)
    return default_tokenizer_dir()


def tokenizer_dir(cfg: mlc.ConfigDict) -> pathlib.Path:
    """tokenizer_path, else the HF folder's own tokenizer, else the bundled Qwen3 tokenizer."""
    return tokenizer_folder(cfg.tokenizer_path, cfg.model.hf_path)


def model_config(cfg: mlc.ConfigDict) -> Qwen3Config:
    if cfg.model.hf_path:
        return Qwen3Config.from_pretrained(cfg.model.hf_path)
    try:
        return get_preset(cfg.model.preset)
    except ValueError as e:
        raise ConfigError(str(e)) from None


# The fields that make two Qwen3 checkpoints different architectures (not rope/eps details).
ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                       "head_dim", "tie_word_embeddings")


def architecture_mismatch(cfg: mlc.ConfigDict, qcfg: Qwen3Config) -> str | None:
    """One line when model.hf_path's config.json (`qcfg`) is not model.preset's architecture (the
    preset, fixed by the config's model layer, is what the config's memory knobs and batch were
    sized for); None when they agree or either is unset. The trainer and the dry run log it as a
    warning: the weights define the model that runs, and the doc tests run the paper configs'
    recipes on a tiny Hugging Face folder on purpose."""
    if not (cfg.model.hf_path and cfg.model.preset):
        return None
    try:
        preset = get_preset(cfg.model.preset)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    diff = [f"{f} {getattr(qcfg, f)} (preset {getattr(preset, f)})" for f in ARCHITECTURE_FIELDS
            if getattr(qcfg, f) != getattr(preset, f)]
    if not diff:
        return None
    from turnsight_jax.config import model_layer_name  # lazy: turnsight_jax.config imports the RL registries

    layer = model_layer_name(cfg)
    return (f"model.hf_path={cfg.model.hf_path} is not the architecture of model.preset={cfg.model.preset!r}"
            f"{' (model layer ' + layer + ')' if layer else ''}: {', '.join(diff)}; the config's memory knobs were "
            f"sized for the preset: use a config with that folder's model")


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
    """(tokenizer, its folder); ConfigError when it does not fit the model's vocabulary."""
    path = tokenizer_dir(cfg)
    tok = load_tokenizer(path)
    try:
        check_vocab_fits(tok, vocab_size)
    except ValueError as e:
        raise ConfigError(f"tokenizer {path} does not fit the model: {e}") from None
    return tok, path


def teacher_config(cfg: mlc.ConfigDict, policy: Qwen3Config) -> Qwen3Config:
    """The external teacher's architecture (models.config.teacher_architecture) as a ConfigError."""
    try:
        return teacher_architecture(cfg.teacher.checkpoint, cfg.teacher.preset, policy)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def external_teacher(cfg: mlc.ConfigDict, mesh, policy: Qwen3Config, warm_start: str | None):
    """(graphdef, params, architecture) of teacher.weights='external', loaded in model.ref_dtype and
    sharded over `mesh` like the reference: teacher.checkpoint, or the run's own warm-start (the
    SFT stage's folder, or model.hf_path) for 'warm_start'."""
    qcfg = teacher_config(cfg, policy)  # the vocabulary check, before anything is loaded
    path = warm_start if cfg.teacher.checkpoint == "warm_start" else cfg.teacher.checkpoint
    if not path:
        raise ConfigError("teacher.checkpoint='warm_start' but the run has no warm-start folder (no model.hf_path, "
                          "no SFT stage): name a Hugging Face Qwen3 folder")
    if not (pathlib.Path(path) / "config.json").is_file():
        raise ConfigError(f"teacher.checkpoint={path!r} is not a Hugging Face Qwen3 folder on this machine (no "
                          f"config.json): pass --config.teacher.checkpoint=/path/to/the/teacher")
    model = load_pretrained(path, dtype=DTYPES[cfg.model.ref_dtype], mesh=mesh, options=runtime_options(cfg))
    return (*nnx.split(model), qcfg)
