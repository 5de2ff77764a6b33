"""Replay a drive through a real node over ZeroMQ and write its latency report.

    report, json_path, html_path = replay("drive.mcap", launch="launch/cpu.toml", out_dir="out/replay")

1. The drive (a native drive, a ROS 2 bag or a video file) and the launch file are opened and checked first:
   every problem is a one-line DriveError / ConfigError before anything starts.
2. The node runs in its own process (`python -m vla_node.cli run`) on private ipc:// addresses, its log in
   out_dir/node.log; or, with connect=True, the node already running at the launch file's addresses is used.
3. Handshake (Client.wait_for_node) with a long timeout for the model's warm-up.
4. Streaming. Frames are published at the drive's recorded timing divided by `rate`, re-stamped with
   time.monotonic_ns() at send (the capture stamp the live node sees) and numbered per camera from 0 (loops
   continue the count). With as_fast_as_possible the replay runs closed loop with one frame in flight: the
   next frame of the node's first camera goes out as soon as an action names the previous one, or after
   max(2 x vision deadline, 0.2 s) when none does (the node skipped it). That measures the node's own
   throughput; a fixed high rate would only measure how many frames it drops. The drive's instruction and
   state commands are sent at their times. A reader thread decodes the drive ahead of the sender, and a
   receiver thread collects every action and health message with its arrival time: the sender never waits
   on either (except for the closed-loop answer).
5. Drain: until the last frame is answered (or its deadline has long passed) and one more health message
   arrived. The node is then stopped with SIGINT and must exit 0; a node that dies is a NodeProcessError with
   its exit code and the last lines of its log.
6. One FrameRecord per frame of the node's first camera (the camera actions are made for), one ActionRecord
   per action the node published from the first frame on; report.json and report.html in out_dir.

Frames and actions are matched by (frame_seq, frame_stamp_ns): stamps are unique, so a node that already
served an earlier replay cannot confuse the two.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np
import zmq

from vla_node.drive import DriveError, DriveFrame, DriveMessage, DriveReader, open_drive
from vla_node.progress import Progress
from vla_node.protocol import ProtocolError, decode_action, decode_health
from vla_node.report import ActionRecord, FrameRecord, RunMeta, build_report, format_summary, write_report
from vla_node.transport import Client, TransportConfig
from vla_node.validate import ConfigError, require

if TYPE_CHECKING:
    from vla_node.config import NodeConfig

ADDRESS_KEYS = ("frames", "commands", "actions", "health")
WARMUP_TIMEOUT_S = 300.0  # a cold small model on a busy 2-core CPU takes 10-30 s; a base model far longer
STOP_TIMEOUT_S = 30.0  # SIGINT to exit
PREFETCH_DEPTH = 8  # drive items decoded ahead of the sender
LOG_TAIL_LINES = 12


class NodeProcessError(RuntimeError):
    """The node could not be reached, crashed, or did not stop; the message names the exit code and log."""


# ---- the node process ----------------------------------------------------------------------------------


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


class NodeProcess:
    """`vla-node run` in a child process (its own session, so a terminal's Ctrl-C reaches only the replay,
    which stops the node itself); stdout and stderr go to log_path."""

    def __init__(self, launch: Path, transport: TransportConfig, log_path: Path) -> None:
        self.log_path = log_path
        command = [sys.executable, "-m", "vla_node.cli", "run", "--launch", str(launch)]
        for key in ADDRESS_KEYS:
            command += [f"--{key}", getattr(transport, key)]
        self._log = open(log_path, "wb")
        try:
            self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        except BaseException:
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


# ---- receiving -----------------------------------------------------------------------------------------


def action_record(msg: Mapping[str, Any], recv_ns: int) -> ActionRecord:
    return ActionRecord(
        recv_ns=recv_ns, stamp_ns=msg["stamp_ns"], seq=msg["seq"], status=msg["status"], level=msg["level"],
        frame_seq=msg["frame_seq"], frame_stamp_ns=msg["frame_stamp_ns"], timing_ms=msg["timing_ms"],
        tokens_refreshed=msg.get("tokens_refreshed"), reuse_ratio=msg.get("reuse_ratio"),
        kv_bytes=msg.get("kv_bytes"),
    )


class Receiver(threading.Thread):
    """Collects every action and health message from the client's SUBs, stamped at arrival. Malformed
    messages are counted (first reason kept); any other failure stops the thread and is re-raised by check()."""

    def __init__(self, client: Client) -> None:
        super().__init__(name="vla-replay-receiver", daemon=True)
        self.client = client
        self.actions: list[ActionRecord] = []
        self.health: dict | None = None
        self.health_count = 0
        self.last_health_ns = 0  # arrival of the newest health message
        self.rejected = 0
        self.first_reject: str | None = None
        self.error: BaseException | None = None
        self._answered_stamp = -1  # newest frame_stamp_ns an action named
        self._cond = threading.Condition()
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # re-raised in the sender's thread by check()
            self.error = e
        finally:
            with self._cond:
                self._cond.notify_all()

    def _loop(self) -> None:
        actions_sub, health_sub = self.client.actions_sub, self.client.health_sub
        limits = self.client.limits
        poller = zmq.Poller()
        poller.register(actions_sub, zmq.POLLIN)
        poller.register(health_sub, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(20):
                continue
            while True:
                try:
                    parts = actions_sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                recv_ns = time.monotonic_ns()
                try:
                    record = action_record(decode_action(parts, limits), recv_ns)
                except (ProtocolError, ValueError) as e:  # a malformed action: counted, reported
                    self._reject(f"action: {e}")
                    continue
                self.actions.append(record)
                if record.frame_stamp_ns is not None and record.frame_stamp_ns > self._answered_stamp:
                    with self._cond:
                        self._answered_stamp = record.frame_stamp_ns
                        self._cond.notify_all()
            while True:
                try:
                    parts = health_sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                recv_ns = time.monotonic_ns()
                try:
                    msg = decode_health(parts, limits)
                except ProtocolError as e:
                    self._reject(f"health: {e}")
                    continue
                with self._cond:
                    self.health, self.last_health_ns = msg, recv_ns
                    self.health_count += 1
                    self._cond.notify_all()

    def _reject(self, reason: str) -> None:
        self.rejected += 1
        if self.first_reject is None:
            self.first_reject = reason

    def wait_answered(self, frame_stamp_ns: int, timeout_s: float) -> bool:
        """Wait until an action names a frame stamped frame_stamp_ns or later."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._answered_stamp >= frame_stamp_ns or self.error is not None, timeout_s)

    def wait_health_after(self, t_ns: int, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.last_health_ns > t_ns or self.error is not None, timeout_s)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self._stopping.set()
        self.join(5)


