"""Adaptive hindsight horizons (rl.selection = "dependency" | "saturation"; docs/spec.md §1.5).

The paper fixes the depth set D_H = {1, 2, 3} and picks one depth per turn by a vote over the
gaps; it names an adaptive horizon as future work. Two state-based rules pick, per turn, how far
the hindsight extends:

* **dependency** (from the trajectory, not from the teacher): the block of turn k grows from k
  while the next turn's calls use a result already shown, and stops at the first later turn
  whose calls use none of them:

      h_k = 1 + #{consecutive j = k+1, k+2, ... with uses(j, {k, ..., j-1})}

  where uses(j, S) says that some argument of a call of turn j contains a value that a result of
  a turn in S returned (`turn_dependencies`, on the host). On a gold chain of n hops h_k is the
  rest of the chain, n - k; a wasted call whose result nothing uses gets h_k = 1. The depth used
  is the smallest configured depth >= h_k, or the largest when none is (`depth_index`).
* **saturation** (from the teacher's gaps): going through the configured depths in increasing
  order, the turn stops at the first depth d whose next depth changes its mean gap δ̄ by at most
  rl.horizon_tol nats per token (|δ̄^(next) − δ̄^(d)| <= tol: seeing more changes nothing the
  teacher says), else at the largest depth (`saturation_index`). Depths past the trajectory's end
  clip to the same block, so their gaps are equal and saturate.

What a result offers a later call (`result_values`): the result parsed as JSON when it is JSON,
its string and number leaves, else its stripped text; lower-cased; values shorter than two
characters are dropped, and so is everything from an error observation (FTRL's "an error occured
when call ..." text, a malformed call's message) and from a turn's faults (envs.faults) of kind
"unavailable". An argument uses a value when one of its string or number leaves, lower-cased,
equals it or contains it as a whole word.

The host computes uses(j, i) per trajectory as a [K, K] bool matrix; the batch carries it as
`TrainBatch.turn_uses [B, K, K]`, and `dependency_horizon` turns it into h [B, K] inside the step
(pure jax.numpy, like the rest of TurnSight's selection).
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Sequence

import jax.numpy as jnp
import numpy as np

from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import CallError, Task, ToolCall
from turnsight_jax.envs.executor import ERROR_TEMPLATE

ERROR_PREFIX = ERROR_TEMPLATE.split("{name}")[0]  # FTRL's error observation starts so
MIN_VALUE_CHARS = 2


def _leaves(x: Any) -> Iterable[str]:
    """String and number leaves of a decoded JSON value, as text."""
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)
    elif isinstance(x, bool) or x is None:
        return
    elif isinstance(x, (str, int, float)):
        yield str(x)


def result_values(text: str) -> set[str]:
    """The values a tool result offers a later call (lower-cased; see the module docstring)."""
    text = text.strip()
    if text.startswith(ERROR_PREFIX):
        return set()
    try:
        decoded = json.loads(text)
        values = list(_leaves(decoded)) if isinstance(decoded, (dict, list, str, int, float)) else [text]
    except (ValueError, RecursionError):
        values = [text]
    return {v.strip().lower() for v in values if len(v.strip()) >= MIN_VALUE_CHARS}


def argument_values(call: ToolCall) -> list[str]:
    """A call's string and number argument leaves, lower-cased."""
    return [v.strip().lower() for v in _leaves(call.arguments)]


def uses_value(argument: str, value: str) -> bool:
    """Whether an argument leaf equals a result value or contains it as a whole word."""
    return argument == value or re.search(r"(?<!\w)" + re.escape(value) + r"(?!\w)", argument) is not None


def turn_dependencies(traj: Trajectory, faults: Sequence[Sequence[Sequence[str]]] | None = None) -> np.ndarray:
    """[K, K] bool: uses[j, i] for i < j, some call of turn j uses a value a result of turn i gave.
    faults: per turn, per call, the kinds of fault injected (envs.faults; the turn records'
    env_info["faults"] when None): an "unavailable" result offers nothing."""
    k = traj.num_turns
    offered: list[set[str]] = []
    for t, turn in enumerate(traj.turns):
        vals: set[str] = set()
        turn_faults = faults[t] if faults is not None else turn.env_info.get("faults", ())
        for c, (call, result) in enumerate(zip(turn.calls, turn.results)):
            if isinstance(call, CallError) or (c < len(turn_faults) and "unavailable" in turn_faults[c]):
                continue
            vals |= result_values(result)
        offered.append(vals)
    uses = np.zeros((k, k), bool)
    for j, turn in enumerate(traj.turns):
        args = [a for call in turn.calls if isinstance(call, ToolCall) for a in argument_values(call)]
        for i in range(j):
            uses[j, i] = any(uses_value(a, v) for a in args for v in offered[i])
    return uses


