"""Table 2: TurnSight, temporal coverage: the first 5 turns; everything else as configs/paper/table1_turnsight_8b.py.

Paper (Table 2, Qwen3-8B): FTRL Avg 44.56; the full method 46.92.

    python -m turnsight_jax.train --config configs/paper/table2_first_5.py \
        --config.model.hf_path=/path/to/Qwen3-8B \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

import pathlib

from turnsight_jax.config import load_config_module

paper = load_config_module(pathlib.Path(__file__).with_name("_paper.py"))


def change(c):
    c.rl.turns = "first:5"


def get_config():
    return paper.ablation("first_5", change)
