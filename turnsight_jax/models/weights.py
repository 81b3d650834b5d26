"""Hugging Face Qwen3 checkpoints in and out.

`load_pretrained` reads a model folder (config.json + model.safetensors, or an index-sharded
set) tensor by tensor straight into each weight's target sharding: every device shard is cut
from a memory-mapped file, so no host ever holds the whole model. `save_pretrained` writes a
folder that `transformers.Qwen3ForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import json
import pathlib
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import LAYER_PARAMS, Qwen3, RuntimeOptions
from turnsight_jax.models.safetensors_io import SafetensorsFile, write_safetensors
from turnsight_jax.models.sharding import leaf_name, param_sharding

# our layer parameter -> (Hugging Face name inside model.layers.{i}, transposed?)
_HF_LAYER = {
    "attn_norm": ("input_layernorm.weight", False),
    "q": ("self_attn.q_proj.weight", True),
    "k": ("self_attn.k_proj.weight", True),
    "v": ("self_attn.v_proj.weight", True),
    "o": ("self_attn.o_proj.weight", True),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "gate": ("mlp.gate_proj.weight", True),
    "up": ("mlp.up_proj.weight", True),
    "down": ("mlp.down_proj.weight", True),
}
_HF_GLOBAL = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def hf_tensor_names(cfg: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face Qwen3 checkpoint of this config holds, with its shape."""
    d, f, v, dh = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    hq, hkv = cfg.num_heads * dh, cfg.num_kv_heads * dh
    per_layer = {
        "input_layernorm.weight": (d,), "self_attn.q_proj.weight": (hq, d), "self_attn.k_proj.weight": (hkv, d),
        "self_attn.v_proj.weight": (hkv, d), "self_attn.o_proj.weight": (d, hq), "self_attn.q_norm.weight": (dh,),
        "self_attn.k_norm.weight": (dh,), "post_attention_layernorm.weight": (d,),
        "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d), "mlp.down_proj.weight": (d, f),
    }
    names = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (v, d)
    for i in range(cfg.num_layers):
        for key, shape in per_layer.items():
            names[f"model.layers.{i}.{key}"] = shape
    return names


