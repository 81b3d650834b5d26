"""turnsight_jax.rl.logprobs: the token entropy from the chunked log-softmax pass, and the student
forward with observation tokens masked out (rl.student_sees_observations=False)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from turnsight_jax.models.attention import NO_SEGMENT, Layout
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import init_model
from turnsight_jax.rl.logprobs import predictor_positions, student_logprobs

# A small vocabulary keeps the dense numpy reference cheap; nothing here needs the tokenizer.
CFG = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)

# One row of 12 slots: prompt 0-2, policy turn 0 at 3-5, observation (tool response + next header)
# at 6-8, policy turn 1 at 9-10, padding at 11. A second row: prompt 0-1, policy 2-4, no observation.
TOKENS = np.array([[5, 17, 3, 40, 41, 42, 60, 61, 62, 43, 44, 0],
                   [7, 8, 50, 51, 52, 0, 0, 0, 0, 0, 0, 0]], np.int32)
REAL = np.arange(12)[None] < np.array([[11], [5]])
CONTEXT = REAL.copy()
CONTEXT[0, 6:9] = False  # the student does not read the observation
POL_POS = np.array([[3, 4, 5, 9, 10, 0], [2, 3, 4, 0, 0, 0]], np.int32)
POL_VALID = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], bool)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


def _np_log_softmax(logits):
    z = logits - logits.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_predictor_positions_skip_masked_tokens():
    # every token readable: the previous token; masked 6-8: turn 1's first token (9) is predicted
    # by turn 0's last policy token (5)
    np.testing.assert_array_equal(predictor_positions(jnp.asarray(REAL), jnp.asarray(POL_POS)),
                                  [[2, 3, 4, 8, 9, 0], [1, 2, 3, 0, 0, 0]])
    np.testing.assert_array_equal(predictor_positions(jnp.asarray(CONTEXT), jnp.asarray(POL_POS)),
                                  [[2, 3, 4, 5, 9, 0], [1, 2, 3, 0, 0, 0]])


@pytest.mark.parametrize("chunk", [64, 4])  # one block, and the scanned path (12 rows in blocks of 4)
def test_entropy_equals_numpy_entropy_of_the_logits(model, chunk):
    temp = 0.7
    scored = nnx.jit(student_logprobs, static_argnames=("chunk", "temperature", "with_entropy"))
    lp, ent = scored(model, jnp.asarray(TOKENS), jnp.asarray(REAL), jnp.asarray(POL_POS), chunk=chunk,
                     temperature=temp, with_entropy=True)
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(TOKENS)), np.float64) / temp  # [B, T, V], dense: the reference
    logp = _np_log_softmax(logits)
    want_ent = -(np.exp(logp) * logp).sum(-1)  # H = -Σ p log p at each position
    pred = POL_POS - 1
    for b in range(2):
        n = POL_VALID[b].sum()
        np.testing.assert_allclose(ent[b, :n], want_ent[b, pred[b, :n]], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lp[b, :n], logp[b, pred[b, :n], TOKENS[b, POL_POS[b, :n]]], rtol=1e-5, atol=1e-6)
    assert float(np.min(ent[POL_VALID])) > 0 and float(np.max(ent[POL_VALID])) <= np.log(CFG.vocab_size) + 1e-5
    # the log-probs do not depend on whether the entropy is asked for
    alone = scored(model, jnp.asarray(TOKENS), jnp.asarray(REAL), jnp.asarray(POL_POS), chunk=chunk, temperature=temp)
    np.testing.assert_array_equal(alone, lp)


def test_entropy_gradient_matches_a_dense_reference(model):
    graphdef, params = nnx.split(model)
    mask = jnp.asarray(POL_VALID, jnp.float32)

    def chunked(p):
        _, ent = student_logprobs(nnx.merge(graphdef, p), jnp.asarray(TOKENS), jnp.asarray(REAL),
                                  jnp.asarray(POL_POS), chunk=4, with_entropy=True)
        return jnp.sum(ent * mask)

    def dense(p):  # full [B, T, V] log-softmax: fine at V = 97
        logp = jax.nn.log_softmax(nnx.merge(graphdef, p)(jnp.asarray(TOKENS)), -1)
        ent = -jnp.sum(jnp.exp(logp) * logp, -1)
        return jnp.sum(jnp.take_along_axis(ent, jnp.asarray(POL_POS - 1).clip(0), 1) * mask)

    g = jax.jit(jax.grad(chunked))(params)
    want = jax.jit(jax.grad(dense))(params)
    leaves = jax.tree.leaves(g)
    assert all(np.all(np.isfinite(x)) for x in leaves)
    assert max(float(np.abs(x).max()) for x in leaves) > 1e-4  # a real gradient
    for a, b in zip(leaves, jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_masked_student_equals_a_forward_without_the_observation(model):
    """The masked forward equals a plain forward of the row with tokens 6-8 removed, at the kept
    tokens' own positions (the released code keeps position ids running through masked tokens)."""
    scored = nnx.jit(student_logprobs, static_argnames=("chunk",))
    lp = scored(model, jnp.asarray(TOKENS), jnp.asarray(CONTEXT), jnp.asarray(POL_POS), chunk=4)
    kept = np.flatnonzero(CONTEXT[0])  # [0 1 2 3 4 5 9 10]
    short = jnp.asarray(TOKENS[0, kept][None])
    n = kept.size
    none, zero = jnp.full((1, n), NO_SEGMENT, jnp.int32), jnp.zeros((1, n), jnp.int32)
    layout = Layout(jnp.asarray(kept[None], jnp.int32), zero, none, zero, none, zero)
    logp = _np_log_softmax(np.asarray(nnx.jit(lambda m, x, lay: m(x, lay))(model, short, layout), np.float64))[0]
    # policy tokens are kept indices 3, 4, 5, 6, 7 (positions 3, 4, 5, 9, 10), each predicted by the one before
    want = [logp[j - 1, TOKENS[0, kept[j]]] for j in range(3, 8)]
    np.testing.assert_allclose(lp[0, :5], want, rtol=1e-5, atol=1e-6)
    # the second row has no observation: masking changes nothing there
    full = scored(model, jnp.asarray(TOKENS), jnp.asarray(REAL), jnp.asarray(POL_POS), chunk=4)
    np.testing.assert_array_equal(lp[1], full[1])
    # turn 0 is before the observation: the same either way; turn 1 differs (it no longer reads it)
    np.testing.assert_allclose(lp[0, :3], full[0, :3], rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(lp[0, 3:5] - full[0, 3:5]))) > 1e-3


