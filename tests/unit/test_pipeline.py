"""The worker's per-frame pipeline without sockets or threads, on an injected clock."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from vla_node.backends.packed_weights import PackedLinear, packed_weights_available
from vla_node.config import load_launch
from vla_node.node.pipeline import Pipeline
from vla_node.sched.broker import TickStatus
from vla_node.wire.protocol import Frame

TINY = Path(__file__).parents[1] / "launch" / "tiny.toml"


class Clock:
    def __init__(self) -> None:
        self.now = 10**12

    def __call__(self) -> int:
        return self.now


def frame(seq: int, stamp_ns: int, value: int) -> Frame:
    rgb = np.full((48, 64, 3), value, np.uint8)
    rgb[: 8 + seq % 16] = 255 - value  # a band that moves: some patches change
    return Frame("front", seq, stamp_ns, "rgb8", 48, 64, rgb)


def test_frames_become_fresh_chunks_and_an_instruction_change_is_applied():
    clock = Clock()
    pipeline = Pipeline(load_launch(TINY), clock, warm_up_rounds=1)
    assert pipeline.instruction == "keep lane"
    reuse = []
    for seq in range(4):
        instruction = "exit right" if seq >= 2 else None
        plan = pipeline.process([frame(seq, clock.now, 40)], instruction, np.ones(4, np.float32))
        assert plan.level == 0 and not plan.stale
        out = pipeline.broker.next(clock.now)
        assert out.status is TickStatus.FRESH and out.frame_seq == seq
        reuse.append(out.reuse_ratio)  # the frame's figures travel with its chunk
        assert out.action.shape == (pipeline.policy.config.action_dims,) and np.isfinite(out.action).all()
        clock.now += 100_000_000
    assert pipeline.instruction == "exit right" and pipeline.policy.instruction == "exit right"
    assert pipeline.frames_processed == 4
    # the second frame barely differs from the first: its tokens are reused; the instruction change at the third
    # invalidates every cached vision token (a full refresh)
    assert reuse[1] > 0.5 and reuse[2] == 0.0, reuse


def test_a_frame_past_its_deadline_runs_nothing():
    clock = Clock()
    pipeline = Pipeline(load_launch(TINY), clock, warm_up_rounds=1)
    old = clock.now - 10**9  # captured a second ago; the vision deadline is 200 ms
    plan = pipeline.process([frame(0, old, 40)], None, None)
    assert plan.stale and pipeline.frames_skipped == 1 and pipeline.frames_processed == 0
    assert pipeline.broker.next(clock.now).status is TickStatus.FALLBACK


@pytest.mark.parametrize("name", ["cpu", "rtx", "jetson-orin"])
def test_every_launch_file_builds_its_engines_and_warms_up(name):
    """The shipped launch files start (on this CPU, in fp32): the instruction fits every engine. The smaller
    engine takes the main engine's text capacity (jetson-orin's tiny one would otherwise refuse its instruction)."""
    config = load_launch(Path(__file__).parents[2] / "launch" / f"{name}.toml")
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, device="cpu", dtype="fp32"))
    pipeline = Pipeline(config, warm_up_rounds=1)
    priors = pipeline.priors
    assert pipeline.policy.instruction == config.model.instruction
    engines = [pipeline.policy] + ([pipeline.small] if config.scheduler.smaller_preset else [])
    assert {p.config.max_text_tokens for p in engines} == {pipeline.policy.config.max_text_tokens}
    assert all(p.instruction == config.model.instruction for p in engines)
    assert all(v > 0 for v in priors.values()), priors


@pytest.mark.skipif(not packed_weights_available(),
                    reason="packed bf16 weights need oneDNN running bf16 in hardware (AVX512-BF16 or AMX, as ONEDNN_MAX_CPU_ISA allows)")
def test_bf16_compute_with_auto_weights_runs_packed_weights_through_the_pipeline():
    config = load_launch(TINY)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bf16", weights="auto"))
    clock = Clock()
    pipeline = Pipeline(config, clock, warm_up_rounds=1)
    assert isinstance(pipeline.policy.model.decoder.lm_head, PackedLinear)
    for seq in range(3):
        pipeline.process([frame(seq, clock.now, 40)], None, np.ones(4, np.float32))
        out = pipeline.broker.next(clock.now)
        assert out.status is TickStatus.FRESH and np.isfinite(out.action).all()
        clock.now += 100_000_000


def test_fp16_compute_on_the_cpu_runs_plain_fp16_weights():
    """weights auto with fp16 compute resolves to 'fp16', but fbgemm's fp16 weights take fp32 compute only: the
    pipeline keeps plain fp16 weights (it used to swap in fbgemm's and fail at warm-up)."""
    config = load_launch(TINY)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="fp16", weights="auto"))
    pipeline = Pipeline(config, warm_up_rounds=1)
    assert type(pipeline.policy.model.decoder.lm_head) is torch.nn.Linear
    assert pipeline.policy.model.decoder.lm_head.weight.dtype == torch.float16
    assert all(v > 0 for v in pipeline.priors.values())


def test_a_frames_tick_runs_in_its_vision_pass_and_the_action_cost_stays_measured():
    clock = Clock()
    pipeline = Pipeline(load_launch(TINY), clock, warm_up_rounds=1)
    costs = pipeline.scheduler.costs
    half_age_ns = int(pipeline.config.scheduler.cost_max_age_ms * 1e6) // 2
    ticks = pipeline.policy.state_count  # the warm-up's
    # (gap before the frame, pixel value, where the tick runs, action samples after the frame): the ticks join
    # their frames' passes, except where nothing changed (the same frame again: no pass, the stage runs on its own
    # and is a sample); the first frame and the one after half cost_max_age_ms have the action stage timed after
    # their chunks went out (a tick that commits nothing)
    steps = [(0, 40, "vision", 1), (100_000_000, 90, "vision", 1), (100_000_000, 90, None, 2),
             (100_000_000, 200, "vision", 2), (half_age_ns, 30, "vision", 3), (100_000_000, 120, "vision", 3)]
    for seq, (gap, value, within, samples) in enumerate(steps):
        clock.now += gap
        rgb = np.full((48, 64, 3), value, np.uint8)
        plan = pipeline.process([Frame("front", seq, clock.now, "rgb8", 48, 64, rgb)], None,
                                np.full(4, seq, np.float32))
        runs = {run.stage: run for run in plan.budget.runs}
        assert runs["vision"].within is None and runs["action"].within == within, (seq, runs)
        assert costs.count("action") == samples, seq
        out = pipeline.broker.next(clock.now)
        assert out.status is TickStatus.FRESH and out.frame_seq == seq
    assert costs.count(plan.cost_keys[1]) == len(steps)
    assert pipeline.policy.state_count == ticks + len(steps)  # a committed tick a frame: timing runs commit nothing
