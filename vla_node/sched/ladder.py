"""The degrade ladder: levels of decreasing cost, each a set of pipeline knobs.

Level 0 is `normal`. The ladder steps follow in this fixed order (a configured ladder may drop steps but not
reorder them):

    raise_reuse_threshold   vision reuse threshold x2, then x4 (one level per scale)
    cap_refreshed_tokens    at most 50%, then 25% of the vision tokens refreshed (one level per fraction)
    fewer_denoising_steps   the flow head's tick in fewer Euler steps, e.g. 10 -> 5 -> 2 (one level per count)
    skip_vision             no vision update this frame: act on the cached vision partition
    smaller_engine          run the smaller preset's engine (its own caches, its own normal knobs)
    chunk                   no inference this frame: keep playing out the current action chunk
    fallback                no inference: drop the current chunk and publish the configured safe action

Knobs accumulate up to `skip_vision` (a cap level keeps the largest reuse scale). `smaller_engine` is a
separate, complete pipeline: it runs text, vision and action on the smaller engine with normal knobs, so the
vehicle keeps seeing while overloaded. A step whose feature the node lacks is skipped (`features`), and
`smaller_engine` exists only when a smaller preset is configured, `fewer_denoising_steps` only for the flow head
(given its step counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from vla_node.validate import ConfigError, choose, did_you_mean, require

NORMAL = "normal"
RAISE_REUSE_THRESHOLD = "raise_reuse_threshold"
CAP_REFRESHED_TOKENS = "cap_refreshed_tokens"
FEWER_DENOISING_STEPS = "fewer_denoising_steps"
SKIP_VISION = "skip_vision"
SMALLER_ENGINE = "smaller_engine"
CHUNK = "chunk"
FALLBACK = "fallback"

# The full ladder in its only allowed order; also the default.
LADDER_STEPS: tuple[str, ...] = (
    RAISE_REUSE_THRESHOLD, CAP_REFRESHED_TOKENS, FEWER_DENOISING_STEPS, SKIP_VISION, SMALLER_ENGINE, CHUNK, FALLBACK,
)

# Which node feature each step needs; `fallback` needs none. A feature missing from `features` is present.
STEP_FEATURE: Mapping[str, str] = {
    RAISE_REUSE_THRESHOLD: "reuse",         # a vision reuse gate with a threshold
    CAP_REFRESHED_TOKENS: "refresh_cap",    # the vision stage can refresh a capped subset of tokens
    SKIP_VISION: "vision_cache",            # a vision partition to act on without refreshing it
    SMALLER_ENGINE: "smaller_engine",       # a smaller engine built and warm
    CHUNK: "chunk",                         # action chunks longer than one step
}
FEATURES: tuple[str, ...] = tuple(STEP_FEATURE.values())


@dataclass(frozen=True)
class Knobs:
    """What the pipeline does at one level. The node reads these; nothing here runs anything."""

    reuse_threshold_scale: float = 1.0   # multiplies the vision reuse threshold (>= 1: fewer refreshes)
    max_refresh_fraction: float = 1.0    # at most this fraction of vision tokens refreshed, in (0, 1]
    denoising_steps: int | None = None   # the flow head's Euler steps per tick (None: the model's flow_steps)
    run_vision: bool = True              # False: act on the cached vision partition
    use_smaller_engine: bool = False     # run the smaller preset's engine instead of the main one
    run_inference: bool = True           # False: no stage runs this frame
    force_fallback: bool = False         # withdraw the current chunk; publish the safe action

    def __post_init__(self) -> None:
        require(math.isfinite(self.reuse_threshold_scale) and self.reuse_threshold_scale >= 1.0,
                "Knobs.reuse_threshold_scale", self.reuse_threshold_scale, "a finite number >= 1")
        require(0.0 < self.max_refresh_fraction <= 1.0, "Knobs.max_refresh_fraction",
                self.max_refresh_fraction, "a fraction in (0, 1]")
        require(self.denoising_steps is None or (isinstance(self.denoising_steps, int) and self.denoising_steps >= 1),
                "Knobs.denoising_steps", self.denoising_steps, "None or an integer >= 1")
        require(not (self.force_fallback and self.run_inference), "Knobs.force_fallback", self.force_fallback,
                "False while run_inference is True")
        require(self.run_inference or not (self.run_vision or self.use_smaller_engine), "Knobs.run_inference",
                self.run_inference, "True when run_vision or use_smaller_engine is set")


@dataclass(frozen=True)
class Level:
    """One rung: its index (0 = normal), the ladder step it comes from, a readable name, its knobs."""

    index: int
    step: str
    name: str
    knobs: Knobs


NO_INFERENCE = Knobs(run_vision=False, run_inference=False)


def check_ladder(key: str, ladder: Sequence[str]) -> None:
    """Known step names, each at most once, in LADDER_STEPS order; errors name the offending entry."""
    positions = {step: i for i, step in enumerate(LADDER_STEPS)}
    last = -1
    for i, name in enumerate(ladder):
        position = choose(f"{key}[{i}]", name, positions)
        require(position > last, f"{key}[{i}]", name,
                f"each step once, in the order {list(LADDER_STEPS)}")
        last = position


def check_features(features: Mapping[str, bool] | None) -> dict[str, bool]:
    """The node's feature flags with every known feature filled in (absent means present)."""
    flags = {name: True for name in FEATURES}
    for name, value in (features or {}).items():
        if name not in flags:
            raise ConfigError(f"features.{name}: unknown feature; expected one of {sorted(FEATURES)}"
                              f"{did_you_mean(name, FEATURES)}")
        require(isinstance(value, bool), f"features.{name}", value, "true or false")
        flags[name] = value
    return flags


