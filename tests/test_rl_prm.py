"""PiCA's step-PRM (methods.prm): where the states are read, the progress rewards, the hinge (it
penalises exactly the increases of h), the loss's labels, and GAE over outcome + process rewards.
(In the fused step: tests/test_rl_critic_step.py.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.methods import critic, prm


def test_state_positions_hand_values():
    """Turns 0, 1, 2 start at slots 0, 2, 4 (their predictor positions 4, 9, 14); the
    trajectory's last readable token is 16; state 3 is the end, state 4 absent."""
    turn_ids = np.array([[0, 0, 1, 1, 2, -1]], np.int32)
    pol_valid = np.array([[1, 1, 1, 1, 1, 0]], bool)
    pred = np.array([[4, 5, 9, 10, 14, 0]], np.int32)
    valid = np.zeros((1, 20), bool)
    valid[0, :17] = True
    pos, exists = prm.state_positions(turn_ids, pol_valid, pred, valid, np.array([3]), max_turns=4)
    np.testing.assert_array_equal(np.asarray(pos), [[4, 9, 14, 16, 0]])
    np.testing.assert_array_equal(np.asarray(exists), [[True, True, True, True, False]])


def test_progress_rewards_hand_values():
    """h = (0.9, 0.6, 0.5, 0.1) over states s_0..s_3 of a 3-turn trajectory; alpha 2, decay 0.5,
    baseline 0.05: boundary 1 gains 2·(0.9 − 0.6 − 0.05) = 0.5 on turn 0's last slot, boundary 2
    gains 2·0.5·(0.6 − 0.5 − 0.05) = 0.05 on turn 1's; s_3 (after the answer) is no boundary."""
    h = np.array([[0.9, 0.6, 0.5, 0.1, 0.0]], np.float32)
    exists = np.array([[1, 1, 1, 1, 0]], bool)
    turn_ids = np.array([[0, 0, 1, 1, 2, -1]], np.int32)
    pol_valid = np.array([[1, 1, 1, 1, 1, 0]], bool)
    tokens, gains = prm.progress_rewards(h, exists, turn_ids, pol_valid, np.array([3]), alpha=2.0, decay=0.5,
                                         baseline=0.05)
    np.testing.assert_allclose(np.asarray(gains), [[0.0, 0.5, 0.05, 0.0, 0.0]], atol=1e-6)
    np.testing.assert_allclose(np.asarray(tokens), [[0.0, 0.5, 0.0, 0.05, 0.0, 0.0]], atol=1e-6)
    # a rise of h is a negative gain (a call that made the task look further from solved)
    tokens, _ = prm.progress_rewards(np.array([[0.2, 0.7, 0.0, 0.0, 0.0]], np.float32), exists, turn_ids,
                                     pol_valid, np.array([3]), alpha=1.0, decay=1.0, baseline=0.0)
    np.testing.assert_allclose(np.asarray(tokens)[0, 1], -0.5, atol=1e-6)


def test_hinge_penalises_exactly_the_increases():
    h = np.array([[0.9, 0.95, 0.5, 0.6, 0.6, 0.3]], np.float32)
    exists = np.array([[1, 1, 1, 1, 1, 0]], bool)
    got = np.asarray(prm.monotonicity_hinge(h, exists))
    np.testing.assert_allclose(got, [[0.05, 0.0, 0.1, 0.0, 0.0]], atol=1e-6)  # the last pair: s_5 absent
    # property: a non-increasing sequence costs nothing; the cost is the sum of the rises
    rng = np.random.default_rng(0)
    down = np.sort(rng.random((4, 7)), axis=1)[:, ::-1].astype(np.float32)
    assert float(np.asarray(prm.monotonicity_hinge(down, np.ones((4, 7), bool))).sum()) == 0.0
    x = rng.random((4, 7)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(prm.monotonicity_hinge(x, np.ones((4, 7), bool))).sum(axis=1),
                               np.clip(np.diff(x, axis=1), 0, None).sum(axis=1), rtol=1e-6)


def test_prm_loss_labels_and_hinge_hand_values():
    """Row 0 solved (2 turns: states s_0, s_1, s_2): only s_2 is labelled (0), its pairs are
    hinged; row 1 failed (1 turn: s_0, s_1): both labelled 1, no hinge. A 1-d head with w = 1,
    b = 0: the logits are the hidden values."""
    z = np.array([[[0.5], [1.0], [-2.0]], [[0.3], [0.7], [0.0]]], np.float32)
    exists = np.array([[1, 1, 1], [1, 1, 0]], bool)
    head = {"prm_w": jnp.ones(1), "prm_b": jnp.zeros(())}
    loss, parts = prm.prm_loss(head, z, exists, np.array([2, 1]), np.array([True, False]), hinge_coef=2.0)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    bce = [-np.log(1 - sig(-2.0)), -np.log(sig(0.3)), -np.log(sig(0.7))]
    hinge = [max(0.0, sig(1.0) - sig(0.5)), max(0.0, sig(-2.0) - sig(1.0))]
    assert float(parts["bce"]) == pytest.approx(np.mean(bce), rel=1e-5)
    assert float(parts["hinge"]) == pytest.approx(np.mean(hinge), rel=1e-5)
    assert float(loss) == pytest.approx(np.mean(bce) + 2.0 * np.mean(hinge), rel=1e-5)


def test_gae_process_is_gae_over_summed_rewards():
    rng = np.random.default_rng(3)
    v = rng.normal(size=(3, 6)).astype(np.float32)
    m = np.array([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4], bool)
    proc = np.where(m, rng.normal(size=(3, 6)), 0.0).astype(np.float32)
    r = np.array([1.0, 0.0, 0.5], np.float32)
    got = critic.gae_process_advantages(r, v, m, proc, gae_gamma=0.9, gae_lam=0.8, gae_whiten=False)
    want = critic.gae(np.asarray(critic.token_rewards(r, m)) + proc, v, m, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(np.asarray(got["advantages"]), np.asarray(want[0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got["returns"]), np.asarray(want[1]), atol=1e-6)
    zero = critic.gae_process_advantages(r, v, m, np.zeros_like(proc), gae_gamma=0.9, gae_lam=0.8, gae_whiten=True)
    ppo = critic.gae_advantages(r, v, m, gae_gamma=0.9, gae_lam=0.8, gae_whiten=True)
    np.testing.assert_array_equal(np.asarray(zero["advantages"]), np.asarray(ppo["advantages"]))
