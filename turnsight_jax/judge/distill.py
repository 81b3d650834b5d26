"""Distilling a small judge from a larger judge's labels.

The student is fine-tuned with the supervised warm-start's own update (turnsight_jax.sft:
full-vocabulary cross-entropy on the target tokens only, its AdamW with warm-up and cosine decay)
on rows `judge prompt -> teacher output`, the prompt built by the same function the judge runs
on (judge.prompt.prompt_ids) and the target being the teacher's rationale and verdict in the
strict format (`judge.rationale=False`: the verdict alone, the rationale-free ablation), ended by
<|im_end|>. Rows whose teacher output was malformed are left out: their label is the default,
not a judgment. A held-out share of the rows measures the student before and after: its greedy
verdicts' agreement with the teacher's labels, its malformed rate, and its mean NLL of the
teacher's target tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import shutil
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.judge import prompt as judge_prompt
from turnsight_jax.judge.labels import LabelRow, LabelsError
from turnsight_jax.judge.model import Judge
from turnsight_jax.judge.settings import JudgeSettings
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.weights import save_pretrained
from turnsight_jax.rl.logprobs import chunked_logprobs
from turnsight_jax.runlog import log
from turnsight_jax.rl.supervised import flatten_policy, pad_demonstrations, sft_optimizer, sft_update, state_pinned


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """steps: SFT steps; lr: peak learning rate; batch_size: rows per step; holdout: share of
    the usable rows held out for the before/after measurement (at least one row); seed: the split
    and the batches."""

    steps: int = 200
    lr: float = 1e-5
    batch_size: int = 8
    holdout: float = 0.2
    seed: int = 0

    def __post_init__(self):
        if self.steps < 0 or self.batch_size < 1 or not 0.0 < self.holdout < 1.0 or self.lr <= 0:
            raise ValueError(f"distill: steps >= 0, batch_size >= 1, 0 < holdout < 1 and lr > 0 are required, got "
                             f"{self}")


def usable_rows(rows: Sequence[LabelRow], *, rationale: bool, source: str = "labels") -> list[LabelRow]:
    """The rows a student is distilled on: the teacher's well-formed judgments. A rationale
    student needs each one's rationale (LabelsError naming the row otherwise)."""
    kept = [r for r in rows if not r.malformed]
    if rationale:
        for r in kept:
            if not r.rationale.strip():
                raise LabelsError(f"{source}:{r.line}: key 'rationale': a judge with rationales is distilled on the "
                                  f"teacher's rationale, got an empty one (or distill with --config.judge.rationale=False)")
    return kept


def split_rows(rows: Sequence[LabelRow], holdout: float, seed: int) -> tuple[list[LabelRow], list[LabelRow]]:
    """(train, held-out): a seeded shuffle, round(holdout * n) rows held out (at least one, and
    at least one left to train on)."""
    if len(rows) < 2:
        raise LabelsError(f"distill needs at least 2 well-formed labelled rows (one to train on, one held out), "
                          f"got {len(rows)}")
    order = np.random.default_rng(seed).permutation(len(rows))
    n_hold = min(max(1, int(round(holdout * len(rows)))), len(rows) - 1)
    return [rows[i] for i in order[n_hold:]], [rows[i] for i in order[:n_hold]]


def example(tokenizer, row: LabelRow, settings: JudgeSettings) -> tuple[np.ndarray, np.ndarray]:
    """One distillation row: tokens int32 [T] = judge prompt + teacher target + <|im_end|>, and
    its target mask bool [T] (True on the target and the stop token)."""
    prompt = judge_prompt.prompt_ids(tokenizer, row.prompt, rationale=settings.rationale,
                                     max_prompt_tokens=settings.max_prompt_tokens).ids
    text = judge_prompt.target_text(row.rationale, row.label, with_rationale=settings.rationale)
    target = tok_lib.encode(tokenizer, text) + [tok_lib.im_end_id(tokenizer)]
    tokens = np.asarray(prompt + target, np.int32)
    mask = np.zeros(tokens.shape, bool)
    mask[len(prompt):] = True
    return tokens, mask


@functools.partial(jax.jit, static_argnums=(0,))
def _target_nll(graphdef, params, tokens, valid, flat_row, flat_pos, keep):
    """Mean NLL of the target tokens (no gradient): the loss of rl.supervised.sft_update."""
    model = nnx.merge(graphdef, params)
    hidden = model.hidden_states(tokens, Layout.causal(valid))
    rows = hidden[flat_row, jnp.maximum(flat_pos - 1, 0)]
    lp = chunked_logprobs(rows, tokens[flat_row, flat_pos], model.output_weight(), chunk=1024,
                           vocab_block=model.options.vocab_block)
    return -jnp.sum(lp * keep) / jnp.maximum(keep.sum(), 1)


