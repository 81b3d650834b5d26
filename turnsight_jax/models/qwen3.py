"""Dense Qwen3 in Flax NNX, numerically the Hugging Face `Qwen3ForCausalLM`.

Layer weights are stacked along a leading layer axis and the decoder runs as one `lax.scan`
over layers: a 36-layer model compiles as fast as a 1-layer one, and per-layer
rematerialisation is a `jax.checkpoint` on the scan body.

Weight layout (kernels are [in, out]; Hugging Face stores [out, in]):
  embed [V, D]; layers.{q,k,v} [L, D, H*Dh]; layers.o [L, Hq*Dh, D]; layers.{gate,up} [L, D, F];
  layers.down [L, F, D]; layers.{attn_norm,mlp_norm} [L, D]; layers.{q_norm,k_norm} [L, Dh];
  final_norm [D]; lm_head [D, V] (absent when embeddings are tied).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from turnsight_jax.models.attention import Layout, cache_attention, layout_attention
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.fused_attention import block_plan, fused_attention_fn
from turnsight_jax.models.sharding import constrain

LAYER_PARAMS = ("attn_norm", "q", "k", "v", "o", "q_norm", "k_norm", "mlp_norm", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """How the forward pass runs; does not change the math beyond float rounding.

    compute_dtype: dtype of matmul inputs and activations (float32 or bfloat16).
    remat: rematerialise each decoder layer in the backward pass.
    attn_q_chunk: queries per attention chunk (bounds the [chunk, keys] score block).
    vocab_block: vocabulary columns per logits block of the log-prob head (rl.logprobs); 0: the
        whole vocabulary at once.
    attn_row_group: > 0: in the forwards that ask for it (`hidden_states(skip_padding=True)`: the
        RL step's, the student's update included, and the teacher's views) attention runs the rows
        in groups of this many and skips a group's query chunks that hold only padding, in the
        forward and the backward pass (models.attention.chunked_attention); 0: all rows together,
        nothing skipped. For unsharded rows (one device).
    attn_key_block: with attn_row_group, a chunk's keys are scored this many at a time and a
        block none of the chunk's queries reads is skipped (packed rows' earlier items, a long
        row's keys past the chunk); 0: one score block per chunk.
    attn_impl: the kernel of the full-sequence forwards (`hidden_states`): "xla" (models.attention,
        every backend; the reference) or "pallas" (models.fused_attention: a fused flash kernel,
        Triton on GPUs, that skips the (query block, key block) tiles the layout's mask never
        reads); "pallas_interpret" runs that kernel in Pallas's interpreter (any backend, slow:
        for tests). The row-group and key-block options apply to "xla" only. Decoding against
        the KV cache (`extend`) always runs the XLA kernel.
    attn_block: the fused kernel's tile side (queries and keys per tile; a power of two).
    """

    compute_dtype: jnp.dtype = jnp.float32
    remat: bool = False
    attn_q_chunk: int = 512
    vocab_block: int = 0
    attn_row_group: int = 0
    attn_key_block: int = 0
    attn_impl: str = "xla"
    attn_block: int = 64


@struct.dataclass
class KVCache:
    """Keys and values of every layer. k, v [L, B, S, Hkv, Dh]; lengths [B] int32 filled slots."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @classmethod
    def zeros(cls, cfg: Qwen3Config, batch: int, max_len: int, dtype=jnp.float32) -> "KVCache":
        shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Hugging Face Qwen3RMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (rotate-half convention). x [B, T, H, Dh]; positions [B, T] int32."""
    dh = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[:, :, None, :]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out], as one 2-D matmul over the flattened leading axes.

    The same product as einsum("...i,io->...o"), but XLA on CPU runs the backward pass of a
    3-D dot (its weight gradient contracts two axes, batch and time) about 5x slower than the
    2-D one (BENCHMARKS.md, "Train step on CPU"); accelerators see no difference."""
    lead = x.shape[:-1]
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*lead, w.shape[-1])


