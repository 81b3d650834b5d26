"""Packed attention (docs/spec.md §4.2): block tokens score exactly as in explicitly built plain sequences.

A packed row holds an original sequence (segment 0) and blocks. A block is a trunk that reads
the original up to a prefix limit, and branches that each read the original up to the same
limit plus the trunk up to a branch-specific limit. Each branch must equal the plain sequence
original[:limit] + trunk[:trunk_limit] + branch, position by position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from turnsight_jax.models.attention import NO_SEGMENT, PAD_SEGMENT, Layout
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import RuntimeOptions, init_model

VOCAB, PACKED_T, PLAIN_T, PLAIN_ROWS = 97, 128, 48, 16
CFG = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, tie_word_embeddings=False)
MODEL = init_model(CFG, seed=7, options=RuntimeOptions(attn_q_chunk=32))  # several query chunks


@jax.jit
def _logprobs(tokens, layout):
    return jax.nn.log_softmax(MODEL(tokens, layout), axis=-1)


@st.composite
def structures(draw):
    orig_len = draw(st.integers(3, 24))
    blocks = []
    for _ in range(draw(st.integers(1, 3))):
        limit = draw(st.integers(1, orig_len))
        trunk = draw(st.integers(1, 6))
        branches = [(draw(st.integers(1, trunk)), draw(st.integers(1, 5))) for _ in range(draw(st.integers(1, 3)))]
        blocks.append((limit, trunk, branches))
    seed = draw(st.integers(0, 2**31 - 1))
    return orig_len, blocks, seed


def _build(orig_len, blocks, rng):
    """Packed tokens/layout fields plus, per block token, its plain sequence and index there."""
    orig = rng.integers(0, VOCAB, orig_len)
    tok, pos, seg = list(orig), list(range(orig_len)), [0] * orig_len
    c1s, c1e, c2s, c2e = [NO_SEGMENT] * orig_len, [0] * orig_len, [NO_SEGMENT] * orig_len, [0] * orig_len
    checks = []  # (packed index, plain tokens, index in plain)
    next_seg = 1
    for limit, trunk_len, branches in blocks:
        trunk = rng.integers(0, VOCAB, trunk_len)
        trunk_seg, trunk_start = next_seg, len(tok)
        next_seg += 1
        for i, t in enumerate(trunk):
            checks.append((len(tok), np.concatenate([orig[:limit], trunk]), limit + i))
            tok.append(t); pos.append(limit + i); seg.append(trunk_seg)
            c1s.append(0); c1e.append(limit); c2s.append(NO_SEGMENT); c2e.append(0)
        for trunk_limit, blen in branches:
            branch = rng.integers(0, VOCAB, blen)
            plain = np.concatenate([orig[:limit], trunk[:trunk_limit], branch])
            for i, t in enumerate(branch):
                checks.append((len(tok), plain, limit + trunk_limit + i))
                tok.append(t); pos.append(limit + trunk_limit + i); seg.append(next_seg)
                c1s.append(0); c1e.append(limit); c2s.append(trunk_seg); c2e.append(trunk_start + trunk_limit)
            next_seg += 1
    n = len(tok)
    pad = PACKED_T - n
    fields = [tok, pos, seg, c1s, c1e, c2s, c2e]
    fills = [0, 0, PAD_SEGMENT, NO_SEGMENT, 0, NO_SEGMENT, 0]
    fields = [np.asarray(f + [fill] * pad, np.int32)[None] for f, fill in zip(fields, fills)]
    return fields, checks


@settings(max_examples=40, deadline=None, derandomize=True)
@given(structures())
def test_block_tokens_equal_plain_sequences(structure):
    orig_len, blocks, seed = structure
    rng = np.random.default_rng(seed)
    (tok, pos, seg, c1s, c1e, c2s, c2e), checks = _build(orig_len, blocks, rng)
    layout = Layout(*(jnp.asarray(a) for a in (pos, seg, c1s, c1e, c2s, c2e)))
    packed = np.asarray(_logprobs(jnp.asarray(tok), layout))[0]

    orig = tuple(tok[0, :orig_len])
    plains = sorted({tuple(p) for _, p, _ in checks} | {orig})
    rows = np.zeros((PLAIN_ROWS, PLAIN_T), np.int32)  # fixed shape: one compilation
    mask = np.zeros((PLAIN_ROWS, PLAIN_T), bool)
    for r, p in enumerate(plains):
        rows[r, : len(p)] = p
        mask[r, : len(p)] = True
    plain_lp = np.asarray(_logprobs(jnp.asarray(rows), Layout.causal(jnp.asarray(mask))))
    where = {p: r for r, p in enumerate(plains)}
    for packed_idx, plain, plain_idx in checks:
        ref = plain_lp[where[tuple(plain)], plain_idx]
        np.testing.assert_allclose(packed[packed_idx], ref, atol=1e-5, rtol=0)
    # the original segment is untouched by the blocks after it
    np.testing.assert_allclose(packed[:orig_len], plain_lp[where[orig], :orig_len], atol=1e-5, rtol=0)
