"""Loading the Qwen3 tokenizer and looking up the chat format's special tokens.

Everything here works from token *strings* (``<|im_start|>``, ...): ids are looked up in the
loaded vocabulary, never hard-coded, so a tokenizer with a different layout fails loudly
instead of silently producing wrong masks.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

_REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Load a Hugging Face fast tokenizer from a folder.

    The folder must hold ``tokenizer.json`` (the vocabulary, merges and added tokens) and
    ``tokenizer_config.json`` (special-token roles and the chat template).

    Returns:
      a ``transformers`` fast tokenizer (a ``PreTrainedTokenizerFast`` / ``TokenizersBackend``
      subclass such as ``Qwen2Tokenizer``).

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
    # Imported lazily: transformers takes seconds to import and most of this package never needs it.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(f"tokenizer in {folder!r} loaded as a slow tokenizer ({type(tokenizer).__name__})")
    return tokenizer


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
    """Token ids of ``text`` with no BOS/EOS added; control tokens in the text become their ids."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``text`` and each token's (start, end) character offsets in ``text``.

    Byte-level BPE can split one character over several tokens; those tokens share the
    character's offsets.
    """
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]


def char_span_to_token_span(
    offsets: Sequence[tuple[int, int]], start: int, end: int
) -> tuple[int, int]:
    """Smallest token span [i, j) covering the characters [start, end).

    A token that straddles the boundary (e.g. a "\\n\\n" merging the template's newline with a
    result's leading newline) is included. An empty character range gives an empty token span
    placed at the first token ending after ``start``.
    """
    i = 0
    while i < len(offsets) and offsets[i][1] <= start:
        i += 1
    if end <= start:
        return i, i
    j = i
    while j < len(offsets) and offsets[j][0] < end:
        j += 1
    return i, j
