"""PPO's critic and PiCA's step-PRM in the fused step: the critic's values equal a dense reference
in every batch layout, the policy gradient with GAE advantages equals an unfused reference, the
value loss falls on a fixed batch, accumulation over micro-batches equals one pass, with the
critic's advantages replaced by GRPO's the policy's update is GRPO's exactly (the critic never
reaches the policy), and PiCA with alpha = 0 is PPO while its PRM learns."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from turnsight_jax.models.attention import Layout
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import init_model
from turnsight_jax.models.sharding import make_mesh, state_shardings
from turnsight_jax.methods import critic as critic_lib
from turnsight_jax.rl.advantages import get_estimator
from turnsight_jax.rl.batch import make_train_batch, shard_batch
from turnsight_jax.rl.config import AlgoConfig, LossConfig, StepConfig
from turnsight_jax.rl.losses import aggregation_weights, clipped_surrogate
from turnsight_jax.rl.methods import resolve_method
from turnsight_jax.rl.step import make_train_step

from _replayed import gold_and_wrong
from _vocab import SMALL_VOCAB, fold, fold_batch
from conftest import OPTIMIZED

CFG = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
G = 2


@pytest.fixture(scope="module")
def setup(tok):
    """8 real trajectories (4 groups of 2: a gold chain and a wrong call), random old log-probs
    (normal(-3, 0.5)); a policy and a critic whose trunk differs from it and whose head is random."""
    trajs, tasks = gold_and_wrong(tok)
    policy, trunk = init_model(CFG, seed=0), init_model(CFG, seed=3)
    rng = np.random.default_rng(0)
    for t in trajs:
        lp = np.zeros(t.length, np.float32)
        lp[t.policy_mask] = rng.normal(-3.0, 0.5, int(t.policy_mask.sum()))
        t.old_logprobs = lp
    head = {"value_w": jnp.asarray(rng.normal(0, 0.3, CFG.hidden_size), jnp.float32),
            "value_b": jnp.asarray(0.1, jnp.float32)}
    return trajs, [tasks[i // G] for i in range(len(trajs))], policy, {"trunk": nnx.split(trunk)[1], "head": head}


def _cfg(method="ppo", **kw):
    """`critic` / `prm`: {key: value} of those sections; `algo`: more AlgoConfig fields."""
    algo = AlgoConfig(method=method, **kw.pop("algo", {})).with_section("gae", gamma=0.95, lam=0.9, whiten=True)
    for name in ("critic", "prm"):
        if name in kw:
            algo = algo.with_section(name, **kw.pop(name))
    return StepConfig(algo=algo, loss=LossConfig(clip_eps=0.2, clip_eps_high=0.28), group_size=G,
                      max_turns=5, logprob_chunk=64, **kw)


def _batch(cfg, trajs, row_tasks, tok, method=None):
    batch, _ = make_train_batch(trajs, row_tasks, tok, cfg, method or resolve_method(cfg))
    return fold_batch(batch)


_hidden = jax.jit(lambda graphdef, params, x, m: nnx.merge(graphdef, params).hidden_states(x, Layout.causal(m)),
                  static_argnums=0, compiler_options=OPTIMIZED)


def _dense_values(trunk_params, head, trajs, width=1024):
    """V at each trajectory's policy tokens, each trajectory its own plain row: [B, N] (0-padded)."""
    graphdef = nnx.graphdef(init_model(CFG, seed=0))
    x = np.zeros((len(trajs), width), np.int32)
    m = np.zeros((len(trajs), width), bool)
    for r, t in enumerate(trajs):
        x[r, : t.length], m[r, : t.length] = fold(t.tokens), True
    h = np.asarray(_hidden(graphdef, trunk_params, x, m), np.float32)
    n = max(int(t.policy_mask.sum()) for t in trajs)
    out = np.zeros((len(trajs), n), np.float32)
    for r, t in enumerate(trajs):
        pol = np.flatnonzero(t.policy_mask)
        out[r, : len(pol)] = h[r, pol - 1] @ np.asarray(head["value_w"]) + float(head["value_b"])
    return out


@pytest.mark.parametrize("layout", ["plain", "length_classes", "packed"])
def test_values_equal_dense_reference(setup, tok, layout):
    trajs, row_tasks, _, critic = setup
    kw = {"plain": {}, "length_classes": dict(length_classes=2), "packed": dict(pack_rows=True)}[layout]
    cfg = _cfg(**kw)
    batch = jax.tree.map(jnp.asarray, _batch(cfg, trajs, row_tasks, tok))
    got = np.asarray(jax.jit(lambda c, b: critic_lib.policy_values(nnx.merge(nnx.graphdef(init_model(CFG)),
                                                                             c["trunk"]), c["head"], b))(critic, batch))
    want = _dense_values(critic["trunk"], critic["head"], trajs)
    n = want.shape[1]
    np.testing.assert_allclose(got[:, :n], want, atol=2e-5)
    assert np.all(got[:, n:] == 0.0)
    assert np.all(got[~np.asarray(batch.pol_valid)] == 0.0)


