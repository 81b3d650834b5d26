"""PPO's critic: token rewards, GAE over the policy tokens, the clipped value loss, and the critic
model (a value head on its own Qwen3 trunk).

The critic is a separate model, as in verl's PPO: a Qwen3 trunk (initialised from the policy's
starting weights) and a linear value head [D] + bias (initialised to zero, so V = 0 before the
first update). It is trained by its own optimizer on its own loss; nothing it does reaches the
policy's gradient, so a critic-carrying method whose advantage is replaced by GRPO's makes the
GRPO step exactly (tests/test_rl_critic_step.py).

All arrays are in the compact policy-position layout (rl.batch): [B, N] per policy token, in the
order the policy wrote them. V(s_t) is read at token t's *predictor* position (the last token
before it): the state before the policy emits token t.

GAE runs over the policy tokens only. Observation tokens (tool results) between two turns are
part of the environment's transition, not steps of the agent: the value after turn k's last token
is the value before turn k+1's first, and γ, λ apply once per policy token. This is verl's rule
(its GAE skips positions outside the response mask, carrying the next value and the running
advantage over them); tests/test_rl_critic.py checks it against a loop over a padded layout.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.auxiliaries import StageOut, StepAuxiliary, register_auxiliary
from turnsight_jax.rl.logprobs import gather_rows, layout_fields, predictor_positions, row_layout
from turnsight_jax.rl.packing import packed_index
from turnsight_jax.models.attention import Layout
from turnsight_jax.rl.length_classes import run_by_class
from turnsight_jax.rl.config import OptimConfig, always_checked
from turnsight_jax.rl.methods import Method, register_config_section, register_method, register_progress_metrics

Array = jax.Array


def token_rewards(rewards: Array, pol_valid: Array) -> Array:
    """The trajectory reward placed on its last policy token: rewards [B], pol_valid [B, N] bool ->
    [B, N] float32 (0 elsewhere; a trajectory without policy tokens gets nothing)."""
    n = pol_valid.shape[1]
    last = jnp.max(jnp.where(pol_valid, jnp.arange(n)[None], -1), axis=1)  # [B], -1: none
    at = (jnp.arange(n)[None] == last[:, None]) & pol_valid
    return jnp.where(at, jnp.asarray(rewards, jnp.float32)[:, None], 0.0)


def gae(rewards: Array, values: Array, mask: Array, *, gamma: float = 1.0, lam: float = 1.0) -> tuple[Array, Array]:
    """Generalised advantage estimation over the masked positions of each row.

    rewards, values [B, N] float, mask [B, N] bool -> (advantages, returns), both [B, N] float32,
    0 where masked out. For the masked positions t_1 < t_2 < ... of a row (the row's steps, in
    order), with V after the last step = 0:
        δ_i = r_i + γ V_{i+1} − V_i,   A_i = δ_i + γ λ A_{i+1},   R_i = A_i + V_i.
    Positions outside the mask are skipped: the next value and the running advantage are carried
    over them unchanged. A reverse `lax.scan` over N (no Python loop over tokens)."""
    r = jnp.where(mask, jnp.asarray(rewards, jnp.float32), 0.0)
    v = jnp.where(mask, jnp.asarray(values, jnp.float32), 0.0)
    g = jnp.asarray(gamma, jnp.float32)
    gl = g * jnp.asarray(lam, jnp.float32)

    def body(carry, x):
        next_v, next_a = carry
        r_t, v_t, m_t = x
        a_t = r_t + g * next_v - v_t + gl * next_a
        carry = (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a))
        return carry, jnp.where(m_t, a_t, 0.0)

    zeros = jnp.zeros(r.shape[0], jnp.float32)
    _, adv = jax.lax.scan(body, (zeros, zeros), (r.T, v.T, mask.T), reverse=True)
    adv = adv.T
    return adv, jnp.where(mask, adv + v, 0.0)


def whiten(x: Array, mask: Array, eps: float = 1e-8) -> Array:
    """(x − mean) / sqrt(var + eps) over the masked entries of the whole batch (var with Bessel's
    correction, as verl's masked_whiten); 0 outside the mask. x, mask [B, N]."""
    m = mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    mean = jnp.sum(x * m) / n
    var = jnp.sum(jnp.square(x - mean) * m) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(mask, (x - mean) * jax.lax.rsqrt(var + eps), 0.0)


def value_loss(values: Array, old_values: Array, returns: Array, clip: float | None) -> tuple[Array, Array]:
    """PPO's clipped value loss per token [B, N] and where the clip binds (float 0/1 [B, N]):
    0.5 · max((V − R)², (clip(V, V_old − c, V_old + c) − R)²); c = None: 0.5 · (V − R)²."""
    unclipped = jnp.square(values - returns)
    if clip is None:
        return 0.5 * unclipped, jnp.zeros_like(unclipped)
    clipped_v = old_values + jnp.clip(values - old_values, -clip, clip)
    clipped = jnp.square(clipped_v - returns)
    return 0.5 * jnp.maximum(unclipped, clipped), (clipped > unclipped).astype(jnp.float32)


def explained_variance(values: Array, returns: Array, mask: Array) -> Array:
    """1 − Var(R − V) / Var(R) over the masked tokens (1: perfect, 0: no better than a constant)."""
    m = mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)

    def var(x):
        mu = jnp.sum(x * m) / n
        return jnp.sum(jnp.square(x - mu) * m) / n

    return 1.0 - var(returns - values) / jnp.maximum(var(returns), 1e-12)


