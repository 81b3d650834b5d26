"""Blocks of a fixed token length: the equal-length control of the teacher's context.

The paper's source ablation (tool results vs tool results + answer vs answer alone, its Figure 3)
compares blocks of different lengths, so a difference between sources can be a difference of
context length. With a budget of L tokens (`rl.hindsight_budget` for the hindsight message,
`privileged.block_budget` for a privileged block) every block is exactly L tokens long:

* the markup (the message's opening and closing pieces, and the gold answer, which lives in the
  opening piece of the hindsight message) is never cut; L smaller than it is an error;
* the content between them is cut to its first tokens when it is longer than the room left
  (the head is kept: turn k's own calls and results come first, later turns are dropped first,
  and a deeper hindsight block stays an extension of a shallower one), or followed by the filler
  when shorter;
* the filler is a fixed text (`rl.hindsight_filler` / `privileged.block_filler`; default ".\\n", a
  line holding one period, a single Qwen3 token) tokenised once as plain text and tiled token by
  token, so a run of it is what the tokenizer makes of the repeated text. It says nothing about
  the task.

A block that is empty by design (the answer turn with source "tool_results": no message at all)
stays empty: the control equalises the length of what is shown, and a turn shown nothing is not
shown a message of filler.
"""

from __future__ import annotations

from typing import Any, Sequence

from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.chat.hindsight_template import DEFAULT_FILLER  # noqa: F401  (re-exported)


def filler_ids(tokenizer: Any, text: str) -> list[int]:
    """The filler's token ids (plain text: a spelled control token stays text); ValueError when
    it tokenises to nothing."""
    ids = tok_lib.encode_plain(tokenizer, text)
    if not ids:
        raise ValueError(f"the block filler {text!r} tokenises to no tokens; give a non-empty text")
    return ids


def padding(n: int, filler: Sequence[int]) -> list[int]:
    """The filler tiled to exactly n tokens (n >= 0)."""
    if n < 0:
        raise ValueError(f"padding of {n} tokens")
    if n and not filler:
        raise ValueError("an empty filler cannot pad a block")
    reps = -(-n // max(len(filler), 1))
    return (list(filler) * reps)[:n]


def fit(content: Sequence[int], room: int, filler: Sequence[int]) -> list[int]:
    """`content` fitted to exactly `room` tokens: its first `room` tokens, or all of it followed by
    the tiled filler."""
    if room < 0:
        raise ValueError(f"no room for a block's content ({room} tokens)")
    kept = list(content[:room])
    return kept + padding(room - len(kept), filler)
