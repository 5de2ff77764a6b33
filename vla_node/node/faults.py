"""Fault injection for tests, in one named place: a wrapper around the policy, enabled only by its environment
variable and logged loudly. Production stage code has no test hook; later faults (stalls, exceptions mid-step)
plug in here.

    VLA_NODE_TEST_DELAY_FILE=PATH   PATH holds "<stage> <ms>" (text, vision or action): each call of that stage
                                    sleeps ms first. The file is re-read at most every 50 ms, so a test changes
                                    the delay while the node runs (replace it atomically).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)
DELAY_FILE_ENV = "VLA_NODE_TEST_DELAY_FILE"
REREAD_NS = 50_000_000


class StageDelay:
    """The delay file's current "<stage> <ms>", re-read at most every 50 ms (an unreadable file: no delay)."""

    def __init__(self, path: Path, clock: Callable[[], int]) -> None:
        self.path = path
        self.clock = clock
        self._read_ns: int | None = None
        self._value: tuple[str, float] | None = None

    def apply(self, stage: str) -> None:
        now = self.clock()
        if self._read_ns is None or now - self._read_ns > REREAD_NS:
            self._read_ns = now
            try:
                name, ms = self.path.read_text().split()
                self._value = (name, float(ms))
            except (OSError, ValueError):
                self._value = None
        if self._value is not None and self._value[0] == stage and self._value[1] > 0:
            time.sleep(self._value[1] / 1000)


class FaultyPolicy:
    """A policy whose stages first suffer the injected delay; everything else is the wrapped policy's. A tick
    decoded in its frame's vision pass suffers the action delay after that pass (inside the vision stage)."""

    def __init__(self, policy, delay: StageDelay) -> None:
        self.wrapped = policy
        self.delay = delay

    def __getattr__(self, name: str):
        return getattr(self.wrapped, name)

    def update_text(self, *args, **kwargs):
        self.delay.apply("text")
        return self.wrapped.update_text(*args, **kwargs)

    def update_vision(self, *args, **kwargs):
        self.delay.apply("vision")
        update = self.wrapped.update_vision(*args, **kwargs)
        if update.chunk is not None:
            self.delay.apply("action")
        return update

    def action_tick(self, *args, **kwargs):
        self.delay.apply("action")
        return self.wrapped.action_tick(*args, **kwargs)


def with_faults(policy, clock: Callable[[], int] = time.monotonic_ns, environ=os.environ):
    """The policy itself, or wrapped in FaultyPolicy when the fault environment variable is set (tests only)."""
    path = environ.get(DELAY_FILE_ENV)
    if not path:
        return policy
    log.warning("TEST-ONLY FAULT INJECTION ENABLED: stage delays from %s=%s", DELAY_FILE_ENV, path)
    return FaultyPolicy(policy, StageDelay(Path(path), clock))
