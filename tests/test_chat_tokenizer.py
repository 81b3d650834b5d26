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


def test_a_process_builds_each_tokenizer_content_once(tmp_path, qwen3_tokenizer_dir):
    """The Rust tokenizer is cached by tokenizer.json's content: a copy in another folder (each
    run's folder holds one) shares it and encodes the same, an edited file is built again."""
    import json

    first = tl.load_tokenizer(qwen3_tokenizer_dir)
    copy = shutil.copytree(qwen3_tokenizer_dir, tmp_path / "copy")
    second = tl.load_tokenizer(copy)
    assert second._tk is first._tk and second.name_or_path == str(copy)
    assert second.encode_plain("<|im_end|>") == first.encode_plain("<|im_end|>") != first.encode("<|im_end|>")
    spec = json.loads((copy / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|im_end|>"]
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    edited = tl.load_tokenizer(copy)
    assert edited._tk is not first._tk and edited.convert_tokens_to_ids("<|im_end|>") is None
    assert tl.load_tokenizer(qwen3_tokenizer_dir).convert_tokens_to_ids("<|im_end|>") == QWEN3_IM_END_ID


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


# Texts of every kind the package encodes or decodes: chat control tokens, tool-call JSON, think
# blocks, tool results with unicode, whitespace runs, digits, code, and added tokens adjacent to text.
CORPUS = [
    "",
    "<|im_start|>user\nWho directed Heat?<|im_end|>\n<|im_start|>assistant\n",
    '<think>\nI should call the tool.\n</think>\n\n<tool_call>\n{"name": "director_of", "arguments": {"movie": "Heat"}}\n</tool_call>',
    "<tool_response>\n{'director': 'Michael Mann', 'year': 1995}\n</tool_response>",
    "  leading spaces,\ttabs\t and trailing   \n\n\n",
    "晴天 🌞 Ünïcödé — naïve café; 中文分词测试 😀👍🏽",
    "12345678901234567890 3.14159 -0.5e-10 0x1F",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "<|endoftext|><|im_end|>text<|im_start|>",
    "<answer>Michael Mann</answer>",
    "\u0000\u200b zero\u00a0width and nbsp",
]


def test_package_tokenizer_equals_transformers(tok, qwen3_tokenizer_dir):
    """`load_tokenizer` (the `tokenizers` library, no transformers import) gives the same ids,
    offsets and text as the transformers fast tokenizer of the same folder."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)
    assert isinstance(tok, tl.FastTokenizer) and len(tok) == len(hf) == 151669
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == list(hf.encode(text, add_special_tokens=False)), text
        ours, theirs = tok(text, return_offsets_mapping=True), hf(text, add_special_tokens=False,
                                                                  return_offsets_mapping=True)
        assert ours["input_ids"] == list(theirs["input_ids"])
        assert [tuple(o) for o in ours["offset_mapping"]] == [tuple(o) for o in theirs["offset_mapping"]], text
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    rng = __import__("numpy").random.default_rng(0)
    some = [int(i) for i in rng.integers(0, len(tok), 400)] + list(range(151640, 151669))
    assert tok.decode(some) == hf.decode(some)  # arbitrary id sequences, incl. partial UTF-8 bytes
    for i in some[:50] + list(range(151640, 151669)):
        assert tok.convert_ids_to_tokens(i) == hf.convert_ids_to_tokens(i)
        assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(i)) == i
    assert tok.convert_tokens_to_ids("not-a-token-at-all") is None


def test_segment_encoder_equals_a_full_encode_and_reuses_segments(tok):
    """Texts split at <|im_start|> anywhere (first, last, doubled, inside text that BPE would
    merge across), Unicode that NFC normalises, and segments repeated across texts."""
    tools = '<|im_start|>system\n# Tools\n{"name": "f", "description": "caf\u0065\u0301 \u00e9 \u4f60\u597d"}<|im_end|>\n'
    texts = [
        tools + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        tools + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n  spaced  \n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        "no special token at all  \n\n",
        "<|im_start|><|im_start|>x<|im_start|>",
        "ab<|im_start|>cd",
        "",
    ]
    enc = tl.SegmentEncoder(tok, max_segments=3)
    for text in texts + texts[::-1]:
        assert enc(text) == tl.encode(tok, text), text
    assert len(enc._cache) == 3  # bounded
    calls = []
    enc = tl.SegmentEncoder(tok)
    real = enc.tokenizer
    class Counting:  # counts the characters that reach BPE
        def encode(self, text, add_special_tokens=False):
            calls.append(text)
            return real.encode(text, add_special_tokens=add_special_tokens)
    enc.tokenizer = Counting()
    enc(texts[0]), enc(texts[1])
    assert calls.count('system\n# Tools\n{"name": "f", "description": "caf\u0065\u0301 \u00e9 \u4f60\u597d"}<|im_end|>\n') == 1
    assert sum(map(len, calls)) < len(texts[0]) + len(texts[1]) - len(tools)
