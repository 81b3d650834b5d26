"""The self-distillation baselines in the fused step: each method's gradient equals an unfused
reference (the teacher scoring each privileged context as its own plain sequence, the student's
full log-softmax, the loss written out per token), its teacher is the one teacher.weights names
(the step-start policy, an EMA passed in, an external model of another size), and with its
coefficient 0 (λ = 0 for RLSD) the step is the base method's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from turnsight_jax.methods.privileged_blocks import default_skills_path, load_skills, privileged_blocks
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import init_model
from turnsight_jax.rl import advantages as adv_lib
from turnsight_jax.methods import self_distillation as distill
from turnsight_jax.models.sharding import make_mesh, state_shardings
from turnsight_jax.rl.batch import make_train_batch, shard_batch
from turnsight_jax.rl.config import AlgoConfig, LossConfig, StepConfig, TeacherConfig
from turnsight_jax.rl.losses import aggregation_weights, clipped_surrogate
from turnsight_jax.rl.methods import resolve_method
from turnsight_jax.rl.step import make_train_step

from _replayed import gold_and_wrong
from _vocab import SMALL_VOCAB, fold, fold_batch
from conftest import OPTIMIZED

CFG = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
BIG = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=48, intermediate_size=96, num_layers=3, num_heads=4,
                  num_kv_heads=2, head_dim=12, tie_word_embeddings=False)  # SOD's "larger" external teacher
G, K = 2, 4


@pytest.fixture(scope="module")
def setup(tok):
    """8 real trajectories (4 groups of 2: a gold chain solving the task and a wrong call), old
    log-probs near the policy's own."""
    trajs, tasks = gold_and_wrong(tok)
    assert [t.reward for t in trajs[:2]] == [1.0, 0.0]  # a successful sibling for the failed rollout only
    policy, ref, big = init_model(CFG, seed=0), init_model(CFG, seed=1), init_model(BIG, seed=2)
    rng = np.random.default_rng(0)
    graphdef, params = nnx.split(policy)
    pol = [np.flatnonzero(t.policy_mask) for t in trajs]
    own = _dense(graphdef, params, [t.tokens for t in trajs], [p - 1 for p in pol])
    for t, p, lsm in zip(trajs, pol, own):
        lp = np.zeros(t.length, np.float32)
        lp[p] = lsm[np.arange(len(p)), fold(t.tokens[p])] + rng.normal(0, 0.3, len(p))
        t.old_logprobs = lp
    return trajs, [tasks[i // G] for i in range(len(trajs))], policy, ref, big


_rows = jax.jit(lambda graphdef, params, x, m, pred: jax.nn.log_softmax(
    nnx.merge(graphdef, params).logits(jnp.take_along_axis(
        nnx.merge(graphdef, params).hidden_states(x, Layout.causal(m)), pred[..., None], axis=1)), -1),
    static_argnums=0, compiler_options=OPTIMIZED)


def _dense(graphdef, params, seqs, preds, width=1024, most=128):
    """Full log-softmax [n, V] at each sequence's predictor positions (each its own plain row)."""
    x = np.zeros((len(seqs), width), np.int32)
    m = np.zeros((len(seqs), width), bool)
    pr = np.zeros((len(seqs), most), np.int32)
    for r, (sq, p) in enumerate(zip(seqs, preds)):
        x[r, : len(sq)], m[r, : len(sq)], pr[r, : len(p)] = fold(sq), True, p
    traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(params))
    out = (_rows.__wrapped__ if traced else _rows)(graphdef, params, x, m, pr)
    return [out[r, : len(p)] for r, p in enumerate(preds)]


def _cfg(method, *, base="grpo", weights="policy", source="gold_answer", sections=None, **algo):
    """`sections`: {method section: {key: value}} (sdpo.*, sdar.*, sod.*)."""
    a = AlgoConfig(method=method, base=base, **algo).with_section("privileged", source=source, placement="prompt")
    for name, values in (sections or {}).items():
        a = a.with_section(name, **values)
    return StepConfig(algo=a,
                      teacher=TeacherConfig(weights=weights, top_k=K,
                                            checkpoint="x" if weights == "external" else ""),
                      loss=LossConfig(clip_eps=0.2, clip_eps_high=0.28), group_size=G, max_turns=5, logprob_chunk=64)


def _step(cfg, policy, ref, batch, teacher=None, mesh=None):
    """The fused step with SGD(lr=1) -> (grads, metrics); on `mesh` with every state sharded."""
    graphdef, params = nnx.split(policy)
    ref_params = nnx.split(ref)[1]
    tgraph, tparams = (None, None) if teacher is None else nnx.split(teacher)
    opt = optax.sgd(1.0)
    step = make_train_step(graphdef, cfg, opt, teacher_graphdef=tgraph if cfg.teacher.weights == "external" else None)
    before = jax.tree.map(np.asarray, params)
    if mesh is None:
        new, _, metrics = step(params, opt.init(params), ref_params, jax.tree.map(jnp.asarray, batch), tparams)
    else:
        put = lambda tree: None if tree is None else jax.device_put(tree, state_shardings(tree, mesh))
        params, ref_params, tparams = put(params), put(ref_params), put(tparams)
        with jax.set_mesh(mesh):
            new, _, metrics = step(params, opt.init(params), ref_params, shard_batch(batch, mesh), tparams)
    return jax.tree.map(lambda a, b: a - np.asarray(b), before, new), metrics


def _batch(cfg, trajs, row_tasks, tok):
    batch, stats = make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg))
    return fold_batch(batch), stats


