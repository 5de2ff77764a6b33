"""Realtime settings: the worker thread's nice value is its own, the process's other threads keep theirs."""

import os
import threading

import pytest

from vla_node.node.realtime import lower_thread_priority

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
