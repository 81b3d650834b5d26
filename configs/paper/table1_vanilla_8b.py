"""Table 1: the untrained model (vanilla evaluation), Qwen3-8B, released-code conventions (configs/paper/_paper.py).

Paper (Table 1, Qwen3-8B): BFCL base 46.5 (docs/spec.md §2); its other cells not quoted (read them off the paper's Table 1).

train.steps = 0: the run evaluates the held-out FTRL tasks and exports; BFCL and ToolHop of the
same model: `python -m turnsight_jax.evaluate --hf /path/to/Qwen3-8B --benchmarks ftrl,bfcl,toolhop ...`
(docs/evaluation.md).

    python -m turnsight_jax.train --config configs/paper/table1_vanilla_8b.py \
        --config.model.hf_path=/path/to/Qwen3-8B \
        --config.data.path=/path/to/ftrl/train.parquet --config.data.eval_path=/path/to/ftrl/test.parquet
"""

import pathlib

from turnsight_jax.config import load_config_module

paper = load_config_module(pathlib.Path(__file__).with_name("_paper.py"))


def get_config():
    return paper.row("vanilla", "8b")
