"""Noisy, slow and unavailable tools: an environment wrapper that injects faults by configuration
(`faults.*`; docs/experiments.md).

`FaultyEnv(env, FaultConfig(...))` wraps any `Environment`. Each tool call of an episode (a
parsed `ToolCall` naming one of the task's tools; malformed calls and unknown tools pass through)
draws, independently per kind, a uniform number from a hash of (faults.seed, the episode's seed,
the task id, the call's index in the episode, the kind): the same episode seeds and the same calls
give the same faults, whatever else runs in the batch. The kinds:

* **unavailable** (`unavailable_rate` p, `unavailable_attempts` k): the call's tool is down for
  this call (its name and arguments): this attempt and the next k - 1 identical attempts are
  answered, without running, with FTRL's error text "an error occured when call NAME: the tool
  is temporarily unavailable; call it again to retry", and the attempt after them runs (it draws
  no new outage; later identical calls may fault again). The policy recovers by calling again.
  An unavailable attempt is not executed, so the environment does not count it as a call
  (FTRL's Solve-P counts executed calls): a retry costs turns, not precision.
* **wrong** (`wrong_rate`): the call runs, and its result is replaced by a plausible wrong value:
  one of the task's gold intermediate values (Task.unsolved_set) or of the episode's earlier
  results that differs from the true result and is no part of the task's final answer (a fault
  must not hand the policy the answer), chosen by the same hash; "unknown" when there is none.
  Error results are never replaced. For environments that step in two phases (the
  code-tool environments: FTRL, ToolHop, built-in) the wrong value is what the environment records
  and scores, as it is what the policy saw; for the others (BFCL) only the observation changes,
  and the environment scores its own state.
* **delay** (`delay_rate`, `delay_s`): the call takes `delay_s` seconds more. Calls run
  concurrently: one batch of calls (a `VectorEnv` step) waits for its slowest delay once, as
  concurrent calls would, not for the sum.

Every injected fault is reported per call in the step's `StepResult.info["faults"]` (the rollout
records it on the turn, `TurnRecord.env_info["faults"]`) and counted in the episode's metrics
("faults_wrong", "faults_unavailable", "faults_delay", "faulted_calls"). A fault never ends or
loses an episode: every episode returns its trajectory and its score.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import threading
import time
from typing import Any, Callable, Sequence

from turnsight_jax.chat.types import Call, CallError, Task, ToolCall
from turnsight_jax.envs.base import Environment, Episode, EpisodeScore, StepResult
from turnsight_jax.envs.code_tools import step_in_two_phases
from turnsight_jax.envs.executor import ERROR_TEMPLATE, error_text

FAULT_KINDS = ("unavailable", "wrong", "delay")
UNAVAILABLE_MESSAGE = "the tool is temporarily unavailable; call it again to retry"
NO_VALUE = "unknown"
ERROR_PREFIX = ERROR_TEMPLATE.split("{name}")[0]  # FTRL's error observation starts so


@dataclasses.dataclass
class _Fault:
    """One call's faults: the kinds injected, and the uniform draw that picks a wrong value."""

    kinds: set[str]
    pick: float = 0.0


