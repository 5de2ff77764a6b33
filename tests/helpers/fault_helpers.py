"""Helpers of the fault-injection tests: a two-camera launch file with its checkpoint, action statuses as a string,
time windows over received messages, a node's process group, and a child process with a file size limit (a disk
that fills up, without root)."""

from __future__ import annotations

import json
import os
import resource
import signal
import time
from pathlib import Path
from typing import Callable, Iterable

from helpers.node_harness import LAUNCH_DIR, NodeUnderTest, Received
from vla_node.wire.protocol import decode_action

TWO_CAMERA_TEMPLATE = LAUNCH_DIR / "tiny_two_cameras.toml"
STATUS_LETTER = {"fresh": "F", "chunk": "c", "fallback": "b"}


def two_camera_launch(folder: Path) -> Path:
    """tests/launch/tiny_two_cameras.toml naming a checkpoint of the tiny model with two cameras (seeded random
    weights), both written into `folder`; the launch file's path."""
    from vla_node.model.checkpoint import save_checkpoint
    from vla_node.model.config import preset
    from vla_node.model.vla import build_vla

    checkpoint = save_checkpoint(build_vla(preset("tiny").replace(num_cameras=2), seed=0), folder / "tiny-2cam")
    launch = folder / "tiny_two_cameras.toml"
    text = TWO_CAMERA_TEMPLATE.read_text()
    launch.write_text(text.replace("[model]\n", f"[model]\ncheckpoint = {json.dumps(str(checkpoint))}\n", 1))
    return launch


def statuses(actions: Iterable[Received]) -> str:
    """The actions' statuses as one letter each: F fresh, c chunk, b fallback (e.g. "Fccccb")."""
    return "".join(STATUS_LETTER[a.msg["status"]] for a in actions)


def between(items: Iterable, start_ns: float, end_ns: float, stamp: Callable = lambda a: a.arrival_ns) -> list:
    """The items whose stamp (default: the arrival of a Received) lies in [start_ns, end_ns]."""
    return [item for item in items if start_ns <= stamp(item) <= end_ns]


def stream_offset(node: NodeUnderTest, seconds: float, offset_ns: int, fps: float = 10.0) -> tuple[list[Received],
                                                                                                  list[int]]:
    """Like NodeUnderTest.stream, with every frame stamped `offset_ns` off this host's clock (a camera clock that
    jumped): (actions in arrival order, the seqs of the frames sent)."""
    sock, actions, seqs = node.client.actions_sub, [], []
    image = node.image()
    end, next_frame, period = time.monotonic_ns() + int(seconds * 1e9), 0, int(1e9 / fps)
    while (now := time.monotonic_ns()) < end:
        if now >= next_frame:
            seq, node.next_seq = node.next_seq, node.next_seq + 1
            node.client.send_frame("front", seq, now + offset_ns, image)
            seqs.append(seq)
            next_frame = now + period
        elif sock.poll(max(1, (min(next_frame, end) - now) // 1_000_000)):
            actions.append(Received(time.monotonic_ns(), decode_action(sock.recv_multipart())))
    return actions, seqs


def process_group(pgid: int) -> list[int]:
    """The live processes (not zombies) of process group `pgid` (a node started in its own session: itself and
    its publisher process)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def file_size_limit(limit_bytes: int) -> Callable[[], None]:
    """A preexec_fn for subprocess: files of the child cannot grow past `limit_bytes`, and a write past it fails with
    EFBIG instead of killing the child (SIGXFSZ ignored; the ignore survives exec) - a disk that is full."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return apply
