"""The self-distillation baselines of the TurnSight paper's Table 1: RLSD, SDPO, SDAR and SOD
(docs/baselines.md), as small pure functions registered by name (advantage estimators and loss
terms), so they run in the same fused step as TurnSight.

Their teachers score *privileged views* (methods.privileged_views): each policy token y_t under the
student's context plus a privileged block (the gold answer, a successful sibling rollout, the
environment's feedback or a skill text; methods.privileged_blocks), or, for SOD, under another model on the
student's own context. All arrays are in the compact policy layout of rl.batch ([B, N] per policy
token); `covered` [B, N] bool marks the tokens whose view had a block (a missing block, e.g. no
successful sibling, leaves the token to the base method: no modulation, no distillation).

* RLSD (arXiv 2604.03128): Δ_t = log π_T(y_t | x, privileged) − log π_θ(y_t | x),
  w_t = clip(exp(sign(A_t)·Δ_t), 1 − ε_w, 1 + ε_w), Ã_t = A_t·((1 − λ) + λ·w_t).
* SDPO (arXiv 2601.20802): KL(π_θ(·|x, y<t) ‖ sg π_T(·|x, f, y<t)) per sampled position on the
  teacher's top-K tokens (`topk_kl`), times a coefficient; or, as the "sdpo_advantage" method,
  the sampled-token form Ã_t = A_t + c·Δ_t.
* SDAR (arXiv 2605.15155): gate g_t = σ(β·δ_t) (detached), δ_t = log π_θ(y_t | r, x) −
  log π_θ(y_t | x) with r a skill text; L = −c·Σ_t g_t·log π_θ(y_t | x) next to GRPO.
* SOD (arXiv 2605.07725): the top-K KL to an external teacher, each turn's strength multiplied by
  ω_k = exp(−D̄_k / τ), D̄_k the turn's mean KL (detached): turns where student and teacher
  diverge most are attenuated. The paper states the attenuation, not its formula; this one is ours.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from turnsight_jax.rl.advantages import register_advantage
from turnsight_jax.rl.config import AlgoConfig, LossConfig
from turnsight_jax.rl.losses import register_loss_term

Array = jax.Array
_TINY = 1e-12  # floor of a tail probability before its log (the tail's term then vanishes)


def _masked_mean(x: Array, mask: Array) -> Array:
    return jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def _share(cond: Array, mask: Array) -> Array:
    return jnp.sum(cond & mask) / jnp.maximum(jnp.sum(mask), 1)


# ---- RLSD ----

def rlsd_weights(delta: Array, base_adv: Array, covered: Array, eps_w: float) -> Array:
    """w_t = clip(exp(sign(A_t)·Δ_t), 1 − ε_w, 1 + ε_w) on covered tokens, 1 elsewhere.
    delta, base_adv [B, N] float32, covered [B, N] bool -> [B, N] float32 (no gradient)."""
    d = jax.lax.stop_gradient(jnp.where(covered, delta, 0.0))
    w = jnp.clip(jnp.exp(jnp.sign(base_adv) * d), 1.0 - eps_w, 1.0 + eps_w)
    return jnp.where(covered, w, 1.0)


def rlsd_advantages(delta: Array, base_advantages: Array, policy_mask: Array, teacher_covered: Array, *,
                    lam: float, eps_w: float) -> dict[str, Array]:
    """RLSD's modulated advantage. delta [1, B, N] (the privileged view's teacher − student
    log-probs), base_advantages [B, N] (MatchTIR in the paper), policy_mask, teacher_covered [B, N]
    bool -> {"advantages": Ã [B, N], "rlsd_weights": w, diagnostics}. λ = 0 gives A exactly."""
    base = jax.lax.stop_gradient(jnp.where(policy_mask, base_advantages, 0.0))
    covered = policy_mask & teacher_covered
    w = rlsd_weights(delta[0], base, covered, eps_w)
    adv = jnp.where(policy_mask, base * ((1.0 - lam) + lam * w), 0.0)
    moved = covered & (base != 0)
    return {"advantages": adv, "rlsd_weights": w,
            "rlsd/weight_mean": _masked_mean(w, policy_mask),
            "rlsd/weight_min": jnp.min(jnp.where(policy_mask, w, jnp.inf)),
            "rlsd/weight_max": jnp.max(jnp.where(policy_mask, w, -jnp.inf)),
            "rlsd/frac_strengthened": _share(w > 1.0, moved), "rlsd/frac_weakened": _share(w < 1.0, moved)}


# ---- SDPO (sampled-token advantage form) ----

def sdpo_advantages(delta: Array, base_advantages: Array, policy_mask: Array, teacher_covered: Array, *,
                    sdpo_coef: float) -> dict[str, Array]:
    """Ã_t = A_t + c·Δ_t on covered policy tokens (Δ the feedback teacher's gap, [1, B, N]);
    c = 0 gives A exactly."""
    base = jax.lax.stop_gradient(jnp.where(policy_mask, base_advantages, 0.0))
    covered = policy_mask & teacher_covered
    gap = jax.lax.stop_gradient(jnp.where(covered, delta[0], 0.0))
    adv = jnp.where(policy_mask, base + sdpo_coef * gap, 0.0)
    return {"advantages": adv, "sdpo/gap_mean": _masked_mean(gap, covered),
            "sdpo/frac_strengthened": _share(gap > 0, covered), "sdpo/frac_weakened": _share(gap < 0, covered)}


def base_passthrough(base_advantages: Array) -> Array:
    """The base method's advantage unchanged: the methods whose mechanism is a loss term (SDPO,
    SDAR, SOD) run over rl.base (GRPO, MatchTIR, ...) through it."""
    return base_advantages


register_advantage("base", ("base_advantages",))(base_passthrough)
register_advantage("rlsd", ("delta", "base_advantages", "policy_mask", "teacher_covered"),
                   ("lam", "eps_w"))(rlsd_advantages)
register_advantage("sdpo_advantage", ("delta", "base_advantages", "policy_mask", "teacher_covered"),
                   ("sdpo.coef",))(sdpo_advantages)


# ---- the top-K KL (SDPO, SOD) ----

def topk_kl(student: Array, teacher: Array, *, tail: bool = True) -> Array:
    """KL(student ‖ teacher) per position on the teacher's top-K tokens.

    student [..., K]: the student's log-probs of the teacher's K tokens (differentiated);
    teacher [..., K]: the teacher's (no gradient). tail=True: the K tokens and one more category
    holding the rest of the vocabulary (1 − Σ p), a proper KL between the two coarsened
    distributions (never above the full-vocabulary KL); tail=False: both renormalised over the K.
    Returns [...] float32 >= 0."""
    s = jnp.asarray(student, jnp.float32)
    q = jax.lax.stop_gradient(jnp.asarray(teacher, jnp.float32))
    if not tail:
        s = s - jax.nn.logsumexp(s, axis=-1, keepdims=True)
        q = q - jax.nn.logsumexp(q, axis=-1, keepdims=True)
        return jnp.sum(jnp.exp(s) * (s - q), axis=-1)
    ps = jnp.exp(s)
    rest_s = jnp.maximum(1.0 - jnp.sum(ps, axis=-1), 0.0)
    rest_q = jnp.maximum(1.0 - jnp.sum(jnp.exp(q), axis=-1), 0.0)
    tail_kl = rest_s * (jnp.log(jnp.maximum(rest_s, _TINY)) - jnp.log(jnp.maximum(rest_q, _TINY)))
    return jnp.sum(ps * (s - q), axis=-1) + tail_kl


def turn_mean(values: Array, turn_ids: Array, mask: Array) -> Array:
    """Each token's turn mean of `values` over the masked tokens of its (row, turn): [B, N] ->
    [B, N] (0 off the mask). Turn ids are < N (a turn holds at least one policy token)."""
    b, n = values.shape
    ok = mask & (turn_ids >= 0)
    seg = jnp.where(ok, jnp.arange(b)[:, None] * n + jnp.clip(turn_ids, 0, n - 1), b * n).reshape(-1)
    total = jax.ops.segment_sum(jnp.where(ok, values, 0.0).reshape(-1), seg, num_segments=b * n + 1)
    count = jax.ops.segment_sum(ok.reshape(-1).astype(jnp.float32), seg, num_segments=b * n + 1)
    mean = total / jnp.maximum(count, 1.0)
    return jnp.where(ok, mean[seg].reshape(b, n), 0.0)


def sod_turn_weights(kl: Array, turn_ids: Array, mask: Array, tau: float) -> Array:
    """ω = exp(−D̄_k / τ) per token, D̄_k its turn's mean top-K KL (detached): [B, N]. D̄_k is a
    KL (>= 0); floored at 0 so that float rounding (teacher = student, D̄ ~ −1e-8) keeps ω <= 1."""
    d = jnp.maximum(turn_mean(jax.lax.stop_gradient(kl), turn_ids, mask), 0.0)
    return jnp.where(mask, jnp.exp(-d / tau), 0.0)


@register_loss_term("sdpo_kl", ("topk_logprobs", "teacher_topk_logprobs", "teacher_covered", "pol_valid"),
                    ("sdpo_kl",))
def _sdpo_term(x, cfg: LossConfig, algo: AlgoConfig):
    """SDPO's distillation: c·KL(student ‖ sg feedback teacher) on the teacher's top-K, per token."""
    mask = x["pol_valid"] & x["teacher_covered"]
    sdpo = algo.section("sdpo")
    kl = jnp.where(mask, topk_kl(x["topk_logprobs"], x["teacher_topk_logprobs"], tail=sdpo.tail), 0.0)
    return sdpo.coef * kl, {"sdpo_kl": kl}


@register_loss_term("sdar", ("logprobs", "teacher_logprobs", "teacher_covered", "pol_valid"),
                    ("sdar_gate", "sdar_nll"))
def _sdar_term(x, cfg: LossConfig, algo: AlgoConfig):
    """SDAR's gated NLL: −c·σ(β·(log π_T − log π_θ))·log π_θ, the gate detached."""
    mask = x["pol_valid"] & x["teacher_covered"]
    lp = x["logprobs"]
    gap = jax.lax.stop_gradient(x["teacher_logprobs"] - lp)
    sdar = algo.section("sdar")
    gate = jnp.where(mask, jax.nn.sigmoid(sdar.beta * gap), 0.0)
    nll = jnp.where(mask, -lp, 0.0)
    return sdar.coef * gate * nll, {"sdar_gate": gate, "sdar_nll": nll}


