"""The node in its own process for replays and tests: `python -m vla_node.cli run` on private addresses, its
output in a log file, stopped with SIGINT, its exit code and the tail of its log in every error."""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import zmq

from vla_node.node.signals import SignalFlag
from vla_node.wire.transport import TransportConfig

ADDRESS_KEYS = ("frames", "commands", "actions", "health")
STOP_TIMEOUT_S = 30.0  # SIGINT to exit
LOG_TAIL_LINES = 12
PR_SET_PDEATHSIG = 1  # prctl(2)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # a terminal's, a supervisor's, a closed session's


class NodeProcessError(RuntimeError):
    """The node could not be reached, crashed, or did not stop; the message names the exit code and log."""


def private_addresses() -> dict[str, str]:
    """Four unused addresses: Linux abstract ipc (a second bind is refused, nothing to clean up), else free
    loopback tcp ports."""
    if sys.platform.startswith("linux"):
        tag = f"vla-node-replay-{os.getpid()}-{secrets.token_hex(4)}"
        return {key: f"ipc://@{tag}-{key}" for key in ADDRESS_KEYS}
    ctx = zmq.Context.instance()
    ports = []
    for _ in ADDRESS_KEYS:
        with ctx.socket(zmq.PUB) as probe:
            ports.append(probe.bind_to_random_port("tcp://127.0.0.1"))
    return {key: f"tcp://127.0.0.1:{port}" for key, port in zip(ADDRESS_KEYS, ports)}


def _child_signals() -> None:
    """In the child before exec: no signal blocked or ignored as its parent may have them (a Ray worker blocks
    SIGINT, which the node stops on; both the mask and ignored dispositions survive exec), and on Linux SIGTERM when
    the thread that started it dies, so a replay killed outright (a fleet task's worker, SIGKILL) never leaves its
    node running."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class NodeProcess:
    """`vla-node run` in a child process (its own session, so a terminal's Ctrl-C reaches only the replay,
    which stops the node itself); stdout and stderr go to log_path. overrides: `--set SECTION.KEY=VALUE` for the
    launch file; env: variables added to this process's environment."""

    def __init__(self, launch: Path, transport: TransportConfig, log_path: Path, overrides: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        command = [sys.executable, "-m", "vla_node.cli", "run", "--launch", str(launch)]
        for key in ADDRESS_KEYS:
            command += [f"--{key}", getattr(transport, key)]
        for override in overrides:  # the launch file's values changed for this run (`--set`, config.apply_overrides)
            command += ["--set", override]
        self._log = open(log_path, "wb")
        self.launched_ns = time.monotonic_ns()  # the startup figure's origin (replay: launch -> first fresh action)
        # Python runs its at-fork callbacks (logging's, ...) around a fork with a preexec_fn and drops an exception
        # raised in one: a Ctrl-C handled there would be lost. During the fork it is only recorded, then raised
        with SignalFlag(*STOP_SIGNALS) as during_fork:
            try:
                self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                             stderr=subprocess.STDOUT, start_new_session=True,
                                             env=None if env is None else {**os.environ, **env},
                                             preexec_fn=_child_signals)
            except BaseException:
                self._log.close()
                raise
        if during_fork.received is not None:
            try:
                signal.raise_signal(during_fork.received)  # to the handler it was meant for (KeyboardInterrupt)
            except BaseException:
                self.proc.kill()  # the node just started
                self.proc.wait()
                self._log.close()
                raise

    def poll(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(log unreadable: {e})"
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def error(self, when: str) -> NodeProcessError:
        return NodeProcessError(f"the node exited with code {self.proc.returncode} {when}; last lines of "
                                f"{self.log_path}:\n{self.tail()}")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGINT, wait; a node still running after timeout_s is killed and that is an error."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                    raise NodeProcessError(f"the node did not stop within {timeout_s:g} s of SIGINT and was "
                                           f"killed; last lines of {self.log_path}:\n{self.tail()}") from None
            return self.proc.returncode
        finally:
            self._log.close()
