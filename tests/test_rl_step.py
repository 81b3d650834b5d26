"""The fused train step against an unfused reference; sharding, micro-batching, λ = 0, config errors."""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from turnsight_jax.rl import advantages as adv_lib
from turnsight_jax.rl.batch import make_train_batch
from turnsight_jax.chat.hindsight import teacher_view_ids
from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import init_model
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout
from turnsight_jax.errors import ConfigError
from turnsight_jax.models.sharding import make_mesh, state_shardings
from turnsight_jax.rl.batch import shard_batch
from turnsight_jax.rl.config import AlgoConfig, LossConfig, StepConfig
from turnsight_jax.rl.losses import aggregation_weights, clipped_surrogate, kl_penalty
from turnsight_jax.rl.methods import resolve_method
from turnsight_jax.rl.step import make_train_step

from _vocab import SMALL_VOCAB, fold, fold_batch
from conftest import OPTIMIZED

CFG = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
G = 2


_SETUP: dict = {}


@pytest.fixture(scope="module")
def setup(tok):
    """8 real trajectories (4 groups of 2) with varied rewards, and old log-probs near the model's.

    Built once per test process: the nine files that import this fixture share one value (and so
    the memoised steps of _sgd_step); callers treat it as read-only."""
    if not _SETUP:
        _SETUP["value"] = _build_setup(tok)
    return _SETUP["value"]


def _build_setup(tok):
    tasks = [generate_task(c, s, SyntheticConfig(hops=2)) for s, c in
             enumerate(["multi_hop", "single_hop", "parallel_single_hop", "multi_hop"])]
    scripts = []
    for t in tasks:
        gold = gold_turn_texts(t)
        scripts.append(gold)
        scripts.append(['<tool_call>\n{"name": "nope", "arguments": {"x": 1}}\n</tool_call>', "<answer>no</answer>"])
    with FTRLEnv(num_workers=1) as env:
        trajs = rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=G,
                        config=RolloutConfig(max_turns=5, max_response_tokens=2048)).trajectories
    policy = init_model(CFG, seed=0)
    ref = init_model(CFG, seed=1)  # a different reference so δ is not ~0
    rng = np.random.default_rng(0)
    graphdef, params = nnx.split(policy)
    own = plain_logprobs(graphdef, params, [t.tokens for t in trajs], [np.arange(t.length - 1) for t in trajs],
                         [t.tokens[1:] for t in trajs])
    for t, lp in zip(trajs, own):  # old log-probs: the policy's own, perturbed so some ratios clip
        lp = np.concatenate([[0.0], np.asarray(lp)])
        t.old_logprobs = np.where(t.policy_mask, lp + rng.normal(0, 0.3, t.length), 0).astype(np.float32)
    row_tasks = [tasks[i // G] for i in range(len(trajs))]
    return trajs, row_tasks, policy, ref


def _batch(trajs, row_tasks, tok, cfg):
    batch, _ = make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg))
    return fold_batch(batch)


def _cfg(**algo):
    return StepConfig(algo=AlgoConfig(**algo), loss=LossConfig(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05,
                                                                kl_estimator="k3"),
                      group_size=G, max_turns=5, logprob_chunk=64)


