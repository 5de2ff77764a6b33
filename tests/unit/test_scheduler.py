"""Deadline scheduler, degrade ladder, cost model, frame budget, chunk broker and control clock.

Pure logic driven by a fake clock (integer ns); the only real concurrency is the broker's two-thread test."""

from __future__ import annotations

import math
import re
import threading
import time
import tomllib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vla_node.sched.broker import ChunkBroker, TickStatus
from vla_node.sched.budget import Budget, CostModel, FrameOutcome, StageRun
from vla_node.sched.clock import ControlClock
from vla_node.sched.ladder import FEATURES, LADDER_STEPS, Knobs, build_levels
from vla_node.sched.scheduler import FramePlan, Scheduler, SchedulerConfig
from vla_node.validate import ConfigError, from_dict

MS = 1_000_000
T0 = 1_000_000 * MS  # an arbitrary monotonic start
FRAME_PERIOD = 33 * MS  # ~30 Hz camera

# The `small` preset's stage costs on this CPU, as numbers (ms): vision is a full refresh of every token.
SMALL_PRESET_MS = {"text": 12.0, "vision": 30.0, "action": 9.0,
                   "small_text": 4.0, "small_vision": 10.0, "small_action": 3.0}

FULL_LADDER_NAMES = [
    "normal", "raise_reuse_threshold x2", "raise_reuse_threshold x4", "cap_refreshed_tokens 50%",
    "cap_refreshed_tokens 25%", "skip_vision", "smaller_engine", "chunk", "fallback",
]


def stage_cost_ms(stage: str, knobs: Knobs, load: float) -> float:
    """A simulated pipeline: vision cost scales with the refresh cap; the smaller engine has its own costs."""
    if knobs.use_smaller_engine:
        return SMALL_PRESET_MS["small_" + stage] * load
    if stage == "vision":
        return SMALL_PRESET_MS["vision"] * knobs.max_refresh_fraction * load
    return SMALL_PRESET_MS[stage] * load


def run_frame(sched: Scheduler, now: int, stamp: int, load: float, instruction_changed: bool = False,
              pieces: int = 4) -> tuple[FramePlan, FrameOutcome, int]:
    """The worker's loop on a fake clock: budget checks before each stage and between its pieces."""
    plan = sched.plan_frame(now, stamp, instruction_changed)
    budget = plan.budget
    t = now
    for stage in plan.stages:
        if not budget.fits(stage, t):
            continue
        budget.begin(stage, t)
        piece_ns = round(stage_cost_ms(stage, plan.knobs, load) * MS / pieces)
        for i in range(pieces):
            if not budget.fits(stage, t, fraction_left=1 - i / pieces):
                budget.stop(stage, t, fraction_done=i / pieces)
                break
            t += piece_ns
        else:
            budget.end(stage, t)
    outcome = budget.outcome()
    sched.finish_frame(t, stamp, outcome)
    return plan, outcome, t


def small_scheduler(**overrides) -> Scheduler:
    config = SchedulerConfig(**{"smaller_preset": "tiny", **overrides})
    return Scheduler(config, SMALL_PRESET_MS)


# -- config and ladder --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, key", [
    ({"control_hz": 0}, "control_hz"),
    ({"vision_deadline_ms": float("nan")}, "vision_deadline_ms"),
    ({"text_deadline_ms": 40.0}, "text_deadline_ms"),
    ({"history": 0}, "history"),
    ({"history": True}, "history"),
    ({"cost_quantile": 1.5}, "cost_quantile"),
    ({"safety_margin": 0.9}, "safety_margin"),
    ({"degrade_after_misses": 0}, "degrade_after_misses"),
    ({"recover_slack": 1.0}, "recover_slack"),
    ({"chunk_max_age_ms": -1.0}, "chunk_max_age_ms"),
    ({"fallback_action": ()}, "fallback_action"),
    ({"fallback_action": (0.0, float("inf"))}, "fallback_action"),
    ({"ladder": ("chunk", "skip_vision")}, "ladder[1]"),
    ({"ladder": ("skip_vision", "skip_vision")}, "ladder[1]"),
    ({"reuse_threshold_scales": (4.0, 2.0)}, "reuse_threshold_scales"),
    ({"refresh_fractions": (0.5, 1.0)}, "refresh_fractions"),
    ({"smaller_preset": ""}, "smaller_preset"),
])
def test_config_rejects_bad_values_naming_the_key(kwargs, key):
    with pytest.raises(ConfigError, match="^" + re.escape(key) + " = "):
        SchedulerConfig(**kwargs)


def test_config_unknown_ladder_step_suggests_the_name():
    with pytest.raises(ConfigError, match=r"ladder\[0\] = 'skip_visoin'.*did you mean 'skip_vision'"):
        SchedulerConfig(ladder=("skip_visoin",))


def test_config_loads_from_a_toml_table():
    table = tomllib.loads("""
        [scheduler]
        control_hz = 30
        ladder = ["skip_vision", "chunk", "fallback"]
        fallback_action = [0, 0.5]
        smaller_preset = "tiny"
    """)["scheduler"]
    config = from_dict(SchedulerConfig, table, "scheduler")
    assert config.control_hz == 30.0 and config.period_ns == 33_333_333
    assert config.ladder == ("skip_vision", "chunk", "fallback")
    assert config.fallback_action == (0.0, 0.5)
    with pytest.raises(ConfigError, match=r"scheduler.recover_slak: unknown key.*'recover_slack'"):
        from_dict(SchedulerConfig, {"recover_slak": 0.2}, "scheduler")