# ---- reading the drive ahead of the sender -------------------------------------------------------------

_END = object()


class Prefetch(threading.Thread):
    """Decodes drive items (frames of the mapped cameras and commands, merged in time order) `loops` times into
    a small queue; an exception while reading is handed to the consumer."""

    def __init__(self, drive: DriveReader, commands: list[DriveMessage], cameras: Mapping[str, str],
                 loops: int) -> None:
        super().__init__(name="vla-replay-reader", daemon=True)
        self.drive, self.commands, self.cameras, self.loops = drive, commands, cameras, loops
        self.items: queue.Queue = queue.Queue(PREFETCH_DEPTH)
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            for loop in range(self.loops):
                frames = (f for f in self.drive.frames() if f.camera in self.cameras)
                # commands first at equal stamps: an instruction recorded with a frame applies to it
                for item in heapq.merge(self.commands, frames, key=lambda m: m.stamp_ns):
                    if not self._put((loop, item)):
                        return
        except BaseException as e:  # handed to the sender, which re-raises it
            self._put(e)
            return
        self._put(_END)

    def _put(self, item: object) -> bool:
        while not self._stopping.is_set():
            try:
                self.items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[int, DriveFrame | DriveMessage]]:
        while True:
            item = self.items.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self) -> None:
        self._stopping.set()
        self.join(5)


# ---- the replay ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class SentFrame:
    seq: int
    stamp_ns: int
    sent_ns: int


@dataclasses.dataclass
class StreamResult:
    frames: list[SentFrame]  # the node's first camera only
    sent_total: int  # frames of every camera plus commands
    lag_ms: list[float]  # send time - due time, realtime mode
    interrupted: bool


