"""Run `vla-node run` in its own process on private loopback addresses and talk to it over real ZeroMQ.

    with running_node(TINY_LAUNCH, tmp_dir) as node:       # handshake done; the process is killed at exit
        sent = node.send_frame()                            # -> (seq, stamp_ns)
        action = node.wait_fresh(sent[0])                    # the first fresh action naming that frame
        health = node.health()                              # the newest health message from now on

Addresses are Linux abstract ipc names (`ipc://@vla-test-<uuid>-frames`): unique per node, nothing to clean
up, and a second bind fails instead of stealing the endpoint (no free-port races). The node's stdout and
stderr go to a log file whose tail is attached to every failure raised here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import zmq

from vla_node.bench.node import tick_figures
from vla_node.node.faults import DELAY_FILE_ENV as DELAY_ENV  # the node's test-only stage delay
from vla_node.wire.protocol import decode_action, decode_health
from vla_node.wire.transport import Client, TransportConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCH_DIR = REPO_ROOT / "tests" / "launch"
TINY_LAUNCH = LAUNCH_DIR / "tiny.toml"
PATIENT_LAUNCH = LAUNCH_DIR / "tiny_patient.toml"  # generous deadlines: for tests about inputs, not timing
STATUSES = ("fresh", "chunk", "fallback")


def private_addresses(**transport: Any) -> TransportConfig:
    """Four abstract-namespace ipc addresses no other node or test uses."""
    tag = f"vla-test-{uuid.uuid4().hex[:12]}"
    return TransportConfig(frames=f"ipc://@{tag}-frames", commands=f"ipc://@{tag}-commands",
                           actions=f"ipc://@{tag}-actions", health=f"ipc://@{tag}-health", **transport)


class FreshLost(AssertionError):
    """The frame was processed on time and its chunk published, but its first tick went out as 'chunk' (step 1),
    never as 'fresh'. The chunk broker counts steps from the chunk's production time to the publisher's actual
    (jittered) tick time: when the first tick after production is late by more than the time between the
    previous grid tick and the production, that tick is already step 1 (vla_node/node.py passes `now`, not the
    tick's scheduled time, to ChunkBroker.next). Rare on a quiet machine, seen under heavy CPU contention."""

    def __init__(self, frame_seq: int, msg: dict, before: list) -> None:
        super().__init__(f"frame {frame_seq}: its chunk was first published as 'chunk' (step 1), never 'fresh': "
                         f"{msg}")
        self.frame_seq = frame_seq
        self.msg = msg
        self.before = before


@dataclass(frozen=True)
class Received:
    """An action or health map and when it arrived (time.monotonic_ns, the clock of the node's stamps)."""

    arrival_ns: int
    msg: dict


class NodeProcess:
    """The node's process: started at construction, stopped by stop() or kill()."""

    SOCKETS_OPEN = "node transport:"  # the node logs this line once its four sockets exist

    def __init__(self, launch: Path, addresses: TransportConfig, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.launch = Path(launch)
        self.addresses = addresses
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")
        command = [sys.executable, "-m", "vla_node.cli", "run", "--launch", str(self.launch),
                   "--frames", addresses.frames, "--commands", addresses.commands,
                   "--actions", addresses.actions, "--health", addresses.health]
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     start_new_session=True)  # a Ctrl-C at the test does not reach the node

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_log(self, text: str, timeout_s: float = 90.0) -> None:
        """Wait until the node's log contains `text` (e.g. 'node transport:', logged once its sockets exist)."""
        deadline = time.monotonic() + timeout_s
        while text not in self.log_path.read_text(errors="replace"):
            if not self.alive() or time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not in the node's log (exit code {self.proc.poll()}):\n"
                                     f"{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> tuple[int | None, float]:
        """Send `sig` and wait: (exit code or None if it did not exit in time, seconds it took)."""
        t0 = time.monotonic()
        if self.alive():
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        """Make sure the process is gone (SIGTERM, then SIGKILL after 5 s)."""
        if self.alive():
            rc, _ = self.stop(signal.SIGTERM, 5.0)
            if rc is None:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class NodeUnderTest:
    """A node process plus a client bound on its addresses; helpers to stream frames and read actions."""

    def __init__(self, process: NodeProcess, client: Client | None, delay_file: Path | None = None) -> None:
        self.process = process
        self.client = client
        self.delay_file = delay_file  # the node's test-only stage delay file, when enabled
        self.next_seq = 0
        self.sent: dict[int, int] = {}  # every frame this harness published: seq -> stamp_ns
        self.fresh_lost = 0  # frames retried by send_and_wait_fresh because of FreshLost
        self.rng = np.random.default_rng(0)

    def set_delay(self, stage: str, ms: float) -> None:
        """Make the node sleep `ms` in `stage` (0: no delay). The file is replaced atomically; the node re-reads
        it at most every 50 ms."""
        self.set_faults(f"{stage} {ms:g}")

    def set_faults(self, *lines: str) -> None:
        """Replace the node's test-only faults, one line per stage (vla_node/node/faults.py): "vision 300" (a delay),
        "vision stall 1500" (a hung engine, mid-step), "action raise" (a failing engine); no line: no fault."""
        if self.delay_file is None:
            raise RuntimeError("this node was started without stage_delay=True")
        tmp = self.delay_file.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, self.delay_file)

    # --- client ---------------------------------------------------------------------------------------------
    def connect(self, *, handshake_s: float | None = 60.0, **client_kwargs: Any) -> Client:
        """Replace the client (closing the old one) by one with `client_kwargs` (Client's keyword arguments,
        e.g. client_secret_key=...); handshake unless handshake_s is None."""
        if self.client is not None:
            self.client.close()
            self.client = None
        config = self.process.addresses
        if "curve_keys_dir" in client_kwargs:
            config = replace(config, curve_keys_dir=client_kwargs.pop("curve_keys_dir"))
        self.client = Client(config, **client_kwargs)
        if handshake_s is not None:
            self.handshake(handshake_s)
        return self.client

    def handshake(self, timeout_s: float) -> None:
        """Client.wait_for_node, failing at once (with the log) when the node process exits meanwhile."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive("before the handshake")
            try:
                self.client.wait_for_node(min(1.0, max(0.01, deadline - time.monotonic())))
                return
            except TimeoutError as e:
                if time.monotonic() >= deadline:
                    links = [h.get("transport") for h in self.queued_health()[-1:]]  # what the node's inputs did
                    raise AssertionError(f"{e}\nnode health transport: {links}\n--- node log ---\n"
                                         f"{self.process.log_tail()}") from None

    def check_alive(self, when: str = "") -> None:
        if not self.process.alive():
            raise AssertionError(f"the node exited with code {self.process.proc.returncode} {when}\n"
                                 f"--- node log ---\n{self.process.log_tail()}")

    # --- frames ---------------------------------------------------------------------------------------------
    def image(self, height: int = 48, width: int = 64) -> np.ndarray:
        return self.rng.integers(0, 256, (height, width, 3), dtype=np.uint8)

    def send_frame(self, image: np.ndarray | None = None, camera: str = "front") -> tuple[int, int]:
        """Publish a frame stamped now (CLOCK_MONOTONIC); returns (seq, stamp_ns). Seqs increase per node."""
        seq, stamp = self.next_seq, time.monotonic_ns()
        self.next_seq += 1
        self.client.send_frame(camera, seq, stamp, self.image() if image is None else image)
        self.sent[seq] = stamp
        return seq, stamp

    def stream(self, seconds: float, fps: float = 10.0, until: Callable[[Received], bool] | None = None,
               image: Callable[[], np.ndarray] | None = None,
               events: list[tuple[float, Callable[[], None]]] = (),
               cameras: Sequence[str] = ("front",)) -> tuple[list[Received], dict[int, int]]:
        """Publish frames at `fps` for `seconds` (or until `until(action)` is true) while collecting every
        action; `events`: (seconds from the start, function) called once that time has come. `cameras`: the
        cameras sent a frame each period, read every period (an event may change the list), the first (the
        primary) sent last so that its frame finds the others' there. Returns (actions in arrival order,
        {frame seq: stamp_ns} sent)."""
        pending = sorted(events, key=lambda e: e[0])
        actions: list[Received] = []
        sent: dict[int, int] = {}
        sock = self.client.actions_sub
        start = time.monotonic_ns()
        end = start + int(seconds * 1e9)
        next_frame = start
        period = int(1e9 / fps)
        while True:
            now = time.monotonic_ns()
            if now >= end:
                break
            if pending and now >= start + int(pending[0][0] * 1e9):
                pending.pop(0)[1]()
                continue
            if now >= next_frame:
                for camera in reversed(list(cameras)):
                    seq, stamp = self.send_frame(None if image is None else image(), camera)
                    sent[seq] = stamp
                next_frame += period
                continue
            wake = min(next_frame, end, start + int(pending[0][0] * 1e9) if pending else end)
            if sock.poll(max(0, wake - now) // 1_000_000 + 1):
                parts = sock.recv_multipart()
                received = Received(time.monotonic_ns(), decode_action(parts))
                actions.append(received)
                if until is not None and until(received):
                    break
        return actions, sent

    # --- actions --------------------------------------------------------------------------------------------
    def recv_actions(self, seconds: float) -> list[Received]:
        """Every action arriving within `seconds`."""
        out: list[Received] = []
        sock = self.client.actions_sub
        end = time.monotonic_ns() + int(seconds * 1e9)
        while (left := end - time.monotonic_ns()) > 0:
            if sock.poll(left // 1_000_000 + 1):
                parts = sock.recv_multipart()
                out.append(Received(time.monotonic_ns(), decode_action(parts)))
        return out

    def drain_actions(self) -> list[Received]:
        """The actions already queued at the client (older than anything sent from now on)."""
        out: list[Received] = []
        sock = self.client.actions_sub
        while True:
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(Received(time.monotonic_ns(), decode_action(parts)))

    def wait_fresh(self, frame_seq: int, timeout_s: float = 5.0) -> tuple[dict, list[Received]]:
        """Read actions until a fresh one names frame_seq: (that action, every action read before it).
        Raises FreshLost when the frame's chunk is first published as 'chunk' (see FreshLost)."""
        before: list[Received] = []
        sock = self.client.actions_sub
        end = time.monotonic_ns() + int(timeout_s * 1e9)
        while (left := end - time.monotonic_ns()) > 0:
            if sock.poll(left // 1_000_000 + 1):
                msg = decode_action(sock.recv_multipart())
                if msg["frame_seq"] == frame_seq and msg["status"] == "fresh":
                    return msg, before
                if msg["frame_seq"] == frame_seq and msg["status"] == "chunk":
                    raise FreshLost(frame_seq, msg, before)
                before.append(Received(time.monotonic_ns(), msg))
        self.check_alive(f"while waiting for a fresh action naming frame {frame_seq}")
        named = [(r.msg["status"], r.msg["frame_seq"]) for r in before[-12:]]
        health = self.queued_health()[-1:]
        raise AssertionError(f"no fresh action named frame {frame_seq} within {timeout_s} s; last (status, "
                             f"frame_seq): {named}; last health: {health}\n--- node log ---\n"
                             f"{self.process.log_tail()}")

    def warm_up(self, attempts: int = 5) -> None:
        """Publish frames until one makes a fresh action (the first inference after start can be slow)."""
        for attempt in range(attempts):
            try:
                self.send_and_wait_fresh(timeout_s=3.0)
                return
            except AssertionError:
                if attempt == attempts - 1:
                    raise

    def send_and_wait_fresh(self, timeout_s: float = 5.0, attempts: int = 3) -> tuple[int, dict]:
        """Drain old actions, publish one frame, wait for the fresh action naming it: (seq, action).
        A frame whose chunk was made but first published as 'chunk' (FreshLost) is retried with a new frame,
        up to `attempts` frames in all."""
        for attempt in range(attempts):
            self.drain_actions()
            seq, _ = self.send_frame()
            try:
                action, _ = self.wait_fresh(seq, timeout_s)
                return seq, action
            except FreshLost:
                self.fresh_lost += 1
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    # --- health ---------------------------------------------------------------------------------------------
    def queued_health(self) -> list[dict]:
        """The health messages already queued at the client, oldest first."""
        out = []
        while True:
            try:
                parts = self.client.health_sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(decode_health(parts))

    def health(self, timeout_s: float = 5.0, after_ns: int | None = None,
               until: Callable[[dict], bool] | None = None) -> dict:
        """The first health message stamped at or after `after_ns` (default: now) for which `until` holds
        (default: any). Actions are drained meanwhile so that their queue never fills."""
        after_ns = time.monotonic_ns() if after_ns is None else after_ns
        sock = self.client.health_sub
        end = time.monotonic_ns() + int(timeout_s * 1e9)
        last = None
        while (left := end - time.monotonic_ns()) > 0:
            if sock.poll(min(left // 1_000_000 + 1, 50)):
                msg = decode_health(sock.recv_multipart())
                if msg["stamp_ns"] >= after_ns:
                    last = msg
                    if until is None or until(msg):
                        return msg
            self.drain_actions()
        self.check_alive("while waiting for health")
        raise AssertionError(f"no matching health message within {timeout_s} s; last one: {last}\n"
                             f"--- node log ---\n{self.process.log_tail()}")


@contextlib.contextmanager
def running_node(launch: Path = TINY_LAUNCH, log_dir: Path | None = None, *, env: dict[str, str] | None = None,
                 stage_delay: bool = False, handshake_s: float | None = 90.0,
                 addresses: TransportConfig | None = None, **client_kwargs: Any) -> Iterator[NodeUnderTest]:
    """Start a node on private addresses (or `addresses`) and a client bound there; handshake (unless handshake_s
    is None, then no client is made: call node.connect); always stop the node and close the client at exit.
    stage_delay: enable the node's test-only faults (node.set_delay, node.set_faults), initially none."""
    log_dir = Path(tempfile.mkdtemp(prefix="vla-node-test-")) if log_dir is None else Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    name = f"node-{uuid.uuid4().hex[:8]}"
    delay_file = None
    if stage_delay:
        delay_file = log_dir / f"{name}.delay"
        delay_file.write_text("vision 0\n")
        env = {**(env or {}), DELAY_ENV: str(delay_file)}
    process = NodeProcess(launch, addresses or private_addresses(), log_dir / f"{name}.log", env)
    node = NodeUnderTest(process, None, delay_file)
    try:
        if handshake_s is not None:
            node.connect(handshake_s=handshake_s, **client_kwargs)
        yield node
    finally:
        if node.client is not None:
            node.client.close()
        process.kill()


# --- checks shared by the node tests -------------------------------------------------------------------------
def tick_count(actions: list[Received], period_ns: int) -> dict[str, Any]:
    """How many control ticks the received actions cover (vla_node.bench.node.tick_figures): expected = the
    larger of the grid span of their stamps and of their arrival span; lost = seq gaps (published, not
    received); skipped = grid ticks the node did not publish; jitter_ms = lateness against the grid."""
    return tick_figures([a.msg["stamp_ns"] for a in actions], [a.msg["seq"] for a in actions],
                        [a.arrival_ns for a in actions], period_ns)


def check_action(msg: dict, horizon: int, dims: int, fallback: list[float]) -> None:
    """Fields beyond decode_action's checks: status, shapes, timing, and action = chunk row or fallback."""
    status = msg["status"]
    assert status in STATUSES, msg
    assert len(msg["action"]) == dims, msg
    assert all(isinstance(v, (int, float)) for v in msg["timing_ms"].values()), msg
    assert isinstance(msg["level"], int) and msg["level"] >= 0, msg
    if status == "fallback":
        assert msg["chunk"] == [] and msg["action"] == fallback, msg
        return
    chunk = msg["chunk"]
    assert len(chunk) == horizon and all(len(row) == dims for row in chunk), msg
    assert msg["frame_seq"] is not None and msg["frame_stamp_ns"] is not None, msg
    assert msg["timing_ms"], msg  # a chunk carries the stage times of the frame it came from
    if status == "fresh":
        assert msg["action"] == chunk[0], msg
    else:
        assert msg["action"] in chunk, msg