def _open_checkpoint(path: pathlib.Path) -> dict[str, SafetensorsFile]:
    """Map each tensor name to the file holding it."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from e
        files: dict[str, SafetensorsFile] = {}
        out = {}
        for name, fname in weight_map.items():
            fpath = path / fname
            if fname not in files:
                if not fpath.is_file():
                    raise FileNotFoundError(f"{index}: tensor {name!r} is in {fname}, which does not exist")
                files[fname] = SafetensorsFile(fpath)
            out[name] = files[fname]
        return out
    if single.is_file():
        f = SafetensorsFile(single)
        return {name: f for name in f.keys()}
    raise FileNotFoundError(
        f"{path}: no weights: expected model.safetensors or model.safetensors.index.json"
    )


def _check_tensors(cfg: Qwen3Config, files: dict[str, SafetensorsFile]) -> None:
    expected = hf_tensor_names(cfg)
    for name, shape in expected.items():
        if name not in files:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
        got = files[name].shape(name)
        if got != shape:
            raise ValueError(
                f"{files[name].path}: tensor {name!r} has shape {got}, config.json implies {shape}"
            )
    allowed_extra = {"lm_head.weight"}  # tied checkpoints sometimes also store the head
    extra = sorted(set(files) - set(expected) - allowed_extra)
    if extra:
        raise ValueError(
            f"checkpoint has tensors a dense Qwen3 of this config does not: {extra[:5]}"
            f"{' ...' if len(extra) > 5 else ''} (unsupported architecture?)"
        )


def _reader(name: str, cfg: Qwen3Config, files, np_dtype) -> Callable:
    """index -> numpy block of our parameter `name`, cut from the Hugging Face tensors."""
    if name in _HF_GLOBAL:
        hf_name, transposed = _HF_GLOBAL[name]

        def read(index):
            src = files[hf_name].get(hf_name)
            block = src.T[index] if transposed else src[index]
            return np.asarray(block, dtype=np_dtype)

        return read
    hf_key, transposed = _HF_LAYER[name]

    def read_layers(index):
        layer_idx, rest = index[0], index[1:]
        blocks = []
        for i in range(cfg.num_layers)[layer_idx]:
            hf_name = f"model.layers.{i}.{hf_key}"
            src = files[hf_name].get(hf_name)
            blocks.append(np.asarray(src.T[rest] if transposed else src[rest], dtype=np_dtype))
        return np.stack(blocks)

    return read_layers


def _np_dtype(dtype) -> np.dtype:
    dtype = jnp.dtype(dtype)
    return np.dtype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else np.dtype(dtype)


def load_pretrained(
    path: str | pathlib.Path,
    *,
    dtype=jnp.float32,
    mesh: Mesh | None = None,
    options: RuntimeOptions = RuntimeOptions(),
) -> Qwen3:
    """Load a Hugging Face Qwen3 folder into a Qwen3 whose weights are `dtype`, placed with the
    partition rules of turnsight_jax.sharding on `mesh` (one device when None)."""
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a folder")
    cfg = Qwen3Config.from_pretrained(path)
    files = _open_checkpoint(path)
    _check_tensors(cfg, files)
    abstract = nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0), param_dtype=dtype, options=options))
    graphdef, state = nnx.split(abstract)
    np_dtype = _np_dtype(dtype)
    device = SingleDeviceSharding(jax.devices()[0])

    def materialise(path_, leaf):
        name = leaf_name(path_)
        sharding = param_sharding(name, leaf.shape, mesh) if mesh is not None else device
        return jax.make_array_from_callback(leaf.shape, sharding, _reader(name, cfg, files, np_dtype))

    state = jax.tree_util.tree_map_with_path(materialise, state)
    return nnx.merge(graphdef, state)


def _host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def save_pretrained(
    model: Qwen3,
    path: str | pathlib.Path,
    *,
    dtype=jnp.float32,
    max_shard_bytes: int = 4 * 1024**3,
) -> pathlib.Path:
    """Write `model` as a Hugging Face Qwen3 folder (config.json + safetensors, index-sharded
    above `max_shard_bytes`). Tensors are gathered one at a time; in a multi-host run every
    process must call this, and process 0 writes."""
    path = pathlib.Path(path)
    cfg = model.config
    np_dtype = _np_dtype(dtype)
    params = {"embed": model.embed, "final_norm": model.final_norm}
    if model.lm_head is not None:
        params["lm_head"] = model.lm_head
    layers = {name: model.layers[name] for name in LAYER_PARAMS}

    entries = []
    for name, (hf_name, transposed) in _HF_GLOBAL.items():
        if name not in params:
            continue
        shape = params[name].shape[::-1] if transposed else params[name].shape

        def produce(p=params[name], t=transposed):
            a = _host(p[...])
            return a.T if t else a

        entries.append((hf_name, tuple(shape), np_dtype, produce))
    for i in range(cfg.num_layers):
        for name in LAYER_PARAMS:
            hf_key, transposed = _HF_LAYER[name]
            layer_shape = layers[name].shape[1:]
            shape = layer_shape[::-1] if transposed else layer_shape

            def produce(p=layers[name], i=i, t=transposed):
                a = _host(p[...][i])
                return a.T if t else a

            entries.append((f"model.layers.{i}.{hf_key}", tuple(shape), np_dtype, produce))

    if jax.process_index() != 0:  # other processes only take part in the gathers
        for *_, produce in entries:
            produce()
        return path
    path.mkdir(parents=True, exist_ok=True)
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = hf_cfg["dtype"] = {np.dtype(np.float32): "float32",
                                               np.dtype(ml_dtypes.bfloat16): "bfloat16",
                                               np.dtype(np.float16): "float16"}[np_dtype]
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))

    shards, current, size = [], [], 0
    for e in entries:
        nbytes = int(np.prod(e[1])) * np_dtype.itemsize
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        write_safetensors(path / "model.safetensors", shards[0], metadata={"format": "pt"})
        (path / "model.safetensors.index.json").unlink(missing_ok=True)
        return path
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path / fname, shard, metadata={"format": "pt"})
        weight_map.update({e[0]: fname for e in shard})
    total = sum(int(np.prod(e[1])) * np_dtype.itemsize for e in entries)
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (path / "model.safetensors").unlink(missing_ok=True)
    return path
