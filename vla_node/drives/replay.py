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
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np

from vla_node.drives.open import DriveError, DriveMessage, DriveReader, open_drive
from vla_node.drives.record import BackgroundRecording
from vla_node.drives.replay_threads import Prefetch, Receiver
from vla_node.node.process import ADDRESS_KEYS, NodeProcess, NodeProcessError, private_addresses
from vla_node.node.signals import ExitOn, SignalFlag
from vla_node.progress import Progress
from vla_node.report.report import ActionRecord, FrameRecord, RunMeta, build_report, format_summary, write_report
from vla_node.validate import ConfigError, require
from vla_node.wire.transport import Client, TransportConfig

if TYPE_CHECKING:
    from vla_node.config import NodeConfig

WARMUP_TIMEOUT_S = 300.0  # a cold small model on a busy 2-core CPU takes 10-30 s; a base model far longer


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
    command_seq = 0  # the node orders commands by stamp_ns, then seq: a new replay's are newer whatever their seq
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
    # Ctrl-C (or SIGTERM, SIGHUP) stops between frames: none is sent unrecorded
    with SignalFlag(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as ctrl_c:
        try:
            for loop, item in prefetch:
                if ctrl_c.received is not None:
                    break
                if not closed_loop:
                    due_ns = start_ns + int((loop * loop_span_ns + item.stamp_ns) / rate)
                    wait_ns = due_ns - time.monotonic_ns()
                    if wait_ns > 0 and ctrl_c.sleep(wait_ns / 1e9):
                        break
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
                        deadline = time.monotonic() + answer_timeout_s
                        while (not receiver.wait_answered(stamp_ns, 0.05) and ctrl_c.received is None
                               and time.monotonic() < deadline):
                            pass
        except KeyboardInterrupt:  # where SignalFlag could not take over Ctrl-C (not the main thread)
            interrupted = True
        finally:
            bar.close()
            prefetch.stop()
    return StreamResult(sent, total, lag_ms, interrupted or ctrl_c.received is not None)


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
    on_records: Callable[[list[FrameRecord], list[ActionRecord]], None] | None = None,
    overrides: tuple[str, ...] = (),
    record_out: os.PathLike | str | None = None,
) -> tuple[dict, Path, Path]:
    """Replay `drive` through a node (started here from `launch`, default launch/cpu.toml; or the running one
    at the launch file's addresses with connect=True; `addresses` overrides any of frames/commands/actions/
    health) and write out_dir/report.json and report.html. Returns (report, json_path, html_path).

    rate: recorded timing x rate (2.0 = twice as fast); as_fast_as_possible: closed loop, one frame in flight;
    loop: play the drive this many times; topic: one camera of the drive (topic or camera name); on_records:
    called with the report's frame and action records (for a caller's own figures); overrides: `--set
    SECTION.KEY=VALUE` changes to the launch file (config.apply_overrides), for the node started here; record_out:
    a drive that records the replay's traffic as `vla-node record` does (Foxglove schemas, its layout beside it).
    Raises DriveError (drive), ConfigError (arguments, launch file), NodeProcessError (node). A Ctrl-C while
    streaming stops the replay early, writes the report of what was sent, and is re-raised."""
    _check_pacing(rate, loop, warmup_timeout_s)
    reader = open_drive(drive, topic)  # first: a bad drive fails in a moment, before torch is imported
    from vla_node.config import default_launch, load_launch

    launch_path = Path(launch) if launch is not None else default_launch()
    config = load_launch(launch_path, overrides)
    cameras = camera_map(reader, config)
    commands = list(reader.commands())
    _check_commands(reader.path, commands, config.limits)
    transport = _addresses(config, addresses, connect)
    if record_out is not None and Path(record_out).exists():
        raise FileExistsError(f"{record_out} exists: remove it or choose another --record-out")
    if record_out is not None and transport.curve_keys_dir is not None:
        raise ConfigError("replay --record-out: transport.curve_keys_dir is set, and recording encrypted (CURVE) "
                          "traffic is not supported yet")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"replay {reader.path}: {reader.kind}, {reader.frame_count} frames over {reader.duration_ns / 1e9:.2f} s, "
          f"cameras {dict(cameras)}, {len(commands)} commands; "
          + ("as fast as the node takes them" if as_fast_as_possible else f"at {rate:g}x")
          + (f", {loop} loops" if loop > 1 else ""), flush=True)
    if not connect:  # the node starts from a built engine store: its engines built (or checked) here, with progress
        from vla_node.node.policies import build_launch_engines

        build_launch_engines(config, str(launch_path), progress=lambda line: print(f"engines: {line}", flush=True))
    result, receiver, node = _replay_through_node(
        reader, commands, cameras, config, launch_path, transport, out, connect=connect, rate=rate,
        as_fast_as_possible=as_fast_as_possible, loop=loop, progress=progress, warmup_timeout_s=warmup_timeout_s,
        overrides=overrides, record_out=record_out)
    report, json_path, html_path = _write_replay_report(reader, config, result, receiver, node, out, on_records)
    if result.interrupted:
        raise KeyboardInterrupt
    return report, json_path, html_path


def _check_pacing(rate: float, loop: int, warmup_timeout_s: float) -> None:
    """replay's rate, loop count and warm-up timeout, checked before anything is opened (ConfigError)."""
    require(isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate) and rate > 0,
            "rate", rate, "a number > 0 (1.0 = the recorded timing)")
    require(isinstance(loop, int) and not isinstance(loop, bool) and loop >= 1, "loop", loop, "an integer >= 1")
    require(isinstance(warmup_timeout_s, (int, float)) and warmup_timeout_s > 0, "warmup_timeout_s",
            warmup_timeout_s, "a number of seconds > 0")


