"""Ctrl-C where Python drops it: inside a finalizer, whose exceptions are printed ("Exception ignored in ...") and
ignored; and Python's own Ctrl-C handler for the tests that send one."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Iterator


@contextlib.contextmanager
def python_ctrl_c() -> Iterator[None]:
    """Python's own Ctrl-C handler (KeyboardInterrupt) within, whatever the test runner's (a worker process may
    ignore SIGINT); the runner's comes back after."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


class CtrlCWhenCollected:
    """Ctrl-C, as a terminal sends it, while this object's finalizer runs: a raising handler raises there, and
    Python drops the exception."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs here, inside the finalizer