def _digest(tree) -> str:
    """A content hash of a pytree of arrays (shapes, dtypes and bytes)."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        a = np.asarray(leaf)
        h.update(f"{a.shape}{a.dtype}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


# (grads, metrics) of every fused step this test process ran, by everything the step reads: a
# baseline ("the step without option X") that several tests and files compare against is
# compiled and run once per worker, not once per comparison. Callers treat the results as
# read-only.
_STEP_MEMO: dict = {}


def _sgd_step(cfg, policy, ref, batch, mesh=None, records=False):
    """Run the fused step with SGD(lr=1): the update is exactly -grad (memoised, see _STEP_MEMO)."""
    graphdef, params = nnx.split(policy)
    _, ref_params = nnx.split(ref)
    mesh_key = None if mesh is None else (tuple(mesh.shape.items()), tuple(d.id for d in mesh.devices.flat))
    key = (cfg, graphdef, _digest(params), _digest(ref_params), _digest(batch), str(jax.tree.structure(batch)), mesh_key,
           records)
    if key not in _STEP_MEMO:
        _STEP_MEMO[key] = _run_sgd_step(cfg, graphdef, params, ref_params, batch, mesh, records)
    return _STEP_MEMO[key]


def _run_sgd_step(cfg, graphdef, params, ref_params, batch, mesh, records):
    opt = optax.sgd(1.0)
    step = make_train_step(graphdef, cfg, opt, records=records)
    if mesh is not None:
        params = jax.device_put(params, state_shardings(params, mesh))
        ref_params = jax.device_put(ref_params, state_shardings(ref_params, mesh))
        batch = shard_batch(batch, mesh)
        with jax.set_mesh(mesh):
            opt_state = opt.init(params)
            before = jax.tree.map(np.asarray, params)
            new, _, metrics = step(params, opt_state, ref_params, batch)
    else:
        batch = jax.tree.map(jnp.asarray, batch)
        before = jax.tree.map(np.asarray, params)
        new, _, metrics = step(params, opt.init(params), ref_params, batch)
    grads = jax.tree.map(lambda a, b: a - np.asarray(b), before, new)
    return grads, metrics


def _score_rows(graphdef, params, x, m, pred, target):
    """x, m [R, W]; pred, target [R, P] -> [R, P] log-probs: an explicit log_softmax of the logits
    at the positions that predict the targets, on right-padded causal rows."""
    model = nnx.merge(graphdef, params)
    h = model.hidden_states(x, Layout.causal(m))
    logits = model.logits(jnp.take_along_axis(h, pred[..., None], axis=1))
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), target[..., None], -1)[..., 0]


# Run many times on 2,048-wide rows: compiled at full optimisation (tests/conftest.py OPTIMIZED).
_score = jax.jit(_score_rows, static_argnums=0, compiler_options=OPTIMIZED)


def plain_logprobs(graphdef, params, seqs, preds, targets, width=None, rows=None, most=None):
    """seqs: token lists; preds/targets: index lists per sequence -> list of log-prob arrays.

    Each sequence is its own right-padded row (ids folded, tests/_vocab.py), padded to `rows`
    rows of `most` scored positions and `width` tokens (default: the longest rounded up to 256,
    so a few shapes serve every call): one compiled program per shape, not op-by-op dispatch."""
    width = width or -(-max(len(sq) for sq in seqs) // 256) * 256
    rows = rows or len(seqs)
    most = most or max(len(p) for p in preds)
    x = np.zeros((rows, width), np.int32)
    m = np.zeros((rows, width), bool)
    pred = np.zeros((rows, most), np.int32)
    target = np.zeros((rows, most), np.int32)
    for r, sq in enumerate(seqs):
        x[r, : len(sq)] = fold(sq)
        m[r, : len(sq)] = True
        pred[r, : len(preds[r])] = preds[r]
        target[r, : len(preds[r])] = fold(targets[r])
    traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(params))
    out = (_score_rows if traced else _score)(graphdef, params, x, m, pred, target)
    if not traced:  # concrete: slice on the host, not op by op
        out = np.asarray(out)
    return [out[r, : len(preds[r])] for r in range(len(seqs))]


def _reference_grads(cfg, policy, ref, trajs, answers, tok, out=None):
    """Teacher on explicit plain views, advantages and the loss in plain code (no packing).

    Each (turn, depth) view is its own right-padded sequence; log-probs are an explicit
    log_softmax of the logits at the positions that predict policy tokens. `out` (a dict, when
    given) receives the teacher's log-probs [D, B, N] and the policy mask [B, N]."""
    a = cfg.algo
    b = len(trajs)
    n = max(int(t.policy_mask.sum()) for t in trajs)
    pol = [np.flatnonzero(t.policy_mask) for t in trajs]
    mask = np.zeros((b, n), bool)
    turn_ids = np.full((b, n), -1, np.int32)
    old = np.zeros((b, n), np.float32)
    for i, t in enumerate(trajs):
        c = len(pol[i])
        mask[i, :c] = True
        turn_ids[i, :c] = t.turn_ids[pol[i]]
        old[i, :c] = t.old_logprobs[pol[i]]

    # reference log-probs on the student's context (for the KL term)
    ref_lp = np.zeros((b, n), np.float32)
    ref_graphdef, ref_params = nnx.split(ref)
    for i, lp in enumerate(plain_logprobs(ref_graphdef, ref_params, [t.tokens for t in trajs], [p - 1 for p in pol],
                                          [t.tokens[p] for t, p in zip(trajs, pol)])):
        ref_lp[i, : len(pol[i])] = np.asarray(lp)
    # teacher on every (turn, depth) view built explicitly
    teacher = np.zeros((len(a.depths), b, n), np.float32)
    cases = []
    for i, t in enumerate(trajs):
        for k, turn in enumerate(t.turns):
            for di, d in enumerate(a.depths):
                seq = teacher_view_ids(tok, t, k, d, max_depth=max(a.depths), source=a.source, gold_answer=answers[i])
                cases.append((i, turn, di, seq))
    most = max(turn.policy_end - turn.policy_start for _, turn, _, _ in cases)
    for c0 in range(0, len(cases), 16):
        chunk = cases[c0:c0 + 16]
        ms = [turn.policy_end - turn.policy_start for _, turn, _, _ in chunk]
        lps = plain_logprobs(ref_graphdef, ref_params, [c[3] for c in chunk],
                             [np.arange(len(c[3]) - m - 1, len(c[3]) - 1) for c, m in zip(chunk, ms)],
                             [np.asarray(c[3][len(c[3]) - m:]) for c, m in zip(chunk, ms)], rows=16, most=most)
        for (i, turn, di, _), lp in zip(chunk, lps):
            j = np.searchsorted(pol[i], np.arange(turn.policy_start, turn.policy_end))
            teacher[di, i, j] = np.asarray(lp)

    group_ids = np.repeat(np.arange(b // G), G).astype(np.int32)
    rewards = np.array([t.reward for t in trajs], np.float32)
    base = jax.jit(adv_lib.grpo_advantages, static_argnames="num_groups")(rewards, group_ids, mask, num_groups=b // G)
    adv = base
    if a.method == "turnsight":
        adv = jax.jit(adv_lib.turnsight_advantages, static_argnames=("lam", "eps_w", "num_groups", "max_turns"))(
            teacher - old[None], mask, turn_ids, group_ids, base, lam=a.lam, eps_w=a.eps_w, num_groups=b // G,
            max_turns=cfg.max_turns)["advantages"]
    if out is not None:
        out.update(teacher=teacher, mask=mask)
    weights = aggregation_weights(jnp.asarray(mask), cfg.loss.aggregation)
    graphdef, params = nnx.split(policy)

    def loss(params):
        lps = plain_logprobs(graphdef, params, [t.tokens for t in trajs], [p - 1 for p in pol],
                             [t.tokens[p] for t, p in zip(trajs, pol)])
        total = 0.0
        for i, lp in enumerate(lps):
            lp_pol = jnp.zeros(n).at[: len(pol[i])].set(lp)
            tl = clipped_surrogate(lp_pol, old[i], adv[i], cfg.loss)[0]
            tl = tl + cfg.loss.kl_coef * kl_penalty(lp_pol, ref_lp[i], cfg.loss.kl_estimator)
            total = total + jnp.sum(tl * weights[i])
        return total

    return jax.jit(jax.grad(loss))(params)


def _max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()), a, b)))


