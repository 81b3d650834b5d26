"""PPO's critic math (methods.critic): GAE equals a loop reference on padded, gapped layouts and has
the textbook limits; the reward sits on the last policy token; whitening and the clipped value
loss equal hand-computed values."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.methods import critic


def _loop_gae(r, v, m, gamma, lam):
    """The definition, step by step over each row's masked positions."""
    adv = np.zeros_like(r, dtype=np.float64)
    for b in range(r.shape[0]):
        idx = np.flatnonzero(m[b])
        run, nxt = 0.0, 0.0
        for t in reversed(idx):
            run = r[b, t] + gamma * nxt - v[b, t] + gamma * lam * run
            adv[b, t], nxt = run, v[b, t]
    return adv, np.where(m, adv + v, 0.0)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0), (0.99, 0.3)])
def test_gae_equals_loop_reference(gamma, lam):
    rng = np.random.default_rng(int(gamma * 100 + lam * 10))
    b, n = 5, 17
    r = rng.normal(size=(b, n)).astype(np.float32)
    v = rng.normal(size=(b, n)).astype(np.float32)
    m = rng.random((b, n)) < 0.7  # gaps inside rows (skipped positions) and padding
    m[3] = False  # a row without steps
    adv, ret = jax.jit(lambda *a: critic.gae(*a, gamma=gamma, lam=lam))(r, v, m)
    want_adv, want_ret = _loop_gae(r, v, m, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), want_adv, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), want_ret, atol=1e-5)
    assert np.all(np.asarray(adv)[~m] == 0.0) and np.all(np.asarray(ret)[~m] == 0.0)


def test_gae_skipped_positions_change_nothing():
    """Inserting unmasked positions (observation tokens in a full layout) between the steps
    leaves every step's advantage unchanged: γ and λ apply per step, not per slot."""
    r = np.array([[0.0, 0.0, 1.0]], np.float32)
    v = np.array([[0.2, 0.5, 0.7]], np.float32)
    compact = critic.gae(r, v, np.ones((1, 3), bool), gamma=0.9, lam=0.8)[0]
    gapped_r = np.array([[0.0, 9.0, 9.0, 0.0, 9.0, 1.0, 9.0]], np.float32)  # 9s sit on skipped slots
    gapped_v = np.array([[0.2, 5.0, 5.0, 0.5, 5.0, 0.7, 5.0]], np.float32)
    mask = np.array([[1, 0, 0, 1, 0, 1, 0]], bool)
    gapped = critic.gae(gapped_r, gapped_v, mask, gamma=0.9, lam=0.8)[0]
    np.testing.assert_allclose(np.asarray(gapped)[mask], np.asarray(compact)[0], atol=1e-6)


def test_gae_hand_values():
    """Three steps, reward 1 at the end, V = (0.2, 0.5, 0.7), γ = 0.9, λ = 0.8:
    δ = (0 + 0.45 − 0.2, 0 + 0.63 − 0.5, 1 − 0.7) = (0.25, 0.13, 0.3);
    A_3 = 0.3, A_2 = 0.13 + 0.72·0.3 = 0.346, A_1 = 0.25 + 0.72·0.346 = 0.49912."""
    adv, ret = critic.gae(np.array([[0.0, 0.0, 1.0]]), np.array([[0.2, 0.5, 0.7]]), np.ones((1, 3), bool),
                          gamma=0.9, lam=0.8)
    np.testing.assert_allclose(np.asarray(adv)[0], [0.49912, 0.346, 0.3], atol=1e-6)
    np.testing.assert_allclose(np.asarray(ret)[0], [0.69912, 0.846, 1.0], atol=1e-6)


def test_gae_limits():
    """λ = 1: A_t = discounted return − V_t (Monte Carlo); λ = 0: A_t = the one-step TD error."""
    rng = np.random.default_rng(1)
    r = rng.normal(size=(3, 9)).astype(np.float32)
    v = rng.normal(size=(3, 9)).astype(np.float32)
    m = np.ones((3, 9), bool)
    g = 0.8
    disc = np.array([[sum(g ** (j - t) * r[b, j] for j in range(t, 9)) for t in range(9)] for b in range(3)])
    mc = critic.gae(r, v, m, gamma=g, lam=1.0)
    np.testing.assert_allclose(np.asarray(mc[0]), disc - v, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mc[1]), disc, atol=1e-5)  # returns: the discounted return itself
    nxt = np.concatenate([v[:, 1:], np.zeros((3, 1), np.float32)], axis=1)
    td = critic.gae(r, v, m, gamma=g, lam=0.0)[0]
    np.testing.assert_allclose(np.asarray(td), r + g * nxt - v, atol=1e-6)


