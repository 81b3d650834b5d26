"""The evaluation loop: tasks in batches through the rollout driver, greedy or sampled.

One loop serves the command line (every `PolicySource`, model or replay) and the training-time
held-out evaluation (`eval.heldout`). `run_batches` is the seeding contract both share: with G
rollouts per task (1 greedy, `samples` sampled), tasks go in batches of max(1, batch_size // G)
in the given order; the batch starting at task index i gets a policy seeded `seed + i` and runs
`rollout(policy, env, batch, group_size=G, seed=seed)`. `run_suites` turns each task's G
trajectories into an `Example` record (metrics averaged over the samples).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from turnsight_jax.chat.types import CallError, Task, ToolCall
from turnsight_jax.envs.base import Environment
from turnsight_jax.eval import suites as suite_lib
from turnsight_jax.eval.policies import PolicySource
from turnsight_jax.rollout.driver import ProgressCallback, RolloutConfig, TurnPolicy, rollout
from turnsight_jax.rollout.progress import ProgressLine

# policy_factory(tasks, group_size, seed) -> the policy of one batch
PolicyFactory = Callable[[Sequence[Task], int, int], TurnPolicy]


def describe_sampling(temperature: float, samples: int, top_k: int = 0, top_p: float = 1.0) -> str:
    """"greedy" or e.g. "4 samples at temperature 1, top-k 20" (the held-out `mode` string)."""
    if temperature <= 0:
        return "greedy"
    return (f"{samples} samples at temperature {temperature:g}" + (f", top-k {top_k}" if top_k else "")
            + (f", top-p {top_p:g}" if top_p < 1 else ""))


def mean_metrics(trajectories: Sequence) -> dict[str, float]:
    """One task's metrics: each numeric metric's mean over its rollouts (float64 -> float)."""
    group = [t.metrics for t in trajectories]
    return {k: float(np.mean([m[k] for m in group])) for k in group[0]
            if all(isinstance(m.get(k), (int, float)) for m in group)}


def run_batches(policy_factory: PolicyFactory, env: Environment, tasks: Sequence[Task], *, tokenizer,
                config: RolloutConfig, group_size: int, batch_size: int, seed: int,
                progress: ProgressCallback | None = None) -> tuple[list[list[Any]], dict[str, float]]:
    """G = group_size rollouts of every task, in batches of max(1, batch_size // G) tasks.

    Returns (per task in order, its G `Trajectory`s in sample order; rollout stats summed over the
    batches, `compilations` the process total)."""
    per_task: list[list[Any]] = []
    totals: dict[str, float] = {}
    bs = max(1, batch_size // group_size)
    for i in range(0, len(tasks), bs):
        chunk = list(tasks[i:i + bs])
        policy = policy_factory(chunk, group_size, seed + i)
        res = rollout(policy, env, chunk, tokenizer=tokenizer, group_size=group_size, config=config, seed=seed,
                      progress=progress)
        for j in range(len(chunk)):
            per_task.append(res.trajectories[j * group_size:(j + 1) * group_size])
        for k, v in res.stats.items():
            # Every batch has its own policy, so its figures add up; compilations is a process total.
            totals[k] = float(v) if k == "compilations" else totals.get(k, 0.0) + float(v)
    return per_task, totals


@dataclasses.dataclass
class Example:
    """One evaluated task: what examples.jsonl holds per line."""

    benchmark: str
    category: str
    task_id: str
    metrics: dict[str, Any]
    reward: float
    finish_reason: str
    truncated: bool | float  # G > 1: the fraction of truncated rollouts
    num_turns: int | float  # G > 1: the mean
    text: str
    turns: list[dict]
    samples: list[dict] = dataclasses.field(default_factory=list)  # G > 1: every rollout's record

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


def _record(traj, tokenizer) -> dict:
    turns = [
        {"text": t.text, "calls": [_call_json(c) for c in t.calls], "results": list(t.results), "answer": t.answer}
        for t in traj.turns
    ]
    return dict(metrics=_plain(dict(traj.metrics)), reward=float(traj.reward), finish_reason=traj.finish_reason,
                truncated=bool(traj.truncated), num_turns=traj.num_turns,
                text=tokenizer.decode(traj.tokens.tolist(), skip_special_tokens=False), turns=turns)


def to_example(benchmark: str, category: str, trajectories: Sequence, tokenizer) -> Example:
    """One task's record. With one rollout, that rollout; with G > 1 the metrics, reward,
    truncation rate and turn count are means over the rollouts, text/turns/finish_reason are the
    first rollout's, and `samples` holds every rollout's own record."""
    records = [_record(t, tokenizer) for t in trajectories]
    first = records[0]
    if len(records) == 1:
        return Example(benchmark=benchmark, category=category, task_id=str(trajectories[0].task_id), **first)
    return Example(
        benchmark=benchmark, category=category, task_id=str(trajectories[0].task_id),
        metrics=mean_metrics(trajectories), reward=float(np.mean([r["reward"] for r in records])),
        finish_reason=first["finish_reason"], truncated=float(np.mean([r["truncated"] for r in records])),
        num_turns=float(np.mean([r["num_turns"] for r in records])), text=first["text"], turns=first["turns"],
        samples=records,
    )


def _conversation_record(conv) -> dict:
    """One BFCL conversation as an Example's fields (the harness's steps as turns)."""
    verdict = conv.verdict()
    passed = 1.0 if verdict.get("valid") else 0.0
    steps = [st for turn in conv.turns for st in turn]
    turns = [{"text": st.raw, "calls": [_call_json(c) for c in (st.calls or [])], "results": list(st.results),
              "answer": None} for st in steps]
    metrics = {"bfcl_pass": passed, "num_user_turns_done": float(len(conv.turns) if conv.finished else len(conv.turns) - 1),
               "num_calls": float(sum(len(st.calls or []) for st in steps)), "num_turns": float(len(steps)),
               "force_quit": float(bool(getattr(conv.episode, "force_quit", False))), "policy_tokens": float(conv.tokens)}
    finish = "length" if conv.error == "length" else ("error" if conv.error else
                                                      ("env_done" if metrics["force_quit"] else "answer"))
    try:
        text = conv.prompt()
    except ValueError:
        text = ""
    return dict(metrics=metrics, reward=passed, finish_reason=finish, truncated=conv.error == "length",
                num_turns=len(steps), text=text, turns=turns, verdict=verdict)


def _bfcl_example(category: str, convs: Sequence) -> Example:
    records = [_conversation_record(c) for c in convs]
    for r in records:
        r["metrics"]["error_type"] = r.pop("verdict").get("error_type", "")
    first = records[0]
    task_id = convs[0].task.task_id
    if len(records) == 1:
        return Example(benchmark="bfcl", category=category, task_id=task_id, **first)
    numeric = [k for k, v in first["metrics"].items() if isinstance(v, float)]
    return Example(benchmark="bfcl", category=category, task_id=task_id,
                   metrics={k: float(np.mean([r["metrics"][k] for r in records])) for k in numeric},
                   reward=float(np.mean([r["reward"] for r in records])), finish_reason=first["finish_reason"],
                   truncated=float(np.mean([r["truncated"] for r in records])),
                   num_turns=float(np.mean([r["num_turns"] for r in records])), text=first["text"],
                   turns=first["turns"], samples=records)


def run_bfcl_suite(source: PolicySource, suite: suite_lib.Suite, settings: suite_lib.EvalSettings,
                   progress: ProgressLine) -> tuple[list[Example], dict]:
    """BFCL through its own loop (`eval.bfcl_harness`): Memory prerequisites first (chain by
    chain, unscored), then every task, G rollouts each, in batches of max(1, batch_size // G)
    tasks; the batch starting at task index i is seeded seed + i (as `run_batches`)."""
    from turnsight_jax.envs.bfcl import BFCLEnv
    from turnsight_jax.eval import bfcl_harness as H
    from turnsight_jax.rollout.driver import RolloutProgress

    group = settings.group_size
    cfg = H.HarnessConfig(step_tokens=settings.max_new_tokens or H.STEP_TOKENS,
                          max_context_tokens=settings.bfcl_max_response_tokens,
                          max_prompt_tokens=settings.max_prompt_tokens, enable_thinking=settings.enable_thinking)
    env = BFCLEnv()
    memory_root = H.new_memory_root()
    t0 = time.monotonic()
    totals: dict[str, float] = {}

    def play(tasks: Sequence[Task], seed: int, report: bool):
        convs, keys = [], []
        for task in tasks:
            for g in range(group):
                memory_dir = memory_root / f"sample{g}"
                episode = env.start(task, memory_dir=memory_dir, search_backend=suite.search_backend)
                convs.append(H.Conversation(task, episode,
                                            enable_thinking=settings.enable_thinking))
                keys.append((task, g))
        completer = source.completer_for(suite.benchmark, cfg.step_tokens, seed=seed)

        def tick(finished, total, rounds):
            if report:  # per batch, as the driver reports a rollout (the line adds the batches up)
                progress(RolloutProgress(finished, total, rounds, int(sum(c.tokens for c in convs)),
                                         time.monotonic() - t0, done=finished == total))
        stats = H.run_conversations(completer, convs, keys, source.tokenizer, cfg, progress=tick)
        for k, v in {**stats, **{f"{k}_s": v for k, v in completer.timings.items()}}.items():
            totals[k] = totals.get(k, 0.0) + float(v)
        return convs

    examples: list[Example] = []
    # Memory prerequisites: each (backend, scenario) chain in order, the k-th of every chain together.
    chains: dict[tuple, list[Task]] = {}
    for task in suite.prerequisites:
        chains.setdefault((task.extra["memory_backend"], task.extra["bfcl_entry"]["scenario"]), []).append(task)
    for k in range(max((len(c) for c in chains.values()), default=0)):
        play([c[k] for c in chains.values() if k < len(c)], settings.seed, report=False)
    pairs = suite.pairs()
    bs = max(1, settings.batch_size // group)
    for i in range(0, len(pairs), bs):
        chunk = pairs[i:i + bs]
        convs = play([t for _, t in chunk], settings.seed + i, report=True)
        for j, (cat, _) in enumerate(chunk):
            examples.append(_bfcl_example(cat, convs[j * group:(j + 1) * group]))
    totals["wall_s"] = time.monotonic() - t0
    return examples, totals


def run_suites(source: PolicySource, suites: Sequence[suite_lib.Suite], settings: suite_lib.EvalSettings,
               *, progress: ProgressLine | None = None, env_factory=suite_lib.make_env) -> tuple[list[Example], dict]:
    """Evaluates every suite; returns (examples in suite evaluation order, timing stats)."""
    group = settings.group_size
    progress = progress or ProgressLine(sum(len(s) for s in suites) * group)
    examples: list[Example] = []
    stats: dict[str, dict[str, float]] = {}
    for suite in suites:
        if suite.benchmark == "bfcl":
            progress.label = suite.benchmark
            bfcl_examples, stats[suite.benchmark] = run_bfcl_suite(source, suite, settings, progress)
            examples += bfcl_examples
            continue
        t0 = time.monotonic()
        pairs = suite.pairs()
        tasks = [t for _, t in pairs]
        config = suite_lib.rollout_config(suite.benchmark, settings, tasks)
        progress.label = suite.benchmark
        env = env_factory(suite.benchmark, settings)
        try:
            per_task, totals = run_batches(
                lambda chunk, g, seed: source.policy_for(suite.benchmark, chunk, config, group_size=g, seed=seed),
                env, tasks, tokenizer=source.tokenizer, config=config, group_size=group,
                batch_size=settings.batch_size, seed=settings.seed, progress=progress)
        finally:
            env.close()
        for (cat, _), trajs in zip(pairs, per_task):
            examples.append(to_example(suite.benchmark, cat, trajs, source.tokenizer))
        totals["wall_s"] = time.monotonic() - t0
        stats[suite.benchmark] = totals
    return examples, stats
