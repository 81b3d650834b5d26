"""docs/examples/custom_method.py: the method plug-in API end to end (docs/adding_an_algorithm.md).

The example's settings, reward, advantage and loss term against hand computations; its 2-step
run of `python -m turnsight_jax.train --config <a copy of the file outside the repository>` (the
method changes no file of the package), its trainer hook's tally logged and checkpointed; TurnSight
composed over it; and the guide's code blocks equal to the file.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "custom_method.py"
GUIDE = REPO / "docs" / "adding_an_algorithm.md"


@pytest.fixture(scope="module")
def example():
    """The example module (executing it registers the method; a second load is a no-op)."""
    spec = importlib.util.spec_from_file_location("custom_method_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does (its dataclass resolves its annotations there)
    spec.loader.exec_module(module)
    return module


def _step_config(method: str, base: str = "grpo", **settings):
    """`settings`: the example's rloo_efficient.* values."""
    from turnsight_jax.rl.config import AlgoConfig, StepConfig

    algo = AlgoConfig(method=method, base=base)
    if settings:
        algo = algo.with_section("rloo_efficient", **settings)
    return StepConfig(algo=algo, group_size=2, max_turns=4)


# ---- (a) the pieces, by hand -----------------------------------------------------------------

def rloo_reference(rewards, group_ids):
    """Leave-one-out by explicit loops, float64: r_i - mean of the other members of i's group."""
    out = np.zeros(len(rewards))
    for i, g in enumerate(group_ids):
        others = [rewards[j] for j in range(len(rewards)) if group_ids[j] == g and j != i]
        out[i] = rewards[i] - np.mean(others) if others else 0.0
    return out


def test_rloo_matches_leave_one_out_on_non_contiguous_groups(example):
    from turnsight_jax.rl.advantages import KNOBS, get_estimator, make_advantage_fn

    # 4 groups, siblings scattered: group 0 = rows 0, 3, 6; group 1 = rows 1, 4; group 2 = row 2
    # alone; group 3 = rows 5, 7 with equal rewards; row 8 has an id outside [0, num_groups).
    group_ids = np.array([0, 1, 2, 0, 1, 3, 0, 3, 7], np.int32)
    rewards = np.array([1.0, 0.3, 0.9, 0.0, -0.1, 0.7, 0.5, 0.7, 1.0], np.float32)
    policy_mask = np.random.default_rng(0).random((9, 6)) < 0.6
    want = rloo_reference(rewards.astype(np.float64), group_ids)
    want[8] = 0.0  # ungrouped
    # hand-checked: group 0 -> 1 - 0.25, 0 - 0.75, 0.5 - 0.5; group 1 -> +-0.4
    np.testing.assert_allclose(want[[0, 3, 6, 1, 4]], [0.75, -0.75, 0.0, 0.4, -0.4], atol=1e-12)
    want_tok = np.where(policy_mask, want[:, None], 0.0)

    est = get_estimator("rloo")
    assert est.inputs == ("efficiency_rewards", "group_ids", "policy_mask") and est.knobs == ("num_groups",)
    fn = jax.jit(example.rloo_advantages, static_argnames=("num_groups",))
    got = np.asarray(fn(rewards, group_ids, policy_mask, num_groups=4))
    np.testing.assert_allclose(got, want_tok, atol=1e-6)
    assert np.all(got[2] == 0.0) and np.all(got[[5, 7]] == 0.0) and np.all(got[8] == 0.0)

    # through the registry, as the step calls it (every knob given, the estimator takes its own)
    knobs = {k: None for k in KNOBS} | {"num_groups": 4}
    out = jax.jit(make_advantage_fn("rloo", knobs=knobs))(
        {"efficiency_rewards": rewards, "group_ids": group_ids, "policy_mask": policy_mask})
    np.testing.assert_allclose(np.asarray(out["advantages"]), want_tok, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out["base_advantages"]), want_tok, atol=1e-6)


