"""Ctrl-C where Python drops it: inside a finalizer, whose exceptions are printed ("Exception ignored in ...") and
ignored."""

from __future__ import annotations

import os
import signal
import time


class CtrlCWhenCollected:
    """Ctrl-C, as a terminal sends it, while this object's finalizer runs: a raising handler raises there, and
    Python drops the exception."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs here, inside the finalizer
