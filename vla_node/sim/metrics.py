"""How a drive went, from the ground truth at every control tick: lateral error, lane departures, collisions, speed
tracking and instruction compliance, plus a decimated trace for the bird's-eye view.

- Lateral error: |d - the goal lane's centre|, over the ticks outside lane changes (where the goal is that lane);
  after a lane change, from when the car has settled in its new lane (within SETTLED_M of its centre, or
  SETTLE_S after the change ended).
- A lane departure: the car's body leaves its allowed band (the goal lane; during a lane change and while the car
  settles after it, the origin and target lanes together), counted once per excursion; `departures_at_speed`
  counts those that began above DEPARTURE_SPEED_MPS (a car rolling to a stop over a line is not a car leaving its
  lane at speed).
- A collision: the body starts to overlap another vehicle's (once per contact).
- Speed tracking: |speed - the goal speed|, over ticks at least SPEED_SETTLE_S after the goal speed changed.
- Instructions: `keep the lane` succeeds without a departure or collision during it; a lane change when the car
  crossed into its target lane in time (scenario.py) without a departure or collision; `slow down` when its speed from
  SLOW_JUDGE_AFTER_S on stayed within SLOW_TOLERANCE_MPS of the slow speed on average.
"""

from __future__ import annotations

import math

import numpy as np

from vla_node.sim.env import SimConfig, Truth
from vla_node.sim.instructions import KEEP, LEFT, SLOW, Goal
from vla_node.sim.road import Road
from vla_node.sim.scenario import InstructionGiver

DEPARTURE_SPEED_MPS = 3.0
SETTLED_M = 0.3
SETTLE_S = 6.0
SPEED_SETTLE_S = 8.0
SLOW_JUDGE_AFTER_S = 6.0
SLOW_TOLERANCE_MPS = 2.0
TRACE_HZ = 10.0


