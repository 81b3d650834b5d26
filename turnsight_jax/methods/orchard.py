"""Orchard's credit-assigned SFT (CA-SFT; docs/signal_methods.md): learn from the good parts of
failed trajectories.

A teacher that knows the episode's outcome gives each state a retrospective value V(s_k): the
probability it answers "Yes" to a fixed question asked right after the state's prefix (its
"Yes" and "No" logits, normalised over the two). State s_k (k = 0..K-1) is the context before
turn k's assistant header; s_K the whole trajectory. The credit of turn k is
c_k = V(s_{k+1}) - V(s_k); its rise segments are the maximal runs of consecutive turns with
c_k >= threshold; the loss is the SFT negative log-likelihood of those turns' policy tokens, on
failed trajectories only, next to the RL terms.

All the K+1 probes of a trajectory sit in one packed row (rl.views' layout), computed once per
step by the frozen teacher:

  [original trajectory (segment 0)]
  for each state k: [probe_k]    reads original[:boundary_k], positions continue from boundary_k

so probe k sees exactly the plain sequence original[:boundary_k] + probe_k; the trajectory is
never copied. Only two columns of the vocabulary projection are computed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import Task
from turnsight_jax.models.attention import Layout
from turnsight_jax.rl.auxiliaries import RowsRequest, StageOut, StepAuxiliary, register_auxiliary
from turnsight_jax.rl.config import AlgoConfig, LossConfig
from turnsight_jax.rl.context_rows import context_row, has_elisions
from turnsight_jax.rl.logprobs import gather_rows
from turnsight_jax.rl.losses import register_loss_term
from turnsight_jax.rl.views import DEFAULT_PACKED_BUCKETS, _Row, pick_bucket

Array = jax.Array
# Tokens per probe the dry-run's worst case allows (the default template's question is ~60 tokens,
# plus the gold answer).
PROBE_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class RetrospectiveTemplate:
    """The question after each state's prefix. message_open / message_close are chat markup
    (encoded with their special tokens); `question` is plain text with the fields {reward}
    (the episode's outcome, 2 decimals), {outcome} ("solved" / "not solved") and {answer} (the
    gold answer). The teacher's next token after message_close is read: `yes` vs `no` (each must
    be one token)."""

    message_open: str = "<|im_start|>user\n"
    question: str = ("Hindsight review. This episode ended with reward {reward} ({outcome}); the correct final "
                     "answer is: {answer}\nJudging from the conversation up to this point, will the assistant "
                     "go on to solve the task? Reply Yes or No.")
    message_close: str = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    yes: str = "Yes"
    no: str = "No"


@struct.dataclass
class RetroProbes:
    """The teacher's probe rows of B trajectories (numpy or jax; rows first, so they shard like
    the batch).

    tokens [B, Q] int32 and layout (Layout fields [B, Q]): one packed row per trajectory.
    at [B, S] int32: packed index of probe k's last token (S = max_turns + 1 states; 0 where
    state k does not exist). exists [B, S] bool: state k exists (k <= the row's turns).
    answer_ids [B, 2] int32: the "Yes" and "No" token ids (the same in every row)."""

    tokens: Array
    layout: Layout
    at: Array
    exists: Array
    answer_ids: Array


def state_boundaries(traj: Trajectory) -> list[int]:
    """Token index where each state's prefix ends: turn k's header start, then the trajectory's
    end (K + 1 entries)."""
    return [t.header_start for t in traj.turns] + [traj.length]


def build_probes(trajs: Sequence[Trajectory], tasks: Sequence[Task], tokenizer, *, max_turns: int,
                 success_threshold: float, template: RetrospectiveTemplate = RetrospectiveTemplate(),
                 buckets: Sequence[int], min_width: int = 0) -> tuple[RetroProbes, dict[str, float]]:
    """The packed probe rows (numpy) and stats ("Q": the row width, "probe_tokens"). The question
    tells the teacher the episode's reward and the gold answer (`task.answer`); model and dataset
    text is encoded as plain text (a special token in it stays text)."""
    if len(tasks) != len(trajs):
        raise ValueError(f"{len(trajs)} trajectories but {len(tasks)} tasks")
    windowed = [b for b, t in enumerate(trajs) if has_elisions(t)]
    if windowed:
        raise ValueError(f"retrospective probes: trajectory {windowed[0]}'s turns saw elided observations (an "
                         f"observation window, methods.mm_grpo); the probes read the whole trajectory only")
    open_ids = tok_lib.encode(tokenizer, template.message_open)
    close_ids = tok_lib.encode(tokenizer, template.message_close)
    answer_ids = []
    for word in (template.yes, template.no):
        ids = tok_lib.encode_plain(tokenizer, word)
        if len(ids) != 1:
            raise ValueError(f"retrospective template: answer {word!r} must be one token, got {len(ids)} ({ids})")
        answer_ids.append(ids[0])
    newline = tok_lib.encode_plain(tokenizer, "\n")
    s = max_turns + 1
    at = np.zeros((len(trajs), s), np.int32)
    exists = np.zeros((len(trajs), s), bool)
    rows, probe_tokens = [], 0
    for b, (traj, task) in enumerate(zip(trajs, tasks)):
        if traj.num_turns > max_turns:
            raise ValueError(f"trajectory {b} has {traj.num_turns} turns, over rl max_turns={max_turns}")
        reward = float(traj.reward)
        text = template.question.format(reward=f"{reward:.2f}", answer="" if task.answer is None else task.answer,
                                        outcome="solved" if reward >= success_threshold else "not solved")
        body = open_ids + tok_lib.encode_plain(tokenizer, text) + close_ids
        row = _Row(context_row(traj))
        for k, end in enumerate(state_boundaries(traj)):
            # the prefix before a header ends with "<|im_end|>\n"; the whole trajectory with the
            # sampled <|im_end|>: the newline a chat template puts between messages, added
            ids = body if _ends_with(traj, end, newline) else newline + body
            _, start = row.add(ids, end, end)
            at[b, k] = start + len(ids) - 1
            exists[b, k] = True
            probe_tokens += len(ids)
        rows.append(row)
    width = pick_bucket(max([r.length for r in rows] + [min_width]), buckets, "retrospective probe row")
    tok, pos, seg, c1s, c1e, c2s, c2e = [np.stack(c) for c in zip(*(r.arrays(width) for r in rows))]
    ids = np.broadcast_to(np.asarray(answer_ids, np.int32), (len(trajs), 2)).copy()
    probes = RetroProbes(tok, Layout(pos, seg, c1s, c1e, c2s, c2e), at, exists, ids)
    return probes, {"Q": float(width), "probe_tokens": float(probe_tokens)}


def _ends_with(traj: Trajectory, end: int, ids: Sequence[int]) -> bool:
    n = len(ids)
    return end >= n and list(traj.tokens[end - n:end]) == list(ids)


# ---- in the step ----

def retrospective_values(teacher, probes: RetroProbes) -> Array:
    """V(s_k) [B, S] float32 without gradient: sigmoid(logit_yes - logit_no) at each probe's last
    token (= P(Yes) / (P(Yes) + P(No)); only those two vocabulary columns are projected); 0 where
    the state does not exist."""
    # no gradient; attention skips the probe rows' query chunks of padding (model.attn_row_group)
    hidden = gather_rows(teacher.hidden_states(probes.tokens, probes.layout, skip_padding=True), probes.at)  # [B, S, D]
    w = teacher.output_weight()  # [D, V]
    cols = jnp.take(w, probes.answer_ids, axis=1).astype(jnp.float32)  # [D, B, 2]
    logits = jnp.einsum("bsd,dbj->bsj", hidden.astype(jnp.float32), cols)
    v = jax.nn.sigmoid(logits[..., 0] - logits[..., 1])
    return jax.lax.stop_gradient(jnp.where(probes.exists, v, 0.0))


def turn_credits(values: Array, exists: Array) -> tuple[Array, Array]:
    """c_k = V(s_{k+1}) - V(s_k) [B, S-1] and whether turn k exists (both of its states do)."""
    has = exists[:, 1:] & exists[:, :-1]
    return jnp.where(has, values[:, 1:] - values[:, :-1], 0.0), has


def rise_turns(credits: Array, has: Array, threshold: float) -> tuple[Array, Array]:
    """(turns in a rise segment [B, K] bool, rise segments per row [B] int32). A rise segment is a
    maximal run of consecutive turns with c_k >= threshold, so a turn is in one exactly when its
    own credit passes; a segment starts at a passing turn whose predecessor does not pass."""
    rise = has & (credits >= threshold)
    starts = rise & ~jnp.pad(rise[:, :-1], ((0, 0), (1, 0)))
    return rise, starts.sum(axis=1).astype(jnp.int32)


def rise_mask(values: Array, exists: Array, turn_ids: Array, pol_valid: Array, rewards: Array, algo: AlgoConfig):
    """The CA-SFT token mask [B, N] bool (policy tokens of rise-segment turns of failed
    trajectories: outcome reward < orchard.success) and its metrics (scalars)."""
    orchard = algo.section("orchard")
    credits, has = turn_credits(values, exists)
    rise, segments = rise_turns(credits, has, orchard.rise)
    failed = rewards < orchard.success  # [B]
    k = rise.shape[1]
    tok_rise = jnp.take_along_axis(rise, jnp.clip(turn_ids, 0, k - 1), axis=1) & (turn_ids >= 0)
    mask = pol_valid & tok_rise & failed[:, None]
    fl = failed.astype(jnp.float32)
    n_failed = jnp.maximum(fl.sum(), 1.0)
    first = exists[:, 0]
    metrics = {
        "orchard/v_start": jnp.sum(jnp.where(first, values[:, 0], 0.0)) / jnp.maximum(first.sum(), 1),
        "orchard/credit_mean": jnp.sum(credits) / jnp.maximum(has.sum(), 1),
        "orchard/failed_frac": jnp.mean(fl),
        "orchard/rise_segments": jnp.sum(segments * fl) / n_failed,  # per failed trajectory
        "orchard/rise_turn_frac": jnp.sum(rise & failed[:, None]) / jnp.maximum(jnp.sum(has & failed[:, None]), 1),
        "orchard/rise_token_share": mask.sum() / jnp.maximum(pol_valid.sum(), 1),
    }
    return mask, metrics


@register_loss_term("ca_sft", ("logprobs", "rise_mask", "pol_valid"), ("ca_sft_nll",))
def _ca_sft_term(x, cfg: LossConfig, algo: AlgoConfig):
    """Orchard's CA-SFT: coef · (−log π_θ) on the rise-segment tokens of failed trajectories,
    aggregated like the other terms (loss.aggregation)."""
    mask = x["pol_valid"] & x["rise_mask"]
    nll = jnp.where(mask, -x["logprobs"], 0.0)
    return algo.section("orchard").coef * nll, {"ca_sft_nll": nll}


# ---- the step auxiliary (rl.auxiliaries) ----

def _batch_rows(req: RowsRequest):
    """The probe rows of a batch (`batch.aux_rows["retrospective"]`) and their stats ("Q")."""
    return build_probes(req.trajs, req.tasks, req.tokenizer, max_turns=req.cfg.max_turns,
                        success_threshold=req.cfg.algo.section("orchard").success, buckets=req.buckets, min_width=req.min_width)


def _plan_width(run_config, length: int) -> int:
    """The dry-run's worst case: the trajectory, then one probe of PROBE_TOKENS per state."""
    return pick_bucket(length + (run_config.rollout.max_turns + 1) * PROBE_TOKENS, DEFAULT_PACKED_BUCKETS,
                       "plan: probe row")


def _abstract_rows(b: int, width: int, max_turns: int) -> RetroProbes:
    i32 = np.int32
    rows = lambda *shape, dtype=i32: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    return RetroProbes(rows(b, width), Layout(*(rows(b, width) for _ in range(6))), rows(b, max_turns + 1),
                       rows(b, max_turns + 1, dtype=np.bool_), rows(b, 2))


def _stage(inputs, state, optimizer) -> StageOut:
    """The teacher's retrospective values on the probe rows (teacher micro-batches, no gradient),
    once per step -> the CA-SFT mask "rise_mask" [B, N] bool."""
    batch, cfg = inputs.batch, inputs.cfg
    probes = batch.aux_rows["retrospective"]
    values = inputs.teacher_pass(lambda p: retrospective_values(inputs.teacher_model, p), probes)
    mask, metrics = rise_mask(values, probes.exists, batch.turn_ids, batch.pol_valid, batch.signals["rewards"], cfg.algo)
    return StageOut({"rise_mask": mask}, metrics)


# ---- registration ----
from turnsight_jax.errors import ConfigError  # noqa: E402
from turnsight_jax.rl.config import always_checked  # noqa: E402
from turnsight_jax.rl.methods import Method, register_config_section, register_method  # noqa: E402


@dataclasses.dataclass(frozen=True)
class OrchardConfig:
    """The run config's `orchard.*` section."""

    coef: float = 1.0  # coefficient of the CA-SFT NLL on rise segments of failed trajectories
    rise: float = 0.05  # a turn whose credit V(s_k+1) - V(s_k) reaches this is in a rise segment (the paper's 0.05)
    success: float = 1.0  # outcome reward from which a trajectory is solved (CA-SFT trains on the others)

    def validate(self) -> "OrchardConfig":
        for key in ("coef", "rise", "success"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (key == "coef" and v < 0):
                raise ConfigError(f"orchard.{key} must be finite" + (" and >= 0" if key == "coef" else "") + f", got {v!r}")
        return self


register_config_section("orchard", OrchardConfig, always_checked("orchard", OrchardConfig, "an Orchard"))

# runs whenever a loss term reads "rise_mask" (CA-SFT trains on failed trajectories: the outcome tells)
register_auxiliary(StepAuxiliary("retrospective", provides=("rise_mask",), needs_outputs=("rewards",),
                                 before_advantage=_stage, batch_rows=_batch_rows, rows_key="Q",
                                 plan_width=_plan_width, abstract_rows=_abstract_rows,
                                 describe="retrospective teacher on probe rows"))

register_method(Method("orchard", advantage="base", rewards=(), loss_terms=("clipped_surrogate", "ca_sft"),
                       description="Orchard CA-SFT: the base method + SFT on rise segments of failed trajectories, "
                                   "valued by a teacher that knows the outcome"))
