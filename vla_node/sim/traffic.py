"""Other vehicles: each keeps its lane at its own constant speed, swaying a little within it.

A vehicle's station at time t is s0 + speed * t and its lateral offset its lane's centre plus a slow sway, so any
instant can be evaluated on its own (no state to step). They do not react to the ego: a collision is the ego's.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from vla_node.sim.paint import VEHICLE_COLOURS
from vla_node.sim.road import Road


@dataclasses.dataclass(frozen=True)
class Vehicle:
    lane: int
    s0: float  # station at t = 0 (m, its centre)
    speed: float  # m/s
    length_m: float
    width_m: float
    height_m: float
    colour: np.ndarray  # (3,) float32
    sway_m: float
    sway_period_s: float
    sway_phase: float

    def station(self, t: float) -> float:
        return self.s0 + self.speed * t

    def offset(self, road: Road, t: float) -> float:
        """Its lateral offset d at time t (left positive)."""
        sway = self.sway_m * math.sin(2 * math.pi * t / self.sway_period_s + self.sway_phase)
        return road.lane_offset(self.lane) + sway


def make_traffic(road: Road, rng: np.random.Generator, free_lanes: tuple[int, ...], ego_s: float,
                 cruise_mps: float, density_per_km: float) -> list[Vehicle]:
    """Traffic in every lane but `free_lanes` (the ego's and the one it may change into): about `density_per_km`
    vehicles per lane and km at 0.8-1.2x the cruise speed, none within 25 m of the ego at t = 0; in each free lane
    one lead vehicle 60-150 m ahead, faster than the cruise speed (it pulls away). So the ego meets another vehicle
    only by leaving its lanes: a collision is a departure into traffic."""
    vehicles = []
    length = road.config.length_m
    for lane in range(road.lanes):
        if lane in free_lanes:
            s0 = ego_s + float(rng.uniform(60, 150))
            vehicles.append(_vehicle(rng, lane, s0, cruise_mps + float(rng.uniform(2, 5))))
            continue
        count = rng.poisson(density_per_km * length / 1000)
        for s0 in np.sort(rng.uniform(-40, length, count)):
            if abs(s0 - ego_s) < 25:
                continue
            vehicles.append(_vehicle(rng, lane, float(s0), cruise_mps * float(rng.uniform(0.8, 1.2))))
    return vehicles


def _vehicle(rng: np.random.Generator, lane: int, s0: float, speed: float) -> Vehicle:
    truck = rng.random() < 0.15
    return Vehicle(
        lane=lane, s0=s0, speed=speed,
        length_m=float(rng.uniform(9, 14) if truck else rng.uniform(4.2, 4.9)),
        width_m=float(rng.uniform(2.4, 2.6) if truck else rng.uniform(1.7, 2.0)),
        height_m=float(rng.uniform(3.0, 3.8) if truck else rng.uniform(1.3, 1.7)),
        colour=VEHICLE_COLOURS[int(rng.integers(0, len(VEHICLE_COLOURS)))],
        sway_m=float(rng.uniform(0.05, 0.3)), sway_period_s=float(rng.uniform(4, 10)),
        sway_phase=float(rng.uniform(0, 2 * math.pi)),
    )
