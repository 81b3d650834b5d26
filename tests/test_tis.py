"""Sampler/trainer mismatch correction (loss.tis_threshold): truncated importance sampling in the
fused step, against hand-written references.

The batch is test_rl_step's (8 replayed trajectories, a random policy, a different reference).
Its sampler log-probs are set here: the trainer's own (an explicit teacher-forced log_softmax,
`plain_logprobs`) minus a known per-token offset, so trainer − sampler is known on every token.
With the option off the step is the code before the option, bit for bit: tests/test_rl_step_pinned.py
holds the step to numbers recorded long before it, and test_rl_step's fused-vs-unfused check to a
reference whose ratio reads the sampler's log-probs; here the off path is also checked against a
reference on this batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import turnsight_jax.config as C
from turnsight_jax.errors import ConfigError
from turnsight_jax.rl import advantages as adv_lib
from turnsight_jax.rl.config import AlgoConfig, LossConfig, StepConfig
from turnsight_jax.rl.logprobs import student_logprobs
from turnsight_jax.rl.losses import aggregation_weights, get_loss_term
from turnsight_jax.rl.methods import resolve_method
from turnsight_jax.rl.step import make_train_step

from test_rl_step import G, _batch, _max_diff, plain_logprobs, setup  # noqa: F401  (setup: the fixture)

DIFFS = (0.5, -1.5, 0.2)  # trainer − sampler, cycling over each row's policy tokens
C_CLIP = 1.5  # e^0.5 = 1.65 clips, e^-1.5 = 0.22 and e^0.2 = 1.22 do not
KL = 0.05


def _cfg(tis=None, method="grpo", mini=1, **algo):
    return StepConfig(algo=AlgoConfig(method=method, **algo),
                      loss=LossConfig(clip_eps=0.2, clip_eps_high=0.28, kl_coef=KL, kl_estimator="k3",
                                      tis_threshold=tis),
                      group_size=G, max_turns=5, logprob_chunk=64, mini_batches=mini)


def _pol(trajs):
    return [np.flatnonzero(t.policy_mask) for t in trajs]


def _compact(rows, n):
    out = np.zeros((len(rows), n), np.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = np.asarray(r)
    return out


@pytest.fixture(scope="module")
def lps(setup):
    """(trainer log-probs [B, N] at the step-start parameters, the offsets trainer − sampler [B, N],
    reference log-probs [B, N], valid [B, N]), compact layout, from explicit teacher-forced forwards."""
    trajs, _, policy, ref = setup
    pol = _pol(trajs)
    n = max(len(p) for p in pol)
    args = ([t.tokens for t in trajs], [p - 1 for p in pol], [t.tokens[p] for t, p in zip(trajs, pol)])
    trainer = _compact(plain_logprobs(*nnx.split(policy), *args), n)
    ref_lp = _compact(plain_logprobs(*nnx.split(ref), *args), n)
    diff = _compact([np.resize(np.asarray(DIFFS, np.float32), len(p)) for p in pol], n)
    valid = _compact([np.ones(len(p)) for p in pol], n) > 0
    return trainer, diff, ref_lp, valid


def _run(cfg, setup, tok, sampler, lr=1.0):
    """One fused step with SGD(lr) on the setup's batch with these sampler log-probs: (before −
    after, metrics); with lr = 1 the first is the gradient."""
    trajs, row_tasks, policy, ref = setup
    batch = _batch(trajs, row_tasks, tok, cfg)
    sampler = np.pad(sampler, ((0, 0), (0, batch.old_logprobs.shape[1] - sampler.shape[1])))
    batch = jax.tree.map(jnp.asarray, batch.replace(old_logprobs=np.where(batch.pol_valid, sampler, 0.0)))
    graphdef, params = nnx.split(policy)
    _, ref_params = nnx.split(ref)
    opt = optax.sgd(lr)
    before = jax.tree.map(np.asarray, params)
    new, _, m = make_train_step(graphdef, cfg, opt)(jax.tree.map(jnp.copy, params), opt.init(params), ref_params, batch)
    return jax.tree.map(lambda a, b: a - np.asarray(b), before, new), jax.device_get(m)


def _reference_grads(setup, lps, sampler, tis):
    """∇ Σ_tokens agg_weight · (w · surrogate + kl_coef · k3) in plain code. Off (tis None): the
    ratio against the sampler's log-probs, w = 1. On: the ratio against the trainer's own log-probs
    (stop_gradient of the forward: one update, step-start parameters), w = min(exp(trainer −
    sampler), C) on the surrogate only."""
    trajs, _, policy, _ = setup
    trainer, _, ref_lp, mask = lps
    pol = _pol(trajs)
    group_ids = np.repeat(np.arange(len(trajs) // G), G).astype(np.int32)
    rewards = np.array([t.reward for t in trajs], np.float32)
    adv = adv_lib.grpo_advantages(rewards, group_ids, mask, num_groups=len(trajs) // G)
    weights = aggregation_weights(jnp.asarray(mask), "seq_mean_token_mean")
    w = 1.0 if tis is None else np.minimum(np.exp(trainer - sampler), tis)
    graphdef, params = nnx.split(policy)

    def loss(params):
        lp = plain_logprobs(graphdef, params, [t.tokens for t in trajs], [p - 1 for p in pol],
                            [t.tokens[p] for t, p in zip(trajs, pol)])
        lp = jnp.stack([jnp.zeros(trainer.shape[1]).at[: len(r)].set(r) for r in lp])
        old = sampler if tis is None else jax.lax.stop_gradient(lp)
        ratio = jnp.exp(lp - old)
        pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 0.8, 1.28) * adv)
        log_r = ref_lp - lp
        k3 = jnp.exp(log_r) - log_r - 1.0
        return jnp.sum(weights * (w * pg + KL * k3))

    return jax.jit(jax.grad(loss))(params)


def _close(got, want):
    scale = max(float(np.abs(np.asarray(x)).max()) for x in jax.tree.leaves(want))
    assert scale > 1e-4  # a real gradient
    return _max_diff(got, want) < 1e-5 * max(1.0, scale) + 1e-6


def _token_stats(diff, valid, c):
    d = diff[valid]
    return {"tis/logprob_diff_mean": d.mean(), "tis/logprob_diff_abs_mean": np.abs(d).mean(),
            "tis/logprob_diff_max_abs": np.abs(d).max(), "tis/weight_mean": np.minimum(np.exp(d), c).mean(),
            "tis/clip_frac": (np.exp(d) > c).mean()}


def test_off_is_the_plain_step_and_reports_the_free_mismatch(setup, tok, lps):
    """tis_threshold None: the ratio reads the sampler's log-probs (the reference), and with one
    update the mismatch metrics come from the update's own forward; no weight metrics. With
    several updates nothing is reported (it would cost a forward)."""
    trainer, diff, _, valid = lps
    sampler = trainer - diff
    grads, m = _run(_cfg(), setup, tok, sampler)
    assert _close(grads, _reference_grads(setup, lps, sampler, None))
    assert float(m["clip_frac"]) > 0  # ratios e^{-0.5}, e^{1.5} clip where the sign of A says so
    want = _token_stats(diff, valid, C_CLIP)
    for k in ("tis/logprob_diff_mean", "tis/logprob_diff_abs_mean", "tis/logprob_diff_max_abs"):
        assert float(m[k]) == pytest.approx(want[k], abs=1e-5), k
    assert "tis/weight_mean" not in m and "tis/clip_frac" not in m
    _, m2 = _run(_cfg(mini=2), setup, tok, sampler, lr=0.0)
    assert not any(k.startswith("tis/") for k in m2)


def test_on_with_the_trainers_own_logprobs_equals_off(setup, tok, lps):
    """Sampler log-probs equal to the trainer's: every weight 1, ratio 1, the same update as off."""
    trainer, _, _, _ = lps
    g_off, m_off = _run(_cfg(), setup, tok, trainer)
    g_on, m_on = _run(_cfg(tis=2.0), setup, tok, trainer)
    assert _max_diff(g_on, g_off) < 1e-6
    assert abs(float(m_on["pg_loss"]) - float(m_off["pg_loss"])) < 1e-6
    assert float(m_on["ratio"]) == pytest.approx(1.0, abs=1e-6)
    assert abs(float(m_on["tis/weight_mean"]) - 1.0) < 1e-5 and float(m_on["tis/clip_frac"]) == 0.0
    assert float(m_on["tis/logprob_diff_max_abs"]) < 1e-5 and abs(float(m_on["tis/logprob_diff_mean"])) < 1e-6