def _run(cfg, policy, critic, batch, *, method=None, lr=1.0, critic_opt=None, steps=1):
    """`steps` fused steps with SGD(lr) (the critic: `critic_opt`, default SGD(lr)) on the same
    batch -> (params before - after, each step's metrics, the critic state after)."""
    graphdef, params = nnx.split(policy)
    method = method or resolve_method(cfg)
    opt, c_opt = optax.sgd(lr), critic_opt or optax.sgd(lr)
    step = make_train_step(graphdef, cfg, opt, method, aux_optimizers={"critic": c_opt})
    before = jax.tree.map(np.asarray, params)
    ref = jax.tree.map(jnp.copy, params)
    params = jax.tree.map(jnp.copy, params)
    opt_state = opt.init(params)
    state = None
    if method.uses("critic"):
        state = {"critic": {"params": jax.tree.map(jnp.copy, critic), "opt_state": c_opt.init(critic)}}
    history = []
    for _ in range(steps):
        out = step(params, opt_state, ref, jax.tree.map(jnp.asarray, batch), None, state)
        if method.uses("critic"):
            params, opt_state, metrics, state = out
        else:
            params, opt_state, metrics = out
        history.append(jax.device_get(metrics))
    diff = jax.tree.map(lambda a, b: a - np.asarray(b), before, params)
    return diff, history, None if state is None else state["critic"]


@pytest.fixture(scope="module")
def ppo_one(setup, tok):
    """PPO's step (the _cfg() defaults, SGD(1)) on the setup batch, once for the tests that compare
    against it: (policy params before - after, metrics, critic after)."""
    trajs, row_tasks, policy, critic = setup
    return _run(_cfg(), policy, critic, _batch(_cfg(), trajs, row_tasks, tok))


def _reference_policy_grads(cfg, policy, critic, trajs):
    """The clipped surrogate with GAE advantages, unfused: each trajectory a plain row, values
    from _dense_values, GAE by a Python loop over the policy tokens, whitened over the batch."""
    a = cfg.algo
    values = _dense_values(critic["trunk"], critic["head"], trajs)
    b, n = values.shape
    mask = np.zeros((b, n), bool)
    old = np.zeros((b, n), np.float32)
    adv = np.zeros((b, n), np.float64)
    for i, t in enumerate(trajs):
        pol = np.flatnonzero(t.policy_mask)
        c = len(pol)
        mask[i, :c] = True
        old[i, :c] = t.old_logprobs[pol]
        run, nxt = 0.0, 0.0
        for j in reversed(range(c)):
            r = t.reward if j == c - 1 else 0.0
            g = a.section("gae")
            run = r + g.gamma * nxt - values[i, j] + g.gamma * g.lam * run
            adv[i, j], nxt = run, values[i, j]
    flat = adv[mask]
    adv = np.where(mask, (adv - flat.mean()) / np.sqrt(flat.var(ddof=1) + 1e-8), 0.0).astype(np.float32)
    weights = aggregation_weights(jnp.asarray(mask), cfg.loss.aggregation)
    graphdef, params = nnx.split(policy)
    x = np.zeros((b, 1024), np.int32)
    m = np.zeros((b, 1024), bool)
    for r, t in enumerate(trajs):
        x[r, : t.length], m[r, : t.length] = fold(t.tokens), True

    def loss(params):
        model = nnx.merge(graphdef, params)
        lsm = jax.nn.log_softmax(model.logits(model.hidden_states(x, Layout.causal(m))), -1)
        total = 0.0
        for i, t in enumerate(trajs):
            pol = np.flatnonzero(t.policy_mask)
            lp = jnp.zeros(n).at[: len(pol)].set(lsm[i, pol - 1, fold(t.tokens[pol])])
            total = total + jnp.sum(clipped_surrogate(lp, old[i], adv[i], cfg.loss)[0] * weights[i])
        return total

    return jax.grad(loss)(params), values, adv, mask


def _max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)))


