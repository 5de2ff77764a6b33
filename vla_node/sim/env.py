"""The road simulator: a car on a curving multi-lane road with traffic, stepped at the control rate, seen by its camera.

    env = RoadEnv(SimConfig(seed=3))
    frame = env.frame()                    # HxWx3 uint8, what the forward camera sees now
    env.step(action)                       # [steer, accel] in [-1, 1] for one control period (vehicle.py)
    truth = env.truth()                    # lateral offset, heading error, lane, boundaries, gaps, collision ...

Everything is deterministic by seed: the road (lanes, curvature), its scenery (time of day, shadows, underpasses) and
the traffic derive from `SimConfig.seed`; the car's start from the constructor's arguments. The ground truth comes
from the world, never from the image. The ego's state message (`state_vector`) holds what a car's own sensors know:
speed, wheel angle, acceleration and yaw rate, scaled to about [-1, 1]; nothing about where the lane is.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from vla_node.sim.camera import Camera, CameraConfig, Scenery
from vla_node.sim.road import MAX_ROAD_M, Road, RoadConfig
from vla_node.sim.traffic import Vehicle, make_traffic
from vla_node.sim.vehicle import VehicleConfig, VehicleState, step_vehicle, yaw_rate
from vla_node.validate import is_int, is_number, require

REAR_OVERHANG_M = 0.9  # the body starts this far behind the rear axle
STATE_SPEED_SCALE = 20.0  # m/s
STATE_ACCEL_SCALE = 6.0  # m/s^2
STATE_YAW_RATE_SCALE = 0.5  # rad/s
OFF_ROAD_END_M = 5.0  # a car this far beyond the road's edge has left the road for good: the drive ends
ACTION_DIMS = 2  # [steer, accel] (vehicle.py)
STATE_DIM = 4  # state_vector's values


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """A drive's world. lanes: None draws 2-4 from the seed. cruise/slow: the speeds `keep the lane` and `slow down`
    ask for. traffic_per_km: vehicles per lane and km, in the lanes other than the ego's and the one to its left (a
    lead vehicle each, pulling away: traffic.py)."""

    seed: int = 0
    lanes: int | None = None
    control_hz: float = 50.0
    fps: float = 25.0
    cruise_mps: float = 20.0
    slow_mps: float = 10.0
    traffic_per_km: float = 6.0
    max_curvature: float = 1 / 250
    length_m: float = 4000.0
    palette: str | None = None
    camera: CameraConfig = dataclasses.field(default_factory=CameraConfig)
    vehicle: VehicleConfig = dataclasses.field(default_factory=VehicleConfig)

    def __post_init__(self) -> None:
        require(is_int(self.seed) and self.seed >= 0, "sim.seed", self.seed, "a non-negative integer")
        require(self.lanes is None or (is_int(self.lanes) and 1 <= self.lanes <= 6), "sim.lanes", self.lanes,
                "None or an integer in 1..6")
        require(is_number(self.control_hz) and 1 <= self.control_hz <= 1000, "sim.control_hz", self.control_hz,
                "a rate in [1, 1000] Hz")
        require(is_number(self.fps) and 1 <= self.fps <= self.control_hz, "sim.fps", self.fps,
                f"a rate in [1, control_hz = {self.control_hz}] Hz")
        require(is_number(self.cruise_mps) and 1 <= self.cruise_mps <= 40, "sim.cruise_mps", self.cruise_mps,
                "a speed in [1, 40] m/s")
        require(is_number(self.slow_mps) and 0 <= self.slow_mps < self.cruise_mps, "sim.slow_mps", self.slow_mps,
                f"a speed in [0, cruise_mps = {self.cruise_mps}) m/s")
        require(is_number(self.traffic_per_km) and 0 <= self.traffic_per_km <= 40, "sim.traffic_per_km",
                self.traffic_per_km, "a number in [0, 40]")

    @property
    def dt(self) -> float:
        return 1.0 / self.control_hz

    def length_for(self, seconds: float) -> float:
        """A road long enough for `seconds` of driving at the car's top speed (it cannot run out)."""
        return max(self.length_m, self.vehicle.max_speed * seconds + 300.0)

    def max_seconds(self) -> float:
        """The longest drive a road can be built for (road.length_m's bound, at the car's top speed)."""
        return (MAX_ROAD_M - 300.0) / self.vehicle.max_speed


@dataclasses.dataclass(frozen=True)
class Truth:
    """Where the car is, from the world (metres, radians, m/s; d and offsets left-positive)."""

    t: float
    x: float
    y: float
    heading: float
    s: float
    d: float
    lane: int  # the lane whose span holds the car's centre
    heading_error: float  # car heading - road heading, wrapped to (-pi, pi]
    speed: float
    lane_left: float  # d of the current lane's left line
    lane_right: float  # d of its right line
    lead_gap_m: float  # bumper to bumper, to the nearest vehicle ahead that overlaps the car sideways (inf: none)
    nearest_m: float  # centre to centre, to the nearest vehicle (inf: none)
    collision: bool  # the car's body overlaps another vehicle's
    off_road: bool  # part of the car is beyond the road's edge lines
    left_road: bool  # the car is more than OFF_ROAD_END_M beyond an edge: the drive cannot go on


