"""Qwen3-4B with TurnSight on MatchTIR, the paper's setting (docs/spec.md §2): configs/qwen3_8b.py's
experiment on the Qwen3-4B model layer."""

import pathlib

from turnsight_jax.config import layered, load_config_module, model_file


def get_config():
    paper = load_config_module(pathlib.Path(__file__).with_name("qwen3_8b.py"))
    c = layered(model=model_file(__file__, "qwen3_4b"), experiment=paper.experiment)
    c.name = "qwen3_4b_turnsight"
    return c
