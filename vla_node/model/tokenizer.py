"""Byte-level instruction tokenizer and the vocabulary layout (bytes, specials, action bins)."""

from __future__ import annotations

BYTE_TOKENS = 256
BOS = 256
EOS = 257
PAD = 258
ACT = 259  # the action query placeholder
BIN_BASE = 260  # bin b of any action dim is token BIN_BASE + b
NUM_BIN_TOKENS = 256
VOCAB_SIZE = BIN_BASE + NUM_BIN_TOKENS  # 516


class TokenizerError(ValueError):
    pass


def encode(text: str, max_tokens: int) -> list[int]:
    """BOS followed by the UTF-8 bytes of `text`; raises when it does not fit in `max_tokens`."""
    data = text.encode("utf-8")
    if len(data) + 1 > max_tokens:
        raise TokenizerError(
            f"instruction of {len(data)} UTF-8 bytes does not fit: expected at most {max_tokens - 1} bytes"
        )
    return [BOS, *data]


def decode(ids: list[int]) -> str:
    """Inverse of encode: byte tokens back to text; BOS/EOS/PAD are skipped, other tokens rejected."""
    out = bytearray()
    for i in ids:
        if 0 <= i < BYTE_TOKENS:
            out.append(i)
        elif i in (BOS, EOS, PAD):
            continue
        else:
            raise TokenizerError(f"token {i} is not a text token: expected 0..255 or BOS/EOS/PAD")
    return out.decode("utf-8")
