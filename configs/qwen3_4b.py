"""Qwen3-4B with TurnSight on MatchTIR, the paper's setting (SPEC §2); see configs/qwen3_8b.py."""

import importlib.util
import pathlib


def get_config():
    spec = importlib.util.spec_from_file_location("qwen3_8b", pathlib.Path(__file__).with_name("qwen3_8b.py"))
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    c = base.get_config()
    c.name = "qwen3_4b_turnsight"
    c.model.preset = "qwen3-4b"
    return c
