"""APPO: one "future appreciation" signal picks branch points and amplifies credit
(docs/rollout_methods.md, "APPO").

For rollout n with policy tokens i = 0 .. n_tok - 1 (its turns' tokens in order; observations are
not the policy's and are skipped):

* log rho_i = log pi_new(a_i) - log pi_old(a_i), at rollout time: pi_new is the policy that
  sampled (its recorded log-probs, equal to a teacher-forced forward of the current parameters),
  pi_old the policy before the last update (`appo.ratio_to=previous`: the trainer keeps it; the
  first step has none, rho = 1) or the frozen reference (`reference`), scored teacher-forced on
  the rollout's tokens (one forward per prompt group, `old_logprobs`).
* Omega_i = exp(sum_{i' >= i} gamma^(i' - i) log rho_{i'}) (`log_omega`, a backward recursion).
* BS_i = Z(clip(Omega_i)) * Z(H_i), clip to [1 - clip_low, 1 + clip_high], Z the z-score over the
  rollout's own policy tokens (population std; a constant gives 0), H_i the entropy of the policy
  at i, computed in the compiled decode (rollout.control.DecodeSignals). The product as written:
  both factors high or both low score high.
* the rollout branches at its top `branches` tokens by BS (ties: higher entropy, then earlier):
  a branch keeps the rollout's tokens before i and draws token i anew with the current policy,
  then runs the episode on (rollout.control.EpisodeStart: the prefix's KV blocks shared, its
  environment replayed to the branch turn).
* groups: the G initial rollouts of a prompt form one advantage group, its G * branches branches
  another (group ids 2p and 2p + 1 for the prompt with global index p); the batch holds
  G * (1 + branches) rows per prompt (rl.methods.RolloutController.rows_per_prompt). A branch is a
  whole trajectory: its prefix's policy tokens train with the branch group's advantage too.
* amplification: the step multiplies the method's final advantage (GRPO's, or TurnSight's over
  its base) by 1 + amplify * (clip(Omega_i) - 1) per token (the transform `appo_amplify`, reading
  the per-token reward `appo_omega` [B, N] = clip(Omega) of each trajectory's own tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from turnsight_jax import distributed
from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import Task
from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.advantages import register_advantage_transform
from turnsight_jax.rl.config import section_settings
from turnsight_jax.rl.episodes import run_episodes
from turnsight_jax.models.sharding import BATCH
from turnsight_jax.rl.logprobs import student_logprobs
from turnsight_jax.rollout.control import ENTROPY, DecodeSignals, EngineController, EpisodeStart
from turnsight_jax.rollout.driver import RolloutResult
from turnsight_jax.rollout.engine import PagedEngine, blocks_per_episode, default_pool_blocks
from turnsight_jax.rollout.sampler import pow2_bucket

OMEGA = "appo_omega"  # the per-token reward / batch array / Trajectory.token_values key: clip(Omega)
AMPLIFY = "appo_amplify"  # the advantage transform
RATIO_POLICIES = ("previous", "reference")
BRANCH_KEY_BASE = 1 << 30  # branches' global rows (sampling keys) lie above every initial rollout's


@dataclasses.dataclass(frozen=True)
class APPOConfig:
    """The run config's appo.* keys (each documented below; the section `config.base_config` generates from these fields)."""

    branches: int = 2  # B: branch points per initial rollout; the batch holds train.group_size * (1 + B) rows per prompt
    gamma: float = 0.9  # Omega_i = exp(sum_i'>=i gamma^(i'-i) log rho_i') over the rollout's policy tokens (paper silent)
    clip_low: float = 0.2  # Omega clipped to [1 - clip_low, 1 + clip_high] before BS's z-score and in the amplification (paper silent)
    clip_high: float = 0.28  # (see clip_low)
    amplify: float = 0.5  # beta: the final advantage times 1 + beta * (clip(Omega) - 1) per token; 0: no amplification (paper silent)
    ratio_to: str = "previous"  # rho = pi_current / pi_old with pi_old: previous (the policy before the last update; kept, checkpointed) | reference

    def validate(self) -> "APPOConfig":
        if isinstance(self.branches, bool) or not isinstance(self.branches, int) or self.branches < 1:
            raise ConfigError(f"appo.branches must be an int >= 1, got {self.branches!r}")
        for name in ("gamma", "clip_low", "clip_high", "amplify"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"appo.{name} must be a finite number, got {v!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ConfigError(f"appo.gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0:
            raise ConfigError(f"appo.clip_low must be in [0, 1) and appo.clip_high >= 0, got {self.clip_low} and "
                              f"{self.clip_high}")
        if self.amplify < 0 or self.amplify * self.clip_low >= 1:
            raise ConfigError(f"appo.amplify must be >= 0 with amplify * clip_low < 1 (the factor "
                              f"1 + amplify * (clip(Omega) - 1) keeps the advantage's sign), got {self.amplify}")
        if self.ratio_to not in RATIO_POLICIES:
            raise ConfigError(f"appo.ratio_to must be one of {RATIO_POLICIES}, got {self.ratio_to!r}")
        return self


def appo_settings(section) -> APPOConfig:
    """The run config's `appo` ConfigDict (or any mapping of its keys) -> a checked APPOConfig."""
    return section_settings(APPOConfig, section, "appo", "an APPO")


# ---- the signal (pure functions on one rollout's policy tokens) ----

def log_omega(log_ratio: np.ndarray, gamma: float) -> np.ndarray:
    """log Omega_i = sum_{i' >= i} gamma^(i' - i) log rho_{i'}: [n] -> [n] float64."""
    out = np.zeros(len(log_ratio), np.float64)
    acc = 0.0
    for i in range(len(log_ratio) - 1, -1, -1):
        acc = float(log_ratio[i]) + gamma * acc
        out[i] = acc
    return out


def clip_omega(log_om: np.ndarray, cfg: APPOConfig) -> np.ndarray:
    """clip(Omega) = clip(exp(log Omega), 1 - clip_low, 1 + clip_high), computed on the log (no overflow)."""
    low = math.log(1.0 - cfg.clip_low) if cfg.clip_low > 0 else 0.0
    return np.exp(np.clip(log_om, low, math.log1p(cfg.clip_high)))


def zscore(x: np.ndarray) -> np.ndarray:
    """(x - mean) / std over x (population std); 0 where std is 0."""
    x = np.asarray(x, np.float64)
    std = x.std() if x.size else 0.0
    return (x - x.mean()) / std if std > 0 else np.zeros_like(x)


def branch_points(omega_clipped: np.ndarray, entropy: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(the rollout's top-b token indices by BS = Z(clip Omega) * Z(H), descending, ties broken by
    the higher entropy then the earlier token; repeated in that order when it has fewer than b
    tokens; BS [n])."""
    bs = zscore(omega_clipped) * zscore(entropy)
    order = np.lexsort((np.arange(len(bs)), -np.asarray(entropy, np.float64), -bs))
    return np.resize(order, b), bs


# ---- pi_old's log-probs of the rollouts, teacher-forced ----

@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("temperature",))
def _scored(graphdef, params, tokens, valid, pol_pos, pol_valid, *, temperature: float):
    return student_logprobs(nnx.merge(graphdef, params), tokens, valid, pol_pos, chunk=256, temperature=temperature,
                            pol_valid=pol_valid)


def old_logprobs(graphdef, params, trajs: Sequence[Trajectory], temperature: float) -> list[np.ndarray]:
    """log pi_old(a_i) of each trajectory's policy tokens ([n_tok] float32 each), a teacher-forced
    forward of `params` (rows and widths bucketed to powers of two: few compilations); None params:
    each trajectory's own recorded log-probs (rho = 1)."""
    pos = [np.flatnonzero(t.policy_mask) for t in trajs]
    if params is None:
        return [t.old_logprobs[p] for t, p in zip(trajs, pos)]
    rows, width = pow2_bucket(len(trajs), 1), pow2_bucket(max(t.length for t in trajs), 64)
    n = pow2_bucket(max(len(p) for p in pos), 16)
    tokens = np.zeros((rows, width), np.int32)
    valid = np.zeros((rows, width), bool)
    pol_pos = np.zeros((rows, n), np.int32)
    pol_valid = np.zeros((rows, n), bool)
    for i, (t, p) in enumerate(zip(trajs, pos)):
        tokens[i, :t.length], valid[i, :t.length] = t.tokens, True
        pol_pos[i, :len(p)], pol_valid[i, :len(p)] = p, True
    lp = np.asarray(_scored(graphdef, params, tokens, valid, pol_pos, pol_valid, temperature=float(temperature)))
    return [lp[i, :len(p)] for i, p in enumerate(pos)]


# ---- the controller ----

class _Entropy(EngineController):
    """APPO reads the decode's entropy only (the branch score's H)."""

    signals = DecodeSignals(entropy=True)


class APPOHooks:
    """rollout.control.RolloutHooks of one rollout call: Omega and the branch points of each prompt's
    initial rollouts when they end, Omega of its branches when those end. `score_old(trajs)` ->
    log pi_old of their policy tokens (`old_logprobs`); `first_prompt`: the global index of the
    call's first prompt."""

    def __init__(self, cfg: APPOConfig, group_size: int, first_prompt: int, score_old):
        self.cfg, self.g, self.first, self.score_old = cfg, group_size, first_prompt, score_old
        self.branch_of: list[tuple[int, int, int]] = []  # (prompt, parent n, rank j) of each branch, in start order
        self.chosen: dict[tuple[int, int], list[int]] = {}  # (prompt, n) -> the branch positions (token indices)
        self.scored: set[int] = set()  # rows whose Omega is recorded (a branch inherits its parent's values)
        self.stats: dict[str, float] = {}

    def _add(self, key: str, value: float) -> None:
        self.stats[key] = self.stats.get(key, 0.0) + float(value)

    def _omega(self, trajs: Sequence[Trajectory]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(log Omega, clip(Omega)) of each trajectory's policy tokens; clip(Omega) also recorded in
        its token_values[OMEGA]."""
        out = []
        for t, old in zip(trajs, self.score_old(trajs)):
            pos = np.flatnonzero(t.policy_mask)
            lo = log_omega(t.old_logprobs[pos].astype(np.float64) - old.astype(np.float64), self.cfg.gamma)
            om = clip_omega(lo, self.cfg)
            full = np.zeros(t.length, np.float32)
            full[pos] = om
            t.token_values[OMEGA] = full
            out.append((lo, om))
        return out

    def after_group(self, prompt: int, rows: Sequence[int], trajectories: Sequence[Trajectory]):
        gp = self.first + prompt
        fresh = [t for r, t in zip(rows, trajectories) if r not in self.scored]
        self.scored.update(rows)
        omegas = self._omega(fresh) if fresh else []
        if len(rows) > self.g:  # the branches ended: their Omega is recorded, nothing more to start
            return []
        starts = []
        for n, (row, t, (lo, om)) in enumerate(zip(rows, trajectories, omegas)):
            t.group_id = 2 * gp
            pos = np.flatnonzero(t.policy_mask)
            h = t.token_values[ENTROPY][pos]
            points, bs = branch_points(om, h, self.cfg.branches)
            self.chosen[(prompt, n)] = [int(pos[k]) for k in points]
            for j, k in enumerate(points):
                starts.append(EpisodeStart(key_row=BRANCH_KEY_BASE + (gp * self.g + n) * self.cfg.branches + j,
                                           group_id=2 * gp + 1, parent=row, position=int(pos[k])))
                self.branch_of.append((prompt, n, j))
                self._add("appo/branch_score_sum", bs[k])
                self._add("appo/branch_entropy_sum", h[k])
                self._add("appo/branch_omega_sum", om[k])
                self._add("appo/branch_relative_position_sum", k / max(len(pos) - 1, 1))
            clipped = (lo < math.log(1.0 - self.cfg.clip_low)) | (lo > math.log1p(self.cfg.clip_high))
            for key, v in (("omega_log", lo), ("omega_log_sq", lo * lo), ("omega", om), ("entropy", h),
                           ("omega_clipped", clipped)):
                self._add(f"appo/{key}_sum", np.sum(v))
                self._add(f"appo/{key}_n", v.size)
        for key in ("branch_score", "branch_entropy", "branch_omega", "branch_relative_position"):
            self._add(f"appo/{key}_n", len(starts))
        return starts

    def ordered(self, trajs: Sequence[Trajectory], prompts: int) -> list[Trajectory]:
        """The call's rows in batch order: per prompt its G initial rollouts, then its branches by
        (parent, rank) (the driver numbers added episodes in start order)."""
        g = self.g
        initial, added = trajs[:prompts * g], trajs[prompts * g:]
        if len(added) != len(self.branch_of):
            raise RuntimeError(f"APPO: {len(added)} added rows for {len(self.branch_of)} branches started")
        by_prompt: dict[int, list] = {}
        for t, (p, n, j) in zip(added, self.branch_of):
            by_prompt.setdefault(p, []).append(((n, j), t))
        out = []
        for p in range(prompts):
            out.extend(initial[p * g:(p + 1) * g])
            out.extend(t for _, t in sorted(by_prompt.get(p, []), key=lambda x: x[0]))
        return out


def appo_pool_blocks(engine, config, prompts: int, group_size: int, shards: int = 1) -> int:
    """Blocks per shard for APPO's engine: the slots at full length (the default pool) plus every
    initial rollout of the call kept at full length until its branches start (any of them may be
    kept on any shard: the worst case)."""
    shared, own = blocks_per_episode(config.max_prompt_tokens, config.max_response_tokens, engine.block_size)
    slots = default_pool_blocks(-(-engine.slots // shards), config.max_prompt_tokens, config.max_response_tokens,
                                engine.block_size)
    return max(engine.pool_blocks, slots + prompts * group_size * (shared + own))


def appo_rollout(ctx, tasks: Sequence[Task], seed: int, cfg: APPOConfig) -> RolloutResult:
    """APPO's rollouts of `tasks` (module docstring): len(tasks) * G * (1 + branches) rows, per
    prompt its G initial rollouts (group 2p) then their branches (group 2p + 1). Metrics (over
    every process, under "appo/"): rollouts, branches, branch_tokens (tokens the branches decoded:
    past their branch points), shared_prefix_tokens (prefix tokens branches reused without
    prefill), replay_mismatches, old_policy_s (pi_old's scoring), and the means of the initial
    rollouts' log Omega, its square, clip(Omega), the share of tokens clipped, the entropy, and at
    the chosen points of BS, H, clip(Omega) and the relative position."""
    if ctx.engine is None:
        raise ConfigError("rl.rollout=appo branches inside the paged engine: set rollout.engine=paged")
    old = ctx.old_params  # the trainer's (rl.methods.RolloutController.old_policy); None: rho = 1
    temperature = 1.0 if ctx.sampling.greedy else ctx.sampling.temperature

    scoring = [0.0]

    def score_old(trajs):
        t0 = time.perf_counter()
        try:
            return old_logprobs(ctx.graphdef, old, trajs, temperature)
        finally:
            scoring[0] += time.perf_counter() - t0

    def policy(c, s, rows):
        n_prompts = len(rows) // c.group_size
        shards = 1 if c.mesh is None else math.prod(c.mesh.shape[a] for a in BATCH)
        engine = dataclasses.replace(c.engine, pool_blocks=appo_pool_blocks(c.engine, c.config, n_prompts,
                                                                            c.group_size, shards))
        kwargs = {} if c.cache_dtype is None else {"cache_dtype": c.cache_dtype}
        return PagedEngine(c.graphdef, c.params, c.tokenizer, sampling=c.sampling, config=c.config, engine=engine,
                           seed=s, mesh=c.mesh, row_offset=rows, controller=_Entropy(), retain=True, **kwargs)

    # one call per chunk of prompts (rollout.prompts_per_chunk), each with its hooks
    per = ctx.prompts_per_chunk or max(len(tasks), 1)
    trajs, stats, own = [], {}, {}
    for i in range(0, len(tasks), per):
        part = dataclasses.replace(ctx, group_offset=ctx.group_offset + i, prompts_per_chunk=0)
        hooks = APPOHooks(cfg, ctx.group_size, part.group_offset, score_old)
        res = run_episodes(part, tasks[i:i + per], seed, policy=policy, hooks=hooks)
        trajs.extend(hooks.ordered(res.trajectories, len(tasks[i:i + per])))
        for k, v in res.stats.items():
            stats[k] = stats.get(k, 0.0) + v if k != "compilations" else v
        for k, v in hooks.stats.items():
            own[k] = own.get(k, 0.0) + v
    branches = [t for t in trajs if t.group_id % 2 == 1]
    own.update({"appo/rollouts": float(len(trajs) - len(branches)), "appo/branches": float(len(branches)),
                # the policy tokens the branches decoded (the initial rollouts decoded their own)
                "appo/branch_tokens": float(stats.get("engine/decoded_tokens", 0.0) - sum(
                    int(t.policy_mask.sum()) for t in trajs if t.group_id % 2 == 0)),
                "appo/shared_prefix_tokens": stats.get("engine/branch_shared_tokens", 0.0),
                "appo/replay_mismatches": stats.get("replay_mismatches", 0.0), "appo/old_policy_s": scoring[0]})
    metrics = distributed.summed(own)
    for key in [k for k in metrics if k.endswith("_sum")]:  # each _sum / _n pair as its mean
        stem = key[:-len("_sum")]
        metrics[stem + "_mean"] = metrics.pop(key) / max(metrics.pop(stem + "_n"), 1.0)
    return RolloutResult(trajs, stats, metrics=metrics)


@register_advantage_transform(AMPLIFY, ("advantages", OMEGA, "policy_mask"), ("appo.amplify",))
def amplify_advantages(advantages, omega, policy_mask, *, appo_amplify):
    """APPO's amplification: advantages [B, N] * (1 + appo_amplify * (omega - 1)), omega [B, N] =
    clip(Omega) per policy token (the `appo_omega` reward); 0 off policy_mask. Diagnostics
    appo/amplify_{mean,min,max} over the policy tokens. amplify = 0 (a Python number: the
    configured value) returns the advantages themselves: the step's program is then the one
    without the transform, bit for bit (a multiply by 1.0 could still change how XLA fuses)."""
    if isinstance(appo_amplify, (int, float)) and appo_amplify == 0:
        return advantages
    factor = 1.0 + appo_amplify * (omega - 1.0)
    n = jnp.maximum(policy_mask.sum(), 1)
    return {"advantages": jnp.where(policy_mask, advantages * factor, 0.0),
            "appo/amplify_mean": jnp.sum(jnp.where(policy_mask, factor, 0.0)) / n,
            "appo/amplify_min": jnp.min(jnp.where(policy_mask, factor, jnp.inf)),
            "appo/amplify_max": jnp.max(jnp.where(policy_mask, factor, -jnp.inf))}


def omega_reward(traj: Trajectory, task: Task, algo) -> np.ndarray:
    """clip(Omega) [length] float32 that the APPO controller recorded (0 off the policy tokens)."""
    if OMEGA not in traj.token_values:
        raise ValueError(f"trajectory {traj.task_id!r} has no {OMEGA}: the appo_omega reward needs the 'appo' rollout "
                         f"controller (rl.rollout=appo)")
    return traj.token_values[OMEGA]


# ---- registration ----
from turnsight_jax.rl.methods import (  # noqa: E402
    RolloutContext, register_config_section, register_progress_metrics, register_reward, register_rollout, run_section,
    runs_controller)

register_config_section("appo", APPOConfig,
                        lambda cfg, stages, check_data: runs_controller(stages, "appo") and appo_settings(cfg.appo))
register_reward(OMEGA, OMEGA, per="token")(omega_reward)


@register_rollout("appo", rewards=(OMEGA,), engine_only=True, advantage_transform=AMPLIFY,
                  rows_per_prompt=lambda cfg: cfg.train.group_size * (1 + appo_settings(cfg.appo).branches),
                  old_policy=lambda cfg: appo_settings(cfg.appo).ratio_to,
                  plan_pool_blocks=lambda engine, rollout, cfg, shards: appo_pool_blocks(
                      engine, rollout, cfg.rollout.prompts_per_chunk or cfg.train.prompts_per_step,
                      cfg.train.group_size, shards))
def appo_controller(ctx: RolloutContext, tasks: Sequence[Task], seed: int) -> RolloutResult:
    """APPO: G rollouts per prompt, then appo.branches continuations of each from its top branch
    points by Z(clip Ω) Z(H), sharing the prefix's KV; initial rollouts and branches form two groups
    per prompt, and the step amplifies the final advantage by Ω."""
    return appo_rollout(ctx, tasks, seed, appo_settings(run_section(ctx, "appo")))

register_progress_metrics({"appo/branches": "branches"})
