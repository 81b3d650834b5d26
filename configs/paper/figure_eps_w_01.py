"""Figures 3-6: TurnSight, the ε_w sweep: ε_w = 0.1 (main run: 0.5); everything else as configs/paper/table1_turnsight_8b.py.

Paper: the figure's values are not quoted in docs/spec.md (read them off the paper's figure); this grid is ours.

    python -m turnsight_jax.train --config configs/paper/figure_eps_w_01.py \
        --config.model.hf_path=/path/to/Qwen3-8B \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

import pathlib

from turnsight_jax.config import load_config_module

paper = load_config_module(pathlib.Path(__file__).with_name("_paper.py"))


def change(c):
    c.rl.eps_w = 0.1


def get_config():
    return paper.ablation("eps_w_01", change)
