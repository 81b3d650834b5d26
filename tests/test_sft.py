"""The supervised warm-start's pieces: short rows, the task vocabulary, the restricted softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from turnsight_jax import config as C
from turnsight_jax import model_setup, sources
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import init_model
from turnsight_jax.rl.supervised import flatten_policy, pad_demonstrations, sft_step, sft_update, state_pinned
from turnsight_jax.sft import (_restricted_step, demonstration_turn_texts, drop_system_block, gold_trajectories,
                               task_vocabulary)
from turnsight_jax.rl.logprobs import student_logprobs
from turnsight_jax.envs.synthetic import generate_tasks, gold_turn_texts


@pytest.fixture(scope="module")
def gold():
    cfg = C.default_config()
    tok, _ = model_setup.setup_tokenizer(cfg, 151936)
    tasks = generate_tasks(8, seed=3, categories=("single_hop", "multi_hop"), config=sources.synthetic_config(cfg))
    with sources.make_env("builtin") as env:
        trajs = gold_trajectories(tasks, tok, cfg, env)
    return tok, tasks, trajs


def test_drop_system_block_keeps_every_policy_token(gold):
    tok, tasks, trajs = gold
    user_start = tok.encode("<|im_start|>user")
    for task, t in zip(tasks, trajs):
        ids, pm = drop_system_block(t.tokens, t.policy_mask.astype(bool), user_start)
        text = tok.decode(list(ids))
        assert text.startswith("<|im_start|>user\nPlease call given tools")
        assert "<tools>" not in text and "<tools>" in tok.decode(list(t.tokens))
        # The policy tokens are the same tokens, in the same order, with the same context after the cut.
        np.testing.assert_array_equal(ids[pm], t.tokens[t.policy_mask.astype(bool)])
        cut = len(t.tokens) - len(ids)
        assert cut > 150  # the schemas of 2-3 tools
        np.testing.assert_array_equal(np.flatnonzero(pm) + cut, np.flatnonzero(t.policy_mask))
        assert tok.decode(list(ids[pm])).endswith(f"<answer>{task.answer}</answer><|im_end|>")


def test_drop_system_block_without_user_message_is_an_error():
    with pytest.raises(ValueError, match="no '<\\|im_start\\|>user'"):
        drop_system_block(np.array([1, 2, 3]), np.array([0, 1, 1], bool), [7, 8])


def test_task_vocabulary_is_the_policy_tokens(gold):
    tok, tasks, trajs = gold
    classes = task_vocabulary(trajs)
    assert classes.dtype == np.int32 and np.all(np.diff(classes) > 0)
    expected = set()
    for task in tasks:
        for turn in gold_turn_texts(task):
            expected.update(tok.encode(turn))
    # Every gold turn's tokens (plus the template's end-of-turn tokens) and nothing from the prompts.
    assert expected <= set(classes.tolist())
    assert set(classes.tolist()) - expected <= set(tok.encode("<|im_end|>\n"))
    assert not set(tok.encode("Please call given tools")) & set(classes.tolist())


def _small_model():
    cfg = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
    return init_model(cfg, seed=0)


def _batch(seed, b=3, t=12, n=4, vocab=96):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        length = int(rng.integers(n + 2, t + 1))
        ids = rng.integers(0, vocab, length).astype(np.int32)
        pm = np.zeros(length, bool)
        pm[rng.choice(np.arange(1, length), size=n, replace=False)] = True
        rows.append((ids, pm))
    return rows


def test_restricted_loss_is_cross_entropy_over_the_classes():
    """The restricted step's loss = -mean log softmax over `classes` of the policy tokens, computed
    here from the full logits by hand; with every token as a class it is the ordinary SFT loss."""
    model = _small_model()
    graphdef, params = nnx.split(model)
    rows = _batch(0)
    tokens, valid, pol_pos, pol_valid = pad_demonstrations(rows, 12, 8)
    classes = np.unique(np.concatenate([ids[pm] for ids, pm in rows]) + 0).astype(np.int32)
    classes = np.union1d(classes, [0, 5, 50]).astype(np.int32)  # some classes that are never targets

    full_logits = nnx.jit(lambda m, x, v: m.hidden_states(x, Layout.causal(v)) @ m.output_weight())
    logits = np.asarray(full_logits(model, jnp.asarray(tokens), jnp.asarray(valid)), np.float64)  # [B, T, V]
    want, count = 0.0, 0
    for b in range(len(rows)):
        for p, ok in zip(pol_pos[b], pol_valid[b]):
            if ok:
                row = logits[b, p - 1, classes]
                want -= row[np.searchsorted(classes, tokens[b, p])] - np.log(np.exp(row - row.max()).sum()) - row.max()
                count += 1
    want /= count

    sgd = optax.sgd(0.0)  # lr 0: the step returns the loss and leaves the parameters alone
    args = [jnp.asarray(x) for x in (tokens, valid, pol_pos, pol_valid)]
    _, _, got = _restricted_step(graphdef, sgd, jax.tree.map(jnp.copy, params), sgd.init(params),
                                 jnp.asarray(classes), *args)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)

    everything = jnp.arange(96, dtype=jnp.int32)
    _, _, restricted_all = _restricted_step(graphdef, sgd, jax.tree.map(jnp.copy, params), sgd.init(params),
                                            everything, *args)
    _, _, full = sft_step(graphdef, sgd, jax.tree.map(jnp.copy, params), sgd.init(params), *args[:2],
                           *map(jnp.asarray, flatten_policy(pol_pos, pol_valid, multiple=8)))
    np.testing.assert_allclose(float(restricted_all), float(full), rtol=1e-5)
    assert float(got) < float(full)  # fewer classes: a smaller normaliser


def test_flatten_policy_lists_every_policy_token_once():
    pol_pos = np.array([[3, 5, 0, 0], [1, 2, 4, 7], [0, 0, 0, 0]], np.int32)
    pol_valid = pol_pos > 0
    row, pos, keep = flatten_policy(pol_pos, pol_valid, multiple=4)
    assert row.shape == pos.shape == keep.shape == (8,)
    assert list(zip(row[keep], pos[keep])) == [(0, 3), (0, 5), (1, 1), (1, 2), (1, 4), (1, 7)]
    assert not keep[6:].any()
    assert flatten_policy(pol_pos, np.zeros_like(pol_valid), multiple=4)[2].shape == (4,)  # never empty


def test_packed_sft_step_equals_the_padded_per_row_loss_and_gradient():
    """The full-vocabulary step on flattened policy tokens computes the same loss and the same
    update as the mean over the padded [B, N] log-probs."""
    model = _small_model()
    graphdef, params = nnx.split(model)
    rows = _batch(2, b=4)
    tokens, valid, pol_pos, pol_valid = pad_demonstrations(rows, 12, 8)

    def padded(p):
        lp = student_logprobs(nnx.merge(graphdef, p), jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(pol_pos))
        return -jnp.sum(lp * pol_valid) / pol_valid.sum()

    want_loss, want_grads = jax.jit(jax.value_and_grad(padded))(params)
    sgd = optax.sgd(1.0)  # lr 1: the update is minus the gradient
    new, _, loss = sft_step(graphdef, sgd, jax.tree.map(jnp.copy, params), sgd.init(params), jnp.asarray(tokens),
                             jnp.asarray(valid), *map(jnp.asarray, flatten_policy(pol_pos, pol_valid, multiple=8)))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    got_grads = jax.tree.map(lambda a, b: a - b, params, new)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


def test_warm_start_steps_compile_once_on_a_one_device_mesh():
    """The step's updated state keeps the input shardings (`state_pinned`), so step 2 reuses
    step 1's program; left to the compiler, a one-device mesh hands P(None,) back as P() and the
    same step compiles again."""
    from turnsight_jax.models.sharding import make_mesh, state_shardings

    mesh = make_mesh(devices=jax.devices()[:1])
    graphdef, params = nnx.split(_small_model())
    tokens, valid, pol_pos, pol_valid = pad_demonstrations(_batch(3, b=2), 12, 8)
    args = (jnp.asarray(tokens), jnp.asarray(valid), *map(jnp.asarray, flatten_policy(pol_pos, pol_valid, multiple=8)))
    opt = optax.adam(1e-3)
    counts = {}
    for name in ("pinned", "compiler's choice"):
        p = jax.device_put(jax.tree.map(jnp.copy, params), state_shardings(params, mesh))  # donated below
        with jax.set_mesh(mesh):
            o = jax.jit(opt.init)(p)
            step = (state_pinned(sft_update, p, o) if name == "pinned"
                    else jax.jit(sft_update, static_argnums=(0, 1), donate_argnums=(2, 3)))
            before = step._cache_size()  # jits of one function may share a cache: count what these calls add
            for _ in range(3):
                p, o, loss = step(graphdef, opt, p, o, *args)
        counts[name] = step._cache_size() - before
        assert np.isfinite(float(loss))
    assert counts == {"pinned": 1, "compiler's choice": 2}, counts


def test_imperfect_demonstrations_add_one_wasted_call_at_the_configured_rate():
    cfg = C.default_config()
    tasks = generate_tasks(400, seed=5, categories=("single_hop", "multi_hop"), config=sources.synthetic_config(cfg))
    rng = np.random.default_rng(0)
    for t in tasks[:20]:
        assert demonstration_turn_texts(t, rng, 0.0, 4) == gold_turn_texts(t)
    wasted = 0
    for t in tasks:
        gold = gold_turn_texts(t)
        got = demonstration_turn_texts(t, rng, 0.5, 4)
        if got == gold:
            continue
        wasted += 1
        assert len(got) == len(gold) + 1
        i = next(k for k in range(len(gold)) if got[k] != gold[k])
        assert got[i + 1:] == gold[i:]  # the demonstrator recovers: the gold chain follows unchanged
        tool_names = {x["function"]["name"] for x in t.tools}
        gold_call = t.gold_calls[i][0]
        assert f'"arguments": {{"name": "{gold_call["arguments"]["name"]}"}}' in got[i]
        assert f'"name": "{gold_call["name"]}"' not in got[i]
        assert any(f'"name": "{n}"' in got[i] for n in tool_names)
    assert abs(wasted / len(tasks) - 0.5) < 0.1  # binomial sd 0.025
    # Never past the turn limit: a 3-turn gold chain with max_turns 3 stays gold.
    multi = next(t for t in tasks if len(gold_turn_texts(t)) == 3)
    assert all(demonstration_turn_texts(multi, rng, 1.0, 3) == gold_turn_texts(multi) for _ in range(5))


def test_restricted_gradient_matches_autodiff_of_the_reference():
    """Gradients of the restricted step = gradients of the hand-written restricted loss."""
    model = _small_model()
    graphdef, params = nnx.split(model)
    rows = _batch(1)
    tokens, valid, pol_pos, pol_valid = pad_demonstrations(rows, 12, 8)
    classes = jnp.asarray(np.unique(np.concatenate([ids[pm] for ids, pm in rows])).astype(np.int32))

    def reference(p):
        m = nnx.merge(graphdef, p)
        h = m.hidden_states(jnp.asarray(tokens), Layout.causal(jnp.asarray(valid)))
        logits = (h @ m.output_weight())[..., classes]  # [B, T, C]
        lsm = jax.nn.log_softmax(logits, -1)
        idx = jnp.searchsorted(classes, jnp.asarray(tokens))
        per_pos = jnp.take_along_axis(lsm[:, :-1], idx[:, 1:, None], -1)[..., 0]  # predicts token t+1
        mask = np.zeros(tokens.shape, bool)
        for b in range(len(rows)):
            mask[b, pol_pos[b][pol_valid[b]]] = True
        mask = jnp.asarray(mask[:, 1:])
        return -jnp.sum(per_pos * mask) / mask.sum()

    want = jax.jit(jax.grad(reference))(params)
    lr = 1.0
    sgd = optax.sgd(lr)
    new, _, _ = _restricted_step(graphdef, sgd, jax.tree.map(jnp.copy, params), sgd.init(params), classes,
                                 *[jnp.asarray(x) for x in (tokens, valid, pol_pos, pol_valid)])
    got = jax.tree.map(lambda a, b: (a - b) / lr, params, new)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5)
    assert max(float(jnp.abs(w).max()) for w in jax.tree.leaves(want)) > 1e-3
