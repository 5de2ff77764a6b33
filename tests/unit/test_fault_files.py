"""Faults in what the node and its tools write: an engine build killed halfway (SIGKILL) leaves nothing that is ever
loaded and its leftovers are removed by the next build, two builders never build at once, a corrupt engine is
rebuilt loudly; a drive cut off by a full disk is ended at its last complete record and reads back."""

from __future__ import annotations

import logging
import signal
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from mcap.opcode import Opcode
from mcap.reader import make_reader

from helpers.fault_helpers import file_size_limit
from helpers.paths import REPO_ROOT
from vla_node.backends.store import EngineKey, EngineStore
from vla_node.drives.open import DriveWriter, open_drive
from vla_node.drives.record import end_drive_at, record_ends

KEY = dict(step="tick", recipe="fp32", backend="onnxruntime", backend_version="1.32.0", device="cpu x", weights="w0",
           shapes=(("bias", (3, 4)),))
BUILDER = textwrap.dedent("""
    import sys, time
    from vla_node.backends.store import EngineKey, EngineStore
    def build(folder):
        (folder / "tick.onnx").write_bytes(b"half an engine")
        print("building", flush=True)
        time.sleep(float(sys.argv[2]))
        (folder / "tick.onnx").write_bytes(b"a whole engine")
    EngineStore(sys.argv[1]).get(EngineKey(**{KEY!r}), build, "vla-node build-engines")
    print("built", flush=True)
""").replace("{KEY!r}", repr(KEY))


def builder(root, seconds: float) -> subprocess.Popen:
    """A process building the KEY engine in `root`, `seconds` long; returns once it is building."""
    proc = subprocess.Popen([sys.executable, "-c", BUILDER, str(root), str(seconds)], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "building"
    return proc


class Builder:
    def __init__(self) -> None:
        self.builds = 0

    def __call__(self, folder) -> None:
        self.builds += 1
        (folder / "tick.onnx").write_bytes(b"engine bytes")


def test_a_build_killed_halfway_is_never_loaded_and_its_leftovers_go_with_the_next_build(tmp_path, caplog):
    proc = builder(tmp_path, 60)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    store, key = EngineStore(tmp_path), EngineKey(**KEY)
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(f".{key.folder_name()}-"), leftovers
    assert store.problem(key) == "not built"  # the half-written folder is not the engine's
    build = Builder()
    with caplog.at_level(logging.WARNING):
        folder = store.get(key, build, "vla-node build-engines")
    assert build.builds == 1 and [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert "left by a build that did not finish" in caplog.text
    assert (folder / "tick.onnx").read_bytes() == b"engine bytes"


def test_two_processes_never_build_one_engine_at_once(tmp_path, caplog):
    proc = builder(tmp_path, 1.0)  # builds for a second, holding the store's lock
    store, build = EngineStore(tmp_path), Builder()
    with caplog.at_level(logging.WARNING):
        folder = store.get(EngineKey(**KEY), build, "vla-node build-engines")  # waits, then finds it built
    assert proc.stdout.read().strip() == "built" and proc.wait(10) == 0
    assert build.builds == 0 and (folder / "tick.onnx").read_bytes() == b"a whole engine"
    assert "another process is building" in caplog.text


def test_a_corrupt_engine_is_rebuilt_with_a_warning_naming_the_file(tmp_path, caplog):
    store, build, key = EngineStore(tmp_path), Builder(), EngineKey(**KEY)
    folder = store.get(key, build, "vla-node build-engines")
    engine = folder / "tick.onnx"
    engine.write_bytes(engine.read_bytes()[:-1] + b"X")  # same size, one byte changed
    with caplog.at_level(logging.WARNING):
        store.get(key, build, "vla-node build-engines")
    assert build.builds == 2 and store.problem(key) is None
    assert "tick.onnx corrupt or truncated" in caplog.text and "rebuilding" in caplog.text


# --- a drive cut off by a full disk -------------------------------------------------------------------------------
def write_drive(path, frames: int = 6) -> list[int]:
    """A drive of an instruction and `frames` 32x32 frames, one chunk per frame (uncompressed, chunks of at most
    1 KiB: the instruction and the schemas fill one before them); the end offset of each frame's Chunk record."""
    rng = np.random.default_rng(0)
    with DriveWriter(path, compression="none", chunk_size=1024) as writer:
        writer.add_message("instruction", 1, {"v": 1, "seq": 0, "stamp_ns": 1, "text": "go"})
        for seq in range(frames):
            writer.add_frame("front", seq, 10 + seq, "rgb8", 32, 32, rng.integers(0, 256, 32 * 32 * 3, np.uint8))
    data, offset, chunks = path.read_bytes(), 8, []
    while offset < len(data) - 8:
        opcode, length = struct.unpack_from("<BQ", data, offset)
        offset += 9 + length
        if opcode == Opcode.CHUNK:
            chunks.append(offset)
    assert len(chunks) == frames + 1, chunks
    return chunks[1:]


def frame_seqs(path) -> list[int]:
    with open(path, "rb") as f:
        return [m.sequence for _, channel, m in make_reader(f).iter_messages() if channel.topic == "frame/front"]


@pytest.mark.parametrize("cut", ["in_the_fourth_chunk", "in_the_summary"])
def test_a_drive_cut_off_halfway_is_ended_at_its_last_complete_record_and_reads_back(tmp_path, cut):
    path = tmp_path / "drive.mcap"
    chunks = write_drive(path)
    data = path.read_bytes()
    assert frame_seqs(path) == list(range(6)) and len(chunks) == 6
    size = chunks[3] - 10 if cut == "in_the_fourth_chunk" else len(data) - 40
    path.write_bytes(data[:size])
    with pytest.raises(Exception):
        frame_seqs(path)  # as the failed write left it: no footer, the mcap reader refuses it
    ends = record_ends(path)
    assert ends and ends[-1] <= size and all(e in ends for e in chunks if e <= size), (ends, chunks)
    kept = end_drive_at(path, ends)
    assert kept == path.stat().st_size
    expected = 3 if cut == "in_the_fourth_chunk" else 6  # every frame of a complete chunk
    assert frame_seqs(path) == list(range(expected))
    assert open_drive(path).frame_count == expected


def test_where_even_the_ending_does_not_fit_the_drive_ends_a_record_earlier(tmp_path):
    """A file size limit 10 bytes past the end of the fourth chunk, the file cut in the fifth: the 50-byte ending
    fits after no record past the fourth chunk, so the drive ends before it, and still reads back."""
    path = tmp_path / "drive.mcap"
    chunks = write_drive(path)
    path.write_bytes(path.read_bytes()[:chunks[4] - 10])
    code = ("import sys; from pathlib import Path; from vla_node.drives.record import end_drive_at, record_ends; "
            "p = Path(sys.argv[1]); print(end_drive_at(p, record_ends(p)))")
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO_ROOT, capture_output=True, text=True,
                          preexec_fn=file_size_limit(chunks[3] + 10), timeout=60)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == path.stat().st_size <= chunks[3] + 10
    seqs = frame_seqs(path)
    assert seqs == list(range(len(seqs))) and 2 <= len(seqs) <= 4, seqs
