"""The fused train step: teacher views, advantages and the update in one jit.

One call of the compiled step, for a rollout batch of B trajectories (B / G prompt groups):

1. frozen teacher on the packed hindsight views (micro-batched, no gradient) -> teacher log-probs
   of every policy token under each depth [D, B, N], when the method's advantage reads "delta";
   the reference log-probs on the original context come from the same packed forward when a
   loss term reads "ref_logprobs";
2. δ = teacher − student, where the student log-probs are the rollout's own (the sampler's
   log-probs equal a teacher-forced forward of the rollout parameters, tests/test_rollout_sampler.py) ->
   the method's advantage (`rl.advantages.make_advantage_fn`) on the whole batch, so group
   statistics see all siblings;
   with rl.student_sees_observations=False, π_old for the ratio on the masked context
   (`masked_old_logprobs`; docs/spec.md §1.9); with loss.tis_threshold set, π_old for the ratio is
   the trainer's own step-start log-probs too, and the surrogate is re-weighted by the truncated
   sampler -> trainer importance weight (rl.losses.tis_weights; δ keeps the sampler's log-probs);
3. for each epoch over the batch (train.ppo_epochs) and mini-batch: gradients of the method's loss
   terms (rl.losses) accumulated over micro-batches (normalised by the *mini-batch*
   token/trajectory counts, so accumulation equals one full pass exactly), global-norm clipping and
   an optax AdamW update.

A method's step auxiliaries (rl.auxiliaries; `method.auxiliaries`, in order) add: before 2, each
one's `before_advantage` arrays (no gradient; e.g. a critic's values "values", a step-PRM's
"process_rewards" with its head's update, a retrospective teacher's "rise_mask"), which the
advantage and the loss terms read; after 2, each one's `after_advantage` arrays (e.g. the
critic's returns); in 3, each one's `loss`, on the same micro-batches, accumulated the same way,
whose gradient reaches only its own parameters, then its own optimizer update. A learned
auxiliary's state is the step's `aux` (`init_aux`).

All arrays are in the compact policy-position layout of turnsight_jax.rl.batch: [B, N] per policy
token. Rows of a micro-batch are strided (rows m, m+M, ...), so each micro-batch spreads over all
data shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from turnsight_jax.errors import ConfigError
from turnsight_jax.models.qwen3 import Qwen3
from turnsight_jax.rl.advantages import make_advantage_fn
from turnsight_jax.rl import micro_groups
from turnsight_jax.rl import turn_records
from turnsight_jax.rl.auxiliaries import StageInputs
from turnsight_jax.rl.batch import TrainBatch, packed_reference
from turnsight_jax.rl.config import OptimConfig, StepConfig
from turnsight_jax.rl.logprobs import policy_logprobs, teacher_logprobs
from turnsight_jax.rl.micro_batches import (in_micro_batches, map_micro_batches, merge_rows, split_batch, split_rows,
                                            student_rows)
from turnsight_jax.rl.losses import loss_weights, tis_weights, weighted_losses
from turnsight_jax.rl.methods import ResolvedMethod, resolve_method

# TurnSight diagnostics the step reports (under turnsight/ in the run's metrics).
TURNSIGHT_METRICS = ("agreement_rate", "depth_histogram", "weight_mean", "weight_min", "weight_max",
                     "frac_turns_amplified", "frac_turns_damped", "delta_mean")


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW, after a linear warm-up; constant or cosine schedule."""
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


def advantage_knobs(cfg: StepConfig, batch_size: int) -> dict:
    """The KNOBS of rl.advantages for this config and batch."""
    a = cfg.algo
    # num_groups: B, a bound on the groups of any layout (ids are < the prompts <= B; a controller
    # may form groups of unequal size), so the segment sums never depend on group sizes
    return {"eps": a.eps, "gamma": a.gamma, "num_groups": batch_size, "max_turns": cfg.max_turns,
            "lam": a.lam, "eps_w": a.eps_w, "selection": a.selection, "aggregation": a.aggregation,
            "group_norm": a.group_norm, "turns": a.turns, "matchtir_singleton": a.matchtir_singleton,
            "norm_pool": a.norm_pool, "uncovered_in_stats": a.uncovered_in_stats,
            "empty_block_turns": a.empty_block_turns, "depths": tuple(a.depths), "horizon_tol": a.horizon_tol,
            **a.section_knobs()}


