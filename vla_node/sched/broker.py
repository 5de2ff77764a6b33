"""The chunk broker: the only object the inference worker and the control-rate publisher share.

The inference worker `offer`s each action chunk
[H, D] it decodes; the control-rate publisher calls `next(now_ns)` once per tick and never waits on inference:

    fresh     the first tick after a chunk was offered on time: action = chunk[0]
    chunk     later ticks: action = chunk[step], step = elapsed control periods since the chunk was produced
    fallback  no chunk yet, the chunk is exhausted or older than its max age, or the worker withdrew it:
              the configured safe action; a dimension in `fallback_hold` keeps the last action played instead
              (steering held through a curve while the safe action brakes)

A chunk produced after its frame's deadline is never `fresh`: its first tick is already `chunk`.

Steps count from the chunk's origin: its production by default (a new chunk starts at its step 0), or the time
its step 0 is for (`origin_ns`; real-time chunking: a chunk decoded from an observation at t plays its step
(now - t) // period, the steps before it having been played from the previous chunk meanwhile). `fresh` is the
first tick after an on-time offer, whichever step it plays.

Chunks are copied into three preallocated slots (a triple buffer): the arrays of a TickOutput are read-only
views that stay valid until the publisher's next call to `next()`, whatever the worker offers meanwhile.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

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
    tokens_refreshed: int | None          # vision tokens the chunk's frame recomputed (None: no vision update)
    reuse_ratio: float | None             # the fraction of that frame's vision tokens reused
    denoising_steps: int | None = None    # the flow head's Euler steps for the chunk (None: bins, or no chunk)


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
    fallback_action: [D] safe action (default zeros). fallback_hold: [D] bools, the dimensions that hold the last
    action played (before any: the safe action's value) instead of the safe action's (default none)."""

    def __init__(self, horizon: int, dim: int, *, period_ns: int, late_after_ns: int, max_age_ns: int | None = None,
                 fallback_action: Sequence[float] | np.ndarray | None = None,
                 fallback_hold: Sequence[bool] | None = None, dtype: type = np.float32) -> None:
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
        hold = np.zeros(self.dim, bool) if fallback_hold is None else np.array(fallback_hold)
        if hold.shape != (self.dim,) or hold.dtype != bool:
            raise ValueError(f"fallback_hold = {fallback_hold!r}: expected {self.dim} booleans")
        self._hold = hold if hold.any() else None
        self._played = fallback.copy()      # [D] the last action played (held dimensions)
        self._fallback_held = fallback.copy()  # [D] the fallback with its held dimensions filled in
        self._fallback_held_view = _read_only(self._fallback_held)
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
        self._origin_ns = 0
        self._frame_seq: int | None = None
        self._frame_stamp_ns: int | None = None
        self._level: int | None = None
        self._timing_ms: Mapping[str, float] | None = None
        self._tokens_refreshed: int | None = None
        self._reuse_ratio: float | None = None
        self._denoising_steps: int | None = None
        self._status: Mapping | None = None   # the worker's latest figures for health, and when they were taken
        self._status_ns = 0
        self.offered = 0
        self.late_offers = 0
        self.rejected_nonfinite = 0
        self.replaced_unpublished = 0         # fresh chunks replaced before any tick published them
        self.ticks = {status: 0 for status in TickStatus}

    @property
    def fallback_action(self) -> np.ndarray:
        """The safe action [D] (read-only)."""
        return self._fallback

    @property
    def fallback_hold(self) -> list[bool]:
        """Per dimension: whether the fallback holds the last action played there."""
        return [False] * self.dim if self._hold is None else self._hold.tolist()

    def offer(self, chunk: np.ndarray, frame_seq: int, frame_stamp_ns: int, produced_ns: int, level: int,
              timing_ms: Mapping[str, float] | None = None, deadline_ns: int | None = None,
              tokens_refreshed: int | None = None, reuse_ratio: float | None = None,
              origin_ns: int | None = None, denoising_steps: int | None = None) -> bool:
        """Hand over a decoded chunk [H, D] (copied). `deadline_ns`: the frame's own deadline (the plan's);
        without it the chunk is late when produced more than late_after_ns after the frame's capture. `origin_ns`:
        the time its step 0 is for (at most produced_ns; default produced_ns).
        A chunk with a non-finite value is counted and dropped (returns False). `timing_ms` is kept by
        reference: do not mutate it afterwards."""
        if getattr(chunk, "shape", None) != (self.horizon, self.dim):
            raise ValueError(f"chunk shape {getattr(chunk, 'shape', type(chunk).__name__)}: expected "
                             f"({self.horizon}, {self.dim})")
        late = (produced_ns > deadline_ns) if deadline_ns is not None else \
            (produced_ns - frame_stamp_ns > self.late_after_ns)
        if origin_ns is not None and not (isinstance(origin_ns, (int, np.integer)) and origin_ns <= produced_ns):
            raise ValueError(f"ChunkBroker origin_ns = {origin_ns!r}: expected an integer <= produced_ns {produced_ns}")
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
            self._origin_ns = produced_ns if origin_ns is None else int(origin_ns)
            self._frame_seq = frame_seq
            self._frame_stamp_ns = frame_stamp_ns
            self._level = level
            self._timing_ms = timing_ms
            self._tokens_refreshed = tokens_refreshed
            self._reuse_ratio = reuse_ratio
            self._denoising_steps = denoising_steps
            self.offered += 1
            self.late_offers += int(late)
        return True

    def post_status(self, status: Mapping, stamp_ns: int) -> None:
        """The worker's figures for the health message (kept by reference: do not mutate them afterwards)."""
        with self._lock:
            self._status, self._status_ns = status, stamp_ns

    def status(self) -> tuple[Mapping | None, int]:
        """The worker's latest posted figures and when it took them (None, 0 before any)."""
        with self._lock:
            return self._status, self._status_ns

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
                elapsed = now_ns - self._origin_ns
                step = elapsed // self.period_ns if elapsed > 0 else 0
                first = (now_ns - self._produced_ns) // self.period_ns <= 0  # within a period of production
                if fresh and first and step < self.horizon:
                    status = TickStatus.FRESH
                    # a tick due before the chunk was produced (the publisher woke late) plays the chunk's first
                    # step: the steps count from that tick, so the next one plays the step after it, not it again
                    early = max(0, self._produced_ns - now_ns)
                    self._produced_ns -= early
                    self._origin_ns -= early
                elif step < self.horizon and now_ns - self._produced_ns <= self.max_age_ns:
                    status = TickStatus.CHUNK
            self.ticks[status] += 1
            if status is TickStatus.FALLBACK:
                self._reader = None
                action = self._fallback
                if self._hold is not None:
                    np.copyto(self._fallback_held, self._played, where=self._hold)
                    action = self._fallback_held_view
                return TickOutput(status, action, None, None, self._frame_seq, self._frame_stamp_ns,
                                  self._level, self._timing_ms, self._tokens_refreshed, self._reuse_ratio)
            self._reader = slot
            if self._hold is not None:
                np.copyto(self._played, self._rows[slot][step])
            return TickOutput(status, self._rows[slot][step], self._chunks[slot], step, self._frame_seq,
                              self._frame_stamp_ns, self._level, self._timing_ms, self._tokens_refreshed,
                              self._reuse_ratio, self._denoising_steps)
