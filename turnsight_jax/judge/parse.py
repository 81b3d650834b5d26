"""The strict parser of a judge's output. Model text is hostile: it is only searched for fixed
tags, never evaluated; anything but the exact format is *malformed*, with a reason, and gets
`judge.default_label` (counted in `judge/malformed_rate`), never an exception.

Well-formed, with a rationale (`rationale=True`):

    <rationale>TEXT</rationale> WS <verdict> WS 0|1 WS </verdict>

and rationale-free (`rationale=False`): `<verdict> WS 0|1 WS </verdict>`. WS is optional
whitespace; the whole output may be surrounded by whitespace and end with the stop token
(`<|im_end|>` or `<|endoftext|>`, as the sampler returns it). Each tag occurs exactly once; TEXT is
non-empty after stripping and holds no judge tag; nothing else may be written before, between or
after (so "two verdicts", a missing tag, a verdict of "yes" or "2", a rationale in the
rationale-free format, or prose around the tags are all malformed).
"""

from __future__ import annotations

import dataclasses

from turnsight_jax.chat.tokenizer import ENDOFTEXT, IM_END

TAGS = ("<rationale>", "</rationale>", "<verdict>", "</verdict>")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """label: 0 or 1, None when malformed; rationale: the stripped rationale (None without one);
    error: why the output is malformed ("" when well-formed)."""

    label: int | None
    rationale: str | None = None
    error: str = ""

    @property
    def malformed(self) -> bool:
        return self.label is None

    def label_or(self, default: int) -> int:
        """The label, or `default` when malformed."""
        return default if self.label is None else self.label


def _bad(reason: str) -> Verdict:
    return Verdict(None, None, reason)


def _strip_stop(text: str) -> str:
    text = text.strip()
    for stop in (IM_END, ENDOFTEXT):
        if text.endswith(stop):
            return text[: -len(stop)].strip()
    return text


def parse_verdict(text: str, *, rationale: bool) -> Verdict:
    """Parse one judge output (see the module docstring); never raises on any string."""
    if not isinstance(text, str):
        return _bad(f"not text: {type(text).__name__}")
    body = _strip_stop(text)
    if not body:
        return _bad("empty output")
    counts = {tag: body.count(tag) for tag in TAGS}
    if counts["<verdict>"] == 0 or counts["</verdict>"] == 0:
        return _bad("no <verdict>...</verdict>")
    if counts["<verdict>"] > 1 or counts["</verdict>"] > 1:
        return _bad("several verdicts")
    if rationale:
        if counts["<rationale>"] == 0 or counts["</rationale>"] == 0:
            return _bad("no <rationale>...</rationale>")
        if counts["<rationale>"] > 1 or counts["</rationale>"] > 1:
            return _bad("several rationales")
        r0, r1 = body.find("<rationale>"), body.find("</rationale>")
        v0, v1 = body.find("<verdict>"), body.find("</verdict>")
        if not (r0 == 0 and r0 < r1 < v0 < v1):
            return _bad("text before the rationale, or tags out of order")
        if body[r1 + len("</rationale>"):v0].strip():
            return _bad("text between the rationale and the verdict")
        reason = body[r0 + len("<rationale>"):r1].strip()
        if not reason:
            return _bad("empty rationale")
    else:
        if counts["<rationale>"] or counts["</rationale>"]:
            return _bad("a rationale in the rationale-free format")
        v0, v1 = body.find("<verdict>"), body.find("</verdict>")
        if not (v0 == 0 and v0 < v1):
            return _bad("text before the verdict, or tags out of order")
        reason = None
    if body[v1 + len("</verdict>"):].strip():
        return _bad("text after the verdict")
    value = body[v0 + len("<verdict>"):v1].strip()
    if value not in ("0", "1"):
        return _bad(f"verdict is not 0 or 1: {value[:20]!r}")
    return Verdict(int(value), reason, "")
