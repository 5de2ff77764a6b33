"""vla_node.fuzz: bounded, reproducible hypothesis runs of every fuzz target (mutated seeds, and inputs built field by
field: every header field type and range, part counts, JPEG claims, launch values, checkpoint configs); the runner
and `vla-node fuzz` on a seconds-level budget; the runner catching a broken decoder, a hang, a crash and a memory
hog; and one regression test per crash the fuzzer found, with its minimal input inline."""

from __future__ import annotations

import functools
import json
import math
import random
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.fuzz_inputs import (
    CHUNK_INDEX,
    STATISTICS,
    STATS_END,
    STATS_START,
    foxglove_compressed,
    frame_message,
    native_drive,
    patch_field,
    ros2_compressed_without_format,
    ros2_image,
    three_frames,
    tiny_checkpoint_files,
)
from helpers.fuzz_targets import BROKEN, CRASHING, HANGING, HUNGRY, run_index_error
from vla_node.cli import main
from vla_node.config import load_launch
from vla_node.drives.open import DriveError, open_drive
from vla_node.fuzz.contract import MAX_MESSAGE_CHARS, FuzzFailure, check_message
from vla_node.fuzz.corpus import T0, jpeg, launch_toml, png
from vla_node.fuzz.inputs import pack_parts, pack_tree
from vla_node.fuzz.jpeg import set_size
from vla_node.fuzz.runner import format_summary, run_fuzz
from vla_node.fuzz.targets import TARGETS
from vla_node.fuzz.values import TOML_LITERALS, Raw, pack_with_raw
from vla_node.model.checkpoint import CheckpointError, load_checkpoint
from vla_node.validate import ConfigError, is_number, show
from vla_node.wire.codec import CodecError, unpack
from vla_node.wire.protocol import (
    CameraSpec,
    ProtocolError,
    decode_action,
    decode_command,
    decode_frame,
    decode_health,
)

WIRE_MS = 2_000  # hypothesis deadline per example: a wire message decodes in well under a millisecond
FILE_MS = 30_000  # a drive, launch file or checkpoint (the first example pays for lazy imports on a busy machine)


def bounded(examples: int, deadline_ms: int = WIRE_MS):
    """Few examples, derandomized (the same inputs on every run and machine), no example database."""
    return settings(max_examples=examples, deadline=timedelta(milliseconds=deadline_ms), derandomize=True,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.lru_cache(maxsize=None)
def seeds(name: str) -> tuple[bytes, ...]:
    return tuple(data for _, data in TARGETS[name].seeds())


def run(name: str, data: bytes):
    """One input through a target: an Outcome, or FuzzFailure (the test fails, hypothesis shrinks the input)."""
    with tempfile.TemporaryDirectory() as scratch:
        return TARGETS[name].run(data, Path(scratch))


# ---------------------------------------------------------------- every target, bounded

@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_seed_keeps_the_contract_and_most_are_accepted(name):
    outcomes = [run(name, data) for data in seeds(name)]
    assert sum(o.accepted for o in outcomes) >= len(outcomes) // 2, [o.reason for o in outcomes]


EXAMPLES = {"codec": 150, "frame": 150, "command": 100, "action": 100, "health": 60, "drive": 50, "launch": 60,
            "checkpoint": 20}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_mutated_seeds_keep_the_contract(name):
    target = TARGETS[name]

    @bounded(EXAMPLES[name], FILE_MS if name in ("drive", "launch", "checkpoint") else WIRE_MS)
    @given(index=st.integers(0, 63), rng_seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 4))
    def check(index, rng_seed, rounds):
        pool = list(seeds(name))
        rng = random.Random(rng_seed)
        data = pool[index % len(pool)]
        for _ in range(rounds):
            data = target.mutate(data, rng, pool)[: target.max_bytes]
        run(name, data)

    check()


LEAVES = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.integers(-2, 70000) | st.floats()
          | st.text(max_size=12) | st.binary(max_size=12) | st.sampled_from(["front", "side", "jpeg", "rgb8", "bgr8",
                                                                              "fresh", "fallback", "chunk"]))
VALUES = st.recursive(LEAVES, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                      max_leaves=12)
PAYLOADS = st.sampled_from([jpeg(16, 16), set_size(jpeg(16, 16), 60000, 60000), set_size(jpeg(16, 16), 48, 64),
                            jpeg(16, 16)[:200], jpeg(16, 16)[:-2], b"not a jpeg", bytes(16 * 16 * 3),
                            png(16, 16)]) | st.binary(max_size=96)
