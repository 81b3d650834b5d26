"""turnsight_jax.rl.losses: the clipped surrogate, KL estimators, aggregation, and the term registry."""

from __future__ import annotations

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
    assert set(metrics) == {"pg_loss", "ratio", "clip_frac", "kl", "nll"}
    with pytest.raises(ValueError, match="already registered"):
        register_loss_term("kl", ("logprobs",), ("kl",))(lambda x, c, a: (x["logprobs"], {}))
    with pytest.raises(KeyError, match="unknown loss term 'nope'"):
        get_loss_term("nope")
