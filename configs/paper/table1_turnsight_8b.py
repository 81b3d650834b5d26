"""Table 1: TurnSight on MatchTIR (the paper's method), Qwen3-8B, released-code conventions (configs/paper/_paper.py).

Paper (Table 1, Qwen3-8B): overall 42.02 (the mean of FTRL Avg 46.92, BFCL Avg 37.56 and ToolHop 41.58).

    python -m turnsight_jax.train --config configs/paper/table1_turnsight_8b.py \
        --config.model.hf_path=/path/to/Qwen3-8B \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

import pathlib

from turnsight_jax.config import load_config_module

paper = load_config_module(pathlib.Path(__file__).with_name("_paper.py"))


def get_config():
    return paper.row("turnsight", "8b")
