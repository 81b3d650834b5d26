"""The environment protocol shared by every task source (FTRL, ToolHop, BFCL, built-in).

An *episode* is one rollout's environment. The rollout driver:

1. `env.start(task, seed=...)` -> `Episode`; the prompt is `task.messages` with `task.tools`;
2. after each policy turn, `episode.step(calls)` with that turn's parsed calls (`ToolCall` or
   `CallError`, in order) -> `StepResult`: one observation string per call (same order), a
   `done` flag and, for multi-turn user simulations (BFCL), the next user message;
   a turn with **no** calls ends the episode (FTRL, ToolHop, built-in) or the current user turn
   (BFCL, which then sends the next user message or finishes);
3. `episode.score(final_text)` -> `EpisodeScore(reward, metrics)` at the end;
4. `episode.close()`.

A `CallError` (malformed call) is answered with its `message`; a failing tool is answered with
an error observation. Nothing raised by tool code or caused by model output escapes `step`.

`VectorEnv` runs many episodes concurrently: the calls of all FTRL-style episodes (dataset tool
code) go to their shared executor as one batch, spread over its worker processes; other episodes
(BFCL) step in threads. Determinism: given the same
task, seed and calls, an episode returns the same observations and score.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
from typing import Any, Mapping, Sequence

from turnsight_jax.chat.template import escape_tool_response
from turnsight_jax.chat.types import Call, CallError, Task


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What the environment answers to one policy turn.

    observations: one text per call of the turn, in call order (empty for a turn without calls).
    done: the episode is over; the policy gets no further turn.
    user_message: a user message to append after the observations (BFCL's next user turn);
      None when there is none.
    added_tools: tool schemas that became available with `user_message` (BFCL miss_func).
    error: set by `VectorEnv` when the environment itself raised on this turn: the episode is
      over, and this is the reason (the rollout records it instead of dying).
    info: what else the environment reports about the turn (the rollout records it on the turn,
      `TurnRecord.env_info`); e.g. "faults": envs.faults' injected faults, per call.
    """

    observations: tuple[str, ...]
    done: bool
    user_message: str | None = None
    added_tools: tuple[dict, ...] = ()
    error: str | None = None
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _escaped(result: StepResult) -> StepResult:
    """`result` with every observation passed through `escape_tool_response`."""
    observations = tuple(escape_tool_response(o) if isinstance(o, str) else o for o in result.observations)
    if observations == result.observations:
        return result
    return dataclasses.replace(result, observations=observations)


def _failed(e: BaseException) -> StepResult:
    """The step of an episode whose environment raised: over, with the reason."""
    return StepResult(observations=(), done=True, error=f"{type(e).__name__}: {e}"[:500])


@dataclasses.dataclass(frozen=True)
class EpisodeScore:
    """The outcome of an episode: the scalar reward and named metrics (all floats)."""

    reward: float
    metrics: dict[str, float]


class Episode(abc.ABC):
    """One rollout's environment state."""

    task: Task

    @abc.abstractmethod
    def step(self, calls: Sequence[Call]) -> StepResult:
        """Executes one policy turn's calls; see the module docstring."""

    @abc.abstractmethod
    def score(self, final_text: str | None = None) -> EpisodeScore:
        """Scores the finished episode; `final_text` is the policy's last (answer) turn."""

    def close(self) -> None:
        """Releases the episode's resources (idempotent)."""

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """True once the episode has ended."""


class Environment(abc.ABC):
    """A factory of episodes for one task source."""

    name: str = "env"

    @abc.abstractmethod
    def start(self, task: Task, *, seed: int = 0) -> Episode:
        """Starts a fresh episode for `task`."""

    def close(self) -> None:
        """Releases shared resources (worker pools)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def malformed_observation(call: CallError) -> str:
    """The observation for a call the parser rejected: its message (never empty)."""
    return call.message or "malformed tool call"


def _score_or_failure(episode: "Episode", final_text: str | None) -> EpisodeScore:
    """The episode's score; a scorer that raises gives reward 0 with metric `env_error` = 1."""
    try:
        return episode.score(final_text)
    except Exception:  # noqa: BLE001 - counted in metrics, the rollout goes on
        return EpisodeScore(reward=0.0, metrics={"env_error": 1.0})