@pytest.fixture(scope="module")
def replayed(example):
    """Real built-in trajectories from scripted turns: per task, the gold chain, the gold chain
    with one wasted call, and a wrong answer with two wasted calls."""
    from turnsight_jax.assets import default_tokenizer
    from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts, tool_call_text
    from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout
    from turnsight_jax.sources import make_env

    tok = default_tokenizer()
    tasks = [generate_task(c, s, SyntheticConfig(hops=2)) for s, c in enumerate(["single_hop", "multi_hop"])]
    scripts = []
    for task in tasks:
        gold = gold_turn_texts(task)
        call = task.gold_calls[0][0]
        other = next(t["function"]["name"] for t in task.tools if t["function"]["name"] != call["name"])
        wasted = tool_call_text(other, dict(call["arguments"]))
        scripts += [gold, [wasted, *gold], [wasted, wasted, "<answer>nobody</answer>"]]
    with make_env("builtin", num_workers=1) as env:
        res = rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=3,
                      config=RolloutConfig(max_turns=4, max_response_tokens=1024))
    return tok, tasks, res.trajectories


def test_call_efficiency_on_replayed_trajectories(example, replayed):
    from turnsight_jax.rl.methods import REWARDS

    tok, tasks, trajs = replayed
    algo = _step_config("rloo_efficient").algo
    reward = REWARDS["call_efficiency"]
    assert (reward.output, reward.per) == ("efficiency_rewards", "trajectory")
    for k, task in enumerate(tasks):
        gold_n = sum(len(turn) for turn in task.gold_calls)
        gold, one_wasted, two_wasted = trajs[3 * k:3 * k + 3]
        assert [sum(len(t.calls) for t in tr.turns) for tr in (gold, one_wasted, two_wasted)] == [gold_n, gold_n + 1, 2]
        assert gold.reward == 1.0 and reward.fn(gold, task, algo) == 1.0
        assert reward.fn(one_wasted, task, algo) == pytest.approx(one_wasted.reward - 0.1)
        assert reward.fn(two_wasted, task, algo) == pytest.approx(two_wasted.reward - 0.1 * max(2 - gold_n, 0))
    # the knob comes from the rloo_efficient.* section; a task without gold calls is not penalised
    strict = algo.with_section("rloo_efficient", call_penalty=0.5)
    assert reward.fn(trajs[1], tasks[0], strict) == pytest.approx(trajs[1].reward - 0.5)
    assert reward.fn(trajs[1], dataclasses.replace(tasks[0], gold_calls=None), algo) == trajs[1].reward


def test_batch_signals_and_success_nll(example, replayed):
    from turnsight_jax.rl.batch import make_train_batch
    from turnsight_jax.rl.methods import resolve_method

    tok, tasks, trajs = replayed
    cfg = dataclasses.replace(_step_config("rloo_efficient", nll_coef=0.5), group_size=3)
    method = resolve_method(cfg)
    assert [r.name for r in method.rewards] == ["outcome", "call_efficiency"]
    assert [t.name for t in method.loss_terms] == ["clipped_surrogate", "success_nll"]
    assert not method.needs_views and not method.needs_ref
    batch, _ = make_train_batch(trajs, [t for t in tasks for _ in range(3)], tok, cfg, method)
    np.testing.assert_allclose(batch.signals["rewards"], [t.reward for t in trajs])
    np.testing.assert_allclose(batch.signals["efficiency_rewards"],
                               [example.call_efficiency(t, task, cfg.algo) for t, task in
                                zip(trajs, [t for t in tasks for _ in range(3)])], atol=1e-6)

    # the loss term on the batch's arrays, with made-up student log-probs
    lp = -np.random.default_rng(1).random(batch.pol_valid.shape).astype(np.float32)
    x = {"logprobs": jnp.asarray(lp), "rewards": jnp.asarray(batch.signals["rewards"]),
         "pol_valid": jnp.asarray(batch.pol_valid)}
    loss, metrics = jax.jit(lambda x: example.success_nll(x, cfg.loss, cfg.algo))(x)
    solved = (batch.signals["rewards"] >= 1.0)[:, None] & batch.pol_valid
    assert solved.any() and not solved.all()
    np.testing.assert_allclose(np.asarray(metrics["success_nll"]), np.where(solved, -lp, 0.0), atol=1e-6)
    np.testing.assert_allclose(np.asarray(loss), 0.5 * np.where(solved, -lp, 0.0), atol=1e-6)
    # it has a gradient exactly on the solved trajectories' policy tokens
    g = jax.grad(lambda l: jnp.sum(example.success_nll({**x, "logprobs": l}, cfg.loss, cfg.algo)[0]))(x["logprobs"])
    np.testing.assert_allclose(np.asarray(g), np.where(solved, -0.5, 0.0))