def teacher_covered(batch: TrainBatch):
    """[B, N] bool: the policy tokens whose teacher view showed its block (privileged views and
    hindsight views record it: a hindsight turn outside rl.turns or with an empty block is
    scored on the student's own context, False)."""
    covered = None if batch.views is None else batch.views.covered
    return batch.pol_valid if covered is None else covered & batch.pol_valid


def advantage_inputs(batch: TrainBatch, teacher_lp, extra: dict | None = None) -> dict:
    """The arrays an estimator may read (rl.advantages.Estimator.inputs); `extra`: the step
    auxiliaries' arrays (rl.auxiliaries: e.g. the critic's "values" [B, N])."""
    arrays = {"group_ids": batch.group_ids, "policy_mask": batch.pol_valid, "turn_ids": batch.turn_ids,
              "num_turns": batch.num_turns, **batch.signals}
    if batch.turn_uses is not None:
        arrays["turn_uses"] = batch.turn_uses
    arrays.update(extra or {})
    if teacher_lp is not None:
        arrays["delta"] = teacher_lp - batch.old_logprobs[None]
        arrays["teacher_covered"] = teacher_covered(batch)
    return arrays


def compute_advantages(batch: TrainBatch, teacher_lp, cfg: StepConfig, method: ResolvedMethod,
                       extra: dict | None = None, *, with_outputs: bool = False):
    """Advantages [B, N] of the method over the whole batch, and diagnostics; with_outputs: and
    the estimator's whole output dict (per-token weights, depths, a critic's "returns", ...:
    rl.turn_records and the step auxiliaries read it). `extra`: the auxiliaries' arrays."""
    fn = make_advantage_fn(method.advantage.name, base=method.base.name if method.base else None,
                           knobs=advantage_knobs(cfg, batch.pol_valid.shape[0]),
                           transform=method.transform.name if method.transform else None)
    out = fn(advantage_inputs(batch, teacher_lp, extra))
    # TurnSight's diagnostics by name; a plug-in estimator's under its own "<method>/" prefix
    diag = {k: out[k] for k in out if k in TURNSIGHT_METRICS or "/" in k}
    if teacher_lp is not None:
        mask = batch.pol_valid
        n = jnp.maximum(mask.sum(), 1)
        gap = jnp.where(mask[None], teacher_lp - batch.old_logprobs[None], 0.0)
        diag["delta_mean"] = jnp.sum(gap, axis=(1, 2)) / n  # per view (TurnSight: per depth)
        if method.teacher == "privileged":  # the teacher-student gap of the privileged view
            covered = teacher_covered(batch)
            m = jnp.maximum(covered.sum(), 1)
            diag["teacher/covered_frac"] = covered.sum() / n
            diag["teacher/gap_mean"] = jnp.sum(jnp.where(covered, gap[0], 0.0)) / m
            diag["teacher/gap_abs_mean"] = jnp.sum(jnp.where(covered, jnp.abs(gap[0]), 0.0)) / m
            diag["teacher/frac_teacher_higher"] = jnp.sum(covered & (gap[0] > 0)) / m
            diag["teacher/frac_teacher_lower"] = jnp.sum(covered & (gap[0] < 0)) / m
    if with_outputs:
        return out["advantages"], diag, out
    return out["advantages"], diag