# ---- the critic model ----

def init_head(hidden_size: int) -> dict:
    """The value head {"value_w": [D] f32, "value_b": [] f32}, zero: V = 0 until the first update."""
    return {"value_w": jnp.zeros((hidden_size,), jnp.float32), "value_b": jnp.zeros((), jnp.float32)}


def _head(hidden: Array, head: dict) -> Array:
    """hidden [..., D] -> values [...] float32."""
    return jnp.einsum("...d,d->...", hidden.astype(jnp.float32), head["value_w"]) + head["value_b"]


def hidden_at(trunk, batch, positions: Array) -> Array:
    """The trunk's final hidden states at per-trajectory token positions: positions [B, M] int32
    (indices into each trajectory's own tokens, as `batch.tokens` [B, T] holds them) -> [B, M, D].
    The batch's layout (plain, length classes, packed rows) as rl.logprobs.policy_logprobs; the
    trunk reads `batch.valid` (the student's context). `trunk` a Qwen3 whose vocabulary head is
    not used. An RL-step forward: attention skips the rows' query chunks of padding per
    `model.attn_row_group` rows (Qwen3.hidden_states(skip_padding=True))."""
    if batch.packed is not None:
        pk = batch.packed
        hidden = trunk.hidden_states(pk.tokens, pk.layout, skip_padding=True)
        s = pk.plan.shards
        b, m = positions.shape
        flat = packed_index(pk, positions)  # [S, B/S * M]
        return gather_rows(hidden.reshape(s, -1, hidden.shape[-1]), flat).reshape(b, m, -1)
    if batch.classes is None:
        return gather_rows(trunk.hidden_states(batch.tokens, row_layout(batch.valid, batch.layout), skip_padding=True),
                           positions)

    def one(_, pos, tokens, valid, *lay):
        return gather_rows(trunk.hidden_states(tokens, row_layout(valid, Layout(*lay) if lay else None),
                                               skip_padding=True), pos)

    return run_by_class(one, batch.classes, batch.length_class, (positions,),
                        (batch.tokens, batch.valid, *layout_fields(batch.layout)))


def policy_values(trunk, head: dict, batch) -> Array:
    """V at every policy token of a TrainBatch's (or micro-batch's) rows: [B, N] float32, 0 on
    padding slots; read at each token's predictor position (`hidden_at`)."""
    hidden = hidden_at(trunk, batch, predictor_positions(batch.valid, batch.pol_pos))
    return jnp.where(batch.pol_valid, _head(hidden, head), 0.0)


