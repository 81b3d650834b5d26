"""Log-probs of policy tokens: the student on its own context, the frozen teacher on the packed
hindsight views, both through a chunked log-softmax that never forms a [B, T, V] float32 array.

For each chunk of rows the logits [C, V] are formed in float32, reduced by log-sum-exp and
gathered at the target, inside a rematerialised `lax.scan` body: the peak extra memory is one
[C, V] float32 block in the forward and in the backward pass, whatever B * T is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from turnsight_jax.models.attention import Layout
from turnsight_jax.models.qwen3 import Qwen3
from turnsight_jax.rl.views import PackedViews


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


def gather_rows(hidden: jax.Array, index: jax.Array) -> jax.Array:
    """hidden [B, P, D], index [B, N] int32 -> [B, N, D] (per-row gather; shards along B)."""
    return jnp.take_along_axis(hidden, index[..., None], axis=1)


def logprobs_at(model: Qwen3, hidden: jax.Array, pred_index: jax.Array, targets: jax.Array, *,
                chunk: int, temperature: float = 1.0) -> jax.Array:
    """log p(targets[b, n] | hidden[b, pred_index[b, n]]); pred_index, targets [B, N] -> [B, N] f32."""
    b, n = targets.shape
    rows = gather_rows(hidden, pred_index)
    lp = chunked_logprobs(rows.reshape(b * n, -1), targets.reshape(-1), model.output_weight(), chunk=chunk,
                          temperature=temperature)
    return lp.reshape(b, n)


def student_logprobs(model: Qwen3, tokens: jax.Array, valid_mask: jax.Array, pol_pos: jax.Array, *,
                     chunk: int = 1024, temperature: float = 1.0) -> jax.Array:
    """Student log-probs of its policy tokens. tokens, valid_mask [B, T]; pol_pos [B, N] -> [B, N]."""
    hidden = model.hidden_states(tokens, Layout.causal(valid_mask))
    targets = jnp.take_along_axis(tokens, pol_pos, axis=1)
    return logprobs_at(model, hidden, jnp.maximum(pol_pos - 1, 0), targets, chunk=chunk, temperature=temperature)


def teacher_logprobs(model: Qwen3, views: PackedViews, *, chunk: int = 1024, temperature: float = 1.0) -> jax.Array:
    """Frozen-teacher log-probs of the policy tokens under every view of `views.view_pred`
    (the hindsight depths, then the plain reference row when built with_reference).

    One forward over the packed rows; the vocabulary projection runs once per distinct
    (predictor, target) pair and is gathered into [R, B, N] float32, outside the gradient."""
    hidden = model.hidden_states(views.tokens, views.layout)
    distinct = logprobs_at(model, hidden, views.pred, views.pred_target, chunk=chunk, temperature=temperature)
    out = jax.vmap(lambda s: jnp.take_along_axis(distinct, s, axis=1))(views.slot)
    return jax.lax.stop_gradient(out)