def teacher_and_ref_logprobs(teacher_model: Qwen3, ref_model: Qwen3, batch: TrainBatch, cfg: StepConfig,
                             method: ResolvedMethod):
    """(teacher log-probs [R, B, N] or None, reference log-probs [B, N] or None, top-K or None),
    no gradient. R: the hindsight depths, or the one privileged view. top-K (when a loss term
    reads it, teacher.top_k = K): the privileged view's (ids [B, N, K] int32, log-probs [B, N, K]).

    With views, one packed forward gives both when the views carry the reference row
    (rl.batch.packed_reference: only when the teacher is the reference); otherwise the reference
    is scored on the student's context (`batch.valid`, which masks the observations when
    rl.student_sees_observations is False)."""
    temp, chunk, m = cfg.loss.temperature, cfg.scoring_chunk, cfg.teacher_micro_batches
    teacher = ref = topk = None
    if method.needs_views:
        k = cfg.teacher.top_k if method.top_k else 0

        def one(v):
            return teacher_logprobs(teacher_model, v, chunk=chunk, temperature=temp, top_k=k)

        groups = batch.micro_groups
        if m == 1:
            out = one(batch.views)
        elif groups is not None and groups.micro_batches == m and groups.view_widths is not None:
            _, out = micro_groups.run_grouped(lambda c, part: (c, jax.lax.map(one, part)), split_batch(batch.views, m),
                                              groups, micro_groups.cut_views, groups.view_widths)
            out = _merge_views(out)
        else:
            out = _merge_views(jax.lax.map(one, split_batch(batch.views, m)))
        if k:
            out, ids, lps = out
            topk = (ids[0], lps[0])
        views = method.teacher_views(cfg.algo)
        teacher = out[:views]
        if packed_reference(cfg, method):
            ref = out[views]
    if method.needs_ref and ref is None:
        def one_ref(rows):
            return policy_logprobs(ref_model, rows, chunk=chunk, temperature=temp)

        ref = jax.lax.stop_gradient(in_micro_batches(one_ref, student_rows(batch), m))
    return teacher, ref, topk


def _merge_views(out):
    """merge_rows of teacher_logprobs' outputs over teacher micro-batches: each leaf [m, R, B/m, ...]."""
    return jax.tree.map(lambda x: merge_rows(x, axis=1), out)


def masked_old_logprobs(model: Qwen3, batch: TrainBatch, cfg: StepConfig):
    """The step-start policy's log-probs [B, N] on the student's (masked) context, no gradient.

    Also the trainer's π_old of the mismatch correction (loss.tis_threshold) with several updates
    per step; there the context is `batch.valid` whatever it holds (full or masked).

    With rl.student_sees_observations=False the ratio must compare the updated policy with the old
    one *on the same masked context*, which the sampler (it saw the observations) never scored.
    The step-start parameters are the rollout's parameters (the sampler ran them), so this forward
    is exactly π_old on that context; the released code recomputes old log-probs the same way
    (verl's compute_log_prob before the update). Micro-batched like the gradient passes."""
    def one(rows):
        return policy_logprobs(model, rows, chunk=cfg.scoring_chunk, temperature=cfg.loss.temperature)

    lp = in_micro_batches(one, student_rows(batch), cfg.micro_batches)
    return jax.lax.stop_gradient(jnp.where(batch.pol_valid, lp, 0.0))


def mismatch_metrics(trainer_lp, sampler_lp, valid, threshold: float | None) -> dict:
    """Sampler/trainer log-prob mismatch over the batch's valid policy tokens (exact token means,
    like adv_mean; the max over tokens), and with a threshold C the importance weights' mean and
    the share of tokens whose raw weight exp(trainer − sampler) exceeded C."""
    n = jnp.maximum(valid.sum(), 1)
    d = jnp.where(valid, trainer_lp - sampler_lp, 0.0)
    out = {"tis/logprob_diff_mean": jnp.sum(d) / n, "tis/logprob_diff_abs_mean": jnp.sum(jnp.abs(d)) / n,
           "tis/logprob_diff_max_abs": jnp.max(jnp.abs(d))}
    if threshold is not None:
        w = tis_weights(trainer_lp, sampler_lp, threshold)
        out["tis/weight_mean"] = jnp.sum(jnp.where(valid, w, 0.0)) / n
        out["tis/clip_frac"] = jnp.sum(valid & (jnp.exp(d) > threshold)) / n
    return out


