"""A minimal tool environment plugged into the rollout driver and the training batch.

    python docs/examples/custom_environment.py

`CalculatorEnv` implements the protocol of `turnsight_jax/envs/base.py` (see
docs/adding_an_environment.md): `Environment.start(task, seed=...) -> Episode`, and
`Episode.step(calls) -> StepResult`, `Episode.score(final_text) -> EpisodeScore`, `Episode.done`,
`Episode.close()`. Its tools are plain in-process Python functions (trusted code written here,
never model text). The script plays scripted turns through the real rollout driver
(`ReplayPolicy`: no model, no compilation), checks the rewards, and turns the trajectories into
the fixed-shape `TrainBatch` (with TurnSight's packed hindsight views) that the train step eats.
"""

from __future__ import annotations

import json
from typing import Sequence

from turnsight_jax.assets import default_tokenizer
from turnsight_jax.rl.batch import make_train_batch
from turnsight_jax.chat.hindsight import hindsight_ids
from turnsight_jax.chat.parsing import render_tool_call
from turnsight_jax.chat.types import Call, CallError, Task, ToolCall
from turnsight_jax.envs.base import Environment, Episode, EpisodeScore, StepResult, malformed_observation
from turnsight_jax.envs.executor import error_text
from turnsight_jax.envs.answers import extract_answer
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout
from turnsight_jax.rl.config import AlgoConfig, StepConfig
from turnsight_jax.rl.methods import resolve_method

# ---- the tools: name -> (python function, OpenAI-style schema) ----------------------------------


def _schema(name: str, description: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}}


TOOLS = {
    "add": (lambda a, b: a + b, _schema("add", "Return a + b.")),
    "multiply": (lambda a, b: a * b, _schema("multiply", "Return a * b.")),
}


# ---- the environment ---------------------------------------------------------------------------


class CalculatorEpisode(Episode):
    """One rollout: executes each turn's calls, scores the final answer against `task.answer`."""

    def __init__(self, task: Task, seed: int):
        self.task = task
        self.seed = seed  # nothing random here; an environment with randomness must derive it from seed
        self.num_calls = 0
        self._done = False

    @property
    def done(self) -> bool:
        return self._done

    def step(self, calls: Sequence[Call]) -> StepResult:
        if not calls:  # a turn without calls is the answer turn: the episode ends
            self._done = True
            return StepResult(observations=(), done=True)
        observations = []
        for call in calls:  # one observation per call, in call order; nothing may raise
            if isinstance(call, CallError):  # the parser rejected the call text
                observations.append(malformed_observation(call))
                continue
            assert isinstance(call, ToolCall)
            self.num_calls += 1
            # Errors use FTRL's wording (`error_text`): the driver's tool_error_rate counts
            # observations that start with it, plus malformed calls.
            if call.name not in TOOLS:
                observations.append(error_text(call.name, f"unknown tool; tools: {sorted(TOOLS)}"))
                continue
            try:
                value = TOOLS[call.name][0](**call.arguments)
                observations.append(json.dumps({"result": value}))
            except Exception as e:  # noqa: BLE001 - tool errors go back to the policy as text
                observations.append(error_text(call.name, f"{type(e).__name__}: {e}"))
        return StepResult(observations=tuple(observations), done=False)

    def score(self, final_text: str | None = None) -> EpisodeScore:
        correct = float(extract_answer(final_text) == self.task.answer)
        # The driver adds num_turns, num_calls, tool_error_rate, response_tokens, policy_tokens and
        # truncated to these metrics (overwriting keys of the same name).
        return EpisodeScore(reward=correct, metrics={"answer_correct": correct,
                                                     "executed_calls": float(self.num_calls)})

    def close(self) -> None:
        self._done = True


class CalculatorEnv(Environment):
    name = "calculator"

    def start(self, task: Task, *, seed: int = 0) -> Episode:
        return CalculatorEpisode(task, seed)


