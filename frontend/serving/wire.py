"""Frames over asyncio streams: the frontend's side of protos/framing.py."""

from __future__ import annotations

import asyncio

from protos.framing import HEADER, Frame, encode, parse_header


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    """Read one whole frame; raises asyncio.IncompleteReadError at EOF."""
    kind, length = parse_header(await reader.readexactly(HEADER.size))
    payload = await reader.readexactly(length) if length else b""
    return Frame(kind, payload)


def write_frame(writer: asyncio.StreamWriter, frame: Frame) -> None:
    """Queue one frame on the transport (the caller drains when it must)."""
    writer.write(encode(frame))