def _reference_grads(cfg, policy, teacher, trajs, row_tasks, tok):
    """Everything unfused: each trajectory's privileged sequence prompt + block + the rest scored
    as a plain row by `teacher`, the advantages and every loss term per token in plain code."""
    a, pv = cfg.algo, cfg.algo.section("privileged")
    b, n = len(trajs), max(int(t.policy_mask.sum()) for t in trajs)
    pol = [np.flatnonzero(t.policy_mask) for t in trajs]
    mask = np.zeros((b, n), bool)
    old = np.zeros((b, n), np.float32)
    turn_ids = np.full((b, n), -1, np.int32)
    for i, t in enumerate(trajs):
        mask[i, : len(pol[i])] = True
        old[i, : len(pol[i])] = t.old_logprobs[pol[i]]
        turn_ids[i, : len(pol[i])] = t.turn_ids[pol[i]]
    skills = load_skills(default_skills_path()) if pv.source == "skill" else None
    blocks = privileged_blocks(trajs, row_tasks, tok, source=pv.source, placement="prompt", skills=skills,
                               rewards=[t.reward for t in trajs], group_ids=[t.group_id for t in trajs],
                               min_reward=pv.sibling_min_reward)
    seqs, preds, covered = [], [], np.zeros((b, n), bool)
    for i, (t, blk) in enumerate(zip(trajs, blocks)):
        hs = t.turns[0].header_start
        blk = [] if blk is None else list(blk)
        seqs.append(list(t.tokens[:hs]) + blk + list(t.tokens[hs:]))
        preds.append(pol[i] - 1 + len(blk))  # every policy token sits after the block
        covered[i, : len(pol[i])] = bool(blk) or pv.source == "none"
    tg, tp = nnx.split(teacher)
    t_lsm = _dense(tg, tp, seqs, preds)
    tlp = np.zeros((b, n), np.float32)
    top_ids = np.zeros((b, n, K), np.int32)
    top_lp = np.zeros((b, n, K), np.float32)
    for i, (t, lsm) in enumerate(zip(trajs, t_lsm)):
        lsm = np.asarray(lsm)
        c = len(pol[i])
        tlp[i, :c] = lsm[np.arange(c), fold(t.tokens[pol[i]])]
        ids = np.argsort(-lsm, axis=1, kind="stable")[:, :K]
        top_ids[i, :c], top_lp[i, :c] = ids, np.take_along_axis(lsm, ids, axis=1)
    group_ids = np.repeat(np.arange(b // G), G).astype(np.int32)
    rewards = np.array([t.reward for t in trajs], np.float32)
    adv = np.asarray(adv_lib.grpo_advantages(rewards, group_ids, mask, num_groups=b // G))
    gap = (tlp - old)[None]
    if a.method == "rlsd":
        adv = np.asarray(distill.rlsd_advantages(gap, adv, mask, covered, lam=a.lam, eps_w=a.eps_w)["advantages"])
    elif a.method == "sdpo_advantage":
        adv = np.asarray(distill.sdpo_advantages(gap, adv, mask, covered,
                                                 sdpo_coef=a.section("sdpo").coef)["advantages"])
    weights = aggregation_weights(jnp.asarray(mask), cfg.loss.aggregation)
    graphdef, params = nnx.split(policy)

    def loss(params):
        total = 0.0
        lsms = _dense(graphdef, params, [t.tokens for t in trajs], [p - 1 for p in pol])
        for i, (t, lsm) in enumerate(zip(trajs, lsms)):
            c = len(pol[i])
            lp = jnp.zeros(n).at[:c].set(lsm[jnp.arange(c), fold(t.tokens[pol[i]])])
            tl = clipped_surrogate(lp, old[i], adv[i], cfg.loss)[0]
            if a.method in ("sdpo", "sod"):
                s = jnp.zeros((n, K)).at[:c].set(jnp.take_along_axis(lsm, top_ids[i, :c], axis=1))
                kl = jnp.where(mask[i] & covered[i], distill.topk_kl(s, top_lp[i], tail=a.section(a.method).tail), 0.0)
                if a.method == "sdpo":
                    tl = tl + a.section("sdpo").coef * kl
                else:
                    sod = a.section("sod")
                    w = distill.sod_turn_weights(kl[None], turn_ids[i][None], mask[i][None], sod.tau)[0]
                    tl = tl + sod.coef * w * kl
            if a.method == "sdar":
                sdar = a.section("sdar")
                gate = jax.nn.sigmoid(sdar.beta * (tlp[i] - jax.lax.stop_gradient(lp)))
                tl = tl - sdar.coef * jnp.where(mask[i] & covered[i], gate * lp, 0.0)
            total = total + jnp.sum(tl * weights[i])
        return total

    return jax.grad(loss)(params), covered


def _max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)))


CASES = {  # method -> step config and which model teaches
    "rlsd": (dict(lam=0.5, eps_w=0.5), dict(source="gold_answer"), "policy"),
    "sdpo": (dict(sections={"sdpo": dict(coef=0.7)}), dict(source="sibling"), "policy"),
    "sdpo_advantage": (dict(sections={"sdpo": dict(coef=0.7)}), dict(source="sibling"), "policy"),
    "sdar": (dict(sections={"sdar": dict(coef=0.5, beta=2.0)}), dict(source="skill"), "policy"),
    "sod": (dict(sections={"sod": dict(coef=0.5, tau=0.5)}), dict(source="none", weights="external"), "big"),
}


@pytest.mark.parametrize("method", list(CASES))
def test_fused_step_equals_unfused_reference(setup, tok, method):
    trajs, row_tasks, policy, ref, big = setup
    algo, teacher_kw, who = CASES[method]
    cfg = _cfg(method, **algo, **teacher_kw)
    batch, stats = _batch(cfg, trajs, row_tasks, tok)
    teacher = {"policy": policy, "big": big}[who]
    grads, metrics = _step(cfg, policy, ref, batch, teacher=big if who == "big" else None)
    want, covered = _reference_grads(cfg, policy, teacher, trajs, row_tasks, tok)
    scale = max(jax.tree.leaves(jax.tree.map(lambda x: float(np.abs(np.asarray(x)).max()), want)))
    assert scale > 1e-4
    assert _max_diff(grads, want) < 1e-5 * max(1.0, scale) + 1e-6
    if teacher_kw["source"] == "sibling":  # the gold rollouts have no successful sibling: skipped
        assert 0 < covered.sum() < covered.size and stats["views_skipped"] == 4
    name = {"rlsd": "rlsd/weight_max", "sdpo": "sdpo_kl", "sdpo_advantage": "sdpo/gap_mean", "sdar": "sdar_gate",
            "sod": "sod_weight"}[method]
    assert float(metrics[name]) != 0.0 and np.isfinite(float(metrics[name]))  # the mechanism acted


def test_an_ema_teacher_is_the_parameters_passed_in(setup, tok):
    """teacher.weights='ema': the step scores the views with teacher_params (here the
    reference's weights), not the policy's: the gradient is the reference-teacher reference."""
    trajs, row_tasks, policy, ref, _ = setup
    cfg = _cfg("rlsd", weights="ema", lam=1.0, eps_w=0.5)
    batch, _ = _batch(cfg, trajs, row_tasks, tok)
    grads, _ = _step(cfg, policy, ref, batch, teacher=ref)
    want, _ = _reference_grads(cfg, policy, ref, trajs, row_tasks, tok)
    assert _max_diff(grads, want) < 1e-5
    as_policy, _ = _step(dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, weights="policy")),
                         policy, ref, batch)
    assert _max_diff(grads, as_policy) > 1e-5  # another teacher, another gradient


