"""Deadline scheduler: stage cost estimates, per-frame budgets and the degrade ladder's level.

Pure logic with the clock passed in: every call takes `now_ns` (CLOCK_MONOTONIC ns, the clock of frame
`stamp_ns`); nothing here touches sockets, threads or the real clock. The worker thread, per camera frame:

    plan = scheduler.plan_frame(now(), frame.stamp_ns, instruction_changed)
    if plan.knobs.force_fallback:
        broker.withdraw(plan.level)
    budget = plan.budget
    for stage in plan.stages:                        # a subsequence of ("text", "vision", "action")
        if not budget.fits(stage, now()):
            continue                                 # skipped; e.g. act on the cached vision partition
        budget.begin(stage, now())
        for i, piece in enumerate(pieces):           # decoder layers, vision token chunks, ...
            if not budget.fits(stage, now(), fraction_left=1 - i / len(pieces)):
                budget.stop(stage, now(), fraction_done=i / len(pieces))   # discard: nothing committed
                break
            run(piece)
        else:
            budget.end(stage, now())                 # commit the stage's cache transaction
    outcome = budget.outcome()
    if outcome.produced:
        broker.offer(chunk, ..., deadline_ns=plan.deadline_ns, timing_ms=outcome.timing_ms())
    scheduler.finish_frame(now(), frame.stamp_ns, outcome)

Two levels. `scheduler.level` (persistent) is the hysteresis state: it moves one step up after
`degrade_after_misses` consecutive misses or when a plan predicts that it cannot fit, and one step down after
`recover_after_ok` consecutive on-time frames with `recover_slack` of the budget left, provided the level below
is predicted to fit too (so the next plan does not climb straight back). `plan.level` (effective) is the lowest
level at or above it whose predicted cost fits this frame's time left: a frame degrades at once, the persistent
level only step by step. At `chunk`/`fallback` nothing runs, so there a frame counts as ok when the highest
inference level is predicted to fit with that slack, and as a miss when it is predicted not to fit at all; and
when nothing has been measured for `cost_max_age_ms`, the frame is a `probe` that runs the highest inference
level anyway (stages capped to an even share of half the time left), so wrong priors or an overload that is
over cannot keep inference off for good.

Deadlines: a fresh action is due `vision_deadline_ms` after the frame's capture stamp (`text_deadline_ms`
when the instruction changed); the action stage alone must fit `action_deadline_ms`. A frame already past its
deadline when planned is `stale`: nothing runs and the level does not move.

Costs are kept per stage variant, because the knobs change them: "text", "action", "vision@<level>" (the main
engine's vision at each vision level), "vision_full" (a full refresh, which an instruction change forces: the text
partition precedes vision, so a text change invalidates it), and "small_text", "small_vision", "small_action" for
the smaller engine, "action@<steps>" for the flow head's tick in fewer denoising steps (its prior the action's times
(steps + 1) / (flow_steps + 1): the state's decoder pass costs about a step). Priors come from the node (preset
figures or warm-up measurements): "vision" is a full refresh, and "vision@<level>" starts from it times the level's
refresh cap. A variant without samples is estimated from its prior times the measured / prior ratio of its most
recently sampled sibling (the same stage at other knobs or on the other engine), else times the load factor: that
ratio for the action stage, which does the same work every frame (1.0 without a sample). Samples older than
`cost_max_age_ms` are forgotten: a level left during an overload is estimated afresh from the current ratios, not
from its last run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from vla_node.sched.broker import ChunkBroker
from vla_node.sched.budget import (
    MAX_HISTORY,
    NS_PER_MS,
    STAGES,
    Budget,
    CostModel,
    FrameOutcome,
)
from vla_node.sched.ladder import LADDER_STEPS, Knobs, Level, build_levels, check_ladder
from vla_node.validate import ConfigError, did_you_mean, is_int, is_number, require

MAIN_PRIORS: tuple[str, ...] = ("text", "vision", "action")
SMALL_PRIORS: tuple[str, ...] = ("small_text", "small_vision", "small_action")
# The action stage does the same work every frame: its measured / prior cost says how loaded the machine is.
LOAD_KEYS: tuple[str, ...] = ("action", "small_action")
_Keys = tuple[str | None, str | None, str | None]  # cost keys of (text, vision, action); None: not run


def _ns(ms: float) -> int:
    return int(round(ms * NS_PER_MS))


@dataclass(frozen=True)
class SchedulerConfig:
    """Deadlines, cost model and degrade ladder. Times in ms; every field checked in __post_init__."""

    control_hz: float = 50.0
    action_deadline_ms: float = 20.0           # the action stage alone must fit this
    vision_deadline_ms: float = 50.0           # frame capture stamp -> fresh action
    text_deadline_ms: float = 100.0            # the same, for a frame that also encodes a new instruction
    history: int = 32                          # cost samples kept per stage variant
    cost_quantile: float = 0.9                 # estimate = this quantile of the samples x safety_margin
    safety_margin: float = 1.2
    cost_max_age_ms: float = 2000.0            # older samples are forgotten (the prior applies again)
    degrade_after_misses: int = 2
    recover_after_ok: int = 20
    recover_slack: float = 0.3                 # fraction of the budget that must be left to count as ok
    chunk_max_age_ms: float | None = None      # how long a chunk may be played out; None: H control periods
    fallback_action: tuple[float, ...] | None = None  # the safe action; None: zeros
    fallback_hold: tuple[bool, ...] | None = None      # per action dim: hold the last action played instead of the
                                                       # safe action's value (e.g. steering through a curve); None: none
    ladder: tuple[str, ...] = LADDER_STEPS
    reuse_threshold_scales: tuple[float, ...] = (2.0, 4.0)
    refresh_fractions: tuple[float, ...] = (0.5, 0.25)
    smaller_preset: str | None = None          # the smaller_engine step runs this preset ...
    smaller_recipe: str | None = None          # ... or this recipe of the same model (engine backends: "int8-ort");
                                               # the step exists only when one of them is set
    denoising_steps: tuple[int, ...] = (5, 2)  # the flow head's fewer_denoising_steps levels (below its flow_steps)
    real_time_chunking: bool = False           # flow head: guide each chunk toward the one being played (RTC)
    min_level: str | None = None               # never below this level (its name, as health shows it, e.g.
                                               # "cap_refreshed_tokens 25%") from the first frame that ran inference
                                               # on: what a level costs, measured by forcing it (an instruction change
                                               # still refreshes every vision token, as at any level)

    def __post_init__(self) -> None:
        for key in ("control_hz", "action_deadline_ms", "vision_deadline_ms", "text_deadline_ms",
                    "cost_max_age_ms"):
            value = getattr(self, key)
            require(is_number(value) and value > 0, key, value, "a finite number > 0")
        require(self.text_deadline_ms >= self.vision_deadline_ms, "text_deadline_ms", self.text_deadline_ms,
                f"a deadline >= vision_deadline_ms ({self.vision_deadline_ms})")
        require(is_int(self.history) and 1 <= self.history <= MAX_HISTORY, "history", self.history,
                f"an integer in [1, {MAX_HISTORY}]")
        require(is_number(self.cost_quantile) and 0 < self.cost_quantile <= 1, "cost_quantile",
                self.cost_quantile, "a quantile in (0, 1]")
        require(is_number(self.safety_margin) and self.safety_margin >= 1, "safety_margin", self.safety_margin,
                "a finite number >= 1")
        for key in ("degrade_after_misses", "recover_after_ok"):
            value = getattr(self, key)
            require(is_int(value) and value >= 1, key, value, "an integer >= 1")
        require(is_number(self.recover_slack) and 0 <= self.recover_slack < 1, "recover_slack",
                self.recover_slack, "a fraction in [0, 1)")
        require(self.chunk_max_age_ms is None or (is_number(self.chunk_max_age_ms) and self.chunk_max_age_ms > 0),
                "chunk_max_age_ms", self.chunk_max_age_ms, "None or a finite number > 0")
        require(self.fallback_action is None or (isinstance(self.fallback_action, tuple) and self.fallback_action
                                                 and all(is_number(v) for v in self.fallback_action)),
                "fallback_action", self.fallback_action, "None or a non-empty tuple of finite numbers")
        require(self.fallback_hold is None or (isinstance(self.fallback_hold, tuple) and self.fallback_hold
                                               and all(isinstance(v, bool) for v in self.fallback_hold)),
                "fallback_hold", self.fallback_hold, "None or a non-empty tuple of booleans")
        require(isinstance(self.ladder, tuple), "ladder", self.ladder, f"a tuple of steps from {list(LADDER_STEPS)}")
        check_ladder("ladder", self.ladder)
        scales = self.reuse_threshold_scales
        require(isinstance(scales, tuple) and scales and all(is_number(s) and s > 1 for s in scales)
                and all(a < b for a, b in zip(scales, scales[1:])), "reuse_threshold_scales", scales,
                "a non-empty tuple of increasing numbers > 1")
        fractions = self.refresh_fractions
        require(isinstance(fractions, tuple) and fractions and all(is_number(f) and 0 < f < 1 for f in fractions)
                and all(a > b for a, b in zip(fractions, fractions[1:])), "refresh_fractions", fractions,
                "a non-empty tuple of decreasing fractions in (0, 1)")
        steps = self.denoising_steps
        require(isinstance(steps, tuple) and steps and all(is_int(n) and n >= 1 for n in steps)
                and all(a > b for a, b in zip(steps, steps[1:])), "denoising_steps", steps,
                "a non-empty tuple of decreasing integers >= 1")
        require(isinstance(self.real_time_chunking, bool), "real_time_chunking", self.real_time_chunking,
                "true or false")
        require(self.smaller_preset is None or (isinstance(self.smaller_preset, str) and self.smaller_preset != ""),
                "smaller_preset", self.smaller_preset, "None or a preset name")
        require(self.smaller_recipe is None or self.smaller_recipe in ("fp32", "int8-ort", "int8-trt"),
                "smaller_recipe", self.smaller_recipe, "None, 'fp32', 'int8-ort' or 'int8-trt'")
        require(self.smaller_preset is None or self.smaller_recipe is None, "smaller_recipe", self.smaller_recipe,
                f"unset while smaller_preset is set ({self.smaller_preset!r}): the smaller engine is one or the other")
        require(self.min_level is None or (isinstance(self.min_level, str) and self.min_level != ""), "min_level",
                self.min_level, "None or a level's name")

    @property
    def smaller_engine(self) -> bool:
        return self.smaller_preset is not None or self.smaller_recipe is not None

    @property
    def period_ns(self) -> int:
        """The control period."""
        return int(round(1e9 / self.control_hz))

    def broker(self, horizon: int, dim: int, dtype: type = np.float32) -> ChunkBroker:
        """The chunk broker these settings ask for, for chunks [horizon, dim]."""
        max_age = None if self.chunk_max_age_ms is None else int(round(self.chunk_max_age_ms * 1e6))
        return ChunkBroker(horizon, dim, period_ns=self.period_ns, late_after_ns=int(round(self.vision_deadline_ms * 1e6)),
                           max_age_ns=max_age, fallback_action=self.fallback_action,
                           fallback_hold=self.fallback_hold, dtype=dtype)


@dataclass(frozen=True)
class FramePlan:
    """What to run for one frame. `level` is this frame's effective level: >= persistent_level, except for a
    probe, which runs the highest inference level while the persistent one runs none (chunk/fallback)."""

    frame_stamp_ns: int
    planned_ns: int
    deadline_ns: int
    instruction_changed: bool
    level: int
    level_name: str
    persistent_level: int
    knobs: Knobs
    run_text: bool
    run_vision: bool
    run_action: bool
    cost_keys: _Keys       # cost-model keys of (text, vision, action); None: not run
    predicted_ns: int
    stale: bool            # already past its deadline when planned: nothing runs
    probe: bool            # a measuring run below the persistent level (which runs no inference)
    budget: Budget

    @property
    def stages(self) -> tuple[str, ...]:
        return self.budget.stages


@dataclass(frozen=True)
class SchedulerHealth:
    """Counters for the health message."""

    level: int
    level_name: str
    levels: int
    consecutive_misses: int
    consecutive_ok: int
    frames: int
    missed_frames: int         # inference ran and produced no on-time chunk
    stale_frames: int          # past the deadline before planning
    predicted_misses: int      # plans that could not fit the persistent level
    probes: int                # measuring runs while the persistent level runs no inference
    load_factor: float         # measured / prior cost of the action stage
    level_ups: int
    level_downs: int


def scheduler_levels(config: SchedulerConfig, features: Mapping[str, bool] | None = None,
                     flow_steps: int | None = None) -> tuple[Level, ...]:
    """The levels of a scheduler with `config`, for a node with `features` and (the flow head) `flow_steps`."""
    fewer = () if flow_steps is None else tuple(n for n in config.denoising_steps if n < flow_steps)
    return build_levels(config.ladder, features=features, smaller_engine=config.smaller_engine,
                        reuse_threshold_scales=config.reuse_threshold_scales, refresh_fractions=config.refresh_fractions,
                        denoising_steps=fewer)


def check_min_level(name: str | None, levels: tuple[Level, ...]) -> int:
    """The floor `min_level` names among `levels` (0 when None): a level that runs inference (chunk and fallback
    are what an overload forces: a stage delay shows them). Otherwise a ConfigError naming the choices."""
    if name is None:
        return 0
    names = {level.name: level.index for level in levels if level.knobs.run_inference}
    if name not in names:
        raise ConfigError(f"scheduler.min_level = {name!r}: expected a level of this node that runs inference, one of "
                          f"{list(names)}{did_you_mean(name, names)}")
    return names[name]


class Scheduler:
    """Plans each frame against its deadline and moves the degrade level with hysteresis (one worker thread).

    `prior_ms`: prior stage costs in ms, keys "text", "vision" (a full refresh), "action", and "small_text",
    "small_vision", "small_action" when the smaller_engine level exists. `features`: which optional node
    features exist, e.g. {"reuse": False}; see vla_node.sched.ladder.FEATURES."""

    def __init__(self, config: SchedulerConfig, prior_ms: Mapping[str, float],
                 features: Mapping[str, bool] | None = None, flow_steps: int | None = None) -> None:
        self.config = config
        self.levels: tuple[Level, ...] = scheduler_levels(config, features, flow_steps)
        self._top = len(self.levels) - 1
        has_small = any(level.knobs.use_smaller_engine for level in self.levels)
        priors = self._check_priors(prior_ms, has_small)
        self._keys: list[_Keys] = []           # per level, for an ordinary frame
        self._keys_text: list[_Keys] = []      # per level, for a frame with an instruction change
        cost_priors: dict[str, int] = {"text": priors["text"], "vision_full": priors["vision"],
                                       "action": priors["action"]}
        for level in self.levels:
            knobs = level.knobs
            if not knobs.run_inference:
                keys = text_keys = (None, None, None)
            elif knobs.use_smaller_engine:
                text_keys = ("small_text", "small_vision", "small_action")
                keys = (None, "small_vision", "small_action")
            else:
                text_keys = ("text", "vision_full", "action")
                vision_key = f"vision@{level.index}" if knobs.run_vision else None
                if vision_key is not None:
                    cost_priors[vision_key] = round(priors["vision"] * knobs.max_refresh_fraction)
                action_key = "action"
                if knobs.denoising_steps is not None:  # the state's decoder pass costs about one step
                    action_key = f"action@{knobs.denoising_steps}"
                    cost_priors[action_key] = round(priors["action"] * (knobs.denoising_steps + 1) / (flow_steps + 1))
                keys = (None, vision_key, action_key)
            self._keys.append(keys)
            self._keys_text.append(text_keys)
        if has_small:
            cost_priors.update({key: priors[key] for key in SMALL_PRIORS})
        self.costs = CostModel(cost_priors, history=config.history, quantile=config.cost_quantile,
                               safety_margin=config.safety_margin)
        self._last_sample_ns: dict[str, int | None] = {key: None for key in cost_priors}
        self._families = {  # keys whose costs move together (the same stage, other knobs or engine)
            "text": tuple(k for k in cost_priors if k in ("text", "small_text")),
            "vision": tuple(k for k in cost_priors if k.startswith("vision@") or k == "small_vision"),
            "action": tuple(k for k in cost_priors if k in LOAD_KEYS or k.startswith("action@")),
        }
        self._prior_scale = {key: 1.0 for key in cost_priors}
        self._highest_inference = max(level.index for level in self.levels if level.knobs.run_inference)
        self._min_level = check_min_level(config.min_level, self.levels)
        self._floor = 0  # min_level, once a frame ran inference (so that the node has looked once)
        self._vision_deadline_ns = _ns(config.vision_deadline_ms)
        self._text_deadline_ns = _ns(config.text_deadline_ms)
        self._action_deadline_ns = _ns(config.action_deadline_ms)
        self._cost_max_age_ns = _ns(config.cost_max_age_ms)
        self._full_refresh = Knobs()  # what the main engine runs on an instruction change
        self._load_factor = 1.0
        self._level = 0
        self._misses = 0
        self._ok = 0
        self._pending: FramePlan | None = None
        self._last_measured_ns: int | None = None  # when a frame last ran (and measured) any stage
        self.frames = 0
        self.missed_frames = 0
        self.stale_frames = 0
        self.predicted_misses = 0
        self.level_ups = 0
        self.level_downs = 0
        self.probes = 0

    @staticmethod
    def _check_priors(prior_ms: Mapping[str, float], has_small: bool) -> dict[str, int]:
        known = MAIN_PRIORS + SMALL_PRIORS
        for key, value in prior_ms.items():
            if key not in known:
                raise ConfigError(f"prior_ms.{key}: unknown stage; expected one of {list(known)}"
                                  f"{did_you_mean(key, known)}")
            require(is_number(value) and value >= 0, f"prior_ms.{key}", value, "a finite number of ms >= 0")
        needed = MAIN_PRIORS + (SMALL_PRIORS if has_small else ())
        missing = [key for key in needed if key not in prior_ms]
        require(not missing, "prior_ms", dict(prior_ms), f"priors for {missing} as well")
        return {key: _ns(value) for key, value in prior_ms.items()}

    # -- readable state -------------------------------------------------------------------------------------

    @property
    def level(self) -> int:
        """The persistent level (hysteresis state); a frame's plan may go higher."""
        return self._level

    @property
    def level_name(self) -> str:
        return self.levels[self._level].name

    @property
    def top_level(self) -> int:
        return self._top

    @property
    def consecutive_misses(self) -> int:
        return self._misses

    @property
    def consecutive_ok(self) -> int:
        return self._ok

    def health(self) -> SchedulerHealth:
        return SchedulerHealth(self._level, self.level_name, len(self.levels), self._misses, self._ok,
                               self.frames, self.missed_frames, self.stale_frames, self.predicted_misses,
                               self.probes, self._load_factor, self.level_ups, self.level_downs)

    # -- prediction -----------------------------------------------------------------------------------------

    def predict(self, level: int, instruction_changed: bool = False) -> tuple[int, int]:
        """(Estimated ns of all stages the level runs, estimated ns of its action stage); (0, 0) if none."""
        text_key, vision_key, action_key = self._keys_text[level] if instruction_changed else self._keys[level]
        if action_key is None:
            return 0, 0
        action = self._estimate(action_key)
        total = action
        for key in (text_key, vision_key):
            if key is not None:
                total += self._estimate(key)
        return total, action

    def _fits(self, level: int, instruction_changed: bool, budget_ns: float) -> bool:
        total, action = self.predict(level, instruction_changed)
        return total <= budget_ns and action <= self._action_deadline_ns

    def _estimate(self, key: str) -> int:
        return self.costs.estimate(key, self._prior_scale[key])

    def wants_action_sample(self, plan: FramePlan, now_ns: int) -> bool:
        """Whether the planned action stage should also be timed on its own this frame: its key has no sample from
        the last cost_max_age_ms / 2. A tick decoded inside the frame's vision pass is no sample of the action
        stage (its time is in the vision stage's), and without samples the action estimate and the load factor
        would stop following the machine. The worker times it after the frame's chunk went out (record_sample),
        or runs the stage on its own where the tick cannot join the pass. (With cost_max_age_ms at or below two
        frame periods every frame measures it.)"""
        key = plan.cost_keys[2]
        if key is None:
            return False
        stamp = self._last_sample_ns[key]
        return stamp is None or now_ns - stamp >= self._cost_max_age_ns // 2

    def record_sample(self, plan: FramePlan, stage: str, elapsed_ns: int, now_ns: int) -> None:
        """A cost sample of `plan`'s `stage` measured outside the frame's budget, after finish_frame (the action
        stage run without committing once the frame's chunk, decoded in its vision pass, had been offered): it
        counts as the stage's own run in finish_frame does, but judges no deadline."""
        if stage not in STAGES:
            raise ValueError(f"record_sample: stage {stage!r}: expected one of {list(STAGES)}")
        key = dict(zip(STAGES, plan.cost_keys))[stage]
        if key is None:
            raise ValueError(f"record_sample: stage {stage!r} is not planned at level {plan.level} "
                             f"({plan.level_name}): planned {list(plan.stages)}")
        self._record(key, elapsed_ns, now_ns)
        self._update_prior_scales()

    def _record(self, key: str, elapsed_ns: int, now_ns: int) -> None:
        """One cost sample of `key`, measured by now_ns."""
        self.costs.record(key, elapsed_ns)
        self._last_sample_ns[key] = now_ns

    @property
    def load_factor(self) -> float:
        """Measured / prior cost of the most recently sampled action stage (1.0 without a recent sample)."""
        return self._load_factor

    def _ratio_of_latest(self, keys: tuple[str, ...]) -> float | None:
        """Measured quantile / prior of the most recently sampled key among `keys`; None if none has samples."""
        latest, ratio = None, None
        for key in keys:
            stamp = self._last_sample_ns[key]
            prior = self.costs.prior_ns(key)
            if stamp is not None and prior > 0 and (latest is None or stamp >= latest):
                latest, ratio = stamp, self.costs.quantile_ns(key) / prior
        return ratio

    def _update_prior_scales(self) -> None:
        """How to scale the prior of a key without samples: by its family's latest measured / prior ratio (a
        vision level measured 3x its prior makes the untried vision levels 3x theirs too), else by the load
        factor. A full vision refresh takes the load factor only: reuse makes partial refreshes cheaper than
        their priors in a way that says nothing about refreshing every token."""
        load = self._ratio_of_latest(self._families["action"])
        self._load_factor = 1.0 if load is None else load
        for keys in self._families.values():
            ratio = self._ratio_of_latest(keys)
            scale = self._load_factor if ratio is None else ratio
            for key in keys:
                self._prior_scale[key] = scale
        self._prior_scale["vision_full"] = self._load_factor

    def _forget_stale(self, now_ns: int) -> None:
        forgot = False
        for key, stamp in self._last_sample_ns.items():
            if stamp is not None and now_ns - stamp > self._cost_max_age_ns:
                self.costs.reset(key)
                self._last_sample_ns[key] = None
                forgot = True
        if forgot:
            self._update_prior_scales()

    # -- the frame ------------------------------------------------------------------------------------------

    def plan_frame(self, now_ns: int, frame_stamp_ns: int, instruction_changed: bool) -> FramePlan:
        """Choose this frame's level and stages. Call finish_frame before planning the next frame."""
        if self._pending is not None:
            raise RuntimeError(f"plan_frame: the frame stamped {self._pending.frame_stamp_ns} was planned and "
                               "not finished; call finish_frame first")
        self._forget_stale(now_ns)
        stamp = min(frame_stamp_ns, now_ns)  # a stamp from the future must not extend the budget
        deadline = stamp + (self._text_deadline_ns if instruction_changed else self._vision_deadline_ns)
        remaining = deadline - now_ns
        persistent = self._level
        stale = remaining <= 0
        chosen = persistent
        if not stale:
            cheapest, cheapest_ns = persistent, None
            for index in range(persistent, self._top + 1):
                total, action = self.predict(index, instruction_changed)
                if total <= remaining and action <= self._action_deadline_ns:
                    chosen = index
                    break
                if cheapest_ns is None or total < cheapest_ns:
                    cheapest, cheapest_ns = index, total
            else:
                chosen = cheapest  # nothing fits and no level skips inference: run the cheapest
        # A probe: at chunk/fallback, with nothing measured for cost_max_age_ms, run the highest inference level
        # anyway, so that pessimistic priors or a past overload cannot keep inference off for good. Each stage
        # gets at most an even share of half the time left (and half the action deadline); the budget checks
        # stop what overruns (its cost is then extrapolated), and a late chunk is never published as fresh.
        probe = (not stale and chosen == persistent and not self.levels[chosen].knobs.run_inference
                 and (self._last_measured_ns is None or now_ns - self._last_measured_ns >= self._cost_max_age_ns))
        if probe:
            chosen = self._highest_inference
        level = self.levels[chosen]
        knobs = level.knobs
        if stale:
            keys: _Keys = (None, None, None)
        elif instruction_changed:
            keys = self._keys_text[chosen]
            if knobs.run_inference and not knobs.use_smaller_engine:
                knobs = self._full_refresh
        else:
            keys = self._keys[chosen]
        estimates = {stage: self._estimate(key) for stage, key in zip(STAGES, keys) if key is not None}
        if probe:  # trust no estimate beyond an even share of half the time left (priors may be way off)
            share = min(remaining // (2 * len(estimates)), self._action_deadline_ns // 2)
            estimates = {stage: min(estimate, share) for stage, estimate in estimates.items()}
        budget = Budget(now_ns, deadline, estimates, self._action_deadline_ns)
        plan = FramePlan(
            frame_stamp_ns=frame_stamp_ns, planned_ns=now_ns, deadline_ns=deadline,
            instruction_changed=instruction_changed, level=chosen, level_name=level.name,
            persistent_level=persistent, knobs=knobs, run_text=keys[0] is not None,
            run_vision=keys[1] is not None, run_action=keys[2] is not None, cost_keys=keys,
            predicted_ns=sum(estimates.values()), stale=stale, probe=probe, budget=budget)
        self._pending = plan
        return plan

    def finish_frame(self, now_ns: int, frame_stamp_ns: int, outcome: FrameOutcome) -> None:
        """Record the frame's stage costs, judge it against its deadline and move the persistent level."""
        plan = self._pending
        if plan is None:
            raise RuntimeError("finish_frame without a planned frame; call plan_frame first")
        if frame_stamp_ns != plan.frame_stamp_ns:
            raise ValueError(f"finish_frame: frame_stamp_ns = {frame_stamp_ns}: expected the planned frame's "
                             f"{plan.frame_stamp_ns}")
        keys = dict(zip(STAGES, plan.cost_keys))
        for run in outcome.runs:
            if keys[run.stage] is None:
                raise ValueError(f"finish_frame: stage {run.stage!r} ran but level {plan.level} "
                                 f"({plan.level_name}) planned only {list(plan.stages)}")
        self._pending = None
        for run in outcome.runs:
            if run.fraction_done > 0 and run.within is None:  # a stopped stage counts as its extrapolated full cost
                self._record(keys[run.stage], math.ceil(run.elapsed_ns / run.fraction_done), now_ns)
        if outcome.runs:
            self._last_measured_ns = now_ns
            if self._floor < self._min_level:
                self._floor = self._min_level
                self._level = max(self._level, self._floor)
        self._update_prior_scales()
        self.frames += 1
        if plan.stale:
            self.stale_frames += 1
            return
        if plan.probe:
            self.probes += 1
        elif plan.level > plan.persistent_level:  # the persistent level was predicted not to fit
            self.predicted_misses += 1
            if plan.run_action and not (outcome.produced and now_ns <= plan.deadline_ns):
                self.missed_frames += 1
            self._move(+1)
            return
        budget_ns = plan.budget.total_ns
        slack_ns = self.config.recover_slack * budget_ns
        if plan.run_action and not plan.probe:
            on_time = outcome.produced and now_ns <= plan.deadline_ns
            miss = not on_time
            ok = on_time and plan.deadline_ns - now_ns >= slack_ns
            self.missed_frames += miss
        else:  # no inference at this level (a probe only measures): judge by whether inference is predicted to fit
            miss = not self._fits(self._highest_inference, plan.instruction_changed, budget_ns)
            ok = self._fits(self._highest_inference, plan.instruction_changed, budget_ns - slack_ns)
        if miss:
            self._ok = 0
            self._misses += 1
            if self._misses >= self.config.degrade_after_misses:
                self._move(+1)
        elif ok:
            self._misses = 0
            self._ok += 1
            # Step down only to a level predicted to fit as well, so the next plan does not climb straight back.
            lower = min(plan.persistent_level - 1, self._highest_inference)
            if self._ok >= self.config.recover_after_ok and lower >= self._floor and self._fits(
                    lower, plan.instruction_changed, budget_ns):
                self._move(-1)
        else:
            self._misses = 0
            self._ok = 0

    def _move(self, step: int) -> None:
        level = min(self._top, max(self._floor, self._level + step))
        if level > self._level:
            self.level_ups += 1
        elif level < self._level:
            self.level_downs += 1
        self._level = level
        self._misses = 0
        self._ok = 0