def test_fused_step_equals_unfused_reference(setup, tok):
    trajs, row_tasks, policy, ref = setup
    cfg = dataclasses.replace(_cfg(method="turnsight", depths=(1, 2, 3)), record_teacher=True)
    batch = _batch(trajs, row_tasks, tok, cfg)
    grads, metrics = _sgd_step(cfg, policy, ref, batch, records=True)
    got = {}
    want = _reference_grads(cfg, policy, ref, trajs, [t.answer for t in row_tasks], tok, out=got)
    scale = max(jax.tree.leaves(jax.tree.map(lambda x: float(np.abs(np.asarray(x)).max()), want)))
    assert scale > 1e-4  # a real gradient
    assert _max_diff(grads, want) < 1e-5 * max(1.0, scale) + 1e-6
    assert 0.0 < float(metrics["clip_frac"]) < 1.0  # the perturbation made some ratios clip
    # log.turn_records' token log-probs (StepConfig.record_teacher) are the teacher's on the
    # explicit views: the step's own arrays, returned with its records
    mask = got["mask"]
    packed = np.asarray(metrics["records"]["teacher_logprobs"])[:, :, :mask.shape[1]]  # N is bucketed
    np.testing.assert_allclose(packed[:, mask], got["teacher"][:, mask], atol=1e-5)


