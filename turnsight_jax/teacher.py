"""Log-probs of policy tokens: the student on its own context, the frozen teacher on the packed
hindsight views. Both are computed only at policy positions, in chunks (turnsight_jax.logprobs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from turnsight_jax.logprobs import chunked_logprobs
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.qwen3 import Qwen3
from turnsight_jax.views import PackedViews


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
