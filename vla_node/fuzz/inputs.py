"""How structured fuzz inputs travel as bytes (the worker's pipe, the saved failure files).

A multipart wire message is a msgpack array of bin parts; a checkpoint directory is a msgpack map of relative
path -> file bytes (a path ending in '/' is an empty folder). Anything that does not decode as such is taken as
one part / one file, so every byte string is a valid input.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgpack

MAX_PARTS = 16
MAX_FILES = 32
MAX_DEPTH = 4
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def pack_parts(parts: list[bytes]) -> bytes:
    return msgpack.packb([bytes(p) for p in parts], use_bin_type=True)


def unpack_parts(data: bytes) -> list[bytes]:
    """The parts packed by pack_parts; any other bytes are a one-part message."""
    try:
        parts = msgpack.unpackb(data, raw=True, max_array_len=MAX_PARTS)
    except Exception:  # noqa: BLE001 - not our container: the bytes themselves are the message
        return [bytes(data)]
    if isinstance(parts, list) and all(isinstance(p, bytes) for p in parts):
        return parts
    return [bytes(data)]


def pack_tree(files: dict[str, bytes]) -> bytes:
    return msgpack.packb({k: bytes(v) for k, v in sorted(files.items())}, use_bin_type=True)


def unpack_tree(data: bytes) -> dict[str, bytes]:
    """The files packed by pack_tree; any other bytes are a directory holding one file 'vla.json' of them."""
    try:
        tree = msgpack.unpackb(data, raw=False, max_map_len=MAX_FILES)
    except Exception:  # noqa: BLE001 - not our container
        return {"vla.json": bytes(data)}
    if isinstance(tree, dict) and all(isinstance(k, str) and isinstance(v, bytes) for k, v in tree.items()):
        return tree
    return {"vla.json": bytes(data)}


def safe_relative(name: str) -> Path | None:
    """`name` as a relative path of plain components (no '..', no absolute path), or None."""
    parts = [p for p in name.split("/") if p]
    if not parts or len(parts) > MAX_DEPTH or not all(_NAME.fullmatch(p) and p not in (".", "..") for p in parts):
        return None
    return Path(*parts)


def write_tree(files: dict[str, bytes], root: Path) -> Path:
    """Create `root` holding `files` (unsafe names skipped; a name that is also a folder prefix loses)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, content in sorted(files.items(), key=lambda kv: kv[0].count("/")):
        rel = safe_relative(name)
        if rel is None:
            continue
        target = root / rel
        try:
            if name.endswith("/"):
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
        except OSError:  # e.g. a file where a folder of another entry should go
            continue
    return root
