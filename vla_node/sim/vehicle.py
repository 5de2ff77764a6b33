"""The ego vehicle: a kinematic bicycle model with steering and speed actuators, and the action's meaning.

An action is the model's [steer, accel], each in [-1, 1] (the bins head's range): steer x `max_steer_rad` is the
front wheel angle commanded (positive: left), accel x `max_accel` (>= 0) or x `max_brake` (< 0) the longitudinal
acceleration commanded (m/s^2). The actuators follow: the wheel angle at most `steer_rate` rad/s toward its
command, the acceleration through a first-order lag of `accel_lag_s`. The rear-axle kinematic bicycle then moves:

    x' = v cos(psi)    y' = v sin(psi)    psi' = v tan(delta) / wheelbase    v' = a  (v >= 0: it stops, never reverses)

integrated with a midpoint step of dt (the control period). Inputs outside [-1, 1] are clipped (the flow head's
values are unclipped on the wire); a non-finite input is refused by name.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from vla_node.validate import is_number, require


@dataclasses.dataclass(frozen=True)
class VehicleConfig:
    wheelbase_m: float = 2.7
    length_m: float = 4.6
    width_m: float = 1.8
    max_steer_rad: float = 0.12  # action steer 1.0: a 22.6 m radius; a 250 m curve needs a tenth of it
    steer_rate: float = 0.4  # rad/s the front wheels turn at most
    max_accel: float = 3.0  # m/s^2 at accel = 1
    max_brake: float = 6.0  # m/s^2 at accel = -1
    accel_lag_s: float = 0.15
    max_speed: float = 40.0

    def __post_init__(self) -> None:
        for key in ("wheelbase_m", "length_m", "width_m", "max_steer_rad", "steer_rate", "max_accel", "max_brake",
                    "accel_lag_s", "max_speed"):
            value = getattr(self, key)
            require(is_number(value) and value > 0, f"vehicle.{key}", value, "a finite number > 0")


@dataclasses.dataclass
class VehicleState:
    """The ego's pose (rear axle, world frame), speed (m/s), front wheel angle (rad) and acceleration (m/s^2)."""

    x: float
    y: float
    heading: float
    speed: float
    steer: float = 0.0
    accel: float = 0.0

    def copy(self) -> "VehicleState":
        return dataclasses.replace(self)


def check_action(action) -> tuple[float, float]:
    """(steer, accel) clipped to [-1, 1] from any 2 finite numbers; anything else raises naming it."""
    values = np.asarray(action, dtype=np.float64).reshape(-1)
    if values.shape != (2,) or not np.isfinite(values).all():
        raise ValueError(f"action {values.tolist()}: expected 2 finite numbers (steer, accel)")
    return float(np.clip(values[0], -1, 1)), float(np.clip(values[1], -1, 1))


def commanded_accel(config: VehicleConfig, accel: float) -> float:
    return accel * (config.max_accel if accel >= 0 else config.max_brake)


def step_vehicle(config: VehicleConfig, state: VehicleState, action, dt: float) -> VehicleState:
    """The state after dt seconds under `action` (a new object; `state` is not changed)."""
    steer_cmd, accel_cmd = check_action(action)
    target = steer_cmd * config.max_steer_rad
    max_turn = config.steer_rate * dt
    steer = state.steer + min(max(target - state.steer, -max_turn), max_turn)
    accel = state.accel + (commanded_accel(config, accel_cmd) - state.accel) * min(dt / config.accel_lag_s, 1.0)
    speed = min(max(state.speed + accel * dt, 0.0), config.max_speed)
    mean_speed = (state.speed + speed) / 2
    mean_steer = (state.steer + steer) / 2
    yaw_rate = mean_speed * math.tan(mean_steer) / config.wheelbase_m
    mid_heading = state.heading + yaw_rate * dt / 2
    return VehicleState(
        x=state.x + mean_speed * math.cos(mid_heading) * dt,
        y=state.y + mean_speed * math.sin(mid_heading) * dt,
        heading=state.heading + yaw_rate * dt,
        speed=speed,
        steer=steer,
        accel=accel if speed > 0 or accel > 0 else 0.0,
    )


def yaw_rate(config: VehicleConfig, state: VehicleState) -> float:
    return state.speed * math.tan(state.steer) / config.wheelbase_m
