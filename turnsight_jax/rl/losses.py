"""Loss terms of the RL step, registered by name, and how per-token losses are aggregated.

A loss term is a pure function of arrays computed inside the jitted step:

    fn(x: Mapping[str, Array], cfg: LossConfig, algo: AlgoConfig) -> (loss [B, N], metrics)

`x` holds the term's declared `inputs`, each [B, N] in the compact policy-position layout
(turnsight_jax.rl.batch) unless noted: "logprobs" (the student's, differentiated),
"old_logprobs", "advantages", "ref_logprobs" (frozen reference on the student's context),
"pol_valid", "turn_ids", "entropy" (the student's token entropy, differentiated; computed only when
a term reads it); per-trajectory arrays [B]: "rewards", "group_ids", "num_turns"; and any
extra batch array a registered reward fills. `loss` is per token and already scaled by the
term's coefficient; `metrics` maps names to per-token [B, N] values. The step sums the terms,
weights tokens with `aggregation_weights` (so micro-batch accumulation equals one full pass
exactly) and reports each metric as the same weighted sum.

Which tokens a term aggregates over (`LossTerm.rows`): by default the policy tokens of the rows
in a group (group id >= 0; every row of a fixed-layout batch), the RL terms' set, so a row in
no group (a padding row, an exemplar; rl.batch) carries no policy-gradient, KL or entropy loss.
A term with `rows=NAME` (NAME a per-trajectory [B] input, e.g. a reward's flag) aggregates over
the policy tokens of the rows where NAME > 0 instead, with its own normaliser (`loss_weights`):
AKBE's CE on its exemplars, which leaves the RL terms' loss exactly as without the exemplars.

A term may also declare `optional_inputs`: arrays the step fills only in some configurations; the
term gets them when they are filled and not otherwise. One exists: "is_weights" [B, N], the
truncated importance weights of the sampler/trainer mismatch correction (`loss.tis_threshold`,
`tis_weights`; without gradient), filled only when that option is on. The clipped surrogate reads
it and multiplies its per-token loss by it; the KL and entropy terms do not (the correction
re-weights the policy gradient only, as verl's rollout correction does). A policy-gradient term of
a plug-in method opts in the same way; the step refuses `loss.tis_threshold` when no term does.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from turnsight_jax.rl.config import AlgoConfig, LossConfig

Array = jax.Array


def kl_penalty(logprobs: Array, ref_logprobs: Array, estimator: str, clip: float = 10.0) -> Array:
    """Per-token KL(π_θ || π_ref) estimate from log-probs of the sampled tokens [B, N]."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    k3 = jnp.exp(log_ratio) - log_ratio - 1.0
    if estimator == "k3":
        return k3
    return jnp.clip(k3, -clip, clip)  # low_var_kl: k3 clipped for stability


def tis_weights(trainer_old_logprobs: Array, sampler_logprobs: Array, threshold: float) -> Array:
    """Truncated importance weights [B, N], without gradient: min(π_old_trainer / π_sampler, C).

    The tokens were drawn by the sampler, whose numerics (bf16, another kernel) differ from the
    trainer's; the ratio's π_old is then the trainer's own step-start log-probs and this weight
    corrects the remaining sampler -> trainer shift (Yao et al. 2025; verl's rollout correction).
    The cap C bounds the variance a rare large ratio would add."""
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(trainer_old_logprobs - sampler_logprobs), threshold))


def clipped_surrogate(logprobs: Array, old_logprobs: Array, advantages: Array, cfg: LossConfig,
                      is_weights: Array | None = None):
    """PPO's clipped surrogate per token [B, N] and its diagnostics (per token).

    With `cfg.clip_ratio_c` = c (verl's dual clip; the released code uses c = 3), a token with
    A < 0 has its loss capped at -A·c: a huge ratio on a negative advantage cannot blow the step
    up. A >= 0 is unchanged. clip_frac_lower counts the tokens the cap binds (0 when off).
    `is_weights` (`tis_weights`, None = off) multiplies each token's loss after both clips, so
    pg_loss reports the loss actually optimised."""
    ratio = jnp.exp(logprobs - old_logprobs)
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    clipped = jnp.clip(ratio, 1.0 - cfg.clip_eps, 1.0 + high)
    pg = -jnp.minimum(ratio * advantages, clipped * advantages)
    is_clipped = (ratio * advantages) > (clipped * advantages)
    capped = jnp.zeros_like(pg, dtype=bool)
    if cfg.clip_ratio_c is not None:
        cap = -advantages * cfg.clip_ratio_c
        capped = (advantages < 0) & (pg > cap)
        pg = jnp.where(capped, cap, pg)
    if is_weights is not None:
        pg = is_weights * pg
    return pg, {"pg_loss": pg, "ratio": ratio, "clip_frac": is_clipped.astype(jnp.float32),
                "clip_frac_lower": capped.astype(jnp.float32)}


def loss_weights(terms, pol_valid: Array, group_ids: Array, arrays: Mapping[str, Array], how: str) -> dict[str, Array]:
    """{row set: [B, N] aggregation weights} for the terms' token sets: "" the RL terms' (the
    policy tokens of rows in a group, group_ids >= 0), and each `LossTerm.rows` name's (the
    policy tokens of rows where arrays[name] [B] > 0)."""
    sets = {"": group_ids >= 0}
    for t in terms:
        if t.rows:
            sets[t.rows] = arrays[t.rows] > 0
    return {k: aggregation_weights(pol_valid & rows[:, None], how) for k, rows in sets.items()}