def _percent(fraction: float) -> str:
    return f"{fraction * 100:g}%"


def build_levels(
    ladder: Sequence[str] = LADDER_STEPS,
    *,
    features: Mapping[str, bool] | None = None,
    smaller_engine: bool = False,
    reuse_threshold_scales: Sequence[float] = (2.0, 4.0),
    refresh_fractions: Sequence[float] = (0.5, 0.25),
    denoising_steps: Sequence[int] = (),
) -> tuple[Level, ...]:
    """The levels in order, level 0 = normal. `smaller_engine` says whether a smaller preset is configured;
    `denoising_steps`: the flow head's step counts of fewer_denoising_steps (none: no such level)."""
    check_ladder("ladder", ladder)
    flags = check_features(features)
    levels = [Level(0, NORMAL, NORMAL, Knobs())]
    scale, fraction, steps = 1.0, 1.0, None  # accumulated up to skip_vision

    def add(step: str, name: str, knobs: Knobs) -> None:
        levels.append(Level(len(levels), step, name, knobs))

    for step in ladder:
        feature = STEP_FEATURE.get(step)
        if feature is not None and not flags[feature]:
            continue
        if step == RAISE_REUSE_THRESHOLD:
            for step_scale in reuse_threshold_scales:
                add(step, f"{step} x{step_scale:g}", Knobs(reuse_threshold_scale=step_scale))
                scale = step_scale
        elif step == CAP_REFRESHED_TOKENS:
            for step_fraction in refresh_fractions:
                add(step, f"{step} {_percent(step_fraction)}",
                    Knobs(reuse_threshold_scale=scale, max_refresh_fraction=step_fraction))
                fraction = step_fraction
        elif step == FEWER_DENOISING_STEPS:
            for count in denoising_steps:
                add(step, f"{step} {count}", Knobs(reuse_threshold_scale=scale, max_refresh_fraction=fraction,
                                                   denoising_steps=count))
                steps = count
        elif step == SKIP_VISION:
            add(step, step, Knobs(reuse_threshold_scale=scale, max_refresh_fraction=fraction, denoising_steps=steps,
                                  run_vision=False))
        elif step == SMALLER_ENGINE:
            if smaller_engine:
                add(step, step, Knobs(use_smaller_engine=True))
        elif step == CHUNK:
            add(step, step, NO_INFERENCE)
        elif step == FALLBACK:
            add(step, step, Knobs(run_vision=False, run_inference=False, force_fallback=True))
    return tuple(levels)