def teacher_arrays(batch: TrainBatch, teacher_lp, topk, method: ResolvedMethod) -> dict:
    """The teacher arrays the method's loss terms read (rl.methods.TEACHER_ARRAYS), each with the
    rows first: "teacher_logprobs" [B, N] (view 0), "teacher_covered" [B, N] bool, and with top-K
    "teacher_topk_ids" / "teacher_topk_logprobs" [B, N, K]; no gradient."""
    out = {}
    if method.reads("teacher_logprobs"):
        out["teacher_logprobs"] = jax.lax.stop_gradient(teacher_lp[0])
    if method.reads("teacher_covered"):
        out["teacher_covered"] = teacher_covered(batch)
    if topk is not None:
        out["teacher_topk_ids"], out["teacher_topk_logprobs"] = jax.tree.map(jax.lax.stop_gradient, topk)
    return out


def make_aux_optimizers(cfg: StepConfig, method: ResolvedMethod) -> dict:
    """{name: optimizer} of the method's learned auxiliaries (rl.auxiliaries), from their settings."""
    return {a.name: make_optimizer(a.optim(cfg)) for a in method.auxiliaries if a.learned}


def init_aux(method: ResolvedMethod, params, hidden_size: int, optimizers: dict) -> dict:
    """The step's `aux` at the start of a run: {name: {"params", "opt_state"}} of each learned
    auxiliary of the method ({} none); `params`: the policy's."""
    return {a.name: a.init(params, hidden_size, optimizers[a.name]) for a in method.auxiliaries if a.learned}


