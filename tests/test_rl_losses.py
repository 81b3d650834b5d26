"""turnsight_jax.rl.losses: the clipped surrogate (and its dual clip), KL estimators, the entropy term,
aggregation, and the term registry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.rl.config import AlgoConfig, LossConfig
from turnsight_jax.rl.losses import (LOSS_TERMS, aggregation_weights, clipped_surrogate, get_loss_term, kl_penalty,
                                     register_loss_term, term_losses)

LP = jnp.log(jnp.asarray([[0.5, 0.25, 0.1], [0.9, 0.2, 0.3]], jnp.float32))
OLD = jnp.log(jnp.asarray([[0.25, 0.25, 0.2], [0.9, 0.4, 0.3]], jnp.float32))
ADV = jnp.asarray([[1.0, -1.0, 2.0], [-0.5, 0.5, 0.0]], jnp.float32)


def test_clipped_surrogate_by_hand():
    cfg = LossConfig(clip_eps=0.2, clip_eps_high=0.28)
    pg, parts = clipped_surrogate(LP, OLD, ADV, cfg)
    ratio = np.array([[2.0, 1.0, 0.5], [1.0, 0.5, 1.0]])
    clipped = np.clip(ratio, 0.8, 1.28)
    want = -np.minimum(ratio * np.asarray(ADV), clipped * np.asarray(ADV))
    np.testing.assert_allclose(pg, want, rtol=1e-6)
    np.testing.assert_allclose(parts["ratio"], ratio, rtol=1e-6)
    # clipped only where the clipped term is the smaller: ratio 2 with A > 0 (and ratio 0.5 with A < 0
    # would be); ratio 0.5 with A > 0 keeps the unclipped, smaller term
    np.testing.assert_array_equal(parts["clip_frac"], [[1, 0, 0], [0, 0, 0]])
    pg_neg, parts_neg = clipped_surrogate(LP[:, 2:], OLD[:, 2:], -ADV[:, 2:], cfg)  # ratio 0.5, A = -2
    np.testing.assert_array_equal(parts_neg["clip_frac"], [[1], [0]])
    np.testing.assert_allclose(pg_neg[0, 0], 0.8 * 2.0, rtol=1e-6)


def test_dual_clip_caps_negative_advantages_only():
    # ratios 5, 2, 5, 0.5 (old log-prob 0); advantages -1, -1, +1, -2; eps 0.2 / 0.28, c = 3
    lp = jnp.log(jnp.asarray([[5.0, 2.0, 5.0, 0.5]], jnp.float32))
    old = jnp.zeros_like(lp)
    adv = jnp.asarray([[-1.0, -1.0, 1.0, -2.0]], jnp.float32)
    # PPO alone: -min(r·A, clip(r)·A) = 5 (r·A = -5 is the smaller), 2, -min(5, 1.28) = -1.28,
    # -min(-1, -0.8·2 = -1.6) = 1.6
    plain = np.array([[5.0, 2.0, -1.28, 1.6]])
    pg, parts = clipped_surrogate(lp, old, adv, LossConfig(clip_eps=0.2, clip_eps_high=0.28))
    np.testing.assert_allclose(pg, plain, rtol=1e-6)
    np.testing.assert_array_equal(parts["clip_frac_lower"], [[0, 0, 0, 0]])  # off: never binds
    # dual clip: A < 0 tokens are capped at -A·c = 3, 3, -, 6: only the first (5 > 3) changes
    cfg = LossConfig(clip_eps=0.2, clip_eps_high=0.28, clip_ratio_c=3.0)
    pg, parts = clipped_surrogate(lp, old, adv, cfg)
    np.testing.assert_allclose(pg, [[3.0, 2.0, -1.28, 1.6]], rtol=1e-6)
    np.testing.assert_array_equal(parts["clip_frac_lower"], [[1, 0, 0, 0]])
    np.testing.assert_array_equal(parts["clip_frac"], [[0, 0, 1, 1]])  # r = 5 (A > 0) and r = 0.5 (A < 0)
    # the cap is a constant: no gradient through the capped token; d(-r·A)/d lp = -A·r = 2 on the second,
    # 0 on the clipped third, d(-0.8·(-2))/d lp = 0 on the fourth (clipped below)
    grad = jax.grad(lambda l: jnp.sum(clipped_surrogate(l, old, adv, cfg)[0]))(lp)
    np.testing.assert_allclose(grad, [[0.0, 2.0, 0.0, 0.0]], atol=1e-6)


def test_entropy_term_is_a_bonus():
    term = get_loss_term("entropy")
    assert term.inputs == ("entropy",) and term.metrics == ("entropy",)
    ent = jnp.asarray([[0.5, 1.0], [2.0, 0.0]], jnp.float32)
    loss, parts = term.fn({"entropy": ent}, LossConfig(entropy_coef=0.01), AlgoConfig())
    np.testing.assert_allclose(loss, [[-0.005, -0.01], [-0.02, 0.0]], rtol=1e-6)  # -coef · H
    np.testing.assert_array_equal(parts["entropy"], ent)
    # aggregated like the surrogate: token-mean per row, mean over rows = (0.75 + 1.0) / 2 = 0.875
    w = aggregation_weights(jnp.ones((2, 2), bool), "seq_mean_token_mean")
    assert float(jnp.sum(loss * w)) == pytest.approx(-0.01 * 0.875, rel=1e-6)


def test_kl_estimators_by_hand():
    ref = OLD
    log_ratio = np.asarray(ref - LP, np.float64)
    np.testing.assert_allclose(kl_penalty(LP, ref, "k1"), -log_ratio, rtol=1e-6)
    k3 = np.exp(log_ratio) - log_ratio - 1
    np.testing.assert_allclose(kl_penalty(LP, ref, "k3"), k3, rtol=1e-5, atol=1e-7)
    assert (np.asarray(kl_penalty(LP, ref, "k3")) >= 0).all()  # k3 is non-negative
    far = jnp.asarray([[-30.0]]), jnp.asarray([[0.0]])
    assert float(kl_penalty(*far, "low_var_kl", clip=10.0)[0, 0]) == 10.0
    assert float(kl_penalty(*far, "low_var_kl", clip=3.0)[0, 0]) == 3.0


@pytest.mark.parametrize("how,want", [
    ("seq_mean_token_mean", [[1 / 4, 1 / 4, 0], [1 / 2, 0, 0]]),  # 2 then 1 tokens, 2 trajectories
    ("seq_mean_token_sum", [[1 / 2, 1 / 2, 0], [1 / 2, 0, 0]]),
    ("token_mean", [[1 / 3, 1 / 3, 0], [1 / 3, 0, 0]]),
])
def test_aggregation_weights(how, want):
    mask = jnp.asarray([[True, True, False], [True, False, False]])
    np.testing.assert_allclose(aggregation_weights(mask, how), want, rtol=1e-6)


def test_an_empty_row_gets_no_weight():
    mask = jnp.asarray([[True, False], [False, False]])
    np.testing.assert_allclose(aggregation_weights(mask, "seq_mean_token_mean"), [[1, 0], [0, 0]])


def test_term_registry_sums_terms_and_keeps_their_metrics():
    assert {"clipped_surrogate", "kl"} <= set(LOSS_TERMS)
    if "double_nll_test" not in LOSS_TERMS:
        register_loss_term("double_nll_test", ("logprobs", "pol_valid"), ("nll",))(
            lambda x, cfg, algo: (-2.0 * x["logprobs"], {"nll": -x["logprobs"]}))
    terms = (get_loss_term("clipped_surrogate"), get_loss_term("kl"), get_loss_term("double_nll_test"))
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1")
    x = {"logprobs": LP, "old_logprobs": OLD, "advantages": ADV, "ref_logprobs": OLD, "pol_valid": ADV != 9}
    total, metrics = term_losses(terms, x, cfg, AlgoConfig())
    pg, _ = clipped_surrogate(LP, OLD, ADV, cfg)
    np.testing.assert_allclose(total, pg + 0.1 * kl_penalty(LP, OLD, "k1") - 2.0 * LP, rtol=1e-6)
    assert set(metrics) == {"pg_loss", "ratio", "clip_frac", "clip_frac_lower", "kl", "nll"}
    with pytest.raises(ValueError, match="already registered"):
        register_loss_term("kl", ("logprobs",), ("kl",))(lambda x, c, a: (x["logprobs"], {}))
    with pytest.raises(KeyError, match="unknown loss term 'nope'"):
        get_loss_term("nope")
