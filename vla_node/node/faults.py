"""Fault injection for tests, in one named place: a wrapper around the policy, enabled only by its environment
variable and logged loudly. Production stage code has no test hook: the wrapper calls the policy's own verbs and
hands them its own budget check, so that a fault can strike mid-step (between two pieces of a stage, where the
scheduler's budget checks sit) as a hung or failing engine would.

    VLA_NODE_TEST_DELAY_FILE=PATH   PATH holds faults, one line per stage (text, vision or action):

        <stage> <ms>          each call of the stage sleeps ms first (a slow stage)
        <stage> stall <ms>    each call of the stage sleeps ms mid-step: at its first budget check after some work
                              (a hung engine; the check then finds the budget spent), or after the call when the
                              stage makes no such check
        <stage> raise         each call of the stage raises InjectedFault mid-step, where a stall would sleep (an
                              engine that fails)
        <stage> hold <ms>     each call of the stage first holds the interpreter lock for about ms: one C call
                              that never releases it (sorting integers), as a large copy or decode can

    The file is re-read at most every 50 ms, so a test changes the faults while the node runs (replace it
    atomically). A missing file means no fault; a file that does not parse means no fault and a warning naming the
    bad line. A tick decoded in its frame's vision pass suffers the action fault after that pass.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)
DELAY_FILE_ENV = "VLA_NODE_TEST_DELAY_FILE"
FAULT_FILE_ENV = DELAY_FILE_ENV  # the same variable: it names the file of every fault kind
REREAD_NS = 50_000_000
STAGES = ("text", "vision", "action")
KINDS = ("delay", "stall", "raise", "hold")


class InjectedFault(RuntimeError):
    """The test-only fault file said this stage raises."""


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str        # delay | stall | raise | hold
    ms: float = 0.0  # delay, stall and hold: how long


def parse_faults(text: str) -> dict[str, Fault]:
    """stage -> its fault, from the fault file's text; ValueError naming the first bad line."""
    faults: dict[str, Fault] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words:
            continue
        stage, fault = _parse_line(words, f"line {number} {line.strip()!r}")
        faults[stage] = fault
    return faults


def _parse_line(words: list[str], where: str) -> tuple[str, Fault]:
    expected = (f"'<stage> <ms>', '<stage> stall <ms>', '<stage> hold <ms>' or '<stage> raise' with a stage from "
                f"{list(STAGES)}")
    if words[0] not in STAGES or len(words) not in (2, 3):
        raise ValueError(f"fault file {where}: expected {expected}")
    if words[1:] == ["raise"]:
        return words[0], Fault("raise")
    kind, ms = ("delay", words[1]) if len(words) == 2 else (words[1], words[2])
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if kind not in ("delay", "stall", "hold") or not value >= 0 or value == float("inf"):
        raise ValueError(f"fault file {where}: expected {expected} (ms a finite number >= 0)")
    return words[0], Fault(kind, value)


_SHUFFLED: dict[float, list[int]] = {}  # per hold time: integers whose sort takes about that long here


def _shuffled(count: int) -> list[int]:
    items = list(range(max(1, count)))
    random.Random(1).shuffle(items)
    return items


def hold_interpreter(ms: float) -> None:
    """Hold the interpreter lock for about ms: sorted() of shuffled integers runs in C and compares ints without
    running bytecode, so no other thread of this process runs Python meanwhile (time.sleep would release it).

    The list's length comes from the fastest of three timed sorts (a busy moment during one only lengthens the hold);
    a hold that still ends early (the CPU faster than at calibration) lengthens the list for the next."""
    items = _SHUFFLED.get(ms)
    if items is None:
        sample = _shuffled(100_000)
        per_item_ns = min(_sort_ns(sample) for _ in range(3)) / len(sample)
        items = _shuffled(int(ms * 1e6 / per_item_ns))
    log.warning("TEST-ONLY injected fault: holding the interpreter lock %g ms", ms)
    held_ns = max(1, _sort_ns(items))
    if held_ns < ms * 1e6:  # to 1.1 x ms / held its length: only the shortfall is built and shuffled, after the hold
        items.extend(_shuffled(int(len(items) * (1.1 * ms * 1e6 / held_ns - 1))))
    _SHUFFLED[ms] = items


def _sort_ns(items: list[int]) -> int:
    start = time.perf_counter_ns()
    sorted(items)
    return time.perf_counter_ns() - start


