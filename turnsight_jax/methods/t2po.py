"""T2PO: hesitation-driven rollout hooks (docs/rollout_methods.md, "T2PO"). No change to reward,
advantage or loss: the controller changes what is sampled, and any method trains on the result
(`rl.rollout=t2po` over GRPO, MatchTIR, TurnSight, ...).

Hesitation per policy token, M_t = alpha * H~_t + (1 - alpha) * C~_t: H_t the entropy of the
policy's (tempered, untruncated) distribution at t, C_t the mean negative log-prob of its top-j
tokens, both computed inside the compiled decode (rollout.control.DecodeSignals) and min-max
normalised along the trajectory *so far* (a running min and max over its policy tokens up to t:
the rollout cannot see later tokens; 0 while max = min).

* **TTI** (token level): within a turn's thinking (from the turn's first token until it writes
  `</think>` or `<tool_call>`; rollout.enable_thinking must be on), Delta_t = |M_t - M_{t-1}|
  between consecutive tokens of the turn; when the mean of the last N deltas falls below
  `tti_threshold`, thinking is stalling: `</think>` is forced as the next token (its log-prob the
  policy's, so the trajectory stays on-policy-scored and trains like any token). At most once per
  trajectory.
* **TDS** (turn level): Phi^k = the geometric mean of M_t over turn k's tokens (M floored at
  `phi_floor`: a normalised M is 0 at the running minimum); when Gamma^k = |Phi^k - Phi^{k-1}| <
  `tds_threshold` (k >= 1), turn k is sampled again from the state it started in (the engine rolls
  the sequence back to the turn's first slot; this controller restores its running statistics and
  TTI flag to the turn start), at most `tds_max_resamples` times per trajectory; the last sample
  is kept.

What is computed where: H_t and C_t (sums over the vocabulary) in the decode; M_t, the running
min/max, the TTI window and Phi^k on the host, on each chunk's returned [n] arrays (vectorised per
chunk). The controller's counts go to the rollout's stats under "t2po/".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from turnsight_jax import distributed
from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.chat.types import Task
from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.config import section_settings
from turnsight_jax.rl.episodes import run_episodes
from turnsight_jax.rollout.control import ENTROPY, TOP_J_NLL, Chunk, DecodeSignals, Edit, EngineController
from turnsight_jax.rollout.driver import RolloutResult
from turnsight_jax.rollout.engine import PagedEngine


@dataclasses.dataclass(frozen=True)
class T2POConfig:
    """The run config's t2po.* keys (each documented below; the section `config.base_config` generates from these fields)."""

    alpha: float = 0.5  # hesitation M = alpha * entropy~ + (1 - alpha) * top-j NLL~ (each min-max normalised along the trajectory so far)
    top_j: int = 5  # j: C is the mean negative log-prob of the policy's j most likely tokens (paper silent)
    tti: bool = True  # TTI: force </think> when thinking stalls (once per trajectory; needs rollout.enable_thinking)
    tti_window: int = 8  # N: TTI looks at the mean of the last N |M_t - M_t-1| of the turn's thinking (paper silent)
    tti_threshold: float = 0.05  # ... and fires when it is below this (paper silent)
    tds: bool = True  # TDS: sample turn k again when |Phi^k - Phi^k-1| is below tds_threshold (Phi: geometric mean of M over the turn)
    tds_threshold: float = 0.02  # (paper silent)
    tds_max_resamples: int = 2  # re-samples per trajectory at most (the last sample is kept)
    phi_floor: float = 1e-3  # M floored at this in Phi's geometric mean (a normalised M is 0 at the running minimum)

    def validate(self) -> "T2POConfig":
        for name in ("tti", "tds"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"t2po.{name} must be True or False, got {getattr(self, name)!r}")
        if not (isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0):
            raise ConfigError(f"t2po.alpha must be in [0, 1], got {self.alpha!r}")
        for name, low in (("top_j", 1), ("tti_window", 1), ("tds_max_resamples", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ConfigError(f"t2po.{name} must be an int >= {low}, got {v!r}")
        for name in ("tti_threshold", "tds_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"t2po.{name} must be a finite number >= 0, got {v!r}")
        if isinstance(self.phi_floor, bool) or not isinstance(self.phi_floor, (int, float)) or not 0 < self.phi_floor <= 1:
            raise ConfigError(f"t2po.phi_floor must be in (0, 1], got {self.phi_floor!r}")
        if not (self.tti or self.tds):
            raise ConfigError("t2po.tti and t2po.tds are both False: the t2po controller would do nothing")
        return self


# ---- the hesitation signal (pure functions on one row's stream) ----

@dataclasses.dataclass
class Running:
    """The running min and max of H and C over a trajectory's policy tokens so far."""

    h_lo: float = math.inf
    h_hi: float = -math.inf
    c_lo: float = math.inf
    c_hi: float = -math.inf


def hesitation(h: np.ndarray, c: np.ndarray, run: Running, alpha: float) -> tuple[np.ndarray, Running, list[Running]]:
    """M [n] of n consecutive tokens given the statistics before them, the statistics after them,
    and after each of them (to commit a prefix). h, c [n] float: entropies and top-j NLLs."""
    h, c = np.asarray(h, np.float64), np.asarray(c, np.float64)

    def norm(x, lo, hi):
        lo_t = np.minimum.accumulate(np.concatenate([[lo], x]))[1:]
        hi_t = np.maximum.accumulate(np.concatenate([[hi], x]))[1:]
        span = hi_t - lo_t
        return np.where(span > 0, (x - lo_t) / np.where(span > 0, span, 1.0), 0.0), lo_t, hi_t

    hn, h_lo, h_hi = norm(h, run.h_lo, run.h_hi)
    cn, c_lo, c_hi = norm(c, run.c_lo, run.c_hi)
    m = alpha * hn + (1.0 - alpha) * cn
    after = [Running(float(a), float(b), float(d), float(e)) for a, b, d, e in zip(h_lo, h_hi, c_lo, c_hi)]
    return m, (after[-1] if after else dataclasses.replace(run)), after


def tti_fire(m_turn: np.ndarray, first: int, window: int, threshold: float) -> int:
    """The first index t >= first of a turn's M values [T] where the mean of the last `window`
    deltas |M_t - M_{t-1}| (within the turn) is below `threshold`; -1 if none."""
    m = np.asarray(m_turn, np.float64)
    if m.size <= window:
        return -1
    d = np.abs(np.diff(m))  # d[t-1] = Delta_t
    csum = np.concatenate([[0.0], np.cumsum(d)])
    t = np.arange(window, m.size)  # Delta_{t-window+1..t} = d[t-window .. t-1]
    means = (csum[t] - csum[t - window]) / window
    hit = np.flatnonzero((means < threshold) & (t >= first))
    return int(t[hit[0]]) if hit.size else -1


def turn_phi(m_turn: np.ndarray, floor: float) -> float:
    """Phi^k: the geometric mean of a turn's M values, each floored at `floor`."""
    m = np.maximum(np.asarray(m_turn, np.float64), floor)
    return float(np.exp(np.mean(np.log(m)))) if m.size else floor


@dataclasses.dataclass
class _Row:
    run: Running = dataclasses.field(default_factory=Running)
    turn_m: list[float] = dataclasses.field(default_factory=list)  # this turn (attempt)'s M values
    thinking: bool = True
    tti_used: bool = False
    phi_prev: float | None = None
    resamples: int = 0
    at_turn_start: tuple[Running, bool] = dataclasses.field(default_factory=lambda: (Running(), False))


class T2POController(EngineController):
    """The engine controller of T2PO (module docstring). `stats` counts what it did:
    tti_triggers, tds_resamples, and the trajectories' Phi / Gamma for the metrics."""

    def __init__(self, cfg: T2POConfig, tokenizer, *, enable_thinking: bool):
        if cfg.tti and not enable_thinking:
            raise ConfigError("t2po.tti forces </think>: it needs rollout.enable_thinking=True (with thinking off the "
                              "prompt closes the think block itself); set t2po.tti=False to run TDS alone")
        self.cfg = cfg
        self.signals = DecodeSignals(entropy=True, top_j=cfg.top_j)
        self.think_close = tok_lib.token_id(tokenizer, "</think>")
        self.thinking_ends = {self.think_close, tok_lib.token_id(tokenizer, "<tool_call>")}
        self.stop = {tok_lib.im_end_id(tokenizer), tok_lib.endoftext_id(tokenizer)}
        self.rows: dict[int, _Row] = {}
        self.stats = {"tti_triggers": 0.0, "tds_resamples": 0.0, "tds_checked_turns": 0.0, "gamma_sum": 0.0,
                      "phi_sum": 0.0, "phi_n": 0.0}
        self.fired: list[tuple[int, int, int]] = []  # (row, turn, index in the turn) of every TTI trigger
        self.resampled: dict[int, list[int]] = {}  # row -> the turns it sampled again, once per re-sample

    def on_chunk(self, chunk: Chunk) -> Edit | None:
        st = self.rows.setdefault(chunk.row, _Row())
        if chunk.start == 0:  # a turn (or a new attempt of it) starts
            st.at_turn_start = (dataclasses.replace(st.run), st.tti_used)
            st.turn_m, st.thinking = [], True
        m, _, after = hesitation(chunk.signals[ENTROPY], chunk.signals[TOP_J_NLL], st.run, self.cfg.alpha)
        n, keep = len(chunk.tokens), len(chunk.tokens)
        ends = [i for i, t in enumerate(chunk.tokens) if int(t) in self.thinking_ends or int(t) in self.stop]
        fire = -1
        if self.cfg.tti and not st.tti_used and st.thinking:
            # TTI may fire at a thinking token: one before the turn's first </think>, <tool_call> or stop
            thinking = ends[0] if ends else n
            fire = tti_fire(np.concatenate([st.turn_m, m[:thinking]]), len(st.turn_m), self.cfg.tti_window,
                            self.cfg.tti_threshold)
            if fire >= 0:
                keep = fire - chunk.start + 1
                if chunk.room - keep < 1:  # no room left for </think>
                    fire, keep = -1, n
        st.turn_m += m[:keep].tolist()
        if keep:
            st.run = after[keep - 1]
        if ends and ends[0] < keep:
            st.thinking = False
        if fire < 0:
            return None
        st.tti_used = True
        self.stats["tti_triggers"] += 1
        self.fired.append((chunk.row, chunk.turn, fire))
        return Edit(keep, (self.think_close,))

    def turn_done(self, row, turn, attempt, ids, logprobs, signals) -> bool:
        st = self.rows.setdefault(row, _Row())
        phi = turn_phi(st.turn_m, self.cfg.phi_floor)
        if self.cfg.tds and st.phi_prev is not None:
            gamma = abs(phi - st.phi_prev)
            self.stats["tds_checked_turns"] += 1
            self.stats["gamma_sum"] += gamma
            if gamma < self.cfg.tds_threshold and st.resamples < self.cfg.tds_max_resamples:
                st.resamples += 1
                self.stats["tds_resamples"] += 1
                self.resampled.setdefault(row, []).append(turn)
                # the state the turn started in: statistics, and TTI's flag (a trigger in the discarded
                # sample is undone with it; it still counts in tti_triggers)
                st.run, st.tti_used = dataclasses.replace(st.at_turn_start[0]), st.at_turn_start[1]
                st.turn_m = []
                return True
        st.phi_prev = phi
        self.stats["phi_sum"] += phi
        self.stats["phi_n"] += 1
        return False


def t2po_settings(section) -> T2POConfig:
    """The run config's `t2po` ConfigDict (or any mapping of its keys) -> a checked T2POConfig."""
    return section_settings(T2POConfig, section, "t2po", "a T2PO")


def t2po_rollout(ctx, tasks: Sequence[Task], seed: int, cfg: T2POConfig) -> RolloutResult:
    """G rollouts of each task from the paged engine with a T2POController (TTI, TDS), the fixed
    layout (rl.episodes.run_episodes: the same episodes, keys and seeds as the default sampler).
    Metrics (over every process): t2po/tti_triggers, t2po/tds_resamples, t2po/tds_checked (turns
    k >= 1 whose Gamma was computed, re-sampled attempts included), t2po/gamma_mean and
    t2po/phi_mean (over the checked turns, over the kept turns), t2po/discarded_tokens (decoded,
    then dropped: TTI's cut chunk tails and re-sampled turns), t2po/recompute_tokens (one per
    rollback to a mid-turn slot)."""
    if ctx.engine is None:
        raise ConfigError("rl.rollout=t2po acts inside the paged engine's decode: set rollout.engine=paged")
    controllers: list[T2POController] = []

    def policy(c, s, rows):
        ctl = T2POController(cfg, c.tokenizer, enable_thinking=c.config.enable_thinking)
        controllers.append(ctl)
        kwargs = {} if c.cache_dtype is None else {"cache_dtype": c.cache_dtype}
        return PagedEngine(c.graphdef, c.params, c.tokenizer, sampling=c.sampling, config=c.config, engine=c.engine,
                           seed=s, mesh=c.mesh, row_offset=rows, controller=ctl, **kwargs)

    res = run_episodes(ctx, tasks, seed, policy=policy)
    total = {k: sum(c.stats[k] for c in controllers) for k in controllers[0].stats} if controllers else {}
    metrics = distributed.summed({
        "t2po/tti_triggers": total.get("tti_triggers", 0.0),
        "t2po/tds_resamples": total.get("tds_resamples", 0.0),
        "t2po/tds_checked": total.get("tds_checked_turns", 0.0),
        "t2po/gamma_sum": total.get("gamma_sum", 0.0),
        "t2po/phi_sum": total.get("phi_sum", 0.0), "t2po/phi_n": total.get("phi_n", 0.0),
        "t2po/discarded_tokens": res.stats.get("engine/discarded_tokens", 0.0),
        "t2po/recompute_tokens": res.stats.get("engine/recompute_tokens", 0.0),
    })
    metrics["t2po/gamma_mean"] = metrics.pop("t2po/gamma_sum") / max(metrics["t2po/tds_checked"], 1.0)
    metrics["t2po/phi_mean"] = metrics.pop("t2po/phi_sum") / max(metrics.pop("t2po/phi_n"), 1.0)
    return dataclasses.replace(res, metrics=metrics)


# ---- registration ----
from turnsight_jax.rl.methods import (  # noqa: E402
    RolloutContext, register_config_section, register_progress_metrics, register_rollout, run_section, runs_controller)


def _check_section(cfg, stages, check_data: bool) -> None:
    if runs_controller(stages, "t2po") and t2po_settings(cfg.t2po).tti and not cfg.rollout.enable_thinking:
        raise ConfigError("t2po.tti forces </think>: it needs rollout.enable_thinking=True (with thinking off the "
                          "prompt closes the think block itself); or set t2po.tti=False")


register_config_section("t2po", T2POConfig, _check_section)


@register_rollout("t2po", engine_only=True)
def t2po_controller(ctx: RolloutContext, tasks: Sequence[Task], seed: int) -> RolloutResult:
    """T2PO: G rollouts per prompt from the paged engine with T2PO's hooks in the decode: TTI forces
    </think> when the hesitation signal stalls, TDS samples a turn again when its hesitation barely
    moved from the previous turn's (t2po.*)."""
    return t2po_rollout(ctx, tasks, seed, t2po_settings(run_section(ctx, "t2po")))

register_progress_metrics({"t2po/tti_triggers": "tti", "t2po/tds_resamples": "tds"})