class DriveMetrics:
    def __init__(self, config: SimConfig, road: Road) -> None:
        self.config, self.road = config, road
        self.half_width = config.vehicle.width_m / 2
        self.lateral: list[float] = []
        self.speed_error: list[float] = []
        self.departures = 0
        self.departures_at_speed = 0
        self.departure_ticks = 0
        self.collisions = 0
        self.ticks = 0
        self.statuses: dict[str, int] = {}
        self._out = False
        self._touching = False
        self._speed_goal: tuple[float, float] | None = None  # (goal speed, since when)
        self._spans: list[tuple[float, int, int]] = []  # per issued instruction: (start t, departures, collisions)
        self._slow_samples: dict[int, list[float]] = {}
        self._settled: set[int] = set()  # issued instructions (by index) whose car has settled in its lane
        self._trace_every = max(1, round(config.control_hz / TRACE_HZ))
        self.trace: dict[str, list[float]] = {k: [] for k in ("t", "x", "y", "s", "d", "speed", "steer", "accel")}
        self.events: list[tuple[float, str, float, float]] = []  # (t, what, x, y)
        self.first: Truth | None = None
        self.last: Truth | None = None

    def _band(self, goal: Goal, settling: bool) -> tuple[float, float]:
        """(right, left) d limits of the allowed band for the car's centre."""
        lanes = (goal.lane, goal.origin_lane) if goal.instruction == LEFT or settling else (goal.lane,)
        w = self.road.lane_width
        left = max(self.road.lane_offset(i) for i in lanes) + w / 2 - self.half_width
        right = min(self.road.lane_offset(i) for i in lanes) - w / 2 + self.half_width
        return right, left

    def record(self, truth: Truth, giver: InstructionGiver, action: np.ndarray, status: str | None = None) -> None:
        """One control tick: the world after it, the instructions so far, the action applied and its status."""
        goal = giver.goal
        index = len(giver.issued) - 1
        while len(self._spans) <= index:
            self._spans.append((truth.t, self.departures, self.collisions))
        self.first = self.first or truth
        self.last = truth
        self.ticks += 1
        if status is not None:
            self.statuses[status] = self.statuses.get(status, 0) + 1
        error = abs(truth.d - self.road.lane_offset(goal.lane))
        if goal.origin_lane == goal.lane or error < SETTLED_M or truth.t - goal.since_s >= SETTLE_S:
            self._settled.add(index)
        settling = index not in self._settled
        if goal.instruction != LEFT and not settling:
            self.lateral.append(error)
        right, left = self._band(goal, settling)
        out = not (right <= truth.d <= left)
        if out and not self._out:
            self.departures += 1
            self.departures_at_speed += truth.speed > DEPARTURE_SPEED_MPS
            self.events.append((truth.t, "departure", truth.x, truth.y))
        self._out = out
        self.departure_ticks += out
        if truth.collision and not self._touching:
            self.collisions += 1
            self.events.append((truth.t, "collision", truth.x, truth.y))
        self._touching = truth.collision
        if self._speed_goal is None or self._speed_goal[0] != goal.speed:
            self._speed_goal = (goal.speed, truth.t)
        if truth.t - self._speed_goal[1] >= SPEED_SETTLE_S:
            self.speed_error.append(abs(truth.speed - goal.speed))
        if goal.instruction == SLOW and truth.t - goal.since_s >= SLOW_JUDGE_AFTER_S:
            self._slow_samples.setdefault(index, []).append(truth.speed)
        if self.ticks % self._trace_every == 1 or self._trace_every == 1:
            for key, value in (("t", truth.t), ("x", truth.x), ("y", truth.y), ("s", truth.s), ("d", truth.d),
                               ("speed", truth.speed), ("steer", float(action[0])), ("accel", float(action[1]))):
                self.trace[key].append(float(value))

    def instructions(self, giver: InstructionGiver) -> list[dict]:
        """Per instruction given: what, when, until when, whether it succeeded and why not."""
        rows = []
        end_t = self.last.t if self.last is not None else 0.0
        for index, issued in enumerate(giver.issued):
            start, deps0, cols0 = self._spans[index] if index < len(self._spans) else (issued.at_s, 0, 0)
            if index + 1 < len(self._spans):
                _, deps1, cols1 = self._spans[index + 1]
            else:
                deps1, cols1 = self.departures, self.collisions
            departures, collisions = deps1 - deps0, cols1 - cols0
            ended = issued.ended_s if issued.ended_s is not None else end_t
            row = {"instruction": issued.instruction, "at_s": round(issued.at_s, 3), "until_s": round(ended, 3),
                   "lane": issued.goal.lane, "speed_mps": issued.goal.speed, "departures": departures,
                   "collisions": collisions}
            if issued.instruction == KEEP:
                row["success"] = departures == 0 and collisions == 0
            elif issued.instruction == LEFT:
                row["arrived_s"] = None if issued.arrived_s is None else round(issued.arrived_s - issued.at_s, 3)
                row["success"] = issued.arrived_s is not None and departures == 0 and collisions == 0
            else:
                speeds = self._slow_samples.get(index)
                mean_error = None if not speeds else float(np.mean(np.abs(np.asarray(speeds) - issued.goal.speed)))
                row["speed_error_mps"] = mean_error
                row["success"] = mean_error is not None and mean_error <= SLOW_TOLERANCE_MPS and collisions == 0
            rows.append(row)
        return rows

    def summary(self, giver: InstructionGiver) -> dict:
        rows = self.instructions(giver)
        last = self.last
        return {
            "seconds": round(last.t, 3) if last is not None else 0.0,
            "distance_m": round(last.s - self.first.s, 1) if last is not None else 0.0,
            "lateral_error_mean_m": float(np.mean(self.lateral)) if self.lateral else math.nan,
            "lateral_error_max_m": float(np.max(self.lateral)) if self.lateral else math.nan,
            "lane_departures": self.departures,
            "departures_at_speed": self.departures_at_speed,
            "seconds_out_of_lane": round(self.departure_ticks * self.config.dt, 3),
            "collisions": self.collisions,
            "speed_error_mean_mps": float(np.mean(self.speed_error)) if self.speed_error else math.nan,
            "instruction_success": float(np.mean([r["success"] for r in rows])) if rows else math.nan,
            "instructions": rows,
            "skipped_instructions": [{"instruction": c.instruction, "at_s": c.at_s} for c in giver.skipped],
            "left_road": bool(last.left_road) if last is not None else False,
            "final_speed_mps": round(last.speed, 3) if last is not None else 0.0,
            "status_counts": dict(sorted(self.statuses.items())),
        }


SUMS = ("lane_departures", "departures_at_speed", "collisions")
MEANS = ("lateral_error_mean_m", "instruction_success", "speed_error_mean_mps", "final_speed_mps")


def aggregate(summaries: list[dict]) -> dict:
    """Several drives' summaries as one: departures and collisions summed, the largest lateral error, the mean of the
    other figures (a figure no drive measured: NaN), and how many drives left the road."""
    out: dict = {}
    for key in (*MEANS[:1], "lateral_error_max_m", *SUMS, *MEANS[1:]):
        values = [d[key] for d in summaries if d.get(key) is not None and not (isinstance(d[key], float)
                                                                               and math.isnan(d[key]))]
        if key in SUMS:
            out[key] = int(sum(values))
        elif not values:
            out[key] = math.nan
        else:
            out[key] = float(max(values)) if key == "lateral_error_max_m" else float(np.mean(values))
    out["left_road"] = sum(bool(d["left_road"]) for d in summaries)
    return out
