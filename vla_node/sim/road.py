"""The road: a smoothly curving multi-lane centreline in the world plane, with lanes, stations and Frenet coordinates.

World frame: x east, y north (metres), headings counter-clockwise from +x (radians). The road's reference line is
the centre of lane 0, the leftmost; lane i's centre is `lane_offset(i)` = -i * lane_width (d grows to the left, as
in Frenet frames, so the lanes to the right have negative offsets). The curvature along the station s is a sum of a few sinusoids of random wavelength
and phase (bounded by `max_curvature`), so the road bends both ways, smoothly, with straights between: sampled
every `STATION_STEP_M` and integrated once, so a pose at any station is a table lookup.

Everything derives from `seed`: the same config gives the same road bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from vla_node.validate import is_int, is_number, require

STATION_STEP_M = 0.5
MAX_ROAD_M = 100_000.0
BEHIND_M = 50.0  # the table starts this far behind station 0 (the camera looks back never, a vehicle may start there)


@dataclasses.dataclass(frozen=True)
class RoadConfig:
    """lanes: lane count (lane 0 the leftmost); length_m: the stations the road covers ahead of 0; max_curvature:
    the bound of |curvature| (1/m; 1/250 is a 250 m radius, 1.6 m/s^2 of lateral acceleration at 20 m/s)."""

    lanes: int = 3
    lane_width_m: float = 3.6
    length_m: float = 4000.0
    max_curvature: float = 1 / 250
    seed: int = 0

    def __post_init__(self) -> None:
        require(is_int(self.lanes) and 1 <= self.lanes <= 6, "road.lanes", self.lanes, "an integer in 1..6")
        require(is_number(self.lane_width_m) and 2.5 <= self.lane_width_m <= 5.0, "road.lane_width_m",
                self.lane_width_m, "a number of metres in [2.5, 5]")
        require(is_number(self.length_m) and 100 <= self.length_m <= MAX_ROAD_M, "road.length_m", self.length_m,
                f"a number of metres in [100, {MAX_ROAD_M:g}]")
        require(is_number(self.max_curvature) and 0 <= self.max_curvature <= 0.05, "road.max_curvature",
                self.max_curvature, "a curvature in [0, 0.05] (1/m)")
        require(is_int(self.seed) and self.seed >= 0, "road.seed", self.seed, "a non-negative integer")


class Road:
    """Station tables (s, x, y, heading, curvature) every STATION_STEP_M, and the lanes across them."""

    def __init__(self, config: RoadConfig) -> None:
        self.config = config
        rng = np.random.default_rng([config.seed, 11])
        s = np.arange(-BEHIND_M, config.length_m + BEHIND_M + STATION_STEP_M, STATION_STEP_M)  # (N,)
        curvature = np.zeros_like(s)
        weights = rng.uniform(0.3, 1.0, 3)
        for weight, wavelength, phase in zip(weights / weights.sum(), rng.uniform(250, 900, 3), rng.uniform(0, 6.3, 3)):
            curvature += weight * np.sin(2 * math.pi * s / wavelength + phase)
        # straights where the sum is small: a sum below 0.15 (of its largest 1.0) flattens to 0
        curvature = config.max_curvature * np.sign(curvature) * np.clip((np.abs(curvature) - 0.15) / 0.85, 0, 1)
        heading = np.concatenate([[0.0], np.cumsum((curvature[1:] + curvature[:-1]) / 2 * STATION_STEP_M)])
        heading -= np.interp(0.0, s, heading)  # heading 0 (east) at station 0
        dx, dy = np.cos(heading), np.sin(heading)
        x = np.concatenate([[0.0], np.cumsum((dx[1:] + dx[:-1]) / 2 * STATION_STEP_M)])
        y = np.concatenate([[0.0], np.cumsum((dy[1:] + dy[:-1]) / 2 * STATION_STEP_M)])
        x -= np.interp(0.0, s, x)
        y -= np.interp(0.0, s, y)
        self.s, self.x, self.y, self.heading, self.curvature = s, x, y, heading, curvature

    # ---- lanes -------------------------------------------------------------------------------------------

    @property
    def lanes(self) -> int:
        return self.config.lanes

    @property
    def lane_width(self) -> float:
        return self.config.lane_width_m

    def lane_offset(self, lane: int | float) -> float:
        """The lateral offset d (left positive) of lane `lane`'s centre from the reference line (lane 0's centre)."""
        return -float(lane) * self.config.lane_width_m

    def lane_of(self, d: float) -> int:
        """The lane whose span holds offset d, clipped to the road's lanes."""
        return int(min(max(round(-d / self.config.lane_width_m), 0), self.config.lanes - 1))

    @property
    def left_edge(self) -> float:
        """d of the road's left edge (the solid line left of lane 0)."""
        return self.config.lane_width_m / 2

    @property
    def right_edge(self) -> float:
        return self.config.lane_width_m / 2 - self.config.lanes * self.config.lane_width_m

    def boundaries(self) -> np.ndarray:
        """d of every lane line, left edge first: (lanes + 1,), the first and last solid, the rest dashed."""
        return self.left_edge - self.config.lane_width_m * np.arange(self.config.lanes + 1, dtype=np.float64)

    # ---- geometry ----------------------------------------------------------------------------------------

    def check_station(self, s: float) -> None:
        if not self.s[0] <= s <= self.s[-1]:
            raise ValueError(f"station {s:.1f} m: outside the road's {self.s[0]:.0f}..{self.s[-1]:.0f} m "
                             f"(road.length_m {self.config.length_m:g})")

    def pose(self, s: float | np.ndarray, d: float | np.ndarray = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(x, y, heading) of the point at station s, offset d to the left of the reference line."""
        x = np.interp(s, self.s, self.x)
        y = np.interp(s, self.s, self.y)
        heading = np.interp(s, self.s, self.heading)
        return x - d * np.sin(heading), y + d * np.cos(heading), heading

    def curvature_at(self, s: float | np.ndarray) -> np.ndarray:
        return np.interp(s, self.s, self.curvature)

    def frenet(self, x: float, y: float, hint_s: float, window_m: float = 30.0) -> tuple[float, float]:
        """(s, d) of the world point (x, y): the nearest table point within hint_s +- window_m (the caller knows
        roughly where it is: the previous step's station), refined by two Newton steps along the tangent."""
        step = STATION_STEP_M
        lo = max(0, int((hint_s - window_m - self.s[0]) / step))
        hi = min(len(self.s), int((hint_s + window_m - self.s[0]) / step) + 2)
        if hi - lo < 2:
            raise ValueError(f"station hint {hint_s:.1f} m: outside the road's {self.s[0]:.0f}..{self.s[-1]:.0f} m")
        dx, dy = x - self.x[lo:hi], y - self.y[lo:hi]
        i = lo + int(np.argmin(dx * dx + dy * dy))
        s = float(self.s[i])
        for _ in range(2):  # Newton on the tangent's distance: the offset point's arc scales by 1 - curvature d
            px, py, h = self.pose(s)
            along = (x - px) * math.cos(h) + (y - py) * math.sin(h)
            d = -(x - px) * math.sin(h) + (y - py) * math.cos(h)
            s += along / max(1.0 - float(self.curvature_at(s)) * d, 0.1)
        px, py, h = self.pose(s)
        return float(s), float(-(x - px) * math.sin(h) + (y - py) * math.cos(h))
