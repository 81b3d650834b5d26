"""The multi-turn driver: a scripted 10-turn rollout through the real sampler, parser and
environment, checked token by token against the environment's own record."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from turnsight_jax.chat import template as tmpl
from turnsight_jax.chat.types import ToolCall
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_tool_calls, gold_turn_texts
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import init_model
from turnsight_jax.rollout.driver import ModelPolicy, ReplayPolicy, RolloutConfig, rollout
from turnsight_jax.rollout.sampler import SamplingParams

TINY = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=16)


def _check_against_env(traj, task, tok, env):
    """Masks, turn ids, calls and observations equal the environment's own execution."""
    gold_texts = gold_turn_texts(task)
    assert traj.num_turns == len(gold_texts)
    ep = env.start(task, seed=0)
    for k, turn in enumerate(traj.turns):
        policy_ids = traj.tokens[turn.policy_start:turn.policy_end]
        assert tok.decode(policy_ids) == gold_texts[k] + "<|im_end|>"
        assert np.all(traj.policy_mask[turn.policy_start:turn.policy_end])
        assert np.all(traj.turn_ids[turn.policy_start:turn.policy_end] == k)
        if k < len(gold_texts) - 1:
            want_calls = gold_tool_calls(task)[k]
            assert [(c.name, c.arguments) for c in turn.calls] == [(c.name, c.arguments) for c in want_calls]
            step = ep.step([ToolCall(c.name, c.arguments) for c in want_calls])
            assert list(turn.results) == list(step.observations)
            obs_ids = traj.tokens[turn.obs_start:turn.obs_end]
            assert tok.decode(obs_ids) == tmpl.observation_suffix(list(step.observations), enable_thinking=False)
            assert not traj.policy_mask[turn.obs_start:turn.obs_end].any()
            assert np.all(traj.turn_ids[turn.obs_start:turn.obs_end] == -1)
        else:
            assert turn.answer == task.answer and not turn.calls
    assert not traj.policy_mask[: traj.prompt_len].any()
    assert traj.finish_reason == "answer"


