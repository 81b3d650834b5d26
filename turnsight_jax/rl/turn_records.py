"""What each turn was and what it received: per-step turn records and the turn-level metrics of
the studies (docs/experiments.md).

Host side, from a step's trajectories, their tasks and the step's per-row outputs
(rl.step.PER_ROW_PREFIXES). Per turn (arrays [b, K], K = max_turns, b = this process's rows in
trajectory order; 0 / -1 / False past a trajectory's turns):

* outcome (`turn_outcomes`): has_calls; errored (a malformed call, or a result that is FTRL's error
  text, as an unavailable tool's is); gold_match (every call is a call of the task's gold chain);
  gold_turn (the gold turn whose calls the turn's calls are, -1 none); gold_horizon (the dependency
  rule's h on the gold chain at that gold turn, rl.horizon.gold_horizons; -1 unknown); horizon
  (the rule's h on the trajectory itself); fault_wrong / fault_unavailable / fault_delay / faulted
  (envs.faults, from TurnRecord.env_info);
* received (the step's "per_turn/<name>": advantage, and with TurnSight weight, delta_bar, depth,
  horizon), under "step_<name>".

Per trajectory [b]: reward, success (the environment's answer_correct when it reports one, else
reward >= 1), faulted (>= 1 fault), num_turns, task_id, category. Per policy token, with
log.turn_records and a teacher (ragged, concatenated over the trajectories in order, [n]):
token_teacher [R, n] (the teacher's log-probs of the sampled tokens under each view, the step's
own arrays), token_student [n] (the sampler's log-probs: δ's student side), token_row, token_turn.

`write` stores one compressed .npz per step in <workdir>/turn_records/ (log.turn_records);
`metric_sums` gives the metrics' numerators and denominators so that the trainer can sum them
over processes.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np

from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import CallError, Task, ToolCall
from turnsight_jax.rl.horizon import ERROR_PREFIX, dependency_batch, dependency_horizon, depth_index, gold_horizons

RECORDS_DIR = "turn_records"
FAULT_KINDS = ("wrong", "unavailable", "delay")


def _canon(name: str, arguments: Any) -> str:
    return name + "|" + json.dumps(arguments, sort_keys=True, ensure_ascii=False, default=str)


def success(traj: Trajectory) -> bool:
    """The episode solved the task: the environment's answer check when it has one, else reward >= 1."""
    if "answer_correct" in traj.metrics:
        return bool(traj.metrics["answer_correct"] >= 1.0)
    return bool(traj.reward >= 1.0)


