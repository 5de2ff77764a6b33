"""Record: a live tiny node's traffic into a native drive that reads back and replays; the writer queue's drop
accounting; argument errors."""

from __future__ import annotations

import threading
import time

import numpy as np

from helpers.node_helpers import TINY_LAUNCH, crc, road_frames, start_tiny_node
from vla_node.drives.open import DriveWriter, open_drive
from vla_node.drives.record import record
from vla_node.drives.replay import replay
from vla_node.node.process import private_addresses
from vla_node.wire.transport import Client, TransportConfig


class Recording:
    """record() in a thread until stop()."""

    def __init__(self, **kwargs) -> None:
        self.stop_event = threading.Event()
        self.summary = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, kwargs=kwargs, daemon=True)
        self.thread.start()

    def _run(self, **kwargs) -> None:
        try:
            self.summary = record(stop_event=self.stop_event, progress=False, **kwargs)
        except BaseException as e:  # re-raised by stop()
            self.error = e

    def stop(self):
        self.stop_event.set()
        self.thread.join(30)
        if self.error is not None:
            raise self.error
        return self.summary
def test_recording_a_live_node_reads_back_and_replays(tmp_path, capsys):
    node, addresses = start_tiny_node(tmp_path / "node.log")
    frames = road_frames(15)
    drive = tmp_path / "drive.mcap"
    with DriveWriter(drive) as writer:
        writer.add_message("instruction", 0, {"v": 1, "seq": 0, "stamp_ns": 0, "text": "follow the car"})
        for i, rgb in enumerate(frames):
            writer.add_frame("front", i, i * 100_000_000, "rgb8", 120, 160, rgb.tobytes())
    out = tmp_path / "rec.mcap"
    try:
        recording = Recording(launch=TINY_LAUNCH, out=out, addresses=addresses)
        replay(drive, TINY_LAUNCH, connect=True, addresses=addresses, out_dir=tmp_path / "r1", progress=False)
        summary = recording.stop()
        assert summary.written["frames"] == 15 and summary.written["commands"] == 1
        assert summary.written["actions"] > 10 and summary.written["health"] >= 1
        assert not any(summary.dropped.values()) and not summary.rejected
        assert "recorded 15 frames, 1 commands" in capsys.readouterr().out

        recorded = open_drive(out)
        assert recorded.kind == "native" and recorded.cameras == ("front",)
        assert [crc(f.rgb()) for f in recorded.frames()] == [crc(rgb) for rgb in frames]
        info = recorded.info()
        assert info.other_topics["instruction"] == 1 and info.other_topics["action"] == summary.written["actions"]
        assert info.other_topics["health"] == summary.written["health"]
        actions = [m.header for m in recorded.messages(["action"])]
        sent_stamps = {recorded.index.start_ns + f.stamp_ns for f in recorded.frames()}  # absolute stamps
        assert {a["status"] for a in actions} <= {"fresh", "chunk", "fallback"}
        assert any(a["frame_stamp_ns"] in sent_stamps for a in actions)  # actions name the recorded frames
        assert [m.header["model"] for m in recorded.messages(["health"])][-1] == "tiny"
        assert [m.header["text"] for m in recorded.commands()] == ["follow the car"]

        # the recording is a drive: it replays with its frames and its instruction
        report, *_ = replay(out, TINY_LAUNCH, connect=True, addresses=addresses, out_dir=tmp_path / "r2",
                            progress=False)
        assert report["frames_sent"] == 15 and report["frames_processed"] > 0
    finally:
        assert node.stop() == 0, node.tail()
def test_a_full_writer_queue_drops_and_counts_instead_of_blocking(tmp_path):
    addresses = private_addresses()
    out = tmp_path / "burst.mcap"
    image = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    with Client(TransportConfig(**addresses)) as client:
        recording = Recording(launch=TINY_LAUNCH, out=out, addresses=addresses, queue_size=1)
        client.frames_pub.RCVTIMEO = 5000
        assert client.frames_pub.recv() == b"\x01frame/"  # the recorder subscribed
        for seq in range(200):  # a burst far faster than zstd can write 640x480 frames
            client.send_frame("front", seq, time.monotonic_ns(), image)
        time.sleep(1.0)
        summary = recording.stop()
    assert summary.dropped["frames"] > 0
    assert summary.written["frames"] + summary.dropped["frames"] == 200
    assert open_drive(out).frame_count == summary.written["frames"]


