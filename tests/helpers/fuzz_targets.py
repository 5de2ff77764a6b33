"""Deliberately broken fuzz targets, to show that the runner catches each kind of failure: a decoder that raises
IndexError, one that hangs, one that kills its process, one that allocates far too much. Each misbehaves on its
second seed (the first is fine), so a seeds-only run (minutes=0) finds every one."""

from __future__ import annotations

import os
import time
from pathlib import Path

from vla_node.fuzz.contract import Outcome, check_call
from vla_node.fuzz.mutate import havoc
from vla_node.fuzz.targets import Target

SEEDS = [("fine", b"ok"), ("bad", b"\x00bad")]


class ToyError(ValueError):
    pass


def _toy_decode(data: bytes) -> int:
    if not data:
        raise ToyError("empty input: expected at least one byte")
    if data[0] == 0:
        return data[len(data) + 5]  # the bug: IndexError instead of ToyError
    return len(data)


def run_index_error(data: bytes, scratch: Path) -> Outcome:
    return check_call(lambda: _toy_decode(data), (ToyError,), lambda e: "toy", lambda _: None)


def run_hang(data: bytes, scratch: Path) -> Outcome:
    if data[:1] == b"\x00":
        time.sleep(60)
    return Outcome(True, "accepted")


def run_crash(data: bytes, scratch: Path) -> Outcome:
    if data[:1] == b"\x00":
        os._exit(7)
    return Outcome(True, "accepted")


def run_hungry(data: bytes, scratch: Path) -> Outcome:
    if data[:1] == b"\x00":
        block = b"\x01" * (200 << 20)  # 200 MB, every page touched
        del block
    return Outcome(True, "accepted")


def _seeds():
    return list(SEEDS)


BROKEN = Target("toy_index", run_index_error, _seeds, havoc, deadline_s=5.0)
HANGING = Target("toy_hang", run_hang, _seeds, havoc, deadline_s=1.0)
CRASHING = Target("toy_crash", run_crash, _seeds, havoc, deadline_s=5.0)
HUNGRY = Target("toy_hungry", run_hungry, _seeds, havoc, deadline_s=5.0, memory_mb=64)