def test_scripted_ten_turn_rollout_through_model_sampler(tok, env):
    cfg = SyntheticConfig(hops=9)  # multi_hop: one chain of 9 tool turns + answer
    tasks = [generate_task("multi_hop", s, cfg) for s in (1, 2)]
    G = 2
    scripts = [gold_turn_texts(t) for t in tasks for _ in range(G)]
    assert all(len(s) == 10 for s in scripts)
    model = init_model(TINY, seed=0)
    graphdef, state = nnx.split(model)
    rc = RolloutConfig(max_turns=10, max_prompt_tokens=1024, max_response_tokens=1536, max_turn_tokens=96)
    policy = ModelPolicy(graphdef, state, tok, sampling=SamplingParams(), config=rc, seed=0, forced_scripts=scripts)
    before = ModelPolicy.compilations()
    res = rollout(policy, env, tasks, tokenizer=tok, group_size=G, config=rc)
    assert len(res.trajectories) == 4
    for r, traj in enumerate(res.trajectories):
        assert traj.group_id == r // G
        _check_against_env(traj, tasks[r // G], tok, env)
        assert traj.reward == pytest.approx(1.0)  # gold chain: Solve-F1 = 1
        assert traj.metrics["solve_f1"] == pytest.approx(1.0)
        assert "turn_rewards" not in traj.metrics  # the driver records; rewards come from the record (rl.methods)
        # old log-probs are the model's log-probs of the forced tokens: finite, negative
        lp = traj.old_logprobs[traj.policy_mask]
        assert np.all(lp < 0) and np.all(np.isfinite(lp))
    compiles = ModelPolicy.compilations() - before
    print(f"compilations for a 10-turn rollout: {compiles}; stats: {res.stats}")
    assert compiles <= 6  # prefill + decode + a few observation-length buckets


def test_replay_policy_and_truncation(tok, env):
    task = generate_task("single_hop", 3)
    texts = gold_turn_texts(task)
    res = rollout(ReplayPolicy(tok, [texts]), env, [task], tokenizer=tok, group_size=1,
                  config=RolloutConfig(max_turns=4, max_response_tokens=4096))
    _check_against_env(res.trajectories[0], task, tok, env)
    # a response budget smaller than the first turn truncates it, recorded as such
    res = rollout(ReplayPolicy(tok, [texts]), env, [task], tokenizer=tok, group_size=1,
                  config=RolloutConfig(max_turns=4, max_response_tokens=5))
    traj = res.trajectories[0]
    assert traj.truncated and traj.finish_reason == "length" and traj.policy_mask.sum() == 5


def test_max_turns_ends_episode(tok, env):
    task = generate_task("multi_hop", 5, SyntheticConfig(hops=3))
    res = rollout(ReplayPolicy(tok, [gold_turn_texts(task)]), env, [task], tokenizer=tok, group_size=1,
                  config=RolloutConfig(max_turns=2, max_response_tokens=4096))
    traj = res.trajectories[0]
    assert traj.num_turns == 2 and traj.finish_reason == "max_turns" and not traj.truncated
    assert traj.metrics["solve_r"] == pytest.approx(2 / 3)


def test_prompt_over_budget_is_an_error(tok, env):
    task = generate_task("single_hop", 1)
    with pytest.raises(ValueError, match="prompt has .* tokens, over rollout.max_prompt_tokens=10"):
        rollout(ReplayPolicy(tok, [[]]), env, [task], tokenizer=tok, group_size=1,
                config=RolloutConfig(max_prompt_tokens=10))


# ---- the released code's parse semantics (rollout.end_on_unparsable_turn, rollout.calls_in_think) ----

BAD_CALL = "<tool_call>{not json</tool_call>"


def test_unparsable_turn_continues_by_default_and_ends_with_the_option(tok, env):
    task = generate_task("single_hop", 3)
    gold = gold_turn_texts(task)  # one call turn, then the answer
    script = [BAD_CALL] + gold
    default = rollout(ReplayPolicy(tok, [script]), env, [task], tokenizer=tok, group_size=1,
                      config=RolloutConfig(max_turns=4, max_response_tokens=4096)).trajectories[0]
    # today: the parse error goes back to the policy as the observation, and the episode goes on
    assert default.num_turns == 3 and default.finish_reason == "answer"
    assert default.turns[0].results[0].startswith("tool call 1: invalid JSON")
    assert default.turns[0].obs_end > default.turns[0].obs_start
    ended = rollout(ReplayPolicy(tok, [script]), env, [task], tokenizer=tok, group_size=1,
                    config=RolloutConfig(max_turns=4, max_response_tokens=4096,
                                         end_on_unparsable_turn=True)).trajectories[0]
    assert ended.num_turns == 1 and ended.finish_reason == "unparsable" and not ended.truncated
    turn = ended.turns[0]
    assert len(turn.calls) == 1 and not turn.results and turn.obs_end == turn.obs_start == ended.length
    assert ended.metrics["tool_error_rate"] == 1.0
    # one good call next to a bad one is not an unparsable turn: the episode goes on
    mixed = rollout(ReplayPolicy(tok, [[gold[0] + "\n" + BAD_CALL, gold[-1]]]), env, [task], tokenizer=tok,
                    group_size=1, config=RolloutConfig(max_turns=4, max_response_tokens=4096,
                                                       end_on_unparsable_turn=True)).trajectories[0]
    assert mixed.num_turns == 2 and mixed.finish_reason == "answer" and len(mixed.turns[0].results) == 2


def test_calls_in_think_are_executed_only_with_the_option(tok, env):
    task = generate_task("single_hop", 4)
    gold = gold_turn_texts(task)
    script = ["<think>\n" + gold[0] + "\n</think>\n\nLooking it up.", gold[-1]]
    default = rollout(ReplayPolicy(tok, [script]), env, [task], tokenizer=tok, group_size=1,
                      config=RolloutConfig(max_turns=4, max_response_tokens=4096)).trajectories[0]
    # today: a call inside the thought is reasoning; the turn made no call, so it is the answer turn
    assert default.num_turns == 1 and default.finish_reason == "answer" and not default.turns[0].calls
    run = rollout(ReplayPolicy(tok, [script]), env, [task], tokenizer=tok, group_size=1,
                  config=RolloutConfig(max_turns=4, max_response_tokens=4096, calls_in_think=True)).trajectories[0]
    want = gold_tool_calls(task)[0]
    assert [(c.name, c.arguments) for c in run.turns[0].calls] == [(c.name, c.arguments) for c in want]
    step = env.start(task, seed=0).step([ToolCall(c.name, c.arguments) for c in want])
    assert list(run.turns[0].results) == list(step.observations)
    assert run.num_turns == 2 and run.finish_reason == "answer" and run.reward == pytest.approx(1.0)


class _BrokenOn:
    """Wraps an environment so that episodes of one task raise inside `step` (an env bug)."""

    def __init__(self, env, task_id, where):
        self.env, self.task_id, self.where = env, task_id, where

    def start(self, task, *, seed=0):
        episode = self.env.start(task, seed=seed)
        if task.task_id == self.task_id:
            def boom(*args, **kwargs):
                raise KeyError("checker state missing")
            setattr(episode, self.where, boom)
        return episode


@pytest.mark.parametrize("where", ["plan_step", "commit_step"])
def test_an_environment_error_ends_only_its_episode_with_the_reason(tok, env, where, capsys):
    tasks = [generate_task("single_hop", 11), generate_task("single_hop", 12)]
    scripts = [gold_turn_texts(t) for t in tasks]
    res = rollout(ReplayPolicy(tok, scripts), _BrokenOn(env, tasks[0].task_id, where), tasks,
                  tokenizer=tok, group_size=1, config=RolloutConfig(max_turns=4, max_response_tokens=4096))
    broken, healthy = res.trajectories
    assert broken.finish_reason == "env_error" and broken.num_turns == 1
    assert healthy.finish_reason == "answer" and healthy.reward == 1.0
    assert res.stats["env_errors"] == 1.0
    err = capsys.readouterr().err
    assert "1 episode(s) ended by an environment error" in err and "KeyError: 'checker state missing'" in err


def test_last_turn_results_are_recorded_when_the_episode_stops_after_its_calls(tok, env):
    """Issue 58: at max_turns, and on the response budget, the last turn's calls ran: their
    results are on the turn (hindsight blocks, records), with no observation tokens, so the
    budget counts only what the policy saw."""
    task = generate_task("multi_hop", 5, SyntheticConfig(hops=3))
    texts = gold_turn_texts(task)
    full = rollout(ReplayPolicy(tok, [texts]), env, [task], tokenizer=tok, group_size=1,
                   config=RolloutConfig(max_turns=4, max_response_tokens=4096)).trajectories[0]
    first = full.turns[0]
    # max_turns=2: the second turn's call ran; its result is recorded, nothing follows the turn
    capped = rollout(ReplayPolicy(tok, [texts]), env, [task], tokenizer=tok, group_size=1,
                     config=RolloutConfig(max_turns=2, max_response_tokens=4096)).trajectories[0]
    assert capped.finish_reason == "max_turns" and capped.num_turns == 2
    assert capped.turns[1].results == full.turns[1].results and len(capped.turns[1].results) == 1
    assert not capped.turns[1].has_observation and capped.length == capped.turns[1].policy_end
    np.testing.assert_array_equal(capped.tokens, full.tokens[: capped.length])
    # a response budget the first turn fits but not its observation: truncated, result recorded
    budget = first.num_policy_tokens + (first.obs_end - first.obs_start)
    cut = rollout(ReplayPolicy(tok, [texts]), env, [task], tokenizer=tok, group_size=1,
                  config=RolloutConfig(max_turns=4, max_response_tokens=budget)).trajectories[0]
    assert cut.truncated and cut.finish_reason == "length" and cut.num_turns == 1
    assert cut.turns[0].results == first.results and not cut.turns[0].has_observation
    assert cut.length - cut.prompt_len == first.num_policy_tokens < budget


def test_per_turn_cap_off_is_the_response_budget():
    """rollout.max_turn_tokens=0 (the paper configs' value: the paper and the released code have
    no per-turn cap): a turn may use the whole response budget."""
    from turnsight_jax.config import base_config, rollout_config

    assert RolloutConfig(max_turn_tokens=0, max_response_tokens=700).turn_cap == 700
    assert RolloutConfig(max_turn_tokens=48).turn_cap == 48
    with pytest.raises(ValueError, match="max_turn_tokens must be >= 0"):
        RolloutConfig(max_turn_tokens=-1)
    rc = rollout_config(base_config())
    assert (rc.max_turn_tokens, rc.turn_cap) == (0, 13_000)


def test_released_observation_template_puts_the_released_text_after_a_turn(tok, env):
    """rollout.observation_template="released" (issue 58): after a turn's sampled <|im_end|> the
    trajectory holds the released MatchTIR rollout's text up to the next assistant header; the
    turns, calls and recorded results are those of the default ("project") rollout."""
    task = generate_task("multi_hop", 5, SyntheticConfig(hops=3))
    texts = gold_turn_texts(task)
    runs = {name: rollout(ReplayPolicy(tok, [texts]), env, [task], tokenizer=tok, group_size=1,
                          config=RolloutConfig(max_turns=4, max_response_tokens=4096, observation_template=name)
                          ).trajectories[0] for name in ("project", "released")}
    proj, rel = runs["project"], runs["released"]
    assert rel.num_turns == proj.num_turns == 4 and rel.finish_reason == proj.finish_reason == "answer"
    for k in range(3):  # the three call turns
        t, p = rel.turns[k], proj.turns[k]
        assert t.results == p.results and len(t.results) == 1
        assert [(c.name, c.arguments) for c in t.calls] == [(c.name, c.arguments) for c in p.calls]
        assert tok.decode(rel.tokens[t.policy_start:t.policy_end]).endswith("<|im_end|>")
        between = tok.decode(rel.tokens[t.obs_start:rel.turns[k + 1].policy_start])
        result = t.results[0]
        assert between == ("<|im_start|>user\n<tool_response>\n" + result + "\n</tool_response>\n<|im_end|>\n"
                           "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off (RolloutConfig's default)
        assert tok.decode(rel.tokens[slice(*t.result_spans[0])]) == result
        assert tok.decode(proj.tokens[p.obs_start:proj.turns[k + 1].policy_start]).startswith("\n<|im_start|>user")
    with pytest.raises(ValueError, match="rollout.observation_template must be one of"):
        RolloutConfig(observation_template="verl")
