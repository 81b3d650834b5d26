"""A progress line on stderr: examples done of total, rate, elapsed time and ETA."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = int(round(max(seconds, 0.0)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Counts finished examples; `update` prints one line (rewritten in place on a terminal)."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24):
        self.total = max(int(total), 0)
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.start = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def line(self, label: str) -> str:
        elapsed = time.monotonic() - self.start
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        eta_text = _clock(eta) if self.done else "?"
        return (f"[{bar}] {self.done}/{self.total} examples ({100 * frac:5.1f}%) {label} "
                f"elapsed {_clock(elapsed)} ETA {eta_text}")

    def update(self, n: int, label: str = "") -> None:
        self.done += n
        text = self.line(label)
        if self._tty:
            self.stream.write("\r" + text.ljust(100))
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
