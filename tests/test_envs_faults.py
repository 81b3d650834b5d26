"""The fault wrapper (envs.faults): rates within binomial bounds at a fixed seed, determinism,
retry semantics, delays waited once per batch, and no episode lost in a real rollout."""

from __future__ import annotations

import math

import pytest

from turnsight_jax.chat.types import CallError, Task, ToolCall
from turnsight_jax.envs.base import Environment, Episode, EpisodeScore, StepResult
from turnsight_jax.envs.faults import FaultConfig, FaultyEnv, unavailable_text, wrap
from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_tasks, gold_turn_texts
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout

TOOL = {"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}


class _EchoEpisode(Episode):
    """Answers look(x=v) with "value-v"; counts the calls that ran."""

    def __init__(self, task):
        self.task, self.ran, self._done = task, [], False

    @property
    def done(self):
        return self._done

    def step(self, calls):
        out = []
        for c in calls:
            if isinstance(c, CallError):
                out.append(c.message)
            else:
                self.ran.append(c.arguments["x"])
                out.append(f"value-{c.arguments['x']}")
        return StepResult(tuple(out), done=False)

    def score(self, final_text=None):
        return EpisodeScore(1.0, {"ran": float(len(self.ran))})


class _EchoEnv(Environment):
    name = "echo"

    def start(self, task, *, seed=0):
        return _EchoEpisode(task)


def _task(i: int) -> Task:
    # gold-c is the final answer: a wrong value never hands it over
    return Task(f"t{i}", ({"role": "user", "content": "q"},), (TOOL,), {}, {"look": ["gold-a", "gold-b", "gold-c"]},
                "x, Gold-C")


def _call(x) -> ToolCall:
    return ToolCall("look", {"x": x})


def test_rates_within_binomial_bounds_and_deterministic():
    cfg = FaultConfig(wrong_rate=0.1, unavailable_rate=0.2, delay_rate=0.05, delay_s=0.5, seed=3)
    slept = []
    env = FaultyEnv(_EchoEnv(), cfg, sleep=slept.append)
    n_eps, per = 250, 40  # 10,000 calls, each with its own arguments (no retries)
    kinds = []
    for e in range(n_eps):
        ep = env.start(_task(e), seed=e)
        for c in range(per // 4):
            res = ep.step([_call(f"{e}-{c}-{j}") for j in range(4)])
            kinds += res.info["faults"]
            for j, (obs, ks) in enumerate(zip(res.observations, res.info["faults"])):  # what the policy sees
                true = f"value-{e}-{c}-{j}"
                if "unavailable" in ks:
                    assert obs == unavailable_text("look")
                elif "wrong" in ks:  # a task's gold value or an earlier result, never the true one
                    assert obs != true and (obs in ("gold-a", "gold-b") or obs.startswith(f"value-{e}-"))
                else:
                    assert obs == true
        assert ep.score().metrics["faults_unavailable"] + ep.score().metrics["ran"] == per  # unavailable never ran
    n = len(kinds)
    ran = [k for k in kinds if "unavailable" not in k]
    for got, p, m in ((sum("unavailable" in k for k in kinds), 0.2, n),
                      (sum("wrong" in k for k in ran), 0.1, len(ran)),
                      (sum("delay" in k for k in ran), 0.05, len(ran)),
                      (sum({"wrong", "delay"} <= set(k) for k in ran), 0.1 * 0.05, len(ran))):  # independent kinds
        assert abs(got / m - p) <= 4 * math.sqrt(p * (1 - p) / m), (got, m, p)
    # one wait per step that had a delayed call, never the sum of its delays
    assert len(slept) == sum(1 for i in range(0, n, 4) if any("delay" in k for k in kinds[i:i + 4]))
    assert set(slept) == {0.5} and env.slept_s == pytest.approx(0.5 * len(slept))

    # the same (faults.seed, episode seed, task, call index) -> the same faults; another seed differs
    def faults(seed):
        e = FaultyEnv(_EchoEnv(), FaultConfig(wrong_rate=0.3, unavailable_rate=0.3, seed=seed), sleep=lambda s: None)
        ep = e.start(_task(7), seed=11)
        return [ep.step([_call(f"k{i}")]).info["faults"][0] for i in range(60)]

    assert faults(1) == faults(1) and faults(1) != faults(2)


def test_unavailable_retry_semantics():
    env = FaultyEnv(_EchoEnv(), FaultConfig(unavailable_rate=1.0, unavailable_attempts=2), sleep=lambda s: None)
    ep = env.start(_task(0), seed=0)
    seen = [ep.step([_call("same")]) for _ in range(5)]
    # attempt 1 starts an outage of 2 attempts, attempt 3 runs, attempt 4 draws again (p = 1)
    assert [r.info["faults"][0] for r in seen] == [["unavailable"], ["unavailable"], [], ["unavailable"], ["unavailable"]]
    assert seen[2].observations == ("value-same",) and ep.inner.ran == ["same"]
    # another call is another key; a malformed call or an unknown tool is never faulted
    other = ep.step([_call("other"), CallError("bad"), ToolCall("nope", {"x": 1})])
    assert other.info["faults"] == [["unavailable"], [], []]
    assert wrap(_EchoEnv(), FaultConfig()).__class__ is _EchoEnv  # nothing to inject: not wrapped
    with pytest.raises(ValueError, match="faults.wrong_rate must be a probability"):
        FaultConfig(wrong_rate=1.5).validate()
    with pytest.raises(ValueError, match="faults.unavailable_attempts must be an int >= 1"):
        FaultConfig(unavailable_attempts=0).validate()


def test_real_rollout_never_loses_an_episode(tok):
    """Built-in tasks through the FTRL environment (two-phase, batched executor) with heavy faults:
    every episode returns its trajectory and score; faults are recorded per turn and per call; a
    wrong value is what the environment scores; delays wait once per batch."""
    tasks = generate_tasks(4, seed=2, categories=("multi_hop", "parallel_multi_hop"), config=SyntheticConfig(hops=3))
    scripts = [gold_turn_texts(t) for t in tasks for _ in range(2)]
    slept = []
    cfg = FaultConfig(wrong_rate=0.3, unavailable_rate=0.3, unavailable_attempts=1, delay_rate=0.3, delay_s=2.0, seed=5)
    with FTRLEnv(num_workers=1) as inner:
        env = FaultyEnv(inner, cfg, sleep=slept.append)
        res = rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=2,
                      config=RolloutConfig(max_turns=6, max_response_tokens=4096), seed=1)
        clean = rollout(ReplayPolicy(tok, scripts), inner, tasks, tokenizer=tok, group_size=2,
                        config=RolloutConfig(max_turns=6, max_response_tokens=4096), seed=1)
    assert len(res.trajectories) == 8 and res.stats["env_errors"] == 0
    total = {"wrong": 0, "unavailable": 0, "delay": 0}
    for traj, ref in zip(res.trajectories, clean.trajectories):
        assert traj.finish_reason == "answer" and traj.num_turns == ref.num_turns
        for turn, ref_turn in zip(traj.turns, ref.turns):
            faults = turn.env_info.get("faults", [])
            assert len(faults) == len(turn.calls)
            for ks, obs, true in zip(faults, turn.results, ref_turn.results):
                for k in ks:
                    total[k] += 1
                if "unavailable" in ks:
                    assert obs == unavailable_text(turn.calls[0].name)
                elif "wrong" in ks:
                    assert obs != true
                else:
                    assert obs == true
        m = traj.metrics
        assert m["faulted_calls"] == sum(bool(ks) for t in traj.turns for ks in t.env_info.get("faults", []))
        assert max(m["faults_wrong"], m["faults_unavailable"], m["faults_delay"]) <= m["faulted_calls"] \
            <= m["faults_wrong"] + m["faults_unavailable"] + m["faults_delay"]
        # the environment scored what the policy saw: each gold call solves one gold value, an
        # unavailable call did not run (the replayed policy never retries) and solves none; delays
        # change nothing
        assert ref.metrics["solved"] == ref.metrics["num_gold"]
        assert m["solved"] <= ref.metrics["solved"] - m["faults_unavailable"]
        if not (m["faults_wrong"] or m["faults_unavailable"]):
            assert traj.reward == ref.reward
    assert min(total.values()) > 0
    assert 0 < len(slept) <= max(t.num_turns for t in res.trajectories) and set(slept) == {2.0}