def _batch(examples, width: int):
    """examples of (tokens [t], mask [t]) -> tokens, valid [B, width] and flattened target positions."""
    pol_width = max(int(m.sum()) for _, m in examples)
    tokens, valid, pol_pos, pol_valid = pad_demonstrations(examples, width, pol_width)
    # targets are short (a rationale and a verdict): buckets of 64 flattened tokens, not SFT's 256
    return tokens, valid, flatten_policy(pol_pos, pol_valid, multiple=64)


def measure(graphdef, params, tokenizer, settings: JudgeSettings, rows: Sequence[LabelRow]) -> dict:
    """The judge (graphdef, params) on labelled rows: {"agreement" (its greedy label == the
    teacher's), "malformed_rate", "positive_rate", "nll" (mean over the teacher's target tokens),
    "rows"}."""
    judgments = Judge(graphdef, params, tokenizer, settings).judge_users([r.prompt for r in rows])
    exs = [example(tokenizer, r, settings) for r in rows]
    tokens, valid, flat = _batch(exs, max(len(t) for t, _ in exs))
    nll = float(_target_nll(graphdef, params, *map(jnp.asarray, (tokens, valid, *flat))))
    return {"agreement": float(np.mean([j.label == r.label for j, r in zip(judgments, rows)])),
            "malformed_rate": float(np.mean([j.verdict.malformed for j in judgments])),
            "positive_rate": float(np.mean([j.label for j in judgments])), "nll": nll, "rows": len(rows)}


def distill(graphdef, params, tokenizer, rows: Sequence[LabelRow], settings: JudgeSettings, cfg: DistillConfig, *,
            source: str = "labels"):
    """Fine-tune the student (graphdef, params) on the teacher's usable rows. Returns
    (params, summary) with the held-out measurement before and after."""
    usable = usable_rows(rows, rationale=settings.rationale, source=source)
    train_rows, held = split_rows(usable, cfg.holdout, cfg.seed)
    log(f"distill: {len(rows)} labelled rows, {len(rows) - len(usable)} malformed left out; {len(train_rows)} to train "
        f"on, {len(held)} held out; {'rationale + verdict' if settings.rationale else 'verdict only'}")
    before = measure(graphdef, params, tokenizer, settings, held)
    log(f"distill: before: agreement with the teacher {before['agreement']:.3f}, malformed {before['malformed_rate']:.3f}, "
        f"target NLL {before['nll']:.3f}")
    t0 = time.perf_counter()
    exs = [example(tokenizer, r, settings) for r in train_rows]
    width = max(len(t) for t, _ in exs)  # one width: the step compiles once per flattened-target bucket
    optimizer = sft_optimizer(cfg.lr, max(cfg.steps, 1))
    opt_state = jax.jit(optimizer.init)(params)
    step_fn = state_pinned(sft_update, params, opt_state)
    rng = np.random.default_rng(cfg.seed)
    loss = float("nan")
    for step in range(cfg.steps):
        pick = rng.choice(len(exs), size=cfg.batch_size, replace=cfg.batch_size > len(exs))
        tokens, valid, flat = _batch([exs[i] for i in pick], width)
        params, opt_state, loss = step_fn(graphdef, optimizer, params, opt_state, jnp.asarray(tokens),
                                          jnp.asarray(valid), *map(jnp.asarray, flat))
        if step % 25 == 0 or step == cfg.steps - 1:
            log(f"distill: step {step + 1}/{cfg.steps} loss {float(loss):.4f}")
    train_s = time.perf_counter() - t0
    after = measure(graphdef, params, tokenizer, settings, held)
    log(f"distill: after: agreement with the teacher {after['agreement']:.3f}, malformed {after['malformed_rate']:.3f}, "
        f"target NLL {after['nll']:.3f} ({cfg.steps} steps in {train_s:.1f}s)")
    summary = {"before": before, "after": after, "steps": cfg.steps, "lr": cfg.lr, "batch_size": cfg.batch_size,
               "train_rows": len(train_rows), "heldout_rows": len(held), "malformed_rows_left_out": len(rows) - len(usable),
               "rationale": settings.rationale, "final_loss": float(loss), "train_s": train_s}
    return params, summary


def save_judge(graphdef, params, out: str | pathlib.Path, tokenizer_dir: pathlib.Path, summary: dict) -> pathlib.Path:
    """The student as a Hugging Face folder (safetensors, config, tokenizer) with distill.json,
    written to a temporary folder first and then renamed (a crash leaves no half judge)."""
    out = pathlib.Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(nnx.merge(graphdef, params), tmp)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, tmp / name)
    (tmp / "distill.json").write_text(json.dumps(summary, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
