"""The packed update (configs/tiny_cpu_packed.py) on a paper-like length spread at CPU scale:
FTRL-like episodes of 2-10 turns (single lookups and chains of 2-9 hops) whose tool results are
records of 50-500 words (`data.min_result_words`, `data.max_result_words`), so trajectories
range from a few hundred to several thousand tokens, as the paper's do relative to each other.
The tiny model, its warm-start and the packed step's kernel settings are the packed default's;
the rows are packed at the batch's own width, the tiles are smaller and a compiled shape serves
another batch only within 2% of its FLOPs. Its logged `perf/update_padding_ratio` is what
BENCHMARKS.md records for issue 21 at the paper-like geometry: 1.17-1.21 at all 6 steps. About
52 minutes on 2 cores, 40 of them the warm-start (its rows are ~10x the default's)."""

import pathlib

from turnsight_jax.config import load_config_module


def get_config():
    c = load_config_module(pathlib.Path(__file__).with_name("tiny_cpu_packed.py")).get_config()
    c.name = "tiny_cpu_paper_like"
    c.data.categories = ("single_hop", "multi_hop")
    c.data.hops = 2
    c.data.max_hops = 9  # chains of 2-9 hops: 3-10 turns with the answer (single lookups: 2)
    c.data.vocab_size = 28
    c.data.num_relations = 12
    c.data.min_result_words = 50  # tool results of 50-500 words, as FTRL's records run long
    c.data.max_result_words = 500
    c.rollout.max_turns = 10
    c.rollout.max_prompt_tokens = 1536
    c.rollout.max_response_tokens = 6144  # ten turns of results up to ~500 tokens each
    c.eval.max_turns = 10
    # no held-out evaluation: this short warm-start leaves the tiny model near Solve-F1 0 on these
    # tasks (the run measures the step; the embedded default is the run that learns)
    c.data.num_eval = 0
    # A shorter warm-start on fewer rows: its rows run 10x the default's length (attention ~100x),
    # and the run is about the step's geometry, not the policy's skill (every call's result, an
    # unknown name's too, is a long record, so the lengths do not hinge on the skill)
    c.sft.batch_size = 4
    c.sft.curriculum_steps = 120
    c.sft.steps = 40
    c.train.prompts_per_step = 4  # 16 trajectories per step, as the benchmark's paper-like batch
    c.train.steps = 6
    c.train.pack_width = 3328  # rows of the batch's own width (3,584 / 4,096): the finest packing
    c.train.teacher_pack_width = 10240  # the hindsight rows, ~2-3x longer, a few per row
    c.train.shape_reuse = 0.02  # a compiled shape serves a batch only within 2% of its own FLOPs
    c.model.attn_key_block = 64  # a tile straddling two items is paid for twice: smaller tiles waste less
    c.model.attn_q_chunk = 64
    return c
