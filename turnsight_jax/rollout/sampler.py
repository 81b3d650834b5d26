"""KV-cached batched sampling: compiled prefill/append and a compiled decode loop.

The decode loop is one `lax.while_loop` per turn (no Python per token). Each step maps the
last hidden state to logits, samples, records the token and its log-prob, and appends the
token to the cache — also the stop token, so that after a turn the cache holds exactly the
tokens the policy emitted and an observation can be appended behind them.

Log-probs are those of the temperature-scaled, *untruncated* distribution,
log softmax(logits / T)[token], which is what a teacher-forced forward at temperature T gives
the trainer (top-k / top-p only restrict what can be drawn). Greedy decoding reports T = 1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from turnsight_jax.models.qwen3 import KVCache, Qwen3


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= n (at least `minimum`): the one bucket of the rollout's compiled
    shapes (rows, widths, windows), so a run meets a bounded number of shapes (compilations)."""
    return max(minimum, 1 << max(0, int(n - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature > 0; top_k = 0 disables; top_p = 1.0 disables; greedy ignores the rest.
    logprobs=False: the log-probs returned are 0 (an evaluation needs only the tokens); a greedy
    decode then skips its log-sum-exp over the vocabulary, and a truncated one its second."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    logprobs: bool = True

    def __post_init__(self):
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (use greedy=True for argmax), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


_BLOCK = 1024  # vocabulary block of the top-k search and the two-level sampler


def top_values(x: jax.Array, k: int) -> jax.Array:
    """x [B, V] -> [B, k], the k largest values of each row, descending (= lax.top_k(x, k)[0]).

    XLA's CPU top-k sorts the whole row (seconds for 64 x 151,936 per decoded token). Here: the
    k blocks of 1024 with the largest maxima hold every top-k value (if a top-k value lay in
    another block, those k block maxima would all be >= it), so top-k runs on those blocks only,
    then on their k x k candidates; same result, ~20-60x faster on CPU (benchmarks/topk.py)."""
    b, v = x.shape
    nb = -(-v // _BLOCK)
    blocks = jnp.pad(x, ((0, 0), (0, nb * _BLOCK - v)), constant_values=-jnp.inf).reshape(b, nb, _BLOCK)
    best = jax.lax.top_k(jnp.max(blocks, axis=-1), min(k, nb))[1]  # [B, k] block indices
    sub = jnp.take_along_axis(blocks, best[..., None], axis=1)  # [B, k, 1024]
    cand = jax.lax.top_k(sub, min(k, _BLOCK))[0].reshape(b, -1)
    return jax.lax.top_k(cand, k)[0]


def kth_largest(x: jax.Array, k: int) -> jax.Array:
    """x [B, V] -> [B], the k-th largest value of each row (= lax.top_k(x, k)[0][:, -1]; `top_values`)."""
    return top_values(x, k)[:, -1]


def token_signals(logits: jax.Array, params: SamplingParams, *, entropy: bool, top_j: int) -> dict[str, jax.Array]:
    """Per-row signals of the distribution the log-probs are of, softmax(logits / T) over the whole
    vocabulary (T = 1 when greedy): logits [B, V] float32 -> {"entropy": H [B], "top_j_nll": C [B]}
    (each only when asked), H = -sum_v p(v) log p(v) and C = -(1/j) sum of the j largest log p(v).
    Rollout controllers read them (rollout.control.DecodeSignals); the decode calls this only when
    one declared them."""
    scaled = logits if params.greedy else logits / params.temperature
    lse = jax.nn.logsumexp(scaled, axis=-1)
    out = {}
    if entropy:
        p = jnp.exp(scaled - lse[:, None])
        out["entropy"] = lse - jnp.sum(p * scaled, axis=-1)
    if top_j:
        out["top_j_nll"] = lse - jnp.mean(top_values(scaled, top_j), axis=-1)
    return out


def truncated_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Scaled logits [B, V] with tokens outside top-k / the top-p nucleus set to -inf.

    The nucleus keeps the smallest set of most likely tokens whose probability reaches top_p
    (the token that crosses the threshold is kept)."""
    scaled = logits / params.temperature
    if params.top_k:
        scaled = jnp.where(scaled >= kth_largest(scaled, params.top_k)[:, None], scaled, -jnp.inf)
    if params.top_p < 1.0:
        order = jnp.argsort(-scaled, axis=-1)
        sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = mass_before < params.top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(scaled.shape[0])[:, None], order].set(keep_sorted)
        scaled = jnp.where(keep, scaled, -jnp.inf)
    return scaled


def _inverse_cdf(scaled: jax.Array, u01: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact categorical draw from softmax(scaled) [B, V] by a two-level inverse CDF; u01 [B]
    one uniform in [0, 1) per row.

    One uniform per row instead of V Gumbel variates (threefry for 150k variates per row costs
    more than the whole forward pass of a small model on CPU). The vocabulary is split into blocks
    of 1024: a block is drawn from the block masses, then a token inside it. Returns (tokens [B],
    log-sum-exp [B]) so the caller gets log-probs without a second pass over V.
    """
    b, v = scaled.shape
    nb = -(-v // _BLOCK)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    p = jnp.exp(scaled - top)  # -inf (truncated) tokens get exactly 0
    p = jnp.pad(p, ((0, 0), (0, nb * _BLOCK - v))).reshape(b, nb, _BLOCK)
    mass = jnp.sum(p, axis=-1)  # [B, nb]
    total = jnp.sum(mass, axis=-1)
    u = u01 * total
    cum = jnp.cumsum(mass, axis=-1)
    blk = jnp.minimum(jnp.sum(cum <= u[:, None], axis=-1), nb - 1)
    # float round-off can leave u past the last non-empty block: step back to one with mass
    blk = jnp.where(jnp.take_along_axis(mass, blk[:, None], -1)[:, 0] > 0, blk,
                    nb - 1 - jnp.argmax(jnp.flip(mass > 0, -1), axis=-1))
    rest = u - (jnp.take_along_axis(cum, blk[:, None], -1)[:, 0] - jnp.take_along_axis(mass, blk[:, None], -1)[:, 0])
    inner = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]  # [B, 1024]
    icum = jnp.cumsum(inner, axis=-1)
    j = jnp.minimum(jnp.sum(icum <= rest[:, None], axis=-1), _BLOCK - 1)
    j = jnp.where(jnp.take_along_axis(inner, j[:, None], -1)[:, 0] > 0, j,
                  _BLOCK - 1 - jnp.argmax(jnp.flip(inner > 0, -1), axis=-1))
    return (blk * _BLOCK + j).astype(jnp.int32), top[:, 0] + jnp.log(total)


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams, forced: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row. logits [B, V] float32 -> (tokens [B] int32, logprobs [B] f32);
    forced [B] int32 optional: tokens that replace the draw where >= 0 (see `sample_uniform`)."""
    u01 = None if params.greedy else jax.random.uniform(key, (logits.shape[0],), jnp.float32)
    return sample_uniform(logits, u01, params, forced)


def sample_rows(logits: jax.Array, keys: jax.Array, params: SamplingParams, forced: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """`sample` with one key per row (keys [B]): a row's draw depends on its own key only, not on
    which other rows share the batch (the paged engine's determinism)."""
    u01 = None if params.greedy else jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    return sample_uniform(logits, u01, params, forced)


def sample_uniform(logits: jax.Array, u01: jax.Array | None, params: SamplingParams,
                   forced: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`sample` given the row uniforms u01 [B] (None when greedy). forced [B] int32 (-1: keep the
    draw) replaces drawn tokens; the log-prob returned is always the model's (tempered,
    untruncated) log-prob of the token returned. One log-sum-exp per row serves the draw and the
    log-prob, forced or not (a second pass over V costs as much as the head matmul on CPU)."""
    if params.greedy:
        scaled = logits
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        lse = jax.nn.logsumexp(logits, axis=-1) if params.logprobs else None
    else:
        scaled = logits / params.temperature
        truncated = params.top_k > 0 or params.top_p < 1.0
        tokens, lse = _inverse_cdf(truncated_logits(logits, params) if truncated else scaled, u01)
        if truncated and params.logprobs:  # of the untruncated tempered distribution (module docstring)
            lse = jax.nn.logsumexp(scaled, axis=-1)
    if forced is not None:
        tokens = jnp.where(forced >= 0, forced, tokens).astype(jnp.int32)
    if not params.logprobs:
        return tokens, jnp.zeros(tokens.shape, jnp.float32)
    return tokens, jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - lse


@struct.dataclass
class TurnOutput:
    """One decoded turn for every row. tokens, logprobs [B, N]; lengths [B] tokens emitted
    (stop token included); stopped [B] whether the row emitted a stop token."""

    tokens: jax.Array
    logprobs: jax.Array
    lengths: jax.Array
    stopped: jax.Array


def _last_hidden(hidden: jax.Array, num_new: jax.Array) -> jax.Array:
    """hidden [B, N, D] -> [B, D] at each row's last appended token."""
    idx = jnp.maximum(num_new - 1, 0)
    return jnp.take_along_axis(hidden, idx[:, None, None], axis=1)[:, 0]


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("window", "from_empty"), donate_argnums=(4,))
def append_tokens(graphdef, state, tokens, num_new, cache: KVCache, last_hidden, *, window: int | None = None,
                  from_empty: bool = False):
    """Append tokens [B, N] (num_new [B] real ones per row) to the cache; return the new cache
    and the hidden state [B, D] after each row's last token (rows appending 0 keep theirs).
    window: static bound on the filled slots after the append; from_empty: static, the cache is
    empty (a prefill) (see Qwen3.extend)."""
    model: Qwen3 = nnx.merge(graphdef, state)
    hidden, cache = model.extend(tokens, num_new, cache, window=window, from_empty=from_empty)
    new_last = _last_hidden(hidden, num_new)
    return cache, jnp.where((num_new > 0)[:, None], new_last.astype(last_hidden.dtype), last_hidden)


@functools.partial(jax.jit, static_argnums=(0, 5, 6), static_argnames=("window",), donate_argnums=(2,))
def decode_turn(graphdef, state, cache: KVCache, last_hidden, key, max_new: int, params: SamplingParams,
                stop_ids, active, budget, forced=None, counts=None, *, window: int | None = None):
    """Decode up to `max_new` tokens for every active row.

    last_hidden [B, D]: hidden state after each row's last cached token; stop_ids [S] int32;
    active [B] bool (inactive rows emit nothing and keep their cache); budget [B] int32 (a row
    emits at most budget[b] tokens); forced: optional [B, max_new] int32 of tokens that replace
    the sampled ones (-1 = sample), a scripted override whose log-probs are still the model's.
    key: one key, split per step (the draws depend on the batch layout); or, with counts [B]
    int32 (tokens each row drew before), one key per row [B]: a row's n-th draw uses
    fold_in(key[b], n), as the paged engine's, so it depends on the row's own key only (the
    split of episodes over chunks and processes changes nothing).
    Returns (TurnOutput, cache, last_hidden, key). Rows stop at
    a stop token, at their budget, or when the cache is full."""
    model: Qwen3 = nnx.merge(graphdef, state)
    w = model.output_weight()
    b = last_hidden.shape[0]
    out_tok = jnp.zeros((b, max_new), jnp.int32)
    out_lp = jnp.zeros((b, max_new), jnp.float32)

    def cond(c):
        step, done = c[0], c[1]
        return (step < max_new) & ~jnp.all(done)

    def body(c):
        step, done, stopped, count, out_tok, out_lp, cache, hidden, key = c
        logits = jnp.einsum("bd,dv->bv", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
        force = None if forced is None else forced[:, step]
        if counts is None:
            key, sub = jax.random.split(key)
            tok, lp = sample(logits, sub, params, force)
        else:
            tok, lp = sample_rows(logits, jax.vmap(jax.random.fold_in)(key, counts + count), params, force)
        live = ~done
        out_tok = out_tok.at[:, step].set(jnp.where(live, tok, 0))
        out_lp = out_lp.at[:, step].set(jnp.where(live, lp, 0.0))
        h, cache = model.extend(tok[:, None], live.astype(jnp.int32), cache, window=window)
        hidden = jnp.where(live[:, None], h[:, 0].astype(hidden.dtype), hidden)
        is_stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1) & live
        full = cache.lengths >= cache.max_len
        count = count + live.astype(jnp.int32)
        return (step + 1, done | is_stop | full | (count >= budget), stopped | is_stop, count, out_tok, out_lp, cache, hidden, key)

    done0 = ~active | (cache.lengths >= cache.max_len) | (budget <= 0)
    zeros = jnp.zeros((b,), jnp.int32)
    init = (jnp.int32(0), done0, jnp.zeros((b,), bool), zeros, out_tok, out_lp, cache, last_hidden, key)
    _, _, stopped, count, out_tok, out_lp, cache, hidden, key = jax.lax.while_loop(cond, body, init)
    return TurnOutput(out_tok, out_lp, count, stopped), cache, hidden, key


def global_rows(row_offset, rows: int, padded: int | None = None) -> np.ndarray:
    """[padded] int32: the global row of each of `rows` episodes, whose sampling key is
    fold_in(key(seed), global row): row_offset + r for an int offset, or row_offset[r] for a
    sequence of `rows` ids (a rollout controller's own stable numbering, e.g. prompt x cap + k,
    when the episodes of one call are not a contiguous range). Rows past `rows` (a policy's
    padding, never sampled from) continue the numbering after the largest id."""
    padded = rows if padded is None else padded
    if np.ndim(row_offset) == 0:
        return np.arange(padded, dtype=np.int32) + np.int32(row_offset)
    ids = np.asarray(row_offset, np.int64)
    if ids.shape != (rows,):
        raise ValueError(f"row_offset: {ids.shape[0] if ids.ndim == 1 else ids.shape} global rows for {rows} episodes")
    if rows and (ids.min() < 0 or ids.max() >= 2**31 - padded):
        raise ValueError(f"row_offset: global rows must lie in [0, 2**31 - {padded}), got {ids.min()}..{ids.max()}")
    top = int(ids.max()) + 1 if rows else 0
    return np.concatenate([ids, np.arange(top, top + padded - rows)]).astype(np.int32)
