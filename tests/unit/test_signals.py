"""SignalFlag: a signal is recorded, never raised, and the previous handler comes back. CtrlCLatch: a Ctrl-C
that Python drops (raised inside a finalizer) is still raised by check(). NodeProcess: a Ctrl-C during the fork
that starts the node (Python's at-fork callbacks) is raised after it, and the node just started is killed."""

import dataclasses
import gc
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from helpers.ctrl_c import CtrlCWhenCollected, python_ctrl_c
from helpers.node_helpers import TINY_LAUNCH
from vla_node.config import load_launch
from vla_node.node.process import NodeProcess, private_addresses
from vla_node.node.signals import CtrlCLatch, SignalFlag


def test_a_signal_is_recorded_and_ends_a_sleep():
    before = signal.getsignal(signal.SIGINT)
    with SignalFlag(signal.SIGINT, signal.SIGTERM) as flag:
        assert flag.received is None and not flag.sleep(0.02)
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
        start = time.monotonic()
        assert flag.sleep(5.0)  # no exception; woken within a slice of the signal
        assert time.monotonic() - start < 1.0 and flag.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGINT) is before


def test_outside_the_main_thread_signals_keep_their_handlers():
    before = signal.getsignal(signal.SIGINT)
    seen = []

    def enter():
        with SignalFlag(signal.SIGINT):
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [before]


@pytest.fixture(name="python_ctrl_c")
def python_ctrl_c_fixture():
    with python_ctrl_c():
        yield


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_python_drops_in_a_finalizer_is_raised_by_check(python_ctrl_c):
    CtrlCWhenCollected()  # without the latch: dropped, nothing else happens
    gc.collect()
    with CtrlCLatch() as ctrl_c:
        ctrl_c.check()
        CtrlCWhenCollected()
        gc.collect()
        assert ctrl_c.received
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.check()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_still_raises_where_it_lands(python_ctrl_c):
    with CtrlCLatch() as ctrl_c:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)
        assert ctrl_c.received


def test_the_latch_leaves_an_ignored_ctrl_c_ignored():
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with CtrlCLatch() as ctrl_c:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
            ctrl_c.check()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def child_pids() -> set[int]:
    return {int(pid) for task in Path("/proc/self/task").iterdir()
            for pid in (task / "children").read_text().split()}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads a process's children from Linux's /proc")
def test_a_ctrl_c_during_the_node_s_fork_is_raised_after_it(python_ctrl_c, tmp_path):
    armed = []

    def ctrl_c_in_the_fork() -> None:  # Python runs at-fork callbacks around a fork with a preexec_fn (the node's)
        if armed:
            armed.clear()
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # a raising handler would run here, and its KeyboardInterrupt be dropped

    os.register_at_fork(after_in_parent=ctrl_c_in_the_fork)  # for the process's life: armed once, below
    transport = dataclasses.replace(load_launch(TINY_LAUNCH).transport, **private_addresses())
    before = child_pids()
    armed.append(True)
    with pytest.raises(KeyboardInterrupt):
        NodeProcess(TINY_LAUNCH, transport, tmp_path / "node.log")
    assert not armed  # the Ctrl-C came during the fork
    assert child_pids() == before  # the node it started was killed and reaped
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
