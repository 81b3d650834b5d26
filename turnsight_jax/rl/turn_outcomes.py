"""What each turn was and what it received: the turn-level records and metrics of the studies
(docs/experiments.md); the trajectory records of the viewer are turnsight_jax.records.

Host side, from a step's trajectories, their tasks and, when the step returned them, its per-turn
summaries (rl.turn_records, metrics["records"]). Per turn (arrays [b, K], K = max_turns, b = this
process's trajectories in rollout order; 0 / -1 / False past a trajectory's turns):

* outcome (`turn_outcomes`): has_calls; errored (a malformed call, or a result that is FTRL's error
  text, as an unavailable tool's is); gold_match (every call is a call of the task's gold chain);
  gold_turn (the gold turn whose calls the turn's calls are, -1 none); gold_horizon (the dependency
  rule's h on the gold chain at that gold turn, rl.horizon.gold_horizons; -1 unknown); horizon
  (the rule's h on the trajectory itself); fault_wrong / fault_unavailable / fault_delay / faulted
  (envs.faults, from TurnRecord.env_info);
* received (`received`, from the step's summaries): step_advantage (the turn's mean Ã), and with
  TurnSight step_weight (mean w), step_delta_bar (δ̄*), step_depth (the chosen depth d*, a depth
  value; -1 for the mean fusion or where the turn's tokens chose differently) and step_horizon
  (the dependency rule's h inside the step; -1 for the other selections).

Per trajectory [b]: reward, success (the environment's answer_correct when it reports one, else
reward >= 1), episode_faulted (>= 1 fault), num_turns, task_id, category. Per policy token, with
log.turn_records and a teacher (ragged, concatenated over the trajectories in order, [n]):
token_teacher [R, n] (the teacher's log-probs of the sampled tokens under each view, the step's
own arrays), token_student [n] (the sampler's log-probs: δ's student side), token_row, token_turn;
token_views [R] names the views. Padding rows (rl.batch) are left out.

`write` stores one compressed .npz per step in <workdir>/turn_records/ (log.turn_records);
`metric_sums` gives the metrics' numerators and denominators so that the trainer can sum them
over processes.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Mapping, Sequence

import numpy as np

from turnsight_jax.chat.trajectory import Trajectory, is_padding
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


def received(summaries: Mapping, row: int, max_turns: int, depths: Sequence[int]) -> dict[str, np.ndarray]:
    """One batch row's per-turn values [K] from rl.turn_records' summaries (global rows, numpy)."""
    turns = summaries["turns"]
    count = np.asarray(turns["count"][row], np.float64)
    has = count > 0
    out = {}

    def mean(name):
        return np.where(has, np.asarray(turns[name]["sum"][row]) / np.maximum(count, 1), 0.0).astype(np.float32)

    def same(name):  # the value when every token of the turn has it, else -1
        lo, hi = np.asarray(turns[name]["min"][row]), np.asarray(turns[name]["max"][row])
        return np.where(has & (lo == hi), lo, -1).astype(np.int32)

    for name, field in (("adv", "advantage"), ("weight", "weight"), ("delta_star", "delta_bar")):
        if name in turns:
            out[f"step_{field}"] = mean(name)
    if "depth" in turns:
        idx = same("depth")
        out["step_depth"] = np.where(idx >= 0, np.asarray(depths, np.int32)[np.maximum(idx, 0)], -1).astype(np.int32)
    if "horizon" in turns:
        h = same("horizon")
        out["step_horizon"] = np.where(h >= 1, h, -1).astype(np.int32)
    return {k: v[:max_turns] for k, v in out.items()}


def step_records(trajs: Sequence[Trajectory], tasks: Sequence[Task], summaries: Mapping | None,
                 order: Sequence[int], max_turns: int, *, first_row: int = 0, depths: Sequence[int] = (1, 2, 3),
                 views: Sequence[str] = ()) -> dict[str, np.ndarray]:
    """The records of a step's trajectories (this process's; padding rows left out), in rollout
    order. summaries: the step's metrics["records"] on the host (global rows; None: outcomes
    only); order[i]: the trajectory in local batch row i (rl.batch.batch_row_order), global row
    first_row + i. views: the names of the teacher's views (rows of "teacher_logprobs")."""
    if len(tasks) != len(trajs) or sorted(order) != list(range(len(trajs))):
        raise ValueError(f"{len(trajs)} trajectories, {len(tasks)} tasks, batch order {list(order)[:8]}...")
    row_of = {int(t): first_row + i for i, t in enumerate(order)}  # trajectory -> its global batch row
    keep = [i for i, t in enumerate(trajs) if not is_padding(t)]
    trajs, tasks = [trajs[i] for i in keep], [tasks[i] for i in keep]
    rows = [row_of[i] for i in keep]
    horizons = np.asarray(dependency_horizon(dependency_batch(trajs, max_turns))) if trajs else None
    gold: dict[str, list[int]] = {}  # per task: a group's rollouts share it
    for task in tasks:
        if task.task_id not in gold:
            gold[task.task_id] = gold_horizons(task) if task.gold_calls else []
    per = [turn_outcomes(t, task, max_turns, horizons[i], gold[task.task_id])
           for i, (t, task) in enumerate(zip(trajs, tasks))]
    if summaries is not None:
        for p, row in zip(per, rows):
            p.update(received(summaries, row, max_turns, depths))
    rec: dict[str, np.ndarray] = {name: np.stack([p[name] for p in per]) for name in per[0]} if per else {}
    rec.update({
        "reward": np.asarray([t.reward for t in trajs], np.float32),
        "success": np.asarray([success(t) for t in trajs], bool),
        "episode_faulted": np.asarray([t.metrics.get("faulted_calls", 0.0) > 0 for t in trajs], bool),
        "num_turns": np.asarray([t.num_turns for t in trajs], np.int32),
        "task_id": np.asarray([str(t.task_id) for t in trajs]),
        "category": np.asarray([task.category for task in tasks]),
    })
    teacher = None if summaries is None else summaries.get("teacher_logprobs")
    if teacher is not None and trajs:
        teacher = np.asarray(teacher)
        if len(views) != teacher.shape[0]:
            raise ValueError(f"{teacher.shape[0]} teacher views but names {list(views)}")
        chunks_t, chunks_s, tok_rows, turns = [], [], [], []
        for i, (t, row) in enumerate(zip(trajs, rows)):
            n = int(t.policy_mask.sum())
            chunks_t.append(teacher[:, row, :n])
            chunks_s.append(t.old_logprobs[t.policy_mask])
            tok_rows.append(np.full(n, i, np.int32))
            turns.append(t.turn_ids[t.policy_mask])
        rec.update({"token_views": np.asarray(list(views)),
                    "token_teacher": np.concatenate(chunks_t, axis=1).astype(np.float32),
                    "token_student": np.concatenate(chunks_s).astype(np.float32),
                    "token_row": np.concatenate(tok_rows), "token_turn": np.concatenate(turns).astype(np.int32)})
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
