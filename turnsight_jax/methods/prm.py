"""PiCA's step-PRM (docs/ppo.md, "PiCA"): h(s) = P(not yet solved | the trajectory up to s),
its training loss (labels where they are known, a hinge on increases along solved trajectories),
and the progress rewards it writes at tool-result boundaries for GAE (methods.critic) to propagate.

Which PRM: a logistic head (`prm_w` [D], `prm_b`) on the *frozen reference trunk* (the initial
policy, already resident for the KL and the teachers: no extra model). It is trained online, a
stage of every step (not a separate `python -m` job): on the step's own trajectories, with its own
AdamW, after its step-start values have given the rewards (so the rewards never see a head fitted
to their own batch). Its gradient reaches the head only.

States of a trajectory with n turns, s_0 .. s_n: s_k (k < n) is the state before turn k's first
policy token (the prompt and every earlier turn and tool result: read at that token's predictor
position), s_n the state after the whole trajectory (its last readable token). State k >= 1 is
the boundary after turn k−1's tool results.

Progress rewards: at boundary k = 1 .. n−1 (after a tool result; s_n, after the answer, is the
outcome's), the gain g_k = α · γ^(k−1) · (h(s_{k−1}) − h(s_k) − β) on the last policy token of
turn k−1 (the turn whose calls produced the result). The paper's α · γ^(i−2) counts steps from
i = 2 at the first boundary: the same exponents. β is the fixed baseline (0: a gain is any fall
of h); the decay γ < 1 makes later calls worth less (against call spamming).

Training labels: a failed trajectory (outcome below `success_reward`) is unsolved at every
prefix: h(s_k) → 1 for all k <= n; a solved one is solved at its end: h(s_n) → 0; its earlier
states carry no label but the monotonicity hinge Σ_k max(0, h(s_{k+1}) − h(s_k)): information only
accumulates, so along a solved trajectory h may not rise.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from turnsight_jax.errors import ConfigError
from turnsight_jax.methods.critic import hidden_at
from turnsight_jax.rl.auxiliaries import StageOut, StepAuxiliary, register_auxiliary
from turnsight_jax.rl.config import OptimConfig, section_settings
from turnsight_jax.rl.logprobs import predictor_positions
from turnsight_jax.rl.methods import Method, register_config_section, register_method, register_progress_metrics

Array = jax.Array


def init_head(hidden_size: int) -> dict:
    """The PRM head {"prm_w": [D] f32, "prm_b": [] f32}: zero weights, bias 0 (h = 0.5 everywhere)."""
    return {"prm_w": jnp.zeros((hidden_size,), jnp.float32), "prm_b": jnp.zeros((), jnp.float32)}


def state_positions(turn_ids: Array, pol_valid: Array, pred_pos: Array, valid: Array, num_turns: Array,
                    max_turns: int) -> tuple[Array, Array]:
    """Where each state is read: ([B, K+1] int32 positions, [B, K+1] bool exists), K = max_turns.

    turn_ids, pol_valid, pred_pos [B, N] (pred_pos: each policy token's predictor position,
    rl.logprobs.predictor_positions); valid [B, T]; num_turns [B]. State k < n: pred_pos of turn
    k's first policy slot; state n: the last readable token; k > n: absent (position 0)."""
    b, n_slots = turn_ids.shape
    k = jnp.arange(max_turns + 1)
    n = jnp.clip(num_turns, 0, max_turns)
    is_turn = (turn_ids[:, None, :] == k[None, :, None]) & pol_valid[:, None, :]  # [B, K+1, N]
    first = jnp.argmax(is_turn, axis=2)  # the first slot of turn k (0 when none)
    has = jnp.any(is_turn, axis=2)
    start = jnp.take_along_axis(pred_pos, first, axis=1)
    last = jnp.max(jnp.where(valid, jnp.arange(valid.shape[1])[None], 0), axis=1)  # [B]
    is_end = k[None] == n[:, None]
    pos = jnp.where(is_end, last[:, None], jnp.where(has & (k[None] < n[:, None]), start, 0))
    exists = is_end | (has & (k[None] < n[:, None]))
    return pos.astype(jnp.int32), exists


def head_logits(hidden: Array, head: dict) -> Array:
    """The PRM's logits at states: hidden [B, M, D] -> [B, M] float32 (h = sigmoid of them)."""
    return jnp.einsum("bmd,d->bm", hidden.astype(jnp.float32), head["prm_w"]) + head["prm_b"]