def test_full_ladder_in_order_and_smaller_engine_only_when_configured():
    with_small = build_levels(LADDER_STEPS, smaller_engine=True)
    assert [level.name for level in with_small] == FULL_LADDER_NAMES
    assert [level.index for level in with_small] == list(range(len(FULL_LADDER_NAMES)))
    without = build_levels(LADDER_STEPS, smaller_engine=False)
    assert [level.name for level in without] == [n for n in FULL_LADDER_NAMES if n != "smaller_engine"]
    assert "smaller_engine" not in [level.step for level in small_scheduler(smaller_preset=None).levels]
    assert "smaller_engine" in [level.step for level in small_scheduler().levels]
    assert "smaller_engine" not in [level.step for level in Scheduler(
        SchedulerConfig(smaller_preset="tiny"), SMALL_PRESET_MS, features={"smaller_engine": False}).levels]


def test_knobs_accumulate_up_the_ladder():
    knobs = {level.name: level.knobs for level in build_levels(LADDER_STEPS, smaller_engine=True)}
    assert knobs["normal"] == Knobs()
    assert knobs["raise_reuse_threshold x4"].reuse_threshold_scale == 4.0
    assert knobs["cap_refreshed_tokens 50%"] == Knobs(reuse_threshold_scale=4.0, max_refresh_fraction=0.5)
    assert knobs["skip_vision"] == Knobs(reuse_threshold_scale=4.0, max_refresh_fraction=0.25, run_vision=False)
    assert knobs["smaller_engine"] == Knobs(use_smaller_engine=True)  # a complete pipeline on the small engine
    assert not knobs["chunk"].run_inference and not knobs["chunk"].force_fallback
    assert knobs["fallback"].force_fallback and not knobs["fallback"].run_inference


@pytest.mark.parametrize("feature, gone", [
    ("reuse", {"raise_reuse_threshold x2", "raise_reuse_threshold x4"}),
    ("refresh_cap", {"cap_refreshed_tokens 50%", "cap_refreshed_tokens 25%"}),
    ("vision_cache", {"skip_vision"}),
    ("smaller_engine", {"smaller_engine"}),
    ("chunk", {"chunk"}),
])
def test_absent_features_skip_their_levels(feature, gone):
    names = [level.name for level in build_levels(LADDER_STEPS, features={feature: False}, smaller_engine=True)]
    assert names == [n for n in FULL_LADDER_NAMES if n not in gone]
    assert set(FEATURES) >= {feature}


def test_absent_reuse_leaves_caps_without_a_raised_threshold():
    knobs = {level.name: level.knobs for level in build_levels(features={"reuse": False})}
    assert knobs["cap_refreshed_tokens 50%"] == Knobs(max_refresh_fraction=0.5)


def test_unknown_feature_is_an_error_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"features.resue: unknown feature.*'reuse'"):
        build_levels(features={"resue": False})
    with pytest.raises(ConfigError, match=r"features.chunk = 'no'"):
        build_levels(features={"chunk": "no"})


def test_priors_are_checked():
    with pytest.raises(ConfigError, match=r"prior_ms = .*small_text"):
        Scheduler(SchedulerConfig(smaller_preset="tiny"), {"text": 1, "vision": 2, "action": 3})
    with pytest.raises(ConfigError, match=r"prior_ms.visoin: unknown stage.*'vision'"):
        Scheduler(SchedulerConfig(), {"text": 1, "visoin": 2, "action": 3})
    Scheduler(SchedulerConfig(), {"text": 1, "vision": 2, "action": 3})  # no smaller engine: no small priors


# -- cost model ---------------------------------------------------------------------------------------------


def test_cost_model_prior_then_nearest_rank_quantile_times_margin():
    costs = CostModel({"vision": 10 * MS}, history=32, quantile=0.9, safety_margin=1.2)
    assert costs.estimate("vision") == 12 * MS  # the prior, with the margin
    for ms in range(1, 11):  # 1..10 ms
        costs.record("vision", ms * MS)
    assert costs.quantile_ns("vision") == 9 * MS  # the 9th of 10 sorted samples
    assert costs.estimate("vision") == math.ceil(9 * MS * 1.2)
    costs.reset("vision")
    assert costs.count("vision") == 0 and costs.estimate("vision") == 12 * MS


def test_cost_model_ring_keeps_only_the_latest_history():
    costs = CostModel({"action": 0}, history=4, quantile=1.0, safety_margin=1.0)
    for ms in (100, 1, 2, 3, 4):  # the 100 ms outlier is overwritten by the fifth sample
        costs.record("action", ms * MS)
    assert costs.count("action") == 4
    assert costs.estimate("action") == 4 * MS


def test_cost_model_rejects_unknown_stage_and_bad_duration():
    costs = CostModel({"vision": MS})
    with pytest.raises(ValueError, match=r"stage 'visoin'.*did you mean 'vision'"):
        costs.record("visoin", MS)
    with pytest.raises(ValueError, match=r"duration of 'vision' = -1"):
        costs.record("vision", -1)


@settings(max_examples=100, deadline=None)
@given(samples=st.lists(st.integers(0, 10**9), min_size=1, max_size=80),
       quantile=st.floats(0.05, 1.0), history=st.integers(1, 40))
def test_cost_model_quantile_matches_a_sorted_reference(samples, quantile, history):
    costs = CostModel({"s": 0}, history=history, quantile=quantile, safety_margin=1.0)
    for ns in samples:
        costs.record("s", ns)
    held = sorted(samples[-history:])
    expected = held[max(0, math.ceil(quantile * len(held) - 1e-9) - 1)]
    assert costs.quantile_ns("s") == expected
    assert min(held) <= costs.estimate("s") <= max(held)


# -- frame budget -------------------------------------------------------------------------------------------


