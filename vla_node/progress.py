"""A tiny progress bar for stderr, no dependencies.

On a terminal it redraws one line in place (`\\r`) at most every `interval_s`; when the stream is not a
terminal (CI logs, pipes) it writes a plain line at most every `log_interval_s`, plus a final line at
close, so logs stay short. Time comes from an injectable monotonic clock.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

NS_PER_S = 1_000_000_000
BAR_WIDTH = 28


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class Progress:
    """Progress(total, label) with update(n), close() and use as a context manager.

    total: expected count, or None when unknown (then count and rate only). unit: what is counted.
    enabled=False makes every call a no-op (a caller's `progress=False`)."""

    def __init__(
        self,
        total: int | None,
        label: str,
        *,
        unit: str = "frames",
        stream: TextIO | None = None,
        enabled: bool = True,
        interval_s: float = 0.1,
        log_interval_s: float = 5.0,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
            raise ValueError(f"total = {total!r}: expected a non-negative integer or None")
        self.total = total
        self.label = label
        self.unit = unit
        self.count = 0
        self.enabled = enabled
        self._stream = stream if stream is not None else sys.stderr
        self._clock = clock
        try:
            self._tty = bool(self._stream.isatty())
        except (AttributeError, ValueError):  # closed or file-like without isatty
            self._tty = False
        self._interval_ns = int((interval_s if self._tty else log_interval_s) * NS_PER_S)
        self._start_ns = clock()
        self._last_draw_ns = self._start_ns
        self._closed = False
        self._width = 0  # characters of the last in-place line, to blank leftovers

    def update(self, n: int = 1) -> None:
        """Count n more items; redraws only when the rate limit allows."""
        self.count += n
        if not self.enabled or self._closed:
            return
        now = self._clock()
        if now - self._last_draw_ns >= self._interval_ns:
            self._last_draw_ns = now
            self._draw(now, final=False)

    def close(self) -> None:
        """Draw the final state once and end the line; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        if self.enabled:
            self._draw(self._clock(), final=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def line(self, now_ns: int | None = None) -> str:
        """The text of the current state (without bar on non-terminals)."""
        now_ns = self._clock() if now_ns is None else now_ns
        elapsed = max(now_ns - self._start_ns, 1) / NS_PER_S
        rate = self.count / elapsed
        parts = [self.label]
        if self.total:
            frac = min(self.count / self.total, 1.0)
            if self._tty:
                filled = int(frac * BAR_WIDTH)
                parts.append("[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]")
            parts.append(f"{frac * 100:3.0f}% {self.count}/{self.total} {self.unit}")
        else:
            parts.append(f"{self.count} {self.unit}")
        parts.append(f"{rate:.1f}/s")
        if self.total and 0 < self.count < self.total and rate > 0:
            parts.append(f"ETA {_duration((self.total - self.count) / rate)}")
        else:
            parts.append(f"in {_duration(elapsed)}")
        return " ".join(parts)

    def _draw(self, now_ns: int, final: bool) -> None:
        text = self.line(now_ns)
        if self._tty:
            pad = " " * max(self._width - len(text), 0)
            self._width = len(text)
            self._stream.write("\r" + text + pad + ("\n" if final else ""))
        else:
            self._stream.write(text + "\n")
        self._stream.flush()
