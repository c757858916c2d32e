"""Frames between the frontend and a worker: an 8-byte versioned header plus a protobuf payload.

The decoder is sans-IO (bytes in, frames out) so both the asyncio frontend and the blocking
worker use the same code, and tests need no sockets.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

MAGIC = b"BS"
VERSION = 1
HEADER = struct.Struct("!2sBBI")  # magic, version, kind, payload length
MAX_PAYLOAD_BYTES = 1 << 30


class Kind(enum.IntEnum):
    HELLO = 1  # worker -> frontend, first frame
    LOAD = 2  # frontend -> worker: LoadModel
    LOADED = 3  # worker -> frontend: Loaded
    PREDICT = 4  # frontend -> worker: PredictBatch
    PREDICTED = 5  # worker -> frontend: PredictResult
    ERROR = 6  # worker -> frontend: Error
    SHUTDOWN = 7  # frontend -> worker: exit cleanly (empty payload)
    PARTIAL = 8  # worker -> frontend: one intermediate Response of a request still running
    FORK = 9  # frontend -> fork server: ForkRequest (with two descriptors)
    FORKED = 10  # fork server -> frontend: Forked
    EXITED = 11  # fork server -> frontend: ChildExited


class ProtocolError(Exception):
    """The peer sent bytes that are not a frame of this protocol version."""


@dataclass(frozen=True, slots=True)
class Frame:
    kind: Kind
    payload: bytes = b""


def encode(frame: Frame) -> bytes:
    size = len(frame.payload)
    if size > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"payload of {size} bytes exceeds {MAX_PAYLOAD_BYTES}")
    return HEADER.pack(MAGIC, VERSION, frame.kind, size) + frame.payload


def parse_header(header: bytes | memoryview) -> tuple[Kind, int]:
    """Validate one header; return the frame kind and payload length."""
    magic, version, kind, length = HEADER.unpack(header)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"bad header: magic={magic!r} version={version}")
    if length > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"frame of {length} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        return Kind(kind), length
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None


class FrameDecoder:
    """Feed it bytes as they arrive; it returns every complete frame."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """``data`` is copied in (a caller may reuse its buffer). Each payload is copied out
        once (a slice of a bytearray, then ``bytes`` of it, would copy it twice)."""
        buffer = self._buffer
        buffer += data
        frames: list[Frame] = []
        start = 0
        with memoryview(buffer) as view:
            while len(buffer) - start >= HEADER.size:
                kind, length = parse_header(view[start : start + HEADER.size])
                end = start + HEADER.size + length
                if len(buffer) < end:
                    break
                frames.append(Frame(kind, view[start + HEADER.size : end].tobytes()))
                start = end
        del buffer[:start]  # once the view is released: a viewed bytearray cannot shrink
        return frames

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)
