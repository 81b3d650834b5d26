"""The bundled Qwen3 tokenizer: loads from a fresh clone, and equals ../shared's fixture files."""

from __future__ import annotations

import json

from conftest import shared_path

from turnsight_jax.assets import default_tokenizer, default_tokenizer_dir


def test_bundled_tokenizer_loads_with_the_qwen3_vocabulary():
    tok = default_tokenizer()
    assert len(tok) == 151_669
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    template = json.loads((default_tokenizer_dir() / "tokenizer_config.json").read_text())["chat_template"]
    assert "<tool_call>" in template and "enable_thinking" in template


def test_bundled_tokenizer_files_equal_the_shared_fixture():
    fixture = shared_path("qwen3-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (default_tokenizer_dir() / name).read_bytes() == (fixture / name).read_bytes(), name
