"""The self-distillation baselines' formulas (methods.self_distillation) against hand-computed values: RLSD's
modulated advantage, SDPO's top-K KL (and its advantage form), SDAR's gated NLL, SOD's turn
weights; each with its coefficient 0 (or λ = 0) equal to the base exactly."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.methods import self_distillation as distill
from turnsight_jax.rl.config import AlgoConfig, LossConfig
from turnsight_jax.rl.losses import get_loss_term


def test_rlsd_advantage_by_hand():
    # A > 0 with a positive gap is strengthened (clipped at 1 + eps_w); A < 0 with a positive gap
    # is weakened (exp(-gap)); an uncovered token keeps w = 1; A = 0 stays 0.
    delta = np.array([[[0.1, 2.0, 0.3, -0.2, 0.5]]], np.float32)
    base = np.array([[1.0, 1.0, -2.0, -2.0, 0.0]], np.float32)
    mask = np.array([[True, True, True, True, True]])
    covered = np.array([[True, True, True, False, True]])
    out = distill.rlsd_advantages(delta, base, mask, covered, lam=0.5, eps_w=0.5)
    w = [math.exp(0.1), 1.5, math.exp(-0.3), 1.0, 1.0]  # clip(exp(2.0)) = 1.5; exp(-0.3) = 0.741 > 0.5
    want = [b * (0.5 + 0.5 * wi) for b, wi in zip(base[0], w)]
    np.testing.assert_allclose(np.asarray(out["rlsd_weights"])[0], w, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["advantages"])[0], want, rtol=1e-6)
    assert float(out["rlsd/frac_strengthened"]) == pytest.approx(2 / 3)  # of the 3 covered tokens with A != 0
    assert float(out["rlsd/frac_weakened"]) == pytest.approx(1 / 3)
    # a weight far below 1 - eps_w is clipped there
    low = distill.rlsd_advantages(np.array([[[5.0]]], np.float32), np.array([[-1.0]], np.float32),
                                  np.array([[True]]), np.array([[True]]), lam=1.0, eps_w=0.2)
    assert float(low["advantages"][0, 0]) == pytest.approx(-0.8)


def test_rlsd_lambda_zero_and_sdpo_coef_zero_are_the_base_exactly():
    rng = np.random.default_rng(0)
    delta = rng.normal(size=(1, 4, 7)).astype(np.float32)
    base = rng.normal(size=(4, 7)).astype(np.float32)
    mask = rng.random((4, 7)) > 0.2
    covered = rng.random((4, 7)) > 0.3
    want = np.where(mask, base, 0.0)
    got = distill.rlsd_advantages(delta, base, mask, covered, lam=0.0, eps_w=0.5)["advantages"]
    assert np.array_equal(np.asarray(got), want)
    got = distill.sdpo_advantages(delta, base, mask, covered, sdpo_coef=0.0)["advantages"]
    assert np.array_equal(np.asarray(got), want)


def test_sdpo_advantage_by_hand():
    out = distill.sdpo_advantages(np.array([[[0.4, -1.0, 2.0]]], np.float32), np.array([[1.0, 1.0, 1.0]], np.float32),
                                  np.array([[True, True, True]]), np.array([[True, True, False]]), sdpo_coef=0.5)
    np.testing.assert_allclose(np.asarray(out["advantages"])[0], [1.2, 0.5, 1.0], rtol=1e-6)
    assert float(out["sdpo/frac_strengthened"]) == 0.5 and float(out["sdpo/frac_weakened"]) == 0.5


def _coarse_kl(p_logits, q_logits, ids):
    """KL(p || q) between two full-vocabulary distributions coarsened to `ids` + one rest bin (f64)."""
    p = np.exp(p_logits - np.logaddexp.reduce(p_logits))
    q = np.exp(q_logits - np.logaddexp.reduce(q_logits))
    ps = np.append(p[ids], 1 - p[ids].sum())
    qs = np.append(q[ids], 1 - q[ids].sum())
    return float(np.sum(ps * (np.log(ps) - np.log(qs)))), p, q


def test_topk_kl_is_the_kl_of_the_coarsened_distributions():
    rng = np.random.default_rng(1)
    v, k = 50, 5
    p_logits, q_logits = rng.normal(size=v) * 2, rng.normal(size=v) * 2
    ids = np.argsort(-q_logits)[:k]  # the teacher's top K
    want, p, q = _coarse_kl(p_logits, q_logits, ids)
    s = jnp.asarray(np.log(p[ids]), jnp.float32)
    t = jnp.asarray(np.log(q[ids]), jnp.float32)
    got = float(distill.topk_kl(s, t, tail=True))
    assert got == pytest.approx(want, rel=1e-5)
    full = float(np.sum(p * (np.log(p) - np.log(q))))
    assert 0.0 <= got <= full + 1e-6  # coarsening never raises a KL
    # renormalised over the K
    pk, qk = p[ids] / p[ids].sum(), q[ids] / q[ids].sum()
    assert float(distill.topk_kl(s, t, tail=False)) == pytest.approx(float(np.sum(pk * np.log(pk / qk))), rel=1e-5)
    # equal distributions: 0 both ways
    assert abs(float(distill.topk_kl(t, t))) < 1e-7 and abs(float(distill.topk_kl(t, t, tail=False))) < 1e-7


def test_topk_kl_gradient_through_the_student_logits():
    """d KL / d logits of the student (through log_softmax) equals the gradient of the coarsened
    KL written directly on the probabilities; the teacher gets none."""
    rng = np.random.default_rng(2)
    v, k = 30, 4
    logits = jnp.asarray(rng.normal(size=v), jnp.float32)
    q = jax.nn.log_softmax(jnp.asarray(rng.normal(size=v), jnp.float32))
    ids = jnp.argsort(-q)[:k]

    def ours(x):
        return distill.topk_kl(jax.nn.log_softmax(x)[ids], q[ids])

    def direct(x):
        p = jax.nn.softmax(x)
        ps = jnp.append(p[ids], 1 - p[ids].sum())
        qs = jnp.append(jnp.exp(q[ids]), 1 - jnp.exp(q[ids]).sum())
        return jnp.sum(ps * (jnp.log(ps) - jnp.log(qs)))

    np.testing.assert_allclose(np.asarray(jax.grad(ours)(logits)), np.asarray(jax.grad(direct)(logits)), atol=1e-6)
    assert float(jnp.abs(jax.grad(lambda t: distill.topk_kl(jax.nn.log_softmax(logits)[ids], t))(q[ids])).max()) == 0.0


def test_turn_mean_and_sod_weights_by_hand():
    values = np.array([[1.0, 3.0, 5.0, 0.0], [2.0, 2.0, 9.0, 9.0]], np.float32)
    turns = np.array([[0, 0, 1, -1], [0, 1, 1, 1]], np.int32)
    mask = np.array([[True, True, True, False], [True, True, True, False]])
    np.testing.assert_allclose(np.asarray(distill.turn_mean(values, turns, mask)),
                               [[2.0, 2.0, 5.0, 0.0], [2.0, 5.5, 5.5, 0.0]])
    w = np.asarray(distill.sod_turn_weights(values, turns, mask, tau=2.0))
    np.testing.assert_allclose(w, [[math.exp(-1), math.exp(-1), math.exp(-2.5), 0], [math.exp(-1), math.exp(-2.75),
                                                                                      math.exp(-2.75), 0]], rtol=1e-6)


def _term(name, x, section, **values):
    """Loss term `name` on `x` with its method's config section `section` set to `values`."""
    return get_loss_term(name).fn(x, LossConfig(), AlgoConfig().with_section(section, **values))