FRAME_KEYS = ["v", "seq", "stamp_ns", "camera", "encoding", "height", "width"]


@bounded(200)
@given(topic=st.sampled_from([b"frame/front", b"frame/side", b"frame/rear", b"frame/"]),
       changes=st.dictionaries(st.sampled_from(FRAME_KEYS + ["extra"]), VALUES, max_size=3),
       drop=st.sets(st.sampled_from(FRAME_KEYS), max_size=2), payload=PAYLOADS,
       extra_parts=st.lists(st.binary(max_size=8), max_size=2), keep=st.integers(0, 3))
def test_frame_headers_of_every_field_type_and_range(topic, changes, drop, payload, extra_parts, keep):
    header = {"v": 1, "seq": 1, "stamp_ns": 5, "camera": "front", "encoding": "jpeg", "height": 16, "width": 16}
    header.update(changes)
    for key in drop:
        header.pop(key, None)
    parts = [topic, msgpack.packb(header, use_bin_type=True), payload]
    run("frame", pack_parts(parts[:keep] + extra_parts if keep < 3 else parts + extra_parts))


COMMANDS = {b"instruction": {"v": 1, "seq": 1, "stamp_ns": 5, "text": "go"},
            b"state": {"v": 1, "seq": 1, "stamp_ns": 5, "values": [0.5, 1.0]},
            b"action": {"v": 1, "seq": 1, "stamp_ns": 5, "frame_seq": 1, "frame_stamp_ns": 4, "status": "fresh",
                        "level": 0, "action": [0.0, 1.0], "chunk": [[0.0, 1.0]], "timing_ms": {"total": 1.0}},
            b"health": {"v": 1, "stamp_ns": 5, "level": 0}}


COMMAND_KEYS = sorted({k for m in COMMANDS.values() for k in m} | {"extra"})


@bounded(300)
@given(topic=st.sampled_from(sorted(COMMANDS)), key=st.sampled_from(COMMAND_KEYS),
       value=VALUES | st.lists(st.floats(), max_size=5) | st.lists(st.lists(st.floats(), max_size=3), max_size=3),
       drop=st.booleans(), parts=st.integers(0, 4))
def test_command_action_and_health_fields_of_every_type_and_range(topic, key, value, drop, parts):
    msg = dict(COMMANDS[topic])
    if drop:
        msg.pop(key, None)
    else:
        msg[key] = value
    message = [topic, msgpack.packb(msg, use_bin_type=True)] + [b"x"] * max(parts - 2, 0)
    name = {b"instruction": "command", b"state": "command", b"action": "action", b"health": "health"}[topic]
    run(name, pack_parts(message[:parts] if parts < 2 else message))


