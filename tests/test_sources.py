"""turnsight_jax.sources: one registry of task sources for training, warm-start and evaluation."""

from __future__ import annotations

import json

import pytest

from turnsight_jax import sources
from turnsight_jax.config import default_config
from turnsight_jax.errors import ConfigError


def test_registered_sources():
    assert set(sources.SOURCES) >= {"builtin", "ftrl", "toolhop", "bfcl"}
    assert not sources.get_source("builtin").needs_path and sources.get_source("ftrl").needs_path
    assert not sources.SOURCES["bfcl"].trainable
    with pytest.raises(ConfigError, match="data.source must be one of builtin, ftrl, toolhop, got 'bfcl'"):
        sources.get_source("bfcl", trainable=True)
    with pytest.raises(ConfigError, match="got 'nope'"):
        sources.get_source("nope")
    with pytest.raises(ValueError, match="already registered"):
        sources.register_source(sources.SOURCES["ftrl"])


def test_builtin_train_and_heldout_tasks_are_disjoint_and_seeded():
    cfg = default_config()
    cfg.data.num_train, cfg.data.num_eval = 40, 20
    train = sources.load_tasks(cfg, "train")
    held = sources.load_tasks(cfg, "eval")
    assert len(train) == 40 and len(held) == 20
    assert {t.task_id for t in train}.isdisjoint({t.task_id for t in held})
    assert [t.messages for t in sources.load_tasks(cfg, "train")] == [t.messages for t in train]  # same seed
    assert all(t.gold_calls for t in train)  # built-in tasks carry their gold chains


def test_file_sources_need_a_path_and_cap_heldout_tasks(tmp_path):
    cfg = default_config()
    cfg.data.source = "ftrl"
    with pytest.raises(ConfigError, match="data.path is required for source 'ftrl'"):
        sources.load_tasks(cfg, "train")
    tool = {"type": "function", "function": {"name": "t", "description": "d",
                                             "parameters": {"type": "object", "properties": {}}}}
    row = {"messages": [{"role": "user", "content": "q"}], "tools": json.dumps([tool]),
           "codes": json.dumps({"t": "def t():\n    return 'x'\n"}), "unsolved_set": json.dumps({"t": ["x"]}),
           "answer": "x", "data_source": "self/single_hop"}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for _ in range(5)))
    cfg.data.eval_source, cfg.data.eval_path, cfg.data.num_eval = "ftrl", str(path), 3
    assert len(sources.load_tasks(cfg, "eval")) == 3


def test_environments_come_from_the_registry():
    with sources.make_env("builtin", num_workers=1, timeout_s=5.0) as env:
        assert type(env).__name__ == "FTRLEnv"
