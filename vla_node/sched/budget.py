"""Frame budgets and stage cost estimates: the time model the deadline scheduler plans with.

`CostModel` keeps recent durations per stage variant in preallocated rings and estimates a quantile times a
safety margin. `Budget` is one frame's time: the worker asks `fits(stage, now_ns)` before a stage and between
its pieces, and `stop`s a stage that will not finish (nothing committed); `outcome()` is what
`Scheduler.finish_frame` records. Pure logic: every call takes `now_ns` (CLOCK_MONOTONIC ns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from vla_node.validate import did_you_mean, is_int, is_number, require

STAGES: tuple[str, ...] = ("text", "vision", "action")  # the order a frame runs them in
NS_PER_MS = 1_000_000
MAX_HISTORY = 4096
# Every allowed stage sequence of one frame: the subsequences of STAGES.
_STAGE_ORDERS = frozenset(tuple(s for i, s in enumerate(STAGES) if mask >> i & 1) for mask in range(8))


class CostModel:
    """Recent durations per stage variant in preallocated rings; estimate = quantile x safety margin.

    The quantile is nearest-rank (numpy's "inverted_cdf"): the smallest sample with at least that fraction of
    the samples at or below it. Before any sample (or after `reset`) the stage's prior stands in for it."""

    def __init__(self, prior_ns: Mapping[str, int], *, history: int = 32, quantile: float = 0.9,
                 safety_margin: float = 1.2) -> None:
        require(len(prior_ns) > 0, "prior_ns", dict(prior_ns), "at least one stage")
        for stage, ns in prior_ns.items():
            require(is_int(ns) and ns >= 0, f"prior_ns.{stage}", ns, "an integer number of ns >= 0")
        require(is_int(history) and 1 <= history <= MAX_HISTORY, "history", history,
                f"an integer in [1, {MAX_HISTORY}]")
        require(is_number(quantile) and 0 < quantile <= 1, "quantile", quantile, "a quantile in (0, 1]")
        require(is_number(safety_margin) and safety_margin >= 1, "safety_margin", safety_margin,
                "a finite number >= 1")
        self.stages: tuple[str, ...] = tuple(prior_ns)
        self.history = history
        self.quantile = float(quantile)
        self.safety_margin = float(safety_margin)
        self._row = {stage: i for i, stage in enumerate(self.stages)}
        self._prior = [int(prior_ns[stage]) for stage in self.stages]
        self._ring = np.zeros((len(self.stages), history), dtype=np.int64)  # [stages, history]
        self._count = [0] * len(self.stages)
        self._head = [0] * len(self.stages)
        self._quantile: list[int | None] = [None] * len(self.stages)  # cached until the next record/reset
        self._scratch = np.empty(history, dtype=np.int64)

    def _index(self, stage: str) -> int:
        row = self._row.get(stage)
        if row is None:
            raise ValueError(f"stage {stage!r}: expected one of {list(self.stages)}{did_you_mean(stage, self.stages)}")
        return row

    def record(self, stage: str, ns: int) -> None:
        """One measured duration; the oldest sample of the stage is overwritten once `history` are held."""
        row = self._index(stage)
        if not (is_int(ns) and ns >= 0):
            raise ValueError(f"duration of {stage!r} = {ns!r}: expected an integer number of ns >= 0")
        self._ring[row, self._head[row]] = ns
        self._head[row] = (self._head[row] + 1) % self.history
        self._count[row] = min(self._count[row] + 1, self.history)
        self._quantile[row] = None

    def count(self, stage: str) -> int:
        """Samples held for the stage (at most `history`)."""
        return self._count[self._index(stage)]

    def reset(self, stage: str) -> None:
        """Forget the stage's samples: its prior applies again."""
        row = self._index(stage)
        self._count[row] = 0
        self._head[row] = 0
        self._quantile[row] = None

    def prior_ns(self, stage: str) -> int:
        return self._prior[self._index(stage)]

    def quantile_ns(self, stage: str, prior_scale: float = 1.0) -> int:
        """The configured quantile of the held samples, or the prior x prior_scale when there are none."""
        row = self._index(stage)
        n = self._count[row]
        if n == 0:
            return math.ceil(self._prior[row] * prior_scale)
        cached = self._quantile[row]
        if cached is None:
            rank = max(0, min(n - 1, math.ceil(self.quantile * n - 1e-9) - 1))
            window = self._scratch[:n]
            window[:] = self._ring[row, :n]
            window.partition(rank)
            cached = self._quantile[row] = int(window[rank])
        return cached

    def estimate(self, stage: str, prior_scale: float = 1.0) -> int:
        """Predicted duration in ns: quantile x safety margin, rounded up; with no samples the prior (times
        `prior_scale`, e.g. how much slower than its prior the machine runs now) stands in for the quantile."""
        return math.ceil(self.quantile_ns(stage, prior_scale) * self.safety_margin)


@dataclass(frozen=True)
class StageRun:
    """One stage of one frame: how long it ran and how much of it was done (1.0: completed, committed). `within`:
    the stage ran inside that other stage's work (the action tick in its frame's vision pass): its time is counted
    there, so it has no duration of its own and is no sample of its cost."""

    stage: str
    elapsed_ns: int
    fraction_done: float = 1.0
    within: str | None = None

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"StageRun.stage = {self.stage!r}: expected one of {list(STAGES)}")
        if not (is_int(self.elapsed_ns) and self.elapsed_ns >= 0):
            raise ValueError(f"StageRun.elapsed_ns = {self.elapsed_ns!r}: expected an integer number of ns >= 0")
        if not (is_number(self.fraction_done) and 0 <= self.fraction_done <= 1):
            raise ValueError(f"StageRun.fraction_done = {self.fraction_done!r}: expected a fraction in [0, 1]")
        if self.within is not None and (self.within not in STAGES or self.within == self.stage or self.elapsed_ns):
            raise ValueError(f"StageRun.within = {self.within!r} for {self.stage!r} ({self.elapsed_ns} ns): expected "
                             f"None or another stage of {list(STAGES)}, with elapsed_ns 0")

    @property
    def completed(self) -> bool:
        return self.fraction_done >= 1.0