def turn_outcomes(traj: Trajectory, task: Task, max_turns: int, horizon: np.ndarray | None = None,
                  gold_h: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """The per-turn outcome arrays [K] of one trajectory (module docstring). horizon [>= n] / gold_h:
    the dependency rule's h on the trajectory / on the task's gold chain, when already computed."""
    k = max_turns
    out = {name: np.zeros(k, bool) for name in ("has_calls", "errored", "gold_match", "faulted")
           + tuple(f"fault_{x}" for x in FAULT_KINDS)}
    out.update({name: np.full(k, -1, np.int32) for name in ("gold_turn", "gold_horizon", "horizon")})
    gold = [{_canon(c["name"], c["arguments"]) for c in turn} for turn in (task.gold_calls or ())]
    gold_all = set().union(*gold) if gold else set()
    if gold_h is None:
        gold_h = gold_horizons(task) if task.gold_calls else []
    n = traj.num_turns
    if n > k:
        raise ValueError(f"trajectory of task {traj.task_id!r} has {n} turns, over max_turns {k}")
    if horizon is None and n:
        horizon = np.asarray(dependency_horizon(dependency_batch([traj], n)))[0]
    out["horizon"][:n] = np.asarray(horizon)[:n]
    for j, turn in enumerate(traj.turns):
        calls = turn.calls
        out["has_calls"][j] = bool(calls)
        out["errored"][j] = any(isinstance(c, CallError) for c in calls) or any(
            r.startswith(ERROR_PREFIX) for r in turn.results)
        keys = {_canon(c.name, c.arguments) for c in calls if isinstance(c, ToolCall)}
        out["gold_match"][j] = bool(calls) and len(keys) == len(calls) and keys <= gold_all
        if calls and keys in gold:
            h = gold.index(keys)
            out["gold_turn"][j], out["gold_horizon"][j] = h, gold_h[h]
        faults = turn.env_info.get("faults", ())
        for kind in FAULT_KINDS:
            out[f"fault_{kind}"][j] = any(kind in f for f in faults)
        out["faulted"][j] = any(bool(f) for f in faults)
    return out


def step_records(trajs: Sequence[Trajectory], tasks: Sequence[Task], arrays: Mapping[str, np.ndarray],
                 order: Sequence[int], max_turns: int, views: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The records of a step's trajectories (this process's), in trajectory order. arrays: the
    step's per-row outputs for these rows, in batch order (row i holds trajs[order[i]]). views:
    the names of the teacher's views (the rows of token_teacher, e.g. "depth 1")."""
    if len(tasks) != len(trajs) or sorted(order) != list(range(len(trajs))):
        raise ValueError(f"{len(trajs)} trajectories, {len(tasks)} tasks, batch order {list(order)[:8]}...")
    where = np.argsort(np.asarray(order))  # trajectory i sits in batch row where[i]
    horizons = np.asarray(dependency_horizon(dependency_batch(trajs, max_turns))) if trajs else None
    gold: dict[str, list[int]] = {}  # per task: a group's rollouts share it
    for task in tasks:
        if task.task_id not in gold:
            gold[task.task_id] = gold_horizons(task) if task.gold_calls else []
    per = [turn_outcomes(t, task, max_turns, horizons[i], gold[task.task_id])
           for i, (t, task) in enumerate(zip(trajs, tasks))]
    rec: dict[str, np.ndarray] = {name: np.stack([p[name] for p in per]) for name in per[0]} if per else {}
    rec.update({
        "reward": np.asarray([t.reward for t in trajs], np.float32),
        "success": np.asarray([success(t) for t in trajs], bool),
        "episode_faulted": np.asarray([t.metrics.get("faulted_calls", 0.0) > 0 for t in trajs], bool),
        "num_turns": np.asarray([t.num_turns for t in trajs], np.int32),
        "task_id": np.asarray([str(t.task_id) for t in trajs]),
        "category": np.asarray([task.category for task in tasks]),
    })
    for key, value in arrays.items():
        name = key.split("/", 1)[1]
        if key.startswith("per_turn/"):
            rec[f"step_{name}"] = np.asarray(value)[where]
    teacher = arrays.get("per_token/teacher_logprobs")
    if teacher is not None:
        teacher = np.asarray(teacher)
        chunks_t, chunks_s, rows, turns = [], [], [], []
        for i, t in enumerate(trajs):
            n = int(t.policy_mask.sum())
            chunks_t.append(teacher[:, where[i], :n])
            chunks_s.append(t.old_logprobs[t.policy_mask])
            rows.append(np.full(n, i, np.int32))
            turns.append(t.turn_ids[t.policy_mask])
        if len(views) != teacher.shape[0]:
            raise ValueError(f"{teacher.shape[0]} teacher views but names {list(views)}")
        rec.update({"token_views": np.asarray(list(views)),
                    "token_teacher": np.concatenate(chunks_t, axis=1).astype(np.float32),
                    "token_student": np.concatenate(chunks_s).astype(np.float32),
                    "token_row": np.concatenate(rows), "token_turn": np.concatenate(turns).astype(np.int32)})
    return rec


def metric_sums(rec: Mapping[str, np.ndarray], depths: Sequence[int]) -> dict[str, tuple[float, float]]:
    """{metric: (numerator, denominator)} of the turn-level metrics, summable over processes:
    faults/* (share of tool turns with a fault, per kind), recovery/* (success rate of the
    episodes with >= 1 fault, and of those without), credit/* (mean per-turn advantage and, with
    TurnSight, weight on the faulted tool turns and on the other tool turns), horizon/* (mean
    chosen depth; the share of gold tool turns whose chosen depth is the one covering their gold
    dependency horizon, and whose trajectory horizon equals the gold one)."""
    out: dict[str, tuple[float, float]] = {}
    if not rec:
        return out
    tool = rec["has_calls"]
    n_tool = float(tool.sum())
    for kind in ("faulted",) + tuple(f"fault_{x}" for x in FAULT_KINDS):
        out[f"faults/{kind}_turns"] = (float((rec[kind] & tool).sum()), n_tool)
    ep = rec["episode_faulted"]
    out["recovery/success_faulted"] = (float((rec["success"] & ep).sum()), float(ep.sum()))
    out["recovery/success_clean"] = (float((rec["success"] & ~ep).sum()), float((~ep).sum()))
    for name in ("advantage", "weight"):
        v = rec.get(f"step_{name}")
        if v is None:
            continue
        for part, mask in (("faulted", tool & rec["faulted"]), ("clean", tool & ~rec["faulted"])):
            out[f"credit/{name}_{part}"] = (float(v[mask].sum()), float(mask.sum()))
    depth = rec.get("step_depth")
    if depth is not None:
        chosen = depth >= 1
        out["horizon/depth_mean"] = (float(depth[chosen & tool].sum()), float((chosen & tool).sum()))
        known = chosen & tool & (rec["gold_horizon"] >= 1)
        covering = np.asarray(depths)[np.asarray(depth_index(np.maximum(rec["gold_horizon"], 1), tuple(depths)))]
        out["horizon/depth_covers_gold"] = (float((known & (depth == covering)).sum()), float(known.sum()))
        out["horizon/rule_equals_gold"] = (float((known & (rec["horizon"] == rec["gold_horizon"])).sum()),
                                           float(known.sum()))
    return out


def ratios(sums: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """The metrics from metric_sums (after any summing): numerator / denominator, where the
    denominator is > 0."""
    return {k: n / d for k, (n, d) in sums.items() if d > 0}


def write(workdir: pathlib.Path, step: int, rec: Mapping[str, np.ndarray], process: int = 0,
          processes: int = 1) -> pathlib.Path:
    """<workdir>/turn_records/step_<step>.npz (one per process when there are several)."""
    folder = pathlib.Path(workdir) / RECORDS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (f"step_{step:06d}" + (f"_p{process}" if processes > 1 else "") + ".npz")
    np.savez_compressed(path, **rec)
    return path


def load(run_dir: pathlib.Path) -> list[tuple[int, dict[str, np.ndarray]]]:
    """The run's turn records, (step, arrays) in step order; ValueError naming the folder when
    there are none (the run did not set log.turn_records)."""
    folder = pathlib.Path(run_dir) / RECORDS_DIR
    files = sorted(folder.glob("step_*.npz"))
    if not files:
        raise ValueError(f"{folder}: no turn records (train with --config.log.turn_records=True)")
    out = []
    for f in files:
        with np.load(f) as z:
            out.append((int(f.stem.split("_")[1]), {k: z[k] for k in z.files}))
    return out
