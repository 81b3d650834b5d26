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
    with_entropy: bool = False,
):
    """log softmax(hidden @ weight / temperature)[target] per row.

    hidden [N, D] (any float dtype); targets [N] int32; weight [D, V]. Returns [N] float32, or
    with `with_entropy` the pair ([N], [N]) with the entropy -Σ_v p_v log p_v of each row's
    tempered distribution, from the same [C, V] logits block (differentiable like the log-probs).
    """
    n, d = hidden.shape
    inv_t = 1.0 / float(temperature)
    w = weight.astype(hidden.dtype)

    def rows(h, t):
        logits = jnp.einsum("nd,dv->nv", h, w, preferred_element_type=jnp.float32) * inv_t
        picked = jnp.take_along_axis(logits, t[:, None], axis=-1)[:, 0]
        lse = jax.nn.logsumexp(logits, axis=-1)
        if not with_entropy:
            return picked - lse
        # H = lse - Σ p·logits (p = softmax): no [C, V] log-prob array beyond p itself
        probs = jnp.exp(logits - lse[:, None])
        return picked - lse, lse - jnp.sum(probs * logits, axis=-1)

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
    return jax.tree.map(lambda o: o.reshape(-1)[:n], out)


def gather_rows(hidden: jax.Array, index: jax.Array) -> jax.Array:
    """hidden [B, P, D], index [B, N] int32 -> [B, N, D] (per-row gather; shards along B)."""
    return jnp.take_along_axis(hidden, index[..., None], axis=1)


def logprobs_at(model: Qwen3, hidden: jax.Array, pred_index: jax.Array, targets: jax.Array, *,
                chunk: int, temperature: float = 1.0, with_entropy: bool = False):
    """log p(targets[b, n] | hidden[b, pred_index[b, n]]); pred_index, targets [B, N] -> [B, N] f32
    (with `with_entropy`, also the entropy of each predicted distribution [B, N])."""
    b, n = targets.shape
    rows = gather_rows(hidden, pred_index)
    out = chunked_logprobs(rows.reshape(b * n, -1), targets.reshape(-1), model.output_weight(), chunk=chunk,
                           temperature=temperature, with_entropy=with_entropy)
    return jax.tree.map(lambda o: o.reshape(b, n), out)


def predictor_positions(valid_mask: jax.Array, pol_pos: jax.Array) -> jax.Array:
    """Index of the token whose hidden state predicts each policy token: the last readable token
    before it. valid_mask [B, T] bool (the tokens the forward reads), pol_pos [B, N] -> [B, N] int32.

    With every token readable this is pol_pos - 1. With observation tokens masked out
    (rl.student_sees_observations=False) the first token of turn k > 0 is predicted by the last
    policy token of turn k - 1, as in the released code, whose forward drops the masked tokens."""
    t = valid_mask.shape[1]
    last_readable = jax.lax.cummax(jnp.where(valid_mask, jnp.arange(t, dtype=jnp.int32)[None], 0), axis=1)
    return jnp.take_along_axis(last_readable, jnp.maximum(pol_pos - 1, 0), axis=1)


def student_logprobs(model: Qwen3, tokens: jax.Array, valid_mask: jax.Array, pol_pos: jax.Array, *,
                     chunk: int = 1024, temperature: float = 1.0, with_entropy: bool = False):
    """Student log-probs of its policy tokens. tokens, valid_mask [B, T]; pol_pos [B, N] -> [B, N]
    (with `with_entropy`: (log-probs, token entropies), both [B, N]).

    valid_mask names the tokens the forward reads (rl.batch.TrainBatch.valid); an unreadable token
    is neither attended to nor a predictor. Rotary positions stay the tokens' own indices, so a
    masked span leaves a gap in the positions, as in the released code (docs/spec.md §1.9)."""
    hidden = model.hidden_states(tokens, Layout.causal(valid_mask))
    targets = jnp.take_along_axis(tokens, pol_pos, axis=1)
    return logprobs_at(model, hidden, predictor_positions(valid_mask, pol_pos), targets, chunk=chunk,
                       temperature=temperature, with_entropy=with_entropy)


def teacher_logprobs(model: Qwen3, views: PackedViews, *, chunk: int = 1024, temperature: float = 1.0) -> jax.Array:
    """Frozen-teacher log-probs of the policy tokens under every view of `views.view_pred`
    (the hindsight depths, then the plain reference row when built with_reference).

    One forward over the packed rows; the vocabulary projection runs once per distinct
    (predictor, target) pair and is gathered into [R, B, N] float32, outside the gradient."""
    hidden = model.hidden_states(views.tokens, views.layout)
    distinct = logprobs_at(model, hidden, views.pred, views.pred_target, chunk=chunk, temperature=temperature)
    out = jax.vmap(lambda s: jnp.take_along_axis(distinct, s, axis=1))(views.slot)
    return jax.lax.stop_gradient(out)
