"""The evaluation loop: every suite's tasks in batches through the rollout driver.

The same loop serves every `PolicySource` (model or replay): per batch it asks the source for a
policy, runs `rollout(policy, env, batch, group_size=1)` with the benchmark's budgets, and turns
each trajectory into an `Example` record (decoded text, turns, calls, results, metrics).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from turnsight_jax.chat.types import CallError, ToolCall
from turnsight_jax.eval import suites as suite_lib
from turnsight_jax.eval.policies import PolicySource
from turnsight_jax.eval.progress import Progress
from turnsight_jax.rollout.driver import rollout


_PER_ROLLOUT = ("rollout_s", "tool_s", "tokens")


@dataclasses.dataclass
class Example:
    """One evaluated task: what examples.jsonl holds per line."""

    benchmark: str
    category: str
    task_id: str
    metrics: dict[str, Any]
    reward: float
    finish_reason: str
    truncated: bool
    num_turns: int
    text: str
    turns: list[dict]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _call_json(call) -> dict:
    if isinstance(call, ToolCall):
        return {"name": call.name, "arguments": call.arguments}
    if isinstance(call, CallError):
        return {"error": call.message, "raw": call.raw}
    return {"error": f"unsupported call object {type(call).__name__}"}


def _plain(value):
    """Metrics as JSON-friendly Python values."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    return value


def to_example(benchmark: str, category: str, traj, tokenizer) -> Example:
    turns = [
        {"text": t.text, "calls": [_call_json(c) for c in t.calls], "results": list(t.results), "answer": t.answer}
        for t in traj.turns
    ]
    return Example(
        benchmark=benchmark,
        category=category,
        task_id=str(traj.task_id),
        metrics=_plain(dict(traj.metrics)),
        reward=float(traj.reward),
        finish_reason=traj.finish_reason,
        truncated=bool(traj.truncated),
        num_turns=traj.num_turns,
        text=tokenizer.decode(traj.tokens.tolist(), skip_special_tokens=False),
        turns=turns,
    )


def run_suites(source: PolicySource, suites: Sequence[suite_lib.Suite], settings: suite_lib.EvalSettings,
               *, progress: Progress | None = None, env_factory=suite_lib.make_env) -> tuple[list[Example], dict]:
    """Evaluates every suite; returns (examples in suite/category/task order, timing stats)."""
    progress = progress or Progress(sum(len(s) for s in suites))
    examples: list[Example] = []
    stats: dict[str, dict[str, float]] = {}
    for suite in suites:
        t0 = time.monotonic()
        pairs = [(cat, task) for cat, tasks in suite.categories.items() for task in tasks]
        config = suite_lib.rollout_config(suite.benchmark, settings, [t for _, t in pairs])
        env = env_factory(suite.benchmark, settings)
        totals: dict[str, float] = {}
        try:
            for start in range(0, len(pairs), settings.batch_size):
                batch = pairs[start:start + settings.batch_size]
                tasks = [t for _, t in batch]
                policy = source.policy_for(suite.benchmark, tasks, config)
                result = rollout(policy, env, tasks, tokenizer=source.tokenizer, group_size=1, config=config,
                                 seed=settings.seed, group_offset=start)
                for (cat, _), traj in zip(batch, result.trajectories):
                    examples.append(to_example(suite.benchmark, cat, traj, source.tokenizer))
                for k, v in result.stats.items():
                    # Per-rollout figures add up; the policy's own counters (prefill/decode
                    # seconds, decoded tokens, compilations) are cumulative already.
                    totals[k] = totals.get(k, 0.0) + float(v) if k in _PER_ROLLOUT else float(v)
                progress.update(len(batch), f"[{suite.benchmark}]")
        finally:
            env.close()
        totals["wall_s"] = time.monotonic() - t0
        stats[suite.benchmark] = totals
    return examples, stats
