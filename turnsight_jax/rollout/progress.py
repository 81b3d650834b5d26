"""A throttled progress line on stderr for long rollouts (evaluation and training alike).

`ProgressLine` is a `rollout(..., progress=)` callback. It sums the episodes of several rollouts
(the batches of an evaluation) against one total and prints, at most every `every_s` seconds and
once when the last episode ends:

  [builtin] 96/256 episodes (37.5%), turn 3, 412 decode tok/s, elapsed 1:02, ETA 1:43
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from turnsight_jax.rollout.driver import RolloutProgress


def clock(seconds: float) -> str:
    """Seconds as m:ss or h:mm:ss."""
    seconds = int(round(max(seconds, 0.0)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressLine:
    """Episodes finished of `total` across rollouts, current turn, decode tokens/s, elapsed, ETA.

    `label` may be changed between rollouts (e.g. the benchmark). `stream=None` writes to stderr;
    `quiet=True` prints nothing (the counts are still kept). `patient=True` (training rollouts,
    which a per-step line follows anyway) waits `every_s` before the first line and prints no
    final one, so short rollouts stay silent."""

    def __init__(self, total: int, *, label: str = "", stream: TextIO | None = None, every_s: float = 5.0,
                 quiet: bool = False, patient: bool = False, clock_fn: Callable[[], float] = time.monotonic):
        self.total = max(int(total), 0)
        self.label = label
        self.stream = stream
        self.every_s = every_s
        self.quiet = quiet
        self._clock = clock_fn
        self.start = clock_fn()
        self.patient = patient
        self._last = self.start if patient else float("-inf")
        self._base_done = self._base_tokens = 0  # from the rollouts already finished
        self.done = self.tokens = 0
        self._printed = -1  # the episode count of the last line printed
        self.lines = 0

    def __call__(self, p: RolloutProgress) -> None:
        self.done = self._base_done + p.finished
        self.tokens = self._base_tokens + p.tokens
        if p.done:
            self._base_done, self._base_tokens = self.done, self.tokens
        now = self._clock()
        # the final line, unless the same count was just printed by the throttled update
        last = p.done and self.done >= self.total and not self.patient and self._printed != self.done
        if last or now - self._last >= self.every_s:
            self._last = now
            self._printed = self.done
            self._print(self.line(p.turn, now - self.start))

    def line(self, turn: int, elapsed: float) -> str:
        frac = self.done / self.total if self.total else 1.0
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        eta = clock(elapsed / self.done * (self.total - self.done)) if self.done else "?"
        head = f"[{self.label}] " if self.label else ""
        return (f"{head}{self.done}/{self.total} episodes ({100 * frac:.1f}%), turn {turn}, "
                f"{rate:.0f} decode tok/s, elapsed {clock(elapsed)}, ETA {eta}")

    def _print(self, text: str) -> None:
        if self.quiet:
            return
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(text + "\n")
        stream.flush()
        self.lines += 1
