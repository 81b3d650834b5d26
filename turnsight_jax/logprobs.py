"""Per-token log-probabilities computed in chunks, never as a full [B, T, V] float32 array.

For each chunk of rows the logits [C, V] are formed in float32, reduced by log-sum-exp and
gathered at the target, inside a rematerialised `lax.scan` body: the peak extra memory is one
[C, V] float32 block in the forward and in the backward pass, whatever B * T is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chunked_logprobs(
    hidden: jax.Array,
    targets: jax.Array,
    weight: jax.Array,
    *,
    chunk: int = 1024,
    temperature: float = 1.0,
) -> jax.Array:
    """log softmax(hidden @ weight / temperature)[target] per row.

    hidden [N, D] (any float dtype); targets [N] int32; weight [D, V]. Returns [N] float32.
    """
    n, d = hidden.shape
    inv_t = 1.0 / float(temperature)
    w = weight.astype(hidden.dtype)

    def rows(h, t):
        logits = jnp.einsum("nd,dv->nv", h, w, preferred_element_type=jnp.float32) * inv_t
        picked = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        return picked - jax.nn.logsumexp(logits, axis=-1)

    if n <= chunk:
        return rows(hidden, targets)
    num = -(-n // chunk)
    pad = num * chunk - n
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(num, chunk, d)
    t = jnp.pad(targets, (0, pad)).reshape(num, chunk)

    @jax.checkpoint
    def body(_, xs):
        return None, rows(*xs)

    _, out = jax.lax.scan(body, None, (h, t))
    return out.reshape(-1)[:n]


def sequence_logprobs(
    hidden: jax.Array, tokens: jax.Array, weight: jax.Array, *, chunk: int = 1024, temperature: float = 1.0
) -> jax.Array:
    """Log-prob of each token given its prefix: hidden [B, T, D] of a causal forward over
    tokens [B, T]. Returns [B, T] float32 where out[:, t] = log p(tokens[:, t] | tokens[:, :t]);
    out[:, 0] is 0 (nothing predicts the first token)."""
    b, t, d = hidden.shape
    lp = chunked_logprobs(
        hidden[:, :-1].reshape(-1, d), tokens[:, 1:].reshape(-1), weight, chunk=chunk, temperature=temperature
    ).reshape(b, t - 1)
    return jnp.pad(lp, ((0, 0), (1, 0)))