def test_registration_is_idempotent(example):
    from turnsight_jax.config import load_config_file
    from turnsight_jax.rl.methods import METHODS

    before = METHODS["rloo_efficient"]
    cfg = load_config_file(EXAMPLE)  # executes the file again, as the trainer does
    assert METHODS["rloo_efficient"] is before and cfg.rl.method == "rloo_efficient"


# ---- (b) the documented run --------------------------------------------------------------------

def _records(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _train(workdir: pathlib.Path, config: pathlib.Path, *overrides: str) -> subprocess.CompletedProcess:
    """The documented command in its own process on one CPU device, as a user runs it (the test
    process fakes 8 devices, which on 2 cores only slows a run down), from the folder holding
    `config`; no held-out evaluation."""
    env = dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS)  # one device (tests/conftest.py)
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "turnsight_jax.train", "--config", str(config), "--workdir",
                           str(workdir), "--config.log.progress=False", "--config.data.num_eval=0", *overrides],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> pathlib.Path:
    """A copy of the example in a folder outside the repository: adding the method takes no file of
    the package."""
    folder = tmp_path_factory.mktemp("my_method")
    shutil.copy(EXAMPLE, folder / "my_method.py")
    assert REPO not in (folder / "my_method.py").resolve().parents
    return folder / "my_method.py"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, outside, example) -> pathlib.Path:
    workdir = tmp_path_factory.mktemp("rloo_efficient")
    proc = _train(workdir, outside, "--config.rloo_efficient.call_penalty=0.2")
    assert "method rloo_efficient: rollout wasted_calls," in proc.stderr
    return workdir


def test_example_trains_two_steps(trained):
    recs = _records(trained)
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        assert math.isfinite(r["train/pg_loss"]), r
        assert "train/success_nll" in r and math.isfinite(r["train/success_nll"]), r
        assert r["train/grad_norm"] > 0, r  # call counts differ between siblings: RLOO has a signal
        assert r["train/adv_abs_mean"] > 0, r
    assert (trained / "sft" / "SFT_DONE").is_file() and not (trained / "export").exists()
    # the section's override reached the run's config
    assert json.loads((trained / "config.json").read_text())["rloo_efficient"] == {"call_penalty": 0.2,
                                                                                    "nll_coef": 0.05}


def test_the_trainer_hook_tallies_every_step_and_checkpoints_its_state(trained):
    """The hook's metrics on each step's line: 2 prompts x 2 rollouts a step tallied, the running
    mean of wasted calls; its file in the final checkpoint (in the verified manifest) holds the tally."""
    from turnsight_jax.checkpointing import check_step

    recs = _records(trained)
    assert [r["rloo_efficient/episodes_tallied"] for r in recs] == [4.0, 8.0]
    assert all(0.0 <= r["rloo_efficient/wasted_calls_per_episode"] < 10 for r in recs)
    saved = json.loads((trained / "checkpoints" / "2" / "wasted_calls.json").read_text())
    assert saved["episodes"] == 8
    assert saved["wasted"] == round(recs[-1]["rloo_efficient/wasted_calls_per_episode"] * 8)
    assert check_step(trained / "checkpoints" / "2") is None


# ---- (c) TurnSight over the new method --------------------------------------------------------

def test_turnsight_over_the_new_method_resolves(example):
    from turnsight_jax.errors import ConfigError
    from turnsight_jax.rl.methods import resolve_method

    m = resolve_method(_step_config("turnsight", base="rloo_efficient"))
    assert m.advantage.name == "turnsight" and m.base.name == "rloo"
    assert [r.name for r in m.rewards] == ["outcome", "call_efficiency"]  # the base method's rewards
    assert [t.name for t in m.loss_terms] == ["clipped_surrogate"]  # TurnSight's own loss terms
    assert m.needs_views and "advantage turnsight(rloo)" in m.describe()
    m_kl = resolve_method(dataclasses.replace(_step_config("rloo_efficient"),
                                              loss=dataclasses.replace(_step_config("grpo").loss, kl_coef=0.1)))
    assert [t.name for t in m_kl.loss_terms] == ["clipped_surrogate", "success_nll", "kl"] and m_kl.needs_ref
    with pytest.raises(ConfigError, match="unknown rl.base"):
        resolve_method(_step_config("turnsight", base="rloo_effcient"))


