"""The KV-cached sampler against the full forward pass, and its sampling distributions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import KVCache, init_model
from turnsight_jax.rollout.sampler import SamplingParams, append_tokens, decode_turn, kth_largest, truncated_logits

CFG = Qwen3Config(vocab_size=211, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, tie_word_embeddings=False)
NO_STOP = jnp.array([-1], jnp.int32)
BIG = jnp.full((3,), 10_000, jnp.int32)  # per-row token budgets that never bind


def _prefill(graphdef, state, rows, max_len):
    b = len(rows)
    n = max(len(r) for r in rows)
    toks = np.zeros((b, n), np.int32)
    for i, r in enumerate(rows):
        toks[i, : len(r)] = r
    cache = KVCache.zeros(CFG, b, max_len)
    hidden = jnp.zeros((b, CFG.hidden_size))
    return append_tokens(graphdef, state, jnp.asarray(toks), jnp.array([len(r) for r in rows]), cache, hidden)


def test_greedy_equals_stepwise_argmax_across_observation_append():
    model = init_model(CFG, seed=11)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 211, n)) for n in (5, 9, 3)]
    observations = [list(rng.integers(0, 211, n)) for n in (4, 1, 7)]
    cache, hidden = _prefill(graphdef, state, prompts, 64)
    greedy = SamplingParams(greedy=True)
    key = jax.random.key(0)
    active = jnp.ones((3,), bool)
    out1, cache, hidden, key = decode_turn(graphdef, state, cache, hidden, key, 8, greedy, NO_STOP, active, BIG)
    obs = np.zeros((3, 7), np.int32)
    for i, o in enumerate(observations):
        obs[i, : len(o)] = o
    cache, hidden = append_tokens(graphdef, state, jnp.asarray(obs), jnp.array([4, 1, 7]), cache, hidden)
    out2, cache, hidden, key = decode_turn(graphdef, state, cache, hidden, key, 6, greedy, NO_STOP, active, BIG)

    fwd = jax.jit(lambda t: jax.nn.log_softmax(model(t), -1))
    for i in range(3):
        seq = list(prompts[i])
        want_tok, want_lp = [], []
        for phase, n in ((0, 8), (1, 6)):
            if phase == 1:
                seq += observations[i]
            for _ in range(n):
                # right-padded to one width (one compile): causal, so padding after the last
                # token cannot change its logits
                padded = seq + [0] * (32 - len(seq))
                lp = np.asarray(fwd(jnp.asarray([padded], jnp.int32)))[0, len(seq) - 1]
                t = int(np.argmax(lp))
                want_tok.append(t)
                want_lp.append(lp[t])
                seq.append(t)
        got_tok = list(np.asarray(out1.tokens[i])) + list(np.asarray(out2.tokens[i]))
        got_lp = np.concatenate([np.asarray(out1.logprobs[i]), np.asarray(out2.logprobs[i])])
        assert got_tok == want_tok
        # sampler log-probs vs a teacher-forced forward: acceptance bound 1e-4 (float32)
        assert np.abs(got_lp - np.asarray(want_lp)).max() < 1e-4
    assert list(np.asarray(out1.lengths)) == [8, 8, 8] and not bool(out1.stopped.any())
    assert list(np.asarray(cache.lengths)) == [5 + 8 + 4 + 6, 9 + 8 + 1 + 6, 3 + 8 + 7 + 6]


def test_stop_token_ends_row_and_is_cached():
    model = init_model(CFG, seed=2)
    graphdef, state = nnx.split(model)
    cache, hidden = _prefill(graphdef, state, [[1, 2, 3], [4, 5, 6]], 32)
    greedy = SamplingParams(greedy=True)
    # find what greedy emits, then declare its 3rd token of row 0 a stop token
    probe, *_ = decode_turn(graphdef, state, jax.tree.map(jnp.copy, cache), hidden, jax.random.key(0), 6, greedy,
                            NO_STOP, jnp.ones((2,), bool), BIG[:2])
    stop = int(probe.tokens[0, 2])
    out, cache2, _, _ = decode_turn(graphdef, state, cache, hidden, jax.random.key(0), 6, greedy,
                                    jnp.array([stop]), jnp.ones((2,), bool), BIG[:2])
    assert bool(out.stopped[0]) and int(out.lengths[0]) == 3
    assert list(np.asarray(out.tokens[0, 3:])) == [0, 0, 0]
    assert int(cache2.lengths[0]) == 3 + 3  # the stop token is in the cache


def test_inactive_rows_emit_nothing():
    model = init_model(CFG, seed=2)
    graphdef, state = nnx.split(model)
    cache, hidden = _prefill(graphdef, state, [[1, 2], [3, 4]], 16)
    out, cache, _, _ = decode_turn(graphdef, state, cache, hidden, jax.random.key(1), 4, SamplingParams(),
                                   NO_STOP, jnp.array([True, False]), BIG[:2])
    assert list(np.asarray(out.lengths)) == [4, 0] and list(np.asarray(cache.lengths)) == [6, 2]


def _draws(params, n=4096, vocab=12, seed=0):
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8)
    model = init_model(cfg, seed=4)
    # scale the head so the distribution is far from uniform
    model.embed[...] = model.embed[...] * 8.0
    graphdef, state = nnx.split(model)
    cache = KVCache.zeros(cfg, n, 4)
    cache, hidden = append_tokens(graphdef, state, jnp.full((n, 2), 3, jnp.int32), jnp.full((n,), 2, jnp.int32),
                                  cache, jnp.zeros((n, cfg.hidden_size)))
    logits = np.asarray(model(jnp.array([[3, 3]])))[0, -1]
    out, *_ = decode_turn(graphdef, state, cache, hidden, jax.random.key(seed), 1, params, NO_STOP,
                          jnp.ones((n,), bool), jnp.full((n,), 99, jnp.int32))
    return np.asarray(out.tokens[:, 0]), np.asarray(out.logprobs[:, 0]), logits


def test_temperature_one_matches_softmax_chi_square():
    toks, lps, logits = _draws(SamplingParams(temperature=1.0))
    logits = logits.astype(np.float64)
    p = np.exp(logits - logits.max()); p /= p.sum()
    counts = np.bincount(toks, minlength=len(p))
    keep = p * len(toks) >= 5  # chi-square validity: pool rare cells
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(p[keep], p[~keep].sum()) * len(toks)
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp = exp / exp.sum() * obs.sum()  # float32 softmax mass is 1 only to ~1e-7
    assert stats.chisquare(obs, exp).pvalue > 0.01
    np.testing.assert_allclose(lps, np.log(p)[toks], atol=1e-5)
    assert p.max() < 0.9  # the test distribution is not degenerate


@pytest.mark.parametrize("k", [1, 3])
def test_top_k_truncates_exactly(k):
    toks, _, logits = _draws(SamplingParams(top_k=k))
    allowed = set(np.argsort(-logits)[:k])
    assert set(toks) == allowed  # every allowed token drawn, nothing else


@pytest.mark.parametrize("v,k", [(151936, 20), (151936, 1), (3000, 20), (700, 5), (5000, 1500)])
def test_kth_largest_equals_a_full_top_k(v, k):
    """The block-pruned search returns lax.top_k's k-th value, ties and -inf included: values are
    drawn from a few levels so that many tie, and whole blocks can be the only holders of the top."""
    rng = np.random.default_rng(v + k)
    x = rng.choice([-np.inf, -3.0, 0.0, 1.0, 2.5], size=(6, v), p=[0.3, 0.3, 0.3, 0.09, 0.01]).astype(np.float32)
    x[1] = rng.normal(size=v)  # all distinct
    x[2, :] = 0.0  # one level
    x[3, : min(k, v)] = 9.0  # the whole top in the first block(s)
    x[4, -min(k, v):] = 9.0  # ... or in the last, partial block
    want = np.asarray(jax.lax.top_k(jnp.asarray(x), k)[0][:, -1])
    np.testing.assert_array_equal(np.asarray(kth_largest(jnp.asarray(x), k)), want)


def test_top_p_truncates_exactly():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    kept = np.isfinite(np.asarray(truncated_logits(logits, SamplingParams(top_p=0.8))))[0]
    assert list(kept) == [True, True, False, False]  # 0.5 + 0.3 reaches 0.8
    kept = np.isfinite(np.asarray(truncated_logits(logits, SamplingParams(top_p=0.81))))[0]
    assert list(kept) == [True, True, True, False]
    toks, _, logits = _draws(SamplingParams(top_p=0.7))
    p = np.exp(logits - logits.max()); p /= p.sum()
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    nucleus = set(order[before < 0.7])
    assert set(toks) <= nucleus and len(set(toks)) == len(nucleus)


def test_invalid_sampling_params():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_budget_caps_each_row():
    model = init_model(CFG, seed=2)
    graphdef, state = nnx.split(model)
    cache, hidden = _prefill(graphdef, state, [[1, 2], [3, 4], [5]], 16)
    out, cache, _, _ = decode_turn(graphdef, state, cache, hidden, jax.random.key(1), 6, SamplingParams(),
                                   NO_STOP, jnp.ones((3,), bool), jnp.array([2, 6, 0]))
    assert list(np.asarray(out.lengths)) == [2, 6, 0] and list(np.asarray(cache.lengths)) == [4, 8, 1]


@pytest.mark.parametrize("params", [SamplingParams(greedy=True), SamplingParams(top_k=3), SamplingParams()],
                         ids=["greedy", "top_k", "full"])
def test_tokens_only_draws_the_same_tokens(params):
    """logprobs=False (what an evaluation decodes) changes no draw; its log-probs are 0."""
    import dataclasses

    toks, lps, _ = _draws(params, n=512)
    toks_only, lps_only, _ = _draws(dataclasses.replace(params, logprobs=False), n=512)
    np.testing.assert_array_equal(toks, toks_only)
    assert np.all(lps < 0) and np.all(lps_only == 0.0)