def test_budget_reserves_time_for_later_stages_and_supports_early_stop():
    budget = Budget(T0, T0 + 50 * MS, {"vision": 30 * MS, "action": 10 * MS}, action_deadline_ns=20 * MS)
    assert budget.stages == ("vision", "action")
    assert budget.latest_end_ns("vision") == T0 + 40 * MS
    assert budget.fits("vision", T0 + 10 * MS)
    assert not budget.fits("vision", T0 + 11 * MS)
    assert budget.fits("vision", T0 + 25 * MS, fraction_left=0.5)  # 15 ms of vision left, 10 ms reserved
    budget.begin("vision", T0)
    run = budget.stop("vision", T0 + 26 * MS, fraction_done=0.5)
    assert run == StageRun("vision", 26 * MS, 0.5) and not run.completed
    assert budget.fits("action", T0 + 30 * MS)  # act on the cached vision partition
    budget.begin("action", T0 + 30 * MS)
    budget.end("action", T0 + 39 * MS)
    outcome = budget.outcome()
    assert outcome.produced and budget.completed("action") and not budget.completed("vision")
    assert outcome.timing_ms() == {"vision": 26.0, "action": 9.0}


def test_budget_action_stage_must_end_within_the_action_deadline():
    budget = Budget(T0, T0 + 100 * MS, {"action": 10 * MS}, action_deadline_ns=20 * MS)
    budget.begin("action", T0)
    assert budget.latest_end_ns("action") == T0 + 20 * MS
    assert budget.fits("action", T0 + 15 * MS, fraction_left=0.5)
    assert not budget.fits("action", T0 + 15 * MS, fraction_left=0.6)


def test_budget_misuse_is_an_error():
    budget = Budget(T0, T0 + 50 * MS, {"action": MS})
    with pytest.raises(ValueError, match="not planned"):
        budget.fits("vision", T0)
    with pytest.raises(RuntimeError, match="without begin"):
        budget.end("action", T0)
    budget.begin("action", T0)
    with pytest.raises(ValueError, match="fraction_done = 1.0"):
        budget.stop("action", T0, 1.0)
    budget.end("action", T0)
    with pytest.raises(RuntimeError, match="twice"):
        budget.end("action", T0)
    with pytest.raises(ValueError, match="Budget stages"):
        Budget(T0, T0, {"action": 1, "vision": 1})


# -- scheduler ----------------------------------------------------------------------------------------------


def test_ladder_climbs_in_order_under_injected_delays_and_recovers_with_hysteresis():
    sched = small_scheduler()
    top = sched.top_level
    assert [level.name for level in sched.levels] == FULL_LADDER_NAMES
    t = T0
    persistent: list[int] = []

    def frames(count: int, load: float) -> None:
        nonlocal t
        for _ in range(count):
            plan, _, _ = run_frame(sched, t, t - 2 * MS, load)
            assert plan.persistent_level <= plan.level <= top or (plan.probe and plan.level < plan.persistent_level)
            persistent.append(sched.level)
            t += FRAME_PERIOD

    frames(10, 0.5)
    assert set(persistent) == {0}
    frames(40, 10.0)  # every stage 10x slower: each cost far past the 48 ms left
    climb = persistent[10:]
    assert all(0 <= b - a <= 1 for a, b in zip(climb, climb[1:])), climb
    assert sorted(set(climb)) == list(range(top + 1)), "visits every level, one step at a time"
    assert sched.level == top and sched.levels[top].knobs.force_fallback
    mark = len(persistent)
    frames(600, 0.5)  # costs drop
    down = persistent[mark - 1:]
    assert all(0 <= a - b <= 1 for a, b in zip(down, down[1:])), "only steps down, one at a time"
    assert sched.level == 0
    changes = [i for i, (a, b) in enumerate(zip(down, down[1:])) if a != b]
    assert len(changes) == top
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    assert min(gaps) >= sched.config.recover_after_ok, gaps
    assert sched.level_ups == top and sched.level_downs == top
    assert sched.probes >= 1  # nothing ran at fallback: a probe measured that the overload was over


def test_pessimistic_priors_are_corrected_by_a_probe():
    # Warm-up measured cold-start costs 50x too high: no level fits, but a probe at chunk measures the truth.
    sched = Scheduler(SchedulerConfig(smaller_preset="tiny"), {k: v * 50 for k, v in SMALL_PRESET_MS.items()})
    t = T0
    plans = []
    for _ in range(300):
        plan, outcome, _ = run_frame(sched, t, t - 2 * MS, load=0.5)
        plans.append((plan, outcome))
        t += FRAME_PERIOD
    first_probe = next(i for i, (plan, _) in enumerate(plans) if plan.probe)
    assert plans[first_probe][0].level_name == "smaller_engine"
    assert plans[first_probe][1].produced  # the probe measured its stages to completion
    assert all(not plan.run_action for plan, _ in plans[:first_probe])
    assert sched.load_factor == pytest.approx(0.01)
    assert sched.level == 0 and sched.probes == 1


def test_a_lasting_overload_is_probed_rarely_and_keeps_the_level():
    sched = small_scheduler()
    t = T0
    levels = []
    for _ in range(300):  # ~10 s at 10x cost
        plan, _, _ = run_frame(sched, t, t - 2 * MS, load=10.0)
        levels.append(sched.level)
        t += FRAME_PERIOD
    assert levels[-250:] == [sched.top_level] * 250 and sched.level_downs == 0
    assert 3 <= sched.probes <= 10 * 1000 / sched.config.cost_max_age_ms + 1  # about one per cost_max_age_ms


