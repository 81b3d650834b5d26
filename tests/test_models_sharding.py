"""Sharded Qwen3 on 8 fake CPU devices equals the unsharded model; weights carry their specs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from turnsight_jax.models.attention import Layout
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.weights import load_pretrained, save_pretrained
from turnsight_jax.models.qwen3 import init_model
from turnsight_jax.models.sharding import batch_sharding, make_mesh

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; see tests/conftest.py")

# Dimensions divisible by 8 so every rule applies unmodified on both meshes.
CFG = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
                  num_kv_heads=4, head_dim=16, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded")
    save_pretrained(init_model(CFG, seed=5), path)
    return path


def _forward(model, tokens, mask):
    graphdef, state = nnx.split(model)
    f = jax.jit(lambda s, t, m: nnx.merge(graphdef, s)(t, Layout.causal(m)))
    return np.asarray(f(state, tokens, mask))


@pytest.mark.parametrize("shape", [(1, 8, 1), (1, 2, 4), (2, 1, 4), (1, 4, 2)])
def test_sharded_forward_equals_unsharded(folder, shape):
    data, fsdp, tensor = shape
    mesh = make_mesh(data=data, fsdp=fsdp, tensor=tensor)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (8, 24)).astype(np.int32)
    mask = np.arange(24)[None] < rng.integers(5, 25, (8, 1))
    ref = _forward(load_pretrained(folder), jnp.asarray(tokens), jnp.asarray(mask))

    model = load_pretrained(folder, mesh=mesh)
    # weights carry the intended shardings
    expect = {
        "embed": P("tensor", "fsdp"), "lm_head": P("fsdp", "tensor"),
        "q": P(None, "fsdp", "tensor"), "k": P(None, "fsdp", "tensor"), "o": P(None, "tensor", "fsdp"),
        "gate": P(None, "fsdp", "tensor"), "down": P(None, "tensor", "fsdp"), "attn_norm": P(None, None),
    }
    arrays = {"embed": model.embed[...], "lm_head": model.lm_head[...],
              **{k: model.layers[k][...] for k in ("q", "k", "o", "gate", "down", "attn_norm")}}
    for name, spec in expect.items():
        assert arrays[name].sharding == NamedSharding(mesh, spec), (name, arrays[name].sharding)
        # each device holds only its shard
        n_shards = np.prod([mesh.shape[a] for axes in spec if axes for a in (axes if isinstance(axes, tuple) else (axes,))])
        shard_elems = arrays[name].addressable_shards[0].data.size
        assert shard_elems * n_shards == arrays[name].size, name

    t = jax.device_put(tokens, batch_sharding(mesh, 2))
    m = jax.device_put(mask, batch_sharding(mesh, 2))
    with jax.set_mesh(mesh):
        got = _forward(model, t, m)
    assert np.abs(got - ref)[mask].max() < 1e-5


def test_mesh_must_divide_device_count():
    with pytest.raises(ValueError, match="mesh .* 3 slots but 8 devices"):
        make_mesh(data=1, fsdp=3, tensor=1)
    with pytest.raises(ValueError, match="does not divide"):
        make_mesh(data=3, fsdp=-1, tensor=1)
