"""The expert driver behaviour cloning learns from: pure pursuit on the true centre of the goal lane, and a speed
controller toward the goal speed.

Pure pursuit (Coulter 1992): a target point on the goal lane's centre line a lookahead distance L ahead; the front
wheel angle that puts the rear axle on a circle through it is atan(2 wheelbase y / l^2), with y the target's
lateral offset in the car's frame and l its distance. L grows with speed (lookahead_s x speed, bounded); a lane
change looks `change_lookahead_s` ahead instead, which makes the manoeuvre gentle (about 1 m/s^2 of lateral
acceleration at 20 m/s). Speed: an acceleration command proportional to the speed error, bounded.

It reads the world (road, goal, the car's true pose): it is the teacher, not a policy that could run on a car.
`expert_chunk` rolls a copy of the car forward under the expert for a chunk's steps: the label of one frame.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from vla_node.sim.instructions import LEFT, Goal
from vla_node.sim.road import Road
from vla_node.sim.vehicle import VehicleConfig, VehicleState, step_vehicle


@dataclasses.dataclass(frozen=True)
class ExpertConfig:
    lookahead_s: float = 1.0
    lookahead_min_m: float = 8.0
    lookahead_max_m: float = 30.0
    change_lookahead_s: float = 2.5
    change_lookahead_min_m: float = 20.0
    speed_gain: float = 0.25  # accel command per m/s of speed error
    max_accel_cmd: float = 0.5


def expert_action(config: ExpertConfig, road: Road, vehicle: VehicleConfig, ego: VehicleState, s: float,
                  goal: Goal) -> np.ndarray:
    """[steer, accel] in [-1, 1] for the car at `ego` (station s) toward `goal`."""
    if goal.instruction == LEFT:
        lookahead = max(config.change_lookahead_s * ego.speed, config.change_lookahead_min_m)
    else:
        lookahead = min(max(config.lookahead_s * ego.speed, config.lookahead_min_m), config.lookahead_max_m)
    tx, ty, _ = road.pose(s + lookahead, road.lane_offset(goal.lane))
    dx, dy = float(tx) - ego.x, float(ty) - ego.y
    left = -dx * math.sin(ego.heading) + dy * math.cos(ego.heading)  # the target's offset left of the car's axis
    wheel = math.atan2(2 * vehicle.wheelbase_m * left, dx * dx + dy * dy)
    steer = min(max(wheel / vehicle.max_steer_rad, -1.0), 1.0)
    accel = min(max(config.speed_gain * (goal.speed - ego.speed), -config.max_accel_cmd), config.max_accel_cmd)
    return np.array([steer, accel], np.float32)


def expert_chunk(config: ExpertConfig, road: Road, vehicle: VehicleConfig, ego: VehicleState, s: float,
                 goal: Goal, horizon: int, dt: float) -> np.ndarray:
    """The expert's next `horizon` actions [H, 2] from `ego`, each applied for dt (the control period)."""
    chunk = np.empty((horizon, 2), np.float32)
    state = ego
    for i in range(horizon):
        chunk[i] = expert_action(config, road, vehicle, state, s, goal)
        state = step_vehicle(vehicle, state, chunk[i], dt)
        s, _ = road.frenet(state.x, state.y, s)
    return chunk
