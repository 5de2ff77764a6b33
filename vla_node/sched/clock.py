"""The control clock: when each control tick is due, and the ticks a stall skipped (plain logic, clock injected)."""

from __future__ import annotations

from vla_node.validate import is_int


class ControlClock:
    """The control tick schedule: ticks are due at start_ns + k * period_ns. After a stall the clock resumes on
    the grid (the latest due tick), counting the ticks it skipped as missed; it never bursts to catch up."""

    def __init__(self, period_ns: int, start_ns: int) -> None:
        if not (is_int(period_ns) and period_ns > 0):
            raise ValueError(f"ControlClock period_ns = {period_ns!r}: expected an integer > 0")
        self.period_ns = period_ns
        self.start_ns = start_ns
        self._next_index = 0
        self.ticks = 0               # ticks taken
        self.missed_ticks = 0        # ticks skipped because now was past them by a period or more
        self.index = -1              # index of the last tick taken
        self.scheduled_ns = start_ns  # when the last tick was due
        self.jitter_ns = 0           # now - scheduled of the last tick
        self.max_jitter_ns = 0

    def next_deadline(self) -> int:
        """When the next tick is due."""
        return self.start_ns + self._next_index * self.period_ns

    def wait_time(self, now_ns: int) -> int:
        """ns to wait until the next tick is due (0 when it is due already)."""
        return max(0, self.next_deadline() - now_ns)

    def tick(self, now_ns: int) -> int:
        """Take the tick due at now_ns (the latest one due; the next one if called early).
        Returns how many due ticks were skipped by this call."""
        due = self._next_index
        index = max(due, (now_ns - self.start_ns) // self.period_ns)
        missed = index - due
        self._next_index = index + 1
        self.index = index
        self.scheduled_ns = self.start_ns + index * self.period_ns
        self.jitter_ns = now_ns - self.scheduled_ns
        if self.jitter_ns > self.max_jitter_ns:
            self.max_jitter_ns = self.jitter_ns
        self.ticks += 1
        self.missed_ticks += missed
        return missed
