"""Signals as plain flags.

A Python signal handler runs in the main thread between two bytecodes, possibly while that thread holds a lock.
A handler that calls threading.Event.set() deadlocks when the signal lands inside the same Event's wait() (the
Event's Condition lock is not re-entrant); one that logs can hit a re-entrant write on the log stream. So the
handlers here only store the signal number, and the loops look at it.
"""

from __future__ import annotations

import signal
import threading
import time


class SignalFlag:
    """Within `with`, the given signals are recorded in `received` instead of running their usual handlers.
    Where handlers cannot be set (not the main thread), the signals keep their usual behaviour."""

    def __init__(self, *signums: int) -> None:
        self.signums = signums
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalFlag:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signums:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum: int, frame: object) -> None:
        self.received = signum

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def sleep(self, seconds: float) -> bool:
        """Sleep up to `seconds` in slices of at most 10 ms; True as soon as a signal has come."""
        end = time.monotonic() + seconds
        while self.received is None:
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, 0.01))
        return True


class ExitOn:
    """Within `with`, the given signals raise SystemExit(128 + signum) in the main thread, as Ctrl-C raises
    KeyboardInterrupt, so that `finally` blocks run (a replay stops the node it started). For a process that
    would otherwise die on SIGTERM or SIGHUP without cleaning up. Elsewhere than the main thread: no change."""

    def __init__(self, *signums: int) -> None:
        self.signums = signums
        self._previous: dict[int, object] = {}

    def __enter__(self) -> ExitOn:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signums:
                self._previous[signum] = signal.signal(signum, self._exit)
        return self

    @staticmethod
    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
