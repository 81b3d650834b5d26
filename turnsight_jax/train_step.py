"""The fused train step: teacher views, advantages and the clipped-surrogate update in one jit.

One call of the compiled step, for a rollout batch of B trajectories (B / G prompt groups):

1. frozen teacher on the packed hindsight views (micro-batched, no gradient) -> teacher log-probs
   of every policy token under each depth [D, B, N]; the reference log-probs on the original
   context come from the same packed forward when a KL term needs them;
2. δ = teacher − student, where the student log-probs are the rollout's own (the sampler's
   log-probs equal a teacher-forced forward of the rollout parameters, tests/test_sampler.py) ->
   the configured advantage function (GRPO, MatchTIR, or TurnSight over either) on the whole
   batch, so group statistics see all siblings;
3. for each PPO epoch and mini-batch: gradients of the clipped surrogate accumulated over
   micro-batches (normalised by the *mini-batch* token/trajectory counts, so accumulation equals
   one full pass exactly), global-norm clipping and an optax AdamW update.

All arrays are in the compact policy-position layout of turnsight_jax.views: [B, N] per policy
token. Rows of a micro-batch are strided (rows m, m+M, ...), so each micro-batch spreads over all
data shards.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from turnsight_jax import advantages as adv_lib
from turnsight_jax.models.qwen3 import Qwen3
from turnsight_jax.teacher import student_logprobs, teacher_logprobs
from turnsight_jax.views import PackedViews

ALGORITHMS = ("grpo", "matchtir", "turnsight")  # built in; more via advantages.register_advantage
LOSS_AGGREGATIONS = ("seq_mean_token_mean", "seq_mean_token_sum", "token_mean")
KL_ESTIMATORS = ("k1", "k3", "low_var_kl")


class ConfigError(ValueError):
    """An invalid configuration, reported as one line before anything compiles."""


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """Which advantage: `name` is "turnsight" or a registered base estimator (grpo, matchtir, or one
    added with turnsight_jax.advantages.register_advantage); TurnSight wraps `base`.

    TurnSight switches (SPEC §1 ablations): lam, eps_w, selection ("vote" | "mean" | depth index),
    aggregation ("turn" | "token"), group_norm, turns ("all" | "first:N" | "last:N"), depths (the
    hindsight depth set D_H), source ("tool_results" | "tool_results_answer" | "answer").
    """

    name: str = "turnsight"
    base: str = "grpo"
    gamma: float = 0.9
    eps: float = 1e-6
    lam: float = 0.5
    eps_w: float = 0.5
    selection: Any = "vote"
    aggregation: str = "turn"
    group_norm: bool = True
    turns: str = "all"
    depths: tuple[int, ...] = (1, 2, 3)
    source: str = "tool_results"

    @property
    def uses_views(self) -> bool:
        return self.name == "turnsight"


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Clipped surrogate: ratio clipped to [1 - clip_eps, 1 + (clip_eps_high or clip_eps)];
    optional KL to the reference (kl_coef, kl_estimator); aggregation (see `aggregate`)."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "low_var_kl"
    aggregation: str = "seq_mean_token_mean"
    temperature: float = 1.0


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    schedule: str = "constant"  # constant | cosine (both after linear warm-up)
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class StepConfig:
    algo: AlgoConfig = AlgoConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    group_size: int = 16
    micro_batches: int = 1  # gradient accumulation inside one mini-batch
    mini_batches: int = 1  # optimizer updates per epoch
    ppo_epochs: int = 1
    teacher_micro_batches: int = 1
    logprob_chunk: int = 1024
    max_turns: int = 10

    def validate(self, batch_size: int | None = None) -> None:
        """Raise ConfigError (one line) for any invalid combination."""
        a, l, o = self.algo, self.loss, self.optim
        known = sorted(adv_lib.ADVANTAGE_FNS)
        if a.name != "turnsight" and a.name not in adv_lib.ADVANTAGE_FNS:
            raise ConfigError(f"unknown algorithm {a.name!r}; expected turnsight or a registered estimator {known}")
        if a.name == "turnsight" and a.base not in adv_lib.ADVANTAGE_FNS:
            raise ConfigError(f"unknown TurnSight base algorithm {a.base!r}; expected a registered estimator {known}")
        if a.name == "turnsight":
            if not a.depths:
                raise ConfigError("algo.depths is empty: TurnSight needs at least one hindsight depth")
            if any(int(d) < 1 for d in a.depths):
                raise ConfigError(f"algo.depths must be >= 1, got {tuple(a.depths)}")
            if not 0.0 <= a.eps_w < 1.0:
                raise ConfigError(f"algo.eps_w must be in [0, 1) so the weight keeps the advantage's sign, got {a.eps_w}")
            if not 0.0 <= a.lam <= 1.0:
                raise ConfigError(f"algo.lam must be in [0, 1], got {a.lam}")
            if isinstance(a.selection, int) and not 0 <= a.selection < len(a.depths):
                raise ConfigError(f"algo.selection={a.selection} is not an index into depths {tuple(a.depths)}")
            if not isinstance(a.selection, int) and a.selection not in ("vote", "mean"):
                raise ConfigError(f"algo.selection must be 'vote', 'mean' or a depth index, got {a.selection!r}")
            if a.aggregation not in ("turn", "token"):
                raise ConfigError(f"algo.aggregation must be 'turn' or 'token', got {a.aggregation!r}")
            if a.source not in ("tool_results", "tool_results_answer", "answer"):
                raise ConfigError(f"algo.source must be tool_results, tool_results_answer or answer, got {a.source!r}")
            kind, _, n = a.turns.partition(":")
            if a.turns != "all" and (kind not in ("first", "last") or not n.isdigit() or int(n) < 1):
                raise ConfigError(f"algo.turns must be 'all', 'first:N' or 'last:N', got {a.turns!r}")
        if l.aggregation not in LOSS_AGGREGATIONS:
            raise ConfigError(f"loss.aggregation {l.aggregation!r} unknown; expected one of {LOSS_AGGREGATIONS}")
        if l.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"loss.kl_estimator {l.kl_estimator!r} unknown; expected one of {KL_ESTIMATORS}")
        if l.clip_eps <= 0 or (l.clip_eps_high is not None and l.clip_eps_high <= 0):
            raise ConfigError("loss.clip_eps (and clip_eps_high) must be > 0")
        if o.schedule not in ("constant", "cosine"):
            raise ConfigError(f"optim.schedule must be 'constant' or 'cosine', got {o.schedule!r}")
        if self.group_size < 1:
            raise ConfigError(f"group_size must be >= 1, got {self.group_size}")
        for name in ("micro_batches", "mini_batches", "ppo_epochs", "teacher_micro_batches", "max_turns"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if batch_size is not None:
            if batch_size % self.group_size:
                raise ConfigError(f"batch of {batch_size} trajectories is not divisible by group_size {self.group_size}")
            per_mini = batch_size // self.mini_batches
            if batch_size % self.mini_batches or per_mini % self.micro_batches:
                raise ConfigError(
                    f"batch {batch_size} must split into {self.mini_batches} mini-batches of "
                    f"{self.micro_batches} equal micro-batches"
                )
            if batch_size % self.teacher_micro_batches:
                raise ConfigError(f"batch {batch_size} is not divisible by teacher_micro_batches {self.teacher_micro_batches}")


@struct.dataclass
class TrainBatch:
    """A rollout batch in the compact policy-position layout (see turnsight_jax.views).

    tokens, valid [B, T]; pol_pos, pol_valid, turn_ids, old_logprobs [B, N]; group_ids,
    rewards, num_turns [B]; turn_rewards [B, K]; views: PackedViews or None.
    """

    tokens: Any
    valid: Any
    pol_pos: Any
    pol_valid: Any
    turn_ids: Any
    old_logprobs: Any
    group_ids: Any
    rewards: Any
    num_turns: Any
    turn_rewards: Any
    views: Any = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def row_axis(path) -> int:
    """Axis holding the trajectories in a TrainBatch leaf: 1 for view_pred / slot [R, B, N], else 0."""
    names = [getattr(k, "name", None) for k in path]
    return 1 if names and names[-1] in ("view_pred", "slot") else 0


def shard_batch(batch: TrainBatch, mesh) -> TrainBatch:
    """Place a (numpy) TrainBatch on `mesh`, rows split over the data axes."""
    from turnsight_jax.sharding import shard_rows

    return shard_rows(batch, mesh, row_axis)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    if cfg.schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(
            0.0, cfg.lr, max(cfg.warmup_steps, 0), max(cfg.total_steps, cfg.warmup_steps + 1), cfg.lr * cfg.min_lr_ratio
        )
    elif cfg.warmup_steps > 0:
        lr = optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), optax.constant_schedule(cfg.lr)],
            [cfg.warmup_steps],
        )
    else:
        lr = optax.constant_schedule(cfg.lr)
    return optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay),
    )


# ---- pieces (pure functions, also used by the unfused reference in the tests) ----

def kl_penalty(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str) -> jax.Array:
    """Per-token KL(π_θ || π_ref) estimate from log-probs of the sampled tokens."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    k3 = jnp.exp(log_ratio) - log_ratio - 1.0
    if estimator == "k3":
        return k3
    return jnp.clip(k3, -10.0, 10.0)  # low_var_kl: k3 clipped for stability