def test_sdar_term_by_hand_and_its_gradient_is_the_gated_nll():
    lp = jnp.asarray([[-1.0, -2.0, -0.5]], jnp.float32)
    teacher = jnp.asarray([[-0.5, -3.0, -0.1]], jnp.float32)
    x = {"logprobs": lp, "teacher_logprobs": teacher, "teacher_covered": jnp.asarray([[True, True, False]]),
         "pol_valid": jnp.asarray([[True, True, True]])}
    loss, m = _term("sdar", x, "sdar", coef=0.3, beta=2.0)
    g = [1 / (1 + math.exp(-2.0 * 0.5)), 1 / (1 + math.exp(-2.0 * -1.0)), 0.0]
    np.testing.assert_allclose(np.asarray(m["sdar_gate"])[0], g, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(loss)[0], [0.3 * g[0] * 1.0, 0.3 * g[1] * 2.0, 0.0], rtol=1e-6)
    # the gate is detached: d loss / d log p = -coef * gate
    grad = jax.grad(lambda a: jnp.sum(_term("sdar", {**x, "logprobs": a}, "sdar", coef=0.3, beta=2.0)[0]))(lp)
    np.testing.assert_allclose(np.asarray(grad)[0], [-0.3 * g[0], -0.3 * g[1], 0.0], rtol=1e-6)
    zero, _ = _term("sdar", x, "sdar", coef=0.0)
    assert not np.any(np.asarray(zero))


def test_sdpo_and_sod_terms_by_hand():
    s = jnp.log(jnp.asarray([[[0.5, 0.2], [0.3, 0.3]]], jnp.float32))  # [1, 2 tokens, K = 2]
    t = jnp.log(jnp.asarray([[[0.4, 0.4], [0.3, 0.3]]], jnp.float32))
    kl0 = 0.5 * math.log(0.5 / 0.4) + 0.2 * math.log(0.2 / 0.4) + 0.3 * math.log(0.3 / 0.2)
    x = {"topk_logprobs": s, "teacher_topk_logprobs": t, "teacher_covered": jnp.asarray([[True, True]]),
         "pol_valid": jnp.asarray([[True, True]]), "turn_ids": jnp.asarray([[0, 1]], jnp.int32)}
    loss, m = _term("sdpo_kl", x, "sdpo", coef=0.5)
    np.testing.assert_allclose(np.asarray(m["sdpo_kl"])[0], [kl0, 0.0], atol=1e-6)
    np.testing.assert_allclose(np.asarray(loss)[0], [0.5 * kl0, 0.0], atol=1e-6)
    loss, m = _term("sod", x, "sod", coef=2.0, tau=0.5)
    w0 = math.exp(-kl0 / 0.5)  # each token alone in its turn
    np.testing.assert_allclose(np.asarray(m["sod_weight"])[0], [w0, 1.0], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(loss)[0], [2.0 * w0 * kl0, 0.0], atol=1e-6)
    for name, section in (("sdpo_kl", "sdpo"), ("sod", "sod")):
        zero, _ = _term(name, x, section, coef=0.0)
        assert not np.any(np.asarray(zero))