def test_ppo_policy_gradient_equals_unfused_reference(setup, ppo_one):
    trajs, row_tasks, policy, critic = setup
    cfg = _cfg()
    grads, hist, _ = ppo_one
    want, values, adv, mask = _reference_policy_grads(cfg, policy, critic, trajs)
    scale = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(want))
    assert scale > 1e-4  # the reference gradient is not trivially zero
    assert _max_diff(grads, want) < 1e-5 * max(scale, 1.0)
    m = hist[0]
    np.testing.assert_allclose(m["adv_mean"], adv[mask].mean(), atol=1e-6)  # whitened: mean 0
    np.testing.assert_allclose(m["adv_abs_mean"], np.abs(adv[mask]).mean(), rtol=1e-5)
    assert 0.0 < m["critic/value_loss"] and np.isfinite(m["critic/explained_variance"])


def test_value_loss_falls_on_a_fixed_batch(setup, tok):
    """Six critic updates (Adam, lr 3e-2) on one batch: the value loss falls by more than half
    and the explained variance of the step-start values rises above where it started."""
    trajs, row_tasks, policy, critic = setup
    cfg = _cfg(critic=dict(value_clip=None))
    _, hist, state = _run(cfg, policy, critic, _batch(cfg, trajs, row_tasks, tok), lr=1e-6,
                          critic_opt=optax.adam(3e-2), steps=6)
    losses = [h["critic/value_loss"] for h in hist]
    assert losses[-1] < 0.5 * losses[0], losses
    ev = [h["critic/explained_variance"] for h in hist]
    assert ev[-1] > ev[0] + 0.2, ev
    assert not np.allclose(np.asarray(state["params"]["head"]["value_w"]), np.asarray(critic["head"]["value_w"]))


def test_grpo_advantage_with_a_critic_is_the_grpo_step(setup, tok):
    """PPO with its advantage replaced by GRPO's: the policy's update equals the GRPO method's
    (the critic's loss never reaches the policy), while the critic is still trained."""
    trajs, row_tasks, policy, critic = setup
    cfg_ppo, cfg_grpo = _cfg(), _cfg("grpo")
    ppo = dataclasses.replace(resolve_method(cfg_ppo), advantage=get_estimator("grpo"))
    batch = _batch(cfg_ppo, trajs, row_tasks, tok, ppo)
    d_ppo, h_ppo, state = _run(cfg_ppo, policy, critic, batch, method=ppo)
    d_grpo, h_grpo, _ = _run(cfg_grpo, policy, critic, _batch(cfg_grpo, trajs, row_tasks, tok))
    assert _max_diff(d_ppo, d_grpo) == 0.0
    assert h_ppo[0]["adv_mean"] == h_grpo[0]["adv_mean"] and h_ppo[0]["grad_norm"] == h_grpo[0]["grad_norm"]
    moved = _max_diff(state["params"], critic)
    assert moved > 1e-4


def test_micro_batches_accumulate_and_mini_batches_run(setup, tok, ppo_one):
    """Two micro-batches accumulate to one pass (policy and critic, to float rounding); two
    mini-batches x two epochs make four updates of both, each from the step-start V_old."""
    trajs, row_tasks, policy, critic = setup
    two = _cfg(micro_batches=2)
    d1, h1, s1 = ppo_one
    d2, h2, s2 = _run(two, policy, critic, _batch(two, trajs, row_tasks, tok))
    assert _max_diff(d1, d2) < 1e-6
    assert _max_diff(s1["params"], s2["params"]) < 1e-5
    np.testing.assert_allclose(h1[0]["critic/value_loss"], h2[0]["critic/value_loss"], rtol=1e-5)
    many = _cfg(mini_batches=2, ppo_epochs=2)
    _, h4, s4 = _run(many, policy, critic, _batch(many, trajs, row_tasks, tok), lr=1e-3,
                     critic_opt=optax.adam(1e-3))
    assert h4[0]["skipped_updates"] == 0 and np.isfinite(h4[0]["critic/value_loss"])
    assert int(s4["opt_state"][0].count) == 4  # the critic's Adam stepped once per update


def test_turnsight_over_ppo(setup, tok):
    """rl.method=turnsight over rl.base=ppo: the critic is trained and TurnSight weights GAE's
    advantage (its base), which the step reports as the base."""
    trajs, row_tasks, policy, critic = setup
    cfg = _cfg("turnsight", algo=dict(base="ppo"))
    method = resolve_method(cfg)
    assert method.uses("critic") and method.base.name == "gae"
    _, hist, state = _run(cfg, policy, critic, _batch(cfg, trajs, row_tasks, tok))
    m = hist[0]
    assert m["critic/value_loss"] > 0 and _max_diff(state["params"], critic) > 1e-4
    assert 0.0 <= m["agreement_rate"] <= 1.0 and m["adv_abs_mean"] > 0