def wrap_angle(a: float) -> float:
    return (a + math.pi) % (2 * math.pi) - math.pi


class RoadEnv:
    """One drive: its road, scenery, traffic, camera and the ego car. `ego_lane` None: a lane with a lane to its
    left (any lane on a one-lane road), drawn from the seed; offset_m, heading_error: the start's deviation from
    that lane's centre line; speed None: the cruise speed."""

    def __init__(self, config: SimConfig, *, ego_lane: int | None = None, offset_m: float = 0.0,
                 heading_error: float = 0.0, speed: float | None = None, start_s: float = 0.0,
                 seconds: float = 120.0) -> None:
        self.config = config
        rng = np.random.default_rng([config.seed, 31])
        lanes = config.lanes if config.lanes is not None else int(rng.integers(2, 5))
        self.road = Road(RoadConfig(lanes=lanes, length_m=config.length_for(seconds),
                                    max_curvature=config.max_curvature, seed=config.seed))
        self.scenery = Scenery(self.road, config.seed, config.palette)
        self.camera = Camera(config.camera, self.road, self.scenery)
        if ego_lane is None:
            ego_lane = int(rng.integers(1, lanes)) if lanes > 1 else 0
        require(is_int(ego_lane) and 0 <= ego_lane < lanes, "ego_lane", ego_lane, f"a lane in 0..{lanes - 1}")
        free_lanes = (ego_lane, ego_lane - 1) if ego_lane > 0 else (ego_lane,)
        self.traffic: list[Vehicle] = make_traffic(self.road, rng, free_lanes, start_s, config.cruise_mps,
                                                   config.traffic_per_km)
        x, y, road_heading = self.road.pose(start_s, self.road.lane_offset(ego_lane) + offset_m)
        self.ego = VehicleState(float(x), float(y), float(road_heading) + heading_error,
                                config.cruise_mps if speed is None else float(speed))
        self.t = 0.0
        self.steps = 0
        self.s, self.d = self.road.frenet(self.ego.x, self.ego.y, start_s)

    @property
    def dt(self) -> float:
        return self.config.dt

    def step(self, action) -> None:
        """Advance one control period under `action` ([steer, accel], vehicle.py)."""
        self.ego = step_vehicle(self.config.vehicle, self.ego, action, self.dt)
        self.steps += 1
        self.t = self.steps * self.dt
        self.s, self.d = self.road.frenet(self.ego.x, self.ego.y, self.s)

    def frame(self) -> np.ndarray:
        return self.camera.render(self.ego, self.s, self.traffic, self.t)

    def state_vector(self) -> np.ndarray:
        """The state message's values: speed, wheel angle, acceleration, yaw rate, each scaled to about [-1, 1]."""
        vehicle = self.config.vehicle
        return np.array([self.ego.speed / STATE_SPEED_SCALE, self.ego.steer / vehicle.max_steer_rad,
                         self.ego.accel / STATE_ACCEL_SCALE, yaw_rate(vehicle, self.ego) / STATE_YAW_RATE_SCALE],
                        np.float32)

    def body_station(self) -> float:
        """Station of the car body's centre (the rear axle is at self.s)."""
        return self.s + self.config.vehicle.length_m / 2 - REAR_OVERHANG_M

    def truth(self) -> Truth:
        road, vehicle = self.road, self.config.vehicle
        _, _, road_heading = road.pose(self.s)
        lane = road.lane_of(self.d)
        centre = road.lane_offset(lane)
        body_s = self.body_station()
        lead, nearest, collision = math.inf, math.inf, False
        for v in self.traffic:
            ds = v.station(self.t) - body_s
            dd = v.offset(road, self.t) - self.d
            nearest = min(nearest, math.hypot(ds, dd))
            beside = abs(dd) < (v.width_m + vehicle.width_m) / 2
            if beside and abs(ds) < (v.length_m + vehicle.length_m) / 2:
                collision = True
            elif beside and ds > 0:
                lead = min(lead, ds - (v.length_m + vehicle.length_m) / 2)
        half = vehicle.width_m / 2
        beyond = max(self.d + half - road.left_edge, road.right_edge - (self.d - half))
        return Truth(
            t=self.t, x=self.ego.x, y=self.ego.y, heading=self.ego.heading, s=self.s, d=self.d, lane=lane,
            heading_error=wrap_angle(self.ego.heading - float(road_heading)), speed=self.ego.speed,
            lane_left=centre + road.lane_width / 2, lane_right=centre - road.lane_width / 2, lead_gap_m=lead,
            nearest_m=nearest, collision=collision, off_road=beyond > 0, left_road=beyond > OFF_ROAD_END_M + half,
        )
