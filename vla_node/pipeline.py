"""The inference worker's per-frame work: plan against the deadline, run the stages, offer the chunk.

No sockets and no threads here: `Pipeline.process(frames, now)` is called by the node's worker thread (and
by tests and benchmarks) with the frames ingest selected; the clock is injected.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from vla_node.config import NodeConfig
from vla_node.model import build_vla, load_checkpoint, preset
from vla_node.model.decoder import RotaryTable
from vla_node.model.fp16_weights import use_fp16_weights
from vla_node.model.packed_weights import use_packed_weights
from vla_node.multirate import MultiRatePolicy, StageAborted
from vla_node.protocol import Frame
from vla_node.reuse import ReuseGate
from vla_node.scheduler import ChunkBroker, FramePlan, Scheduler
from vla_node.synthetic import SyntheticDriveConfig, synthetic_frames
from vla_node.validate import ConfigError

log = logging.getLogger(__name__)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TEST_DELAY_ENV = "VLA_NODE_TEST_DELAY_FILE"  # test only: a file holding "<stage> <ms>" to sleep in that stage


@dataclass(frozen=True)
class FrameMetrics:
    """Per processed frame, published with the actions made from it."""

    frame_seq: int
    level: int
    tokens_refreshed: int | None
    reuse_ratio: float | None


class TestDelay:
    """Reads the test-only delay file (if the env var names one) at most every 50 ms."""

    def __init__(self, clock: Callable[[], int]) -> None:
        path = os.environ.get(TEST_DELAY_ENV)
        self.path = Path(path) if path else None
        self.clock = clock
        self._read_ns = 0
        self._value: tuple[str, float] | None = None
        if self.path is not None:
            log.warning("test-only stage delay enabled through %s=%s", TEST_DELAY_ENV, path)

    def apply(self, stage: str) -> None:
        if self.path is None:
            return
        now = self.clock()
        if now - self._read_ns > 50_000_000:
            self._read_ns = now
            try:
                name, ms = self.path.read_text().split()
                self._value = (name, float(ms))
            except (OSError, ValueError):
                self._value = None
        if self._value is not None and self._value[0] == stage and self._value[1] > 0:
            time.sleep(self._value[1] / 1000)


def load_model(config: NodeConfig, preset_name: str | None = None, text_tokens: int | None = None):
    """The main engine's model, or with `preset_name` the smaller engine's, given the main engine's text capacity
    (`text_tokens`) so that every instruction the main engine takes fits it too."""
    model = _build_model(config, preset_name, text_tokens)
    weights = config.model.resolved_weights
    if weights == "fp16" and config.model.resolved_dtype == "fp32":  # fbgemm's (fp16 compute: plain weights)
        return use_fp16_weights(model)
    if weights == "packed":
        return use_packed_weights(model.to(torch.bfloat16))
    return model


def _build_model(config: NodeConfig, preset_name: str | None, text_tokens: int | None):
    section = config.model
    if preset_name is not None:
        shapes = preset(preset_name)
        return build_vla(shapes.replace(max_text_tokens=text_tokens or shapes.max_text_tokens), seed=section.seed)
    if section.checkpoint is not None:
        model = load_checkpoint(section.checkpoint)
    else:
        model = build_vla(preset(section.preset), seed=section.seed)
    if section.vision_frames is not None:
        model.config = model.config.replace(vision_frames=section.vision_frames)
        model.decoder.config = c = model.config
        # the layout's positions change with the window: the RoPE table (not a weight) is built for them anew
        model.decoder.rope = RotaryTable(c.head_dim, c.max_positions, c.rope_theta).to(model.decoder.rope.cos.device)
    return model


class Pipeline:
    def __init__(self, config: NodeConfig, clock: Callable[[], int] = time.monotonic_ns) -> None:
        self.config = config
        self.clock = clock
        dtype = DTYPES[config.model.resolved_dtype]
        device = config.model.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"model.device = {device!r}: CUDA is not available to torch {torch.__version__} "
                              "on this machine; use 'cpu'")
        self.policy = MultiRatePolicy(load_model(config), config.cache, dtype, device, config.reuse)
        # A GPU runs the stages asynchronously: wait for it at every budget check and stage end, so that stage
        # costs and checks see the work done, not the work queued.
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        c = self.policy.config
        self.small = None
        if config.scheduler.smaller_preset is not None:
            self.small = MultiRatePolicy(load_model(config, config.scheduler.smaller_preset, c.max_text_tokens),
                                         config.cache, dtype, device, config.reuse)
        self.gates = [ReuseGate(config.reuse, c.image_size, c.patch_size) for _ in config.cameras]
        self.broker = ChunkBroker.from_config(config.scheduler, c.action_horizon, c.action_dims)
        self.state = np.zeros(c.state_dim, np.float32)
        self.instruction: str | None = None
        self.scheduler: Scheduler | None = None
        self.metrics = FrameMetrics(-1, 0, None, None)
        self.delay = TestDelay(clock)
        self.frames_processed = 0
        self.frames_skipped = 0  # planned stale or at a level that runs no inference

    # --- warm-up: measured stage costs are the scheduler's priors ------------------------------------
    def warm_up(self, rounds: int = 2) -> dict[str, float]:
        """Run every stage once untimed (first calls pay one-off costs: allocator growth, CUDA's lazy kernel and
        library loading, hundreds of ms on a GPU), then `rounds` times timed; a stage's prior is its slowest
        timed run."""
        c = self.policy.config
        cfg = SyntheticDriveConfig(width=320, height=240, fps=10, seconds=1, seed=1)
        frames = [f for _, f in synthetic_frames(cfg)][: rounds + 1]
        priors: dict[str, float] = {}

        def timed(key: str, fn, first: bool) -> None:
            t0 = time.perf_counter_ns()
            fn()
            self.sync()
            if not first:
                priors[key] = max(priors.get(key, 0.0), (time.perf_counter_ns() - t0) / 1e6)

        for policy, prefix in ((self.policy, ""), (self.small, "small_")):
            if policy is None:
                continue
            for i, frame in enumerate(frames):
                timed(prefix + "text", lambda: policy.update_text(self.config.model.instruction), i == 0)
                # the vision stage as the node's frames run it: resize, then the update with their tick, where the
                # policy can
                timed(prefix + "vision", lambda: policy.update_vision(
                    policy.prepare_frames([frame] * c.num_cameras), state=self.state), i == 0)
                timed(prefix + "action", lambda: policy.action_tick(self.state), i == 0)
        self.instruction = self.config.model.instruction
        features = {"reuse": True, "refresh_cap": True, "vision_cache": True,
                    "smaller_engine": self.small is not None, "chunk": c.action_horizon > 1}
        self.scheduler = Scheduler(self.config.scheduler, prior_ms=priors, features=features)
        log.info("warm-up priors (ms): %s", {k: round(v, 1) for k, v in priors.items()})
        return priors

    # --- one frame ------------------------------------------------------------------------------------
    def process(self, frames: list[Frame], instruction: str | None, state: np.ndarray | None) -> FramePlan:
        """Plan and run the stages for the newest frames; offers the chunk to the broker when one is made."""
        sched = self.scheduler
        if state is not None:
            self.state = state
        changed = instruction is not None and instruction != self.instruction
        primary = frames[0]
        now = self.clock()
        plan = sched.plan_frame(now, primary.stamp_ns, changed)
        knobs = plan.knobs
        if knobs.force_fallback:
            self.broker.withdraw(plan.level)
        if plan.stale or not knobs.run_inference:
            self.frames_skipped += 1
            sched.finish_frame(self.clock(), primary.stamp_ns, plan.budget.outcome())
            return plan
        policy = self.small if knobs.use_smaller_engine else self.policy
        budget = plan.budget
        tokens_refreshed, reuse_ratio = None, None

        def run(stage: str, work: Callable[[Callable[[float], bool]], object]) -> object | None:
            if not budget.fits(stage, self.clock()):
                return None
            budget.begin(stage, self.clock())
            done = [0.0]

            def check(fraction: float) -> bool:
                self.sync()
                done[0] = fraction
                return budget.fits(stage, self.clock(), fraction_left=max(0.0, 1.0 - fraction))

            try:
                self.delay.apply(stage)
                result = work(check)
                self.sync()
            except StageAborted:
                budget.stop(stage, self.clock(), min(done[0], 0.99))
                return None
            budget.end(stage, self.clock())
            return result

        if plan.run_text:
            run("text", lambda check: policy.update_text(instruction, check))
            if budget.completed("text"):  # else the old instruction stays, and the new one is retried next frame
                self.instruction = instruction
                if self.small is not None and policy is self.policy:
                    self.small.update_text(instruction)
                if policy is self.small:
                    self.policy.update_text(instruction)  # keep the main engine in step
        update = None
        if plan.run_vision:
            update = self._vision(policy, frames, knobs, plan, run)
            if update is not None:
                tokens_refreshed, reuse_ratio = update.tokens_refreshed, update.reuse_ratio
        chunk = None
        if plan.run_action:
            if update is not None and update.chunk is not None:  # the tick ran in the frame's vision pass
                chunk = update.chunk
                self.delay.apply("action")
                budget.done_within("action", "vision")
            else:
                chunk = run("action", lambda check: policy.action_tick(self.state, check))
        outcome = budget.outcome()
        if chunk is not None:
            timing = outcome.timing_ms()
            timing["total"] = (self.clock() - now) / 1e6
            self.metrics = FrameMetrics(primary.seq, plan.level, tokens_refreshed, reuse_ratio)
            self.broker.offer(chunk.actions, primary.seq, primary.stamp_ns, self.clock(), plan.level, timing,
                              deadline_ns=plan.deadline_ns)
        self.frames_processed += 1
        sched.finish_frame(self.clock(), primary.stamp_ns, outcome)
        return plan

    def _vision(self, policy: MultiRatePolicy, frames: list[Frame], knobs, plan: FramePlan, run):
        """The vision stage: resize to the model input, plan reuse, update; the gates commit with it. When the
        action stage follows, its tick is handed to the update (it decodes it in the frame's pass where it can;
        its budget stays reserved for a stage that stops halfway), except on the frames where the scheduler wants
        the action stage's cost measured on its own."""
        c = policy.config
        state = None
        if plan.run_action and not self.scheduler.wants_action_sample(plan, self.clock()):
            state = self.state
        if policy is self.small or plan.instruction_changed:
            # the smaller engine's cache is not kept frame by frame, and a new instruction invalidates
            # every cached vision token: a full refresh either way
            return run("vision", lambda check: policy.update_vision(
                policy.prepare_frames([f.rgb for f in frames]), None, False, check, state))
        threshold = self.config.reuse.threshold * knobs.reuse_threshold_scale
        cap = None
        if knobs.max_refresh_fraction < 1.0:
            cap = max(1, int(c.tokens_per_camera * knobs.max_refresh_fraction))
        if self.config.reuse.max_refresh is not None:
            cap = self.config.reuse.max_refresh if cap is None else min(cap, self.config.reuse.max_refresh)
        staged = []

        def work(check):
            images = policy.prepare_frames([f.rgb for f in frames])  # [C, S, S, 3]
            plans = [gate.plan(images[i], threshold=threshold, max_refresh=cap) for i, gate in enumerate(self.gates)]
            scene_cut = any(p.scene_cut and p.full for p in plans)  # a capped cut refreshes over several frames
            tokens = [None if p.full else torch.tensor(p.refresh) for p in plans]
            update = policy.update_vision(images, tokens, scene_cut, check, state)
            staged.extend(zip(self.gates, plans, images))
            return update

        update = run("vision", work)
        if update is not None:  # the gates move only with the cache
            for gate, reuse_plan, image in staged:
                gate.commit(reuse_plan, image)
        return update