def test_micro_batched_equals_full_batch(setup, tok):
    trajs, row_tasks, policy, ref = setup
    cfg = _cfg(method="turnsight")
    batch = _batch(trajs, row_tasks, tok, cfg)
    full, _ = _sgd_step(cfg, policy, ref, batch)
    micro, _ = _sgd_step(dataclasses.replace(cfg, micro_batches=4, teacher_micro_batches=2), policy, ref, batch)
    assert _max_diff(full, micro) < 1e-6
    # the no-gradient forwards (teacher views, KL reference) in head chunks of 8 rows, not 64
    scored, m_scored = _sgd_step(dataclasses.replace(cfg, score_chunk=8), policy, ref, batch)
    assert _max_diff(full, scored) < 1e-6 and np.isfinite(float(m_scored["pg_loss"]))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 fake devices (tests/conftest.py)")
@pytest.mark.parametrize("fsdp,tensor", [(2, 4)])  # both axes split; (4, 2) adds nothing new
def test_sharded_step_equals_unsharded(setup, tok, fsdp, tensor):
    """The sharded step runs its batch in two length classes laid out for the mesh's row shards
    (rl.length_classes; each class's gather stays on its devices): it equals the unsharded step
    on the plain batch."""
    trajs, row_tasks, policy, ref = setup
    cfg = _cfg(method="turnsight")
    plain, m0 = _sgd_step(cfg, policy, ref, _batch(trajs, row_tasks, tok, cfg))
    classed = dataclasses.replace(cfg, length_classes=2)
    batch, _ = make_train_batch(trajs, row_tasks, tok, classed, resolve_method(classed), row_shards=fsdp)
    sharded, m1 = _sgd_step(classed, policy, ref, fold_batch(batch), mesh=make_mesh(fsdp=fsdp, tensor=tensor))
    assert _max_diff(plain, sharded) < 1e-6
    assert abs(float(m0["pg_loss"]) - float(m1["pg_loss"])) < 1e-6


@pytest.mark.parametrize("mesh", [None, "fsdp2_tensor4"])
def test_vocab_blocks_equal_the_whole_vocabulary(setup, tok, mesh):
    """The policy and reference with model.vocab_block = 96 (the 1,024-token head in 10 blocks
    and a remainder; 256 columns per device on the tensor-4 mesh: 2 blocks and a remainder): the
    fused step's gradients and loss equal the whole-vocabulary step's."""
    if mesh and jax.device_count() < 8:
        pytest.skip("needs 8 fake devices (tests/conftest.py)")
    trajs, row_tasks, policy, ref = setup
    cfg = _cfg(method="turnsight")
    batch = _batch(trajs, row_tasks, tok, cfg)
    whole, m0 = _sgd_step(cfg, policy, ref, batch)
    blocked_policy = nnx.merge(*_with_options(policy, vocab_block=96))
    blocked, m1 = _sgd_step(cfg, blocked_policy, ref, batch, mesh=mesh and make_mesh(fsdp=2, tensor=4))
    scale = max(jax.tree.leaves(jax.tree.map(lambda x: float(np.abs(np.asarray(x)).max()), whole)))
    assert scale > 1e-4 and _max_diff(whole, blocked) < 1e-6 * max(1.0, scale)
    assert abs(float(m0["pg_loss"]) - float(m1["pg_loss"])) < 1e-6


def _with_options(model, **options):
    """(graphdef, params) of `model` with other runtime options: the same weights."""
    fresh = init_model(model.config, seed=0, options=dataclasses.replace(model.options, **options))
    graphdef, _ = nnx.split(fresh)
    return graphdef, nnx.split(model)[1]