def make_train_step(graphdef, cfg: StepConfig, optimizer: optax.GradientTransformation,
                    method: ResolvedMethod | None = None, *, state_shardings=None, teacher_graphdef=None,
                    aux_optimizers: dict | None = None, records: bool = False):
    """Returns step(params, opt_state, ref_params, batch, teacher_params=None, aux=None) ->
    (params, opt_state, metrics), jitted with params and opt_state donated. `params`/`ref_params`
    are nnx.State of the policy and the frozen reference (same graphdef). `method` defaults to
    resolve_method(cfg).

    A method with learned auxiliaries (rl.auxiliaries; method.aux, e.g. "critic", "prm") takes
    `aux` ({name: {"params", "opt_state"}}: `init_aux`), each trained by its optimizer in
    `aux_optimizers` (default `make_aux_optimizers`), and returns (params, opt_state, metrics, aux),
    `aux` donated too; its `state_shardings` then has a third entry, the aux state's.

    The teacher that scores the views (cfg.teacher.weights): "reference" -> ref_params; "policy"
    -> params at the step's start (no gradient; every update of the step reads the same teacher);
    "ema" -> teacher_params (the trainer's moving average, same graphdef); "external" ->
    teacher_params of `teacher_graphdef` (another Qwen3 with the same vocabulary).

    `state_shardings` (the shardings of (params, opt_state), e.g. `jax.tree.map(lambda x:
    x.sharding, (params, opt_state))`) pins the updated state to them. Left to the compiler, the
    outputs come back in equivalent but unequal shardings (P(None,) as P(); axes of size 1
    dropped), so the second step, and every rollout program taking the new parameters, would
    compile again.

    `records=True`: metrics["records"] also holds the per-turn arrays of the trajectory records
    (rl.turn_records.step_records: Ã, the base advantage, the estimator's weights / depths / gaps,
    the loss terms' per-token values of the first update, summarised per turn), computed from the
    very arrays the update uses; the other outputs are the same (tests/test_records_viewer.py)."""
    method = method or resolve_method(cfg)
    terms = method.loss_terms
    weights_kind = cfg.teacher.weights
    if weights_kind == "external" and teacher_graphdef is None:
        raise ConfigError("teacher.weights='external': make_train_step needs the external teacher's teacher_graphdef")
    reads_topk = method.reads("topk_logprobs")
    metric_names = tuple(dict.fromkeys(k for t in terms for k in t.metrics))
    aux_opts = aux_optimizers if aux_optimizers is not None else make_aux_optimizers(cfg, method)
    # the auxiliaries trained by a loss beside the policy's (one gradient pass: each's gradient
    # reaches only its own parameters), their metrics under "<name>/"
    in_loss = tuple(a for a in method.auxiliaries if a.loss is not None)
    metric_names += tuple(f"{a.name}/{k}" for a in in_loss for k in a.loss_metrics)
    with_entropy = any("entropy" in t.inputs for t in terms)  # the full-vocab entropy only when read
    # Observation masking (rl.student_sees_observations=False) needs π_old on the masked context.
    # With one update per step the first (only) forward runs the step-start parameters, so its own
    # log-probs, without gradient, are π_old exactly (ratio 1) and no extra forward is needed;
    # with several updates a no-gradient forward before the first update provides them.
    #
    # The mismatch correction (loss.tis_threshold = C) needs the same π_old: the trainer's own
    # log-probs at the step-start parameters, obtained the same two ways; the batch's
    # old_logprobs (the sampler's) are then only what the importance weight compares against.
    masked = not cfg.algo.student_sees_observations
    tis = cfg.loss.tis_threshold
    one_update = cfg.mini_batches * cfg.ppo_epochs == 1
    trainer_old = masked or tis is not None
    old_is_current = trainer_old and one_update
    if tis is not None and not any("is_weights" in t.optional_inputs for t in terms):
        raise ConfigError(f"loss.tis_threshold={tis} but no loss term of method {method.name!r} reads the "
                          "importance weights (rl.losses: optional_inputs 'is_weights')")

    def loss_fn(params, aux_params, mb: TrainBatch, adv, ref_lp, weights, sampler_lp, tx, ax):
        """`sampler_lp`: the sampler's log-probs when mb.old_logprobs was replaced by the trainer's
        (mismatch correction with several updates), else None. `tx`: the teacher arrays of these
        rows ({} when no term reads them; "teacher_topk_ids" [B, N, K] only to score them).
        `aux_params` / `ax`: {name: parameters} and {name: its after_advantage arrays of these
        rows} of the auxiliaries with a loss, or None; each loss is added to the RL terms' and
        depends on its own parameters only."""
        model = nnx.merge(graphdef, params)
        tx = dict(tx)
        topk_ids = tx.pop("teacher_topk_ids", None)
        out = policy_logprobs(model, mb, chunk=cfg.logprob_chunk, temperature=cfg.loss.temperature,
                              with_entropy=with_entropy, extra_targets=topk_ids if reads_topk else None)
        if reads_topk:
            *out, tx["topk_logprobs"] = out
            out = tuple(out) if with_entropy else out[0]
        lp, entropy = out if with_entropy else (out, None)
        current = jax.lax.stop_gradient(lp)  # the step-start policy's log-probs when one update per step
        old = current if old_is_current else mb.old_logprobs
        is_w = None
        if tis is not None:
            is_w = tis_weights(old, mb.old_logprobs if old_is_current else sampler_lp, tis)
        x = {"logprobs": lp, "old_logprobs": old, "advantages": adv, "ref_logprobs": ref_lp,
             "pol_valid": mb.pol_valid, "turn_ids": mb.turn_ids, "policy_mask": mb.pol_valid,
             "group_ids": mb.group_ids, "num_turns": mb.num_turns, "entropy": entropy, **mb.signals,
             "is_weights": is_w, **tx}
        extra = None
        for a in in_loss:  # the auxiliaries' losses, on the RL terms' rows
            aux_loss, aux_metrics = a.loss(graphdef, cfg, aux_params[a.name], mb, ax[a.name])
            aux_metrics = {f"{a.name}/{k}": v for k, v in aux_metrics.items()}
            extra = (aux_loss, aux_metrics) if extra is None else (extra[0] + aux_loss, {**extra[1], **aux_metrics})
        loss, sums, parts = weighted_losses(terms, x, weights, cfg.loss, cfg.algo, extra, with_parts=True)
        sums = {k: sums[k] for k in metric_names}
        # the terms' per-token values, for the trajectory records (none without them)
        per_token = {k: jax.lax.stop_gradient(parts[k]) for k in metric_names} if records else None
        # With one update the forward's own log-probs are the trainer's at the step-start
        # parameters: handed back (no gradient) so the step reports the mismatch at no extra cost.
        return loss, (sums, current if one_update else None, per_token)

    grad_fn = jax.grad(loss_fn, argnums=(0, 1), has_aux=True)

    def minibatch_update(params, opt_state, aux_state, mb: TrainBatch, adv, ref_lp, sampler_lp, tx, ax):
        """Accumulate gradients over strided micro-batches, then one optimizer update (and one of
        each auxiliary with a loss, by its own optimizer). `aux_state`: {name: {"params",
        "opt_state"}} of those auxiliaries, or None."""
        m = cfg.micro_batches
        aux_params = None if aux_state is None else {k: v["params"] for k, v in aux_state.items()}
        # each term's token set (the RL terms': the policy tokens of grouped rows; rl.losses)
        weights = loss_weights(terms, mb.pol_valid, mb.group_ids, mb.signals, cfg.loss.aggregation)
        if m == 1:
            (grads, aux_grads), (sums, current, per_token) = grad_fn(params, aux_params, mb, adv, ref_lp, weights,
                                                                     sampler_lp, tx, ax)
        else:
            opt_split = lambda a: None if a is None else split_rows(a, m)
            xs = (split_batch(mb, m), split_rows(adv, m), opt_split(ref_lp),
                  jax.tree.map(lambda a: split_rows(a, m), weights), opt_split(sampler_lp),
                  jax.tree.map(lambda a: split_rows(a, m), tx), jax.tree.map(lambda a: split_rows(a, m), ax))

            def acc(carry, x):
                g_acc, a_acc, s_acc = carry
                mb_, adv_, ref_, w_, sl_, tx_, ax_ = x
                (g, ag), (s, cur, tok) = grad_fn(params, aux_params, mb_, adv_, ref_, w_, sl_, tx_, ax_)
                return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, a_acc, ag),
                        jax.tree.map(jnp.add, s_acc, s)), (cur, tok)

            zeros_g = jax.tree.map(jnp.zeros_like, params)
            zeros_a = jax.tree.map(jnp.zeros_like, aux_params)
            zeros_s = {k: jnp.zeros((), jnp.float32) for k in metric_names}
            init = (zeros_g, zeros_a, zeros_s)
            groups = mb.micro_groups
            if groups is None:
                (grads, aux_grads, sums), (current, per_token) = jax.lax.scan(acc, init, xs)
            else:  # one scan per group of micro-batches, each at its own width, the sums carried across
                cut = lambda x, w: (micro_groups.cut_rows(x[0], w),) + x[1:]
                (grads, aux_grads, sums), (current, per_token) = micro_groups.run_grouped(
                    lambda c, part: jax.lax.scan(acc, c, part), xs, groups, cut, groups.widths, carry=init)
            current = None if current is None else merge_rows(current)
            per_token = jax.tree.map(merge_rows, per_token)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # Non-finite guard: one NaN/inf in the loss or the gradient would reach every parameter
        # (global-norm clip, then AdamW) and the moments; such an update is skipped instead, the
        # parameters and optimizer state stay as they were, and `skipped_updates` counts it.
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(sum(sums.values()))
        new_aux = {}
        for name, state in (aux_state or {}).items():  # each auxiliary's own clip and optimizer
            a_norm = optax.tree.norm(aux_grads[name])
            a_updates, new_a_opt = aux_opts[name].update(aux_grads[name], state["opt_state"], aux_params[name])
            new_aux[name] = {"params": optax.apply_updates(aux_params[name], a_updates), "opt_state": new_a_opt}
            finite = finite & jnp.isfinite(a_norm)
            sums[f"{name}/grad_norm"] = a_norm
        keep = lambda new, old: jnp.where(finite, new, old)
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        if aux_state is not None:
            aux_state = jax.tree.map(keep, new_aux, aux_state)
        sums["grad_norm"] = grad_norm
        sums["skipped_updates"] = 1.0 - finite.astype(jnp.float32)
        return params, opt_state, aux_state, sums, current, per_token

    def step(params, opt_state, ref_params, batch: TrainBatch, teacher_params=None, aux=None):
        missing = [k for k in method.aux if not aux or k not in aux]
        if missing:
            raise ConfigError(f"method {method.name!r} trains {missing}: the step needs aux= (rl.step.init_aux)")
        ref_model = nnx.merge(graphdef, ref_params)
        if weights_kind == "reference":
            teacher_model = ref_model
        elif weights_kind == "policy":  # the step-start policy; teacher_logprobs stops the gradient
            teacher_model = nnx.merge(graphdef, params)
        else:
            if teacher_params is None:
                raise ConfigError(f"teacher.weights={weights_kind!r}: the step needs teacher_params")
            teacher_model = nnx.merge(teacher_graphdef if weights_kind == "external" else graphdef, teacher_params)
        teacher_lp, ref_lp, topk = teacher_and_ref_logprobs(teacher_model, ref_model, batch, cfg, method)
        # the step auxiliaries' stages before the advantage, in the method's order
        rows = student_rows(batch)
        inputs = StageInputs(graphdef, cfg, batch, ref_model, teacher_model,
                             student_pass=lambda fn: in_micro_batches(fn, rows, cfg.micro_batches),
                             teacher_pass=lambda fn, part=None: map_micro_batches(
                                 fn, rows if part is None else part, cfg.teacher_micro_batches))
        aux_arrays, aux_metrics, carries, new_aux = {}, {}, {}, dict(aux or {})
        for a in method.auxiliaries:
            if a.before_advantage is None:
                continue
            out = a.before_advantage(inputs, new_aux.get(a.name), aux_opts.get(a.name))
            aux_arrays.update(out.arrays)
            aux_metrics.update(out.metrics)
            carries[a.name] = out.carry
            if out.state is not None:
                new_aux[a.name] = out.state
        adv, diag, est_out = compute_advantages(batch, teacher_lp, cfg, method, aux_arrays, with_outputs=True)
        rec_batch = batch  # δ's old log-probs (the sampler's), before any replacement below
        ax = {}  # the arrays each auxiliary's loss reads, per row
        for a in method.auxiliaries:
            if a.after_advantage is not None:
                ax[a.name], more = a.after_advantage(inputs, new_aux.get(a.name), carries.get(a.name), est_out)
                aux_metrics.update(more)
        ax = {a.name: ax.get(a.name, {}) for a in in_loss} or None
        tx = teacher_arrays(batch, teacher_lp, topk, method)
        tx.update({k: v for k, v in aux_arrays.items() if method.reads(k)})
        adv = jax.lax.stop_gradient(adv)
        sampler_lp, mismatch = None, {}
        if trainer_old and not old_is_current:
            # δ above keeps the sampler's log-probs (same prefix as the teacher); the ratio uses these
            old = masked_old_logprobs(nnx.merge(graphdef, params), batch, cfg)
            if tis is not None:
                sampler_lp = batch.old_logprobs  # what the importance weight compares against
                mismatch = mismatch_metrics(old, sampler_lp, batch.pol_valid, tis)
            batch = batch.replace(old_logprobs=old)
        nm = cfg.mini_batches
        if nm == 1:
            minis = [(batch, adv, ref_lp, sampler_lp, tx, ax)]
        else:
            sb = split_batch(batch, nm)
            sa = split_rows(adv, nm)
            sr = None if ref_lp is None else split_rows(ref_lp, nm)
            ss = None if sampler_lp is None else split_rows(sampler_lp, nm)
            st = jax.tree.map(lambda x: split_rows(x, nm), tx)
            sc = jax.tree.map(lambda x: split_rows(x, nm), ax)
            pick = lambda tree, i: jax.tree.map(lambda x: x[i], tree)
            minis = [(pick(sb, i), sa[i], None if sr is None else sr[i], None if ss is None else ss[i], pick(st, i),
                      pick(sc, i)) for i in range(nm)]
        logs, first_epoch = [], []
        trained = {a.name: new_aux[a.name] for a in in_loss} or None  # the auxiliaries the updates train
        for epoch in range(cfg.ppo_epochs):
            for mb, a, r, sl, t, c in minis:
                params, opt_state, trained, sums, current, per_token = minibatch_update(params, opt_state, trained, mb,
                                                                                        a, r, sl, t, c)
                logs.append(sums)
                if epoch == 0:
                    first_epoch.append(per_token)
        if one_update:  # the update's forward ran the step-start parameters: the mismatch for free
            mismatch = mismatch_metrics(current, batch.old_logprobs, batch.pol_valid, tis)
        metrics = {k: jnp.mean(jnp.stack([log[k] for log in logs])) for k in logs[0]}
        metrics["skipped_updates"] = sum(log["skipped_updates"] for log in logs)  # a count, not a mean
        grouped = batch.group_ids >= 0  # the rows the RL terms train (padding and exemplar rows are not)
        valid = batch.pol_valid & grouped[:, None]
        n = jnp.maximum(valid.sum(), 1)
        metrics["adv_mean"] = jnp.sum(jnp.where(valid, adv, 0.0)) / n
        metrics["adv_abs_mean"] = jnp.sum(jnp.where(valid, jnp.abs(adv), 0.0)) / n
        if "rewards" in batch.signals:
            metrics["reward_mean"] = jnp.sum(jnp.where(grouped, batch.signals["rewards"], 0.0)) / jnp.maximum(
                grouped.sum(), 1)
        metrics.update(aux_metrics)
        metrics.update(diag)
        metrics.update(mismatch)
        if records:  # each row's loss-term values from the first epoch's pass over it
            term_values = first_epoch[0] if nm == 1 else jax.tree.map(lambda *x: merge_rows(jnp.stack(x)), *first_epoch)
            covered = teacher_covered(rec_batch) if method.teacher == "privileged" and teacher_lp is not None else None
            metrics["records"] = turn_records.step_records(adv, est_out, rec_batch, teacher_lp, covered, term_values,
                                                           cfg.max_turns)
            if cfg.record_teacher and teacher_lp is not None:  # log.turn_records' token log-probs: no extra forward
                metrics["records"]["teacher_logprobs"] = jax.lax.stop_gradient(teacher_lp)
        if method.aux:
            new_aux.update(trained or {})
            return params, opt_state, metrics, {k: new_aux[k] for k in method.aux}
        return params, opt_state, metrics

    donate = (0, 1, 5) if method.aux else (0, 1)
    if state_shardings is None:
        return jax.jit(step, donate_argnums=donate)
    if method.aux:
        if len(state_shardings) != 3:
            raise ValueError(f"method {method.name!r} has learned auxiliaries {method.aux}: state_shardings must be "
                             "(params, opt_state, aux) shardings")
        p_sh, o_sh, a_sh = state_shardings
        return jax.jit(step, donate_argnums=donate, out_shardings=(p_sh, o_sh, None, a_sh))
    return jax.jit(step, donate_argnums=donate, out_shardings=(*state_shardings, None))
