"""Trajectories -> the fixed-shape TrainBatch the compiled step consumes (host side, numpy)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from turnsight_jax.chat.trajectory import DEFAULT_BUCKETS, Trajectory, make_batch
from turnsight_jax.train_step import ConfigError, StepConfig, TrainBatch
from turnsight_jax.views import DEFAULT_PACKED_BUCKETS, ViewOptions, build_views, policy_bucket, policy_positions


def _group_index(trajs: Sequence[Trajectory], group_size: int) -> np.ndarray:
    """Group ids renumbered 0..B/G-1 in order of appearance; every group must hold G rows."""
    index: dict[int, int] = {}
    ids = np.array([index.setdefault(t.group_id, len(index)) for t in trajs], np.int32)
    counts = np.bincount(ids)
    bad = np.flatnonzero(counts != group_size)
    if bad.size:
        raise ConfigError(f"group {bad[0]} has {counts[bad[0]]} trajectories, expected group_size={group_size}")
    return ids


def make_train_batch(
    trajs: Sequence[Trajectory],
    tokenizer,
    cfg: StepConfig,
    *,
    gold_answers: Sequence[str | None] | None = None,
    length_buckets: Sequence[int] = DEFAULT_BUCKETS,
    packed_buckets: Sequence[int] = DEFAULT_PACKED_BUCKETS,
    pad_id: int = 0,
    min_shapes: dict[str, int] | None = None,
) -> tuple[TrainBatch, dict[str, float]]:
    """Assemble a TrainBatch (numpy arrays) and stats (token counts, view overhead).

    min_shapes: floors for the bucketed widths {"T", "N", "P", "U"}; the trainer passes the
    largest widths seen so far, so shapes only grow and the step compiles a handful of times.
    The widths used are returned in stats as T/N/P/U."""
    cfg.validate(len(trajs))
    floor = {"T": 0, "N": 0, "P": 0, "U": 0, **(min_shapes or {})}
    longest = max(t.length for t in trajs)
    buckets = [b for b in length_buckets if b >= max(floor["T"], 1)] or list(length_buckets)
    tb = make_batch(trajs, buckets=buckets if longest <= buckets[-1] else length_buckets, pad_id=pad_id,
                    num_turns_bucket=cfg.max_turns)
    pol_pos, pol_valid = policy_positions(
        trajs, max(policy_bucket(max(int(t.policy_mask.sum()) for t in trajs)), floor["N"]))
    rows = np.arange(len(trajs))[:, None]
    turn_ids = np.where(pol_valid, np.asarray(tb.turn_ids)[rows, pol_pos], -1).astype(np.int32)
    old_lp = np.where(pol_valid, np.asarray(tb.old_logprobs)[rows, pol_pos], 0.0).astype(np.float32)
    views = None
    stats = {"trajectory_tokens": float(sum(t.length for t in trajs)), "policy_tokens": float(pol_valid.sum()),
             "batch_width": float(tb.tokens.shape[1]), "policy_width": float(pol_pos.shape[1]),
             "T": float(tb.tokens.shape[1]), "N": float(pol_pos.shape[1])}
    if cfg.algo.uses_views:
        a = cfg.algo
        views, vstats = build_views(
            trajs, tokenizer,
            options=ViewOptions(depths=tuple(a.depths), source=a.source, turns=a.turns),
            gold_answers=gold_answers, policy_width=pol_pos.shape[1], buckets=packed_buckets,
            with_reference=bool(cfg.loss.kl_coef), min_widths=(floor["P"], floor["U"]),
        )
        stats.update(vstats)
        stats["P"], stats["U"] = float(views.tokens.shape[1]), float(views.pred.shape[1])
    batch = TrainBatch(
        tokens=np.asarray(tb.tokens, np.int32),
        valid=np.asarray(tb.valid_mask, bool),
        pol_pos=pol_pos,
        pol_valid=pol_valid,
        turn_ids=turn_ids,
        old_logprobs=old_lp,
        group_ids=_group_index(trajs, cfg.group_size),
        rewards=np.asarray([t.reward for t in trajs], np.float32),
        num_turns=np.asarray([t.num_turns for t in trajs], np.int32),
        turn_rewards=np.asarray(tb.turn_rewards, np.float32),
        views=views,
    )
    return batch, stats
