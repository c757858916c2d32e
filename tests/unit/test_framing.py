"""Frames round-trip through the sans-IO decoder, however the bytes are split."""

from __future__ import annotations

import struct

import pytest

from protos import worker_pb2
from protos.framing import HEADER, MAGIC, VERSION, Frame, FrameDecoder, Kind, ProtocolError, encode


def _sample_frames() -> list[Frame]:
    batch = worker_pb2.PredictBatch(batch_id=7)
    request = batch.requests.add(request_id="r1")
    request.inputs["body"] = bytes(range(256))
    request.headers["content-type"] = "image/jpeg"
    return [Frame(Kind.HELLO, worker_pb2.Hello(pid=42).SerializeToString()),
            Frame(Kind.PREDICT, batch.SerializeToString()),
            Frame(Kind.SHUTDOWN)]


def test_split_at_every_byte_boundary() -> None:
    frames = _sample_frames()
    stream = b"".join(encode(frame) for frame in frames)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        decoded = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert decoded == frames, cut
        assert decoder.pending_bytes == 0


def test_byte_by_byte() -> None:
    frames = _sample_frames()
    decoder = FrameDecoder()
    decoded: list[Frame] = []
    for byte in b"".join(encode(frame) for frame in frames):
        decoded += decoder.feed(bytes([byte]))
    assert decoded == frames
    batch = worker_pb2.PredictBatch.FromString(decoded[1].payload)
    assert batch.requests[0].inputs["body"] == bytes(range(256))


def test_a_reused_read_buffer_leaves_the_frames_whole() -> None:
    """The worker reads into one buffer and feeds views of it: what the decoder returned, or
    holds of a frame not yet whole, is its own copy."""
    frames = _sample_frames()
    stream = b"".join(encode(frame) for frame in frames)
    received = bytearray(64)
    decoder = FrameDecoder()
    decoded: list[Frame] = []
    with memoryview(received) as view:
        for start in range(0, len(stream), len(received)):
            chunk = stream[start:start + len(received)]
            received[:len(chunk)] = chunk
            decoded += decoder.feed(view[:len(chunk)])
            received[:] = b"\xff" * len(received)  # the next read overwrites it
    assert decoded == frames and all(type(frame.payload) is bytes for frame in decoded)
    assert decoder.pending_bytes == 0


@pytest.mark.parametrize("header", [
    struct.pack("!2sBBI", b"XX", VERSION, Kind.HELLO, 0),
    struct.pack("!2sBBI", MAGIC, VERSION + 1, Kind.HELLO, 0),
    struct.pack("!2sBBI", MAGIC, VERSION, 99, 0),
    struct.pack("!2sBBI", MAGIC, VERSION, Kind.HELLO, 2**31),
])
def test_bad_headers_are_protocol_errors(header: bytes) -> None:
    assert len(header) == HEADER.size
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(header)
