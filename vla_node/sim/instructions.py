"""The instructions a driving policy follows, and the goal each sets: the lane to be in and the speed to hold.

    keep the lane              stay in the lane the car is in, at the cruise speed
    change to the left lane    move to the lane left of the one the car is in, at the cruise speed
    slow down                  stay in the lane the car is in, at the slow speed

The goal is fixed when the instruction is given (a lane change's target lane does not move while the car crosses
into it). A lane change is over once the car is in its target lane (scenario.py): `keep the lane` then centres it
there, so `change to the left lane` is only ever asked of a car still in the lane it leaves, and one look at the road
says which way to steer. Each text fits the tiny preset's text partition (23 bytes after BOS).
"""

from __future__ import annotations

import dataclasses

KEEP = "keep the lane"
LEFT = "change to the left lane"
SLOW = "slow down"
INSTRUCTIONS: tuple[str, ...] = (KEEP, LEFT, SLOW)


@dataclasses.dataclass(frozen=True)
class Goal:
    instruction: str
    lane: int  # the lane to be in (0 = leftmost)
    speed: float  # m/s
    origin_lane: int  # a lane change's lane left; for the `keep the lane` that ends one, the same (the car still
    # straddles the line: it may be in either lane while it settles)
    since_s: float  # when it was given (simulated time)


def goal_for(instruction: str, lane_now: int, t: float, cruise_mps: float, slow_mps: float,
             origin_lane: int | None = None) -> Goal:
    """The goal `instruction` sets for a car in lane `lane_now` at time t (origin_lane: the lane a lane change that
    just ended left). A lane change with no lane to the left is refused (ValueError): whoever gives instructions
    checks first."""
    if instruction not in INSTRUCTIONS:
        raise ValueError(f"instruction {instruction!r}: expected one of {list(INSTRUCTIONS)}")
    if instruction == LEFT:
        if lane_now == 0:
            raise ValueError(f"{LEFT!r} in lane 0: there is no lane to the left")
        return Goal(instruction, lane_now - 1, cruise_mps, lane_now, t)
    origin = lane_now if origin_lane is None else origin_lane
    return Goal(instruction, lane_now, slow_mps if instruction == SLOW else cruise_mps, origin, t)