def camera_map(drive: DriveReader, config: NodeConfig) -> dict[str, str]:
    """drive camera -> node camera. One camera each: mapped whatever the names; otherwise by name, and every
    camera the node takes must be in the drive."""
    node_cameras = [c.name for c in config.cameras]
    if len(drive.cameras) == 1 and len(node_cameras) == 1:
        mapping = {drive.cameras[0]: node_cameras[0]}
    else:
        missing = [c for c in node_cameras if c not in drive.cameras]
        if missing:
            raise DriveError(f"{drive.path}: the node takes cameras {node_cameras} but the drive has "
                             f"{list(drive.cameras)} (missing {missing}); select one camera with --topic or "
                             f"use a launch file whose [[cameras]] match the drive")
        mapping = {c: c for c in node_cameras}
    sizes = drive.info().sizes
    for source, target in mapping.items():
        spec = next(c for c in config.cameras if c.name == target)
        width, height = sizes[source]
        if width > spec.max_width or height > spec.max_height:
            raise DriveError(f"{drive.path}: camera {source!r} frames are {width}x{height}; the node's camera "
                             f"{target!r} accepts at most {spec.max_width}x{spec.max_height} (cameras.max_width/"
                             f"max_height in the launch file)")
    return mapping


def _addresses(config: NodeConfig, addresses: Mapping[str, str] | None, connect: bool) -> TransportConfig:
    overrides = dict(addresses or {})
    unknown = sorted(set(overrides) - set(ADDRESS_KEYS))
    require(not unknown, "addresses", unknown, f"keys among {list(ADDRESS_KEYS)}")
    if not connect:
        overrides = {**private_addresses(), **overrides}
    return dataclasses.replace(config.transport, **overrides)


def _handshake(client: Client, node: NodeProcess | None, timeout_s: float, launch: Path) -> None:
    where = f"{client.config.actions}" + (" (model warm-up)" if node is not None else "")
    print(f"waiting for the node at {where} ...", flush=True)
    start = time.monotonic()
    next_note = start + 15
    while True:
        left = timeout_s - (time.monotonic() - start)
        try:
            client.wait_for_node(max(0.05, min(1.0, left)))
            print(f"node ready after {time.monotonic() - start:.1f} s", flush=True)
            return
        except TimeoutError as e:
            if node is not None and node.poll() is not None:
                raise node.error("during start-up") from None
            if time.monotonic() - start >= timeout_s:
                hint = (f"is `vla-node run --launch {launch}` running?" if node is None
                        else f"see {node.log_path}")
                raise NodeProcessError(f"no node answered within {timeout_s:g} s ({e}); {hint}") from None
        if time.monotonic() >= next_note:
            print(f"still waiting ({time.monotonic() - start:.0f} s)", flush=True)
            next_note += 15


def _stream(client: Client, drive: DriveReader, commands: list[DriveMessage], cameras: Mapping[str, str],
            primary: str, *, rate: float, closed_loop: bool, loops: int, answer_timeout_s: float,
            receiver: Receiver, node: NodeProcess | None, progress: bool) -> StreamResult:
    period_ns = drive.duration_ns // max(drive.frame_count // max(len(drive.cameras), 1) - 1, 1)
    loop_span_ns = drive.duration_ns + period_ns  # one frame period between the end of a loop and the next
    seqs = {camera: 0 for camera in cameras.values()}
    command_seq = time.monotonic_ns() // 1000  # above any earlier replay's: ingest keeps the highest instruction seq
    sent: list[SentFrame] = []
    lag_ms: list[float] = []
    total = 0
    prefetch = Prefetch(drive, commands, cameras, loops)
    prefetch.start()
    frames_total = (drive.frame_count if len(drive.cameras) == len(cameras) else None)
    bar = Progress(frames_total * loops if frames_total else None, f"replay {Path(drive.path).name}",
                   enabled=progress)
    interrupted = False
    start_ns = time.monotonic_ns()
    try:
        for loop, item in prefetch:
            if not closed_loop:
                due_ns = start_ns + int((loop * loop_span_ns + item.stamp_ns) / rate)
                wait_ns = due_ns - time.monotonic_ns()
                if wait_ns > 0:
                    time.sleep(wait_ns / 1e9)
            if node is not None and node.poll() is not None:
                raise node.error("during the replay")
            receiver.check()
            stamp_ns = time.monotonic_ns()
            if not closed_loop:
                lag_ms.append((stamp_ns - due_ns) / 1e6)
            if isinstance(item, DriveMessage):
                if item.topic == "instruction":
                    client.send_instruction(command_seq, stamp_ns, item.header["text"])
                else:
                    client.send_state(command_seq, stamp_ns, item.header["values"])
                command_seq += 1
                total += 1
                continue
            camera = cameras[item.camera]
            seq = seqs[camera]
            seqs[camera] = seq + 1
            if item.encoding == "jpeg":
                client.send_frame(camera, seq, stamp_ns, item.payload, "jpeg", height=item.height, width=item.width)
            else:
                client.send_frame(camera, seq, stamp_ns, item.rgb(), "rgb8")
            sent_ns = time.monotonic_ns()
            total += 1
            bar.update(1)
            if camera == primary:
                sent.append(SentFrame(seq, stamp_ns, sent_ns))
                if closed_loop:
                    receiver.wait_answered(stamp_ns, answer_timeout_s)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        bar.close()
        prefetch.stop()
    return StreamResult(sent, total, lag_ms, interrupted)


