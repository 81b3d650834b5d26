"""Hindsight blocks (docs/spec.md §1 steps 1-2), rendered as token pieces that the three depths share.

For turn k of a trajectory with K turns, the block of depth d holds the calls and results of turns
k .. k̄ with k̄ = min(k+d-1, K-1). The teacher's view is::

  trajectory[:header_start(k)]  +  hindsight message  +  assistant header of turn k  +  turn k tokens

and the hindsight message of depth d is ``open_ids + item_ids[0] + ... + item_ids[d-1] + close_ids``
(d clipped to the number of items), so all depths share the prefix ``open_ids + item_ids[0]`` etc.
The gold answer (sources "tool_results_answer" and "answer") lives in ``open_ids`` to keep that
prefix shared.

Default template (``HindsightTemplate()``), for a turn with one call and one result::

  <|im_start|>user
  <hindsight>
  [<answer>{gold answer}</answer>\\n when the source includes the answer]
  <turn>
  <tool_call>
  {"name": "search", "arguments": {"q": "x"}}
  </tool_call>
  <tool_response>
  {result}
  </tool_response>
  </turn>
  ... one <turn> item per later turn, up to the depth ...
  </hindsight><|im_end|>

Every piece ends with a newline and the next one starts with a non-whitespace character, so
tokenising the pieces separately gives the same ids as tokenising the whole message (Qwen's
pre-tokenizer always splits between a newline and a following non-newline character); the tests
check this with the fixture tokenizer. Custom templates should keep that property.

Empty block: with source "tool_results", when every item of turn k has no calls and no results
(e.g. the final answer turn) the block is empty: ``is_empty`` is True, all pieces are empty and the
teacher's view is the student's own context (no message inserted).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.chat.parsing import render_tool_call
from turnsight_jax.chat.trajectory import Trajectory, TurnRecord, turn_context
from turnsight_jax.chat.types import CallError, ToolCall
from turnsight_jax.chat.hindsight_template import HindsightTemplate

SOURCES = ("tool_results", "tool_results_answer", "answer")


@dataclasses.dataclass(frozen=True)
class HindsightPieces:
    """Token pieces of turn k's hindsight messages (int lists).

    open_ids: message opening (+ gold answer). item_ids[j]: turn k+j's calls and results,
    j < min(max_depth, K-k). close_ids: message closing. header_ids: turn k's assistant header,
    copied from the trajectory. is_empty: the block has no content (all pieces empty).
    """

    open_ids: list[int]
    item_ids: list[list[int]]
    close_ids: list[int]
    header_ids: list[int]
    is_empty: bool = False

    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    def message_ids(self, depth: int) -> list[int]:
        """The depth-d hindsight message (d >= 1, clipped to the number of items)."""
        if depth < 1:
            raise ValueError(f"hindsight depth must be >= 1, got {depth}")
        if self.is_empty:
            return []
        ids = list(self.open_ids)
        for item in self.item_ids[: min(depth, self.num_items)]:
            ids.extend(item)
        ids.extend(self.close_ids)
        return ids


def _call_text(call: ToolCall | CallError) -> str:
    if isinstance(call, ToolCall):
        # Canonical JSON of the parsed call, without the tags (the template adds them).
        rendered = render_tool_call(call.name, call.arguments)
        return rendered[len("<tool_call>\n") : -len("\n</tool_call>")]
    return call.raw.strip()


def _item_text(template: HindsightTemplate, turn: TurnRecord, k: int, j: int) -> str:
    calls = "".join(template.call.format(call=_call_text(c)) for c in turn.calls)
    results = "".join(template.result.format(result=r) for r in turn.results)
    return template.item.format(calls=calls, results=results, turn=k + j + 1, offset=j)


def _check_args(traj: Trajectory, k: int, max_depth: int, source: str, gold_answer: str | None) -> None:
    if not 0 <= k < traj.num_turns:
        raise IndexError(f"turn {k} out of range for a trajectory with {traj.num_turns} turns")
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")
    if source not in SOURCES:
        raise ValueError(f"unknown hindsight source {source!r}; expected one of {SOURCES}")
    if source != "tool_results" and gold_answer is None:
        raise ValueError(f"hindsight source {source!r} needs gold_answer")


def hindsight_texts(
    traj: Trajectory,
    k: int,
    *,
    max_depth: int = 3,
    source: str = "tool_results",
    gold_answer: str | None = None,
    template: HindsightTemplate = HindsightTemplate(),
) -> tuple[str, list[str], str, bool]:
    """The pieces as strings: (open, items, close, is_empty); see ``hindsight_pieces``."""
    _check_args(traj, k, max_depth, source, gold_answer)
    n_items = min(max_depth, traj.num_turns - k)
    turns = traj.turns[k : k + n_items]
    if source == "answer":
        # The gold answer alone: every depth sees the same message.
        items = ["" for _ in turns]
    else:
        items = [_item_text(template, t, k, j) for j, t in enumerate(turns)]
    if source == "tool_results" and all(not t.calls and not t.results for t in turns):
        return "", ["" for _ in turns], "", True
    open_text = template.message_open
    if source != "tool_results":
        open_text += template.answer.format(answer=gold_answer)
    return open_text, items, template.message_close, False


def hindsight_pieces(
    tokenizer: Any,
    traj: Trajectory,
    k: int,
    *,
    max_depth: int = 3,
    source: str = "tool_results",
    gold_answer: str | None = None,
    template: HindsightTemplate = HindsightTemplate(),
) -> HindsightPieces:
    """Tokenised hindsight pieces of turn k (0-based) of ``traj``; each piece is tokenised alone.

    Args:
      source: "tool_results" (default), "tool_results_answer" or "answer" (docs/spec.md §1.10 ablations).
      gold_answer: required for the sources with the answer.
    """
    open_text, items, close_text, is_empty = hindsight_texts(
        traj, k, max_depth=max_depth, source=source, gold_answer=gold_answer, template=template
    )
    turn = traj.turns[k]
    header_ids = [int(x) for x in traj.tokens[turn.header_start : turn.policy_start]]
    return HindsightPieces(
        open_ids=tok_lib.encode(tokenizer, open_text) if open_text else [],
        # items quote tool results (untrusted): a spelled control token stays text, as in the rollout
        item_ids=[tok_lib.encode_plain(tokenizer, t) if t else [] for t in items],
        close_ids=tok_lib.encode(tokenizer, close_text) if close_text else [],
        header_ids=header_ids,
        is_empty=is_empty,
    )


def hindsight_ids(
    tokenizer: Any,
    traj: Trajectory,
    k: int,
    d: int,
    *,
    max_depth: int = 3,
    source: str = "tool_results",
    gold_answer: str | None = None,
    template: HindsightTemplate = HindsightTemplate(),
) -> list[int]:
    """The whole depth-d hindsight message of turn k (empty for an empty block)."""
    if not 1 <= d <= max_depth:
        raise ValueError(f"depth {d} outside 1..{max_depth}")
    pieces = hindsight_pieces(
        tokenizer, traj, k, max_depth=max_depth, source=source, gold_answer=gold_answer, template=template
    )
    return pieces.message_ids(d)


def teacher_view_ids(
    tokenizer: Any,
    traj: Trajectory,
    k: int,
    d: int,
    **kwargs: Any,
) -> list[int]:
    """The naive teacher sequence for (k, d): turn k's context before its header (what the policy
    saw: `trajectory.turn_context`, the trajectory itself unless an observation window elided
    some observations), the hindsight message, turn k's header, turn k's policy tokens (int list).
    Reference for the packed views."""
    turn = traj.turns[k]
    pieces = hindsight_pieces(tokenizer, traj, k, **kwargs)
    context, header = turn_context(traj, k)
    return (
        [int(x) for x in context[:header]]
        + pieces.message_ids(d)
        + pieces.header_ids
        + [int(x) for x in traj.tokens[turn.policy_start : turn.policy_end]]
    )
