"""A JPEG's markers read from its bytes, with no decoder: is the data all there, and is it a
JPEG the fast path takes as it is.

Both answers come from walking the markers (each segment by its length; a scan's
entropy-coded data up to the next marker), in plain Python but without Pillow, which reads a
header in pure Python too and builds an image object for it: ten times the work. The worker
reads the next batch's headers on a thread beside the one launching the current batch's
kernels, and every microsecond it holds the GIL there is one the launching thread waits
(backend/handlers/images.py). ``plain_jpeg_size`` only ever says yes to what Pillow's reading
(``images.is_plain_jpeg``) says yes to; anything it is not sure of goes to Pillow as before.
"""

from __future__ import annotations

import re
from typing import Literal

from PIL import Image

__all__ = ["jpeg_is_complete", "plain_jpeg_size"]

JPEG_START = b"\xff\xd8\xff"
#: In entropy-coded data 0xFF is followed by 0x00 (a stuffed byte) or a restart marker
#: (0xD0-0xD7); anything else after it is the next marker (or a fill byte before one).
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7]")
_EOI, _SOS, _DQT, _APP1, _APP2, _APP14 = 0xD9, 0xDA, 0xDB, 0xE1, 0xE2, 0xEE
#: Start-of-frame markers: every 0xC0-0xCF but DHT (C4), JPG (C8) and DAC (CC).
_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
#: The frames the fast path takes: baseline, extended sequential, progressive (Huffman).
_PLAIN_FRAMES = frozenset({0xC0, 0xC1, 0xC2})
_EXIF = b"Exif\x00\x00"
_ORIENTATION = 0x0112
_SHORT = 3


def jpeg_is_complete(data: bytes) -> bool:
    """Whether a JPEG's segments run to its end-of-image marker: the markers are walked by
    their lengths (an EXIF thumbnail, a whole JPEG of its own, is skipped inside its APP1
    segment) and each scan's entropy-coded data up to the next marker. Bytes after the end
    of the image are allowed, as every decoder allows them."""
    if data.endswith(b"\xff\xd9"):  # the usual case, at no cost: no scan's data holds FF D9
        return True
    position, size = 2, len(data)
    while position + 2 <= size:
        if data[position] != 0xFF:
            return False
        marker = data[position + 1]
        if marker == 0xFF:  # a fill byte before a marker
            position += 1
        elif marker == _EOI:
            return True
        elif 0xD0 <= marker <= 0xD7 or marker == 0x01:  # RSTn, TEM: no length
            position += 2
        elif position + 4 > size:
            return False
        else:
            position += 2 + int.from_bytes(data[position + 2:position + 4], "big")
            if marker == _SOS:
                found = _NEXT_MARKER.search(data, position)
                if found is None:
                    return False
                position = found.start()
    return False


def plain_jpeg_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` of a JPEG the fast path decodes as it is, read from its markers;
    None when it is not one or this reading is not sure (Pillow then reads the header).

    Yes only for: an 8-bit, three-component baseline, extended or progressive JPEG whose data
    runs to its end-of-image marker, within Pillow's ``MAX_IMAGE_PIXELS``, with well-formed
    quantisation tables, no EXIF orientation but 1 (one EXIF block, no XMP: Pillow reads an
    orientation from either), no Adobe segment (how its colour transform is read is Pillow's
    business) and no MPF segment (Pillow opens such a file as MPO)."""
    if not data.startswith(JPEG_START) or not jpeg_is_complete(data):
        return None
    position, size = 2, len(data)
    found: tuple[int, int] | None = None
    exif_seen = False
    while True:
        if position + 4 > size or data[position] != 0xFF:
            return None
        marker = data[position + 1]
        if marker == 0xFF:  # a fill byte before a marker
            position += 1
            continue
        end = position + 2 + int.from_bytes(data[position + 2:position + 4], "big")
        if end > size or end < position + 4:
            return None
        if marker == _SOS:
            break
        body = data[position + 4:end]
        if marker in _FRAMES:
            if marker not in _PLAIN_FRAMES or found is not None:
                return None
            found = _frame_size(body)
            if found is None:
                return None
        elif marker == _DQT:
            if not _tables_are_whole(body):
                return None
        elif marker == _APP1:
            if not body.startswith(_EXIF) or exif_seen:
                return None  # XMP, or EXIF twice: Pillow's reading decides
            exif_seen = True
            if _orientation(body[len(_EXIF):]) not in (None, 1):
                return None
        elif (marker == _APP2 and body.startswith(b"MPF\x00")) or (
                marker == _APP14 and body.startswith(b"Adobe")):
            return None
        elif not (0xE0 <= marker <= 0xEF or marker in (0xC4, 0xDD, 0xFE)):
            return None  # not an APPn, DHT, DRI or comment before the scan: unusual
        position = end
    if found is None:
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and found[0] * found[1] > limit:
        return None
    return found


def _frame_size(body: bytes) -> tuple[int, int] | None:
    """A start-of-frame segment's (width, height) if it is 8-bit with three components."""
    if len(body) < 6 + 3 * 3 or body[0] != 8 or body[5] != 3:
        return None
    height = int.from_bytes(body[1:3], "big")
    width = int.from_bytes(body[3:5], "big")
    return (width, height) if width and height else None


def _tables_are_whole(body: bytes) -> bool:
    """Whether a DQT segment holds whole tables (64 entries of 1 or 2 bytes each)."""
    position = 0
    while position < len(body):
        precision = body[position] >> 4
        if precision > 1 or body[position] & 15 > 3:
            return False
        position += 1 + 64 * (precision + 1)
    return position == len(body)


def _orientation(tiff: bytes) -> int | None:
    """The orientation tag of an EXIF block's first IFD (None: it has none; 0: the block
    cannot be read here)."""
    order: Literal["little", "big"]
    if tiff[:2] == b"II":
        order = "little"
    elif tiff[:2] == b"MM":
        order = "big"
    else:
        return 0

    def number(start: int, length: int) -> int:
        return int.from_bytes(tiff[start:start + length], order)

    if len(tiff) < 8 or number(2, 2) != 42:
        return 0
    ifd = number(4, 4)
    if ifd + 2 > len(tiff):
        return 0
    for entry in range(ifd + 2, ifd + 2 + 12 * number(ifd, 2), 12):
        if entry + 12 > len(tiff):
            return 0
        if number(entry, 2) == _ORIENTATION:
            if number(entry + 2, 2) != _SHORT or number(entry + 4, 4) != 1:
                return 0
            return number(entry + 8, 2)
    return None