def test_gae_is_linear_in_rewards_and_shift_invariant_in_values_at_gamma_one():
    """Properties: GAE is linear in the rewards for fixed values; with γ = λ = 1 a constant c
    added to every value lowers each advantage by exactly c (A_t = G_t − V_t)."""
    rng = np.random.default_rng(2)
    r1, r2, v = (rng.normal(size=(4, 7)).astype(np.float32) for _ in range(3))
    m = rng.random((4, 7)) < 0.8
    f = jax.jit(lambda r, v: critic.gae(r, v, m, gamma=0.93, lam=0.7)[0])
    zero_v = np.zeros_like(v)
    chex.assert_trees_all_close(f(2.0 * r1 + r2, zero_v), 2.0 * f(r1, zero_v) + f(r2, zero_v), atol=1e-5)
    one = jax.jit(lambda r, v: critic.gae(r, v, m, gamma=1.0, lam=1.0)[0])
    chex.assert_trees_all_close(one(r1, v + 3.0), jnp.where(m, one(r1, v) - 3.0, 0.0), atol=1e-5)


def test_token_rewards_on_the_last_policy_token():
    mask = np.array([[1, 1, 1, 0], [1, 0, 1, 0], [0, 0, 0, 0]], bool)
    got = np.asarray(critic.token_rewards(np.array([2.0, -1.0, 5.0]), mask))
    np.testing.assert_array_equal(got, [[0, 0, 2.0, 0], [0, 0, -1.0, 0], [0, 0, 0, 0]])


def test_whiten_hand_values():
    """Masked entries (1, 2, 3, 6): mean 3, unbiased var (4 + 1 + 0 + 9) / 3 = 14/3."""
    x = np.array([[1.0, 2.0, 99.0], [3.0, 6.0, -99.0]], np.float32)
    m = np.array([[1, 1, 0], [1, 1, 0]], bool)
    got = np.asarray(critic.whiten(x, m))
    sd = np.sqrt(14.0 / 3.0 + 1e-8)
    np.testing.assert_allclose(got, [[-2 / sd, -1 / sd, 0.0], [0.0, 3 / sd, 0.0]], rtol=1e-6)


def test_value_loss_hand_values():
    """c = 0.2. (V, V_old, R): (1.0, 0.5, 0.0): unclipped 1.0, clipped V 0.7 -> 0.49: loss 0.5·1.0,
    clip not binding; (0.0, 0.5, 1.0): unclipped 1.0, clipped 0.3 -> 0.49: 0.5; (0.2, 0.5, 0.0):
    unclipped 0.04, clipped 0.3 -> 0.09: the clip binds, loss 0.045."""
    v = np.array([1.0, 0.0, 0.2], np.float32)
    old = np.array([0.5, 0.5, 0.5], np.float32)
    ret = np.array([0.0, 1.0, 0.0], np.float32)
    loss, binds = critic.value_loss(v, old, ret, 0.2)
    np.testing.assert_allclose(np.asarray(loss), [0.5, 0.5, 0.045], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(binds), [0.0, 0.0, 1.0])
    plain, none = critic.value_loss(v, old, ret, None)
    np.testing.assert_allclose(np.asarray(plain), [0.5, 0.5, 0.02], atol=1e-6)
    assert float(np.asarray(none).sum()) == 0.0


def test_explained_variance():
    m = np.ones((1, 4), bool)
    ret = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    assert float(critic.explained_variance(ret, ret, m)) == pytest.approx(1.0)
    assert float(critic.explained_variance(np.full_like(ret, 2.5), ret, m)) == pytest.approx(0.0, abs=1e-6)


def test_gae_estimator_whitens_and_returns_unwhitened_targets():
    r = np.array([1.0, 0.0], np.float32)
    v = np.array([[0.1, 0.2, 0.0], [0.3, 0.0, 0.0]], np.float32)
    m = np.array([[1, 1, 0], [1, 0, 0]], bool)
    out = critic.gae_advantages(r, v, m, gae_gamma=1.0, gae_lam=1.0, gae_whiten=True)
    raw = np.array([[0.9, 0.8, 0.0], [-0.3, 0.0, 0.0]])  # G − V: G = 1, 1 and 0
    np.testing.assert_allclose(np.asarray(out["returns"]), np.where(m, raw + v, 0.0), atol=1e-6)
    flat = raw[m]
    np.testing.assert_allclose(np.asarray(out["advantages"]),
                               np.where(m, (raw - flat.mean()) / np.sqrt(flat.var(ddof=1) + 1e-8), 0.0), atol=1e-5)
    plain = critic.gae_advantages(r, v, m, gae_gamma=1.0, gae_lam=1.0, gae_whiten=False)
    np.testing.assert_allclose(np.asarray(plain["advantages"]), raw, atol=1e-6)