def aggregation_weights(pol_valid: Array, how: str) -> Array:
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


# ---- the registry ----

LossFn = Callable[[Mapping[str, Array], LossConfig, AlgoConfig], tuple[Array, dict[str, Array]]]


@dataclasses.dataclass(frozen=True)
class LossTerm:
    """A registered loss term: `fn` (see the module docstring), the arrays it reads, the names
    of the metrics it returns (the step accumulates exactly these), the optional arrays it
    reads when the step fills them, and the rows it aggregates over ("": the policy tokens of
    grouped rows; a [B] input's name: its rows > 0; the module docstring)."""

    name: str
    fn: LossFn
    inputs: tuple[str, ...]
    metrics: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    rows: str = ""


LOSS_TERMS: dict[str, LossTerm] = {}


def register_loss_term(name: str, inputs: tuple[str, ...], metrics: tuple[str, ...],
                       optional_inputs: tuple[str, ...] = (), rows: str = ""):
    """Decorator: register `fn(x, loss_cfg, algo_cfg) -> (loss [B, N], {metric: [B, N]})`;
    `rows`: see LossTerm (it must be one of `inputs`)."""
    if rows and rows not in inputs:
        raise ValueError(f"loss term {name!r}: rows={rows!r} must be one of its inputs {tuple(inputs)}")

    def deco(fn: LossFn) -> LossFn:
        if name in LOSS_TERMS:
            raise ValueError(f"loss term {name!r} already registered")
        LOSS_TERMS[name] = LossTerm(name, fn, tuple(inputs), tuple(metrics), tuple(optional_inputs), rows)
        return fn

    return deco


def get_loss_term(name: str) -> LossTerm:
    if name not in LOSS_TERMS:
        raise KeyError(f"unknown loss term {name!r}; known: {sorted(LOSS_TERMS)}")
    return LOSS_TERMS[name]


@register_loss_term("clipped_surrogate", ("logprobs", "old_logprobs", "advantages"),
                    ("pg_loss", "ratio", "clip_frac", "clip_frac_lower"), optional_inputs=("is_weights",))
def _surrogate_term(x, cfg: LossConfig, algo: AlgoConfig):
    return clipped_surrogate(x["logprobs"], x["old_logprobs"], x["advantages"], cfg, x.get("is_weights"))


@register_loss_term("kl", ("logprobs", "ref_logprobs"), ("kl",))
def _kl_term(x, cfg: LossConfig, algo: AlgoConfig):
    kl = kl_penalty(x["logprobs"], x["ref_logprobs"], cfg.kl_estimator, cfg.kl_clip)
    return cfg.kl_coef * kl, {"kl": kl}


@register_loss_term("entropy", ("entropy",), ("entropy",))
def _entropy_term(x, cfg: LossConfig, algo: AlgoConfig):
    """Entropy bonus: -coef · H per token, so the aggregated loss falls by coef · the aggregated
    entropy (verl: policy_loss = pg_loss - entropy_coeff · agg_loss(entropy)). Added by
    rl.methods.resolve_method when loss.entropy_coef > 0."""
    return -cfg.entropy_coef * x["entropy"], {"entropy": x["entropy"]}


def weighted_losses(terms: tuple[LossTerm, ...], x: Mapping[str, Array], weights: Mapping[str, Array],
                    cfg: LossConfig, algo: AlgoConfig, extra=None, *, with_parts: bool = False):
    """The aggregated loss (a scalar) and each metric's weighted sum, each term weighted by its
    rows' weights (`loss_weights`). extra: (per-token loss [B, N], {metric: [B, N]}) added to
    the RL terms' set (the critic's value loss). with_parts: also every metric's per-token values
    {metric: [B, N]} (the trajectory records read them)."""
    total, sums, per_token = 0.0, {}, {}
    for rows in dict.fromkeys([""] * (extra is not None) + [t.rows for t in terms]):
        loss, parts = term_losses(tuple(t for t in terms if t.rows == rows), x, cfg, algo)
        if not rows and extra is not None:
            loss, parts = (extra[0] if loss is None else loss + extra[0]), {**parts, **extra[1]}
        w = weights[rows]
        total = total + jnp.sum(loss * w)
        sums.update({k: jnp.sum(v * w) for k, v in parts.items()})
        per_token.update(parts)
    return (total, sums, per_token) if with_parts else (total, sums)


def term_losses(terms: tuple[LossTerm, ...], x: Mapping[str, Array], cfg: LossConfig,
                algo: AlgoConfig) -> tuple[Array, dict[str, Array]]:
    """Sum of the terms' per-token losses [B, N] and all their per-token metrics."""
    total, metrics = None, {}
    for term in terms:
        given = {k: x[k] for k in term.inputs}
        given.update({k: x[k] for k in term.optional_inputs if x.get(k) is not None})
        loss, parts = term.fn(given, cfg, algo)
        total = loss if total is None else total + loss
        metrics.update(parts)
    return total, metrics
