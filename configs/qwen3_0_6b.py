"""Qwen3-0.6B with TurnSight: a single-GPU-sized run of the paper's recipe on FTRL, smaller batch.

    python -m turnsight_jax.train --config configs/qwen3_0_6b.py \
        --config.model.hf_path=/path/to/Qwen3-0.6B --config.data.path=... --config.data.eval_path=...
"""

import pathlib

from turnsight_jax.config import layered, load_config_module, model_file


def smaller_batch(c):
    c.train.prompts_per_step = 8
    c.train.group_size = 8
    c.train.micro_batches = 16
    c.train.teacher_micro_batches = 16
    c.train.steps = 3 * 277  # 3 epochs x ceil(2215 / 8)
    c.rollout.max_prompt_tokens = 8192
    c.rollout.max_response_tokens = 8192
    c.optim.lr = 2e-6


def get_config():
    paper = load_config_module(pathlib.Path(__file__).with_name("qwen3_8b.py"))
    c = layered(model=model_file(__file__, "qwen3_0_6b"), experiment=(paper.experiment, smaller_batch))
    c.name = "qwen3_0_6b_turnsight"
    return c