@bounded(300)
@given(data=st.binary(max_size=256) | VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_codec_on_any_bytes(data):
    run("codec", data)


LAUNCH_LINES = [i for i, line in enumerate(launch_toml().split("\n")) if " = " in line]


def toml_number(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf") if math.isinf(x) else repr(x)


@bounded(80, FILE_MS)
@given(line=st.sampled_from(LAUNCH_LINES),
       value=st.sampled_from(TOML_LITERALS) | st.integers(-(2**70), 2**70).map(str) | st.floats().map(toml_number)
       | st.text(max_size=8).map(json.dumps))
def test_launch_values_of_every_type_and_range(line, value):
    lines = launch_toml().split("\n")
    lines[line] = lines[line].split(" = ")[0] + " = " + value
    run("launch", "\n".join(lines).encode("utf-8", "surrogatepass"))


MODEL_FIELDS = sorted(json.loads(tiny_checkpoint_files()["vla.json"])["model"])


@bounded(25, FILE_MS)
@given(key=st.sampled_from(MODEL_FIELDS + ["unknown"]),
       value=st.integers(-2, 2**70) | st.floats() | st.text(max_size=6) | st.lists(st.floats(), max_size=3)
       | st.none())
def test_checkpoint_configs_of_every_type_and_range(key, value):
    files = dict(tiny_checkpoint_files())
    meta = json.loads(files["vla.json"])
    meta["model"][key] = value
    files["vla.json"] = json.dumps(meta).encode()
    run("checkpoint", pack_tree(files))


@bounded(30, FILE_MS)
@given(order=st.permutations(range(4)), chunk_size=st.sampled_from([64, 1 << 20]))
def test_drives_with_out_of_order_stamps_read_back_in_time_order(order, chunk_size, tmp_path_factory):
    messages = [(T0 + k * 1000, frame_message(k, T0 + k * 1000)) for k in order]
    path = tmp_path_factory.mktemp("drive") / "d.mcap"
    path.write_bytes(native_drive(messages, chunk_size))
    assert run("drive", path.read_bytes()).accepted
    assert [f.seq for f in open_drive(path).frames()] == [0, 1, 2, 3]


# ---------------------------------------------------------------- the runner and the command


def test_run_fuzz_runs_every_target_and_reports_counts(tmp_path):
    summary = run_fuzz(0.02, seed=3, out_dir=tmp_path, progress=False)
    assert summary["ok"], format_summary(summary)
    assert list(summary["targets"]) == list(TARGETS)
    for name, counts in summary["targets"].items():
        assert counts["inputs"] >= counts["seeds"] >= 1, name
        assert counts["accepted"] + counts["rejected"] == counts["inputs"], name
        assert counts["accepted"] >= 1 and sum(counts["reasons"].values()) == counts["rejected"], name
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    table = format_summary(summary)
    assert all(name in table for name in TARGETS) and "inputs in" in table


def test_the_runner_catches_a_broken_decoder_a_hang_a_crash_and_a_memory_hog(tmp_path):
    summary = run_fuzz(0, targets=[BROKEN, HANGING, CRASHING, HUNGRY], out_dir=tmp_path, progress=False)
    assert not summary["ok"]
    assert {f["target"]: f["kind"] for f in summary["failures"]} == {
        "toy_index": "unexpected_exception", "toy_hang": "hang", "toy_crash": "crash", "toy_hungry": "memory"}
    for failure in summary["failures"]:
        (saved,) = failure["files"]
        assert Path(saved).read_bytes() == b"\x00bad"  # the failing input, as a file
        assert failure["kind"] in Path(saved).with_suffix(".txt").read_text()
    assert summary["worker_restarts"] == 2  # after the hang and after the crash
    counts = summary["targets"]["toy_index"]
    assert counts["inputs"] == 2 and counts["accepted"] == 1 and counts["failures"] == {"unexpected_exception": 1}


def test_a_broken_decoder_fails_its_target_in_process():
    with pytest.raises(FuzzFailure, match="IndexError"):
        run_index_error(b"\x00", Path("."))
    assert run_index_error(b"ok", Path(".")).accepted
    for message in ("two\nlines", "x" * (MAX_MESSAGE_CHARS + 1), " "):
        with pytest.raises(FuzzFailure, match="bad_message"):
            check_message(ValueError(message))
    with pytest.raises(FuzzFailure, match="does not name"):
        check_message(ValueError("something broke"), "/the/file: ")


def test_cli_fuzz_exits_0_and_prints_the_counts(tmp_path, capsys):
    assert main(["fuzz", "--minutes", "0.02", "--target", "codec", "--target", "command", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:5] == ["target", "inputs", "accepted", "rejected", "failures"]
    assert [line.split()[0] for line in out.splitlines()[1:3]] == ["codec", "command"]
    assert "inputs in" in out and (tmp_path / "summary.json").is_file()


def test_cli_fuzz_exits_1_on_a_failure_and_2_on_an_unknown_target(tmp_path, capsys, monkeypatch):
    import vla_node.fuzz.runner as runner

    failing = {"ok": False, "seed": 0, "seconds": 0.0, "worker_restarts": 0, "targets": {},
               "failures": [{"target": "codec", "kind": "hang", "count": 1, "detail": "no answer", "files": []}]}
    monkeypatch.setattr(runner, "run_fuzz", lambda *a, **k: failing)
    assert main(["fuzz", "--minutes", "0", "--out", str(tmp_path)]) == 1
    assert "FAILURE codec hang" in capsys.readouterr().out
    assert main(["fuzz", "--minutes", "0", "--target", "codex"]) == 2
    assert "did you mean 'codec'" in capsys.readouterr().err


# ---------------------------------------------------------------- regressions: wire

DEEP = Raw(b"\x91" * 1010 + b"\xc0")  # a list nested 1010 deep (msgpack allows 1024): repr() raised RecursionError
WIDE = "x" * 5000  # a value whose repr made a 5000-character error message
FRAME = {"v": 1, "seq": 1, "stamp_ns": 5, "camera": "front", "encoding": "rgb8", "height": 1, "width": 1}
COMMANDS_LIMITED = (b"instruction", b"state")


def packed(msg: dict, key: str, value) -> bytes:
    return pack_with_raw({**msg, key: value}, random.Random(0))


@pytest.mark.parametrize("value", [DEEP, WIDE, [0.0] * 2000, Raw(b"\x81\xa1a" * 300 + b"\xc0")],
                         ids=["deep", "wide", "long", "deep_map"])
@pytest.mark.parametrize("decode, topic, msg, key, reason", [
    (decode_frame, b"frame/front", FRAME, "v", "bad_version"),
    (decode_frame, b"frame/front", FRAME, "seq", "bad_field"),
    (decode_frame, b"frame/front", FRAME, "camera", "bad_field"),
    (decode_frame, b"frame/front", FRAME, "encoding", "bad_encoding"),
    (decode_frame, b"frame/front", FRAME, "height", "bad_field"),
    (decode_command, b"instruction", COMMANDS[b"instruction"], "text", "bad_field"),
    (decode_command, b"instruction", COMMANDS[b"instruction"], "stamp_ns", "bad_field"),
    (decode_command, b"state", COMMANDS[b"state"], "v", "bad_version"),
    (decode_action, b"action", COMMANDS[b"action"], "status", "bad_field"),
    (decode_action, b"action", COMMANDS[b"action"], "level", "bad_field"),
    (decode_action, b"action", COMMANDS[b"action"], "timing_ms", "bad_field"),
    (decode_health, b"health", COMMANDS[b"health"], "stamp_ns", "bad_field"),
])
def test_a_deep_or_huge_field_value_is_a_bounded_protocol_error(decode, topic, msg, key, reason, value):
    """Found by the fuzzer: RecursionError from the error message's repr(), or messages of 2000-10000 characters."""
    header = packed(msg, key, value)
    if decode is decode_frame:
        parts, args = [topic, header, bytes(3)], ({"front": CameraSpec()},)
        too_large = len(header) > 4096  # ProtocolLimits.max_header_bytes
    else:
        parts, args = [topic, header], ()
        # max_text_chars; a command's arrays stop at max_state_values (1024)
        too_large = (key == "text" and value is WIDE) or (topic in COMMANDS_LIMITED and isinstance(value, list))
    if key == "level" and value is WIDE:  # a str level is a level's name: accepted
        assert decode(parts, *args)["level"] == WIDE
        return
    with pytest.raises(ProtocolError) as e:
        decode(parts, *args)
    assert e.value.reason == ("too_large" if too_large else reason)
    assert len(str(e.value)) <= 300 and "\n" not in str(e.value)


def test_an_ndarray_with_a_deep_dtype_or_shape_is_a_codec_error():
    """Found by the fuzzer: the dtype/shape repr in the error raised RecursionError."""
    for payload, reason in ((b"\x93" + b"\x91" * 1010 + b"\xc0\x90\xc4\x00", "bad_dtype"),
                            (b"\x93\xa3<f4" + b"\x91" * 1010 + b"\xc0\xc4\x00", "bad_ndarray")):
        data = msgpack.packb(msgpack.ExtType(1, payload))
        with pytest.raises(CodecError) as e:
            unpack(data)
        assert e.value.reason == reason and len(str(e.value)) <= 300


def test_a_non_contiguous_buffer_part_is_bad_parts():
    """Found by hand next to the fuzzer (parts are any bytes-like): BufferError/TypeError, not ProtocolError."""
    strided = memoryview(np.zeros((4, 8, 3), np.uint8)[:, ::2])
    header = msgpack.packb({**FRAME, "encoding": "jpeg", "height": 4, "width": 4})
    for part in (strided, memoryview(np.zeros(12, np.uint8))[::2]):
        with pytest.raises(ProtocolError, match="non-contiguous") as e:
            decode_frame([b"frame/front", header, part], {"front": CameraSpec()})
        assert e.value.reason == "bad_parts"
    two_d = memoryview(np.zeros((1, 3), np.uint8))  # contiguous but 2-D: read as its bytes
    rgb = decode_frame([b"frame/front", msgpack.packb(FRAME), two_d], {"front": CameraSpec()}).rgb
    assert rgb.shape == (1, 1, 3)


# ---------------------------------------------------------------- regressions: launch files and validation


@pytest.mark.parametrize("content, fragment", [
    (b"\xff\xfe[model]\n", "not UTF-8 text (byte 0"),
    (b"a = " + b"[" * 2000 + b"]" * 2000, "nested too deep"),
    (b"a = " + b"{b=" * 2000 + b"1" + b"}" * 2000, "nested too deep"),
    (b"[model]\ninstruction = " + b"[" * 500 + b"]" * 500, "nested too deep"),
    (b"[model]\nseed = " + b"1" * 5000, "invalid TOML: Exceeds the limit"),
    (b"[model]\nthreads = 18446744073709551616", "model.threads = 18446744073709551616: expected an integer of at most "
                                                 "64 bits"),
    (b"[health]\nperiod_s = " + b"9" * 400, "health.period_s = <integer of 1329 bits>: expected a finite number"),
    (b"# " + b"x" * (1 << 20), "expected at most 1048576"),
])
def test_launch_files_that_crashed_the_loader_are_config_errors(tmp_path, content, fragment):
    """Found by the fuzzer: UnicodeDecodeError, RecursionError and ValueError out of load_launch; a 65-bit integer
    accepted (model.threads: an OverflowError at start); an integer too large for a float (OverflowError)."""
    path = tmp_path / "launch.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_launch(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and fragment in message and len(message) <= MAX_MESSAGE_CHARS


def test_deep_nesting_is_refused_whatever_the_recursion_limit(tmp_path):
    """Found by CI: torch's inductor raises the interpreter's recursion limit (to 2000) when it compiles, after which
    tomllib parsed 500 nested arrays and the loader answered with a type error instead; the depth is checked itself."""
    path = tmp_path / "launch.toml"
    path.write_bytes(b"[model]\ninstruction = " + b"[" * 500 + b"]" * 500)
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(max(before, 5000))
    try:
        with pytest.raises(ConfigError, match="nested too deep"):
            load_launch(path)
    finally:
        sys.setrecursionlimit(before)


def test_validation_helpers_on_values_python_cannot_print_or_convert():
    assert not is_number(10**400)  # math.isfinite raised OverflowError
    assert show(10**5000) == "<integer of 16610 bits>"  # repr raises ValueError beyond 4300 digits
    assert len(show("x" * 10**6)) <= 200 and len(show([[[[[[1]]]]]] * 1000)) <= 200
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    assert show(nested).startswith("[[[[")


# ---------------------------------------------------------------- regressions: checkpoints


@pytest.fixture(scope="module")
def checkpoint_files():
    return tiny_checkpoint_files()


def write_checkpoint(root: Path, files: dict[str, bytes]) -> Path:
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    return root


def with_model(files: dict[str, bytes], **changes) -> dict[str, bytes]:
    meta = json.loads(files["vla.json"])
    meta["model"].update(changes)
    return {**files, "vla.json": json.dumps(meta).encode()}


@pytest.mark.parametrize("vla_json, fragment", [
    (b"1.5", "vla.json: a JSON float, expected an object"),  # AttributeError: 'float' object has no attribute 'get'
    (b"[]", "vla.json: a JSON list, expected an object"),
    (b"[" * 100_000, "vla.json: invalid JSON (nested too deep)"),  # RecursionError
    (b'{"format_version": 1, "model": {"name": "\x80"}}', "vla.json: not UTF-8 text (byte 41)"),  # UnicodeDecodeError
    (b'{"format_version": 1, "model": {"hidden_size": ' + b"1" * 5000 + b"}}", "vla.json: invalid JSON (Exceeds"),
    (b'{"format_version": 1, "model": {"name": {"a": 1}}}', "vla.json: model.name = {'a': 1}: expected a string"),
    (b'{"format_version": 1, "model": {"ax_text_tokens": 1}}', "vla.json: model.ax_text_tokens: unknown key"),
    (b'{"format_version": true, "model": {}}', "vla.json: format_version True, expected 1"),
])
def test_a_bad_vla_json_is_a_checkpoint_error_naming_it(tmp_path, checkpoint_files, vla_json, fragment):
    """Found by the fuzzer: AttributeError, RecursionError, UnicodeDecodeError, ValueError and ConfigError (without
    the file) out of load_checkpoint."""
    root = write_checkpoint(tmp_path, {**checkpoint_files, "vla.json": vla_json})
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(root)
    assert str(e.value).startswith(str(root)) and fragment in str(e.value)


def test_a_corrupt_safetensors_header_is_a_checkpoint_error(tmp_path, checkpoint_files):
    """Found by the fuzzer: safetensors' SafetensorError ("invalid offset for tensor") escaped."""
    heads = bytearray(checkpoint_files["heads.safetensors"])
    n = int.from_bytes(heads[:8], "little")
    header = json.loads(heads[8:8 + n])
    name = sorted(k for k in header if k != "__metadata__")[0]
    header[name]["data_offsets"] = [0, 2**40]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    files = {**checkpoint_files, "heads.safetensors": len(text).to_bytes(8, "little") + text + bytes(heads[8 + n:])}
    with pytest.raises(CheckpointError, match="heads.safetensors: not a readable safetensors file"):
        load_checkpoint(write_checkpoint(tmp_path, files))


def test_a_nan_tensor_is_a_checkpoint_error_naming_it(tmp_path, checkpoint_files):
    """Found by the fuzzer's value check: a checkpoint with NaN weights loaded as a valid model."""
    from safetensors.torch import load, save

    tensors = load(checkpoint_files["heads.safetensors"])
    tensors["state_proj.weight"][0, 0] = float("nan")
    files = {**checkpoint_files, "heads.safetensors": save(tensors, metadata={"format": "pt"})}
    with pytest.raises(CheckpointError, match="tensor 'state_proj.weight' holds 1 NaN or infinite values"):
        load_checkpoint(write_checkpoint(tmp_path, files))


@pytest.mark.parametrize("changes, fragment", [
    ({"hidden_size": 2**20}, "MiB of weights, more than"),
    ({"num_layers": 10**6}, "MiB of weights, more than"),
    ({"vision_frames": 10**6}, "MiB of position tables"),
    ({"hidden_size": 2**40, "num_heads": 2**10, "num_kv_heads": 2**10}, "cannot be built"),
])
def test_a_config_claiming_a_huge_model_fails_before_allocating(tmp_path, checkpoint_files, changes, fragment):
    """A vla.json claiming a huge model built it (terabytes, or a million layers) before any check."""
    root = write_checkpoint(tmp_path, with_model(checkpoint_files, **changes))
    with pytest.raises(CheckpointError, match=fragment):
        load_checkpoint(root)


# ---------------------------------------------------------------- regressions: drives


def read_all(path: Path) -> None:
    drive = open_drive(path)
    for frame in drive.frames():
        frame.rgb()
    list(drive.messages())


@pytest.mark.parametrize("data, fragment", [
    # statistics starting after the first message: frame and message stamps came out negative
    (patch_field(three_frames(), STATISTICS, STATS_START, "<Q", T0 + 1), "outside the span"),
    # statistics ending before they start: a negative duration
    (patch_field(three_frames(), STATISTICS, STATS_END, "<Q", T0 - 1), "ends before it starts"),
    # the first chunk's index claiming it starts after the others: frames came out of time order
    (patch_field(three_frames(chunk_size=64), CHUNK_INDEX, 0, "<Q", T0 + 250_000_000), "read after one at"),
    # a CompressedImage schema without `format`: AttributeError
    (ros2_compressed_without_format(), "not a sensor_msgs/msg/CompressedImage message (AttributeError"),
    # a foxglove.CompressedImage frame whose format is not jpeg: KeyError (it has no `step` to check)
    (foxglove_compressed("png"), "compressed image format 'png', expected 'jpeg'"),
    (foxglove_compressed("j=eg"), "compressed image format 'j=eg', expected 'jpeg'"),
    # an EOI marker before the SOF: the drive's JPEG scan accepted what the node's refuses
    (native_drive([(T0, frame_message(0, T0, "jpeg", b"\xff\xd8\xff\xd9\x00\x00" + jpeg(8, 8)[2:], (8, 8)))]),
     "not a JPEG (no start-of-frame segment"),
    # a ROS 2 image wider than any drive allows (native drives stop at 16384)
    (ros2_image("mono8", 1, 16385, bytes(16385)), "image size 16385x1, expected sides in 1..16384"),
    # a PNG claiming 60000x60000: refused before the decoder allocates it
    (ros2_image("", 0, 0, png(4, 4)[:16] + (60000).to_bytes(4, "big") * 2 + png(4, 4)[24:], "png"),
     "image size 60000x60000, expected sides in 1..16384"),
])
def test_drives_that_broke_the_readers_are_drive_errors(tmp_path, data, fragment):
    path = tmp_path / "drive.mcap"
    path.write_bytes(data)
    with pytest.raises(DriveError) as e:
        read_all(path)
    assert str(e.value).startswith(f"{path}: ") and fragment in str(e.value), str(e.value)
