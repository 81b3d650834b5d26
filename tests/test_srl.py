"""SRL (methods.srl): the compared action text, the difflib similarity and its step alignment equal
hand-computed values; the registered reward fills the batch's rewards; and a two-stage run (SRL,
then the outcome) trains from a random model, whose rollouts never succeed, with a non-zero
advantage in stage 1 only."""

from __future__ import annotations

import difflib
import json
import pathlib

import numpy as np
import pytest

from turnsight_jax.chat.types import CallError, ToolCall
from turnsight_jax.errors import ConfigError
from turnsight_jax.methods import srl

from _train_runs import run_main

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_action_text_is_sorted_key_json_lines_or_the_answer():
    calls = [ToolCall("lookup", {"b": 2, "a": {"z": 1, "y": [1, 2]}}), CallError("bad JSON", raw='{"name": lookup')]
    assert srl.action_text(calls, None) == ('{"arguments": {"a": {"y": [1, 2], "z": 1}, "b": 2}, "name": "lookup"}\n'
                                            '{"name": lookup')
    assert srl.action_text([], "Paris") == "Paris"
    assert srl.action_text([], None) == ""
    # a gold call (a dict) and the same call parsed from the policy read the same
    assert srl.call_text({"name": "f", "arguments": {"x": "é"}}) == srl.call_text(ToolCall("f", {"x": "é"}))
    assert srl.call_text({"name": "f", "arguments": {"x": "é"}}) == '{"arguments": {"x": "é"}, "name": "f"}'


def test_similarity_hand_values():
    # Ratcliff-Obershelp: 2·M / (|a| + |b|); "abcd" vs "bcde": matching block "bcd", 2·3/8
    assert srl.similarity("abcd", "bcde") == pytest.approx(0.75)
    assert srl.similarity("Paris", "Paris") == 1.0 and srl.similarity("", "") == 1.0
    assert srl.similarity("abc", "") == 0.0
    # autojunk off: in a long text a frequent character is not junked (difflib's default junks
    # characters over 1% of a text of 200+ characters, which would ignore every space here)
    a = "x " * 150 + "tail"
    b = "x " * 150 + "tall"
    assert srl.similarity(a, b) == pytest.approx(difflib.SequenceMatcher(None, a, b, autojunk=False).ratio())
    assert srl.similarity(a, b) > 0.99


