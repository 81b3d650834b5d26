"""MatchTIR's own released training recipe (quchangle1/MatchTIR `Scripts/run.sh` with Qwen3-4B),
Qwen3-4B: configs/released/matchtir_8b.py on the 4B model. NOT a paper cell (the paper's Table 1
row is configs/paper/table1_matchtir_4b.py). Its 8 x 80 GB dry run fits (train step 60.11 GiB,
rollouts 61.47 GiB per device); the 8B recipe's does not (its docstring).

    python -m turnsight_jax.train --config configs/released/matchtir_4b.py \
        --config.model.hf_path=/path/to/Qwen3-4B \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

import pathlib

from turnsight_jax.config import load_config_module

recipe = load_config_module(pathlib.Path(__file__).with_name("matchtir_8b.py"))


def get_config():
    return recipe.build("4b")
