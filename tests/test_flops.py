"""The one FLOP counter: pair counts equal brute-force counts of the masks the kernels apply, the
chunk grouping's pairs equal the kernel's, and the update's necessary/executed split."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax import flops
from turnsight_jax.models.attention import NO_SEGMENT, PAD_SEGMENT, Layout, packed_mask
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.rl.batch import TrainBatch

CFG = Qwen3Config(vocab_size=1000, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8)


def _brute_pairs(layout: Layout) -> int:
    b, p = layout.segment_ids.shape
    mask = packed_mask(jax_tree(layout), jnp.asarray(layout.segment_ids), jnp.arange(p, dtype=jnp.int32))
    real = np.asarray(layout.segment_ids) >= 0
    return int(np.asarray(mask)[real].sum())


def jax_tree(layout: Layout) -> Layout:
    return Layout(*(jnp.asarray(a) for a in (layout.positions, layout.segment_ids, layout.ctx1_segment,
                                             layout.ctx1_end, layout.ctx2_segment, layout.ctx2_end)))


def _views_like_layout() -> Layout:
    """Two rows shaped like packed hindsight rows: segment 0, a trunk reading segment 0 up to 4,
    two branches reading segment 0 up to 4 and the trunk up to two depths; padding at the end."""
    seg, c1s, c1e, c2s, c2e = [], [], [], [], []

    def add(n, s, ctx1=(NO_SEGMENT, 0), ctx2=(NO_SEGMENT, 0)):
        seg.extend([s] * n); c1s.extend([ctx1[0]] * n); c1e.extend([ctx1[1]] * n)
        c2s.extend([ctx2[0]] * n); c2e.extend([ctx2[1]] * n)

    add(10, 0)
    add(6, 1, (0, 4))                 # trunk: packed 10..15
    add(3, 2, (0, 4), (1, 10 + 3))    # branch, depth 1: trunk up to packed 13
    add(3, 3, (0, 4), (1, 10 + 6))    # branch, depth 2: the whole trunk
    add(2, PAD_SEGMENT)
    row = [np.array(a, np.int32) for a in (seg, c1s, c1e, c2s, c2e)]
    rows = [np.stack([r, r]) for r in row]
    # the second row: its last branch is padding
    rows[0][1, 18:], rows[1][1, 18:], rows[3][1, 18:] = PAD_SEGMENT, NO_SEGMENT, NO_SEGMENT
    pos = np.broadcast_to(np.arange(24, dtype=np.int32), (2, 24))
    return Layout(pos, *rows)


def test_layout_pairs_equal_the_mask():
    lay = _views_like_layout()
    assert flops.layout_pairs(lay.segment_ids, lay.ctx1_segment, lay.ctx1_end, lay.ctx2_segment,
                              lay.ctx2_end) == _brute_pairs(lay)


def test_readable_pairs_equal_the_causal_mask():
    rng = np.random.default_rng(0)
    valid = rng.random((3, 17)) < 0.7
    lay = Layout.causal(jnp.asarray(valid))
    assert flops.readable_pairs(valid) == _brute_pairs(Layout(*(np.asarray(a) for a in (
        lay.positions, lay.segment_ids, lay.ctx1_segment, lay.ctx1_end, lay.ctx2_segment, lay.ctx2_end))))
    assert flops.readable_pairs(np.ones((1, 9), bool)) == flops.causal_pairs(9) == 45


@pytest.mark.parametrize("width,chunk", [(4096, 512), (1000, 256), (300, 512), (640, 128)])
def test_chunked_pairs_follow_the_kernel_groups(width, chunk):
    got = flops.chunked_pairs(width, chunk)
    assert got >= flops.causal_pairs(width)
    if width <= chunk:
        assert got == width * width  # one chunk scores every key
    if width % chunk == 0 and width // chunk % 4 == 0:
        assert got == pytest.approx(0.625 * width * width)  # 4 equal groups: (1+2+3+4)/16


def test_update_flops_necessary_and_executed():
    """A batch of 2 rows, widths chosen so every term can be computed by hand."""
    t, n = 8, 4
    valid = np.zeros((2, t), bool)
    valid[0, :8] = True
    valid[1, :5] = True
    pol_valid = np.zeros((2, n), bool)
    pol_valid[0, :4] = True
    pol_valid[1, :2] = True
    z = np.zeros((2, n), np.int32)
    batch = TrainBatch(tokens=np.zeros((2, t), np.int32), valid=valid, pol_pos=z, pol_valid=pol_valid, turn_ids=z,
                       old_logprobs=z.astype(np.float32), group_ids=np.zeros(2, np.int32),
                       num_turns=np.ones(2, np.int32), signals={})
    work = flops.update_flops(CFG, batch, updates=1, q_chunk=16, remat=False)
    fwd = flops.forward_flops(CFG, 13, 36 + 15, 6)
    assert work.parts["student"][0] == pytest.approx(3 * fwd)
    trunk, attn, head = (flops.trunk_flops_per_token(CFG) * 16, flops.attention_flops(CFG, 2 * 64),
                         flops.head_flops(CFG, 8))
    assert work.parts["student"][1] == pytest.approx(3 * trunk + 4 * attn + 4 * head)
    assert work.ratio > 1.0
    # two epochs: twice the work, the same ratio
    two = flops.update_flops(CFG, batch, updates=2, q_chunk=16, remat=False)
    assert two.necessary == pytest.approx(2 * work.necessary) and two.ratio == pytest.approx(work.ratio)


def test_head_rows_executed_counts_live_chunks_per_cell():
    used = np.zeros((4, 8), bool)
    used[0, :5] = used[1, :3] = used[2, :8] = True  # 16 used slots of 32
    assert flops.head_rows_executed(used, 64) == 32  # one chunk holds the whole cell: all of it runs
    assert flops.head_rows_executed(used, 4) == 16  # 16 used -> 4 live chunks of 4
    assert flops.head_rows_executed(used, 4, row_shards=2) == 8 + 8  # shard 0: 8 used, shard 1: 8
    assert flops.head_rows_executed(used, 4, micro_batches=2) == 16 + 4  # rows 0, 2: 13 -> 16; rows 1, 3: 3 -> 4
