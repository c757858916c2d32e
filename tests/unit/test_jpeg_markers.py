"""backend.handlers.jpeg_markers: a JPEG's markers read without Pillow say yes only to what
Pillow's reading (``images.is_plain_jpeg``) says yes to, with the size Pillow reads."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from backend.errors import InvalidInput
from backend.handlers.images import is_plain_jpeg, open_header
from backend.handlers.jpeg_markers import jpeg_is_complete, plain_jpeg_size
from tests.unit.test_images import _encode, _picture, _with_exif_orientation, fallback_images

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "image_classifier" / \
    "resnet_152_batch"


def _segment(marker: int, body: bytes) -> bytes:
    return bytes((0xFF, marker)) + (len(body) + 2).to_bytes(2, "big") + body


def _after_soi(jpeg: bytes, segment: bytes) -> bytes:
    return jpeg[:2] + segment + jpeg[2:]


def _cases() -> dict[str, bytes]:
    picture = _picture((300, 200), seed=3)
    plain = _encode(picture, "JPEG", quality=90)
    cases = {f"test-{name}": (EXAMPLE / f"{name}.jpg").read_bytes()
             for name in ("kitten", "dog", "croco")}
    cases.update(fallback_images())
    cases.update({
        "baseline": plain,
        "progressive": _encode(picture, "JPEG", quality=90, progressive=True),
        "optimised-420": _encode(picture, "JPEG", quality=75, optimize=True, subsampling=2),
        "444": _encode(picture, "JPEG", quality=95, subsampling=0),
        "exif-orientation-1": _with_exif_orientation(plain, 1),
        "exif-orientation-3": _with_exif_orientation(plain, 3),
        "restart-markers": _encode(picture, "JPEG", quality=90, restart_marker_blocks=4),
        "comment": _after_soi(plain, _segment(0xFE, b"made here")),
        "xmp": _after_soi(plain, _segment(0xE1, b"http://ns.adobe.com/xap/1.0/\x00<x/>")),
        "adobe": _after_soi(plain, _segment(0xEE, b"Adobe\x00\x64\x00\x00\x00\x00\x01")),
        "truncated": plain[: len(plain) // 2],
        "trailing-bytes": plain + b"after the end",
        "not-a-jpeg": b"\xff\xd8\xff\xe0" + b"\x00" * 200,
        "soi-only": b"\xff\xd8",
    })
    return cases


CASES = _cases()


def _pillow_says(data: bytes) -> tuple[int, int] | None:
    try:
        header = open_header(data)
    except InvalidInput:
        return None
    with header:
        return header.size if is_plain_jpeg(data, header) else None


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_markers_say_yes_only_where_pillow_does_with_its_size(name: str) -> None:
    data = CASES[name]
    found = plain_jpeg_size(data)
    if found is not None:
        assert found == _pillow_says(data), name


def test_the_usual_jpegs_are_read_from_their_markers_alone() -> None:
    # Those the fast path exists for: no Pillow header read for them.
    for name in ("test-kitten", "test-dog", "test-croco", "baseline", "progressive",
                 "optimised-420", "444", "exif-orientation-1", "restart-markers", "comment",
                 "trailing-bytes"):
        assert plain_jpeg_size(CASES[name]) == Image.open(io.BytesIO(CASES[name])).size, name


@pytest.mark.parametrize("name", ["jpeg-cmyk", "jpeg-greyscale", "jpeg-exif-rotated",
                                  "exif-orientation-3", "xmp", "adobe", "truncated",
                                  "not-a-jpeg", "soi-only", "png", "gif"])
def test_what_the_markers_cannot_vouch_for_goes_to_pillow(name: str) -> None:
    assert plain_jpeg_size(CASES[name]) is None


def test_the_pixel_limit_is_pillows(monkeypatch: pytest.MonkeyPatch) -> None:
    data = CASES["test-kitten"]  # 720x720
    assert plain_jpeg_size(data) == (720, 720)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 720 * 720 - 1)
    assert plain_jpeg_size(data) is None  # Pillow's header then refuses it, saying why


def test_completeness_is_read_past_a_missing_end_marker() -> None:
    plain = CASES["baseline"]
    assert jpeg_is_complete(plain[:-2] + b"\xff\xd9")
    assert not jpeg_is_complete(plain[:-2])
    assert plain_jpeg_size(plain[:-2]) is None