def test_lambda_zero_equals_base_algorithm(setup, tok):
    trajs, row_tasks, policy, ref = setup
    ts = _cfg(method="turnsight", lam=0.0)
    base = _cfg(method="grpo")
    b1 = _batch(trajs, row_tasks, tok, ts)
    b2 = _batch(trajs, row_tasks, tok, base)
    g1, m1 = _sgd_step(ts, policy, ref, b1)
    g2, m2 = _sgd_step(base, policy, ref, b2)
    # identical advantages, bit for bit; the update then differs only by XLA's summation order
    # in two differently fused programs
    assert float(m1["adv_mean"]) == float(m2["adv_mean"]) and float(m1["adv_abs_mean"]) == float(m2["adv_abs_mean"])
    assert float(m1["weight_min"]) != 1.0 or float(m1["weight_max"]) != 1.0  # TurnSight weights were active
    assert _max_diff(g1, g2) < 1e-7


def test_a_non_finite_gradient_skips_the_update(setup, tok):
    """One NaN old log-prob makes the loss and every gradient NaN: the step returns the parameters
    and optimizer state it was given, bit for bit, and counts the skipped update; the same step on
    the clean batch updates and counts none."""
    trajs, row_tasks, policy, ref = setup
    cfg = dataclasses.replace(_cfg(method="grpo"), loss=LossConfig(kl_coef=0.0))
    batch = _batch(trajs, row_tasks, tok, cfg)
    old = np.array(batch.old_logprobs, copy=True)
    old[tuple(np.argwhere(np.asarray(batch.pol_valid))[3])] = np.nan
    graphdef, params = nnx.split(policy)
    _, ref_params = nnx.split(ref)
    opt = optax.adamw(1e-2)
    step = make_train_step(graphdef, cfg, opt)
    copy = lambda tree: jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
    opt_state = opt.init(params)
    opt_state = step(copy(params), opt_state, ref_params, jax.tree.map(jnp.asarray, batch))[1]  # a real moment
    before = jax.tree.map(np.asarray, (params, opt_state))
    new, new_opt, m = step(copy(params), copy(opt_state), ref_params, jax.tree.map(jnp.asarray, batch.replace(old_logprobs=old)))
    assert float(m["skipped_updates"]) == 1.0 and not np.isfinite(float(m["grad_norm"]))
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.tree.map(np.asarray, (new, new_opt)))):
        np.testing.assert_array_equal(a, b)
    clean, _, m = step(copy(params), copy(opt_state), ref_params, jax.tree.map(jnp.asarray, batch))
    assert float(m["skipped_updates"]) == 0.0
    assert _max_diff(jax.tree.map(np.asarray, clean), before[0]) > 0


def test_reference_unused_without_views_or_kl(setup, tok):
    """GRPO with kl_coef = 0 never runs the reference: NaN reference weights change nothing."""
    trajs, row_tasks, policy, ref = setup
    cfg = dataclasses.replace(_cfg(method="grpo"), loss=LossConfig(kl_coef=0.0))
    batch = _batch(trajs, row_tasks, tok, cfg)
    assert batch.views is None
    graphdef, state = nnx.split(init_model(CFG, seed=1))
    nan_ref = nnx.merge(graphdef, jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), state))
    g1, m1 = _sgd_step(cfg, policy, ref, batch)
    g2, m2 = _sgd_step(cfg, policy, nan_ref, batch)
    assert _max_diff(g1, g2) == 0.0 and np.isfinite(float(m2["pg_loss"]))


@pytest.mark.parametrize("change,message", [
    (dict(algo=AlgoConfig(method="dpo")), "unknown rl.method 'dpo'"),
    (dict(algo=AlgoConfig(depths=())), "depths is empty"),
    (dict(algo=AlgoConfig(eps_w=1.0)), "eps_w must be in"),
    (dict(group_size=3), "not divisible by group_size 3"),
    (dict(loss=LossConfig(aggregation="mean")), "loss.aggregation 'mean' unknown"),
    (dict(score_chunk=-1), "train.score_chunk >= 0"),
])
def test_invalid_configs_fail_with_one_line(change, message):
    cfg = dataclasses.replace(StepConfig(group_size=2), **change)
    with pytest.raises(ConfigError, match=message) as e:
        cfg.validate(batch_size=8)
        resolve_method(cfg)
    assert "\n" not in str(e.value)


# ---- rl.student_sees_observations=False: the released code's masked training forward ----

def _masked_cfg(**kw):
    cfg = _cfg(method="turnsight", student_sees_observations=False)
    return dataclasses.replace(cfg, **kw)


