"""GRPO, MatchTIR and TurnSight give the losses, gradients and metrics recorded before the `rl/`
refactor (commit 33aca61, `tests/data/pinned_step_33aca61.json`), on a fixed batch.

The batch: 4 built-in tasks x 2 replayed siblings (one gold, one partly right or wrong, so MatchTIR
turn rewards are neither all 1 nor all 0), a random policy and a different random reference, old
log-probs perturbed so some ratios clip, KL k3 at 0.05. One fused step with SGD(lr=1), so the
update is exactly -grad. The recording script ran the same construction through the old API
(`train_step.make_train_step`, `batching.make_train_batch` with the driver's MatchTIR rewards).
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import init_model
from turnsight_jax.rl.batch import make_train_batch
from turnsight_jax.rl.logprobs import logprobs_at
from turnsight_jax.rl.config import AlgoConfig, LossConfig, StepConfig
from turnsight_jax.rl.methods import resolve_method
from turnsight_jax.rl.step import make_train_step
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout

PINNED = json.loads((pathlib.Path(__file__).parent / "data" / "pinned_step_33aca61.json").read_text())
CFG = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
G = 2


def _cfg(micro=1, mini=1, **algo):
    return StepConfig(algo=AlgoConfig(**algo), loss=LossConfig(clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05,
                      kl_estimator="k3"), group_size=G, max_turns=5, logprob_chunk=64,
                      micro_batches=micro, mini_batches=mini)


CASES = {
    "grpo": _cfg(method="grpo"),
    "matchtir": _cfg(method="matchtir"),
    "turnsight_grpo": _cfg(method="turnsight", base="grpo"),
    "turnsight_matchtir": _cfg(method="turnsight", base="matchtir"),
    "turnsight_matchtir_mini2_micro2": _cfg(method="turnsight", base="matchtir", micro=2, mini=2),
}


def _own_logprobs(policy, trajs):
    """The policy's log-prob of every token given its prefix, [0] first: one compiled forward of
    the right-padded rows (causal, so padding changes nothing), the vocabulary in chunks. Rows are
    padded to the longest trajectory rounded up to 128 (512 here: 4x less work than 2,048)."""
    graphdef, params = nnx.split(policy)
    width = -(-max(t.length for t in trajs) // 128) * 128

    @jax.jit
    def score(params, x, m):
        model = nnx.merge(graphdef, params)
        hidden = model.hidden_states(x, Layout.causal(m))
        pred = jnp.broadcast_to(jnp.arange(width - 1), (x.shape[0], width - 1))
        return logprobs_at(model, hidden, pred, x[:, 1:], chunk=128)

    x = np.zeros((len(trajs), width), np.int32)
    m = np.zeros((len(trajs), width), bool)
    for r, t in enumerate(trajs):
        x[r, : t.length], m[r, : t.length] = t.tokens, True
    lp = np.asarray(score(params, x, m))
    return [np.concatenate([[0.0], lp[r, : t.length - 1]]) for r, t in enumerate(trajs)]


@pytest.fixture(scope="module")
def setup(tok):
    tasks = [generate_task(c, s, SyntheticConfig(hops=2)) for s, c in
             enumerate(["multi_hop", "single_hop", "parallel_single_hop", "multi_hop"])]
    scripts = []
    for i, t in enumerate(tasks):
        gold = gold_turn_texts(t)
        scripts.append(gold)
        scripts.append([gold[0], "<answer>no</answer>"] if i % 2 == 0 else
                       ['<tool_call>\n{"name": "nope", "arguments": {"x": 1}}\n</tool_call>', "<answer>no</answer>"])
    with FTRLEnv(num_workers=1) as env:
        trajs = rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=G,
                        config=RolloutConfig(max_turns=5, max_response_tokens=2048)).trajectories
    policy = init_model(CFG, seed=0)
    ref = init_model(CFG, seed=1)
    rng = np.random.default_rng(0)
    own = _own_logprobs(policy, trajs)
    for t, lp in zip(trajs, own):
        t.old_logprobs = np.where(t.policy_mask, lp + rng.normal(0, 0.3, t.length), 0).astype(np.float32)
    return tok, trajs, [tasks[i // G] for i in range(len(trajs))], policy, ref


def test_the_fixed_batch_is_the_recorded_one(setup):
    _, trajs, row_tasks, _, _ = setup
    want = PINNED["trajectories"]
    assert [t.length for t in trajs] == want["lengths"]
    assert [t.reward for t in trajs] == pytest.approx(want["rewards"])
    batch, _ = make_train_batch(trajs, row_tasks, setup[0], CASES["matchtir"], resolve_method(CASES["matchtir"]))
    turn_rewards = [list(batch.signals["turn_rewards"][i, :t.num_turns]) for i, t in enumerate(trajs)]
    assert turn_rewards == [pytest.approx(r) for r in want["turn_rewards"]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_step_matches_numbers_recorded_before_the_refactor(setup, name):
    tok, trajs, row_tasks, policy, ref = setup
    cfg = CASES[name]
    method = resolve_method(cfg)
    batch, _ = make_train_batch(trajs, row_tasks, tok, cfg, method)
    graphdef, params = nnx.split(policy)
    _, ref_params = nnx.split(ref)
    opt = optax.sgd(1.0)
    step = make_train_step(graphdef, cfg, opt, method)
    before = jax.tree.map(np.asarray, params)
    new, _, metrics = step(params, opt.init(params), ref_params, jax.tree.map(jnp.asarray, batch))
    grads = jax.tree.map(lambda a, b: a - np.asarray(b), before, new)
    want = PINNED[name]
    metrics = jax.device_get(metrics)
    for key, value in want["metrics"].items():
        np.testing.assert_allclose(np.asarray(metrics[key], np.float64), value, rtol=2e-5, atol=1e-7, err_msg=key)
    flat = {jax.tree_util.keystr(p): np.asarray(g, np.float64) for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    assert set(flat) == set(want["grads"])
    for key, g in flat.items():
        w = want["grads"][key]
        # rtol per element, plus float32 summation-order noise relative to the leaf's largest entry
        # (XLA's fusion, hence the order, differs between optimisation levels and versions)
        np.testing.assert_allclose(g.reshape(-1)[:8], w["first"], rtol=1e-4,
                                   atol=1e-9 + 2e-4 * np.abs(w["first"]).max(), err_msg=key)
        np.testing.assert_allclose([np.abs(g).sum(), (g * g).sum()], [w["abs_sum"], w["sq_sum"]], rtol=1e-4,
                                   atol=1e-12, err_msg=key)
    assert want["metrics"]["grad_norm"] > 0.1  # a real gradient
