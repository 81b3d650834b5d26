"""Packed privileged views (docs/baselines.md): the teacher's rows of RLSD, SDPO, SDAR and SOD.

The same `PackedViews` contract as the hindsight views (rl.views), with one view (plus the
reference row when built `with_reference`). One packed row per trajectory holds:

  [original trajectory (segment 0)]
  placement "prompt": [block + trajectory[hs:L-1]]   reads original[:hs], hs = turn 0's header
  placement "turn":   for each turn k with a block,
                      [block_k + trajectory[header_k : policy_end_k - 1]]   reads original[:header_k]

so every policy token sees exactly what it sees in the plain sequence original[:hs] + block +
original[hs:] (rotary positions continue from hs), and the prompt is never copied. A trajectory
(or turn) without a block keeps the student's own context (its predictors stay in segment 0) and
is marked uncovered (`PackedViews.covered`).

Trajectories whose turns saw elided observations (an observation window, methods.mm_grpo) are
refused: the blocks are placed on the trajectory itself, not on each turn's context.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from turnsight_jax.chat.hindsight_template import DEFAULT_FILLER
from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.errors import ConfigError
from turnsight_jax.models.attention import Layout
from turnsight_jax.rl.context_rows import context_row, has_elisions
from turnsight_jax.methods.privileged_blocks import (PLACEMENTS, PRIVILEGED_SOURCES, default_skills_path, load_skills,
                                                     privileged_blocks)
from turnsight_jax.rl.config import check_budget, register_config_section, section_settings
from turnsight_jax.rl.views import (DEFAULT_PACKED_BUCKETS, PackedViews, ViewRequest, _distinct_predictors, _Row,
                                    pick_bucket, policy_positions, register_view_builder, view_token_kinds)


def build_privileged_views(
    trajs: Sequence[Trajectory],
    tokenizer,
    blocks: Sequence | None,
    *,
    placement: str,
    with_reference: bool = False,
    positions: tuple[np.ndarray, np.ndarray] | None = None,
    policy_width: int | None = None,
    buckets: Sequence[int] = DEFAULT_PACKED_BUCKETS,
    min_widths: tuple[int, int] = (0, 0),
) -> tuple[PackedViews, dict[str, float]]:
    """Packed rows of the privileged views (numpy). blocks: methods.privileged_blocks.privileged_blocks'
    output (per trajectory ids or None for "prompt"; per turn for "turn"), or None for no
    privileged context by design (privileged.source='none': another model reads the student's own
    context, every policy token covered, nothing counted as skipped). Returns (views, stats):
    views.view_pred [R, B, N] with R = 1 (+1 reference row), views.covered [B, N] bool; stats count
    the packed tokens, the views built and skipped."""
    del tokenizer  # the blocks are already token ids; kept for build_views' signature
    if placement not in ("prompt", "turn"):
        raise ValueError(f"unknown privileged placement {placement!r}; expected one of ('prompt', 'turn')")
    if blocks is None:
        views, stats = build_privileged_views(trajs, None, [None] * len(trajs), placement="prompt",
                                              with_reference=with_reference, positions=positions,
                                              policy_width=policy_width, buckets=buckets, min_widths=min_widths)
        stats = {k: v for k, v in stats.items() if k not in ("views_built", "views_skipped")}
        return views.replace(covered=_policy_valid(trajs, positions, policy_width)), stats
    if len(blocks) != len(trajs):
        raise ValueError(f"{len(trajs)} trajectories but {len(blocks)} privileged blocks")
    windowed = [b for b, t in enumerate(trajs) if has_elisions(t)]
    if windowed:
        raise ValueError(f"privileged views: trajectory {windowed[0]}'s turns saw elided observations (an observation "
                         f"window, methods.mm_grpo); privileged blocks are placed on the whole trajectory only")
    pol_pos, pol_valid = positions if positions is not None else policy_positions(trajs, policy_width)
    n_views = 1 + int(with_reference)
    view_pred = np.zeros((n_views, len(trajs), pol_pos.shape[1]), np.int32)
    covered = np.zeros(pol_pos.shape, bool)
    rows, built, skipped = [], 0, 0
    block_tokens = copy_tokens = 0
    for b, (traj, blk) in enumerate(zip(trajs, blocks)):
        row = _Row(context_row(traj))
        where = {int(p): j for j, p in enumerate(pol_pos[b, : int(pol_valid[b].sum())])}
        for p, j in where.items():
            view_pred[:, b, j] = p - 1  # the student's own context (the reference row keeps it)
        if placement == "prompt":
            spans = [(blk, traj.turns[0].header_start if traj.turns else traj.prompt_len, traj.length - 1,
                      range(traj.prompt_len, traj.length))]
        else:
            if len(blk) != traj.num_turns:
                raise ValueError(f"trajectory {b} has {traj.num_turns} turns but {len(blk)} privileged blocks")
            spans = [(bk, t.header_start, t.policy_end - 1, range(t.policy_start, t.policy_end))
                     for bk, t in zip(blk, traj.turns)]
        for ids, hs, end, scored in spans:
            if ids is None or not len(ids):
                skipped += 1
                continue
            built += 1
            _, start = row.add(list(ids) + [int(x) for x in traj.tokens[hs:end]], hs, hs)
            block_tokens += len(ids)
            copy_tokens += end - hs
            for p in scored:
                j = where.get(p)
                if j is not None:
                    view_pred[0, b, j] = start + len(ids) + (p - 1 - hs)
                    covered[b, j] = True
        rows.append(row)
    width = pick_bucket(max([r.length for r in rows] + [min_widths[0]]), buckets, "packed privileged row")
    tok, pos, seg, c1s, c1e, c2s, c2e = [np.stack(c) for c in zip(*(r.arrays(width) for r in rows))]
    pred, pred_target, slot = _distinct_predictors([t.tokens for t in trajs], view_pred, pol_pos, pol_valid,
                                                   min_widths[1])
    views = PackedViews(tok, Layout(pos, seg, c1s, c1e, c2s, c2e), view_pred, pred, pred_target, slot,
                        covered=covered)
    own, packed = sum(t.length for t in trajs), sum(r.length for r in rows)
    stats = {"view_tokens": float(packed), "trajectory_tokens": float(own), "view_overhead": packed / max(own, 1),
             "packed_width": float(width), "teacher_rows": float(pol_valid.sum() * n_views),
             "teacher_distinct_rows": float(sum(len(set(view_pred[:, b, pol_valid[b]].ravel()))
                                                for b in range(len(trajs)))),
             "views_built": float(built), "views_skipped": float(skipped),
             **view_token_kinds(own, block_tokens, copy_tokens)}
    return views, stats


def _policy_valid(trajs, positions, policy_width) -> np.ndarray:
    return np.asarray((positions if positions is not None else policy_positions(trajs, policy_width))[1], bool)


# ---- the "privileged" teacher kind: its config section and its view builder ----

@dataclasses.dataclass(frozen=True)
class PrivilegedConfig:
    """The run config's `privileged.*` section: what the privileged teacher's view shows (RLSD,
    SDPO, SDAR, SOD; who scores it is teacher.weights)."""

    source: str = "gold_answer"  # the block: gold_answer | sibling | feedback | skill | none (the student's own context)
    placement: str = "prompt"  # prompt (once, after the prompt) | turn (before every turn)
    skills: str = ""  # source=skill: JSON file {task category: skill text}; "": the bundled skills
    sibling_min_reward: float = 1.0  # source=sibling: a sibling rollout counts as successful at this reward or above
    block_budget: int = 0  # every block exactly this many tokens (content cut to its head, or padded; chat.budget); 0: off
    block_filler: str = DEFAULT_FILLER  # the text that pads a block to the budget

    def validate(self) -> "PrivilegedConfig":
        if self.source not in PRIVILEGED_SOURCES:
            raise ConfigError(f"privileged.source must be one of {PRIVILEGED_SOURCES}, got {self.source!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"privileged.placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if not isinstance(self.skills, str):
            raise ConfigError(f"privileged.skills must be a path (a string; '': the bundled skills), got {self.skills!r}")
        if isinstance(self.sibling_min_reward, bool) or not isinstance(self.sibling_min_reward, (int, float)):
            raise ConfigError(f"privileged.sibling_min_reward must be a number, got {self.sibling_min_reward!r}")
        check_budget(self.block_budget, self.block_filler, "privileged.block_budget", "privileged.block_filler")
        return self


def _check_section(cfg, stages, check_data: bool) -> None:
    """The section's values whatever method runs (a bad value never waits unseen), and its skills
    file read before anything runs when a stage's privileged teacher shows skills (source=skill)."""
    settings = section_settings(PrivilegedConfig, cfg.privileged, "privileged", "a privileged-view")
    if not settings.skills:
        return
    for sc, method in stages:
        if method.needs_views and method.teacher == "privileged" and sc.algo.section("privileged").source == "skill":
            try:
                load_skills(settings.skills)
            except (OSError, ValueError) as e:
                raise ConfigError(f"privileged.skills: {e}") from None
            return


register_config_section("privileged", PrivilegedConfig, _check_section)


@functools.lru_cache(maxsize=8)
def _skills(path: str) -> dict[str, str]:
    """privileged.skills' texts ("": the bundled file), read once per run."""
    return load_skills(path or default_skills_path())


def _privileged_views(req: ViewRequest):
    """One view: the student's context plus the block privileged.source gives, at privileged.placement."""
    pv, trajs = req.cfg.algo.section("privileged"), req.trajs
    blocks = None if pv.source == "none" else privileged_blocks(
        trajs, req.tasks, req.tokenizer, source=pv.source, placement=pv.placement,
        skills=_skills(pv.skills) if pv.source == "skill" else None, rewards=[float(t.reward) for t in trajs],
        group_ids=[t.group_id for t in trajs], min_reward=pv.sibling_min_reward, budget=pv.block_budget,
        filler=pv.block_filler)
    return build_privileged_views(trajs, req.tokenizer, blocks, placement=pv.placement,
                                  with_reference=req.with_reference, positions=(req.policy_positions, req.pol_valid),
                                  buckets=req.buckets, min_widths=req.min_widths)


register_view_builder("privileged", _privileged_views)
