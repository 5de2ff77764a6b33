"""The test-only fault wrapper: off without its environment variable, loud with it, each injected delay in its own
stage only, stalls and raises mid-step (at the stage's first budget check after some work), bad lines named."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import pytest

from vla_node.node.faults import (
    DELAY_FILE_ENV,
    Fault,
    FaultFile,
    FaultyPolicy,
    InjectedFault,
    hold_interpreter,
    parse_faults,
    with_faults,
)


class Policy:
    """Records each verb called; update_vision returns an update whose tick ran in the pass when given a state."""

    def __init__(self) -> None:
        self.calls = []
        self.config = "the wrapped policy's"

    def update_text(self, instruction, check=None):
        self.calls.append("text")

    def update_vision(self, images, tokens=None, scene_cut=False, check=None, state=None):
        self.calls.append("vision")
        return SimpleNamespace(chunk=None if state is None else "chunk")

    def action_tick(self, state, check=None):
        self.calls.append("action")


def test_without_the_variable_the_policy_is_not_wrapped():
    policy = Policy()
    assert with_faults(policy, environ={}) is policy


def test_with_the_variable_the_wrapper_says_so_loudly(tmp_path, caplog):
    path = tmp_path / "delay"
    with caplog.at_level(logging.WARNING):
        wrapped = with_faults(Policy(), environ={DELAY_FILE_ENV: str(path)})
    assert isinstance(wrapped, FaultyPolicy) and wrapped.config == "the wrapped policy's"
    assert "TEST-ONLY FAULT INJECTION ENABLED" in caplog.text


def test_each_delay_applies_to_its_stage_and_is_reread_while_running(tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr("vla_node.node.faults.time.sleep", slept.append)
    now = [0]
    path = tmp_path / "delay"
    path.write_text("vision 30\n")
    policy = Policy()
    wrapped = FaultyPolicy(policy, FaultFile(path, clock=lambda: now[0]))
    wrapped.update_text("go")
    wrapped.action_tick(None)
    assert slept == [] and policy.calls == ["text", "action"]
    wrapped.update_vision(None)
    assert slept == [0.03]
    path.write_text("action 5\n")
    wrapped.update_vision(None, state=[0.0])  # re-read only after 50 ms: still the vision delay
    assert slept == [0.03, 0.03]
    now[0] += 60_000_000
    wrapped.update_vision(None, state=[0.0])  # the tick decoded in the pass suffers the action delay after it
    wrapped.update_vision(None)  # no tick in the pass: no action delay
    assert slept == [0.03, 0.03, 0.005]
    path.write_text("not a delay")
    now[0] += 60_000_000
    wrapped.action_tick(None)  # an unreadable file: no delay
    assert slept == [0.03, 0.03, 0.005]


class SteppedPolicy:
    """A stage of two pieces with a budget check before each (fractions 0 and 0.5), as the real stages check
    between layers; records every event in order."""

    def __init__(self, events: list) -> None:
        self.events = events

    def _stage(self, name, check):
        for i, fraction in enumerate((0.0, 0.5)):
            if check is not None and not check(fraction):
                self.events.append(f"{name} stopped")
                return "stopped"
            self.events.append(f"{name} piece {i}")
        return name

    def update_text(self, instruction, check=None):
        return self._stage("text", check)

    def update_vision(self, images, tokens=None, scene_cut=False, check=None, state=None):
        self._stage("vision", check)
        return SimpleNamespace(chunk=None if state is None else "chunk")

    def action_tick(self, state, check=None):
        return self._stage("action", check)


def faulty(tmp_path, monkeypatch, text: str) -> tuple[FaultyPolicy, list]:
    events: list = []
    monkeypatch.setattr("vla_node.node.faults.time.sleep", lambda s: events.append(f"sleep {s:g}"))
    path = tmp_path / "faults"
    path.write_text(text)
    return FaultyPolicy(SteppedPolicy(events), FaultFile(path, clock=lambda: 0)), events


def test_a_stall_sleeps_mid_step_and_the_stage_sees_its_budget_check_after_it(tmp_path, monkeypatch):
    wrapped, events = faulty(tmp_path, monkeypatch, "vision stall 1500\n")
    checks = []
    wrapped.update_vision(None, check=lambda f: checks.append(f) or f < 0.5)  # the budget is spent by the stall
    assert events == ["vision piece 0", "sleep 1.5", "vision stopped"] and checks == [0.0, 0.5]
    assert wrapped.action_tick(None) == "action" and events[-2:] == ["action piece 0", "action piece 1"]


def test_a_raise_strikes_mid_step_and_names_the_stage(tmp_path, monkeypatch):
    wrapped, events = faulty(tmp_path, monkeypatch, "text 0\naction raise\n")
    assert wrapped.update_text("go") == "text"
    with pytest.raises(InjectedFault, match="TEST-ONLY injected fault: the action stage raised mid-step"):
        wrapped.action_tick(None, check=lambda f: True)
    assert events == ["text piece 0", "text piece 1", "action piece 0"]  # the first piece ran, not the second


def test_a_tick_decoded_in_the_vision_pass_suffers_the_action_fault_after_the_pass(tmp_path, monkeypatch):
    wrapped, events = faulty(tmp_path, monkeypatch, "action raise")
    wrapped.update_vision(None)  # no tick in the pass: no action fault
    with pytest.raises(InjectedFault, match="action stage"):
        wrapped.update_vision(None, state=[0.0])
    assert events == ["vision piece 0", "vision piece 1"] * 2


def test_a_stage_without_a_budget_check_after_work_suffers_the_fault_after_its_call(tmp_path, monkeypatch):
    wrapped, events = faulty(tmp_path, monkeypatch, "text stall 20")

    class OnePiece(SteppedPolicy):
        def update_text(self, instruction, check=None):
            self.events.append("text whole")

    wrapped.wrapped = OnePiece(events)
    wrapped.update_text("go")
    assert events == ["text whole", "sleep 0.02"]


@pytest.mark.parametrize("line", ["vision", "vision stall", "vision stall -1", "vision stall inf", "vision hang 5",
                                  "tower raise", "vision raise now", "vision 1 2"])
def test_a_bad_fault_line_is_named_and_means_no_fault(tmp_path, monkeypatch, caplog, line):
    with pytest.raises(ValueError, match=f"line 2 '{line}': expected"):
        parse_faults(f"text 5\n{line}\n")
    wrapped, events = faulty(tmp_path, monkeypatch, f"text 5\n{line}\n")
    with caplog.at_level(logging.WARNING):
        wrapped.update_text("go")
    assert events == ["text piece 0", "text piece 1"] and "TEST-ONLY FAULT FILE" in caplog.text


def test_fault_lines_parse_one_per_stage():
    assert parse_faults("vision 30\n\ntext stall 2.5\naction raise\n") == {
        "vision": Fault("delay", 30.0), "text": Fault("stall", 2.5), "action": Fault("raise")}


def test_a_hold_keeps_the_interpreter_lock_from_every_other_thread():
    """'<stage> hold <ms>': one C call that never releases the lock, so a thread that wants to run Python in the
    meantime runs only after it (time.sleep would have let it run)."""
    assert parse_faults("vision hold 40\n") == {"vision": Fault("hold", 40.0)}
    hold_interpreter(40)  # measured and built once
    ran_at: list[int] = []
    ready = threading.Event()

    def other() -> None:
        ready.set()
        time.sleep(0.005)  # wakes during the hold, then needs the lock
        ran_at.append(time.perf_counter_ns())

    thread = threading.Thread(target=other)
    thread.start()
    ready.wait()
    start = time.perf_counter_ns()
    hold_interpreter(40)
    ended = time.perf_counter_ns()
    thread.join()
    # the other thread woke at 5 ms and ran only once the hold was over (not at ~5 ms): the main thread may itself be
    # descheduled for a moment between the hold's end and its own clock read, so the bound is the hold's length
    assert ran_at[0] - start >= 20_000_000 and ended - start >= 20_000_000, (ran_at[0] - start, ended - start)