def token_losses(logprobs, old_logprobs, advantages, cfg: LossConfig, ref_logprobs=None):
    """Clipped-surrogate loss per token [B, N] and diagnostics (per token)."""
    ratio = jnp.exp(logprobs - old_logprobs)
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    clipped = jnp.clip(ratio, 1.0 - cfg.clip_eps, 1.0 + high)
    pg = -jnp.minimum(ratio * advantages, clipped * advantages)
    loss = pg
    kl = jnp.zeros_like(pg)
    if cfg.kl_coef and ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl
    is_clipped = (ratio * advantages) > (clipped * advantages)
    return loss, {"pg_loss": pg, "kl": kl, "ratio": ratio, "clip_frac": is_clipped.astype(jnp.float32)}


def aggregation_weights(pol_valid: jax.Array, how: str) -> jax.Array:
    """Per-token weights [B, N] whose weighted sum is the aggregated loss of these rows.

    seq_mean_token_mean: mean over each trajectory's policy tokens, then mean over trajectories
      that have any; seq_mean_token_sum: sum over each trajectory's tokens, mean over those
      trajectories; token_mean: mean over all policy tokens of the rows.
    """
    m = pol_valid.astype(jnp.float32)
    per_traj = m.sum(axis=1, keepdims=True)
    n_traj = jnp.maximum(jnp.sum(per_traj > 0), 1.0)
    if how == "seq_mean_token_mean":
        return m / jnp.maximum(per_traj, 1.0) / n_traj
    if how == "seq_mean_token_sum":
        return m / n_traj
    return m / jnp.maximum(m.sum(), 1.0)