def _init(rngs: nnx.Rngs, shape, dtype, std=0.02):
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Qwen3(nnx.Module):
    """Qwen3 causal LM.

    `model(tokens)` with tokens [B, T] int32 is a plain causal forward returning float32 logits
    [B, T, V] at positions 0..T-1. Training and scoring use `hidden_states` + chunked log-probs
    (turnsight_jax.logprobs) so that [B, T, V] float32 never exists.
    """

    def __init__(
        self,
        cfg: Qwen3Config,
        *,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        options: RuntimeOptions = RuntimeOptions(),
    ):
        self.config = cfg
        self.options = options
        L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        hq, hkv, dh = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        self.embed = nnx.Param(_init(rngs, (V, D), param_dtype))
        shapes = {
            "attn_norm": (L, D), "q": (L, D, hq), "k": (L, D, hkv), "v": (L, D, hkv), "o": (L, hq, D),
            "q_norm": (L, dh), "k_norm": (L, dh), "mlp_norm": (L, D),
            "gate": (L, D, F), "up": (L, D, F), "down": (L, F, D),
        }
        layers = {}
        for name, shape in shapes.items():
            if name.endswith("norm"):
                layers[name] = nnx.Param(jnp.ones(shape, param_dtype))
            else:
                layers[name] = nnx.Param(_init(rngs, shape, param_dtype))
        self.layers = nnx.Dict(layers)
        self.final_norm = nnx.Param(jnp.ones((D,), param_dtype))
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(_init(rngs, (D, V), param_dtype))

    # ---- pieces ----
    def output_weight(self) -> jax.Array:
        """The [D, V] matrix that maps final hidden states to logits."""
        if self.lm_head is None:
            return self.embed[...].T
        return self.lm_head[...]

    def _layer_params(self):
        return {name: self.layers[name][...] for name in LAYER_PARAMS}

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.options.compute_dtype)
        return constrain(x, "activation")

    def _qkv(self, p, x, positions):
        cfg, dt = self.config, self.options.compute_dtype
        b, t, _ = x.shape
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        q = dense(h, p["q"].astype(dt)).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = dense(h, p["k"].astype(dt)).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = dense(h, p["v"].astype(dt)).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        q = rope(rms_norm(q, p["q_norm"], cfg.rms_norm_eps), positions, cfg.rope_theta)
        k = rope(rms_norm(k, p["k_norm"], cfg.rms_norm_eps), positions, cfg.rope_theta)
        return constrain(q, "heads"), constrain(k, "heads"), constrain(v, "heads")

    def _finish_layer(self, p, x, attn):
        cfg, dt = self.config, self.options.compute_dtype
        b, t = x.shape[:2]
        x = x + dense(attn.reshape(b, t, -1), p["o"].astype(dt))
        x = constrain(x, "activation")
        h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        gate = dense(h, p["gate"].astype(dt))
        up = dense(h, p["up"].astype(dt))
        mlp = dense(constrain(jax.nn.silu(gate) * up, "mlp"), p["down"].astype(dt))
        return constrain(x + mlp, "activation")

    # ---- forward passes ----
    def hidden_states(self, tokens: jax.Array, layout: Layout | None = None, *, skip_padding: bool = False
                      ) -> jax.Array:
        """Final-norm hidden states [B, T, D] (compute dtype) for tokens [B, T] under `layout`
        (plain causal when None). skip_padding: attention skips its query chunks of padding per
        `options.attn_row_group` rows, with a backward pass of its own that skips them too (the RL
        step's forwards ask for it, rl.logprobs; the supervised warm-start does not: its steps keep
        the autodiff kernel's rounding, which the embedded default's pinned figures were measured
        with)."""
        if layout is None:
            layout = Layout.full(*tokens.shape)
        chunk, group = self.options.attn_q_chunk, self.options.attn_row_group if skip_padding else 0
        if self.options.attn_impl == "xla":
            attend = lambda q, k, v: layout_attention(q, k, v, layout, q_chunk=chunk, row_group=group,
                                                      key_block=self.options.attn_key_block)
        else:  # the tiles to run, planned once from the layout and shared by every layer
            attend = fused_attention_fn(block_plan(layout, self.options.attn_block),
                                        interpret=self.options.attn_impl == "pallas_interpret")

        def layer(x, p):
            q, k, v = self._qkv(p, x, layout.positions)
            return self._finish_layer(p, x, attend(q, k, v)), None

        if self.options.remat:
            layer = jax.checkpoint(layer, prevent_cse=False)
        x, _ = jax.lax.scan(layer, self.embed_tokens(tokens), self._layer_params())
        return rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] of hidden states [..., D]. Use on small slices only."""
        w = self.output_weight().astype(hidden.dtype)
        return jnp.einsum("...d,dv->...v", hidden, w, preferred_element_type=jnp.float32)

    def __call__(self, tokens: jax.Array, layout: Layout | None = None) -> jax.Array:
        return self.logits(self.hidden_states(tokens, layout))

    def extend(self, tokens: jax.Array, num_new: jax.Array, cache: KVCache, *, window: int | None = None,
               from_empty: bool = False) -> tuple[jax.Array, KVCache]:
        """Append up to N tokens per row to the cache and return their hidden states.

        tokens [B, N] int32; num_new [B] int32 (row b appends its first num_new[b] tokens; the
        rest are padding); cache with lengths [B]. Returns (hidden [B, N, D], cache with
        lengths + num_new). Serves prefill (N = prompt bucket), single-token decode (N = 1) and
        observation appends alike. Padding tokens write into slots past the new length, which no
        query reads and the next append overwrites.

        window: a static bound on the slots any query reads (every row's new length must be
        <= window); attention then costs O(window) instead of O(cache size) per token.
        from_empty: static promise that every row's cache is empty (lengths 0: a prefill), which
        lets attention skip the keys after each query chunk (`cache_attention`). Wrong results
        if the promise is broken.
        """
        b, n = tokens.shape
        cfg = self.config
        offs = jnp.arange(n, dtype=jnp.int32)[None, :]
        slots = cache.lengths[:, None] + offs  # [B, N]
        query_slots = jnp.where(offs < num_new[:, None], slots, -1)
        rows = jnp.arange(b)[:, None]
        chunk = self.options.attn_q_chunk
        window = cache.max_len if window is None else min(window, cache.max_len)

        def layer(carry, p):
            x, k_all, v_all, i = carry
            q, k, v = self._qkv(p, x, slots)
            # Written in place into the stacked cache (a scan carry): no per-layer copy.
            k_all = k_all.at[i, rows, slots].set(k.astype(k_all.dtype), mode="drop")
            v_all = v_all.at[i, rows, slots].set(v.astype(v_all.dtype), mode="drop")
            k_l = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(k_all, i, 0, keepdims=False), 0, window, 1)
            v_l = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_index_in_dim(v_all, i, 0, keepdims=False), 0, window, 1)
            attn = cache_attention(q, k_l.astype(q.dtype), v_l.astype(q.dtype), query_slots, q_chunk=chunk,
                                   from_empty=from_empty)
            return (self._finish_layer(p, x, attn), k_all, v_all, i + 1), None

        init = (self.embed_tokens(tokens), cache.k, cache.v, jnp.int32(0))
        (x, k_all, v_all, _), _ = jax.lax.scan(layer, init, self._layer_params())
        hidden = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)
        return hidden, KVCache(k_all, v_all, cache.lengths + num_new.astype(jnp.int32))


def init_model(
    cfg: Qwen3Config, *, seed: int = 0, param_dtype=jnp.float32, options: RuntimeOptions = RuntimeOptions()
) -> Qwen3:
    """A randomly initialised model (normal(0.02) kernels, unit norms), on the default device.

    The initialisation runs as one compiled program per (config, dtype, options), not op by op:
    eagerly, every parameter shape compiled its own random-normal kernels (19 compilations,
    ~1 s, for a 2-layer model). The values of `Qwen3(cfg, rngs=nnx.Rngs(seed), ...)` to float32
    rounding (compiled, the normal samples differ from the eager ones by at most an ulp)."""
    graphdef, init = _initializer(cfg, jnp.dtype(param_dtype), options)
    return nnx.merge(graphdef, init(jax.random.key(seed)))


@functools.lru_cache(maxsize=16)
def _initializer(cfg: Qwen3Config, param_dtype, options: RuntimeOptions):
    def build(rngs):
        return Qwen3(cfg, rngs=rngs, param_dtype=param_dtype, options=options)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build(nnx.Rngs(0))))
    return graphdef, jax.jit(lambda key: nnx.state(build(nnx.Rngs(key))))