def dependency_batch(trajs: Sequence[Trajectory], max_turns: int) -> np.ndarray:
    """turn_uses [B, K] x K bool (K = max_turns) of a batch; turns past a trajectory's end use nothing."""
    out = np.zeros((len(trajs), max_turns, max_turns), bool)
    for b, traj in enumerate(trajs):
        if traj.num_turns > max_turns:
            raise ValueError(f"trajectory {b} has {traj.num_turns} turns, over max_turns {max_turns}")
        n = traj.num_turns
        out[b, :n, :n] = turn_dependencies(traj)
    return out


def gold_dependencies(task: Task) -> np.ndarray:
    """[G+1, G+1] bool of the task's gold chain (G gold tool turns, then the answer turn): gold
    turn j uses gold turn i when an argument of a call of turn j contains one of the outputs the
    task lists for turn i's tools (Task.unsolved_set)."""
    if task.gold_calls is None:
        raise ValueError(f"task {task.task_id} has no gold calls")
    turns = list(task.gold_calls)
    g = len(turns)
    offered = [{v.strip().lower() for c in turn for v in task.unsolved_set.get(c["name"], ())
                if len(v.strip()) >= MIN_VALUE_CHARS} for turn in turns]
    uses = np.zeros((g + 1, g + 1), bool)
    for j, turn in enumerate(turns):
        args = [v.strip().lower() for c in turn for v in _leaves(c["arguments"])]
        for i in range(j):
            uses[j, i] = any(uses_value(a, v) for a in args for v in offered[i])
    return uses


def gold_horizons(task: Task) -> list[int]:
    """The dependency rule's h on the task's gold chain, one per gold turn and the answer turn (a
    built-in chain of n hops: n, n-1, ..., 1, then 1)."""
    uses = gold_dependencies(task)
    return [int(h) for h in np.asarray(dependency_horizon(jnp.asarray(uses)[None]))[0]]


# ---- inside the step (jax.numpy) ----

def dependency_horizon(turn_uses) -> jnp.ndarray:
    """h [B, K] int32 of the dependency rule from turn_uses [B, K, K] bool (uses[b, j, i]: turn j
    uses turn i's results; only i < j is read)."""
    uses = jnp.asarray(turn_uses, bool)
    _, k, _ = uses.shape
    later = jnp.arange(k)[None, :] > jnp.arange(k)[:, None]  # [i, j]: j after i
    uses = uses & later.T[None]  # [b, j, i], i < j
    # shown(k, j): turn j uses a result of one of turns k .. j-1 = a suffix count over i >= k
    suffix = jnp.flip(jnp.cumsum(jnp.flip(uses.astype(jnp.int32), axis=2), axis=2), axis=2)  # [b, j, i>=]
    reach = jnp.swapaxes(suffix, 1, 2) > 0  # [b, k, j]
    run = jnp.cumprod(jnp.where(later[None], reach, True).astype(jnp.int32), axis=2)  # still extending at j
    return (1 + jnp.sum(jnp.where(later[None], run, 0), axis=2)).astype(jnp.int32)


def depth_index(horizon, depths: Sequence[int]) -> jnp.ndarray:
    """The index into `depths` (the configured depth set, any order) of the smallest depth >= h,
    or of the largest depth when none is; `horizon` int [...] -> int32 [...]."""
    d = jnp.asarray(depths, jnp.int32)
    h = jnp.asarray(horizon, jnp.int32)[..., None]
    fits = d >= h
    smallest_fit = jnp.argmin(jnp.where(fits, d, jnp.iinfo(jnp.int32).max), axis=-1)
    return jnp.where(jnp.any(fits, axis=-1), smallest_fit, jnp.argmax(d)).astype(jnp.int32)


def saturation_index(x, depths: Sequence[int], tol) -> jnp.ndarray:
    """The saturation rule: x [D, U] mean gaps per configured depth (config order) -> the index
    of the first depth, in increasing depth order, whose next depth moves x by at most `tol`; the
    largest depth when none does. int32 [U]."""
    order = np.argsort(np.asarray(depths), kind="stable")
    xs = jnp.asarray(x)[order]  # [D, U], increasing depth
    flat = jnp.abs(xs[1:] - xs[:-1]) <= tol  # [D-1, U]
    stop = jnp.concatenate([flat, jnp.ones((1, xs.shape[1]), bool)], axis=0)
    return jnp.asarray(order, jnp.int32)[jnp.argmax(stop, axis=0)]
