"""Qwen3-4B with TurnSight on MatchTIR, the paper's setting (docs/spec.md §2); see configs/qwen3_8b.py."""

import pathlib

from turnsight_jax.config import load_config_file


def get_config():
    c = load_config_file(pathlib.Path(__file__).with_name("qwen3_8b.py"))
    c.name = "qwen3_4b_turnsight"
    c.model.preset = "qwen3-4b"
    return c
