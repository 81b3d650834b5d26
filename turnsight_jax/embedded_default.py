"""The embedded default's two layers (turnsight_jax.config.default_config): the tiny-default model
and the tiny CPU experiment. They live in the package because an installed package cannot read
the repository's configs/ folder; configs/models/tiny_default.py and configs/tiny_cpu.py return
them. (The paper's experiments are config files: configs/qwen3_8b.py and its siblings.)

This module imports nothing from turnsight_jax.config (config.default_config imports it).
"""

from __future__ import annotations

import ml_collections as mlc

# The model layer: a tiny Qwen3 with the real 151,936-token vocabulary (models.config.PRESETS),
# cheap enough to initialise at random and warm-start on a CPU.
TINY_DEFAULT_MODEL = dict(
    preset="tiny-default",
    param_dtype="float32",
    ref_dtype="float32",
    compute_dtype="float32",
    remat=False,
    attn_q_chunk=128,  # small chunks: cheaper on CPU (static causal bounds skip more)
    vocab_block=1024,  # the head's logits 1,024 columns at a time: a [rows, 1,024] block stays in a CPU's cache
    attn_row_group=4,  # the RL step's attention skips query chunks of padding per 4 rows (one prompt's rollouts)
    allow_random_init=True,  # tiny: random init + the supervised warm-start below
)


def tiny_cpu(c: mlc.ConfigDict) -> None:
    """The tiny CPU experiment: supervised warm-start on gold built-in trajectories, then
    TurnSight RL on GRPO over built-in tasks, on one CPU in minutes (BENCHMARKS.md)."""
    c.name = "tiny_cpu"

    c.data.source = "builtin"
    c.data.eval_source = "builtin"
    c.data.num_eval = 64
    c.data.categories = ("single_hop", "multi_hop")
    c.data.max_distractors = 1
    c.data.vocab_size = 10
    c.data.entity_style = "names"  # single-token first names: a tiny model learns to copy them quickly
    c.data.num_relations = 4
    c.data.extra_rows = 1

    c.rollout.max_turns = 4
    c.rollout.max_prompt_tokens = 1024
    c.rollout.max_response_tokens = 256
    c.rollout.max_turn_tokens = 48
    c.rollout.enable_thinking = False
    c.rollout.top_k = 20  # Qwen3's recommended top-k; also keeps the 151,936-token tail out of rollouts
    # The default's recorded held-out numbers and its < 15 min wall time were measured with the
    # lockstep sampler; the paged engine's run of this default is not yet timed (docs/rollout_engine.md).
    c.rollout.engine = "lockstep"

    c.rl.base = "grpo"  # the built-in tasks have no gold calls for MatchTIR to match per turn

    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2
    c.optim.b2 = 0.99
    c.optim.weight_decay = 0.0

    c.train.steps = 12
    c.train.prompts_per_step = 8
    c.train.group_size = 4
    # head rows per chunk, with the model layer's vocab_block: [rows, 1,024] logits blocks stay in
    # cache whatever the rows, so chunks only need to cover the used rows with little rounding up
    # (BENCHMARKS.md "Train step: the head in vocabulary blocks")
    c.train.logprob_chunk = 640
    c.train.score_chunk = 256

    c.eval.every = 0  # only before and after RL
    c.eval.max_turns = 4
    c.eval.temperature = 1.0  # the sampled policy's expected Solve-F1 (what RL maximises)
    c.eval.samples = 4
    c.eval.top_k = 20  # the same filter as the rollouts'

    c.sft.curriculum_steps = 250  # stage 1: short rows, softmax over the task vocabulary
    c.sft.curriculum_lr = 3e-3
    c.sft.steps = 60  # stage 2: full rows, full vocabulary
    c.sft.lr = 3e-3
    # Stage 2 imitates an imperfect demonstrator: this fraction of its demonstrations make one wasted
    # call to a wrong tool before the gold chain. Gold-perfect SFT leaves RL nothing to improve on
    # the built-in tasks (BENCHMARKS.md); removing the wasted calls is what the default RL learns.
    c.sft.wrong_call_rate = 0.5

    c.checkpoint.every = 10
    c.checkpoint.keep = 2

    # trajectory records of every step (32 short trajectories: ~10 kB each compressed; BENCHMARKS.md
    # "Trajectory records and cost accounting" measured the run's wall time with and without them)
    c.log.records_every = 1
