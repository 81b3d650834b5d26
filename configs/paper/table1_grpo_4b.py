"""Table 1: GRPO (outcome reward, group-normalised), Qwen3-4B, released-code conventions (configs/paper/_paper.py).

Paper: not quoted (read it off the paper's Table 1).

    python -m turnsight_jax.train --config configs/paper/table1_grpo_4b.py \
        --config.model.hf_path=/path/to/Qwen3-4B \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

import pathlib

from turnsight_jax.config import load_config_module

paper = load_config_module(pathlib.Path(__file__).with_name("_paper.py"))


def get_config():
    return paper.row("grpo", "4b")