def test_consecutive_late_frames_degrade_one_step_and_ok_frames_recover_it():
    sched = small_scheduler(degrade_after_misses=2, recover_after_ok=5)
    t = T0
    on_time = FrameOutcome((StageRun("vision", 20 * MS), StageRun("action", 5 * MS)))

    def frame(late: bool, finish_ms: float = 25.0) -> FramePlan:
        nonlocal t
        plan = sched.plan_frame(t, t, False)
        assert plan.level == plan.persistent_level  # predicted to fit: no per-frame degrade
        sched.finish_frame(plan.deadline_ns + MS if late else t + round(finish_ms * MS), t, on_time)
        t += FRAME_PERIOD
        return plan

    frame(late=True)
    assert sched.level == 0 and sched.consecutive_misses == 1
    frame(late=False)  # an on-time frame breaks the streak
    assert sched.consecutive_misses == 0
    frame(late=True)
    frame(late=True)
    assert sched.level == 1 and sched.missed_frames == 3 and sched.consecutive_misses == 0
    for _ in range(4):
        frame(late=False)
    frame(late=False, finish_ms=45.0)  # on time but with 10% of the budget left: not a recovery frame
    assert sched.level == 1 and sched.consecutive_ok == 0
    for _ in range(4):
        frame(late=False)
    assert sched.level == 1 and sched.consecutive_ok == 4
    frame(late=False)
    assert sched.level == 0
    health = sched.health()
    assert (health.level, health.level_ups, health.level_downs, health.frames) == (0, 1, 1, 14)


def test_level_settles_without_oscillating_when_costs_sit_near_a_boundary():
    sched = small_scheduler()
    t = T0
    levels = []
    for _ in range(300):
        plan, _, _ = run_frame(sched, t, t - 2 * MS, load=1.1)  # level 0 needs 52 ms with the margin
        levels.append((sched.level, plan.level))
        t += FRAME_PERIOD
    settled = levels[50:]
    assert len(set(settled)) == 1, set(settled)
    assert sched.level_downs == 0
    assert sched.levels[settled[0][1]].name == "cap_refreshed_tokens 50%"


def test_a_plan_predicted_not_to_fit_degrades_this_frame_and_moves_the_level_one_step():
    sched = small_scheduler()
    plan = sched.plan_frame(T0, T0 - 40 * MS, False)  # 10 ms left: only the chunk level fits
    assert plan.level_name == "chunk" and plan.persistent_level == 0
    assert not plan.run_vision and not plan.run_action and plan.stages == ()
    sched.finish_frame(T0, T0 - 40 * MS, plan.budget.outcome())
    assert sched.level == 1 and sched.predicted_misses == 1


def test_stale_frame_runs_nothing_and_leaves_the_level():
    sched = small_scheduler()
    plan = sched.plan_frame(T0, T0 - 60 * MS, False)
    assert plan.stale and plan.stages == () and not plan.run_action
    with pytest.raises(ValueError, match="ran but level 0"):
        sched.finish_frame(T0, T0 - 60 * MS, FrameOutcome((StageRun("action", MS),)))
    sched.finish_frame(T0, T0 - 60 * MS, FrameOutcome())
    assert sched.level == 0 and sched.stale_frames == 1 and sched.consecutive_misses == 0


def test_instruction_change_plans_text_and_a_full_vision_refresh_against_the_text_deadline():
    sched = small_scheduler()
    t = T0
    for _ in range(30):  # push the persistent level to a refresh cap with moderate load
        run_frame(sched, t, t - 2 * MS, load=1.1)
        t += FRAME_PERIOD
    assert sched.levels[sched.level].knobs.max_refresh_fraction < 1
    plan = sched.plan_frame(t, t - 2 * MS, True)
    assert plan.deadline_ns == t - 2 * MS + 100 * MS
    assert plan.stages == ("text", "vision", "action") and plan.run_text
    assert plan.knobs == Knobs()  # the text change invalidates vision: every token is refreshed
    assert plan.cost_keys == ("text", "vision_full", "action")
    sched.finish_frame(t + 50 * MS, t - 2 * MS, FrameOutcome(
        (StageRun("text", 12 * MS), StageRun("vision", 30 * MS), StageRun("action", 8 * MS))))
    assert sched.costs.count("vision_full") == 1 and sched.costs.count("text") == 1


def test_plan_and_finish_must_alternate():
    sched = small_scheduler()
    with pytest.raises(RuntimeError, match="call plan_frame first"):
        sched.finish_frame(T0, T0, FrameOutcome())
    sched.plan_frame(T0, T0, False)
    with pytest.raises(RuntimeError, match="call finish_frame first"):
        sched.plan_frame(T0, T0, False)
    with pytest.raises(ValueError, match="frame_stamp_ns = 5"):
        sched.finish_frame(T0, 5, FrameOutcome())


def test_stale_cost_samples_are_forgotten_after_the_max_age():
    sched = small_scheduler(cost_max_age_ms=500.0)
    plan = sched.plan_frame(T0, T0, False)
    sched.finish_frame(T0 + 300 * MS, T0, FrameOutcome(
        (StageRun("vision", 200 * MS), StageRun("action", 100 * MS))))
    assert sched.costs.estimate("action") == 120 * MS
    late = T0 + 300 * MS + 501 * MS
    plan = sched.plan_frame(late, late, False)
    assert sched.costs.estimate("action") == math.ceil(9 * MS * 1.2)  # back to the prior
    assert sched.costs.count("vision@0") == 0
    sched.finish_frame(late, late, FrameOutcome())
    assert plan.level >= 0