def test_a_loss_term_reading_advantage_only_arrays_is_refused():
    """delta / base_advantages exist only inside the advantage computation: the step never hands
    them to a loss term, so resolve_method refuses a term that reads one (before compiling)."""
    from turnsight_jax.errors import ConfigError
    from turnsight_jax.rl.losses import LOSS_TERMS, register_loss_term
    from turnsight_jax.rl.methods import METHODS, Method, register_method, resolve_method

    register_loss_term("_reads_delta", ("delta",), ())(lambda x, cfg, algo: (x["delta"][0], {}))
    register_method(Method("_reads_delta", advantage="turnsight", loss_terms=("_reads_delta",)))
    try:
        with pytest.raises(ConfigError, match="loss term '_reads_delta' reads \\['delta'\\]"):
            resolve_method(_step_config("_reads_delta"))
    finally:
        LOSS_TERMS.pop("_reads_delta")
        METHODS.pop("_reads_delta")


def test_rl_rollout_brings_a_controllers_rewards_and_loss_terms_to_any_method(example):
    """rl.rollout runs a registered controller in place of the method's own, and adds the rewards
    and loss terms the controller registered with (issue 24's rollout methods) to GRPO, to
    TurnSight over a base, and to a method with its own terms; an unknown name is refused."""
    from turnsight_jax.errors import ConfigError
    from turnsight_jax.rl.methods import ROLLOUTS, register_rollout, resolve_method, sampler_rollout

    register_rollout("_efficient_sampler", rewards=("call_efficiency",),
                     loss_terms=("success_nll",))(sampler_rollout)
    try:
        def resolved(method, base="grpo", rollout="_efficient_sampler"):
            cfg = _step_config(method, base=base)
            return resolve_method(dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, rollout=rollout)))

        grpo = resolved("grpo")
        assert grpo.rollout.name == "_efficient_sampler" and grpo.advantage.name == "grpo"
        assert [r.name for r in grpo.rewards] == ["outcome", "call_efficiency"]
        assert [t.name for t in grpo.loss_terms] == ["clipped_surrogate", "success_nll"]
        ts = resolved("turnsight", base="matchtir")
        assert ts.rollout.name == "_efficient_sampler" and (ts.advantage.name, ts.base.name) == ("turnsight", "matchtir")
        assert [r.name for r in ts.rewards] == ["outcome", "matchtir_turns", "call_efficiency"]
        assert [t.name for t in ts.loss_terms] == ["clipped_surrogate", "success_nll"]
        own = resolved("rloo_efficient")  # the term is the method's already: listed once
        assert [t.name for t in own.loss_terms] == ["clipped_surrogate", "success_nll"]
        assert resolved("grpo", rollout="").rollout.name == "sampler"
        with pytest.raises(ConfigError, match="rl.rollout: unknown rollout controller '_nope'"):
            resolved("grpo", rollout="_nope")
    finally:
        ROLLOUTS.pop("_efficient_sampler")


def test_turnsight_over_the_new_method_trains_a_step(trained, tmp_path):
    shutil.copytree(trained / "sft", tmp_path / "sft")  # the same warm-start, reused
    _train(tmp_path, EXAMPLE, "--config.rl.method=turnsight", "--config.rl.base=rloo_efficient",
           "--config.train.steps=1")
    (rec,) = _records(tmp_path)
    assert math.isfinite(rec["train/pg_loss"]) and rec["train/grad_norm"] > 0, rec
    assert "train/success_nll" not in rec  # TurnSight's loss terms, not the base method's
    assert 0.5 <= rec["turnsight/weight_min"] <= rec["turnsight/weight_max"] <= 1.5, rec


# ---- the guide shows this file -------------------------------------------------------------------

def test_guide_code_blocks_mirror_the_example():
    """The ```python blocks of the guide marked `<!-- custom_method.py -->` are, joined, the file."""
    text = GUIDE.read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- custom_method\.py -->\n```python\n(.*?)```", text, flags=re.S)
    assert blocks, "the guide embeds docs/examples/custom_method.py in marked ```python blocks"
    assert "".join(blocks) == EXAMPLE.read_text(encoding="utf-8")
