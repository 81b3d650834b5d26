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
3. for each PPO epoch and mini-batch: gradients of the method's loss terms (rl.losses) accumulated
   over micro-batches (normalised by the *mini-batch* token/trajectory counts, so accumulation
   equals one full pass exactly), global-norm clipping and an optax AdamW update.

A method with a critic (methods.critic; PPO) adds: before 2, the critic's values V_old [B, N] at the
step's start (no gradient), which the advantage reads as "values" (GAE) and which give its
"returns"; in 3, the clipped value loss of the same micro-batches, accumulated the same way, and
the critic's own optimizer update. The critic's loss never reaches the policy's gradient. A
method with a step-PRM (methods.prm; PiCA) adds before 2: the PRM's h at every state (the frozen
reference trunk), its progress rewards (the advantage reads them as "process_rewards"), and one
update of the PRM's head on the batch. The critic and the PRM are the step's learned auxiliaries
(`aux`, `init_aux`). A method whose loss reads "rise_mask" (Orchard's CA-SFT, methods.orchard) adds
before 3: the teacher's retrospective values on the probe rows, once, and the mask of
rise-segment tokens of failed trajectories.

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
from turnsight_jax.methods import critic as critic_lib
from turnsight_jax.rl import micro_groups
from turnsight_jax.methods import orchard as orchard_lib
from turnsight_jax.methods import prm as prm_lib
from turnsight_jax.rl import turn_records
from turnsight_jax.rl.batch import TrainBatch, packed_reference, row_axis
from turnsight_jax.rl.config import OptimConfig, StepConfig
from turnsight_jax.rl.logprobs import policy_logprobs, teacher_logprobs
from turnsight_jax.rl.losses import loss_weights, tis_weights, weighted_losses
from turnsight_jax.rl.methods import ResolvedMethod, resolve_method

# The critic's per-token metrics (token-weighted like the loss; reported under critic/).
CRITIC_METRICS = ("value_loss", "value_clip_frac", "values_mean")
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
            "empty_block_turns": a.empty_block_turns, "sdpo_coef": a.sdpo_coef,
            "depths": tuple(a.depths), "horizon_tol": a.horizon_tol,
            "gae_gamma": a.gae_gamma, "gae_lam": a.gae_lam, "gae_whiten": a.gae_whiten,
            **a.section_knobs()}


def teacher_covered(batch: TrainBatch):
    """[B, N] bool: the policy tokens whose teacher view showed its block (privileged views and
    hindsight views record it: a hindsight turn outside rl.turns or with an empty block is
    scored on the student's own context, False)."""
    covered = None if batch.views is None else batch.views.covered
    return batch.pol_valid if covered is None else covered & batch.pol_valid


def advantage_inputs(batch: TrainBatch, teacher_lp, values=None, process_rewards=None) -> dict:
    """The arrays an estimator may read (rl.advantages.Estimator.inputs); `values` [B, N]: the
    critic's, for a method with one; `process_rewards` [B, N]: the PRM's token rewards."""
    arrays = {"group_ids": batch.group_ids, "policy_mask": batch.pol_valid, "turn_ids": batch.turn_ids,
              "num_turns": batch.num_turns, **batch.signals}
    if batch.turn_uses is not None:
        arrays["turn_uses"] = batch.turn_uses
    if values is not None:
        arrays["values"] = values
    if process_rewards is not None:
        arrays["process_rewards"] = process_rewards
    if teacher_lp is not None:
        arrays["delta"] = teacher_lp - batch.old_logprobs[None]
        arrays["teacher_covered"] = teacher_covered(batch)
    return arrays


def compute_advantages(batch: TrainBatch, teacher_lp, cfg: StepConfig, method: ResolvedMethod, values=None,
                       process_rewards=None, *, with_outputs: bool = False):
    """Advantages [B, N] of the method over the whole batch, and diagnostics (GAE's "returns"
    [B, N] among them when the estimator gives them); with_outputs: and the estimator's whole
    output dict (per-token weights, depths, ...: rl.turn_records reads it)."""
    fn = make_advantage_fn(method.advantage.name, base=method.base.name if method.base else None,
                           knobs=advantage_knobs(cfg, batch.pol_valid.shape[0]),
                           transform=method.transform.name if method.transform else None)
    out = fn(advantage_inputs(batch, teacher_lp, values, process_rewards))
    # TurnSight's diagnostics by name; a plug-in estimator's under its own "<method>/" prefix
    diag = {k: out[k] for k in out if k in TURNSIGHT_METRICS or "/" in k}
    if "returns" in out:
        diag["returns"] = out["returns"]
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


