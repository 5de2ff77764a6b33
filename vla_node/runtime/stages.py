"""A policy stage's budget checks: the check a stage is given, a part of it, and the stop that commits nothing."""

from __future__ import annotations

from typing import Callable

Check = Callable[[float], bool]  # called with the fraction of the stage done; False = stop now (out of budget)


class StageAborted(Exception):
    """A stage stopped at a budget check; nothing was committed."""


def span(check: Check | None, start: float, end: float) -> Check | None:
    """The check of a part of a stage that runs from `start` to `end` of it: the part's own fraction done f is
    passed on as start + (end - start) f, so that the fractions a stage reports only grow."""
    if check is None:
        return None
    return lambda fraction: check(start + (end - start) * fraction)


def stop(check: Check | None, fraction: float, why: str) -> None:
    """The budget check at `fraction` of a stage: StageAborted(`why`) where it says stop."""
    if check is not None and not check(fraction):
        raise StageAborted(why)
