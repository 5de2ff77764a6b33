"""The contract every fuzz target checks, and how a violation is reported.

A decoder of outside input either returns a valid object or raises its documented error type, whose message is
one line of bounded length (naming the file, for file decoders); it never raises anything else (IndexError,
KeyError, struct.error, OverflowError, MemoryError, RecursionError, ...). `check_call` runs one decoder call and
returns an `Outcome` (accepted, or rejected with a short reason for the counts) or raises a `FuzzFailure`.
Hangs, crashes of the process and huge allocations are caught one level up, by the runner and its worker.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from typing import Any, Callable

FAILURE_KINDS = (
    "unexpected_exception",  # the decoder raised something other than its documented error
    "bad_message",  # the documented error, but its message is empty, multi-line, too long or names no file
    "invalid_value",  # the decoder accepted the input and returned something that breaks its own promises
    "hang",  # no answer within the target's deadline
    "crash",  # the worker process died (a segfault, an abort, the kernel's OOM killer)
    "memory",  # the input made the worker's peak memory grow past the target's limit
)
MAX_MESSAGE_CHARS = 2000  # an error message is one log line: the node counts and logs every dropped message
MAX_REASON_CHARS = 48


class FuzzFailure(Exception):
    """A violation of the contract. `signature` groups failures with one cause (kind, exception, where)."""

    def __init__(self, kind: str, detail: str, signature: str = "") -> None:
        assert kind in FAILURE_KINDS, kind
        self.kind = kind
        self.detail = detail
        self.signature = signature or f"{kind}:{detail[:80]}"
        super().__init__(f"{kind}: {detail}")


@dataclass(frozen=True)
class Outcome:
    """What one input did: accepted, or rejected with `reason` (the error type and its short reason)."""

    accepted: bool
    reason: str  # "accepted" or e.g. "ProtocolError:bad_jpeg", "DriveError:truncated MCAP"


ACCEPTED = Outcome(True, "accepted")


def short_reason(message: str, prefix: str = "", segments: int = 1) -> str:
    """A reason class for the counts from an error message: what follows `prefix` (e.g. the file's path), its
    first `segments` parts split at ': ', ' = ' or '(', quoted names folded to '*' and digits to N, at most
    MAX_REASON_CHARS characters."""
    text = message[len(prefix):] if prefix and message.startswith(prefix) else message
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'*'", text.lstrip(": /"))
    text = re.sub(r"\[[^\[\]]*\]", "[*]", text)
    parts = [p.strip() for p in re.split(r": | = |\(", text)]
    if len(parts) > segments and parts[segments].startswith("unknown key"):  # one class, whatever the key
        parts[segments - 1] = "unknown key"
    head = re.sub(r"\d+", "N", ": ".join(parts[:segments]))
    return head[:MAX_REASON_CHARS] or "-"


def where(exc: BaseException) -> str:
    """file:line of the innermost frame of the traceback in our package (else the innermost at all)."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "vla_node" in f.filename and "/fuzz/" not in f.filename]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return "?"
    return f"{frame.filename.rsplit('vla_node/', 1)[-1]}:{frame.lineno}"


def unexpected(exc: BaseException) -> FuzzFailure:
    text = str(exc)
    text = text if len(text) <= 300 else text[:297] + "..."
    site = where(exc)
    return FuzzFailure("unexpected_exception", f"{type(exc).__name__} at {site}: {text}",
                       f"unexpected_exception:{type(exc).__name__}:{site}")


def check_message(exc: BaseException, must_start: str = "") -> None:
    """The documented error's message: non-empty, one line, bounded, starting with `must_start` when given."""
    message = str(exc)
    kind = type(exc).__name__
    if not message.strip():
        raise FuzzFailure("bad_message", f"{kind} with an empty message", f"bad_message:{kind}:empty")
    if "\n" in message or "\r" in message:
        raise FuzzFailure("bad_message", f"{kind} message spans lines: {message[:200]!r}",
                          f"bad_message:{kind}:lines:{short_reason(message, must_start)}")
    if len(message) > MAX_MESSAGE_CHARS:
        raise FuzzFailure("bad_message", f"{kind} message of {len(message)} characters: {message[:200]!r}...",
                          f"bad_message:{kind}:long:{short_reason(message, must_start)}")
    if must_start and not message.startswith(must_start):
        raise FuzzFailure("bad_message", f"{kind} message does not name {must_start!r}: {message[:200]!r}",
                          f"bad_message:{kind}:unnamed:{short_reason(message)}")


def invalid(what: str, signature: str = "") -> FuzzFailure:
    return FuzzFailure("invalid_value", what, f"invalid_value:{signature or what[:60]}")


def check_call(
    call: Callable[[], Any],
    documented: tuple[type[BaseException], ...],
    reason: Callable[[BaseException], str],
    validate: Callable[[Any], None],
    must_start: str | Callable[[BaseException], str] = "",
) -> Outcome:
    """Run one decoder call against the contract: the documented error -> rejected (message checked, starting with
    `must_start` or what it returns for the error), any other exception -> FuzzFailure, a returned value ->
    validated, then accepted."""
    try:
        value = call()
    except documented as e:
        check_message(e, must_start(e) if callable(must_start) else must_start)
        return Outcome(False, f"{type(e).__name__}:{reason(e)}")
    except FuzzFailure:
        raise
    except Exception as e:  # noqa: BLE001 - anything else is what the fuzzer looks for
        raise unexpected(e) from e
    validate(value)
    return ACCEPTED
