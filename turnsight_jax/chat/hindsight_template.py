"""The hindsight message's format strings (`rl.hindsight_template`): the contract and its check.

A leaf module (it imports only `errors.py`) so that `rl/config.py`, which types every step knob,
can hold a template without importing the view builder (`chat/hindsight.py` renders with it).
"""

from __future__ import annotations

import dataclasses
import string

from turnsight_jax.errors import ConfigError

# What pads a hindsight message or a privileged block to the equal-length budget (chat.budget),
# tiled token by token: ".\n", a line holding a period. Here, in this leaf module, so the typed step
# configs (rl.config) take the default without importing the tokenizer.
DEFAULT_FILLER = ".\n"


@dataclasses.dataclass(frozen=True)
class HindsightTemplate:
    """Format strings of the hindsight message.

    message_open: starts the message. answer: appended to the open piece when the source includes
      the gold answer (placeholder ``{answer}``). item: one turn (placeholders ``{calls}``,
      ``{results}``, ``{turn}`` = 1-based turn number in the trajectory, ``{offset}`` = j).
    call / result: one call (``{call}``: the ``<tool_call>`` body JSON, or the raw text of a
      malformed call) / one result (``{result}``). message_close: ends the message.
    """

    message_open: str = "<|im_start|>user\n<hindsight>\n"
    answer: str = "<answer>{answer}</answer>\n"
    item: str = "<turn>\n{calls}{results}</turn>\n"
    call: str = "<tool_call>\n{call}\n</tool_call>\n"
    result: str = "<tool_response>\n{result}\n</tool_response>\n"
    message_close: str = "</hindsight><|im_end|>\n"


# The named fields each piece of a HindsightTemplate may use (str.format fields; "{{" is a brace).
TEMPLATE_FIELDS: dict[str, tuple[str, ...]] = {
    "message_open": (),
    "answer": ("answer",),
    "item": ("calls", "results", "turn", "offset"),
    "call": ("call",),
    "result": ("result",),
    "message_close": (),
}


def check_template(template: HindsightTemplate, key: str = "hindsight_template") -> None:
    """ConfigError (one line, naming `key`.<piece> and the field) unless every piece of `template`
    is a string whose format fields are bare names its piece allows (no positional, attribute or
    index fields: the values are rendered as given, never looked into)."""
    for piece, allowed in TEMPLATE_FIELDS.items():
        text = getattr(template, piece)
        if not isinstance(text, str):
            raise ConfigError(f"{key}.{piece} must be a string, got {type(text).__name__}")
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
        except ValueError as e:  # a lone "{" or "}"
            raise ConfigError(f"{key}.{piece}: not a format string ({e}); write a literal brace as {{{{ or }}}}") from None
        for field in fields:
            if field not in allowed:
                shown = ", ".join("{" + a + "}" for a in allowed) or "none"
                raise ConfigError(f"{key}.{piece}: unknown field {{{field}}}; allowed: {shown}")