@dataclasses.dataclass(frozen=True)
class FaultConfig:
    """The faults' rates and shapes (config keys faults.*; the module docstring)."""

    wrong_rate: float = 0.0
    unavailable_rate: float = 0.0
    unavailable_attempts: int = 1
    delay_rate: float = 0.0
    delay_s: float = 0.0
    seed: int = 0

    @property
    def active(self) -> bool:
        return self.wrong_rate > 0 or self.unavailable_rate > 0 or (self.delay_rate > 0 and self.delay_s > 0)

    def validate(self) -> "FaultConfig":
        for name in ("wrong_rate", "unavailable_rate", "delay_rate"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"faults.{name} must be a probability in [0, 1], got {v!r}")
        k = self.unavailable_attempts
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"faults.unavailable_attempts must be an int >= 1, got {k!r}")
        if isinstance(self.delay_s, bool) or not isinstance(self.delay_s, (int, float)) \
                or not (math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ValueError(f"faults.delay_s must be a finite number of seconds >= 0, got {self.delay_s!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"faults.seed must be an int, got {self.seed!r}")
        return self


def uniform(seed: int, episode_seed: int, task_id: Any, call_index: int, kind: str) -> float:
    """A uniform number in [0, 1) for one (call, kind): a pure function of its arguments."""
    digest = hashlib.sha256(f"{seed}|{episode_seed}|{task_id}|{call_index}|{kind}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64


def unavailable_text(name: str) -> str:
    return error_text(name, UNAVAILABLE_MESSAGE)


def _call_key(call: ToolCall) -> str:
    return call.name + "|" + json.dumps(call.arguments, sort_keys=True, ensure_ascii=False, default=str)


def _is_error(text: str) -> bool:
    return text.startswith(ERROR_PREFIX)


class FaultyEpisode(Episode):
    """An episode of the wrapped environment with faults injected into its tool calls."""

    def __init__(self, inner: Episode, cfg: FaultConfig, episode_seed: int, env: "FaultyEnv"):
        self.inner = inner
        self.task: Task = inner.task
        self.cfg = cfg
        self.episode_seed = episode_seed
        self._env = env
        self._tools = {t.get("function", {}).get("name") for t in self.task.tools}
        # a wrong value never hands the policy the final answer (FTRL's multi-part ", " answers)
        self._answer_parts = {p.strip().lower() for p in str(self.task.answer).split(", ") if p.strip()}
        self._n_calls = 0
        self._outage: dict[str, int] = {}  # call key -> unavailable attempts still to answer
        self._recovered: set[str] = set()  # keys whose next attempt runs without a new outage draw
        self._seen: list[str] = []  # the episode's results so far (the wrong values' pool)
        self.counts = {kind: 0 for kind in FAULT_KINDS}
        self.faulted_calls = 0
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self.inner.done

    def close(self) -> None:
        self.inner.close()

    # ---- deciding ----
    def _decide(self, calls: Sequence[Call]) -> list[_Fault]:
        """The faults of each call ("wrong" is provisional until the result is seen)."""
        out = []
        for call in calls:
            index = self._n_calls
            self._n_calls += 1
            fault = _Fault(set())
            if isinstance(call, ToolCall) and call.name in self._tools:
                key = _call_key(call)
                u = {k: uniform(self.cfg.seed, self.episode_seed, self.task.task_id, index, k) for k in FAULT_KINDS}
                u["pick"] = uniform(self.cfg.seed, self.episode_seed, self.task.task_id, index, "pick")
                if self._outage.get(key, 0) > 0:  # a retry during an outage
                    self._outage[key] -= 1
                    fault.kinds.add("unavailable")
                elif key in self._recovered:
                    self._recovered.discard(key)  # the attempt after an outage runs
                elif u["unavailable"] < self.cfg.unavailable_rate:
                    fault.kinds.add("unavailable")
                    self._outage[key] = self.cfg.unavailable_attempts - 1
                if "unavailable" in fault.kinds:
                    if not self._outage[key]:
                        self._recovered.add(key)
                else:
                    if u["wrong"] < self.cfg.wrong_rate:
                        fault.kinds.add("wrong")
                    if u["delay"] < self.cfg.delay_rate and self.cfg.delay_s > 0:
                        fault.kinds.add("delay")
                fault.pick = u["pick"]
            out.append(fault)
        return out

    def _wrong_value(self, true_text: str, pick: float) -> str | None:
        """A wrong value for a result (None: leave it, an error result)."""
        if _is_error(true_text):
            return None
        truth = true_text.strip().lower()
        pool = sorted({v for vs in self.task.unsolved_set.values() for v in vs} | set(self._seen))
        pool = [v for v in pool if v.strip() and v.strip().lower() != truth and not _is_error(v)
                and v.strip().lower() not in self._answer_parts]
        return pool[min(int(pick * len(pool)), len(pool) - 1)] if pool else (NO_VALUE if truth != NO_VALUE else None)

    def _forward(self, calls: Sequence[Call], faults: list[_Fault]) -> list[Call]:
        """The calls the wrapped episode sees: an unavailable attempt becomes a call that is answered
        with the unavailable text and never runs."""
        return [CallError(unavailable_text(c.name), raw=c.raw) if "unavailable" in f.kinds else c
                for c, f in zip(calls, faults)]

    def _apply(self, texts: list[str], slots: Sequence[int], faults: list[_Fault]) -> list[str]:
        """texts (the results of the calls at `slots`) with the wrong values in; `faults` updated
        to what was injected."""
        out = list(texts)
        for j, slot in enumerate(slots):
            fault = faults[slot]
            if "wrong" in fault.kinds:
                value = self._wrong_value(out[j], fault.pick)
                if value is None:
                    fault.kinds.discard("wrong")
                else:
                    out[j] = value
        self._seen.extend(t for t in texts if not _is_error(t))
        return out

    def _finish(self, result: StepResult, faults: list[_Fault]) -> StepResult:
        kinds = [sorted(f.kinds) for f in faults]
        for ks in kinds:
            for kind in ks:
                self.counts[kind] += 1
            self.faulted_calls += bool(ks)
        if not faults:
            return result
        return dataclasses.replace(result, info={**dict(result.info), "faults": kinds})

    # ---- stepping (one phase: the wrapped episode steps itself) ----
    def step(self, calls: Sequence[Call]) -> StepResult:
        with self._lock:
            faults = self._decide(calls)
            forwarded = self._forward(calls, faults)
        if any("delay" in f.kinds for f in faults):
            self._env.wait(self.cfg.delay_s)
        result = self.inner.step(forwarded)
        with self._lock:
            obs = list(result.observations)
            ran = [i for i, f in enumerate(faults) if "unavailable" not in f.kinds] if len(obs) == len(calls) else []
            for i, text in zip(ran, self._apply([obs[i] for i in ran], ran, faults)):
                obs[i] = text
            return self._finish(dataclasses.replace(result, observations=tuple(obs)), faults)

    def score(self, final_text: str | None = None) -> EpisodeScore:
        score = self.inner.score(final_text)
        metrics = {**score.metrics, **{f"faults_{k}": float(v) for k, v in self.counts.items()},
                   "faulted_calls": float(self.faulted_calls)}
        return EpisodeScore(score.reward, metrics)


class FaultyCodeEpisode(FaultyEpisode):
    """A FaultyEpisode over a two-phase (code-tool) episode: `VectorEnv` keeps batching its calls
    through the wrapper's executor, which applies the delays once per batch."""

    def plan_step(self, calls: Sequence[Call]):
        with self._lock:
            faults = self._decide(calls)
            forwarded = self._forward(calls, faults)
            plan = self.inner.plan_step(forwarded)
            if isinstance(plan, StepResult):
                return self._finish(plan, faults)
            observations, requests, slots = plan
            self._env.executor.delay(requests, [self.cfg.delay_s if "delay" in faults[s].kinds else 0.0 for s in slots])
            self._pending = (faults, forwarded)
            return plan

    def commit_step(self, calls: Sequence[Call], observations: list, slots: Sequence[int], texts: Sequence[str]):
        with self._lock:
            faults, forwarded = self._pending
            self._pending = None
            texts = self._apply(list(texts), slots, faults)
            return self._finish(self.inner.commit_step(forwarded, observations, slots, texts), faults)

    def step(self, calls: Sequence[Call]) -> StepResult:
        return step_in_two_phases(self, calls)

    @property
    def executor(self):
        return self._env.executor


class DelayingExecutor:
    """The wrapped environment's tool executor; a batch of requests first waits for the longest
    delay registered for any of them (`delay`), once."""

    def __init__(self, inner, sleep: Callable[[float], None]):
        self.inner = inner
        self._sleep = sleep
        self._delays: dict[int, float] = {}
        self._lock = threading.Lock()

    def delay(self, requests: Sequence[Any], seconds: Sequence[float]) -> None:
        with self._lock:
            for r, s in zip(requests, seconds):
                if s > 0:
                    self._delays[id(r)] = s

    def run_many(self, requests: Sequence[Any]) -> list[str]:
        with self._lock:
            wait = max([self._delays.pop(id(r), 0.0) for r in requests] + [0.0])
        if wait > 0:
            self._sleep(wait)
        return self.inner.run_many(requests)

    def __getattr__(self, name):  # everything else is the wrapped executor's
        return getattr(self.inner, name)


class FaultyEnv(Environment):
    """`env` with faults injected into its tool calls (module docstring). sleep: how a delay waits
    (time.sleep; a test passes a recorder). Closing it closes `env`."""

    def __init__(self, env: Environment, cfg: FaultConfig, *, sleep: Callable[[float], None] = time.sleep):
        self.inner = env
        self.cfg = cfg.validate()
        self.name = f"{env.name}+faults"
        self.sleep = sleep
        self.slept_s = 0.0
        inner_executor = getattr(env, "executor", None)
        self.executor = DelayingExecutor(inner_executor, self.wait) if inner_executor is not None else None

    def wait(self, seconds: float) -> None:
        """A delay: counted in `slept_s`, waited with `sleep`."""
        self.slept_s += seconds
        self.sleep(seconds)

    def start(self, task: Task, *, seed: int = 0) -> FaultyEpisode:
        inner = self.inner.start(task, seed=seed)
        two_phase = hasattr(inner, "plan_step") and hasattr(inner, "commit_step") and self.executor is not None
        return (FaultyCodeEpisode if two_phase else FaultyEpisode)(inner, self.cfg, seed, self)

    def close(self) -> None:
        self.inner.close()


def wrap(env: Environment, cfg: FaultConfig) -> Environment:
    """`env` itself when `cfg` injects nothing, else FaultyEnv(env, cfg)."""
    return FaultyEnv(env, cfg) if cfg.validate().active else env