def test_untried_levels_are_estimated_from_measured_siblings_and_the_load_factor():
    sched = small_scheduler(action_deadline_ms=25.0)
    plan = sched.plan_frame(T0, T0, False)
    assert plan.cost_keys == (None, "vision@0", "action")
    sched.finish_frame(T0 + 40 * MS, T0, FrameOutcome((StageRun("vision", 90 * MS, 0.5), StageRun("action", 18 * MS))))
    assert sched.costs.quantile_ns("vision@0") == 180 * MS  # a stopped stage counts as its extrapolated cost
    assert sched.load_factor == 2.0  # action measured at twice its prior
    margin = sched.config.safety_margin
    # vision@0 ran at 6x its prior (180 / 30): an untried cap level is expected 6x its prior too ...
    assert sched.costs.count("vision@3") == 0
    assert sched.predict(3) == (math.ceil(15 * MS * 6 * margin) + math.ceil(18 * MS * margin),
                                math.ceil(18 * MS * margin))
    # ... the small engine's vision too; its action, the unsampled text and a full refresh follow the load factor.
    assert sched.predict(6) == (math.ceil(10 * MS * 6 * margin) + math.ceil(3 * MS * 2 * margin),
                                math.ceil(3 * MS * 2 * margin))
    assert sched.predict(0, instruction_changed=True)[0] == (
        math.ceil(12 * MS * 2 * margin) + math.ceil(30 * MS * 2 * margin) + math.ceil(18 * MS * margin))
    plan = sched.plan_frame(T0 + FRAME_PERIOD, T0 + FRAME_PERIOD, False)
    assert plan.level_name == "skip_vision"  # every vision level now predicted too slow


# The latency budget table (openpilot style): with the small preset's stage costs as numbers, a 50 Hz tick
# (20 ms action deadline, 50 ms vision deadline, 100 ms text deadline, margin 1.2) must plan these levels.
LATENCY_BUDGET_TABLE = [
    # frame age ms, instruction changed, prior overrides, scheduler overrides, features, expected level
    (2, False, {}, {}, None, "normal"),                     # 30 + 9 -> 46.8 of 48 ms
    (6, False, {}, {}, None, "cap_refreshed_tokens 50%"),   # 46.8 > 44; 15 + 9 -> 28.8
    (25, False, {}, {}, None, "cap_refreshed_tokens 25%"),  # 28.8 > 25; 7.5 + 9 -> 19.8
    (36, False, {}, {}, None, "skip_vision"),               # 19.8 > 14; 9 -> 10.8
    (40, False, {}, {}, None, "chunk"),                     # 10.8 > 10; small 10 + 3 -> 15.6 > 10
    (2, False, {"action": 25.0}, {}, None, "smaller_engine"),  # action 30 ms > the 20 ms action deadline
    (2, False, {"action": 25.0}, {"smaller_preset": None}, None, "chunk"),
    (6, False, {}, {}, {"refresh_cap": False}, "skip_vision"),
    (40, False, {}, {}, {"chunk": False}, "fallback"),
    (40, False, {}, {"ladder": ("skip_vision", "smaller_engine")}, None, "skip_vision"),  # none fits: cheapest
    (2, True, {}, {}, None, "normal"),                      # 12 + 30 + 9 -> 61.2 of 98 ms
    (50, True, {}, {}, None, "smaller_engine"),             # 61.2 > 50; 4 + 10 + 3 -> 20.4
]


@pytest.mark.parametrize("age_ms, changed, priors, overrides, features, expected", LATENCY_BUDGET_TABLE)
def test_latency_budget_table(age_ms, changed, priors, overrides, features, expected):
    config = SchedulerConfig(**{"control_hz": 50.0, "smaller_preset": "tiny", **overrides})
    sched = Scheduler(config, {**SMALL_PRESET_MS, **priors}, features=features)
    plan = sched.plan_frame(T0, T0 - age_ms * MS, changed)
    assert plan.level_name == expected, (plan.level_name, plan.predicted_ns / MS)
    left = plan.deadline_ns - T0
    if plan.predicted_ns > left:  # only when no level fits: then the cheapest one runs
        predictions = [sched.predict(level.index, changed)[0] for level in sched.levels]
        assert min(predictions) > left and plan.predicted_ns == min(predictions)
    assert plan.run_text == (changed and plan.run_action)
    assert plan.knobs.force_fallback == (expected == "fallback")


# -- chunk broker -------------------------------------------------------------------------------------------


H, D = 4, 2
PERIOD = 20 * MS


def make_broker(**kwargs) -> ChunkBroker:
    return ChunkBroker(H, D, period_ns=PERIOD, late_after_ns=50 * MS, **kwargs)


def chunk_of(value: float) -> np.ndarray:
    return np.arange(H * D, dtype=np.float64).reshape(H, D) + value  # [H, D]


def test_broker_fresh_then_chunk_steps_then_fallback():
    broker = make_broker(fallback_action=(0.5, -0.5))
    first = broker.next(T0)
    assert first.status is TickStatus.FALLBACK and first.frame_seq is None and first.chunk is None
    np.testing.assert_array_equal(first.action, [0.5, -0.5])
    chunk = chunk_of(0.0)
    assert broker.offer(chunk, frame_seq=7, frame_stamp_ns=T0 - 30 * MS, produced_ns=T0, level=2,
                        timing_ms={"action": 4.0})
    expected = [(5, TickStatus.FRESH, 0), (25, TickStatus.CHUNK, 1), (45, TickStatus.CHUNK, 2),
                (65, TickStatus.CHUNK, 3), (85, TickStatus.FALLBACK, None)]
    for at_ms, status, step in expected:
        out = broker.next(T0 + at_ms * MS)
        assert (out.status, out.step) == (status, step), at_ms
        assert (out.frame_seq, out.frame_stamp_ns, out.level, out.timing_ms) == (7, T0 - 30 * MS, 2, {"action": 4.0})
        if step is None:
            np.testing.assert_array_equal(out.action, [0.5, -0.5])
        else:
            np.testing.assert_array_equal(out.action, chunk[step])
            np.testing.assert_array_equal(out.chunk, chunk)
    assert out.status == "fallback"  # the wire string
    assert broker.ticks == {TickStatus.FRESH: 1, TickStatus.CHUNK: 3, TickStatus.FALLBACK: 2}