@pytest.fixture(scope="module")
def grpo_step(setup, tok):
    """The base method's step on the same trajectories (every method here runs over GRPO)."""
    trajs, row_tasks, policy, ref, _ = setup
    base = _cfg("grpo")
    return _step(base, policy, ref, _batch(base, trajs, row_tasks, tok)[0])


@pytest.mark.parametrize("method,zero", [("rlsd", dict(lam=0.0)), ("sdpo", dict(sections={"sdpo": dict(coef=0.0)})),
                                         ("sdpo_advantage", dict(sections={"sdpo": dict(coef=0.0)})),
                                         ("sdar", dict(sections={"sdar": dict(coef=0.0, beta=2.0)})),
                                         ("sod", dict(sections={"sod": dict(coef=0.0, tau=0.5)}))])
def test_coefficient_zero_is_the_base_method(setup, tok, grpo_step, method, zero):
    trajs, row_tasks, policy, ref, big = setup
    algo, teacher_kw, who = CASES[method]
    cfg = _cfg(method, **{**algo, **zero}, **teacher_kw)
    g1, m1 = _step(cfg, policy, ref, _batch(cfg, trajs, row_tasks, tok)[0], teacher=big if who == "big" else None)
    g2, m2 = grpo_step
    assert float(m1["adv_mean"]) == float(m2["adv_mean"]) and float(m1["adv_abs_mean"]) == float(m2["adv_abs_mean"])
    assert _max_diff(g1, g2) < 1e-7


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (tests/conftest.py)")
@pytest.mark.parametrize("method", ["sdpo", "sod"])
def test_sharded_step_equals_unsharded(setup, tok, method):
    """fsdp=2 x tensor=4: the vocabulary-sharded head's top-K (each shard's candidates combined)
    and the student's log-probs at the teacher's ids, and SOD's external teacher sharded like the
    reference, give the unsharded step's update."""
    trajs, row_tasks, policy, ref, big = setup
    algo, teacher_kw, who = CASES[method]
    cfg = _cfg(method, **algo, **teacher_kw)
    batch, _ = _batch(cfg, trajs, row_tasks, tok)
    teacher = big if who == "big" else None
    plain, m0 = _step(cfg, policy, ref, batch, teacher=teacher)
    sharded, m1 = _step(cfg, policy, ref, batch, teacher=teacher, mesh=make_mesh(fsdp=2, tensor=4))
    assert _max_diff(plain, sharded) < 1e-6
    name = {"sdpo": "sdpo_kl", "sod": "sod_weight"}[method]
    assert abs(float(m0[name]) - float(m1[name])) < 1e-6 and float(m0[name]) != 0.0
