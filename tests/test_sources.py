"""turnsight_jax.sources: one registry of task sources for training, warm-start and evaluation."""

from __future__ import annotations

import json

import pytest

from _ftrl_rows import GT_GOLD, gt_row, gt_rows
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


def test_sources_declare_the_task_fields_they_provide():
    assert sources.get_source("builtin").provides == ("gold_calls",)
    assert sources.get_source("ftrl").provides == ("gold_calls",)
    assert sources.get_source("toolhop").provides == ()
    assert sources.providers("gold_calls") == ["builtin", "ftrl"]  # trainable ones only
    cfg = default_config()
    assert sources.training_needs(cfg) == ()  # turnsight over grpo: the outcome reward only
    cfg.rl.base = "matchtir"
    assert sources.training_needs(cfg) == ("gold_calls",)
    cfg.rl.method = "toolrl"
    assert sources.training_needs(cfg) == ("gold_calls",)


def _ftrl_train_cfg(path, method="matchtir", base="grpo"):
    cfg = default_config()
    cfg.data.source, cfg.data.path = "ftrl", str(path)
    cfg.rl.method, cfg.rl.base = method, base
    return cfg


def test_training_rows_without_ground_truth_are_refused(tmp_path):
    rows = gt_rows() + [gt_row(2, None)]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # A method whose rewards read gold calls: the row is named by file, line (1-based) and column.
    for method, base in (("matchtir", "grpo"), ("turnsight", "matchtir"), ("toolrl", "grpo")):
        with pytest.raises(ValueError, match=r"train.jsonl: line 3: key 'ground_truth' is missing: the training"):
            sources.load_tasks(_ftrl_train_cfg(jsonl, method, base), "train")
    # Methods that do not read them load every row; so does the held-out split under matchtir.
    tasks = sources.load_tasks(_ftrl_train_cfg(jsonl, "grpo"), "train")
    assert [t.gold_calls for t in tasks] == [*GT_GOLD, None]
    cfg = _ftrl_train_cfg(jsonl)
    cfg.data.eval_source, cfg.data.eval_path = "ftrl", str(jsonl)
    assert len(sources.load_tasks(cfg, "eval")) == 3
    # Rows that all carry ground_truth load under matchtir with their gold calls.
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in gt_rows()))
    assert [t.gold_calls for t in sources.load_tasks(_ftrl_train_cfg(jsonl), "train")] == GT_GOLD
    # Parquet: the row index (0-based) and a null value.
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table_rows = gt_rows()  # row 0: JSON text
    table_rows[1]["ground_truth"] = None
    pq.write_table(pa.Table.from_pylist(table_rows), tmp_path / "train.parquet")
    with pytest.raises(ValueError, match=r"train.parquet: row 1: key 'ground_truth' is null"):
        sources.load_tasks(_ftrl_train_cfg(tmp_path / "train.parquet"), "train")


def test_environments_come_from_the_registry():
    with sources.make_env("builtin", num_workers=1, timeout_s=5.0) as env:
        assert type(env).__name__ == "FTRLEnv"


def test_the_tool_output_cap_is_a_config_value():
    """rollout.max_tool_output_chars reaches the executor of the built-in sources' environments
    (which then own and close it); the executor's default builds the environment as registered; a
    source whose environment cannot take another value is refused."""
    from turnsight_jax.envs.executor import ToolRequest

    with sources.make_env("builtin", num_workers=1, timeout_s=5.0, max_output_chars=100) as env:
        assert env.executor.limits.max_output_chars == 100
        out = env.executor.run(ToolRequest("f", "def f(x=None):\n    return 'y' * 1000", {"x": 1}))
        assert out == "y" * 100 + "... [output truncated: 900 more characters]"
    assert env.executor._closed  # closed with its environment
    plain = sources.TaskSource("plain_env_source", lambda workers, timeout: object(), trainable=False)
    sources.register_source(plain)
    try:
        assert sources.make_env("plain_env_source", max_output_chars=16_384) is not None  # the default: as registered
        assert not sources.check_output_cap("plain_env_source", None)
        with pytest.raises(ConfigError, match="does not take rollout.max_tool_output_chars=100"):
            sources.make_env("plain_env_source", max_output_chars=100)
    finally:
        del sources.SOURCES["plain_env_source"]