# ---- the estimator ----

def gae_advantages(rewards: Array, values: Array, policy_mask: Array, *, gae_gamma, gae_lam, gae_whiten: bool):
    """The registered "gae" estimator: the outcome reward on the last policy token (token_rewards),
    GAE(γ, λ) against the critic's values, optionally whitened over the batch (verl's default).
    rewards [B], values [B, N], policy_mask [B, N] -> {"advantages", "returns"} [B, N] float32
    (returns: A + V before whitening, the value loss's targets)."""
    adv, returns = gae(token_rewards(rewards, policy_mask), values, policy_mask, gamma=gae_gamma, lam=gae_lam)
    if gae_whiten:
        adv = whiten(adv, policy_mask)
    return {"advantages": adv, "returns": returns}


def gae_process_advantages(rewards: Array, values: Array, policy_mask: Array, process_rewards: Array, *,
                           gae_gamma, gae_lam, gae_whiten: bool):
    """The registered "gae_process" estimator (PiCA): GAE over the outcome reward on the last
    policy token plus per-token process rewards [B, N] (methods.prm's progress rewards); otherwise as
    gae_advantages."""
    r = token_rewards(rewards, policy_mask) + jnp.where(policy_mask, process_rewards, 0.0)
    adv, returns = gae(r, values, policy_mask, gamma=gae_gamma, lam=gae_lam)
    if gae_whiten:
        adv = whiten(adv, policy_mask)
    return {"advantages": adv, "returns": returns}


def _register() -> None:
    from turnsight_jax.rl.advantages import register_advantage

    knobs = ("gae.gamma", "gae.lam", "gae.whiten")  # the run config's gae.* section (GaeConfig)
    register_advantage("gae", ("rewards", "values", "policy_mask"), knobs)(gae_advantages)
    register_advantage("gae_process", ("rewards", "values", "policy_mask", "process_rewards"), knobs)(
        gae_process_advantages)


_register()


# ---- the step auxiliary (rl.auxiliaries) ----

def init_state(params, hidden_size: int, optimizer) -> dict:
    """The critic at the start of a run: the trunk a copy of the policy's parameters `params`
    (verl initialises its critic from the actor's model), the value head zero, and its optimizer's
    state: {"params": {"trunk", "head"}, "opt_state"} (the step's aux["critic"], the checkpoint's
    "critic" item)."""
    cp = {"trunk": jax.tree.map(jnp.copy, params), "head": init_head(hidden_size)}
    return {"params": cp, "opt_state": optimizer.init(cp)}


def _stage_values(inputs, state, optimizer):
    """V_old [B, N] at the step's start, no gradient, micro-batched like the gradient passes: the
    advantage's "values" and the value loss's clipping centre."""
    cp = state["params"]
    trunk = nnx.merge(inputs.graphdef, cp["trunk"])
    values = jax.lax.stop_gradient(inputs.student_pass(lambda rows: policy_values(trunk, cp["head"], rows)))
    return StageOut({"values": values}, {}, carry=values)


def _stage_returns(inputs, state, old_values, estimator_out):
    """The value loss's targets: the estimator's "returns" (GAE's), or, for an advantage without
    them (e.g. GRPO's over a critic-carrying method), GAE's returns against V_old."""
    batch, g = inputs.batch, inputs.cfg.algo.section("gae")
    returns = estimator_out.get("returns")
    if returns is None:
        _, returns = gae(token_rewards(batch.signals["rewards"], batch.pol_valid), old_values, batch.pol_valid,
                         gamma=g.gamma, lam=g.lam)
    metrics = {"critic/explained_variance": explained_variance(old_values, returns, batch.pol_valid),
               "critic/returns_mean": jnp.sum(jnp.where(batch.pol_valid, returns, 0.0))
               / jnp.maximum(batch.pol_valid.sum(), 1)}
    return {"returns": jax.lax.stop_gradient(returns), "old_values": old_values}, metrics