def progress_rewards(h: Array, exists: Array, turn_ids: Array, pol_valid: Array, num_turns: Array, *,
                     alpha: float, decay: float, baseline: float) -> tuple[Array, Array]:
    """PiCA's token rewards [B, N] and the gains [B, K+1] (0 where no boundary).

    h, exists [B, K+1] (states s_0 .. s_K); gain at boundary k (1 <= k <= n−1) =
    alpha · decay^(k−1) · (h_{k−1} − h_k − baseline), written on the last policy slot of turn k−1."""
    b, m = h.shape
    k = jnp.arange(m)
    n = num_turns[:, None]
    boundary = (k[None] >= 1) & (k[None] <= n - 1) & exists & jnp.roll(exists, 1, axis=1)
    prev = jnp.concatenate([h[:, :1], h[:, :-1]], axis=1)
    scale = alpha * jnp.power(jnp.asarray(decay, jnp.float32), jnp.maximum(k - 1, 0).astype(jnp.float32))
    gains = jnp.where(boundary, scale[None] * (prev - h - baseline), 0.0)  # [B, K+1]
    # the last slot of each turn j = k − 1 receives gains[:, j + 1]
    slots = jnp.arange(turn_ids.shape[1])
    last_of_turn = jnp.max(jnp.where((turn_ids[:, None, :] == k[None, :, None]) & pol_valid[:, None, :],
                                     slots[None, None], -1), axis=2)  # [B, K+1]: turn j's last slot, -1 none
    src = jnp.concatenate([gains[:, 1:], jnp.zeros((b, 1), gains.dtype)], axis=1)  # src[j] = gains[j + 1]
    hit = (slots[None, None, :] == last_of_turn[:, :, None])  # [B, K+1, N]
    tokens = jnp.sum(jnp.where(hit, src[:, :, None], 0.0), axis=1)
    return jnp.where(pol_valid, tokens, 0.0), gains


def monotonicity_hinge(h: Array, exists: Array) -> Array:
    """Per consecutive pair of existing states (k, k+1): max(0, h_{k+1} − h_k), [B, K] (0 where
    either state is absent). Penalises exactly the increases of h; a fall or a tie costs 0."""
    pair = exists[:, 1:] & exists[:, :-1]
    return jnp.where(pair, jnp.maximum(h[:, 1:] - h[:, :-1], 0.0), 0.0)


def prm_loss(head: dict, hidden: Array, exists: Array, num_turns: Array, solved: Array, hinge_coef: float):
    """The PRM's loss on one batch and its parts. hidden [B, K+1, D] (the frozen trunk's states,
    no gradient), exists [B, K+1], num_turns [B], solved [B] bool. BCE (mean over labelled states:
    every state of a failed trajectory labelled 1, the final state of a solved one 0) +
    hinge_coef · the mean over solved trajectories' state pairs of monotonicity_hinge."""
    logits = head_logits(hidden, head)
    h = jax.nn.sigmoid(logits)
    k = jnp.arange(hidden.shape[1])
    final = k[None] == jnp.clip(num_turns, 0, hidden.shape[1] - 1)[:, None]
    labelled = exists & (~solved[:, None] | final)
    target = jnp.where(solved[:, None], 0.0, 1.0)
    # BCE from logits: softplus(z) − y·z
    bce = jnp.where(labelled, jax.nn.softplus(logits) - target * logits, 0.0)
    bce_mean = jnp.sum(bce) / jnp.maximum(jnp.sum(labelled), 1)
    pairs = (exists[:, 1:] & exists[:, :-1]) & solved[:, None]
    hinge = jnp.where(pairs, monotonicity_hinge(h, exists), 0.0)
    hinge_mean = jnp.sum(hinge) / jnp.maximum(jnp.sum(pairs), 1)
    return bce_mean + hinge_coef * hinge_mean, {"bce": bce_mean, "hinge": hinge_mean}


def prm_states(trunk, batch, max_turns: int):
    """(hidden [B, K+1, D] float32 without gradient, exists [B, K+1]) of a batch's states."""
    pred = predictor_positions(batch.valid, batch.pol_pos)
    pos, exists = state_positions(batch.turn_ids, batch.pol_valid, pred, batch.valid, batch.num_turns, max_turns)
    return jax.lax.stop_gradient(hidden_at(trunk, batch, pos).astype(jnp.float32)), exists


# ---- the step auxiliary (rl.auxiliaries) ----

def init_state(params, hidden_size: int, optimizer) -> dict:
    """The PRM at the start of a run: {"params": init_head, "opt_state"} (the step's aux["prm"])."""
    head = init_head(hidden_size)
    return {"params": head, "opt_state": optimizer.init(head)}


