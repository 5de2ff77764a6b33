"""Realtime settings of the node's process and threads (fail soft: a vehicle user may lack the capability)."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def apply_affinity(cpus) -> None:
    """CPU affinity for this process, where permitted; a warning where not."""
    if cpus:
        try:
            os.sched_setaffinity(0, set(cpus))
        except (OSError, AttributeError) as e:
            log.warning("cpu_affinity %s not applied: %s", cpus, e)


def apply_fifo(priority: int) -> None:
    """SCHED_FIFO at `priority` for this process (0: leave as is), where permitted; a warning where not."""
    if priority:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
        except (OSError, AttributeError) as e:
            log.warning("SCHED_FIFO priority %d not applied (needs CAP_SYS_NICE or an rtprio limit): %s", priority, e)


def fifo_permitted(priority: int) -> bool:
    """Whether this process may run a thread at SCHED_FIFO `priority` (0: False), as the publisher's apply_fifo
    asks: a probe thread takes it, then ends (root, CAP_SYS_NICE or an rtprio limit, within a container's real-time
    budget)."""
    permitted = [False]

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))  # 0: the calling thread (Linux)
            permitted[0] = True
        except (OSError, AttributeError):
            pass

    if priority:
        thread = threading.Thread(target=probe, name="fifo-probe")
        thread.start()
        thread.join()
    return permitted[0]


def resolve_threads(threads: int | str, fifo_priority: int, cpus=()) -> int:
    """model.threads as a count: an integer as it is (0: torch's default), 'auto' every CPU the node may run on
    (`cpus`, else this process's affinity) where its publisher may run at SCHED_FIFO `fifo_priority` (a tick then
    preempts the worker's threads), else 1 (a core left for the publisher: under CFS a tick waited for one)."""
    if threads != "auto":
        return threads
    return len(cpus or os.sched_getaffinity(0)) if fifo_permitted(fifo_priority) else 1


def lower_thread_priority(nice: int) -> None:
    """Raise this thread's nice value by `nice` (Linux: a thread id takes PRIO_PROCESS; no privilege needed to
    lower one's own priority): under CFS the publisher process, at the node's own nice value, then preempts it when
    its tick is due instead of waiting for a core."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (OSError, AttributeError) as e:
        log.warning("worker_nice %d not applied: %s", nice, e)
