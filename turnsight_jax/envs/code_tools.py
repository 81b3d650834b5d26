"""Episodes whose tools are dataset Python functions run by the isolated `ToolExecutor`.

FTRL, ToolHop and the built-in tasks share this: `Task.codes` maps each tool name to the source
of a function of that name; a parsed call `ToolCall(name, arguments)` runs as
`codes[name](**arguments)` in a worker process, and its observation follows FTRL's text rules
(see `executor.py`). Only the scoring differs between the sources (subclasses).
"""

from __future__ import annotations

import threading
import zlib
from typing import Sequence

from turnsight_jax.chat.types import Call, CallError, Task, ToolCall
from turnsight_jax.envs.base import Environment, Episode, EpisodeScore, StepResult
from turnsight_jax.envs.base import malformed_observation
from turnsight_jax.envs.executor import ToolExecutor, ToolRequest, error_text, short_name


def call_seed(seed: int, task_id: str, call_index: int) -> int:
    """Seed for one call: a pure function of the episode seed, task and call position."""
    return zlib.crc32(f"{seed}|{task_id}|{call_index}".encode("utf-8")) & 0x7FFFFFFF


def step_in_two_phases(episode, calls: Sequence[Call]) -> StepResult:
    """One turn of an episode with `plan_step` / `commit_step` run on its own `executor` (what
    `VectorEnv` does for a batch of such episodes)."""
    plan = episode.plan_step(calls)
    if isinstance(plan, StepResult):
        return plan
    observations, requests, slots = plan
    return episode.commit_step(calls, observations, slots, episode.executor.run_many(requests))


class CodeToolEpisode(Episode):
    """An episode over `task.codes`; records every call's (tool name, observation) in order.

    `call_outputs` holds the executed calls (`ToolCall`s) in turn order; malformed calls
    (`CallError`) are answered but, like FTRL's parser which drops them, not recorded unless the
    environment counts them (`count_malformed_calls`).
    """

    def __init__(self, task: Task, executor: ToolExecutor, seed: int, count_malformed: bool):
        self.task = task
        self._executor = executor
        self._seed = seed
        self._count_malformed = count_malformed
        self._done = False
        self._n_calls = 0
        self._lock = threading.Lock()
        self.call_outputs: list[tuple[str, str]] = []
        self.turns: list[list[tuple[str, str]]] = []

    @property
    def done(self) -> bool:
        return self._done

    def step(self, calls: Sequence[Call]) -> StepResult:
        return step_in_two_phases(self, calls)

    # Two-phase stepping lets `VectorEnv` send the calls of all episodes to the executor as one
    # batch (one chunked `run_many`), instead of one small batch per episode.
    def plan_step(self, calls: Sequence[Call]):
        """Either a finished `StepResult` (no tool code to run) or (observations, requests,
        request slots) for `commit_step`."""
        with self._lock:
            if self._done:
                return StepResult(observations=tuple(["episode is over"] * len(calls)), done=True)
            if not calls:
                self._done = True  # a turn without calls is the final answer
                return StepResult(observations=(), done=True)
            observations: list[str | None] = [None] * len(calls)
            requests: list[ToolRequest] = []
            slots: list[int] = []
            for i, call in enumerate(calls):
                if isinstance(call, CallError):
                    observations[i] = malformed_observation(call)
                elif not isinstance(call, ToolCall):
                    observations[i] = f"unsupported call object {type(call).__name__}"
                elif call.name not in self.task.codes:
                    # FTRL looks the code up with codes[name]: a KeyError whose text is repr(name)
                    # (a long name is cut in both places: the observation stays short).
                    observations[i] = error_text(call.name, short_name(repr(call.name)))
                else:
                    seed = call_seed(self._seed, self.task.task_id, self._n_calls + i)
                    requests.append(
                        ToolRequest(call.name, self.task.codes[call.name], call.arguments, seed)
                    )
                    slots.append(i)
            return observations, requests, slots

    def commit_step(
        self,
        calls: Sequence[Call],
        observations: list,
        slots: Sequence[int],
        texts: Sequence[str],
    ) -> StepResult:
        """Records the executed turn (see `plan_step`) and returns its `StepResult`."""
        with self._lock:
            for slot, text in zip(slots, texts):
                observations[slot] = text
            self._n_calls += len(calls)
            turn = []
            for call, text in zip(calls, observations):
                if isinstance(call, ToolCall):
                    turn.append((call.name, text))
                elif self._count_malformed:
                    turn.append(("", text))
            self.turns.append(turn)
            self.call_outputs.extend(turn)
            return StepResult(observations=tuple(observations), done=False)

    @property
    def executor(self) -> ToolExecutor:
        return self._executor

    def score(self, final_text: str | None = None) -> EpisodeScore:  # pragma: no cover - abstract
        raise NotImplementedError


class CodeToolEnvironment(Environment):
    """Base for environments backed by a shared `ToolExecutor`.

    Args:
      executor: a shared executor; when None, one is created with `num_workers` workers and
        `timeout_s` per call, and closed by `close()`.
      count_malformed_calls: count parser-rejected calls in Solve-P/F1 (FTRL does not).
    """

    episode_cls: type[CodeToolEpisode] = CodeToolEpisode

    def __init__(
        self,
        executor: ToolExecutor | None = None,
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        count_malformed_calls: bool = False,
    ):
        self._owns_executor = executor is None
        self.executor = executor or ToolExecutor(num_workers, timeout_s=timeout_s)
        self.count_malformed_calls = count_malformed_calls

    def start(self, task: Task, *, seed: int = 0) -> CodeToolEpisode:
        return self.episode_cls(task, self.executor, seed, self.count_malformed_calls)

    def close(self) -> None:
        if self._owns_executor:
            self.executor.close()