def _value_loss(graphdef, cfg, params, rows, x):
    """The clipped value loss [B, N] of a micro-batch's rows; its gradient reaches the critic only."""
    values = policy_values(nnx.merge(graphdef, params["trunk"]), params["head"], rows)
    vl, vclip = value_loss(values, x["old_values"], x["returns"], cfg.algo.section("critic").value_clip)
    return vl, {"value_loss": vl, "value_clip_frac": vclip, "values_mean": values}


# ---- registration ----

@dataclasses.dataclass(frozen=True)
class GaeConfig:
    """The run config's `gae.*` section: GAE of the methods with a critic (PPO, PiCA)."""

    gamma: float = 1.0  # discount per policy token (verl: 1.0)
    lam: float = 1.0  # GAE lambda (verl: 1.0)
    whiten: bool = True  # advantages whitened over the batch's policy tokens (verl's default)

    def validate(self) -> "GaeConfig":
        for key in ("gamma", "lam"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise ConfigError(f"gae.{key} must be in [0, 1], got {v!r}")
        if not isinstance(self.whiten, bool):
            raise ConfigError(f"gae.whiten must be True or False, got {self.whiten!r}")
        return self


register_config_section("gae", GaeConfig, always_checked("gae", GaeConfig, "a GAE"))


@dataclasses.dataclass(frozen=True)
class CriticConfig:
    """The run config's `critic.*` section: the critic's own AdamW (its schedule's length, b1 and
    b2 are the policy's) and the value clip c of the loss 0.5 · max((V − R)², (clip(V, V_old ± c) −
    R)²)."""

    lr: float = 1e-5  # peak learning rate (verl's critic default)
    warmup_steps: int = 0  # linear warm-up steps of the critic's learning rate
    weight_decay: float = 0.01  # the critic's AdamW weight decay
    max_grad_norm: float = 1.0  # the critic's own global gradient-norm clip
    value_clip: float | None = 0.5  # None: unclipped (verl's cliprange_value 0.5)

    def validate(self) -> "CriticConfig":
        c = self.value_clip
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
            raise ConfigError(f"critic.value_clip must be None (off) or a number > 0, got {c!r}")
        for key in ("lr", "max_grad_norm"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                raise ConfigError(f"critic.{key} must be finite and > 0, got {v!r}")
        if isinstance(self.weight_decay, bool) or not self.weight_decay >= 0:
            raise ConfigError(f"critic.weight_decay must be >= 0, got {self.weight_decay!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"critic.warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        return self


register_config_section("critic", CriticConfig, always_checked("critic", CriticConfig, "a critic"))


def critic_optim(step_cfg) -> OptimConfig:
    """The critic's optimizer settings: its section's, over the policy's schedule length, b1, b2."""
    c, o = step_cfg.algo.section("critic"), step_cfg.optim
    return OptimConfig(lr=c.lr, warmup_steps=c.warmup_steps, total_steps=o.total_steps, b1=o.b1, b2=o.b2,
                       weight_decay=c.weight_decay, max_grad_norm=c.max_grad_norm)


def _announce(step_cfg, model_cfg) -> str:
    c = step_cfg.algo.section("critic")
    return f"critic: a {model_cfg.num_layers}-layer trunk + value head, lr {c.lr:g}, value clip {c.value_clip}"

register_auxiliary(StepAuxiliary(
    "critic", provides=("values",), needs_outputs=("rewards",), init=init_state, optim=critic_optim,
    before_advantage=_stage_values, after_advantage=_stage_returns, loss=_value_loss,
    loss_metrics=("value_loss", "value_clip_frac", "values_mean"), describe="critic (value head, clipped value loss)",
    announce=_announce))

register_method(Method("ppo", advantage="gae", auxiliaries=("critic",),
                       description="PPO: outcome reward on the last token, GAE(gamma, lambda) against a learned critic"))

register_progress_metrics({"critic/value_loss": "v_loss"})