def _stage(inputs, state, optimizer) -> StageOut:
    """The PRM in the step: its step-start h at every state (the frozen reference trunk,
    micro-batched like the teacher), the progress rewards [B, N] from them (the advantage's
    "process_rewards"), and one update of its head on this batch (skipped, the head kept, when not
    finite)."""
    batch, cfg = inputs.batch, inputs.cfg
    pc = cfg.algo.section("prm")
    hidden, exists = inputs.teacher_pass(lambda rows: prm_states(inputs.ref_model, rows, cfg.max_turns))
    head = state["params"]
    h = jax.nn.sigmoid(head_logits(hidden, head))
    proc, gains = progress_rewards(h, exists, batch.turn_ids, batch.pol_valid, batch.num_turns,
                                   alpha=pc.alpha, decay=pc.decay, baseline=pc.baseline)
    solved = batch.signals["rewards"] >= pc.success_reward
    (loss, parts), grads = jax.value_and_grad(prm_loss, has_aux=True)(
        head, hidden, exists, batch.num_turns, solved, pc.hinge_coef)
    updates, new_opt = optimizer.update(grads, state["opt_state"], head)
    finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    new = jax.tree.map(keep, {"params": optax.apply_updates(head, updates), "opt_state": new_opt}, state)
    k = jnp.arange(h.shape[1])
    n = batch.num_turns[:, None]
    boundary = (k[None] >= 1) & (k[None] <= n - 1) & exists
    final = (k[None] == n) & exists
    nb = jnp.maximum(boundary.sum(), 1)
    mean = lambda x, mask: jnp.sum(jnp.where(mask, x, 0.0)) / jnp.maximum(mask.sum(), 1)  # noqa: E731
    metrics = {"prm/loss": loss, "prm/bce": parts["bce"], "prm/hinge": parts["hinge"],
               "prm/h_start": mean(h, (k[None] == 0) & exists),
               "prm/h_final_solved": mean(h, final & solved[:, None]),
               "prm/h_final_failed": mean(h, final & ~solved[:, None]),
               "prm/boundaries": boundary.sum().astype(jnp.float32),
               "prm/gain_mean": jnp.sum(gains) / nb, "prm/gain_abs_mean": jnp.sum(jnp.abs(gains)) / nb,
               "prm/solved_frac": jnp.mean(solved.astype(jnp.float32)),
               "prm/skipped_updates": 1.0 - finite.astype(jnp.float32)}
    return StageOut({"process_rewards": jax.lax.stop_gradient(proc)}, metrics, state=new)


# ---- registration ----

@dataclasses.dataclass(frozen=True)
class PRMConfig:
    """The run config's `prm.*` section: the head's learning rate (AdamW without weight decay; the
    schedule's length, b1, b2 and clip are the policy's), the progress reward alpha ·
    decay^(k−1) · (h_{k−1} − h_k − baseline) at boundary k, the weight of the monotonicity hinge in
    its loss, and the outcome reward from which a trajectory counts as solved (its label)."""

    lr: float = 1e-3  # the head's AdamW learning rate (no weight decay)
    alpha: float = 1.0  # progress reward alpha * decay^(k-1) * (h_{k-1} - h_k - baseline) at tool-result boundary k
    decay: float = 0.9  # against call spamming: later boundaries are worth less
    baseline: float = 0.0  # the fixed baseline subtracted from each gain
    hinge_coef: float = 1.0  # weight of the monotonicity hinge (increases of h along solved trajectories)
    success_reward: float = 1.0  # outcome reward from which a trajectory counts as solved (the PRM's label)

    def validate(self) -> "PRMConfig":
        for name in ("alpha", "baseline", "hinge_coef", "success_reward", "decay", "lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ConfigError(f"prm.{name} must be a finite number, got {v!r}")
        if self.alpha < 0 or self.hinge_coef < 0:
            raise ConfigError(f"prm.alpha and prm.hinge_coef must be >= 0, got {self.alpha} and {self.hinge_coef}")
        if not 0.0 < self.decay <= 1.0:
            raise ConfigError(f"prm.decay must be in (0, 1], got {self.decay}")
        if not self.lr > 0:
            raise ConfigError(f"prm.lr must be finite and > 0, got {self.lr}")
        return self


def _check_section(cfg, stages, check_data: bool) -> None:
    section_settings(PRMConfig, cfg.prm, "prm", "a step-PRM")  # checked whatever method runs
    for sc, method in stages:
        if method.uses("prm") and not sc.algo.student_sees_observations:
            raise ConfigError(f"rl.method={sc.algo.method!r} trains a step-PRM that reads the tool results; "
                              "rl.student_sees_observations=False masks them out of the context it reads")


register_config_section("prm", PRMConfig, _check_section)


def prm_optim(step_cfg) -> OptimConfig:
    """The head's optimizer settings: its learning rate, no weight decay, the policy's schedule length, b1, b2, clip."""
    p, o = step_cfg.algo.section("prm"), step_cfg.optim
    return OptimConfig(lr=p.lr, total_steps=o.total_steps, b1=o.b1, b2=o.b2, weight_decay=0.0,
                       max_grad_norm=o.max_grad_norm)


def _announce(step_cfg, model_cfg) -> str:
    p = step_cfg.algo.section("prm")
    return (f"step-PRM: a logistic head on the frozen reference trunk, lr {p.lr:g}, "
            f"reward {p.alpha:g} * {p.decay:g}^(k-1) * (h_(k-1) - h_k - {p.baseline:g})")


register_auxiliary(StepAuxiliary("prm", provides=("process_rewards",), needs_outputs=("rewards",), init=init_state,
                                 optim=prm_optim, before_advantage=_stage,
                                 describe="step-PRM (head on the frozen reference trunk)", announce=_announce))

register_method(Method("pica", advantage="gae_process", auxiliaries=("critic", "prm"),
                       description="PiCA: a monotone step-PRM's progress rewards at tool results, GAE against a critic"))

register_progress_metrics({"prm/gain_abs_mean": "prm_gain"})
