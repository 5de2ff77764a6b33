"""The fuzz worker: a child process that runs inputs through targets, one at a time, for the runner.

Run as `python -m vla_node.fuzz.worker`. It talks over its stdin/stdout in frames of a 4-byte big-endian length
and a msgpack map (never pickle). Requests: {"op": "init", "refs": ["module:function", ...]} (imports them, answers
{"ready": true}), {"op": "run", "ref": ..., "data": bytes, "memory_mb": int} (answers {"verdict": "accepted" |
"rejected" | "failure", "reason", "kind", "detail", "signature", "seconds", "grew_mb"}). Its own file descriptor 1
goes to stderr so that nothing a decoder prints can corrupt the frames. A hang, a crash or the kernel's OOM killer
ends it; the runner notices, counts the input, and starts another.
"""

from __future__ import annotations

import importlib
import os
import resource
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, Callable

import msgpack

DATA_LIMIT_BYTES = 6 << 30  # RLIMIT_DATA: an input that asks for more gets a MemoryError, not the machine's memory
MAX_FRAME_BYTES = 64 << 20


def read_frame(stream: BinaryIO) -> dict | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {n} bytes: expected at most {MAX_FRAME_BYTES}")
    body = stream.read(n)
    if len(body) < n:
        return None
    return msgpack.unpackb(body, raw=False, max_bin_len=MAX_FRAME_BYTES)


def write_frame(stream: BinaryIO, message: dict) -> None:
    body = msgpack.packb(message, use_bin_type=True)
    stream.write(struct.pack(">I", len(body)) + body)
    stream.flush()


def resolve(ref: str) -> Callable:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _status_mb(field: str) -> float | None:
    """VmRSS / VmHWM of this process from /proc (per address space: not inherited across exec, unlike
    getrusage's ru_maxrss, which starts at the parent's peak), or None where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0), so each input's own peak is measured."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_mb() -> float:
    peak = _status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(run: Callable, data: bytes, memory_mb: int, scratch_root: Path) -> dict:
    from vla_node.fuzz.contract import FuzzFailure

    scratch = Path(tempfile.mkdtemp(dir=scratch_root))
    before = (_status_mb("VmRSS") if _reset_peak() else None) or _peak_mb()
    start = time.perf_counter()
    try:
        outcome = run(data, scratch)
        answer = {"verdict": "accepted" if outcome.accepted else "rejected", "reason": outcome.reason}
    except FuzzFailure as f:
        answer = {"verdict": "failure", "kind": f.kind, "detail": f.detail, "signature": f.signature}
    except Exception as e:  # noqa: BLE001 - the target itself broke (outside its decoder call): still a finding
        from vla_node.fuzz.contract import unexpected

        f = unexpected(e)
        answer = {"verdict": "failure", "kind": f.kind, "detail": f"in the target: {f.detail}",
                  "signature": f.signature}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    grew = _peak_mb() - before
    answer.update(seconds=time.perf_counter() - start, grew_mb=grew)
    if grew > memory_mb and answer["verdict"] != "failure":
        answer.update(verdict="failure", kind="memory", signature=f"memory:{answer.get('reason', '')}",
                      detail=f"peak memory grew by {grew:.0f} MB (limit {memory_mb} MB); "
                             f"outcome {answer.get('reason')}")
    return answer


def main() -> int:
    channel_in = os.fdopen(os.dup(0), "rb")
    channel_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints of decoders go to stderr
    sys.stdout = sys.stderr
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = DATA_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(DATA_LIMIT_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    runs: dict[str, Callable] = {}
    scratch_root = Path(tempfile.mkdtemp(prefix="vla-fuzz-worker-"))
    try:
        while True:
            request = read_frame(channel_in)
            if request is None:
                return 0
            if request["op"] == "init":
                for module in request.get("imports", ()):  # heavy imports now, not in the first input's deadline
                    importlib.import_module(module)
                for ref in request["refs"]:
                    runs[ref] = resolve(ref)
                write_frame(channel_out, {"ready": True, "pid": os.getpid()})
            else:
                answer = run_one(runs[request["ref"]], request["data"], request["memory_mb"], scratch_root)
                write_frame(channel_out, answer)
    finally:
        shutil.rmtree(scratch_root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