def _replay_through_node(reader: DriveReader, commands: list[DriveMessage], cameras: Mapping[str, str],
                         config: NodeConfig, launch_path: Path, transport: TransportConfig, out: Path, *,
                         connect: bool, rate: float, as_fast_as_possible: bool, loop: int, progress: bool,
                         warmup_timeout_s: float, overrides: tuple[str, ...] = (),
                         record_out: os.PathLike | str | None = None
                         ) -> tuple[StreamResult, Receiver, NodeProcess | None]:
    """Start the node (unless connect; its log in out/node.log), wait for it, stream the drive and drain its
    answers; the receiver, the client, the recording (record_out) and the node are stopped whatever happens.
    Returns (the stream's result, the receiver with every action and health message, the node or None)."""
    primary = config.cameras[0].name
    answer_timeout_s = max(2 * config.scheduler.vision_deadline_ms / 1000, 0.2)
    try:
        client = Client(transport)
    except OSError as e:
        raise ConfigError(f"{e}; choose other addresses (--frames/--commands)") from None
    node: NodeProcess | None = None
    receiver: Receiver | None = None
    recording = None if record_out is None else BackgroundRecording(
        launch_path, record_out, {key: getattr(transport, key) for key in ADDRESS_KEYS})
    failed = True
    # SIGTERM or SIGHUP (timeout, CI, a closed terminal) must not leave the node running: they exit through the
    # finally below (during the stream they stop it as Ctrl-C does, and the frames sent so far are reported)
    with ExitOn(signal.SIGTERM, signal.SIGHUP):
        try:
            if not connect:
                node = NodeProcess(launch_path, transport, out / "node.log", overrides)
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
            if recording is not None:
                recording.finish()
            failed = False
        finally:
            if receiver is not None and receiver.is_alive():
                receiver.stop()
            if recording is not None and recording.is_alive():
                recording.stop_event.set()
            client.close()
            if node is not None:
                _stop_node(node, failed)
    return result, receiver, node


def _write_replay_report(reader: DriveReader, config: NodeConfig, result: StreamResult, receiver: Receiver,
                         node: NodeProcess | None, out: Path,
                         on_records: Callable[[list[FrameRecord], list[ActionRecord]], None] | None = None,
                         ) -> tuple[dict, Path, Path]:
    """The report of the actions that answer the frames sent (from the first on): written to out/report.json and
    report.html, its summary and notes printed. Returns (report, json_path, html_path)."""
    report, frames, actions, json_path, html_path = latency_report(str(reader.path), config, result.frames, receiver,
                                                                   node, out)
    if on_records is not None:
        on_records(frames, actions)
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
    return report, json_path, html_path


def latency_report(drive: str, config: NodeConfig, sent: list[SentFrame], receiver: Receiver,
                   node: NodeProcess | None, out: Path) -> tuple[dict, list[FrameRecord], list, Path, Path]:
    """The latency report of the actions that answer the frames `sent` (from the first on), written to
    out/report.json and report.html: (report, frame records, action records, json path, html path)."""
    first_ns = sent[0].stamp_ns if sent else time.monotonic_ns()
    actions = [a for a in receiver.actions if a.stamp_ns >= first_ns]
    frames = records(sent, actions)
    health = receiver.health or {}
    answered = [f.first_action_ns for f in frames if f.first_action_ns is not None]
    startup_s = (answered[0] - node.launched_ns) / 1e9 if node is not None and answered else None
    meta = RunMeta(drive=drive, model=str(health.get("model", config.model.checkpoint or config.model.preset)),
                   backend=_backend(health, config), control_hz=config.scheduler.control_hz,
                   deadline_ms=config.scheduler.vision_deadline_ms, health=health,
                   recipe=str(health.get("recipe", "unknown")), startup_s=startup_s,
                   head=health.get("head") if isinstance(health.get("head"), str) else None)
    report = build_report(frames, actions, meta)
    json_path, html_path = write_report(report, frames, actions, out)
    return report, frames, actions, json_path, html_path


def _check_commands(path, commands: list[DriveMessage], limits) -> None:
    """Every recorded instruction and state as the node will decode it, before anything starts: a bad one is a
    DriveError naming the file, the topic and the stamp, not a crash halfway through the stream."""
    from vla_node.wire.codec import CodecError
    from vla_node.wire.protocol import ProtocolError, decode_command, encode_instruction, encode_state

    for item in commands:
        try:
            if item.topic == "instruction":
                parts = encode_instruction(0, item.stamp_ns, item.header.get("text"))
            else:
                parts = encode_state(0, item.stamp_ns, item.header.get("values"))
            decode_command(parts, limits)
        except (ConfigError, ProtocolError, CodecError, TypeError, ValueError) as e:
            raise DriveError(f"{path}: recorded {item.topic} at {item.stamp_ns} ns: {e}") from None


# ---- command line (wired by cli.py) --------------------------------------------------------------------


def _backend(health: dict, config) -> str:
    """The backend the node resolved at start ('onnxruntime'; 'torch on cuda'), as its health says."""
    backend = str(health.get("backend", config.model.backend))
    device = health.get("device")
    return f"{backend} on {device}" if isinstance(device, str) and device != "cpu" else backend