def _student_rows(batch: TrainBatch) -> TrainBatch:
    """The arrays a no-gradient student forward reads (no views, no signals)."""
    return batch.replace(views=None, signals={})


def _in_micro_batches(fn, batch: TrainBatch, m: int):
    """fn(batch) over strided micro-batches of its rows (lax.map), merged back; m = 1: one call.
    With micro-batch groups (rl.micro_groups) of m micro-batches, each group's map runs cut to
    its own width."""
    if m == 1:
        return fn(batch)
    groups = batch.micro_groups
    if groups is None or groups.micro_batches != m:
        return _merge(jax.lax.map(fn, split_batch(batch, m)))
    _, out = micro_groups.run_grouped(lambda c, part: (c, jax.lax.map(fn, part)), split_batch(batch, m), groups,
                                      micro_groups.cut_rows, groups.widths)
    return _merge(out)


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

        ref = jax.lax.stop_gradient(_in_micro_batches(one_ref, _student_rows(batch), m))
    return teacher, ref, topk


def _merge_views(out):
    """_merge of teacher_logprobs' outputs over teacher micro-batches: each leaf [m, R, B/m, ...]."""
    return jax.tree.map(lambda x: _merge(x, axis=1), out)


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

    lp = _in_micro_batches(one, _student_rows(batch), cfg.micro_batches)
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


def retrospective_stage(teacher_model: Qwen3, batch: TrainBatch, cfg: StepConfig):
    """Orchard's retrospective values on the probe rows (methods.orchard; teacher micro-batches, no
    gradient) -> (the CA-SFT token mask "rise_mask" [B, N] bool, metrics)."""
    def one(p):
        return orchard_lib.retrospective_values(teacher_model, p)

    m = cfg.teacher_micro_batches
    values = one(batch.probes) if m == 1 else _merge(jax.lax.map(one, split_batch(batch.probes, m)))
    return orchard_lib.rise_mask(values, batch.probes.exists, batch.turn_ids, batch.pol_valid,
                                 batch.signals["rewards"], cfg.algo)


def critic_values(graphdef, critic, batch: TrainBatch, cfg: StepConfig):
    """The critic's values V [B, N] at the step's start, no gradient, micro-batched like the
    gradient passes. `critic`: {"trunk": nnx.State of `graphdef`, "head": methods.critic.init_head}."""
    trunk = nnx.merge(graphdef, critic["trunk"])

    def one(rows):
        return critic_lib.policy_values(trunk, critic["head"], rows)

    return jax.lax.stop_gradient(_in_micro_batches(one, _student_rows(batch), cfg.micro_batches))


def init_critic(params, hidden_size: int, optimizer: optax.GradientTransformation) -> dict:
    """A method's critic at the start of a run: the trunk a copy of the policy's parameters
    `params` (verl initialises its critic from the actor's model), the value head zero, and the
    critic optimizer's state: {"params": {"trunk", "head"}, "opt_state"} (aux["critic"] of the
    step, and the checkpoint's "critic" item)."""
    cp = {"trunk": jax.tree.map(jnp.copy, params), "head": critic_lib.init_head(hidden_size)}
    return {"params": cp, "opt_state": optimizer.init(cp)}


def make_aux_optimizers(cfg: StepConfig, method: ResolvedMethod) -> dict:
    """{name: optimizer} of the method's learned auxiliaries (method.aux: "critic", "prm")."""
    opts = {"critic": cfg.critic.optim, "prm": cfg.prm.optim}
    return {name: make_optimizer(opts[name]) for name in method.aux}


def init_aux(method: ResolvedMethod, params, hidden_size: int, optimizers: dict) -> dict:
    """The step's `aux` at the start of a run: {"critic": init_critic(...)} and/or {"prm":
    {"params": methods.prm.init_head, "opt_state"}}, for the auxiliaries the method has ({} none)."""
    out = {}
    if "critic" in method.aux:
        out["critic"] = init_critic(params, hidden_size, optimizers["critic"])
    if "prm" in method.aux:
        head = prm_lib.init_head(hidden_size)
        out["prm"] = {"params": head, "opt_state": optimizers["prm"].init(head)}
    return out


