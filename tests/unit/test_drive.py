"""Drives: native MCAP write/read, ROS 2 bags, video files, conversion, errors, and the progress bar."""

from __future__ import annotations

import io
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcap.writer import Writer as McapWriter
from mcap_ros2.writer import Writer as Ros2Writer

from vla_node.drives.convert import convert_synthetic, convert_video
from vla_node.drives.open import DriveError, DriveFrame, DriveWriter, open_drive
from vla_node.drives.synthetic import SyntheticDriveConfig, synthetic_frames
from vla_node.drives.video import JpegEncoder
from vla_node.progress import Progress

T0 = 1_700_000_000_000_000_000  # an absolute capture clock: readers report stamps relative to the first message

TIME_DEF = "int32 sec\nuint32 nanosec\n"
HEADER_DEF = "builtin_interfaces/Time stamp\nstring frame_id\n"
SEP = "=" * 80 + "\n"
IMAGE_DEF = (
    "std_msgs/Header header\nuint32 height\nuint32 width\nstring encoding\nuint8 is_bigendian\nuint32 step\n"
    "uint8[] data\n" + SEP + "MSG: std_msgs/Header\n" + HEADER_DEF + SEP + "MSG: builtin_interfaces/Time\n" + TIME_DEF
)
COMPRESSED_DEF = (
    "std_msgs/Header header\nstring format\nuint8[] data\n" + SEP + "MSG: std_msgs/Header\n" + HEADER_DEF + SEP
    + "MSG: builtin_interfaces/Time\n" + TIME_DEF
)


