"""SignalFlag: a signal is recorded, never raised, and the previous handler comes back."""

import os
import signal
import threading
import time

from vla_node.node.signals import SignalFlag


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
