"""Qwen3-8B with TurnSight on MatchTIR, the paper's setting (docs/spec.md §2).

Layers: `base_config()` (turnsight_jax/config.py) holds the paper's values: 32 prompts x 16
rollouts per step, max 10 turns, prompt <= 10,000 and response <= 13,000 tokens, lr 1e-6, one PPO
mini-batch, temperature 1.0, no KL, no SFT, thinking on, 3 epochs over FTRL's 2,215 training tasks,
evaluation and checkpoints every 5 steps; configs/models/qwen3_8b.py the model; `experiment`
below how this run fits 8 x 80 GB accelerators (fsdp = 8) and evaluates. This file follows the
paper's text (optimal matching, this project's reward conventions); configs/paper/ holds the same
runs with the released MatchTIR code's conventions, one file per published number
(docs/reproducing.md).

    python -m turnsight_jax.train --config configs/qwen3_8b.py \
        --config.model.hf_path=/path/to/Qwen3-8B \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

from turnsight_jax.config import layered, model_file


def experiment(c):
    """The paper's FTRL run on 8 devices (also the experiment of configs/qwen3_4b.py, qwen3_0_6b.py)."""
    c.data.source = c.data.eval_source = "ftrl"
    c.data.num_eval = 200  # held-out tasks evaluated every eval.every steps
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1  # fsdp over every device
    # The paged engine runs all 32 x 16 episodes through 128 decode slots, 16 per device. Its bf16
    # KV pool: 20,000 blocks of 16 tokens per device (43.9 GiB), 87% of every slot at prompt +
    # response length (10k + 13k: 23,009 blocks, 50.5 GiB), so the rollout plans 66.2 GiB per
    # device for Qwen3-8B, within the launchers' XLA_PYTHON_CLIENT_MEM_FRACTION=0.90 of an 80 GB
    # card less 5% headroom (68.4 GiB; `--dry-run` prints the plan). Admission reserves an
    # episode's worst case and waits for free blocks; a group's siblings share the prompt's blocks
    # (one group needs 13,634), and an episode's tokens do not depend on when it was admitted.
    c.rollout.decode_slots = 128
    c.rollout.kv_pool_blocks = 20_000
    c.train.micro_batches = 64  # 8 trajectories per micro-batch: one per device
    c.train.teacher_micro_batches = 64
    # One row per device per micro-batch: neither length classes nor packing can cut its padding.
    # Each device's rows are ordered by length across the micro-batches, which run in 4 groups, each
    # at its own width (rl/micro_groups.py; the same values; the memory plan compiles every group
    # at T). Counted at a paper-like spread: Qwen3-8B's update 1.68x -> 1.19x its necessary FLOPs.
    c.train.micro_batch_groups = 4
    c.train.logprob_chunk = 2048


def get_config():
    c = layered(model=model_file(__file__, "qwen3_8b"), experiment=experiment)
    c.name = "qwen3_8b_turnsight"
    return c
