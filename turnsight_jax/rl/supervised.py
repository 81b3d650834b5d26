"""The supervised update the warm-start (turnsight_jax.sft) and the distilled judge
(turnsight_jax.judge.distill) share: demonstrations padded into rows, their policy tokens laid back
to back, one step of full-vocabulary cross-entropy on them, and SFT's optimizer schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from turnsight_jax.models.attention import Layout
from turnsight_jax.rl.config import OptimConfig
from turnsight_jax.rl.logprobs import chunked_logprobs
from turnsight_jax.rl.step import make_optimizer


def pad_demonstrations(rows, width: int, pol_width: int):
    """rows of (tokens [t], policy_mask [t]) -> tokens, valid [B, width]; pol_pos, pol_valid [B, pol_width]."""
    b = len(rows)
    tokens = np.zeros((b, width), np.int32)
    valid = np.zeros((b, width), bool)
    pol_pos = np.zeros((b, pol_width), np.int32)
    pol_valid = np.zeros((b, pol_width), bool)
    for i, (ids, pm) in enumerate(rows):
        tokens[i, :len(ids)] = ids
        valid[i, :len(ids)] = True
        p = np.flatnonzero(pm)
        pol_pos[i, :p.size] = p
        pol_valid[i, :p.size] = True
    return tokens, valid, pol_pos, pol_valid


def flatten_policy(pol_pos: np.ndarray, pol_valid: np.ndarray, multiple: int = 256):
    """pol_pos, pol_valid [B, N] -> row, pos [P] int32, keep [P] bool: the batch's policy tokens
    back to back, padded to a multiple of `multiple` (few distinct shapes, so few compilations)."""
    row, col = np.nonzero(pol_valid)
    p = max(multiple, -(-row.size // multiple) * multiple)
    flat_row = np.zeros(p, np.int32)
    flat_pos = np.zeros(p, np.int32)
    keep = np.zeros(p, bool)
    flat_row[:row.size] = row
    flat_pos[:row.size] = pol_pos[row, col]
    keep[:row.size] = True
    return flat_row, flat_pos, keep


def sft_update(graphdef, optimizer, params, opt_state, tokens, valid, flat_row, flat_pos, keep):
    """One step of full-vocabulary cross-entropy on the policy tokens. tokens, valid [B, T];
    flat_row, flat_pos, keep [P] (`flatten_policy`): the 151,936-wide projection, most of a step's
    cost, runs on the real policy tokens only, not on every row padded to the longest."""
    def loss_fn(p):
        model = nnx.merge(graphdef, p)
        hidden = model.hidden_states(tokens, Layout.causal(valid))
        rows = hidden[flat_row, jnp.maximum(flat_pos - 1, 0)]  # [P, D]
        lp = chunked_logprobs(rows, tokens[flat_row, flat_pos], model.output_weight(), chunk=1024,
                              vocab_block=model.options.vocab_block)
        return -jnp.sum(lp * keep) / jnp.maximum(keep.sum(), 1)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


sft_step = jax.jit(sft_update, static_argnums=(0, 1), donate_argnums=(2, 3))


def state_pinned(update, params, opt_state):
    """`update` jitted with its (params, opt_state) outputs in the inputs' shardings.

    Left to the compiler, a one-device mesh returns P('tensor', 'fsdp') parameters as P(): an
    equivalent but unequal sharding, so the second step compiled the whole step again (3.5 s of
    a short warm-start)."""
    shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
    return jax.jit(update, static_argnums=(0, 1), donate_argnums=(2, 3), out_shardings=(*shardings, None))


def sft_optimizer(lr: float, steps: int):
    """The trainer's optimizer with SFT's schedule: a short warm-up, cosine decay to lr / 10."""
    warmup = min(10, max(steps // 10, 1))
    return make_optimizer(OptimConfig(lr=lr, schedule="cosine", warmup_steps=warmup, total_steps=steps,
                                      min_lr_ratio=0.1, weight_decay=0.0, b2=0.999, max_grad_norm=1.0))
