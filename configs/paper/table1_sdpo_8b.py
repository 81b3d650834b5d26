"""Table 1: SDPO over GRPO (top-K KL to the current policy shown a successful sibling rollout), Qwen3-8B, released-code conventions (configs/paper/_paper.py); what was chosen
where the method's paper is silent: docs/reproducing.md.

Paper: not quoted (read it off the paper's Table 1).

    python -m turnsight_jax.train --config configs/paper/table1_sdpo_8b.py \
        --config.model.hf_path=/path/to/Qwen3-8B \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

import pathlib

from turnsight_jax.config import load_config_module

paper = load_config_module(pathlib.Path(__file__).with_name("_paper.py"))


def get_config():
    return paper.row("sdpo", "8b")
