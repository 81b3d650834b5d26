"""Small-vocabulary test models scoring real-tokenizer trajectories.

A Qwen3 row of 151,936 logits costs ~150x a 1,024-row one, and the tests that compare two ways
of computing the same log-probs (packed vs plain views, fused vs unfused step) spend nearly all
their time in that projection. Their claims do not depend on which ids the model sees, only on
both sides seeing the same ones, so they fold every id the model reads or scores modulo a small
vocabulary, identically on both sides. Tests of the vocabulary itself (chunked log-softmax over
the real size, the sampler's top-k over 151,936) keep the real size.
"""

from __future__ import annotations

import dataclasses

import numpy as np

SMALL_VOCAB = 1024


def fold(ids, vocab: int = SMALL_VOCAB) -> np.ndarray:
    """ids (any shape, int) -> ids % vocab, int32."""
    return (np.asarray(ids) % vocab).astype(np.int32)


def _fold_packed(packed, vocab):
    """rl.packing.PackedRows (or None) with its token ids folded."""
    return None if packed is None else dataclasses.replace(packed, tokens=fold(packed.tokens, vocab))


def fold_views(views, vocab: int = SMALL_VOCAB):
    """PackedViews with its token ids and scored targets folded (layout and indices unchanged)."""
    tokens = None if views.tokens is None else fold(views.tokens, vocab)
    return dataclasses.replace(views, tokens=tokens, pred_target=fold(views.pred_target, vocab),
                               packed=_fold_packed(views.packed, vocab))


def fold_probes(probes, vocab: int = SMALL_VOCAB):
    """methods.orchard.RetroProbes with its token ids and answer ids folded."""
    return None if probes is None else dataclasses.replace(probes, tokens=fold(probes.tokens, vocab),
                                                           answer_ids=fold(probes.answer_ids, vocab))


def fold_batch(batch, vocab: int = SMALL_VOCAB):
    """TrainBatch with its tokens (and packed rows, views and probes, when present) folded."""
    views = None if batch.views is None else fold_views(batch.views, vocab)
    return dataclasses.replace(batch, tokens=fold(batch.tokens, vocab), views=views,
                               packed=_fold_packed(batch.packed, vocab),
                               aux_rows=None if batch.aux_rows is None else {
                                   k: fold_probes(v, vocab) if k == "retrospective" else v
                                   for k, v in batch.aux_rows.items()})
