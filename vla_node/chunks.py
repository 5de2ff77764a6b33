"""The control-rate side: the chunk broker shared by worker and publisher, and the control clock.

`ChunkBroker` is the only object the two threads share. The inference worker `offer`s each action chunk
[H, D] it decodes; the control-rate publisher calls `next(now_ns)` once per tick and never waits on inference:

    fresh     the first tick after a chunk was offered on time: action = chunk[0]
    chunk     later ticks: action = chunk[step], step = elapsed control periods since the chunk was produced
    fallback  no chunk yet, the chunk is exhausted or older than its max age, or the worker withdrew it:
              the configured safe action

A chunk produced after its frame's deadline is never `fresh`: its first tick is already `chunk`.

Chunks are copied into three preallocated slots (a triple buffer): the arrays of a TickOutput are read-only
views that stay valid until the publisher's next call to `next()`, whatever the worker offers meanwhile.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from vla_node.scheduler import SchedulerConfig

_SLOTS = 3  # current, held by the publisher, being written


class TickStatus(str, enum.Enum):
    """What a control tick published; the value is the wire string."""

    FRESH = "fresh"
    CHUNK = "chunk"
    FALLBACK = "fallback"


@dataclass(frozen=True, slots=True)
class TickOutput:
    """One control tick's action with the frame it came from. Arrays are read-only views, valid until the
    next `ChunkBroker.next()`; frame fields are those of the last chunk (None before any chunk)."""

    status: TickStatus
    action: np.ndarray                    # [D]
    chunk: np.ndarray | None              # [H, D]; None when status is fallback
    step: int | None                      # index into chunk; None when status is fallback
    frame_seq: int | None
    frame_stamp_ns: int | None
    level: int | None                     # the level the chunk was produced at (or withdrawn at)
    timing_ms: Mapping[str, float] | None


def _check_positive(key: str, value: object) -> None:
    if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"ChunkBroker {key} = {value!r}: expected an integer > 0")


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class ChunkBroker:
    """Latest action chunk from the worker, played out at the control rate. Thread-safe: one small lock.

    horizon, dim: chunk shape [H, D]. period_ns: control period. late_after_ns: a chunk produced more than
    this after its frame's capture stamp is late (the vision deadline) unless `offer` is given the frame's own
    deadline. max_age_ns: how long after production a chunk may be played (default H periods).
    fallback_action: [D] safe action (default zeros)."""

    def __init__(self, horizon: int, dim: int, *, period_ns: int, late_after_ns: int, max_age_ns: int | None = None,
                 fallback_action: Sequence[float] | np.ndarray | None = None, dtype: type = np.float32) -> None:
        _check_positive("horizon", horizon)
        _check_positive("dim", dim)
        _check_positive("period_ns", period_ns)
        _check_positive("late_after_ns", late_after_ns)
        if max_age_ns is not None:
            _check_positive("max_age_ns", max_age_ns)
        self.horizon = int(horizon)
        self.dim = int(dim)
        self.period_ns = int(period_ns)
        self.late_after_ns = int(late_after_ns)
        self.max_age_ns = int(max_age_ns) if max_age_ns is not None else self.horizon * self.period_ns
        fallback = np.zeros(self.dim, dtype) if fallback_action is None else np.array(fallback_action, dtype)
        if fallback.shape != (self.dim,) or not np.isfinite(fallback).all():
            raise ValueError(f"fallback_action = {fallback_action!r}: expected {self.dim} finite numbers")
        self._fallback = _read_only(fallback)
        self._buffers = np.zeros((_SLOTS, self.horizon, self.dim), dtype)  # [slot, H, D]
        self._chunks = tuple(_read_only(self._buffers[slot]) for slot in range(_SLOTS))
        self._rows = tuple(tuple(_read_only(self._buffers[slot, step]) for step in range(self.horizon))
                           for slot in range(_SLOTS))
        self._finite = np.empty((self.horizon, self.dim), bool)  # scratch for the finiteness check
        self._lock = threading.Lock()
        # Under the lock:
        self._current: int | None = None      # slot of the latest chunk
        self._reader: int | None = None       # slot the last TickOutput points into
        self._fresh_pending = False
        self._withdrawn = False
        self._produced_ns = 0
        self._frame_seq: int | None = None
        self._frame_stamp_ns: int | None = None
        self._level: int | None = None
        self._timing_ms: Mapping[str, float] | None = None
        self.offered = 0
        self.late_offers = 0
        self.rejected_nonfinite = 0
        self.replaced_unpublished = 0         # fresh chunks replaced before any tick published them
        self.ticks = {status: 0 for status in TickStatus}

    @classmethod
    def from_config(cls, config: SchedulerConfig, horizon: int, dim: int, dtype: type = np.float32) -> ChunkBroker:
        max_age = None if config.chunk_max_age_ms is None else int(round(config.chunk_max_age_ms * 1e6))
        return cls(horizon, dim, period_ns=config.period_ns, late_after_ns=int(round(config.vision_deadline_ms * 1e6)),
                   max_age_ns=max_age, fallback_action=config.fallback_action, dtype=dtype)

    def offer(self, chunk: np.ndarray, frame_seq: int, frame_stamp_ns: int, produced_ns: int, level: int,
              timing_ms: Mapping[str, float] | None = None, deadline_ns: int | None = None) -> bool:
        """Hand over a decoded chunk [H, D] (copied). `deadline_ns`: the frame's own deadline (the plan's);
        without it the chunk is late when produced more than late_after_ns after the frame's capture.
        A chunk with a non-finite value is counted and dropped (returns False). `timing_ms` is kept by
        reference: do not mutate it afterwards."""
        if getattr(chunk, "shape", None) != (self.horizon, self.dim):
            raise ValueError(f"chunk shape {getattr(chunk, 'shape', type(chunk).__name__)}: expected "
                             f"({self.horizon}, {self.dim})")
        late = (produced_ns > deadline_ns) if deadline_ns is not None else \
            (produced_ns - frame_stamp_ns > self.late_after_ns)
        with self._lock:
            np.isfinite(chunk, out=self._finite)
            if not self._finite.all():
                self.rejected_nonfinite += 1
                return False
            slot = next(s for s in range(_SLOTS) if s != self._current and s != self._reader)
            np.copyto(self._buffers[slot], chunk, casting="same_kind")
            if self._fresh_pending:
                self.replaced_unpublished += 1
            self._current = slot
            self._fresh_pending = not late
            self._withdrawn = False
            self._produced_ns = produced_ns
            self._frame_seq = frame_seq
            self._frame_stamp_ns = frame_stamp_ns
            self._level = level
            self._timing_ms = timing_ms
            self.offered += 1
            self.late_offers += int(late)
        return True

    def withdraw(self, level: int) -> None:
        """Stop playing out the current chunk (the fallback level): fallback until the next offer."""
        with self._lock:
            self._withdrawn = True
            self._fresh_pending = False
            self._level = level

    def next(self, now_ns: int) -> TickOutput:
        """The action for the control tick at now_ns."""
        with self._lock:
            fresh = self._fresh_pending
            self._fresh_pending = False
            slot = self._current
            status = TickStatus.FALLBACK
            step = 0
            if slot is not None and not self._withdrawn:
                elapsed = now_ns - self._produced_ns
                step = elapsed // self.period_ns if elapsed > 0 else 0
                if fresh and step == 0:
                    status = TickStatus.FRESH
                    # a tick due before the chunk was produced (the publisher woke late) plays its step 0: the
                    # steps count from that tick, so the next one plays step 1, not step 0 again
                    self._produced_ns = min(self._produced_ns, now_ns)
                elif step < self.horizon and elapsed <= self.max_age_ns:
                    status = TickStatus.CHUNK
            self.ticks[status] += 1
            if status is TickStatus.FALLBACK:
                self._reader = None
                return TickOutput(status, self._fallback, None, None, self._frame_seq, self._frame_stamp_ns,
                                  self._level, self._timing_ms)
            self._reader = slot
            return TickOutput(status, self._rows[slot][step], self._chunks[slot], step, self._frame_seq,
                              self._frame_stamp_ns, self._level, self._timing_ms)


class ControlClock:
    """The control tick schedule: ticks are due at start_ns + k * period_ns. After a stall the clock resumes on
    the grid (the latest due tick), counting the ticks it skipped as missed; it never bursts to catch up."""

    def __init__(self, period_ns: int, start_ns: int) -> None:
        if not (isinstance(period_ns, int) and not isinstance(period_ns, bool) and period_ns > 0):
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
