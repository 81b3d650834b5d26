"""Loading the Qwen3 tokenizer and looking up the chat format's special tokens.

Everything here works from token *strings* (``<|im_start|>``, ...): ids are looked up in the
loaded vocabulary, never hard-coded, so a tokenizer with a different layout fails loudly
instead of silently producing wrong masks.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
from typing import Any, Sequence

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

_REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json")

# Lone surrogate code points: a JSON escape such as "\ud800" in model output, a tool's reply or a
# dataset row decodes to one, and the tokenizer (TypeError) and every UTF-8 writer reject it.
_SURROGATES = re.compile("[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """``text`` with each lone surrogate replaced by U+FFFD, one for one: its length and every
    character offset are unchanged, so spans computed on the raw text stay valid."""
    return _SURROGATES.sub("\ufffd", text) if _SURROGATES.search(text) else text


class FastTokenizer:
    """A Hugging Face ``tokenizer.json`` run by the ``tokenizers`` library, without ``transformers``.

    Importing ``transformers`` costs seconds (it imports torch when torch is installed), and every
    CLI start paid it for the handful of calls the package makes. This class offers exactly those,
    with the semantics of the ``transformers`` fast tokenizer built from the same folder (tested
    token for token in tests/test_chat_tokenizer.py): ``encode``/``decode``/``__call__`` with
    ``add_special_tokens``/``skip_special_tokens``, the token/id lookups and ``len`` (the
    vocabulary with added tokens). No BOS/EOS is ever added by Qwen3's ``tokenizer.json``, and its
    config sets ``clean_up_tokenization_spaces`` false, so decoding is the library's decode.
    """

    is_fast = True

    def __init__(self, folder: str | os.PathLike[str]):
        import json

        self.name_or_path = os.fspath(folder)
        self._json = os.path.join(self.name_or_path, "tokenizer.json")
        self._digest = _file_digest(self._json)
        self._tk = _rust_tokenizer(self._json, self._digest, False)
        self._specials: tuple[str, ...] | None = None
        self._plain = None
        with open(os.path.join(self.name_or_path, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        if config.get("clean_up_tokenization_spaces"):
            raise ValueError(f"tokenizer in {self.name_or_path!r} sets clean_up_tokenization_spaces, "
                             "which this loader does not implement")
        self.chat_template = config.get("chat_template")
        self.eos_token = config.get("eos_token")
        self.pad_token = config.get("pad_token")

    def __len__(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, {len(self)} tokens)"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = False, return_offsets_mapping: bool = False):
        enc = self._tk.encode(text, add_special_tokens=add_special_tokens)
        out = {"input_ids": enc.ids, "attention_mask": enc.attention_mask}
        if return_offsets_mapping:
            out["offset_mapping"] = enc.offsets
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def special_token_texts(self) -> tuple[str, ...]:
        """Spellings of the special added tokens (``<|im_end|>``, ...; not ``<tool_call>``)."""
        if self._specials is None:
            self._specials = tuple(t.content for t in self._tk.get_added_tokens_decoder().values() if t.special)
        return self._specials

    def encode_plain(self, text: str) -> list[int]:
        """Ids of ``text`` with special-token spellings tokenised as ordinary text."""
        if self._plain is None:  # a second instance: toggling the shared one is not thread-safe
            self._plain = _rust_tokenizer(self._json, self._digest, True)
        return self._plain.encode(text, add_special_tokens=False).ids

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def convert_ids_to_tokens(self, tid: int) -> str | None:
        return self._tk.id_to_token(int(tid))


def load_tokenizer(path: str | os.PathLike[str]) -> FastTokenizer:
    """Load a Hugging Face fast tokenizer from a folder.

    The folder must hold ``tokenizer.json`` (the vocabulary, merges and added tokens) and
    ``tokenizer_config.json`` (special-token roles and the chat template).

    Raises:
      FileNotFoundError: naming the folder and the missing file(s).
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"tokenizer folder {folder!r} does not exist")
    missing = [name for name in _REQUIRED_FILES if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        raise FileNotFoundError(
            f"tokenizer folder {folder!r} is missing {', '.join(missing)} "
            f"(need {' and '.join(_REQUIRED_FILES)})"
        )
    return FastTokenizer(folder)


def _file_digest(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.blake2b(f.read(), digest_size=16).hexdigest()


_RUST_TOKENIZERS: dict[tuple[str, bool], Any] = {}


def _rust_tokenizer(path: str, digest: str, plain: bool):
    """One `tokenizers.Tokenizer` per tokenizer.json content in a process (`plain`: the variant
    that tokenises special-token spellings as text). Building one from Qwen3's 11 MB file takes
    ~0.6 s, and a process that runs several trainings (a notebook, a study, the tests' trainer
    process) reads the same file from each run's folder. Keyed by the content's digest, not the
    path, so an edited file is read again; encoding never mutates the instance, so callers share
    it."""
    key = (digest, plain)
    if key not in _RUST_TOKENIZERS:
        from tokenizers import Tokenizer

        if len(_RUST_TOKENIZERS) >= 8:
            _RUST_TOKENIZERS.pop(next(iter(_RUST_TOKENIZERS)))
        tk = Tokenizer.from_file(path)
        tk.encode_special_tokens = plain
        _RUST_TOKENIZERS[key] = tk
    return _RUST_TOKENIZERS[key]


def check_vocab_fits(tokenizer: Any, vocab_size: int) -> None:
    """Raise when the tokenizer can emit ids the model's embedding table has no row for.

    Qwen3 checkpoints pad the embedding (151,936 rows) beyond the tokenizer (151,669 tokens),
    which is fine; the reverse would index out of bounds (silently clamped under jit).
    """
    n = len(tokenizer)
    if n > vocab_size:
        raise ValueError(
            f"tokenizer has {n} tokens but the model's embedding has only {vocab_size} rows; "
            f"ids {vocab_size}..{n - 1} would be out of range"
        )


def token_id(tokenizer: Any, token: str) -> int:
    """Id of a single token given by its string (e.g. ``"<|im_end|>"``).

    Raises:
      KeyError: the token is not a single entry of the vocabulary.
    """
    # convert_tokens_to_ids maps unknown strings to the unk id (or None): check the round trip.
    # (get_vocab() would be exact too but rebuilds a 150k-entry dict on every call.)
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tokenizer.convert_ids_to_tokens(int(tid)) != token:
        raise KeyError(f"token {token!r} is not in the tokenizer's vocabulary")
    return int(tid)


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """Ids of the chat-format control tokens (int Python scalars)."""

    im_start: int
    im_end: int
    endoftext: int


def special_ids(tokenizer: Any) -> SpecialIds:
    """Look up ``<|im_start|>``, ``<|im_end|>`` and ``<|endoftext|>`` by string."""
    return SpecialIds(
        im_start=token_id(tokenizer, IM_START),
        im_end=token_id(tokenizer, IM_END),
        endoftext=token_id(tokenizer, ENDOFTEXT),
    )


def im_start_id(tokenizer: Any) -> int:
    return token_id(tokenizer, IM_START)


def im_end_id(tokenizer: Any) -> int:
    return token_id(tokenizer, IM_END)


def endoftext_id(tokenizer: Any) -> int:
    return token_id(tokenizer, ENDOFTEXT)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` with no BOS/EOS added; control tokens in the text become their ids.
    Lone surrogates are replaced first (`clean_text`)."""
    return list(tokenizer.encode(clean_text(text), add_special_tokens=False))


def special_token_texts(tokenizer: Any) -> tuple[str, ...]:
    """Spellings of the tokenizer's special (control) tokens: ``<|im_start|>``, ``<|im_end|>``, ..."""
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.special_token_texts
    return tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)  # transformers


def encode_plain(tokenizer: Any, text: str) -> list[int]:
    """Ids of ``text`` (surrogates replaced) with every special-token spelling tokenised as the
    ordinary characters it is made of: for untrusted text (tool results) that must never become a
    control token of the context."""
    text = clean_text(text)
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.encode_plain(text)
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def encode_with_plain_spans(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]], marks: Sequence[int] = ()
                            ) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """Token ids of ``text`` whose characters in ``spans`` (sorted, disjoint [a, b): untrusted
    text such as tool results) are tokenised as plain text (`encode_plain`).

    Returns (ids, token spans of ``spans``, token index of each char position in ``marks``, which
    must lie outside the spans). When no span spells a special token, this is the whole-string
    encode (the template's exact ids). Otherwise the text is tokenised piece by piece at the span
    boundaries: a spelled ``<|im_end|>`` stays text, and BPE merges across a span's boundary (a
    result's leading newline with the template's) may differ from the whole-string ids.
    """
    specials = special_token_texts(tokenizer)
    if not any(sp in text[a:b] for a, b in spans for sp in specials):
        ids, offsets = encode_with_offsets(tokenizer, text)
        return (ids, char_spans_to_token_spans(offsets, spans),
                [char_span_to_token_span(offsets, m, m + 1)[0] for m in marks])
    ids: list[int] = []
    token_spans: list[tuple[int, int]] = []
    at: dict[int, int] = {}
    cuts = [0, *[c for span in spans for c in span], len(text)]
    for k in range(len(cuts) - 1):
        lo, hi = cuts[k], cuts[k + 1]
        if k % 2:  # a span
            piece = encode_plain(tokenizer, text[lo:hi])
            token_spans.append((len(ids), len(ids) + len(piece)))
        else:
            piece, offsets = encode_with_offsets(tokenizer, text[lo:hi]) if hi > lo else ([], [])
            for m in marks:
                if lo <= m < hi:
                    at[m] = len(ids) + char_span_to_token_span(offsets, m - lo, m - lo + 1)[0]
        ids += piece
    missing = [m for m in marks if m not in at]
    if missing:
        raise ValueError(f"marks {missing} fall inside a span or outside the text")
    return ids, token_spans, [at[m] for m in marks]


class SegmentEncoder:
    """``encode`` for many texts that share ``<|im_start|>``-delimited segments, with a cache.

    A multi-step harness re-renders the whole history every step, and the tasks of a benchmark
    share their tool block: the same segments are tokenised over and over (BFCL's gold replay
    encodes 26 M characters of which 6 M are distinct). Exact, not approximate: the tokenizer
    splits added tokens off before normalisation and BPE, so the ids of a text are the ids of its
    pieces between ``<|im_start|>`` tokens, concatenated (tested against a full encode).
    Least-recently-used segments beyond ``max_segments`` are dropped.
    """

    def __init__(self, tokenizer: Any, max_segments: int = 4096):
        self.tokenizer = tokenizer
        self.start_id = token_id(tokenizer, IM_START)
        self.max_segments = max_segments
        self._cache: collections.OrderedDict[str, list[int]] = collections.OrderedDict()

    def _segment(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = encode(self.tokenizer, text)
            self._cache[text] = ids
            if len(self._cache) > self.max_segments:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(text)
        return ids

    def __call__(self, text: str) -> list[int]:
        """Token ids of ``text``, equal to ``encode(tokenizer, text)``."""
        pieces = text.split(IM_START)
        ids = list(self._segment(pieces[0])) if pieces[0] else []
        for piece in pieces[1:]:
            ids.append(self.start_id)
            if piece:
                ids.extend(self._segment(piece))
        return ids


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``text`` and each token's (start, end) character offsets in ``text``.

    Byte-level BPE can split one character over several tokens; those tokens share the
    character's offsets.
    """
    enc = tokenizer(clean_text(text), add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]


def char_span_to_token_span(
    offsets: Sequence[tuple[int, int]], start: int, end: int
) -> tuple[int, int]:
    """Smallest token span [i, j) covering the characters [start, end).

    A token that straddles the boundary (e.g. a "\\n\\n" merging the template's newline with a
    result's leading newline) is included. An empty character range gives an empty token span
    placed at the first token ending after ``start``.
    """
    return _span_from(offsets, 0, start, end)


def _span_from(offsets: Sequence[tuple[int, int]], i: int, start: int, end: int) -> tuple[int, int]:
    """`char_span_to_token_span`, scanning from token `i` (every token before it ends at or
    before `start`)."""
    while i < len(offsets) and offsets[i][1] <= start:
        i += 1
    if end <= start:
        return i, i
    j = i
    while j < len(offsets) and offsets[j][0] < end:
        j += 1
    return i, j


def char_spans_to_token_spans(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """`char_span_to_token_span` of each of ``spans`` (sorted by start, disjoint), in one pass:
    each span's scan starts where the previous span's started, so the cost is linear in tokens
    plus spans (not tokens x spans: a turn of thousands of tool results)."""
    out = []
    i = prev = 0
    for start, end in spans:
        if start < prev:
            raise ValueError(f"spans must be sorted by start: {start} after {prev}")
        prev = start
        i, j = _span_from(offsets, i, start, end)
        out.append((i, j))
    return out
