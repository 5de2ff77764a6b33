"""Realtime settings of the node's process and threads (fail soft: a vehicle user may lack the capability)."""

from __future__ import annotations

import logging
import os
import threading

from vla_node.config import RealtimeConfig

log = logging.getLogger(__name__)


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def apply_realtime(rt: RealtimeConfig) -> None:
    """CPU affinity and SCHED_FIFO for the process, where permitted; a warning where not."""
    if rt.cpu_affinity:
        try:
            os.sched_setaffinity(0, set(rt.cpu_affinity))
        except (OSError, AttributeError) as e:
            log.warning("cpu_affinity %s not applied: %s", rt.cpu_affinity, e)
    if rt.sched_fifo_priority:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(rt.sched_fifo_priority))
        except (OSError, AttributeError) as e:
            log.warning("SCHED_FIFO priority %d not applied (needs CAP_SYS_NICE or an rtprio limit): %s",
                        rt.sched_fifo_priority, e)


def drop_realtime_priority() -> None:
    """This thread back to SCHED_OTHER: a thread started after apply_realtime inherits SCHED_FIFO, and under
    SCHED_FIFO a thread cannot preempt another of the same priority, so inference would delay the control ticks."""
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (OSError, AttributeError) as e:
        log.warning("the worker thread keeps the realtime priority (SCHED_OTHER not applied: %s)", e)


def lower_thread_priority(nice: int) -> None:
    """Raise this thread's nice value by `nice` (Linux: a thread id takes PRIO_PROCESS; no privilege needed to
    lower one's own priority): under CFS the publisher thread, at the process's nice value, then preempts it when
    its tick is due instead of waiting for a core."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (OSError, AttributeError) as e:
        log.warning("worker_nice %d not applied: %s", nice, e)