@pytest.mark.parametrize("chunk", [4, 64])
def test_unused_slots_are_skipped_not_changed(chunk):
    """chunked_logprobs(used=...): the used rows' log-probs, entropies and gradients equal the
    dense computation; the others are 0; chunks of unused rows do not run (a NaN planted in them
    does not reach the output or the gradient)."""
    from turnsight_jax.rl.logprobs import chunked_logprobs

    rng = np.random.default_rng(0)
    n, d, v = 37, 8, 50
    h = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    t = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    used_np = np.arange(n) % 3 == 0
    used = jnp.asarray(used_np)
    # the used rows move to the front; the unused rows after the last live chunk are poisoned
    live_rows = -(-int(used_np.sum()) // chunk) * chunk
    dead = np.flatnonzero(~used_np)[live_rows - int(used_np.sum()):]
    planted = h.at[dead].set(jnp.nan)

    def f(hh, ww, u):
        lp, ent = chunked_logprobs(hh, t, ww, chunk=chunk, with_entropy=True, used=u)
        return jnp.sum(jnp.where(used, lp + 0.3 * ent, 0.0)), (lp, ent)

    (_, (lp, ent)), (gh, gw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(h, w, None)
    (_, (lp_u, ent_u)), (gh_u, gw_u) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        planted if chunk < n else h, w, used)
    assert chunk >= n or dead.size > 10  # the poison is there to be skipped
    np.testing.assert_allclose(np.asarray(lp_u)[used], np.asarray(lp)[used], atol=1e-6)
    np.testing.assert_allclose(np.asarray(ent_u)[used], np.asarray(ent)[used], atol=1e-6)
    assert np.all(np.asarray(lp_u)[~used] == 0.0) and np.all(np.asarray(ent_u)[~used] == 0.0)
    np.testing.assert_allclose(np.asarray(gw_u), np.asarray(gw), atol=1e-5)
    np.testing.assert_allclose(np.asarray(gh_u)[used], np.asarray(gh)[used], atol=1e-6)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (tests/conftest.py)")
def test_fewer_rows_than_devices_on_an_fsdp_mesh(model):
    """2 rows on a mesh of 8 (fsdp): the rows cannot be split, so every device holds both, and the
    head's weight (its D split over fsdp) is gathered to the same value everywhere. The log-probs,
    with chunks of unused slots skipped, and the gradients equal those off the mesh (the released
    MatchTIR recipe's update stopped compiling here: the gathered weight was typed as varying)."""
    from turnsight_jax.models.sharding import make_mesh
    from turnsight_jax.rl.logprobs import logprobs_at

    rng = np.random.default_rng(3)
    hidden = jnp.asarray(rng.normal(size=(2, 12, CFG.hidden_size)), jnp.float32)
    pred, used = jnp.asarray(POL_POS), jnp.asarray(POL_VALID)
    targets = jnp.asarray(rng.integers(0, CFG.vocab_size, POL_POS.shape), jnp.int32)
    coef = jnp.asarray(rng.normal(size=POL_POS.shape), jnp.float32)
    graphdef, state = nnx.split(model)

    def loss(state, h):
        lp = logprobs_at(nnx.merge(graphdef, state), h, pred, targets, chunk=2, used=used)
        return jnp.sum(lp * coef), lp

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (_, want), (want_gs, want_gh) = jax.jit(grad)(state, hidden)
    with jax.set_mesh(make_mesh(1, 8, 1)):
        (_, got), (got_gs, got_gh) = jax.jit(grad)(state, hidden)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert np.all(np.asarray(got)[~POL_VALID] == 0.0) and np.all(np.abs(np.asarray(want)[POL_VALID]) > 0)
    np.testing.assert_allclose(np.asarray(got_gh), np.asarray(want_gh), atol=1e-5)
    for a, b in zip(jax.tree.leaves(got_gs), jax.tree.leaves(want_gs), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert float(jnp.abs(model.output_weight()).sum()) > 0 and any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(got_gs))
