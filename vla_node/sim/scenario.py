"""A drive's instructions: what is asked when, and how a lane change ends (the navigation system's part).

The cues give instructions at simulated times. A `change to the left lane` cue is skipped where the car has no lane to
its left (at the start: `keep the lane` instead). A lane change ends when the car's centre has crossed into its target
lane, or when it has not after
`change_timeout_s`: either way the giver then says `keep the lane` (which centres the car in the lane it is in), and
the change's result (arrived or not, and when) is kept for the report.
"""

from __future__ import annotations

import dataclasses

from vla_node.sim.env import SimConfig, Truth
from vla_node.sim.instructions import INSTRUCTIONS, KEEP, LEFT, SLOW, Goal, goal_for
from vla_node.sim.road import Road
from vla_node.validate import is_number, require


@dataclasses.dataclass(frozen=True)
class Cue:
    at_s: float
    instruction: str

    def __post_init__(self) -> None:
        require(is_number(self.at_s) and self.at_s >= 0, "cue.at_s", self.at_s, "a time >= 0 s")
        require(self.instruction in INSTRUCTIONS, "cue.instruction", self.instruction, f"one of {list(INSTRUCTIONS)}")


def default_cues(seconds: float) -> tuple[Cue, ...]:
    """Keep the lane, change to the left lane at a quarter of the drive, slow down past half, keep the lane again at
    four fifths (back to the cruise speed)."""
    return (Cue(0.0, KEEP), Cue(0.25 * seconds, LEFT), Cue(0.55 * seconds, SLOW), Cue(0.8 * seconds, KEEP))


@dataclasses.dataclass
class Issued:
    """One instruction as given, and (once over) how it went; `ended_s` None while it is the current one."""

    instruction: str
    at_s: float
    goal: Goal
    ended_s: float | None = None
    arrived_s: float | None = None  # a lane change: when the car crossed into its target lane


class InstructionGiver:
    def __init__(self, config: SimConfig, road: Road, cues: tuple[Cue, ...], change_timeout_s: float = 15.0) -> None:
        require(len(cues) > 0 and cues[0].at_s == 0, "cues", cues, "a cue at 0 s first")
        require(all(a.at_s < b.at_s for a, b in zip(cues, cues[1:])), "cues", cues, "cues in increasing time")
        self.config, self.road, self.cues = config, road, cues
        self.change_timeout_s = change_timeout_s
        self.issued: list[Issued] = []
        self.skipped: list[Cue] = []  # lane changes asked where there was no lane to the left
        self._next = 0

    @property
    def current(self) -> Issued:
        return self.issued[-1]

    @property
    def goal(self) -> Goal:
        return self.issued[-1].goal

    def update(self, truth: Truth) -> str | None:
        """The instruction to send now if it changed at this tick (else None): a cue that is due, or `keep the lane`
        once a lane change is over."""
        said = None
        while self._next < len(self.cues) and self.cues[self._next].at_s <= truth.t + 1e-9:
            cue = self.cues[self._next]
            self._next += 1
            if cue.instruction == LEFT and truth.lane == 0:
                self.skipped.append(cue)
                if not self.issued:  # a drive starts with an instruction: keep the lane instead
                    said = self._give(KEEP, truth)
                continue
            said = self._give(cue.instruction, truth)
        if said is None and self.issued and self.current.instruction == LEFT:
            change = self.current
            if truth.lane == change.goal.lane:
                change.arrived_s = truth.t
                said = self._give(KEEP, truth, change.goal.origin_lane)
            elif truth.t - change.at_s >= self.change_timeout_s:
                said = self._give(KEEP, truth, change.goal.origin_lane)
        return said

    def _give(self, instruction: str, truth: Truth, origin_lane: int | None = None) -> str:
        if self.issued:
            self.issued[-1].ended_s = truth.t
        goal = goal_for(instruction, truth.lane, truth.t, self.config.cruise_mps, self.config.slow_mps, origin_lane)
        self.issued.append(Issued(instruction, truth.t, goal))
        return instruction