class VectorEnv:
    """Runs a batch of episodes concurrently.

    `step(calls_per_episode)` takes one entry per episode: the turn's calls, or None for an
    episode that does not act this round (finished, or waiting). The tool calls of all
    executor-backed episodes are sent to the executor as one batch; other episodes step in
    parallel threads. An episode whose environment (or executor) raises ends with the reason
    (`StepResult.error`); the others go on. Observations come back through
    `chat.template.escape_tool_response` (docs/sandbox.md, Observations).
    """

    def __init__(self, env: Environment, *, max_threads: int = 32):
        self.env = env
        self.episodes: list[Episode] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_threads, thread_name_prefix="vector-env"
        )

    def start(self, tasks: Sequence[Task], seeds: Sequence[int] | None = None) -> list[Episode]:
        """Starts one episode per task (closing any previous batch)."""
        self.close_episodes()
        if seeds is None:
            seeds = list(range(len(tasks)))
        if len(seeds) != len(tasks):
            raise ValueError(f"VectorEnv.start: {len(tasks)} tasks but {len(seeds)} seeds")
        self.episodes = list(
            self._pool.map(lambda ts: self.env.start(ts[0], seed=ts[1]), zip(tasks, seeds))
        )
        return self.episodes

    def add(self, task: Task, seed: int) -> int:
        """Start one more episode next to the running ones; its index in `episodes`."""
        self.episodes.append(self.env.start(task, seed=seed))
        return len(self.episodes) - 1

    def step(self, calls_per_episode: Sequence[Sequence[Call] | None]) -> list[StepResult | None]:
        if len(calls_per_episode) != len(self.episodes):
            raise ValueError(
                f"VectorEnv.step: {len(self.episodes)} episodes but "
                f"{len(calls_per_episode)} call lists"
            )
        results: list[StepResult | None] = [None] * len(self.episodes)
        # Episodes that run dataset tool code (FTRL, ToolHop, built-in) plan their calls first;
        # all their calls then go to the shared executor as one batch.
        batched: dict[int, list] = {}
        threaded = []
        # One episode's environment failing (a bug, a checker that raises on odd input) ends
        # that episode with the reason; it never takes the batch down.
        for i, (ep, calls) in enumerate(zip(self.episodes, calls_per_episode)):
            if calls is None or ep.done:
                continue
            calls = list(calls)
            if hasattr(ep, "plan_step") and hasattr(ep, "commit_step"):
                try:
                    plan = ep.plan_step(calls)
                except Exception as e:  # noqa: BLE001 - recorded as the episode's end
                    results[i] = _failed(e)
                    continue
                if isinstance(plan, StepResult):
                    results[i] = plan
                else:
                    batched.setdefault(id(ep.executor), []).append((i, ep, calls, plan))
            else:
                threaded.append((i, self._pool.submit(ep.step, calls)))
        for group in batched.values():
            executor = group[0][1].executor
            requests = [r for _, _, _, (_, reqs, _) in group for r in reqs]
            try:
                texts = executor.run_many(requests)
            except Exception:  # noqa: BLE001 - find the episode(s) whose calls raise; only they pay
                texts = None
            offset = 0
            for i, ep, calls, (observations, reqs, slots) in group:
                try:
                    if texts is not None:
                        mine = texts[offset : offset + len(reqs)]
                    else:
                        mine = executor.run_many(reqs)
                    results[i] = ep.commit_step(calls, observations, slots, mine)
                except Exception as e:  # noqa: BLE001
                    results[i] = _failed(e)
                offset += len(reqs)
        for i, future in threaded:
            try:
                results[i] = future.result()
            except Exception as e:  # noqa: BLE001
                results[i] = _failed(e)
        # Tool results are untrusted text: none may spell a tool-response delimiter (see
        # chat.template.escape_tool_response).
        return [None if r is None else _escaped(r) for r in results]

    def score(self, final_texts: Sequence[str | None] | None = None,
              indices: Sequence[int] | None = None) -> list[EpisodeScore]:
        """Scores of the episodes `indices` (default: all), given their final texts."""
        episodes = self.episodes if indices is None else [self.episodes[i] for i in indices]
        if final_texts is None:
            final_texts = [None] * len(episodes)
        return [_score_or_failure(ep, text) for ep, text in zip(episodes, final_texts)]

    def close_episodes(self) -> None:
        for ep in self.episodes:
            ep.close()
        self.episodes = []

    def close(self) -> None:
        self.close_episodes()
        self._pool.shutdown(wait=True)
