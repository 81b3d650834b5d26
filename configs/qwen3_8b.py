"""Qwen3-8B with TurnSight on MatchTIR, the paper's setting (docs/spec.md §2).

32 prompts x 16 rollouts per step, max 10 turns, prompt <= 10,000 and response <= 13,000 tokens,
lr 1e-6, one PPO mini-batch, temperature 1.0, no KL, 3 epochs over FTRL's 2,215 training tasks,
evaluation and checkpoints every 5 steps, on 8 x 80 GB accelerators (fsdp = 8).

    python -m turnsight_jax.train --config configs/qwen3_8b.py \
        --config.model.hf_path=/path/to/Qwen3-8B-Base \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "qwen3_8b_turnsight"
    c.model.preset = "qwen3-8b"  # architecture for --dry_run; training loads model.hf_path
    c.model.hf_path = ""
    c.model.allow_random_init = False
    c.model.param_dtype = "float32"  # master weights: lr 1e-6 updates vanish in bfloat16
    c.model.compute_dtype = "bfloat16"
    c.model.ref_dtype = "bfloat16"
    c.model.remat = True
    c.model.attn_q_chunk = 1024

    c.data.source = "ftrl"
    c.data.path = ""
    c.data.eval_source = "ftrl"
    c.data.eval_path = ""
    c.data.num_eval = 200

    c.rollout.max_turns = 10
    c.rollout.max_prompt_tokens = 10_000
    c.rollout.max_response_tokens = 13_000
    c.rollout.max_turn_tokens = 4096
    c.rollout.enable_thinking = True
    c.rollout.temperature = 1.0
    c.rollout.top_k = 0  # the paper samples the full distribution (the tiny default uses top-k 20)
    # 4 prompts x 16 rollouts = 64 rows per rollout chunk: a bf16 KV cache of 64 x 23k slots is
    # 27 GiB per device on fsdp=8 (all 512 rows at once would be 217 GiB).
    c.rollout.prompts_per_chunk = 4

    c.rl.name = "turnsight"
    c.rl.base = "matchtir"
    c.rl.lam = 0.5
    c.rl.eps_w = 0.5
    c.rl.depths = (1, 2, 3)

    c.loss.clip_eps = 0.2
    c.loss.clip_eps_high = 0.28
    c.loss.kl_coef = 0.0

    c.optim.lr = 1e-6
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.01
    c.optim.b2 = 0.999

    c.train.steps = 208  # 3 epochs x ceil(2215 / 32)
    c.train.prompts_per_step = 32
    c.train.group_size = 16
    c.train.mini_batches = 1
    c.train.micro_batches = 64  # 8 trajectories per micro-batch: one per device
    c.train.teacher_micro_batches = 64
    c.train.logprob_chunk = 2048

    c.sft.steps = 0  # the paper starts RL from the base checkpoint
    c.eval.every = 5
    c.eval.temperature = 0.0  # greedy held-out evaluation
    c.eval.top_k = 0
    c.eval.max_turns = 20  # FTRL's evaluation limit
    c.eval.batch_size = 64
    c.checkpoint.every = 5
    c.checkpoint.keep = 3

    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.mesh.tensor = 1
    c.plan.device_memory_gib = 80.0
    return c