def _stop_node(node: NodeProcess, failed: bool) -> None:
    """Stop the node and check its exit code; when the replay already failed, that first error is kept (a node
    that will not stop is still reported, on stderr)."""
    try:
        code = node.stop()
    except NodeProcessError as e:
        if not failed:
            raise
        print(f"also: {e}", file=sys.stderr)
        return
    if code != 0 and not failed:
        raise node.error("when stopped")


def _drain(receiver: Receiver, last: SentFrame | None, answer_timeout_s: float, health_period_s: float) -> None:
    if last is not None:
        receiver.wait_answered(last.stamp_ns, answer_timeout_s)
    receiver.wait_health_after(time.monotonic_ns(), health_period_s + 1.0)
    receiver.check()


def records(sent: list[SentFrame], actions: list[ActionRecord]) -> list[FrameRecord]:
    """FrameRecords: first_action_ns = arrival of the first fresh action naming the frame; processed = some
    action (fresh or a late chunk) names it, i.e. the node made a chunk from it."""
    named: set[tuple[int, int]] = set()
    first_fresh: dict[tuple[int, int], int] = {}
    for a in actions:
        if a.frame_seq is None:
            continue
        key = (a.frame_seq, a.frame_stamp_ns)
        named.add(key)
        if a.status == "fresh" and key not in first_fresh:
            first_fresh[key] = a.recv_ns
    return [FrameRecord(f.seq, f.stamp_ns, f.sent_ns, first_fresh.get((f.seq, f.stamp_ns)),
                        (f.seq, f.stamp_ns) in named) for f in sent]