def test_steps_align_by_position_and_missing_steps_cost():
    gold = ((({"name": "f", "arguments": {"x": 1}}),), ({"name": "g", "arguments": {"y": 2}},))
    expert = srl.expert_actions(gold, "42")
    assert expert == ['{"arguments": {"x": 1}, "name": "f"}', '{"arguments": {"y": 2}, "name": "g"}', "42"]
    exact = [([ToolCall("f", {"x": 1})], None), ([ToolCall("g", {"y": 2})], None), ([], "42")]
    assert srl.srl_reward(exact, gold, "42") == 1.0
    # the second call's argument off by one character: '{"arguments": {"y": 3}, "name": "g"}' has
    # 36 characters, 35 matching: 2·35/72; the answer missing (the policy stopped): 0
    wrong = [([ToolCall("f", {"x": 1})], None), ([ToolCall("g", {"y": 3})], None)]
    assert srl.step_rewards([srl.action_text(c, a) for c, a in wrong], expert) == pytest.approx([1.0, 70 / 72, 0.0])
    assert srl.srl_reward(wrong, gold, "42") == pytest.approx((1.0 + 70 / 72 + 0.0) / 3)
    # an extra step past the expert's answer scores 0 and lengthens the mean
    longer = exact + [([], "again")]
    assert srl.srl_reward(longer, gold, "42") == pytest.approx(3 / 4)
    # a flat gold chain (one call per step) reads the same
    flat = ({"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"y": 2}})
    assert srl.expert_actions(flat, "42") == expert


def test_registered_reward_fills_the_batch_rewards(tok):
    """Through the method registry and rl.batch.compute_signals, on trajectories of the built-in
    tasks: the gold chain scores 1, a wrong call less, a different answer less again."""
    from turnsight_jax.envs.ftrl import FTRLEnv
    from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
    from turnsight_jax.rl.batch import compute_signals
    from turnsight_jax.rl.config import AlgoConfig, StepConfig
    from turnsight_jax.rl.methods import resolve_method
    from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout

    task = generate_task("multi_hop", 3, SyntheticConfig(hops=2))
    gold = gold_turn_texts(task)
    wrong_call = ['<tool_call>\n{"name": "nope", "arguments": {"x": 1}}\n</tool_call>', gold[-1]]
    wrong_answer = gold[:-1] + ["<answer>not it</answer>"]
    with FTRLEnv(num_workers=1) as env:
        trajs = rollout(ReplayPolicy(tok, [gold, wrong_call, wrong_answer]), env, [task], tokenizer=tok,
                        group_size=3, config=RolloutConfig(max_turns=5, max_response_tokens=2048)).trajectories
    method = resolve_method(StepConfig(algo=AlgoConfig(method="srl"), group_size=3))
    assert [r.name for r in method.rewards] == ["srl"] and method.advantage.name == "grpo"
    got = compute_signals(method, trajs, [task] * 3, StepConfig(group_size=3, max_turns=5))["rewards"]
    want = [srl.srl_reward([(t.calls, t.answer) for t in tr.turns], task.gold_calls, task.answer) for tr in trajs]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[0] == pytest.approx(1.0) and 0.0 < got[1] < got[0] and 0.0 < got[2] < got[0]


@pytest.mark.parametrize("overrides,message", [
    (["--config.rl.switch_step=2"], "rl.switch_step=2 needs rl.switch_method"),
    (["--config.rl.switch_method=grpo"], r"rl.switch_method='grpo' needs rl.switch_step > 0"),
    (["--config.rl.switch_step=2", "--config.rl.switch_method=ppo"], "must train the same learned auxiliaries"),
    (["--config.rl.switch_step=2", "--config.rl.switch_method=nope"], "unknown rl.method 'nope'"),
    (["--config.rl.method=pica", "--config.rl.student_sees_observations=False"], "reads the tool results"),
])
def test_switch_config_errors(overrides, message):
    from turnsight_jax.config import apply_overrides, load_config_file, validate

    cfg = load_config_file(REPO / "configs" / "methods" / "srl.py")
    cfg.rl.switch_step, cfg.rl.switch_method = 0, ""
    apply_overrides(cfg, [o.removeprefix("--config.") for o in overrides])
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


def test_two_stage_run_from_a_random_model(tmp_path):
    """3 steps of configs/methods/srl.py from a random tiny-default model (no warm-start), switching
    to GRPO on the outcome after 2: the random policy never solves a task (outcome 0 throughout),
    yet SRL's similarity reward differs between siblings, so stage 1 has a non-zero advantage and
    an update; stage 2's outcome GRPO has none."""
    args = ["--config", str(REPO / "configs" / "methods" / "srl.py"),
            "--workdir", str(tmp_path / "run"), "--config.model.allow_random_init=True",
            "--config.sft.steps=0", "--config.sft.curriculum_steps=0", "--config.data.num_eval=0",
            "--config.train.steps=3", "--config.rl.switch_step=2", "--config.train.prompts_per_step=2",
            "--config.train.group_size=4", "--config.rollout.max_turns=2", "--config.rollout.max_turn_tokens=24",
            "--config.rollout.max_response_tokens=64", "--config.checkpoint.every=0", "--config.log.tensorboard=False",
            "--config.checkpoint.export_at_end=False"]
    proc = run_main("turnsight_jax.train", *args, timeout=600)  # in the trainer process (tests/_train_runs.py)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "method srl:" in proc.stderr and "from step 3: method grpo:" in proc.stderr
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rl/stage"] for r in recs] == [1.0, 1.0, 2.0]
    assert all(r["rollout/reward_mean"] == 0.0 for r in recs)  # a random model solves nothing
    for r in recs[:2]:  # SRL: similarities in (0, 1), differing within groups
        assert 0.0 < r["train/reward_mean"] < 1.0 and r["train/adv_abs_mean"] > 0.1 and r["train/grad_norm"] > 0
    assert recs[2]["train/reward_mean"] == 0.0 and recs[2]["train/adv_abs_mean"] == 0.0
