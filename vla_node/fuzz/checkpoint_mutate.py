"""Checkpoint-directory mutations: files missing, extra, swapped or turned into folders; the JSON configs'
values changed; safetensors headers with mis-shaped, mis-typed, overlapping or out-of-file tensors, lying header
lengths, tensors dropped, renamed or added; tensor data set to NaN or infinity."""

from __future__ import annotations

import json
import random
import struct

from vla_node.fuzz.inputs import pack_tree, unpack_tree
from vla_node.fuzz.mutate import havoc
from vla_node.fuzz.values import mutate_json, pick

WEIGHT_FILES = ("decoder/model.safetensors", "vision/model.safetensors", "heads.safetensors",
                "expert/model.safetensors")
CONFIG_FILES = ("vla.json", "decoder/config.json", "vision/config.json")
MODEL_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vision_width",
              "vision_layers", "vision_frames", "image_size", "patch_size", "action_dims", "action_low", "rope_theta",
              "max_text_tokens", "state_dim", "num_cameras", "action_decode", "name", "format_version", "model",
              "action_head", "expert_hidden_size", "flow_steps", "flow_state")
DTYPES = ("F32", "F16", "BF16", "F64", "I64", "I32", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "X", "", 7)
NON_FINITE_F32 = (b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff")  # nan, inf, -inf
EXTRA_FILES = ("notes.txt", "decoder/extra.safetensors", "vision/tokenizer.json", "model.safetensors", ".hidden",
               "decoder/config.json.bak", "vla.json.orig")


def split_safetensors(data: bytes) -> tuple[dict, bytes] | None:
    if len(data) < 8:
        return None
    n = struct.unpack_from("<Q", data)[0]
    if n > len(data) - 8:
        return None
    try:
        header = json.loads(data[8:8 + n])
    except Exception:  # noqa: BLE001
        return None
    return (header, data[8 + n:]) if isinstance(header, dict) else None


def join_safetensors(header: dict, body: bytes) -> bytes:
    text = json.dumps(header, allow_nan=True).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def _tensors(header: dict) -> list[str]:
    return sorted(k for k, v in header.items() if k != "__metadata__" and isinstance(v, dict))


def mutate_safetensors(data: bytes, rng: random.Random) -> bytes:
    parsed = split_safetensors(data)
    if parsed is None:
        return havoc(data, rng)
    header, body = parsed
    names = _tensors(header)
    op = rng.randrange(11)
    name = pick(rng, tuple(names)) if names else None
    entry = header.get(name) if name else None
    if op <= 1 and entry is not None and isinstance(entry.get("shape"), list):  # mis-shaped
        shape = list(entry["shape"])
        change = rng.randrange(6)
        if change == 0 and shape:
            shape[rng.randrange(len(shape))] += pick(rng, (1, -1))
        elif change == 1:
            shape.append(1)
        elif change == 2 and shape:
            shape.pop()
        elif change == 3 and len(shape) > 1:
            shape.reverse()
        elif change == 4 and shape:
            shape[rng.randrange(len(shape))] = pick(rng, (0, -1, 2**40, 2**63, 1.5, "a", None))
        else:
            shape = pick(rng, ([], [0], "x", None, [[1]]))
        entry["shape"] = shape
    elif op == 2 and entry is not None:
        entry["dtype"] = pick(rng, DTYPES)
    elif op == 3 and entry is not None and isinstance(entry.get("data_offsets"), list):
        a, b = (entry["data_offsets"] + [0, 0])[:2]
        entry["data_offsets"] = pick(rng, ([b, a], [0, 2**62], [a, len(body) + 4], [a, a], [-1, b], [0, 0], "x",
                                           [a + 4, b + 4], [0, b - a]))
    elif op == 4 and name:
        del header[name]
    elif op == 5 and name:
        header[name + pick(rng, (".extra", "_", ""))] = dict(entry) if isinstance(entry, dict) else entry
        if rng.random() < 0.5:
            del header[name]
    elif op == 6:
        header["__metadata__"] = pick(rng, ({"format": "pt"}, {"format": 1}, [], "x", {"a": "b" * 1000}, None))
    elif op == 7 and entry is not None and isinstance(entry.get("data_offsets"), list):  # NaN or inf data
        a, b = entry["data_offsets"][:2]
        if isinstance(a, int) and isinstance(b, int) and 0 <= a < b <= len(body) and (b - a) % 4 == 0:
            buf = bytearray(body)
            value = pick(rng, NON_FINITE_F32)
            count = (b - a) // 4 if rng.random() < 0.3 else 1
            for k in range(count):
                i = a + 4 * (rng.randrange((b - a) // 4) if count == 1 else k)
                buf[i:i + 4] = value
            body = bytes(buf)
    elif op == 8:  # a lying header length
        buf = bytearray(join_safetensors(header, body))
        n = struct.unpack_from("<Q", buf)[0]
        struct.pack_into("<Q", buf, 0, pick(rng, (0, 1, n - 1, n + 1, len(buf), 2**63, 2**64 - 1, 100_000_001)) % 2**64)
        return bytes(buf)
    elif op == 9:  # data truncated or grown
        body = body[: rng.randrange(len(body) + 1)] if rng.random() < 0.7 else body + bytes(rng.randint(1, 64))
    else:
        return havoc(data, rng)
    return join_safetensors(header, body)


def mutate_checkpoint(data: bytes, rng: random.Random, others: list[bytes] = ()) -> bytes:
    """One change to a packed checkpoint directory (see inputs.pack_tree)."""
    files = unpack_tree(data)
    op = rng.random()
    present = sorted(files)
    if op < 0.3 and "vla.json" in files:
        files["vla.json"] = mutate_json(files["vla.json"], rng, MODEL_KEYS)
    elif op < 0.62:
        name = pick(rng, tuple(n for n in WEIGHT_FILES if n in files) or tuple(present) or ("vla.json",))
        files[name] = mutate_safetensors(files.get(name, b""), rng)
    elif op < 0.7:
        name = pick(rng, CONFIG_FILES)
        files[name] = mutate_json(files.get(name, b"{}"), rng, MODEL_KEYS)
    elif op < 0.78 and present:
        del files[pick(rng, tuple(present))]
    elif op < 0.84:
        files[pick(rng, EXTRA_FILES)] = pick(rng, (b"", b"{}", b"\x00" * 16, files.get(pick(rng, WEIGHT_FILES), b"")))
    elif op < 0.88 and present:  # a file where a folder is, or a folder where a file is
        name = pick(rng, tuple(present))
        del files[name]
        files[name + "/"] = b""
    elif op < 0.93:
        a, b = rng.sample(WEIGHT_FILES, 2)
        files[a], files[b] = files.get(b, b""), files.get(a, b"")
    elif present:
        name = pick(rng, tuple(present))
        files[name] = havoc(files[name], rng)
    return pack_tree(files)