def replay(
    drive: os.PathLike | str,
    launch: os.PathLike | str | None = None,
    *,
    connect: bool = False,
    rate: float = 1.0,
    as_fast_as_possible: bool = False,
    loop: int = 1,
    topic: str | None = None,
    out_dir: os.PathLike | str = "out/replay",
    progress: bool = True,
    addresses: Mapping[str, str] | None = None,
    warmup_timeout_s: float = WARMUP_TIMEOUT_S,
) -> tuple[dict, Path, Path]:
    """Replay `drive` through a node (started here from `launch`, default launch/cpu.toml; or the running one
    at the launch file's addresses with connect=True; `addresses` overrides any of frames/commands/actions/
    health) and write out_dir/report.json and report.html. Returns (report, json_path, html_path).

    rate: recorded timing x rate (2.0 = twice as fast); as_fast_as_possible: closed loop, one frame in flight;
    loop: play the drive this many times; topic: one camera of the drive (topic or camera name).
    Raises DriveError (drive), ConfigError (arguments, launch file), NodeProcessError (node). A Ctrl-C while
    streaming stops the replay early, writes the report of what was sent, and is re-raised."""
    require(isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate) and rate > 0,
            "rate", rate, "a number > 0 (1.0 = the recorded timing)")
    require(isinstance(loop, int) and not isinstance(loop, bool) and loop >= 1, "loop", loop, "an integer >= 1")
    require(isinstance(warmup_timeout_s, (int, float)) and warmup_timeout_s > 0, "warmup_timeout_s",
            warmup_timeout_s, "a number of seconds > 0")
    from vla_node.config import default_launch, load_launch  # imports the model (torch): on use, not at import

    launch_path = Path(launch) if launch is not None else default_launch()
    config = load_launch(launch_path)
    reader = open_drive(drive, topic)
    cameras = camera_map(reader, config)
    commands = list(reader.commands())
    transport = _addresses(config, addresses, connect)
    primary = config.cameras[0].name
    deadline_ms = config.scheduler.vision_deadline_ms
    answer_timeout_s = max(2 * deadline_ms / 1000, 0.2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"replay {reader.path}: {reader.kind}, {reader.frame_count} frames over {reader.duration_ns / 1e9:.2f} s, "
          f"cameras {dict(cameras)}, {len(commands)} commands; "
          + ("as fast as the node takes them" if as_fast_as_possible else f"at {rate:g}x")
          + (f", {loop} loops" if loop > 1 else ""), flush=True)

    try:
        client = Client(transport)
    except OSError as e:
        raise ConfigError(f"{e}; choose other addresses (--frames/--commands)") from None
    node: NodeProcess | None = None
    receiver: Receiver | None = None
    failed = True
    try:
        if not connect:
            node = NodeProcess(launch_path, transport, out / "node.log")
        _handshake(client, node, warmup_timeout_s, launch_path)
        receiver = Receiver(client)
        receiver.start()
        result = _stream(client, reader, commands, cameras, primary, rate=float(rate),
                         closed_loop=as_fast_as_possible, loops=loop, answer_timeout_s=answer_timeout_s,
                         receiver=receiver, node=node, progress=progress)
        if not result.interrupted:
            _drain(receiver, result.frames[-1] if result.frames else None, answer_timeout_s,
                   config.health.period_s)
        receiver.stop()
        receiver.check()
        failed = False
    finally:
        if receiver is not None and receiver.is_alive():
            receiver.stop()
        client.close()
        if node is not None:
            _stop_node(node, failed)

    first_ns = result.frames[0].stamp_ns if result.frames else time.monotonic_ns()
    actions = [a for a in receiver.actions if a.stamp_ns >= first_ns]
    frames = records(result.frames, actions)
    health = receiver.health or {}
    meta = RunMeta(drive=str(reader.path), model=str(health.get("model", config.model.checkpoint or config.model.preset)),
                   backend=str(health.get("backend", config.model.backend)),
                   control_hz=config.scheduler.control_hz, deadline_ms=deadline_ms, health=health)
    report = build_report(frames, actions, meta)
    json_path, html_path = write_report(report, frames, actions, out)
    late = sum(1 for f in frames if f.processed and f.first_action_ns is None)
    print(format_summary(report))
    notes = [f"processed too late to be fresh: {late}"]
    if result.lag_ms:
        notes.append(f"send lag p99 {np.percentile(result.lag_ms, 99):.1f} ms")
    if receiver.rejected:
        notes.append(f"malformed messages from the node: {receiver.rejected} (first: {receiver.first_reject})")
    if node is not None:
        notes.append(f"node log {node.log_path}")
    print("; ".join(notes))
    print(f"report: {json_path}\n        {html_path}", flush=True)
    if result.interrupted:
        raise KeyboardInterrupt
    return report, json_path, html_path


# ---- command line (wired by cli.py) --------------------------------------------------------------------


def add_address_arguments(parser) -> None:
    from vla_node.cli import add_address_options

    add_address_options(parser)


def add_replay_arguments(parser) -> None:
    """`vla-node replay DRIVE [--launch F] [--connect] [--rate X | --as-fast-as-possible] [--loop N]
    [--topic T] [--out DIR] [--no-progress] [--warmup-timeout S] [--frames A --commands A --actions A
    --health A]`."""
    parser.add_argument("drive", help="native drive (.mcap), ROS 2 bag (.mcap) or video file (.mp4)")
    parser.add_argument("--launch", help="launch file (default launch/cpu.toml)")
    parser.add_argument("--connect", action="store_true",
                        help="use the node already running at the launch file's addresses instead of starting one")
    pace = parser.add_mutually_exclusive_group()
    pace.add_argument("--rate", type=float, default=1.0, help="recorded timing x RATE (default 1.0)")
    pace.add_argument("--as-fast-as-possible", action="store_true",
                      help="closed loop: send the next frame once the node answered the previous one")
    parser.add_argument("--loop", type=int, default=1, help="play the drive N times (default 1)")
    parser.add_argument("--topic", help="replay one camera: its topic or camera name")
    parser.add_argument("--out", default="out/replay", help="report directory (default out/replay)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--warmup-timeout", type=float, default=WARMUP_TIMEOUT_S,
                        help=f"seconds to wait for the node to answer (default {WARMUP_TIMEOUT_S:g})")
    add_address_arguments(parser)


def replay_command(args) -> int:
    addresses = {k: getattr(args, k) for k in ADDRESS_KEYS if getattr(args, k, None)}
    replay(args.drive, args.launch, connect=args.connect, rate=args.rate,
           as_fast_as_possible=args.as_fast_as_possible, loop=args.loop, topic=args.topic, out_dir=args.out,
           progress=not args.no_progress, addresses=addresses or None, warmup_timeout_s=args.warmup_timeout)
    return 0
