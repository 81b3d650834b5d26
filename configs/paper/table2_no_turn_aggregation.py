"""Table 2: TurnSight, w/o turn aggregation (token-level selection and weighting); everything else as configs/paper/table1_turnsight_8b.py.

Paper (Table 2, Qwen3-8B): FTRL Avg 43.23; the full method 46.92.

    python -m turnsight_jax.train --config configs/paper/table2_no_turn_aggregation.py \
        --config.model.hf_path=/path/to/Qwen3-8B \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

import pathlib

from turnsight_jax.config import load_config_module

paper = load_config_module(pathlib.Path(__file__).with_name("_paper.py"))


def change(c):
    c.rl.aggregation = "token"


def get_config():
    return paper.ablation("no_turn_aggregation", change)