def _base_advantages(name: str, batch: TrainBatch, a: AlgoConfig, num_groups: int) -> jax.Array:
    """A registered base estimator (turnsight_jax.advantages.ADVANTAGE_FNS) on the compact batch;
    it receives the knobs its signature names (eps, num_groups, gamma)."""
    fn = adv_lib.ADVANTAGE_FNS[name]
    params = inspect.signature(fn).parameters
    knobs = {k: v for k, v in {"eps": a.eps, "num_groups": num_groups, "gamma": a.gamma}.items() if k in params}
    arrays = {"rewards": batch.rewards, "group_ids": batch.group_ids, "policy_mask": batch.pol_valid,
              "turn_rewards": batch.turn_rewards, "num_turns": batch.num_turns, "turn_ids": batch.turn_ids}
    return adv_lib.compute_base_advantages(name, arrays, **knobs)


def compute_advantages(batch: TrainBatch, teacher_lp, cfg: StepConfig) -> tuple[jax.Array, dict]:
    """Advantages [B, N] of the configured algorithm over the whole batch, and diagnostics."""
    a = cfg.algo
    b = batch.pol_valid.shape[0]
    num_groups = b // cfg.group_size
    mask = batch.pol_valid
    base = _base_advantages(a.base if a.name == "turnsight" else a.name, batch, a, num_groups)
    if a.name != "turnsight":
        return base, {}
    delta = teacher_lp - batch.old_logprobs[None]
    out = adv_lib.turnsight_advantages(
        delta, mask, batch.turn_ids, batch.group_ids, base,
        lam=a.lam, eps_w=a.eps_w, eps=a.eps, selection=a.selection, aggregation=a.aggregation,
        group_norm=a.group_norm, turns=a.turns, num_groups=num_groups, max_turns=cfg.max_turns,
    )
    diag = {k: out[k] for k in ("agreement_rate", "depth_histogram", "weight_mean", "weight_min", "weight_max",
                                "frac_turns_amplified", "frac_turns_damped")}
    n = jnp.maximum(mask.sum(), 1)
    diag["delta_mean"] = jnp.sum(jnp.where(mask[None], delta, 0.0), axis=(1, 2)) / n  # per depth
    return out["advantages"], diag


# ---- strided micro-batches ----

def _split(x, m: int, axis: int = 0):
    """[.., B, ..] -> [m, .., B/m, ..]: micro-batch i holds rows i, i+m, i+2m, ..."""
    x = jnp.moveaxis(x, axis, 0)
    b = x.shape[0]
    x = x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)
    return jnp.moveaxis(x, 1, axis + 1)


def _merge(x, axis: int = 0):
    """Inverse of _split: [m, .., B/m, ..] -> [.., B, ..]."""
    x = jnp.moveaxis(x, axis + 1, 1)  # [m, B/m, ...]
    m, r = x.shape[:2]
    x = x.swapaxes(0, 1).reshape(m * r, *x.shape[2:])
    return jnp.moveaxis(x, 0, axis)


def split_batch(batch, m: int):
    """Strided micro-batches of a TrainBatch (views included), stacked on a new leading axis."""
    def f(path, x):
        return None if x is None else _split(x, m, axis=row_axis(path))

    return jax.tree_util.tree_map_with_path(f, batch)