def test_masked_batch_reads_prompt_and_policy_tokens_only(setup, tok):
    trajs, row_tasks, _, _ = setup
    batch = _batch(trajs, row_tasks, tok, _masked_cfg())
    for i, t in enumerate(trajs):
        want = np.zeros(batch.valid.shape[1], bool)
        want[: t.prompt_len] = True  # the prompt, its assistant header included
        for turn in t.turns:
            want[turn.policy_start:turn.policy_end] = True  # each turn's sampled tokens; not the observations
        np.testing.assert_array_equal(batch.valid[i], want)
        assert batch.valid[i].sum() < t.length  # every trajectory here has an observation to drop
    # the packed views keep no reference row: the KL reference is scored on the masked context
    assert batch.views.view_pred.shape[0] == len(_masked_cfg().algo.depths)


def test_masked_step_ratio_and_kl_use_the_masked_context(setup, tok):
    """With observation masking the ratio compares π_θ with π_old on the same masked context (not
    with the sampler's log-probs, which saw the observations and are perturbed here by N(0, 0.3)),
    and the KL reference reads that context too (the views carry no reference row). Checked with
    lr = 0 (every update sees the step-start parameters) and the policy as its own reference:
    ratio 1 and KL 0. TurnSight with two mini-batches: π_old comes from a forward before the
    updates. (One update per step, where π_old is the update's own forward, is checked below.)"""
    trajs, row_tasks, policy, _ = setup
    graphdef, params = nnx.split(policy)
    cfg = _masked_cfg(mini_batches=2)
    batch = jax.tree.map(jnp.asarray, _batch(trajs, row_tasks, tok, cfg))
    opt = optax.sgd(0.0)
    _, _, m = make_train_step(graphdef, cfg, opt)(jax.tree.map(jnp.copy, params), opt.init(params), params, batch)
    assert abs(float(m["ratio"]) - 1.0) < 1e-5 and float(m["clip_frac"]) == 0.0
    assert abs(float(m["kl"])) < 1e-6


def test_entropy_bonus_in_the_masked_step(setup, tok):
    """loss.entropy_coef adds the entropy term: its metric is the aggregated student entropy and its
    gradient is -coef · ∇(aggregated entropy) (the loss falls as the entropy rises). Equal rewards
    make every GRPO advantage 0, so the surrogate adds no gradient; the policy is its own KL
    reference, so k3 and its gradient are 0. Under observation masking with one update, π_old is
    the update's own forward: ratio 1 although the batch's old log-probs are perturbed."""
    trajs, row_tasks, policy, _ = setup
    coef = 50.0  # large, so the gradient stands well above the float32 rounding of before - after (~1e-7)
    cfg = dataclasses.replace(_cfg(method="grpo", student_sees_observations=False),
                              loss=LossConfig(kl_coef=0.05, kl_estimator="k3", entropy_coef=coef))
    batch = _batch(trajs, row_tasks, tok, cfg)
    batch.signals["rewards"][:] = 1.0
    graphdef, params = nnx.split(policy)
    same = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))  # the policy as reference, in its own buffers (donation)
    grads, metrics = _sgd_step(cfg, policy, same, batch)
    assert abs(float(metrics["ratio"]) - 1.0) < 1e-5 and abs(float(metrics["kl"])) < 1e-6
    assert float(metrics["adv_abs_mean"]) == 0.0
    from turnsight_jax.rl.logprobs import student_logprobs

    w = aggregation_weights(jnp.asarray(batch.pol_valid), cfg.loss.aggregation)

    def agg_entropy(p):
        _, ent = student_logprobs(nnx.merge(graphdef, p), jnp.asarray(batch.tokens), jnp.asarray(batch.valid),
                                  jnp.asarray(batch.pol_pos), chunk=64, with_entropy=True)
        return jnp.sum(ent * w)

    h, dh = jax.value_and_grad(agg_entropy)(params)
    assert float(metrics["entropy"]) == pytest.approx(float(h), rel=1e-5) and float(h) > 1.0
    want = jax.tree.map(lambda d: -coef * np.asarray(d), dh)  # _sgd_step returns before - after = grad
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(want))
    assert scale > 1e-2 and _max_diff(grads, want) < 1e-5 * scale + 2e-7