def test_sharded_step_equals_unsharded(setup, tok, ppo_one):
    """fsdp=2 x tensor=4 on the test's 8 CPU devices, every state sharded: the same update."""
    trajs, row_tasks, policy, critic = setup
    cfg = _cfg()
    batch = _batch(cfg, trajs, row_tasks, tok)
    d1, h1, s1 = ppo_one
    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    graphdef, params = nnx.split(policy)
    put = lambda tree: jax.device_put(tree, state_shardings(tree, mesh))
    opt = optax.sgd(1.0)
    step = make_train_step(graphdef, cfg, opt, aux_optimizers={"critic": opt})
    p = put(jax.tree.map(jnp.copy, params))
    c = {"params": put(jax.tree.map(jnp.copy, critic))}  # the trunk like the policy, the head replicated
    c["opt_state"] = opt.init(c["params"])
    with jax.set_mesh(mesh):
        new, _, m2, s2 = step(p, opt.init(p), put(jax.tree.map(jnp.copy, params)), shard_batch(batch, mesh), None,
                              {"critic": c})
    s2 = s2["critic"]
    d2 = jax.tree.map(lambda a, b: a - np.asarray(b), jax.tree.map(np.asarray, params), new)
    assert _max_diff(d1, d2) < 1e-5
    assert _max_diff(s1["params"], s2["params"]) < 1e-5
    np.testing.assert_allclose(h1[0]["critic/value_loss"], float(m2["critic/value_loss"]), rtol=1e-4)


def _pica_run(cfg, policy, critic, batch, head, lr=1.0):
    """One PiCA step (SGD(lr) for the policy, the critic and the PRM head) -> (policy params
    before - after, metrics, aux after)."""
    graphdef, params = nnx.split(policy)
    method = resolve_method(cfg)
    opt = optax.sgd(lr)
    step = make_train_step(graphdef, cfg, opt, method, aux_optimizers={"critic": opt, "prm": opt})
    before = jax.tree.map(np.asarray, params)
    aux = {"critic": {"params": jax.tree.map(jnp.copy, critic), "opt_state": opt.init(critic)},
           "prm": {"params": head, "opt_state": opt.init(head)}}
    new, _, metrics, aux = step(jax.tree.map(jnp.copy, params), opt.init(params), jax.tree.map(jnp.copy, params),
                                jax.tree.map(jnp.asarray, batch), None, aux)
    return jax.tree.map(lambda a, b: a - np.asarray(b), before, new), jax.device_get(metrics), aux


def test_pica_with_alpha_zero_is_ppo_and_its_prm_learns(setup, tok, ppo_one):
    """With alpha = 0 the progress rewards vanish: PiCA's policy and critic updates are PPO's
    exactly. Its PRM still trains: the head moves, and h sits at 0.5 for a zero head."""
    trajs, row_tasks, policy, critic = setup
    pica_cfg = _cfg("pica", prm=dict(alpha=0.0))
    zero = {"prm_w": jnp.zeros(CFG.hidden_size), "prm_b": jnp.zeros(())}
    d_ppo, h_ppo, s_ppo = ppo_one
    d_pica, m, aux = _pica_run(pica_cfg, policy, critic, _batch(pica_cfg, trajs, row_tasks, tok), zero)
    assert _max_diff(d_ppo, d_pica) == 0.0 and _max_diff(s_ppo["params"], aux["critic"]["params"]) == 0.0
    assert m["prm/h_start"] == pytest.approx(0.5) and m["prm/gain_abs_mean"] == 0.0
    # boundaries: one per tool-result turn before the last, over the 8 trajectories
    assert m["prm/boundaries"] == sum(len(t.turns) - 1 for t in trajs)
    assert 0.0 < m["prm/solved_frac"] < 1.0 and m["prm/loss"] > 0
    assert float(jnp.abs(aux["prm"]["params"]["prm_w"]).max()) > 0  # the head moved


def test_pica_progress_rewards_change_the_advantage(setup, tok, ppo_one):
    """A non-zero PRM head: gains at the boundaries, and GAE's advantages (hence the update)
    differ from PPO's; the gains equal h_{k-1} - h_k of the step's metrics' definition."""
    trajs, row_tasks, policy, critic = setup
    rng = np.random.default_rng(5)
    head = {"prm_w": jnp.asarray(rng.normal(0, 1.0, CFG.hidden_size), jnp.float32), "prm_b": jnp.zeros(())}
    cfg = _cfg("pica", prm=dict(alpha=1.0, decay=0.9))
    d_pica, m, _ = _pica_run(cfg, policy, critic, _batch(cfg, trajs, row_tasks, tok), head)
    d_ppo, h_ppo, _ = ppo_one
    assert m["prm/gain_abs_mean"] > 1e-3
    assert _max_diff(d_pica, d_ppo) > 1e-6 and m["adv_abs_mean"] != h_ppo[0]["adv_abs_mean"]