# ---- tasks and scripted turns ------------------------------------------------------------------


def make_task(i: int, x: int, y: int, z: int) -> Task:
    question = f"Compute ({x} + {y}) * {z} with the tools. Put the result in <answer></answer>."
    return Task(task_id=f"calc-{i}", messages=({"role": "user", "content": question},),
                tools=tuple(schema for _, schema in TOOLS.values()), codes={}, unsolved_set={},
                answer=str((x + y) * z), category="calculator")


def gold_turns(x: int, y: int, z: int) -> list[str]:
    return [render_tool_call("add", {"a": x, "b": y}),
            render_tool_call("multiply", {"a": x + y, "b": z}),
            f"<answer>{(x + y) * z}</answer>"]


def sloppy_turns(x: int, y: int, z: int) -> list[str]:
    return ['<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',  # a tool error
            render_tool_call("power", {"a": x, "b": y}),  # an unknown tool
            "<tool_call>{not json</tool_call>",  # a malformed call
            f"<answer>{x * y * z}</answer>"]  # a wrong answer


def main() -> None:
    tok = default_tokenizer()
    numbers = [(3, 4, 5), (2, 9, 7)]
    tasks = [make_task(i, *n) for i, n in enumerate(numbers)]
    group_size = 2  # two rollouts per task (row r continues task r // group_size)
    scripts = [s for n in numbers for s in (gold_turns(*n), sloppy_turns(*n))]
    config = RolloutConfig(max_turns=6, max_prompt_tokens=2048, max_response_tokens=1024, max_turn_tokens=128)
    env = CalculatorEnv()
    with env:
        res = rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=group_size, config=config)

    for traj in res.trajectories:
        print(f"{traj.task_id} group {traj.group_id}: reward {traj.reward:.0f}, {traj.num_turns} turns, "
              f"{traj.length} tokens ({int(traj.policy_mask.sum())} policy), finish={traj.finish_reason}, "
              f"tool_error_rate={traj.metrics['tool_error_rate']:.2f}")
    assert [t.reward for t in res.trajectories] == [1.0, 0.0, 1.0, 0.0]
    first = res.trajectories[0]
    assert first.turns[0].results == ['{"result": 7}'] and first.turns[1].results == ['{"result": 35}']
    sloppy = res.trajectories[1]
    assert sloppy.turns[1].results[0].startswith("an error occured when call power: unknown tool")
    assert sloppy.metrics["tool_error_rate"] == 1.0  # 3 calls: a tool error, an unknown tool, a malformed call
    assert isinstance(sloppy.turns[2].calls[0], CallError)

    # What the frozen teacher additionally sees for turn 0 at depth 2: that turn's and the next
    # turn's calls and results (docs/hindsight_views.md).
    print("\nhindsight message, turn 0, depth 2:\n" + tok.decode(hindsight_ids(tok, first, 0, 2)))

    # The same trajectories as the fixed-shape batch of one TurnSight step.
    step_cfg = StepConfig(algo=AlgoConfig(method="turnsight", base="grpo"), group_size=group_size,
                          max_turns=config.max_turns)
    row_tasks = [t for t in tasks for _ in range(group_size)]
    batch, stats = make_train_batch(res.trajectories, row_tasks, tok, step_cfg, resolve_method(step_cfg))
    print("TrainBatch:", {k: tuple(getattr(batch, k).shape) for k in
                          ("tokens", "pol_pos", "turn_ids", "old_logprobs", "group_ids")},
          {k: v.shape for k, v in batch.signals.items()})
    print("packed views:", tuple(batch.views.tokens.shape), f"view_pred {tuple(batch.views.view_pred.shape)}",
          f"overhead {stats['view_overhead']:.2f}x the trajectories' tokens")
    assert batch.views.view_pred.shape[0] == 3  # depths 1, 2, 3
    print("ok")


if __name__ == "__main__":
    main()