@register_loss_term("sod", ("topk_logprobs", "teacher_topk_logprobs", "turn_ids", "pol_valid"),
                    ("sod_kl", "sod_weight"))
def _sod_term(x, cfg: LossConfig, algo: AlgoConfig):
    """SOD: c·ω_k·KL_t, ω_k = exp(−D̄_k / τ) of the token's turn (sod_turn_weights)."""
    mask = x["pol_valid"]
    sod = algo.section("sod")
    kl = jnp.where(mask, topk_kl(x["topk_logprobs"], x["teacher_topk_logprobs"], tail=sod.tail), 0.0)
    w = sod_turn_weights(kl, x["turn_ids"], mask, sod.tau)
    return sod.coef * w * kl, {"sod_kl": kl, "sod_weight": w}


# ---- registration ----
# Their teachers (teacher.*) score privileged views (methods.privileged_views, its privileged.* section).
from turnsight_jax.errors import ConfigError  # noqa: E402
from turnsight_jax.methods import privileged_views  # noqa: E402, F401  the "privileged" teacher kind's view builder and section
from turnsight_jax.rl.config import always_checked  # noqa: E402
from turnsight_jax.rl.methods import (Method, register_config_section, register_method,  # noqa: E402
                                     register_progress_metrics)


def _number(section: str, key: str, value, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or (
            value <= 0 if positive else value < 0):
        raise ConfigError(f"{section}.{key} must be finite and {'> 0' if positive else '>= 0'}, got {value!r}")


def _flag(section: str, key: str, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{section}.{key} must be True or False, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SdpoConfig:
    """The run config's `sdpo.*` section (SDPO and its sampled-token form sdpo_advantage)."""

    coef: float = 1.0  # coefficient of the top-K KL to the feedback teacher (sdpo_advantage: of its gap in the advantage)
    tail: bool = True  # the top-K KL keeps the rest of the vocabulary as one extra category; False: renormalised over the K

    def validate(self) -> "SdpoConfig":
        _number("sdpo", "coef", self.coef)
        _flag("sdpo", "tail", self.tail)
        return self


@dataclasses.dataclass(frozen=True)
class SdarConfig:
    """The run config's `sdar.*` section."""

    coef: float = 1.0  # coefficient of the gated auxiliary NLL
    beta: float = 1.0  # the gate sigmoid(beta * (teacher - student log-prob))'s sharpness

    def validate(self) -> "SdarConfig":
        _number("sdar", "coef", self.coef)
        _number("sdar", "beta", self.beta, positive=True)
        return self


@dataclasses.dataclass(frozen=True)
class SodConfig:
    """The run config's `sod.*` section."""

    coef: float = 1.0  # coefficient of the turn-weighted top-K KL to the external teacher
    tau: float = 1.0  # turn weight exp(-turn divergence / tau) (the SOD paper gives no formula: ours)
    tail: bool = True  # the top-K KL keeps the rest of the vocabulary as one extra category; False: renormalised over the K

    def validate(self) -> "SodConfig":
        _number("sod", "coef", self.coef)
        _number("sod", "tau", self.tau, positive=True)
        _flag("sod", "tail", self.tail)
        return self


for _name, _schema, _what in (("sdpo", SdpoConfig, "an SDPO"), ("sdar", SdarConfig, "an SDAR"),
                              ("sod", SodConfig, "a SOD")):
    register_config_section(_name, _schema, always_checked(_name, _schema, _what))


register_method(Method("rlsd", advantage="rlsd", rewards=(), teacher="privileged",
                       description="RLSD: the base advantage modulated by clip(exp(sign(A) * teacher gap))"))
register_method(Method("sdpo", advantage="base", rewards=(), loss_terms=("clipped_surrogate", "sdpo_kl"), teacher="privileged",
                       description="SDPO: the base method + top-K KL to the feedback-conditioned teacher"))
register_method(Method("sdpo_advantage", advantage="sdpo_advantage", rewards=(), teacher="privileged",
                       description="SDPO, sampled-token form: base advantage + coef * teacher gap"))
register_method(Method("sdar", advantage="base", rewards=(), loss_terms=("clipped_surrogate", "sdar"), teacher="privileged",
                       description="SDAR: the base method + the sigmoid-gated NLL toward a skill-text teacher"))
register_method(Method("sod", advantage="base", rewards=(), loss_terms=("clipped_surrogate", "sod"), teacher="privileged",
                       description="SOD: the base method + turn-weighted top-K KL to an external teacher"))

register_progress_metrics({"rlsd/weight_max": "w_max", "train/sdpo_kl": "sdpo_kl", "sdpo/gap_mean": "sdpo_gap",
                           "train/sdar_gate": "gate", "train/sod_weight": "sod_w"})
