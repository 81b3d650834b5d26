"""The log-prob head in vocabulary blocks (rl.logprobs.chunked_logprobs, vocab_block > 0): the
online log-sum-exp gives the dense log-softmax's log-probs, entropies and extra-target log-probs,
and their gradients, for blocks that divide the vocabulary, leave a remainder, or hold it whole;
with unused rows skipped; with the vocabulary split over a mesh axis; and its largest float32
block is [chunk, block], not [chunk, V]."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from turnsight_jax.models.sharding import make_mesh
from turnsight_jax.rl.logprobs import chunked_logprobs

N, D, V, J = 37, 16, 300, 3
TEMP = 0.7


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(N, D)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(D, V)).astype(np.float32))
    t = jnp.asarray(rng.integers(0, V, N).astype(np.int32))
    extra = jnp.asarray(rng.integers(0, V, (N, J)).astype(np.int32))
    used = jnp.asarray(rng.random(N) < 0.6)
    g = jnp.asarray(rng.normal(size=(3, N)).astype(np.float32))  # cotangents of the three outputs
    return h, w, t, extra, used, g


def dense(h, w, t, extra):
    """The reference: a full [N, V] log-softmax."""
    logp = jax.nn.log_softmax(h @ w / TEMP, axis=-1)
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return (jnp.take_along_axis(logp, t[:, None], 1)[:, 0], ent, jnp.take_along_axis(logp, extra, 1))


def objective(fn, g):
    """A scalar mixing every output, so one gradient checks all three."""
    def f(h, w):
        lp, ent, x = fn(h, w)
        return jnp.sum(lp * g[0]) + jnp.sum(ent * g[1]) + jnp.sum(x.sum(-1) * g[2])
    return f


# blocks that divide V (3 x 100), leave a remainder (42 x 7 + 6; 1 x 256 + 44), hold it whole
@pytest.mark.parametrize("block", [7, 100, 256, 300, 0])
@pytest.mark.parametrize("chunk", [8, 64])  # several chunks, and one that holds every row
def test_blocked_head_equals_dense_log_softmax_with_gradients(data, block, chunk):
    h, w, t, extra, _, g = data

    def blocked(h, w):
        return chunked_logprobs(h, t, w, chunk=chunk, temperature=TEMP, with_entropy=True, extra_targets=extra,
                                vocab_block=block)

    got, want = jax.jit(blocked)(h, w), jax.jit(lambda h, w: dense(h, w, t, extra))(h, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    gh, gw = jax.jit(jax.grad(objective(blocked, g), argnums=(0, 1)))(h, w)
    rh, rw = jax.jit(jax.grad(objective(lambda h, w: dense(h, w, t, extra), g), argnums=(0, 1)))(h, w)
    assert float(jnp.abs(rh).max()) > 1e-2  # a real gradient
    np.testing.assert_allclose(gh, rh, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-4, atol=1e-5)


def test_blocked_head_skips_unused_rows_like_the_whole_vocabulary(data):
    """With `used`, the blocked head gives the whole-vocabulary head's values (0 on unused rows)
    and gradients."""
    h, w, t, extra, used, g = data

    def head(block):
        return lambda h, w: chunked_logprobs(h, t, w, chunk=8, temperature=TEMP, with_entropy=True,
                                             extra_targets=extra, used=used, vocab_block=block)

    got, want = jax.jit(head(7))(h, w), jax.jit(head(0))(h, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    assert float(jnp.abs(got[0][~used]).max()) == 0.0 and float(jnp.abs(got[0][used]).min()) > 0
    ga = jax.jit(jax.grad(objective(head(7), g), argnums=(0, 1)))(h, w)
    gb = jax.jit(jax.grad(objective(head(0), g), argnums=(0, 1)))(h, w)
    for a, b in zip(ga, gb):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(ga[0][~used]).max()) == 0.0  # unused rows get no gradient


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (tests/conftest.py)")
@pytest.mark.parametrize("block", [16, 0])  # 75 columns per shard: 4 x 16 + 11, and whole
def test_blocked_head_with_the_vocabulary_split_over_devices(data, block):
    """Inside shard_map with the vocabulary over a 4-way axis (each device [D, V/4], blocks within
    its columns), rows over a 2-way axis: the values and gradients of the unsharded head."""
    h, w, t, extra, _, g = data
    mesh = make_mesh(fsdp=2, tensor=4)
    n = 36  # rows divisible by the 2 row shards

    def sharded(h, w):
        fn = jax.shard_map(
            lambda h, t, w, x: chunked_logprobs(h, t, w, chunk=8, temperature=TEMP, with_entropy=True,
                                                extra_targets=x, vocab_axis="tensor", vocab_block=block),
            mesh=mesh, in_specs=(P("fsdp", None), P("fsdp"), P(None, "tensor"), P("fsdp", None)),
            out_specs=(P("fsdp"), P("fsdp"), P("fsdp", None)))
        return fn(h, t[:n], w, extra[:n])

    want = jax.jit(lambda h, w: dense(h, w, t[:n], extra[:n]))(h[:n], w)
    got = jax.jit(sharded)(h[:n], w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    gs = jax.jit(jax.grad(objective(sharded, g[:, :n]), argnums=(0, 1)))(h[:n], w)
    gd = jax.jit(jax.grad(objective(lambda h, w: dense(h, w, t[:n], extra[:n]), g[:, :n]), argnums=(0, 1)))(h[:n], w)
    for a, b in zip(gs, gd):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_blocked_head_holds_no_rows_by_vocabulary_block():
    """Forward and backward of 4,096 rows in one chunk over a 32,768-token vocabulary: in blocks of
    1,024 columns the compiled program's temporaries stay under one [4,096, 4,096] float32 block,
    where the whole-vocabulary head holds [4,096, 32,768] (512 MiB)."""
    n, d, v = 4096, 64, 32768

    def temp_bytes(block):
        f = jax.jit(jax.value_and_grad(lambda h, w, t: chunked_logprobs(h, t, w, chunk=n, vocab_block=block).sum(),
                                       argnums=(0, 1)))
        args = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d, v), jnp.float32),
                jax.ShapeDtypeStruct((n,), jnp.int32))
        return f.lower(*args).compile().memory_analysis().temp_size_in_bytes

    whole, blocked = temp_bytes(0), temp_bytes(1024)
    assert whole >= n * v * 4, whole
    assert blocked < n * 4096 * 4, blocked