class FaultFile:
    """The fault file's current faults, re-read at most every 50 ms."""

    def __init__(self, path: Path, clock: Callable[[], int]) -> None:
        self.path = path
        self.clock = clock
        self._read_ns: int | None = None
        self._text: str | None = None
        self._faults: dict[str, Fault] = {}

    def fault(self, stage: str) -> Fault | None:
        now = self.clock()
        if self._read_ns is None or now - self._read_ns > REREAD_NS:
            self._read_ns = now
            self._reread()
        return self._faults.get(stage)

    def _reread(self) -> None:
        try:
            text = self.path.read_text()
        except OSError:
            text = ""
        if text == self._text:
            return
        self._text = text
        try:
            self._faults = parse_faults(text)
        except ValueError as e:
            log.warning("TEST-ONLY FAULT FILE %s ignored: %s", self.path, e)
            self._faults = {}
            return
        if self._faults:
            log.warning("TEST-ONLY FAULTS NOW: %s", {s: f"{f.kind} {f.ms:g} ms" if f.kind != "raise" else "raise"
                                                     for s, f in self._faults.items()})

    def apply(self, stage: str) -> None:
        """The stage's delay or hold, if it has one (before the stage starts)."""
        fault = self.fault(stage)
        if fault is not None and fault.kind == "delay" and fault.ms > 0:
            time.sleep(fault.ms / 1000)
        elif fault is not None and fault.kind == "hold" and fault.ms > 0:
            hold_interpreter(fault.ms)

    def run(self, stage: str, call: Callable[[Callable[[float], bool]], object], check) -> object:
        """call(check) with the stage's fault: a delay before it, a stall or a raise at its first budget check
        after some work (fraction done > 0), else after it returns."""
        self.apply(stage)
        fault = self.fault(stage)
        if fault is None or fault.kind in ("delay", "hold"):
            return call(check)
        fired = [False]

        def faulty_check(fraction: float) -> bool:
            if fraction > 0 and not fired[0]:
                fired[0] = True
                self._fire(stage, fault)
            return check is None or check(fraction)

        result = call(faulty_check)
        if not fired[0]:
            self._fire(stage, fault)
        return result

    def after(self, stage: str) -> None:
        """The stage's fault once the work it belongs to is done (a tick decoded in its frame's vision pass)."""
        self.apply(stage)
        fault = self.fault(stage)
        if fault is not None and fault.kind in ("stall", "raise"):
            self._fire(stage, fault)

    def _fire(self, stage: str, fault: Fault) -> None:
        if fault.kind == "raise":
            raise InjectedFault(f"TEST-ONLY injected fault: the {stage} stage raised mid-step ({self.path})")
        log.warning("TEST-ONLY injected fault: the %s stage stalls %g ms mid-step", stage, fault.ms)
        time.sleep(fault.ms / 1000)


class FaultyPolicy:
    """A policy whose stages suffer the fault file's faults; everything else is the wrapped policy's."""

    def __init__(self, policy, faults: FaultFile) -> None:
        self.wrapped = policy
        self.faults = faults

    def __getattr__(self, name: str):
        return getattr(self.wrapped, name)

    def update_text(self, instruction, check=None):
        return self.faults.run("text", lambda c: self.wrapped.update_text(instruction, c), check)

    def update_vision(self, images, tokens=None, scene_cut=False, check=None, state=None):
        update = self.faults.run("vision", lambda c: self.wrapped.update_vision(images, tokens, scene_cut, c, state),
                                 check)
        if update.chunk is not None:
            self.faults.after("action")
        return update

    def action_tick(self, state, check=None, **flow):
        """`flow`: the flow head's steps and guide, passed on."""
        return self.faults.run("action", lambda c: self.wrapped.action_tick(state, c, **flow), check)


def with_faults(policy, clock: Callable[[], int] = time.monotonic_ns, environ=os.environ):
    """The policy itself, or wrapped in FaultyPolicy when the fault environment variable is set (tests only)."""
    path = environ.get(FAULT_FILE_ENV)
    if not path:
        return policy
    log.warning("TEST-ONLY FAULT INJECTION ENABLED: stage delays, stalls and raises from %s=%s", FAULT_FILE_ENV,
                path)
    return FaultyPolicy(policy, FaultFile(Path(path), clock))
