"""The row a trajectory is scored on when its turns saw different contexts: an observation window
(methods.mm_grpo, docs/rollout_methods.md) elided older observations from some turns' contexts.

Turn k of such a trajectory saw the trajectory with its first e_k observations replaced by the
placeholder (`chat.trajectory.turn_context`; e_k = Trajectory.contexts.counts[k], non-decreasing).
The student's training forward must score each turn under exactly that context, or its
log-probs are not the sampler's. One row holds every turn under its own context:

  segment 0   the last turn's context and the last turn: the trajectory with its first e_last
              observations elided, positions 0, 1, ...; it scores every turn whose context is a
              prefix of it (turn 0, the last turn, any turn with the same elisions)
  segment s   one per elision count e of the other turns: the trajectory from observation e (in
              full) to the end of the last turn with count e; it reads segment 0 before the
              placeholder of observation e (context 1 of models.attention.Layout), and its
              positions continue from there

so every policy token reads exactly its turn's context, at the rotary positions it had there
(the packed mask of models.attention.packed_mask), and its predictor is the token before it in
its segment. With a window of n observations, segment s holds n observations and the turns
between them, so a row is at most the trajectory's tokens n + 1 times (with the placeholders);
with n = 1 about the trajectory plus one observation and one turn per elision.

A trajectory without elisions is its own row, unchanged (segment 0 alone, every index its own).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from turnsight_jax.chat.trajectory import Trajectory, observation_turns
from turnsight_jax.models.attention import NO_SEGMENT


@dataclasses.dataclass(frozen=True)
class TurnPrefix:
    """What precedes turn k's assistant header in its context, in row terms: segment 0 before
    index `read`, then the ids `rest` (the rest of its context up to its header; empty when the
    turn is scored in segment 0), the header at position `header` = read + len(rest)."""

    read: int
    rest: np.ndarray
    header: int


@dataclasses.dataclass(frozen=True)
class ContextRow:
    """One trajectory's row. tokens, positions, segment_ids, ctx1_segment, ctx1_end: [R] int32,
    the Layout fields of the row (context 2 unused); index [L] int32: the row index of each
    policy-token position of the trajectory, -1 elsewhere; prefixes: one TurnPrefix per turn."""

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    ctx1_segment: np.ndarray
    ctx1_end: np.ndarray
    index: np.ndarray
    prefixes: tuple[TurnPrefix, ...]

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def segments(self) -> int:
        return int(self.segment_ids.max()) + 1


def has_elisions(traj: Trajectory) -> bool:
    """Whether some turn of `traj` saw an elided observation (its row then has several segments)."""
    return traj.contexts is not None and any(traj.contexts.counts)


def context_row(traj: Trajectory) -> ContextRow:
    """The row of `traj` (module docstring)."""
    n = traj.length
    empty = np.zeros(0, np.int32)
    if not has_elisions(traj):
        index = np.where(traj.policy_mask, np.arange(n, dtype=np.int32), -1).astype(np.int32)
        return ContextRow(traj.tokens, np.arange(n, dtype=np.int32), np.zeros(n, np.int32),
                          np.full(n, NO_SEGMENT, np.int32), np.zeros(n, np.int32), index,
                          tuple(TurnPrefix(t.header_start, empty, t.header_start) for t in traj.turns))
    counts = traj.contexts.counts
    placeholder = np.asarray(traj.contexts.placeholder_ids, np.int32)
    obs = observation_turns(traj)
    last = counts[-1]
    # segment 0: the trajectory with its first `last` observations replaced by the placeholder
    parts, where0 = [], np.full(n, -1, np.int32)  # where0: segment-0 index of each kept position
    placeholder_at = []  # segment-0 index where each elided observation's placeholder starts
    x = r = 0
    for j in obs[:last]:
        t = traj.turns[j]
        where0[x:t.obs_start] = r + np.arange(t.obs_start - x)
        parts += [traj.tokens[x:t.obs_start], placeholder]
        r += t.obs_start - x
        placeholder_at.append(r)
        r += placeholder.size
        x = t.obs_end
    where0[x:] = r + np.arange(n - x)
    parts.append(traj.tokens[x:])
    seg0 = np.concatenate(parts).astype(np.int32)
    cols = {"tokens": [seg0], "positions": [np.arange(seg0.size, dtype=np.int32)],
            "segment_ids": [np.zeros(seg0.size, np.int32)], "ctx1_segment": [np.full(seg0.size, NO_SEGMENT, np.int32)],
            "ctx1_end": [np.zeros(seg0.size, np.int32)]}
    length = seg0.size
    index = np.full(n, -1, np.int32)
    prefixes: list[TurnPrefix | None] = [None] * traj.num_turns
    by_count: dict[int, list[int]] = {}
    for k, t in enumerate(traj.turns):
        before = sum(j < k for j in obs)
        if counts[k] == min(last, before):  # its context is a prefix of segment 0
            index[t.policy_start:t.policy_end] = where0[t.policy_start:t.policy_end]
            header = int(where0[t.policy_start]) - (t.policy_start - t.header_start)
            prefixes[k] = TurnPrefix(header, empty, header)
        else:  # counts[k] < min(last, before): observation counts[k] is full here, elided in segment 0
            by_count.setdefault(counts[k], []).append(k)
    for s, (e, turns) in enumerate(sorted(by_count.items()), start=1):
        start = traj.turns[obs[e]].obs_start  # where this context leaves segment 0's
        end = max(traj.turns[k].policy_end for k in turns)
        read = placeholder_at[e]
        m = end - start
        cols["tokens"].append(traj.tokens[start:end])
        cols["positions"].append(read + np.arange(m, dtype=np.int32))
        cols["segment_ids"].append(np.full(m, s, np.int32))
        cols["ctx1_segment"].append(np.zeros(m, np.int32))
        cols["ctx1_end"].append(np.full(m, read, np.int32))
        for k in turns:
            t = traj.turns[k]
            index[t.policy_start:t.policy_end] = length + np.arange(t.policy_start - start, t.policy_end - start)
            rest = traj.tokens[start:t.header_start].astype(np.int32)
            prefixes[k] = TurnPrefix(read, rest, read + rest.size)
        length += m
    row = {k: np.concatenate(v).astype(np.int32) for k, v in cols.items()}
    return ContextRow(**row, index=index, prefixes=tuple(prefixes))


def row_policy_positions(rows, x_pos: np.ndarray, x_valid: np.ndarray) -> np.ndarray:
    """The row indices [B, N] int32 of policy positions given in trajectory coordinates
    (x_pos [B, N] from rl.views.policy_positions; 0 on padding slots)."""
    out = np.zeros_like(x_pos)
    for b, row in enumerate(rows):
        out[b] = np.where(x_valid[b], row.index[x_pos[b]], 0)
    return out.astype(np.int32)
