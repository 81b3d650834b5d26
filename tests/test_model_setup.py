"""turnsight_jax.model_setup: tokenizer folder rules, vocabulary fit, model build from a preset."""

from __future__ import annotations

import pathlib

import jax
import pytest
from flax import nnx

from turnsight_jax import model_setup
from turnsight_jax.assets import default_tokenizer_dir
from turnsight_jax.config import default_config
from turnsight_jax.errors import ConfigError
from turnsight_jax.models.sharding import make_mesh


def test_tokenizer_folder_rules(tmp_path):
    cfg = default_config()
    assert model_setup.tokenizer_dir(cfg) == default_tokenizer_dir()  # bundled
    hf = tmp_path / "hf"
    hf.mkdir()
    assert model_setup.tokenizer_dir(cfg) == default_tokenizer_dir()
    cfg.model.hf_path = str(hf)
    assert model_setup.tokenizer_dir(cfg) == default_tokenizer_dir()  # a folder without tokenizer.json
    (hf / "tokenizer.json").write_text("{}")
    assert model_setup.tokenizer_dir(cfg) == hf  # the HF folder's own
    cfg.tokenizer_path = str(tmp_path / "explicit")
    assert model_setup.tokenizer_dir(cfg) == pathlib.Path(tmp_path / "explicit")  # explicit wins


def test_vocabulary_fit_and_unknown_preset():
    cfg = default_config()
    tok, path = model_setup.setup_tokenizer(cfg, 151936)
    assert path == default_tokenizer_dir() and len(tok) == 151_669
    with pytest.raises(ConfigError, match="does not fit the model"):
        model_setup.setup_tokenizer(cfg, 1000)
    cfg.model.preset = "qwen3-1b"
    with pytest.raises(ConfigError, match="unknown Qwen3 preset 'qwen3-1b'"):
        model_setup.model_config(cfg)


def test_build_model_initialises_into_the_mesh_shardings():
    cfg = default_config()
    mesh = make_mesh(1, -1, 1)  # every device on fsdp (8 fake CPU devices in the tests)
    model = model_setup.build_model(cfg, mesh, seed=0)
    leaves = jax.tree.leaves(nnx.state(model))
    assert sum(x.size for x in leaves) == model_setup.model_config(cfg).num_params()
    if jax.device_count() > 1:  # the embedding is split over fsdp, not whole on one device
        assert max(len(x.sharding.device_set) for x in leaves) == jax.device_count()