def test_a_held_dimension_keeps_the_last_action_played_through_fallback():
    """Steering held, accel from the safe action: before any chunk the safe action's own value; after a chunk, its
    last step played, also once a newer chunk was withdrawn unplayed (what the car last did, not what was decoded)."""
    broker = make_broker(fallback_action=(0.0, -0.5), fallback_hold=(True, False))
    np.testing.assert_array_equal(broker.next(T0).action, [0.0, -0.5])
    chunk = chunk_of(1.0)
    broker.offer(chunk, 1, T0 - 10 * MS, T0, 0)
    for k in range(3):  # steps 0..2 played
        broker.next(T0 + k * PERIOD + MS)
    out = broker.next(T0 + 5 * PERIOD)
    assert out.status is TickStatus.FALLBACK
    np.testing.assert_array_equal(out.action, [chunk[2, 0], -0.5])
    broker.offer(chunk_of(9.0), 2, T0 + 5 * PERIOD, T0 + 5 * PERIOD + MS, 0)
    broker.withdraw(level=6)
    np.testing.assert_array_equal(broker.next(T0 + 6 * PERIOD).action, [chunk[2, 0], -0.5])
    assert broker.fallback_hold == [True, False] and make_broker().fallback_hold == [False, False]
    with pytest.raises(ValueError, match=r"fallback_hold = \[1, 0\]: expected 2 booleans"):
        make_broker(fallback_hold=[1, 0])


def test_broker_step_follows_elapsed_periods_across_skipped_ticks():
    broker = make_broker()
    broker.offer(chunk_of(0.0), 1, T0 - 10 * MS, T0, 0)
    assert broker.next(T0 + 1 * MS).status is TickStatus.FRESH
    out = broker.next(T0 + 61 * MS)  # two ticks were skipped
    assert (out.status, out.step) == (TickStatus.CHUNK, 3)