@dataclass(frozen=True)
class FrameOutcome:
    """What a frame's stages did. `produced`: the action stage completed, so a chunk was made."""

    runs: tuple[StageRun, ...] = ()

    @property
    def produced(self) -> bool:
        return any(run.stage == "action" and run.completed for run in self.runs)

    def timing_ms(self) -> dict[str, float]:
        """Elapsed ms per stage that ran on its own (for the action message's `timing_ms`): a stage that ran within
        another is counted in that one's."""
        return {run.stage: run.elapsed_ns / NS_PER_MS for run in self.runs if run.within is None}


class Budget:
    """One frame's time: the deadline and the estimated cost of each planned stage, in run order.

    `fits(stage, now)` asks whether the stage (or the `fraction_left` of it still to do) can finish while
    leaving the estimated time of the planned stages after it; once the action stage has begun it must also end
    within `action_deadline_ns` of its start. `begin`/`end`/`stop` record what happened; `stop` means "stopped
    early, nothing committed": the caller discards the partial result."""

    def __init__(self, start_ns: int, deadline_ns: int, estimates_ns: Mapping[str, int],
                 action_deadline_ns: int | None = None) -> None:
        stages = tuple(estimates_ns)
        if stages not in _STAGE_ORDERS:
            raise ValueError(f"Budget stages {stages}: expected distinct stages in the order {list(STAGES)}")
        for stage in stages:
            if not (is_int(estimates_ns[stage]) and estimates_ns[stage] >= 0):
                raise ValueError(f"Budget estimate of {stage} = {estimates_ns[stage]!r}: expected an integer "
                                 "number of ns >= 0")
        self.start_ns = start_ns
        self.deadline_ns = deadline_ns
        self.action_deadline_ns = action_deadline_ns
        self.stages: tuple[str, ...] = stages
        self._estimate = dict(estimates_ns)
        self._latest_end: dict[str, int] = {}
        reserve = 0
        for stage in reversed(stages):  # each stage must end early enough for the planned ones after it
            self._latest_end[stage] = deadline_ns - reserve
            reserve += estimates_ns[stage]
        self._began: dict[str, int] = {}
        self._runs: list[StageRun] = []

    @property
    def total_ns(self) -> int:
        return self.deadline_ns - self.start_ns

    def remaining(self, now_ns: int) -> int:
        return self.deadline_ns - now_ns

    def estimate(self, stage: str) -> int:
        self._planned(stage)
        return self._estimate[stage]

    def latest_end_ns(self, stage: str) -> int:
        """When the stage must be done by, leaving the planned stages after it their estimated time."""
        self._planned(stage)
        latest = self._latest_end[stage]
        began = self._began.get(stage)
        if stage == "action" and began is not None and self.action_deadline_ns is not None:
            latest = min(latest, began + self.action_deadline_ns)
        return latest

    def fits(self, stage: str, now_ns: int, fraction_left: float = 1.0) -> bool:
        """Can the stage's remaining `fraction_left` of work end by `latest_end_ns(stage)`?"""
        latest = self.latest_end_ns(stage)
        if not 0 <= fraction_left <= 1:
            raise ValueError(f"fraction_left = {fraction_left!r}: expected a fraction in [0, 1]")
        return now_ns + self._estimate[stage] * fraction_left <= latest

    def begin(self, stage: str, now_ns: int) -> None:
        self._planned(stage)
        if stage in self._began:
            raise RuntimeError(f"stage {stage!r} began twice in one frame")
        self._began[stage] = now_ns

    def end(self, stage: str, now_ns: int) -> StageRun:
        """The stage completed: its result may be committed."""
        return self._finish(stage, now_ns, 1.0)

    def done_within(self, stage: str, within: str) -> StageRun:
        """The stage was done inside `within`'s work, which completed (the action tick in its frame's vision
        pass): it completed, with no time of its own."""
        self._planned(stage)
        if not self.completed(within):
            raise RuntimeError(f"stage {stage!r} done within {within!r}, which did not complete")
        if stage in self._began or any(run.stage == stage for run in self._runs):
            raise RuntimeError(f"stage {stage!r} ran twice in one frame")
        self._began[stage] = self._began[within]
        run = StageRun(stage, 0, 1.0, within)
        self._runs.append(run)
        return run

    def stop(self, stage: str, now_ns: int, fraction_done: float) -> StageRun:
        """The stage stopped early after `fraction_done` of its work: discard the partial result."""
        if not 0 <= fraction_done < 1:
            raise ValueError(f"fraction_done = {fraction_done!r}: expected a fraction in [0, 1) (use end())")
        return self._finish(stage, now_ns, fraction_done)

    def _finish(self, stage: str, now_ns: int, fraction_done: float) -> StageRun:
        began = self._began.get(stage)
        if began is None:
            raise RuntimeError(f"stage {stage!r} ended without begin()")
        if any(run.stage == stage for run in self._runs):
            raise RuntimeError(f"stage {stage!r} ended twice in one frame")
        run = StageRun(stage, max(0, now_ns - began), fraction_done)
        self._runs.append(run)
        return run

    def completed(self, stage: str) -> bool:
        return any(run.stage == stage and run.completed for run in self._runs)

    @property
    def runs(self) -> tuple[StageRun, ...]:
        return tuple(self._runs)

    def outcome(self) -> FrameOutcome:
        return FrameOutcome(tuple(self._runs))

    def _planned(self, stage: str) -> None:
        if stage not in self._estimate:
            raise ValueError(f"stage {stage!r} is not planned for this frame; planned: {list(self.stages)}")