def teacher_and_ref_logprobs(ref_model: Qwen3, batch: TrainBatch, cfg: StepConfig):
    """(teacher log-probs [D, B, N] or None, reference log-probs [B, N] or None), no gradient.

    With views, one packed forward gives both: the views are built with a reference row when a
    KL term is on (turnsight_jax.batching)."""
    need_kl = bool(cfg.loss.kl_coef)
    temp, chunk, m = cfg.loss.temperature, cfg.logprob_chunk, cfg.teacher_micro_batches
    if cfg.algo.uses_views:
        one = lambda v: teacher_logprobs(ref_model, v, chunk=chunk, temperature=temp)
        if m == 1:
            out = one(batch.views)
        else:
            out = _merge(jax.lax.map(one, split_batch(batch.views, m)), axis=1)
        depths = len(cfg.algo.depths)
        return out[:depths], (out[depths] if need_kl else None)
    if need_kl:
        def one_ref(args):
            tok, valid, pos = args
            return student_logprobs(ref_model, tok, valid, pos, chunk=chunk, temperature=temp)

        args = (batch.tokens, batch.valid, batch.pol_pos)
        if m == 1:
            ref = one_ref(args)
        else:
            ref = _merge(jax.lax.map(one_ref, tuple(_split(a, m) for a in args)))
        return None, jax.lax.stop_gradient(ref)
    return None, None


def make_train_step(graphdef, cfg: StepConfig, optimizer: optax.GradientTransformation):
    """Returns step(params, opt_state, ref_params, batch) -> (params, opt_state, metrics), jitted
    with params and opt_state donated. `params`/`ref_params` are nnx.State of the policy and the
    frozen reference (same graphdef)."""

    def loss_fn(params, mb: TrainBatch, adv, ref_lp, weights):
        model = nnx.merge(graphdef, params)
        lp = student_logprobs(model, mb.tokens, mb.valid, mb.pol_pos, chunk=cfg.logprob_chunk,
                              temperature=cfg.loss.temperature)
        loss_tok, parts = token_losses(lp, mb.old_logprobs, adv, cfg.loss, ref_lp)
        loss = jnp.sum(loss_tok * weights)
        sums = {k: jnp.sum(v * weights) for k, v in parts.items()}
        return loss, sums

    grad_fn = jax.grad(loss_fn, has_aux=True)

    def minibatch_update(params, opt_state, mb: TrainBatch, adv, ref_lp):
        """Accumulate gradients over strided micro-batches, then one optimizer update."""
        m = cfg.micro_batches
        weights = aggregation_weights(mb.pol_valid, cfg.loss.aggregation)
        if m == 1:
            grads, sums = grad_fn(params, mb, adv, ref_lp, weights)
        else:
            xs = (split_batch(mb, m), _split(adv, m), None if ref_lp is None else _split(ref_lp, m), _split(weights, m))

            def acc(carry, x):
                g_acc, s_acc = carry
                mb_i, adv_i, ref_i, w_i = x
                g, s = grad_fn(params, mb_i, adv_i, ref_i, w_i)
                return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, s_acc, s)), None

            zeros_g = jax.tree.map(jnp.zeros_like, params)
            zeros_s = {k: jnp.zeros((), jnp.float32) for k in ("pg_loss", "kl", "ratio", "clip_frac")}
            (grads, sums), _ = jax.lax.scan(acc, (zeros_g, zeros_s), xs)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        sums["grad_norm"] = optax.tree.norm(grads)
        return params, opt_state, sums

    def step(params, opt_state, ref_params, batch: TrainBatch):
        ref_model = nnx.merge(graphdef, ref_params)
        teacher_lp, ref_lp = teacher_and_ref_logprobs(ref_model, batch, cfg)
        adv, diag = compute_advantages(batch, teacher_lp, cfg)
        adv = jax.lax.stop_gradient(adv)
        nm = cfg.mini_batches
        if nm == 1:
            minis = [(batch, adv, ref_lp)]
        else:
            sb = split_batch(batch, nm)
            sa = _split(adv, nm)
            sr = None if ref_lp is None else _split(ref_lp, nm)
            minis = [(jax.tree.map(lambda x: x[i], sb), sa[i], None if sr is None else sr[i]) for i in range(nm)]
        logs = []
        for _ in range(cfg.ppo_epochs):
            for mb, a, r in minis:
                params, opt_state, sums = minibatch_update(params, opt_state, mb, a, r)
                logs.append(sums)
        metrics = {k: jnp.mean(jnp.stack([l[k] for l in logs])) for k in logs[0]}
        valid = batch.pol_valid
        n = jnp.maximum(valid.sum(), 1)
        metrics["adv_mean"] = jnp.sum(jnp.where(valid, adv, 0.0)) / n
        metrics["adv_abs_mean"] = jnp.sum(jnp.where(valid, jnp.abs(adv), 0.0)) / n
        metrics["reward_mean"] = jnp.mean(batch.rewards)
        metrics.update(diag)
        return params, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1))
