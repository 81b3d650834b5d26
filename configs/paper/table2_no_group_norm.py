"""Table 2: TurnSight, w/o prompt-group normalisation (raw selected gap); everything else as configs/paper/table1_turnsight_8b.py.

Paper (Table 2, Qwen3-8B): FTRL Avg 43.65; the full method 46.92.

    python -m turnsight_jax.train --config configs/paper/table2_no_group_norm.py \
        --config.model.hf_path=/path/to/Qwen3-8B \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

import pathlib

from turnsight_jax.config import load_config_module

paper = load_config_module(pathlib.Path(__file__).with_name("_paper.py"))


def change(c):
    c.rl.group_norm = False


def get_config():
    return paper.ablation("no_group_norm", change)