def test_on_with_known_offsets_metrics_and_gradient(setup, tok, lps):
    """Sampler = trainer − {0.5, −1.5, 0.2}: the metrics are those offsets' statistics, and the
    gradient is the reference's: ratio against the trainer's log-probs, surrogate weighted by the
    truncated weight, KL not weighted."""
    trainer, diff, _, valid = lps
    sampler = trainer - diff
    grads, m = _run(_cfg(tis=C_CLIP), setup, tok, sampler)
    want = _token_stats(diff, valid, C_CLIP)
    assert 0.0 < want["tis/clip_frac"] < 1.0 and want["tis/logprob_diff_max_abs"] == 1.5
    for k, v in want.items():
        assert float(m[k]) == pytest.approx(v, abs=1e-5), k
    # one update: π_old is the forward's own log-probs
    assert float(m["ratio"]) == pytest.approx(1.0, abs=1e-6) and float(m["clip_frac"]) == 0.0
    ref = _reference_grads(setup, lps, sampler, C_CLIP)
    assert _close(grads, ref)
    assert not _close(grads, _reference_grads(setup, lps, sampler, None))  # the option changed the update


def test_several_updates_score_pi_old_before_the_first_update(setup, tok, lps):
    """mini_batches = 2: π_old is a no-gradient forward at the step-start parameters, so with lr = 0
    every update's ratio is 1 (not exp(trainer − sampler)), and the metrics are the offsets'."""
    trainer, diff, _, valid = lps
    sampler = trainer - diff
    _, m = _run(_cfg(tis=C_CLIP, mini=2), setup, tok, sampler, lr=0.0)
    for k, v in _token_stats(diff, valid, C_CLIP).items():
        assert float(m[k]) == pytest.approx(v, abs=1e-5), k
    assert abs(float(m["ratio"]) - 1.0) < 1e-5 and float(m["clip_frac"]) == 0.0
    _, m_off = _run(_cfg(mini=2), setup, tok, sampler, lr=0.0)
    agg = np.asarray(aggregation_weights(jnp.asarray(valid), "seq_mean_token_mean"))
    ratio_off = float(np.sum(agg * np.exp(diff)))  # off: the ratio reads the sampler's log-probs
    assert float(m_off["ratio"]) == pytest.approx(ratio_off, abs=1e-4) and abs(ratio_off - 1.0) > 0.01