def prm_stage(ref_model, prm, batch: TrainBatch, cfg: StepConfig, optimizer):
    """PiCA's PRM in the step (methods.prm): its step-start h at every state (the frozen reference
    trunk, micro-batched like the teacher), the progress rewards [B, N] from them, and one update
    of its head on this batch (skipped, the head kept, when not finite). Returns (process rewards,
    updated prm state, metrics)."""
    pc = cfg.prm

    def one(rows):
        return prm_lib.prm_states(ref_model, rows, cfg.max_turns)

    m = cfg.teacher_micro_batches
    rows = _student_rows(batch)
    hidden, exists = one(rows) if m == 1 else jax.tree.map(_merge, jax.lax.map(one, split_batch(rows, m)))
    head = prm["params"]
    h = jax.nn.sigmoid(prm_lib.head_logits(hidden, head))
    proc, gains = prm_lib.progress_rewards(h, exists, batch.turn_ids, batch.pol_valid, batch.num_turns,
                                           alpha=pc.alpha, decay=pc.decay, baseline=pc.baseline)
    solved = batch.signals["rewards"] >= pc.success_reward
    (loss, parts), grads = jax.value_and_grad(prm_lib.prm_loss, has_aux=True)(
        head, hidden, exists, batch.num_turns, solved, pc.hinge_coef)
    updates, new_opt = optimizer.update(grads, prm["opt_state"], head)
    finite = jnp.isfinite(loss) & jnp.isfinite(optax.tree.norm(grads))
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    new = jax.tree.map(keep, {"params": optax.apply_updates(head, updates), "opt_state": new_opt}, prm)
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
    return jax.lax.stop_gradient(proc), new, metrics


