"""Figure 6: TurnSight, the ε_w sweep: ε_w = 0.9 (the paper's grid {0.1, 0.2, 0.5, 0.8, 0.9}; ε_w = 0.5 is the full
method, configs/paper/table1_turnsight_8b.py); everything else as that config.

Paper: not quoted (read this point off the paper's Figure 6); the full method's FTRL Avg is 46.92.

    python -m turnsight_jax.train --config configs/paper/figure_eps_w_09.py \
        --config.model.hf_path=/path/to/Qwen3-8B \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

import pathlib

from turnsight_jax.config import load_config_module

paper = load_config_module(pathlib.Path(__file__).with_name("_paper.py"))


def change(c):
    c.rl.eps_w = 0.9


def get_config():
    return paper.ablation("eps_w_09", change)
