"""Signals as plain flags.

A Python signal handler runs in the main thread between two bytecodes, possibly while that thread holds a lock.
A handler that calls threading.Event.set() deadlocks when the signal lands inside the same Event's wait() (the
Event's Condition lock is not re-entrant); one that logs can hit a re-entrant write on the log stream. So the
handlers here only store the signal number, and the loops look at it (CtrlCLatch raises as Python's own
handler does, and latches the signal for the loops too).
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


class CtrlCLatch:
    """Within `with`, Ctrl-C raises KeyboardInterrupt as usual and is also latched: `check()` raises it again.
    Python drops an exception raised inside a finalizer (a `__del__`, a weakref callback: "Exception ignored
    in ..."), and a signal's handler runs wherever the main thread is, a garbage collection included, so a Ctrl-C
    can vanish; a loop that calls check() between its steps stops at the next step whatever became of the first.
    Changes nothing where Ctrl-C does not raise KeyboardInterrupt (ignored, another handler) or off the main
    thread."""

    def __init__(self) -> None:
        self.received = False
        self._installed = False

    def __enter__(self) -> CtrlCLatch:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, self._raise)
            self._installed = True
        return self

    def _raise(self, signum: int, frame: object) -> None:
        self.received = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.received:
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._installed = False
