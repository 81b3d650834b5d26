"""Tokenizer loading, vocabulary checks and special-token lookups."""

from __future__ import annotations

import shutil

import pytest

from turnsight_jax.chat import tokenizer as tl
from turnsight_jax.chat.trajectory import QWEN3_IM_END_ID, QWEN3_IM_START_ID


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir):
    return tl.load_tokenizer(qwen3_tokenizer_dir)


def test_load_and_special_ids(tok):
    assert tok.is_fast
    assert len(tok) == 151669
    ids = tl.special_ids(tok)
    assert (ids.im_start, ids.im_end, ids.endoftext) == (151644, 151645, 151643)
    assert tl.im_start_id(tok) == QWEN3_IM_START_ID
    assert tl.im_end_id(tok) == QWEN3_IM_END_ID
    assert tl.endoftext_id(tok) == 151643
    assert tl.encode(tok, "<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]


def test_missing_files_are_named(tmp_path, qwen3_tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tl.load_tokenizer(tmp_path / "nope")
    shutil.copy(qwen3_tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="missing tokenizer_config.json"):
        tl.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="missing tokenizer.json, tokenizer_config.json"):
        tl.load_tokenizer(tmp_path)


def test_check_vocab_fits(tok):
    tl.check_vocab_fits(tok, 151936)  # Qwen3's padded embedding
    tl.check_vocab_fits(tok, 151669)
    with pytest.raises(ValueError, match="151669 tokens .* only 151668 rows"):
        tl.check_vocab_fits(tok, 151668)


def test_unknown_token_raises(tok):
    with pytest.raises(KeyError, match="<\\|not_a_token\\|>"):
        tl.token_id(tok, "<|not_a_token|>")


def test_offsets_and_char_span_to_token_span(tok):
    text = "ab 中文\n\nxyz"
    ids, offsets = tl.encode_with_offsets(tok, text)
    assert ids == tl.encode(tok, text)
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    i, j = tl.char_span_to_token_span(offsets, text.index("xyz"), len(text))
    assert tok.decode(ids[i:j]) == "xyz"
    i, j = tl.char_span_to_token_span(offsets, 0, 2)
    assert tok.decode(ids[i:j]) == "ab"
    assert tl.char_span_to_token_span(offsets, 3, 3)[0] == tl.char_span_to_token_span(offsets, 3, 3)[1]