def test_with_observation_masking_and_turnsight(setup, tok, lps):
    """rl.student_sees_observations=False: π_old is the trainer's on the masked context, one update
    or several alike, and the weight compares it with the sampler's. TurnSight's δ keeps reading
    the sampler's log-probs: its diagnostics and advantages do not move with the option."""
    trainer, diff, _, valid = lps
    sampler = trainer - diff
    kw = dict(method="turnsight", student_sees_observations=False)
    _, one = _run(_cfg(tis=C_CLIP, **kw), setup, tok, sampler, lr=0.0)
    _, two = _run(_cfg(tis=C_CLIP, mini=2, **kw), setup, tok, sampler, lr=0.0)
    _, off = _run(_cfg(**kw), setup, tok, sampler, lr=0.0)
    for k in ("tis/logprob_diff_mean", "tis/logprob_diff_abs_mean", "tis/logprob_diff_max_abs",
              "tis/weight_mean", "tis/clip_frac"):
        assert float(one[k]) == pytest.approx(float(two[k]), abs=1e-5), k
    # ... and they are the statistics of (the trainer on the masked context − the sampler)
    trajs, row_tasks, policy, _ = setup
    b = _batch(trajs, row_tasks, tok, _cfg(**kw))
    masked = np.asarray(student_logprobs(policy, jnp.asarray(b.tokens), jnp.asarray(b.valid), jnp.asarray(b.pol_pos),
                                         chunk=64))[:, : trainer.shape[1]]
    for k, v in _token_stats(masked - sampler, valid, C_CLIP).items():
        assert float(one[k]) == pytest.approx(v, abs=1e-5), k
    assert abs(float(two["ratio"]) - 1.0) < 1e-5
    for k in ("delta_mean", "adv_mean", "adv_abs_mean", "weight_min", "weight_max", "agreement_rate"):
        np.testing.assert_allclose(np.asarray(one[k]), np.asarray(off[k]), rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("value", ["0", "-1.0", "'two'"])
def test_a_non_positive_threshold_is_a_one_line_error(value):
    with pytest.raises(ConfigError, match=r"loss\.tis_threshold must be None \(off\) or a number > 0") as e:
        C.validate(C.load_run_config(None, [f"--config.loss.tis_threshold={value}"]), 1)
    assert "\n" not in str(e.value)


def test_the_threshold_reaches_the_step_config_and_a_method_must_read_the_weights(setup):
    c = C.load_run_config(None, ["--config.loss.tis_threshold=2"])
    step_cfg, _ = C.validate(c, 1)
    assert step_cfg.loss.tis_threshold == 2.0
    assert C.step_config(C.apply_overrides(c, ["loss.tis_threshold=None"])).loss.tis_threshold is None
    # a method whose policy-gradient term ignores the weights is refused, not silently uncorrected
    cfg = _cfg(tis=2.0)
    method = dataclasses.replace(resolve_method(cfg), loss_terms=(get_loss_term("kl"),))
    graphdef, _ = nnx.split(setup[2])
    with pytest.raises(ConfigError, match="loss.tis_threshold=2.0 but no loss term"):
        make_train_step(graphdef, cfg, optax.sgd(1.0), method)