def make_train_step(graphdef, cfg: StepConfig, optimizer: optax.GradientTransformation,
                    method: ResolvedMethod | None = None, *, state_shardings=None, teacher_graphdef=None,
                    aux_optimizers: dict | None = None, records: bool = False):
    """Returns step(params, opt_state, ref_params, batch, teacher_params=None, aux=None) ->
    (params, opt_state, metrics), jitted with params and opt_state donated. `params`/`ref_params`
    are nnx.State of the policy and the frozen reference (same graphdef). `method` defaults to
    resolve_method(cfg).

    A method with learned auxiliaries (method.aux: "critic", "prm") takes `aux` ({name: {"params",
    "opt_state"}}: `init_aux`; the critic's params {"trunk": nnx.State of `graphdef`, "head"}),
    each trained by its optimizer in `aux_optimizers` (default `make_aux_optimizers`: from
    cfg.critic.optim / cfg.prm.optim), and returns (params, opt_state, metrics, aux), `aux` donated
    too; its `state_shardings` then has a third entry, the aux state's.

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
    with_critic, with_prm = "critic" in method.aux, "prm" in method.aux
    aux_opts = aux_optimizers if aux_optimizers is not None else make_aux_optimizers(cfg, method)
    critic_optimizer = aux_opts.get("critic")
    if with_critic:
        metric_names += CRITIC_METRICS
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

    def loss_fn(params, critic, mb: TrainBatch, adv, ref_lp, weights, sampler_lp, tx, cx):
        """`sampler_lp`: the sampler's log-probs when mb.old_logprobs was replaced by the trainer's
        (mismatch correction with several updates), else None. `tx`: the teacher arrays of these
        rows ({} when no term reads them; "teacher_topk_ids" [B, N, K] only to score them).
        `critic` / `cx`: the critic's parameters and {"returns", "old_values"} [B, N] of these
        rows, or None; the value loss is added to the loss, and depends on `critic` only."""
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
        if critic is not None:  # the value loss, on the RL terms' rows
            values = critic_lib.policy_values(nnx.merge(graphdef, critic["trunk"]), critic["head"], mb)
            vl, vclip = critic_lib.value_loss(values, cx["old_values"], cx["returns"], cfg.critic.value_clip)
            extra = (vl, {"value_loss": vl, "value_clip_frac": vclip, "values_mean": values})
        loss, sums, parts = weighted_losses(terms, x, weights, cfg.loss, cfg.algo, extra, with_parts=True)
        sums = {k: sums[k] for k in metric_names}
        # the terms' per-token values, for the trajectory records (none without them)
        per_token = {k: jax.lax.stop_gradient(parts[k]) for k in metric_names} if records else None
        # With one update the forward's own log-probs are the trainer's at the step-start
        # parameters: handed back (no gradient) so the step reports the mismatch at no extra cost.
        return loss, (sums, current if one_update else None, per_token)

    grad_fn = jax.grad(loss_fn, argnums=(0, 1), has_aux=True)

    def minibatch_update(params, opt_state, critic_state, mb: TrainBatch, adv, ref_lp, sampler_lp, tx, cx):
        """Accumulate gradients over strided micro-batches, then one optimizer update (and one of
        the critic's, with its own clip and AdamW, when there is a critic)."""
        m = cfg.micro_batches
        critic = None if critic_state is None else critic_state["params"]
        # each term's token set (the RL terms': the policy tokens of grouped rows; rl.losses)
        weights = loss_weights(terms, mb.pol_valid, mb.group_ids, mb.signals, cfg.loss.aggregation)
        if m == 1:
            (grads, c_grads), (sums, current, per_token) = grad_fn(params, critic, mb, adv, ref_lp, weights,
                                                                   sampler_lp, tx, cx)
        else:
            opt_split = lambda a: None if a is None else _split(a, m)
            xs = (split_batch(mb, m), _split(adv, m), opt_split(ref_lp), jax.tree.map(lambda a: _split(a, m), weights),
                  opt_split(sampler_lp),
                  jax.tree.map(lambda a: _split(a, m), tx), jax.tree.map(lambda a: _split(a, m), cx))

            def acc(carry, x):
                g_acc, c_acc, s_acc = carry
                mb_, adv_, ref_, w_, sl_, tx_, cx_ = x
                (g, cg), (s, cur, tok) = grad_fn(params, critic, mb_, adv_, ref_, w_, sl_, tx_, cx_)
                return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, c_acc, cg),
                        jax.tree.map(jnp.add, s_acc, s)), (cur, tok)

            zeros_g = jax.tree.map(jnp.zeros_like, params)
            zeros_c = jax.tree.map(jnp.zeros_like, critic)
            zeros_s = {k: jnp.zeros((), jnp.float32) for k in metric_names}
            init = (zeros_g, zeros_c, zeros_s)
            groups = mb.micro_groups
            if groups is None:
                (grads, c_grads, sums), (current, per_token) = jax.lax.scan(acc, init, xs)
            else:  # one scan per group of micro-batches, each at its own width, the sums carried across
                cut = lambda x, w: (micro_groups.cut_rows(x[0], w),) + x[1:]
                (grads, c_grads, sums), (current, per_token) = micro_groups.run_grouped(
                    lambda c, part: jax.lax.scan(acc, c, part), xs, groups, cut, groups.widths, carry=init)
            current = None if current is None else _merge(current)
            per_token = jax.tree.map(_merge, per_token)
        grad_norm = optax.tree.norm(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # Non-finite guard: one NaN/inf in the loss or the gradient would reach every parameter
        # (global-norm clip, then AdamW) and the moments; such an update is skipped instead, the
        # parameters and optimizer state stay as they were, and `skipped_updates` counts it.
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(sum(sums.values()))
        if critic_state is not None:
            c_norm = optax.tree.norm(c_grads)
            c_updates, new_c_opt = critic_optimizer.update(c_grads, critic_state["opt_state"], critic)
            new_critic = {"params": optax.apply_updates(critic, c_updates), "opt_state": new_c_opt}
            finite = finite & jnp.isfinite(c_norm)
            sums["critic_grad_norm"] = c_norm
        keep = lambda new, old: jnp.where(finite, new, old)
        params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        if critic_state is not None:
            critic_state = jax.tree.map(keep, new_critic, critic_state)
        sums["grad_norm"] = grad_norm
        sums["skipped_updates"] = 1.0 - finite.astype(jnp.float32)
        return params, opt_state, critic_state, sums, current, per_token

    def step(params, opt_state, ref_params, batch: TrainBatch, teacher_params=None, aux=None):
        missing = [k for k in method.aux if not aux or k not in aux]
        if missing:
            raise ConfigError(f"method {method.name!r} trains {missing}: the step needs aux= (rl.step.init_aux)")
        critic = aux["critic"] if with_critic else None
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
        old_values = critic_values(graphdef, critic["params"], batch, cfg) if with_critic else None
        rise, retro_metrics = retrospective_stage(teacher_model, batch, cfg) if method.retrospective else (None, {})
        proc = new_prm = None
        prm_metrics = {}
        if with_prm:
            proc, new_prm, prm_metrics = prm_stage(ref_model, aux["prm"], batch, cfg, aux_opts["prm"])
        adv, diag, est_out = compute_advantages(batch, teacher_lp, cfg, method, old_values, proc, with_outputs=True)
        returns = diag.pop("returns", None)
        rec_batch = batch  # δ's old log-probs (the sampler's), before any replacement below
        cx, critic_diag = None, {}
        if with_critic:
            if returns is None:  # an advantage without a critic (e.g. GRPO's): GAE's returns train it
                a = cfg.algo
                rewards = batch.signals["rewards"]
                _, returns = critic_lib.gae(critic_lib.token_rewards(rewards, batch.pol_valid), old_values,
                                            batch.pol_valid, gamma=a.gae_gamma, lam=a.gae_lam)
            cx = {"returns": jax.lax.stop_gradient(returns), "old_values": old_values}
            critic_diag = {"critic/explained_variance": critic_lib.explained_variance(old_values, returns,
                                                                                      batch.pol_valid),
                           "critic/returns_mean": jnp.sum(jnp.where(batch.pol_valid, returns, 0.0))
                           / jnp.maximum(batch.pol_valid.sum(), 1)}
        tx = teacher_arrays(batch, teacher_lp, topk, method)
        if rise is not None:
            tx["rise_mask"] = rise
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
            minis = [(batch, adv, ref_lp, sampler_lp, tx, cx)]
        else:
            sb = split_batch(batch, nm)
            sa = _split(adv, nm)
            sr = None if ref_lp is None else _split(ref_lp, nm)
            ss = None if sampler_lp is None else _split(sampler_lp, nm)
            st = jax.tree.map(lambda x: _split(x, nm), tx)
            sc = jax.tree.map(lambda x: _split(x, nm), cx)
            pick = lambda tree, i: jax.tree.map(lambda x: x[i], tree)
            minis = [(pick(sb, i), sa[i], None if sr is None else sr[i], None if ss is None else ss[i], pick(st, i),
                      pick(sc, i)) for i in range(nm)]
        logs, first_epoch = [], []
        for epoch in range(cfg.ppo_epochs):
            for mb, a, r, sl, t, c in minis:
                params, opt_state, critic, sums, current, per_token = minibatch_update(params, opt_state, critic, mb,
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
        for k in CRITIC_METRICS + ("critic_grad_norm",):  # the critic's under critic/
            if k in metrics:
                metrics["critic/" + k.removeprefix("critic_")] = metrics.pop(k)
        metrics.update(critic_diag)
        metrics.update(prm_metrics)
        metrics.update(retro_metrics)
        metrics.update(diag)
        metrics.update(mismatch)
        if records:  # each row's loss-term values from the first epoch's pass over it
            term_values = first_epoch[0] if nm == 1 else jax.tree.map(lambda *x: _merge(jnp.stack(x)), *first_epoch)
            covered = teacher_covered(rec_batch) if method.teacher == "privileged" and teacher_lp is not None else None
            metrics["records"] = turn_records.step_records(adv, est_out, rec_batch, teacher_lp, covered, term_values,
                                                           cfg.max_turns)
            if cfg.record_teacher and teacher_lp is not None:  # log.turn_records' token log-probs: no extra forward
                metrics["records"]["teacher_logprobs"] = jax.lax.stop_gradient(teacher_lp)
        if method.aux:
            new_aux = dict(aux)
            if with_critic:
                new_aux["critic"] = critic
            if with_prm:
                new_aux["prm"] = new_prm
            return params, opt_state, metrics, new_aux
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
