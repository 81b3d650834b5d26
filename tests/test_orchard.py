"""Orchard's CA-SFT (methods.orchard): credits, rise segments and the token mask equal hand-computed
values; the packed probe row gives each state exactly the value of its plain sequence (prefix +
question); in the fused step the gradient is the base method's plus the CA-SFT loss written out
per token."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from turnsight_jax.errors import ConfigError
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import init_model
from turnsight_jax.methods import orchard
from turnsight_jax.rl.batch import make_train_batch
from turnsight_jax.rl.config import AlgoConfig, LossConfig, StepConfig
from turnsight_jax.rl.losses import aggregation_weights, get_loss_term
from turnsight_jax.rl.methods import resolve_method
from turnsight_jax.rl.step import make_train_step
from turnsight_jax.rl.views import DEFAULT_PACKED_BUCKETS

from _replayed import gold_and_wrong
from _vocab import SMALL_VOCAB, fold_batch, fold_probes
from _train_runs import run_main

REPO = pathlib.Path(__file__).resolve().parents[1]

CFG = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
G = 2


def test_credits_and_rise_segments_hand_values():
    """Row 0, 4 turns, V = (0.2, 0.3, 0.32, 0.6, 0.5): credits (0.1, 0.02, 0.28, -0.1); at 0.05
    turns 0 and 2 rise, two segments. Row 1, 2 turns, V = (0.1, 0.2, 0.3): both rise, one segment
    (consecutive turns are one run); its absent states give no credit."""
    v = np.array([[0.2, 0.3, 0.32, 0.6, 0.5], [0.1, 0.2, 0.3, 0.0, 0.0]], np.float32)
    exists = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    c, has = orchard.turn_credits(v, exists)
    np.testing.assert_allclose(np.asarray(c), [[0.1, 0.02, 0.28, -0.1], [0.1, 0.1, 0.0, 0.0]], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(has), [[1, 1, 1, 1], [1, 1, 0, 0]])
    rise, segments = orchard.rise_turns(c, has, 0.05)
    np.testing.assert_array_equal(np.asarray(rise), [[1, 0, 1, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(np.asarray(segments), [2, 1])
    # a credit exactly at the threshold rises (c >= 0.05)
    rise, _ = orchard.rise_turns(jnp.array([[0.05, 0.0499]]), jnp.array([[True, True]]), 0.05)
    np.testing.assert_array_equal(np.asarray(rise), [[True, False]])


def test_rise_mask_covers_rise_turns_of_failed_rows_only():
    """The same two rows, row 0 failed (reward 0.4 < 1) and row 1 solved: only row 0's tokens of
    turns 0 and 2 are trained; the metrics are the shares of those."""
    v = np.array([[0.2, 0.3, 0.32, 0.6, 0.5], [0.1, 0.2, 0.3, 0.0, 0.0]], np.float32)
    exists = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    turn_ids = np.array([[0, 0, 1, 2, 2, 3, -1], [0, 1, 1, -1, -1, -1, -1]], np.int32)
    pol_valid = turn_ids >= 0
    mask, m = orchard.rise_mask(v, exists, turn_ids, pol_valid, np.array([0.4, 1.0], np.float32),
                                AlgoConfig().with_section("orchard", rise=0.05, success=1.0))
    np.testing.assert_array_equal(np.asarray(mask), [[1, 1, 0, 1, 1, 0, 0], [0] * 7])
    assert float(m["orchard/rise_token_share"]) == pytest.approx(4 / 9)
    assert float(m["orchard/rise_segments"]) == 2.0  # per failed trajectory
    assert float(m["orchard/rise_turn_frac"]) == pytest.approx(2 / 4)
    assert float(m["orchard/failed_frac"]) == 0.5 and float(m["orchard/v_start"]) == pytest.approx(0.15)
    # every trajectory solved: nothing to imitate
    mask, m = orchard.rise_mask(v, exists, turn_ids, pol_valid, np.array([1.0, 1.0], np.float32), AlgoConfig())
    assert not np.asarray(mask).any() and float(m["orchard/rise_token_share"]) == 0.0


def test_ca_sft_term_is_the_masked_nll():
    lp = jnp.array([[-1.0, -2.0, -0.5], [-3.0, -1.5, -0.1]])
    x = {"logprobs": lp, "rise_mask": jnp.array([[True, False, True], [True, True, False]]),
         "pol_valid": jnp.array([[True, True, True], [True, False, False]])}
    loss, parts = get_loss_term("ca_sft").fn(x, LossConfig(), AlgoConfig().with_section("orchard", coef=0.5))
    np.testing.assert_allclose(np.asarray(loss), [[0.5, 0.0, 0.25], [1.5, 0.0, 0.0]])
    np.testing.assert_allclose(np.asarray(parts["ca_sft_nll"]), [[1.0, 0.0, 0.5], [3.0, 0.0, 0.0]])


@pytest.fixture(scope="module")
def setup(tok):
    trajs, tasks = gold_and_wrong(tok)
    return trajs, [tasks[i // G] for i in range(len(trajs))], init_model(CFG, seed=0), init_model(CFG, seed=1)


def _plain_values(teacher, probes) -> np.ndarray:
    """V of every state from its own plain sequence: the trajectory prefix the probe reads, then
    the probe's tokens, as one causal row; sigmoid(logit_yes - logit_no) at its last token from the
    full vocabulary projection."""
    tokens, seg = np.asarray(probes.tokens), np.asarray(probes.layout.segment_ids)
    c1e, at = np.asarray(probes.layout.ctx1_end), np.asarray(probes.at)
    yes, no = np.asarray(probes.answer_ids)[0]
    seqs = []
    for b in range(tokens.shape[0]):
        for k in np.flatnonzero(np.asarray(probes.exists)[b]):
            mine = np.flatnonzero(seg[b] == seg[b, at[b, k]])
            assert mine[-1] == at[b, k]
            seqs.append(np.concatenate([tokens[b, : c1e[b, at[b, k]]], tokens[b, mine]]))
    width = max(len(s) for s in seqs)
    x = np.zeros((len(seqs), width), np.int32)
    m = np.zeros((len(seqs), width), bool)
    for r, s in enumerate(seqs):
        x[r, : len(s)], m[r, : len(s)] = s, True
    logits = np.asarray(teacher(jnp.asarray(x), Layout.causal(jnp.asarray(m))))
    last = logits[np.arange(len(seqs)), m.sum(axis=1) - 1]
    v = 1.0 / (1.0 + np.exp(-(last[:, yes] - last[:, no])))
    out = np.zeros(at.shape, np.float32)
    out[np.asarray(probes.exists)] = v
    return out


def test_packed_probe_rows_equal_plain_sequences(setup, tok):
    """Every state's value from the one packed row per trajectory equals that of its plain
    sequence; the probes tell the teacher the reward and the gold answer; one probe per state."""
    trajs, row_tasks, _, teacher = setup
    probes, stats = orchard.build_probes(trajs, row_tasks, tok, max_turns=5, success_threshold=1.0,
                                         buckets=DEFAULT_PACKED_BUCKETS)
    np.testing.assert_array_equal(np.asarray(probes.exists).sum(axis=1), [t.num_turns + 1 for t in trajs])
    text = tok.decode(np.asarray(probes.tokens)[1][np.asarray(probes.layout.segment_ids)[1] == 1])
    assert "ended with reward 0.00 (not solved)" in text and f"answer is: {row_tasks[1].answer}" in text
    assert text.rstrip().endswith("</think>")
    yes, no = np.asarray(probes.answer_ids)[0]
    assert tok.decode([int(yes)]) == "Yes" and tok.decode([int(no)]) == "No"
    folded = fold_probes(probes)
    assert len(set(np.asarray(folded.answer_ids)[0])) == 2
    got = np.asarray(orchard.retrospective_values(teacher, jax.tree.map(jnp.asarray, folded)))
    np.testing.assert_allclose(got, _plain_values(teacher, folded), atol=2e-5)
    assert stats["probe_tokens"] > 0 and stats["Q"] >= probes.tokens.shape[1]


def test_probe_template_answers_must_be_single_tokens(setup, tok):
    trajs, row_tasks, _, _ = setup
    with pytest.raises(ValueError, match="must be one token"):
        orchard.build_probes(trajs, row_tasks, tok, max_turns=5, success_threshold=1.0, buckets=DEFAULT_PACKED_BUCKETS,
                             template=orchard.RetrospectiveTemplate(yes="Absolutely-yes"))


def _cfg(method, **orchard):
    """`orchard`: orchard.* settings."""
    return StepConfig(algo=AlgoConfig(method=method, base="grpo").with_section("orchard", **orchard),
                      loss=LossConfig(clip_eps=0.2), group_size=G, max_turns=5, logprob_chunk=64)


def _step(cfg, policy, ref, batch):
    graphdef, params = nnx.split(policy)
    before = jax.tree.map(np.asarray, params)
    params = jax.tree.map(jnp.array, params)  # a copy: the step donates it
    opt = optax.sgd(1.0)
    new, _, metrics = make_train_step(graphdef, cfg, opt)(params, opt.init(params), nnx.split(ref)[1],
                                                          jax.tree.map(jnp.asarray, batch))
    return jax.tree.map(lambda a, b: a - np.asarray(b), before, new), metrics


def _max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)))


def test_fused_step_equals_base_plus_the_written_out_ca_sft(setup, tok):
    """The step's gradient = GRPO's + coef · ∇ Σ_t w_t · (−log π(a_t)) · mask_t, the mask from
    the plain-sequence values (rise threshold 0: about half of the random teacher's credits pass),
    w the loss aggregation's token weights (linear in coef: with coefficient 0 it is GRPO's step)."""
    trajs, row_tasks, policy, ref = setup
    cfg = _cfg("orchard", coef=0.7, rise=0.0)
    batch, _ = make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg))
    batch = fold_batch(batch)
    g_orchard, m = _step(cfg, policy, ref, batch)
    grpo = _cfg("grpo")
    g_grpo, _ = _step(grpo, policy, ref, fold_batch(make_train_batch(trajs, row_tasks, tok, grpo,
                                                                     resolve_method(grpo))[0]))

    probes = batch.aux_rows["retrospective"]
    values = _plain_values(ref, probes)  # the default teacher: the frozen reference
    mask, metrics = orchard.rise_mask(values, probes.exists, batch.turn_ids, batch.pol_valid,
                                      batch.signals["rewards"], cfg.algo)
    mask = np.asarray(mask)
    assert 0 < mask.sum() < np.asarray(batch.pol_valid).sum()
    for k, v in metrics.items():
        assert float(m[k]) == pytest.approx(float(v), abs=1e-5), k
    weights = np.asarray(aggregation_weights(batch.pol_valid, cfg.loss.aggregation))
    graphdef, params = nnx.split(policy)
    tokens, valid, pol_pos = (jnp.asarray(a) for a in (batch.tokens, batch.valid, batch.pol_pos))

    def sft(p):
        logits = nnx.merge(graphdef, p)(tokens, Layout.causal(valid))
        lsm = jax.nn.log_softmax(jnp.take_along_axis(logits, jnp.maximum(pol_pos - 1, 0)[..., None], axis=1), -1)
        lp = jnp.take_along_axis(lsm, jnp.take_along_axis(tokens, pol_pos, axis=1)[..., None], axis=-1)[..., 0]
        return jnp.sum(weights * mask * -lp)

    ref_loss, ref_grads = jax.value_and_grad(sft)(params)
    assert float(m["ca_sft_nll"]) == pytest.approx(float(ref_loss), rel=1e-4)
    want = jax.tree.map(lambda a, b: np.asarray(a) + 0.7 * np.asarray(b), g_grpo, ref_grads)
    assert _max_diff(g_orchard, want) < 2e-5


def test_orchard_needs_the_outcome_reward():
    # the retrospective teacher's CA-SFT trains on failed trajectories: the outcome reward tells them
    with pytest.raises(ConfigError, match=r"step auxiliary 'retrospective' .* reads \['rewards'\], .*'outcome'"):
        resolve_method(StepConfig(algo=AlgoConfig(method="orchard", base="toolomni")))
    assert resolve_method(StepConfig(algo=AlgoConfig(method="orchard", base="matchtir"))).uses("retrospective")


def test_trains_three_steps_from_its_config_on_failures_alone(tmp_path):
    """configs/methods/orchard.py, 3 steps from a random tiny model (no warm-start): nothing is
    solved, so GRPO's advantage is 0 everywhere, and the update comes from CA-SFT alone. The
    random teacher's credits are tiny (|c| ~ 0.01), so the run sets the rise threshold to -1:
    every turn of a failed trajectory rises, one consecutive segment per trajectory (the
    threshold's own cases are the unit tests above)."""
    args = ["--config", str(REPO / "configs" / "methods" / "orchard.py"),
            "--workdir", str(tmp_path / "run"), "--config.model.allow_random_init=True",
            "--config.sft.steps=0", "--config.sft.curriculum_steps=0", "--config.data.num_eval=0",
            "--config.train.steps=3", "--config.train.prompts_per_step=2", "--config.train.group_size=4",
            "--config.rollout.max_turns=2", "--config.rollout.max_turn_tokens=24",
            "--config.rollout.max_response_tokens=64", "--config.checkpoint.every=0", "--config.log.tensorboard=False",
            "--config.checkpoint.export_at_end=False", "--config.orchard.rise=-1.0"]
    proc = run_main("turnsight_jax.train", *args, timeout=600)  # in the trainer process (tests/_train_runs.py)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "method orchard:" in proc.stderr and "loss [clipped_surrogate, ca_sft]" in proc.stderr
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2]
    for r in recs:
        assert r["rollout/reward_mean"] == 0.0 and r["train/adv_abs_mean"] == 0.0  # GRPO: no signal
        assert r["orchard/failed_frac"] == 1.0 and r["orchard/rise_token_share"] == 1.0
        assert r["orchard/rise_segments"] == 1.0 and 0.0 < r["orchard/v_start"] < 1.0
        assert r["train/ca_sft_nll"] > 0 and r["train/grad_norm"] > 0 and r["train/skipped_updates"] == 0.0
