"""Realtime settings: the worker thread's nice value is its own, the process's other threads keep theirs; the
SCHED_FIFO probe agrees with util-linux's chrt, and 'auto' threads follow it."""

import os
import shutil
import subprocess
import sys
import threading

import pytest

from vla_node.node.realtime import fifo_permitted, lower_thread_priority, resolve_threads

pytestmark = pytest.mark.skipif(not hasattr(os, "setpriority"), reason="os.setpriority: POSIX only")


def test_lower_thread_priority_changes_only_the_calling_thread():
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def worker():
        tid = threading.get_native_id()
        lower_thread_priority(5)
        seen["worker"] = os.getpriority(os.PRIO_PROCESS, tid)
        lower_thread_priority(0)  # 0: left as it is
        seen["again"] = os.getpriority(os.PRIO_PROCESS, tid)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"worker": min(before + 5, 19), "again": min(before + 5, 19)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


@pytest.mark.skipif(shutil.which("chrt") is None or not hasattr(os, "sched_setscheduler"),
                    reason="chrt (util-linux) is the oracle; SCHED_FIFO: Linux")
def test_the_fifo_probe_agrees_with_chrt_and_leaves_the_caller_as_it_was():
    before = os.sched_getscheduler(0)
    chrt = subprocess.run(["chrt", "--fifo", "10", "true"], capture_output=True).returncode == 0
    assert fifo_permitted(10) == chrt
    assert not fifo_permitted(0)  # 0: off
    assert os.sched_getscheduler(0) == before == os.SCHED_OTHER
    assert resolve_threads("auto", 10, cpus=[0, 1, 2]) == (3 if chrt else 1)
    assert resolve_threads("auto", 0, cpus=[0, 1, 2]) == 1  # no SCHED_FIFO asked: one core left for the publisher
    assert resolve_threads(2, 10) == 2 and resolve_threads(0, 10) == 0  # a count as it is (0: torch's default)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="as root, a process without CAP_SYS_NICE (setpriv) is the unprivileged case")
def test_auto_threads_leave_a_core_where_the_fifo_probe_is_refused():
    code = ("from vla_node.node.realtime import fifo_permitted, resolve_threads; "
            "print(fifo_permitted(10), resolve_threads('auto', 10, cpus=[0, 1]))")
    no_sys_nice = ["setpriv", "--bounding-set=-sys_nice", "--inh-caps=-sys_nice"]
    chrt = subprocess.run([*no_sys_nice, "chrt", "--fifo", "10", "true"], capture_output=True)
    if chrt.returncode == 0:
        pytest.skip("an rtprio limit grants SCHED_FIFO without CAP_SYS_NICE here")
    done = subprocess.run([*no_sys_nice, sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "1"]
