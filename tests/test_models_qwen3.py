"""Qwen3 in Flax vs Hugging Face transformers: logits, round trips, KV cache, errors."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from _hf import hf_logits, make_hf_checkpoint
from turnsight_jax.rl.logprobs import chunked_logprobs
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.config import PRESETS, Qwen3Config
from turnsight_jax.models.qwen3 import KVCache, init_model
from turnsight_jax.models.safetensors_io import SafetensorsFile
from turnsight_jax.models.weights import load_pretrained, save_pretrained

torch = pytest.importorskip("torch")

# Compiled calls (one program per shape) instead of op-by-op dispatch, which compiles every op.
forward = nnx.jit(lambda model, *args: model(*args))
extend = nnx.jit(lambda model, tokens, n, cache: model.extend(tokens, n, cache))

# (tied, heads, kv_heads, head_dim, hidden): GQA ratios 1, 2, 4; head_dim != hidden/heads in two.
CONFIGS = {
    "tied-mha": dict(tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                     hidden_size=64),
    "untied-gqa2": dict(tie_word_embeddings=False, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                        hidden_size=64),
    "tied-gqa4": dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                      hidden_size=128, num_hidden_layers=3),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_checkpoint(path, seed=hash(request.param) % 1000, **CONFIGS[request.param])
    return path, hf


def _padded_batch(rng, vocab, lengths, t):
    tokens = rng.integers(0, vocab, (len(lengths), t)).astype(np.int32)
    mask = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    return np.where(mask, tokens, 0), mask


def test_logits_match_transformers_with_padding(checkpoint):
    path, hf = checkpoint
    model = load_pretrained(path)
    rng = np.random.default_rng(0)
    tokens, mask = _padded_batch(rng, 512, [23, 9, 17], 23)
    ref = hf_logits(hf, tokens, mask)
    ours = np.asarray(forward(model, jnp.asarray(tokens), Layout.causal(jnp.asarray(mask))))
    err = np.abs(ref - ours)[mask].max()
    assert err < 1e-4, err
    # the public call: tokens alone is a plain causal forward
    full = np.asarray(forward(model, jnp.asarray(tokens[:1])))
    assert np.abs(full - hf_logits(hf, tokens[:1])).max() < 1e-4


def test_save_then_transformers_load_gives_same_logits(checkpoint, tmp_path):
    from transformers import Qwen3ForCausalLM

    path, _ = checkpoint
    model = load_pretrained(path)
    out = save_pretrained(model, tmp_path / "export")
    hf2 = Qwen3ForCausalLM.from_pretrained(out).eval()
    tokens = np.random.default_rng(1).integers(0, 512, (2, 12)).astype(np.int32)
    assert np.abs(hf_logits(hf2, tokens) - np.asarray(forward(model, jnp.asarray(tokens)))).max() < 1e-4


def test_hf_ours_hf_tensors_identical(checkpoint, tmp_path):
    path, _ = checkpoint
    save_pretrained(load_pretrained(path), tmp_path / "again")
    a, b = SafetensorsFile(path / "model.safetensors"), SafetensorsFile(tmp_path / "again" / "model.safetensors")
    names_a = set(a.keys()) - {"lm_head.weight"} if json.loads((path / "config.json").read_text())[
        "tie_word_embeddings"] else set(a.keys())
    assert names_a == set(b.keys())
    for name in names_a:
        np.testing.assert_array_equal(a.get(name), b.get(name), err_msg=name)


def test_index_sharded_save_and_load(tmp_path):
    model = init_model(Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2,
                                   num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=False))
    out = save_pretrained(model, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = load_pretrained(out)
    tokens = jnp.arange(10, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(np.asarray(forward(model, tokens)), np.asarray(forward(again, tokens)))


def test_bf16_save_round_trip(tmp_path):
    model = init_model(Qwen3Config(vocab_size=300, hidden_size=32, intermediate_size=64,
                                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16))
    out = save_pretrained(model, tmp_path / "bf16", dtype=jnp.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = load_pretrained(out, dtype=jnp.bfloat16)
    assert again.embed[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(again.embed[...].astype(jnp.float32)),
        np.asarray(model.embed[...].astype(jnp.bfloat16).astype(jnp.float32)),
    )


def test_kv_cache_decode_matches_full_forward():
    cfg = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=24, tie_word_embeddings=False)
    model = init_model(cfg, seed=3)
    rng = np.random.default_rng(0)
    seq = jnp.asarray(rng.integers(0, 300, (3, 20)).astype(np.int32))
    full = np.asarray(forward(model, seq))
    w = model.output_weight()

    # prefill 5 tokens, decode 4 one by one, append 6 at once (an observation), decode the rest
    cache = KVCache.zeros(cfg, 3, 32)
    got = []
    pos = 0
    for n in [5, 1, 1, 1, 1, 6, 1, 1, 1, 1, 1]:
        h, cache = extend(model, seq[:, pos:pos + n], jnp.full((3,), n, jnp.int32), cache)
        got.append(np.einsum("bnd,dv->bnv", np.asarray(h), np.asarray(w)))
        pos += n
    got = np.concatenate(got, axis=1)
    assert pos == 20 and int(cache.lengths[0]) == 20
    assert np.abs(got - full).max() < 1e-5


def test_kv_cache_ragged_rows_and_padding():
    """Rows append different numbers of tokens in the same call; padding never leaks."""
    cfg = Qwen3Config(vocab_size=200, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    model = init_model(cfg, seed=1)
    rng = np.random.default_rng(2)
    a = rng.integers(0, 200, 11).astype(np.int32)
    b = rng.integers(0, 200, 11).astype(np.int32)
    cache = KVCache.zeros(cfg, 2, 16)
    # step 1: row0 appends 4, row1 appends 7 (rest garbage)
    toks = np.stack([np.concatenate([a[:4], rng.integers(0, 200, 3)]), b[:7]]).astype(np.int32)
    _, cache = extend(model, jnp.asarray(toks), jnp.array([4, 7]), cache)
    # step 2: row0 appends 7 more, row1 appends 4 more
    toks = np.stack([a[4:11], np.concatenate([b[7:11], rng.integers(0, 200, 3)])]).astype(np.int32)
    h, cache = extend(model, jnp.asarray(toks), jnp.array([7, 4]), cache)
    w = model.output_weight()
    ref_a = np.asarray(forward(model, jnp.asarray(a[None])))[0, 4:11]
    ref_b = np.asarray(forward(model, jnp.asarray(b[None])))[0, 7:11]
    got = np.einsum("bnd,dv->bnv", np.asarray(h), np.asarray(w))
    assert np.abs(got[0] - ref_a).max() < 1e-5
    assert np.abs(got[1, :4] - ref_b).max() < 1e-5
    assert list(np.asarray(cache.lengths)) == [11, 11]


def test_prefill_from_an_empty_cache_skips_only_unread_keys():
    """extend(from_empty=True) (chunk groups score keys up to their own end) equals the plain
    prefill over every key, ragged rows and padding included, then decodes on identically."""
    from turnsight_jax.models.qwen3 import RuntimeOptions

    cfg = Qwen3Config(vocab_size=200, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    model = init_model(cfg, seed=4, options=RuntimeOptions(attn_q_chunk=16))  # 96 tokens: 6 chunks, 4 groups
    rng = np.random.default_rng(5)
    toks = jnp.asarray(rng.integers(0, 200, (3, 96)).astype(np.int32))
    lens = jnp.array([96, 41, 7], jnp.int32)
    outs = {}
    for flag in (False, True):
        prefill = nnx.jit(lambda m, t, n, c: m.extend(t, n, c, window=96, from_empty=flag))
        h, cache = prefill(model, toks, lens, KVCache.zeros(cfg, 3, 128))
        nxt, cache = extend(model, toks[:, :1], jnp.ones(3, jnp.int32), cache)
        outs[flag] = [np.asarray(x) for x in (h, cache.k, nxt)]
    real = np.arange(96)[None, :] < np.asarray(lens)[:, None]
    np.testing.assert_allclose(outs[True][0][real], outs[False][0][real], atol=1e-6, rtol=0)
    for a, b in zip(outs[True][1:], outs[False][1:]):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_chunked_attention_equals_single_chunk():
    cfg = Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    from turnsight_jax.models.qwen3 import RuntimeOptions

    big = init_model(cfg, seed=0, options=RuntimeOptions(attn_q_chunk=1024))
    small = init_model(cfg, seed=0, options=RuntimeOptions(attn_q_chunk=16))
    tokens, mask = _padded_batch(np.random.default_rng(0), 100, [70, 33], 70)
    lay = Layout.causal(jnp.asarray(mask))
    a, b = np.asarray(forward(big, jnp.asarray(tokens), lay)), np.asarray(forward(small, jnp.asarray(tokens), lay))
    assert np.abs(a - b)[mask].max() < 1e-5


def test_chunked_logprobs_equal_log_softmax_gather():
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(37, 16)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(16, 300)).astype(np.float32))
    t = jnp.asarray(rng.integers(0, 300, 37).astype(np.int32))
    ref = jax.jit(lambda h: jnp.take_along_axis(jax.nn.log_softmax(h @ w / 0.7, -1), t[:, None], -1)[:, 0])(h)
    chunked = jax.jit(chunked_logprobs, static_argnames=("chunk", "temperature"))
    for chunk in (8, 37, 64):
        np.testing.assert_allclose(chunked(h, t, w, chunk=chunk, temperature=0.7), ref, atol=1e-5)
    # gradients too
    g1 = jax.jit(jax.grad(lambda h: chunked_logprobs(h, t, w, chunk=8).sum()))(h)
    g2 = jax.jit(jax.grad(lambda h: jnp.take_along_axis(jax.nn.log_softmax(h @ w, -1), t[:, None], -1).sum()))(h)
    np.testing.assert_allclose(g1, g2, atol=1e-5)


def sequence_logprobs(hidden, tokens, weight, *, chunk):
    """out[:, t] = log p(tokens[:, t] | tokens[:, :t]) through chunked_logprobs; out[:, 0] = 0."""
    b, t, d = hidden.shape
    lp = chunked_logprobs(hidden[:, :-1].reshape(-1, d), tokens[:, 1:].reshape(-1), weight, chunk=chunk)
    return jnp.pad(lp.reshape(b, t - 1), ((0, 0), (1, 0)))


def test_chunked_logprobs_of_a_sequence_match_model_logits():
    model = init_model(Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=1,
                                   num_heads=2, num_kv_heads=1, head_dim=16))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 9)).astype(np.int32))
    lp, ref = nnx.jit(lambda m: (
        sequence_logprobs(m.hidden_states(tokens), tokens, m.output_weight(), chunk=4),
        jnp.take_along_axis(jax.nn.log_softmax(m(tokens), -1)[:, :-1], tokens[:, 1:, None], -1)[..., 0]))(model)
    np.testing.assert_allclose(lp[:, 1:], ref, atol=1e-5)
    assert float(jnp.abs(lp[:, 0]).max()) == 0.0


def test_chunked_logprobs_peak_memory_does_not_grow_with_vocab_times_length():
    d, v, chunk = 64, 32768, 256

    def temp_bytes(n):
        f = jax.jit(jax.value_and_grad(lambda h, w, t: chunked_logprobs(h, t, w, chunk=chunk).sum()))
        args = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
                jax.ShapeDtypeStruct((n,), jnp.int32))
        return f.lower(*args).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(1024), temp_bytes(8192)
    full_logits_large = 8192 * v * 4  # what a naive log_softmax would hold (1 GiB)
    # 8x the rows costs only the O(N*D) activations, never another O(N*V) block
    assert large < full_logits_large / 8, (small, large)
    assert large - small < 8192 * d * 4 * 8, (small, large)


# ---- clear errors on bad checkpoints ----

def test_missing_config_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(Qwen3Config(vocab_size=10, hidden_size=8,
                                                                 intermediate_size=8, num_layers=1, num_heads=1,
                                                                 num_kv_heads=1, head_dim=8).to_hf_dict()))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_pretrained(tmp_path)


def test_moe_architecture_rejected(tmp_path):
    cfg = Qwen3Config(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                      num_kv_heads=1, head_dim=8).to_hf_dict()
    cfg.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*qwen3_moe"):
        load_pretrained(tmp_path)


def test_tensor_shape_mismatch_names_tensor(tmp_path):
    make_hf_checkpoint(tmp_path, num_hidden_layers=1)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the file holds 128
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.down_proj\.weight.*\(64, 128\).*\(64, 96\)|"
                                         r"mlp\.gate_proj\.weight.*\(128, 64\).*\(96, 64\)"):
        load_pretrained(tmp_path)


def test_presets_have_hf_hyperparameters():
    p = PRESETS["qwen3-8b"]
    assert (p.hidden_size, p.num_layers, p.num_heads, p.num_kv_heads, p.intermediate_size) == (4096, 36, 32, 8, 12288)
    assert not p.tie_word_embeddings and p.rope_theta == 1e6
    assert 8.1e9 < p.num_params() < 8.3e9  # Qwen3-8B: 8.19B parameters
    assert 0.59e9 < PRESETS["qwen3-0.6b"].num_params() < 0.61e9  # 0.6B: 596M
    assert 4.0e9 < PRESETS["qwen3-4b"].num_params() < 4.1e9