def rng_image(seed: int, height: int = 24, width: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def assert_one_line_error(err: pytest.ExceptionInfo, path: Path, *fragments: str) -> None:
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(f"{path}: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def smooth_image(seed: int, height: int = 48, width: int = 64) -> np.ndarray:
    """A frame JPEG compresses faithfully (noise would not)."""
    config = SyntheticDriveConfig(width=width, height=height, fps=10.0, seconds=1.0, seed=seed)
    return next(synthetic_frames(config))[1]


# ---- native drives ------------------------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["zstd", "lz4", "none"])
def test_native_round_trip_is_byte_exact(tmp_path, compression):
    path = tmp_path / "drive.mcap"
    images = [rng_image(i) for i in range(6)]
    with DriveWriter(path, compression=compression, chunk_size=4096) as writer:
        writer.add_message("instruction", T0 - 5, {"v": 1, "seq": 0, "stamp_ns": T0 - 5, "text": "keep lane"})
        for i, rgb in enumerate(images):
            writer.add_frame("front", 100 + i, T0 + i * 50_000_000, "rgb8", 24, 40, rgb.tobytes())
            values = [0.5, -1.0, i] if i % 2 == 0 else np.array([0.5, -1.0, i])  # numpy values become lists
            writer.add_message("state", T0 + i * 50_000_000 + 1,
                               {"v": 1, "seq": np.int64(i), "stamp_ns": T0 + i * 50_000_000 + 1, "values": values})
        writer.add_message("action", T0 + 10**9, {"v": 1, "seq": 0, "stamp_ns": T0 + 10**9, "status": "fresh",
                                                  "action": [0.1, 0.2], "chunk": [[0.1, 0.2], [0.3, 0.4]]})
    drive = open_drive(path)
    assert drive.kind == "native" and drive.cameras == ("front",) and drive.frame_count == 6
    assert drive.duration_ns == 10**9 + 5
    frames = list(drive.frames())
    assert [f.seq for f in frames] == list(range(100, 106))
    assert [f.stamp_ns for f in frames] == [5 + i * 50_000_000 for i in range(6)]
    for frame, rgb in zip(frames, images):
        assert (frame.camera, frame.encoding, frame.height, frame.width) == ("front", "rgb8", 24, 40)
        assert frame.payload == rgb.tobytes()
        assert np.array_equal(frame.rgb(), rgb)
    commands = list(drive.commands())
    assert [c.topic for c in commands] == ["instruction"] + ["state"] * 6
    assert commands[0].stamp_ns == 0 and commands[0].header["text"] == "keep lane"
    assert commands[3].header == {"v": 1, "seq": 2, "stamp_ns": T0 + 100_000_001, "values": [0.5, -1.0, 2]}
    assert commands[4].header["values"] == [0.5, -1.0, 3.0] and commands[4].header["seq"] == 3
    with DriveWriter(tmp_path / "other.mcap") as writer:
        with pytest.raises(ValueError, match="header_map for 'state' cannot be written as JSON"):
            writer.add_message("state", T0, {"values": object()})
    actions = list(drive.messages(["action"]))
    assert len(actions) == 1 and actions[0].header["chunk"] == [[0.1, 0.2], [0.3, 0.4]]
    info = drive.info()
    assert info.sizes == {"front": (40, 24)} and info.frame_count == 6 and info.profile == "vla-node"
    assert info.other_topics == {"action": 1, "chunk": 1, "timing": 1, "instruction": 1, "state": 6}
    assert info.to_dict()["duration_s"] == pytest.approx(1.000000005)
    assert list(drive.frames())[3].payload == images[3].tobytes()  # a reader can be iterated again
def test_native_multi_camera_jpeg_and_bgr8_frames_and_topic_selection(tmp_path):
    path = tmp_path / "cams.mcap"
    left, right = smooth_image(1), smooth_image(2)
    jpeg = JpegEncoder(2).encode(right)
    with DriveWriter(path) as writer:
        for i in range(4):
            writer.add_frame("right", i, T0 + i * 100 + 50, "jpeg", 48, 64, jpeg)
            writer.add_frame("left", i, T0 + i * 100, "bgr8", 48, 64, left[:, :, ::-1].tobytes())
    drive = open_drive(path)
    assert drive.cameras == ("left", "right") and drive.frame_count == 8
    frames = list(drive.frames())
    assert [(f.camera, f.stamp_ns) for f in frames[:3]] == [("left", 0), ("right", 50), ("left", 100)]
    lefts = [f for f in frames if f.camera == "left"]
    assert all(f.encoding == "rgb8" and np.array_equal(f.rgb(), left) for f in lefts)  # bgr8 stored, rgb8 read
    rights = [f for f in frames if f.camera == "right"]
    assert all(f.encoding == "jpeg" and f.payload == jpeg for f in rights)
    assert np.abs(rights[0].rgb().astype(np.int16) - right).mean() < 5  # 4:2:0 chroma on a tiny, sharp frame
    assert drive.info().source_encodings == {"left": "bgr8", "right": "jpeg"}
    for topic in ("frame/right", "right"):
        only = open_drive(path, topic=topic)
        assert only.cameras == ("right",) and only.frame_count == 4
        assert {f.camera for f in only.frames()} == {"right"}
    with pytest.raises(DriveError) as err:
        open_drive(path, topic="frame/rear")
    assert_one_line_error(err, path, "no image topic 'frame/rear'", "frame/left", "frame/right")
def test_writer_rejects_bad_frames_and_finishes_on_an_exception(tmp_path):
    path = tmp_path / "partial.mcap"
    with pytest.raises(RuntimeError, match="camera unplugged"):
        with DriveWriter(path) as writer:
            writer.add_frame("front", 0, T0, "rgb8", 2, 2, bytes(12))
            with pytest.raises(ValueError, match="payload: 11 bytes, expected height\\*width\\*3 = 12"):
                writer.add_frame("front", 1, T0, "rgb8", 2, 2, bytes(11))
            with pytest.raises(ValueError, match="encoding = 'yuv'"):
                writer.add_frame("front", 1, T0, "yuv", 2, 2, bytes(12))
            with pytest.raises(ValueError, match="camera = 'a/b'"):
                writer.add_frame("a/b", 1, T0, "rgb8", 2, 2, bytes(12))
            with pytest.raises(ValueError, match="stamp_ns = -1"):
                writer.add_frame("front", 1, -1, "rgb8", 2, 2, bytes(12))
            with pytest.raises(ValueError, match="frames go through add_frame"):
                writer.add_message("frame/front", T0, {})
            raise RuntimeError("camera unplugged")
    drive = open_drive(path)  # finished despite the exception: a readable one-frame drive
    assert drive.frame_count == 1 and next(drive.frames()).payload == bytes(12)
    with pytest.raises(ValueError, match="closed"):
        writer.add_frame("front", 2, T0, "rgb8", 2, 2, bytes(12))


# ---- ROS 2 bags ---------------------------------------------------------------------------------------


def ros_stamp(ns: int) -> dict:
    return {"sec": ns // 10**9, "nanosec": ns % 10**9}


def write_ros2_bag(path: Path, images: dict[str, list[tuple[str, np.ndarray]]]) -> None:
    """images: topic -> [(encoding or "jpeg"/"png", rgb)]; rows of raw images padded to exercise `step`."""
    with open(path, "wb") as f:
        writer = Ros2Writer(f)
        image_schema = writer.register_msgdef("sensor_msgs/msg/Image", IMAGE_DEF)
        compressed_schema = writer.register_msgdef("sensor_msgs/msg/CompressedImage", COMPRESSED_DEF)
        for t_index, (topic, frames) in enumerate(sorted(images.items())):
            for i, (encoding, rgb) in enumerate(frames):
                stamp = T0 + i * 100_000_000 + t_index * 1_000
                header = {"stamp": ros_stamp(stamp), "frame_id": topic}
                height, width = rgb.shape[:2]
                if encoding in ("jpeg", "png"):
                    data = JpegEncoder(2).encode(rgb) if encoding == "jpeg" else png_bytes(rgb)
                    msg = {"header": header, "format": encoding, "data": data}
                    writer.write_message(topic, compressed_schema, msg, log_time=stamp)
                    continue
                if encoding == "bgr8":
                    pixels = rgb[:, :, ::-1]
                elif encoding == "mono8":
                    pixels = rgb[:, :, :1]
                else:
                    pixels = rgb
                channels = pixels.shape[2]
                step = width * channels + 7  # padded rows
                rows = np.zeros((height, step), np.uint8)  # (H, step)
                rows[:, : width * channels] = pixels.reshape(height, width * channels)  # (H, W*C)
                msg = {"header": header, "height": height, "width": width, "encoding": encoding,
                       "is_bigendian": 0, "step": step, "data": rows.tobytes()}
                writer.write_message(topic, image_schema, msg, log_time=stamp)
        writer.finish()


def png_bytes(rgb: np.ndarray) -> bytes:
    from fractions import Fraction

    import av

    ctx = av.CodecContext.create("png", "w")
    ctx.width, ctx.height, ctx.pix_fmt, ctx.time_base = rgb.shape[1], rgb.shape[0], "rgb24", Fraction(1, 25)
    return bytes(ctx.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24"))[0])
def test_ros2_bag_images_read_back_with_the_right_pixels(tmp_path):
    path = tmp_path / "bag.mcap"
    a, b, c, d = rng_image(1), rng_image(2), smooth_image(3), rng_image(4)
    gray = np.repeat(rng_image(5)[:, :, :1], 3, axis=2)
    write_ros2_bag(path, {
        "/cam/rgb/image_raw": [("rgb8", a), ("rgb8", d)],
        "/cam/bgr": [("bgr8", b)] * 3,
        "/cam/compressed": [("jpeg", c)] * 2,
        "/cam/mono": [("mono8", gray)],
        "/cam/png": [("png", d)],
    })
    drive = open_drive(path)
    assert drive.kind == "ros2"
    assert set(drive.cameras) == {"image_raw", "bgr", "compressed", "mono", "png"}
    assert drive.frame_count == 9
    frames = list(drive.frames())
    assert [f.stamp_ns for f in frames] == sorted(f.stamp_ns for f in frames) and frames[0].stamp_ns == 0
    by_camera: dict[str, list[DriveFrame]] = {}
    for frame in frames:
        by_camera.setdefault(frame.camera, []).append(frame)
    assert [f.seq for f in by_camera["bgr"]] == [0, 1, 2]
    assert np.array_equal(by_camera["image_raw"][0].rgb(), a) and np.array_equal(by_camera["image_raw"][1].rgb(), d)
    assert by_camera["image_raw"][1].stamp_ns == 100_000_000 + 4 * 1_000  # log time minus the first message (T0)
    assert all(np.array_equal(f.rgb(), b) and f.encoding == "rgb8" for f in by_camera["bgr"])
    assert np.array_equal(by_camera["mono"][0].rgb(), gray)
    assert np.array_equal(by_camera["png"][0].rgb(), d)
    jpeg = by_camera["compressed"][0]
    assert jpeg.encoding == "jpeg" and (jpeg.height, jpeg.width) == c.shape[:2]
    assert np.abs(jpeg.rgb().astype(np.int16) - c).mean() < 5
    info = drive.info()
    assert info.source_encodings["bgr"] == "bgr8" and info.source_encodings["compressed"] == "jpeg"
    assert info.topics["bgr"] == "/cam/bgr" and info.sizes["mono"] == (40, 24)

    one = open_drive(path, topic="/cam/bgr")
    assert one.cameras == ("bgr",) and one.frame_count == 3
    assert open_drive(path, topic="cam/bgr").cameras == ("bgr",)  # leading slash optional
    assert open_drive(path, topic="compressed").cameras == ("compressed",)  # by camera name
    with pytest.raises(DriveError) as err:
        open_drive(path, topic="/cam/depth")
    assert_one_line_error(err, path, "no image topic '/cam/depth'", "/cam/bgr", "/cam/rgb/image_raw")
def test_ros2_unsupported_encoding_is_a_drive_error(tmp_path):
    path = tmp_path / "yuv.mcap"
    with open(path, "wb") as f:
        writer = Ros2Writer(f)
        schema = writer.register_msgdef("sensor_msgs/msg/Image", IMAGE_DEF)
        writer.write_message("/cam/yuv", schema, {"header": {"stamp": ros_stamp(T0), "frame_id": "c"}, "height": 2,
                                                  "width": 2, "encoding": "yuv422", "is_bigendian": 0, "step": 4,
                                                  "data": bytes(8)}, log_time=T0)
        writer.finish()
    with pytest.raises(DriveError) as err:
        open_drive(path)
    assert_one_line_error(err, path, "unsupported image encoding 'yuv422'", "rgb8", "bgr8", "mono8")
def test_ros2_image_with_too_little_data_is_a_drive_error(tmp_path):
    path = tmp_path / "short.mcap"
    with open(path, "wb") as f:
        writer = Ros2Writer(f)
        schema = writer.register_msgdef("sensor_msgs/msg/Image", IMAGE_DEF)
        writer.write_message("/cam", schema, {"header": {"stamp": ros_stamp(T0), "frame_id": "c"}, "height": 4,
                                              "width": 4, "encoding": "rgb8", "is_bigendian": 0, "step": 12,
                                              "data": bytes(40)}, log_time=T0)
        writer.finish()
    with pytest.raises(DriveError) as err:
        open_drive(path)
    assert_one_line_error(err, path, "40 data bytes, expected at least 48")


# ---- corrupt, truncated, empty, foreign ------------------------------------------------------------------


def native_drive(path: Path, frames: int = 30) -> None:
    with DriveWriter(path, chunk_size=16 * 1024) as writer:
        for i in range(frames):
            writer.add_frame("front", i, T0 + i, "rgb8", 24, 40, rng_image(i).tobytes())
def test_truncated_mcap_is_a_one_line_drive_error(tmp_path):
    path = tmp_path / "cut.mcap"
    native_drive(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DriveError) as err:
        open_drive(path)
    assert_one_line_error(err, path, "truncated MCAP")
    # the closing magic intact but the footer damaged: still a one-line error
    data = bytearray(data)
    data[-30:-10] = b"\xff" * 20
    path.write_bytes(bytes(data))
    with pytest.raises(DriveError) as err:
        open_drive(path)
    assert_one_line_error(err, path, "corrupt MCAP")
def test_corrupt_chunk_is_a_one_line_drive_error(tmp_path):
    path = tmp_path / "flipped.mcap"
    native_drive(path)
    data = bytearray(path.read_bytes())
    middle = len(data) // 3
    data[middle:middle + 64] = bytes(b ^ 0xA5 for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))
    with pytest.raises(DriveError) as err:
        drive = open_drive(path)
        for _ in drive.frames():
            pass
    assert_one_line_error(err, path, "corrupt MCAP")
def test_mcap_without_summary_or_chunks_is_scanned(tmp_path):
    from mcap.writer import IndexType

    path = tmp_path / "streamed.mcap"
    with open(path, "wb") as f:
        writer = McapWriter(f, use_chunking=False, use_statistics=False, index_types=IndexType.NONE,
                            repeat_channels=False, repeat_schemas=False, use_summary_offsets=False)
        writer.start(profile="vla-node", library="test")
        cid = writer.register_channel("frame/front", "msgpack", 0)
        for i in range(3):
            m = {"v": 1, "seq": i, "stamp_ns": T0 + i, "camera": "front", "encoding": "rgb8", "height": 2,
                 "width": 2, "data": bytes([i]) * 12}
            writer.add_message(cid, T0 + 10 * i, msgpack.packb(m), T0 + 10 * i)
        writer.finish()
    drive = open_drive(path)
    assert drive.frame_count == 3 and drive.duration_ns == 20
    assert [(f.seq, f.stamp_ns, f.payload[0]) for f in drive.frames()] == [(0, 0, 0), (1, 10, 1), (2, 20, 2)]
def test_bad_frame_message_is_a_drive_error(tmp_path):
    path = tmp_path / "bad.mcap"
    with open(path, "wb") as f:
        writer = McapWriter(f)
        writer.start(profile="vla-node", library="test")
        cid = writer.register_channel("frame/front", "msgpack", 0)
        good = {"v": 1, "seq": 0, "stamp_ns": T0, "camera": "front", "encoding": "rgb8", "height": 2, "width": 2,
                "data": bytes(12)}
        writer.add_message(cid, T0, msgpack.packb(good), T0)
        writer.add_message(cid, T0 + 1, msgpack.packb({**good, "data": bytes(5)}), T0 + 1)
        writer.add_message(cid, T0 + 2, b"\xc1 not msgpack", T0 + 2)
        writer.finish()
    drive = open_drive(path)
    frames = drive.frames()
    assert next(frames).payload == bytes(12)
    with pytest.raises(DriveError) as err:
        next(frames)
    assert_one_line_error(err, path, "frame on 'frame/front'", "5 payload bytes, expected 12")
def test_empty_drives_and_non_drives_are_drive_errors(tmp_path):
    empty = tmp_path / "empty.mcap"
    DriveWriter(empty).close()
    commands_only = tmp_path / "commands.mcap"
    with DriveWriter(commands_only) as writer:
        writer.add_message("instruction", T0, {"v": 1, "seq": 0, "stamp_ns": T0, "text": "go"})
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    cases = {
        empty: "empty drive",
        commands_only: "no image topics",
        text: "not a drive: neither an MCAP file nor a video",
        tmp_path / "missing.mcap": "no such file",
    }
    for path, problem in cases.items():
        with pytest.raises(DriveError) as err:
            open_drive(path)
        assert_one_line_error(err, path, problem)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(min_value=8, max_value=4000), st.binary(min_size=1, max_size=64), st.integers(0, 2**31))
def test_any_damage_to_a_drive_gives_drive_error_or_valid_frames(tmp_path_factory, offset, junk, seed):
    root = tmp_path_factory.getbasetemp() / "fuzz"
    root.mkdir(exist_ok=True)
    source = root / "source.mcap"
    if not source.exists():
        native_drive(source, frames=6)
    data = bytearray(source.read_bytes())
    start = offset % len(data)
    data[start:start + len(junk)] = junk
    damaged = root / f"damaged_{seed}.mcap"
    damaged.write_bytes(bytes(data[: len(data) - seed % 3 * 7]))
    try:
        for frame in open_drive(damaged).frames():
            assert len(frame.payload) == frame.height * frame.width * 3
    except DriveError as e:
        assert "\n" not in str(e) and str(e).startswith(str(damaged))
    finally:
        damaged.unlink()


# ---- video files and conversion --------------------------------------------------------------------------


def test_convert_synthetic_reads_back_exactly(tmp_path):
    config = SyntheticDriveConfig(width=96, height=64, fps=10.0, seconds=2.0, seed=9)
    out = tmp_path / "synthetic.mcap"
    summary = convert_synthetic(config, out, progress=False)
    assert summary.frames == 20 and summary.duration_s == pytest.approx(1.9)
    frames = list(open_drive(out).frames())
    for frame, (stamp_ns, rgb) in zip(frames, synthetic_frames(config), strict=True):
        assert frame.stamp_ns == stamp_ns and np.array_equal(frame.rgb(), rgb)
def test_failed_conversion_leaves_nothing_behind(tmp_path):
    out = tmp_path / "never.mcap"
    not_video = tmp_path / "x.mp4"
    not_video.write_bytes(b"\x00" * 100)
    with pytest.raises(DriveError):
        convert_video(not_video, out, progress=False)
    with pytest.raises(ValueError, match="encoding = 'png'"):
        convert_synthetic(SyntheticDriveConfig(width=64, height=48, seconds=1.0), out, encoding="png", progress=False)
    assert list(tmp_path.iterdir()) == [not_video]


# ---- progress bar -----------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True
def test_progress_plain_lines_are_rate_limited_when_not_a_tty():
    clock, stream = FakeClock(), io.StringIO()
    with Progress(100, "convert", stream=stream, clock=clock, log_interval_s=5.0) as bar:
        for _ in range(100):
            clock.ns += 100_000_000  # 10 items/s
            bar.update()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # at 5 s, at 10 s, and the final line
    assert lines[0].startswith("convert  50% 50/100 frames 10.0/s ETA 5s")
    assert lines[-1] == "convert 100% 100/100 frames 10.0/s in 10s"
    assert "\r" not in stream.getvalue()
def test_progress_redraws_in_place_on_a_tty_and_handles_unknown_totals():
    clock, stream = FakeClock(), TtyStream()
    bar = Progress(None, "record", stream=stream, clock=clock, unit="msgs", interval_s=0.1)
    for _ in range(30):
        clock.ns += 50_000_000
        bar.update(2)
    bar.close()
    bar.close()  # idempotent
    text = stream.getvalue()
    assert text.count("\r") == 16 and text.endswith("\n") and text.count("\n") == 1
    assert "record 60 msgs 40.0/s in 2s" in text
    clock2, stream2 = FakeClock(), TtyStream()
    with Progress(10, "x", stream=stream2, clock=clock2) as bar2:
        clock2.ns += 10**9
        bar2.update(5)
    assert "[" + "#" * 14 + "." * 14 + "]" in stream2.getvalue()
def test_disabled_progress_writes_nothing():
    stream = io.StringIO()
    with Progress(3, "quiet", stream=stream, enabled=False) as bar:
        bar.update(3)
    assert stream.getvalue() == "" and bar.count == 3
    with pytest.raises(ValueError, match="total = -1"):
        Progress(-1, "bad")