def test_a_chunk_offered_after_its_tick_was_due_plays_each_step_once():
    """The tick due at T0 is published late (the publisher woke after the worker offered at T0 + 0.2 ms): it plays
    step 0 as fresh, and the next tick, due one period later, plays step 1, not step 0 again."""
    broker = make_broker()
    broker.offer(chunk_of(0.0), 1, T0 - 10 * MS, T0 + MS // 5, 0)
    steps = [(out.status, out.step) for out in (broker.next(T0 + k * PERIOD) for k in range(4))]
    assert steps == [(TickStatus.FRESH, 0), (TickStatus.CHUNK, 1), (TickStatus.CHUNK, 2), (TickStatus.CHUNK, 3)]


def test_late_chunk_is_never_fresh():
    broker = make_broker()
    broker.offer(chunk_of(0.0), 1, frame_stamp_ns=T0 - 51 * MS, produced_ns=T0, level=0)
    out = broker.next(T0 + MS)
    assert (out.status, out.step) == (TickStatus.CHUNK, 0)
    assert broker.late_offers == 1
    # The frame's own deadline (an instruction change: 100 ms) decides when given.
    broker.offer(chunk_of(1.0), 2, frame_stamp_ns=T0 - 80 * MS, produced_ns=T0, level=0, deadline_ns=T0 + 20 * MS)
    assert broker.next(T0 + MS).status is TickStatus.FRESH
    broker.offer(chunk_of(2.0), 3, frame_stamp_ns=T0 - 10 * MS, produced_ns=T0, level=0, deadline_ns=T0 - 1)
    assert broker.next(T0 + MS).status is TickStatus.CHUNK
    # A publisher that stalls past a period after the offer does not publish chunk[0] as fresh either.
    broker.offer(chunk_of(3.0), 4, frame_stamp_ns=T0, produced_ns=T0 + MS, level=0)
    out = broker.next(T0 + 45 * MS)
    assert (out.status, out.step, out.frame_seq) == (TickStatus.CHUNK, 2, 4)


def test_broker_max_age_shorter_than_the_chunk():
    broker = make_broker(max_age_ns=30 * MS)
    broker.offer(chunk_of(0.0), 1, T0, T0, 0)
    assert broker.next(T0 + 25 * MS).status is TickStatus.CHUNK  # fresh was never read: chunk at step 1
    assert broker.next(T0 + 45 * MS).status is TickStatus.FALLBACK  # step 2 < H but older than 30 ms


def test_broker_withdraw_nonfinite_and_shape():
    broker = make_broker()
    broker.offer(chunk_of(0.0), 1, T0, T0, 0)
    broker.withdraw(level=8)
    out = broker.next(T0 + MS)
    assert (out.status, out.level, out.frame_seq) == (TickStatus.FALLBACK, 8, 1)
    bad = chunk_of(0.0)
    bad[2, 1] = np.nan
    assert not broker.offer(bad, 2, T0, T0, 0)
    assert broker.rejected_nonfinite == 1 and broker.next(T0 + MS).status is TickStatus.FALLBACK
    with pytest.raises(ValueError, match=r"chunk shape \(4, 3\): expected \(4, 2\)"):
        broker.offer(np.zeros((4, 3)), 3, T0, T0, 0)
    broker.offer(chunk_of(0.0), 4, T0, T0, 1)
    broker.offer(chunk_of(1.0), 5, T0, T0, 1)  # replaces a fresh chunk nobody published
    out = broker.next(T0 + MS)
    assert (out.status, out.frame_seq, broker.replaced_unpublished) == (TickStatus.FRESH, 5, 1)


def test_tick_arrays_stay_valid_until_the_next_tick():
    broker = make_broker()
    broker.offer(chunk_of(0.0), 1, T0, T0, 0)
    out = broker.next(T0 + MS)
    assert not out.action.flags.writeable and not out.chunk.flags.writeable
    for value in (100.0, 200.0, 300.0):  # the worker keeps offering while the publisher serialises
        broker.offer(chunk_of(value), 2, T0, T0, 0)
    np.testing.assert_array_equal(out.chunk, chunk_of(0.0))
    np.testing.assert_array_equal(broker.next(T0 + MS).chunk, chunk_of(300.0))


def test_the_scheduler_config_builds_its_broker():
    config = SchedulerConfig(control_hz=50.0, chunk_max_age_ms=30.0, fallback_action=(1.0, 2.0))
    broker = config.broker(horizon=H, dim=D)
    assert (broker.period_ns, broker.max_age_ns, broker.late_after_ns) == (20 * MS, 30 * MS, 50 * MS)
    np.testing.assert_array_equal(broker.next(T0).action, [1.0, 2.0])
    assert SchedulerConfig().broker(H, D).max_age_ns == H * 20 * MS
    with pytest.raises(ValueError, match="fallback_action"):
        SchedulerConfig(fallback_action=(1.0,)).broker(horizon=H, dim=D)


def test_broker_between_two_threads_never_mixes_chunks():
    broker = make_broker()
    offers = 3000
    errors: list[str] = []

    def worker() -> None:
        try:
            buffer = np.empty((H, D))
            for seq in range(1, offers + 1):
                buffer.fill(seq)  # [H, D] all equal to the frame seq
                broker.offer(buffer, seq, T0, T0, 0)
        except Exception as exc:  # reported by the assertion below, not swallowed
            errors.append(f"worker: {exc!r}")

    thread = threading.Thread(target=worker)
    thread.start()
    last = 0
    give_up = time.monotonic() + 20.0
    while (thread.is_alive() or last < offers) and not errors and time.monotonic() < give_up:
        out = broker.next(T0 + MS)
        if out.frame_seq is None:
            continue
        if not (np.all(out.chunk == out.frame_seq) and out.action.shape == (D,) and out.frame_seq >= last):
            errors.append(f"seq {out.frame_seq} chunk {out.chunk.ravel()[:3]} after {last}")
        last = out.frame_seq
    thread.join(timeout=10)
    assert not errors, errors
    assert last == offers and broker.offered == offers


# -- control clock ------------------------------------------------------------------------------------------


def test_control_clock_counts_missed_ticks_and_jitter():
    clock = ControlClock(PERIOD, T0)
    assert clock.next_deadline() == T0 and clock.wait_time(T0 - 5 * MS) == 5 * MS
    assert clock.tick(T0 + MS) == 0 and (clock.index, clock.jitter_ns) == (0, MS)
    assert clock.next_deadline() == T0 + 20 * MS and clock.wait_time(T0 + 30 * MS) == 0
    assert clock.tick(T0 + 22 * MS) == 0 and clock.jitter_ns == 2 * MS
    assert clock.tick(T0 + 103 * MS) == 3  # ticks 2, 3 and 4 were missed; tick 5 is taken 3 ms late
    assert (clock.index, clock.scheduled_ns, clock.jitter_ns) == (5, T0 + 100 * MS, 3 * MS)
    assert clock.next_deadline() == T0 + 120 * MS
    assert clock.tick(T0 + 119 * MS) == 0 and clock.jitter_ns == -MS  # an early wake-up takes the next tick
    assert (clock.ticks, clock.missed_ticks, clock.max_jitter_ns) == (4, 3, 3 * MS)
    with pytest.raises(ValueError, match="period_ns = 0"):
        ControlClock(0, T0)


# -- property: bounded level, a finite action every tick ----------------------------------------------------


frame_events = st.lists(st.tuples(
    st.integers(10, 120),          # ms until the next frame
    st.integers(0, 70),            # frame age when planned, ms
    st.floats(0.1, 20.0),          # load factor on every stage
    st.booleans(),                 # instruction changed
), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(events=frame_events, smaller=st.booleans(), no_chunk=st.booleans())
def test_property_level_in_bounds_and_every_tick_a_finite_action(events, smaller, no_chunk):
    config = SchedulerConfig(smaller_preset="tiny" if smaller else None, recover_after_ok=3)
    sched = Scheduler(config, SMALL_PRESET_MS, features={"chunk": not no_chunk})
    broker = config.broker(horizon=H, dim=D)
    clock = ControlClock(config.period_ns, T0)
    t = T0
    seq = 0
    for gap_ms, age_ms, load, changed in events:
        seq += 1
        stamp = t - age_ms * MS
        plan, outcome, done = run_frame(sched, t, stamp, load, changed)
        assert 0 <= plan.level <= sched.top_level
        assert plan.persistent_level <= plan.level or (plan.probe and not sched.levels[
            plan.persistent_level].knobs.run_inference and sched.levels[plan.level].knobs.run_inference)
        assert 0 <= sched.level <= sched.top_level
        if plan.knobs.force_fallback:
            broker.withdraw(plan.level)
        if outcome.produced:
            broker.offer(np.full((H, D), load), seq, stamp, done, plan.level, outcome.timing_ms(),
                         deadline_ns=plan.deadline_ns)
        t = max(t + gap_ms * MS, done)
        while clock.next_deadline() <= t:
            now = clock.next_deadline() + MS
            clock.tick(now)
            out = broker.next(now)
            assert out.action.shape == (D,) and np.all(np.isfinite(out.action))
            assert out.status in TickStatus
            if out.status is TickStatus.FRESH:
                assert out.frame_stamp_ns is not None and out.step == 0


# -- a stage done within another --------------------------------------------------------------------------


def test_a_stage_done_within_another_completes_without_a_time_of_its_own():
    budget = Budget(0, 50 * MS, {"vision": 10 * MS, "action": 5 * MS})
    budget.begin("vision", 0)
    budget.end("vision", 12 * MS)
    assert budget.done_within("action", "vision") == StageRun("action", 0, 1.0, "vision")
    assert budget.outcome().produced and budget.outcome().timing_ms() == {"vision": 12.0}
    with pytest.raises(RuntimeError, match="twice"):
        budget.done_within("action", "vision")
    stopped = Budget(0, 50 * MS, {"vision": 10 * MS, "action": 5 * MS})
    stopped.begin("vision", 0)
    stopped.stop("vision", 5 * MS, 0.5)
    with pytest.raises(RuntimeError, match="did not complete"):  # then the action stage runs on its own
        stopped.done_within("action", "vision")
    for bad in (dict(within="vision", elapsed_ns=MS), dict(within="action", elapsed_ns=0),
                dict(within="visoin", elapsed_ns=0)):
        with pytest.raises(ValueError, match="within"):
            StageRun("action", bad["elapsed_ns"], 1.0, bad["within"])


def test_a_stage_done_within_another_is_no_sample_of_its_cost():
    sched = Scheduler(SchedulerConfig(), {"text": 20, "vision": 20, "action": 5})
    for i in range(3):
        now = T0 + i * 100 * MS
        plan = sched.plan_frame(now, now, False)
        budget = plan.budget
        budget.begin("vision", now)
        budget.end("vision", now + 18 * MS)
        budget.done_within("action", "vision")
        sched.finish_frame(now + 18 * MS, now, budget.outcome())
    assert sched.costs.count("action") == 0 and sched.costs.count(plan.cost_keys[1]) == 3
    assert sched.missed_frames == 0 and sched.level == 0


def test_the_action_stage_wants_a_sample_of_its_own_every_half_cost_max_age():
    sched = Scheduler(SchedulerConfig(cost_max_age_ms=2000.0), {"text": 20, "vision": 20, "action": 5})
    plan = sched.plan_frame(T0, T0, False)
    assert sched.wants_action_sample(plan, T0)  # nothing measured yet
    plan.budget.begin("action", T0)
    plan.budget.end("action", T0 + 4 * MS)
    sched.finish_frame(T0 + 4 * MS, T0, plan.budget.outcome())
    plan = sched.plan_frame(T0 + 100 * MS, T0 + 100 * MS, False)
    assert not sched.wants_action_sample(plan, T0 + 100 * MS)
    assert not sched.wants_action_sample(plan, T0 + 1003 * MS)
    assert sched.wants_action_sample(plan, T0 + 1004 * MS)  # 1000 ms after the sample, recorded at T0 + 4 ms


def test_a_sample_recorded_after_the_frame_counts_as_the_stages_own_run():
    """record_sample: the action stage timed after its frame (whose tick ran in the vision pass) is a cost sample
    like a run of its own, restarts the half-age wait and moves the load factor; no deadline is judged."""
    sched = Scheduler(SchedulerConfig(cost_max_age_ms=2000.0), {"text": 20, "vision": 20, "action": 5})
    plan = sched.plan_frame(T0, T0, False)
    plan.budget.begin("vision", T0)
    plan.budget.end("vision", T0 + 18 * MS)
    plan.budget.done_within("action", "vision")
    sched.finish_frame(T0 + 18 * MS, T0, plan.budget.outcome())
    assert sched.costs.count("action") == 0 and sched.wants_action_sample(plan, T0 + 18 * MS)
    sched.record_sample(plan, "action", 10 * MS, T0 + 28 * MS)
    assert sched.costs.count("action") == 1 and sched.costs.quantile_ns("action") == 10 * MS
    assert sched.load_factor == 2.0  # 10 ms measured against the 5 ms prior
    assert not sched.wants_action_sample(plan, T0 + 1027 * MS) and sched.wants_action_sample(plan, T0 + 1028 * MS)
    assert sched.missed_frames == 0 and sched.frames == 1
    with pytest.raises(ValueError, match="'tick'"):
        sched.record_sample(plan, "tick", MS, T0 + 30 * MS)


# -- a forced level (scheduler.min_level) -------------------------------------------------------------------


def test_min_level_is_a_floor_the_level_never_goes_below():
    sched = small_scheduler(min_level="cap_refreshed_tokens 25%", recover_after_ok=3)
    floor = FULL_LADDER_NAMES.index("cap_refreshed_tokens 25%")
    assert sched.level == 0  # the first frame looks at everything: the node starts from a full view
    t = T0
    names = []
    for load in [0.2] * 50 + [10.0] * 30 + [0.2] * 600:  # idle, an overload, idle again
        plan, _, _ = run_frame(sched, t, t - 2 * MS, load)
        names.append(plan.level_name)
        assert len(names) == 1 or plan.level >= floor or plan.probe, plan.level_name
        assert sched.level >= floor
        t += FRAME_PERIOD
    assert names[0] == "normal" and names[1:50] == ["cap_refreshed_tokens 25%"] * 49  # then the floor, not normal
    assert max(FULL_LADDER_NAMES.index(n) for n in names[50:80]) > floor  # an overload still climbs above it
    assert sched.level == floor and names[-1] == "cap_refreshed_tokens 25%"  # and recovery stops at the floor


def test_min_level_names_a_level_that_runs_inference():
    with pytest.raises(ConfigError, match=r"min_level = 'skip_visoin'.*did you mean 'skip_vision'"):
        small_scheduler(min_level="skip_visoin")
    with pytest.raises(ConfigError, match=r"min_level = 'chunk': expected a level of this node that runs inference"):
        small_scheduler(min_level="chunk")
    with pytest.raises(ConfigError, match=r"min_level = 'fewer_denoising_steps 5'"):  # a bins head has no such level
        small_scheduler(min_level="fewer_denoising_steps 5")
    flow = Scheduler(SchedulerConfig(min_level="fewer_denoising_steps 5"), SMALL_PRESET_MS, flow_steps=10)
    run_frame(flow, T0, T0 - 2 * MS, 0.2)
    assert flow.levels[flow.level].knobs.denoising_steps == 5
