"""The embedded default with its update packed: several trajectories (the teacher: several
hindsight rows) per row, the attention visiting only the key blocks each query reads, and shapes
that follow each batch. The same values as the embedded default's step on the same batch (the
packing and the padding change only XLA's summation order); on the 2-core CPU the update's
executed FLOPs stay within 1.3x the necessary ones (the default: ~1.5-1.7x), at 0.74x the
default's step speed on that CPU (smaller blocks: more loop steps; BENCHMARKS.md, issue 21)."""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "tiny_cpu_packed"
    c.train.pack_rows = True
    c.train.pack_width = 2304  # 4-6 of the default's trajectories per row (bucketed to 2,560)
    c.train.teacher_pack_width = 3584  # the hindsight rows, ~1.8x longer, in their own wider rows
    c.train.shapes = "batch"  # each batch's own row counts and widths (or a compiled shape within 10%)
    c.train.logprob_chunk = 128  # the head's last chunk pads at most 127 rows
    c.model.attn_key_block = 32  # a packed row's later items skip the earlier items' keys
    c.model.attn_q_chunk = 32
    c.model.attn_row_group = 1  # each packed row its own blocks (a group reads the union of its rows')
    return c
