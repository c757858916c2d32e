"""The image pipeline: the tensor path against Pillow's, every fallback format, bad images in
a batch, and the pixel limit (on the CPU; the CUDA cases are marked ``gpu``)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from backend.errors import InvalidInput
from backend.handlers.images import (
    PIL,
    TENSOR,
    ImagePipeline,
    is_plain_jpeg,
    jpeg_is_complete,
    open_header,
)
from backend.handlers.vision import IMAGENET_TRANSFORM

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "image_classifier" / \
    "resnet_152_batch"
TEST_IMAGES = ("kitten", "dog", "croco")
#: The largest difference of a normalised input between the two paths: one uint8 step.
INPUT_TOLERANCE = 0.02


@pytest.fixture(autouse=True)
def _pixel_limit(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)
    yield


def _pipelines(device: str = "cpu") -> tuple[ImagePipeline, ImagePipeline]:
    return (ImagePipeline(torch.device(device), TENSOR),
            ImagePipeline(torch.device(device), PIL, pil_transform=IMAGENET_TRANSFORM))


def _encode(picture: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, fmt, **options)
    return buffer.getvalue()


def _picture(size: tuple[int, int] = (300, 200), seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    gradient = np.linspace(0, 255, size[0], dtype=np.float32)[None, :, None]
    noise = rng.integers(0, 40, size=(size[1], size[0], 3)).astype(np.float32)
    pixels = np.clip(gradient * np.array([1.0, 0.6, 0.3]) + noise, 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def _with_exif_orientation(data: bytes, orientation: int) -> bytes:
    picture = Image.open(io.BytesIO(data))
    exif = picture.getexif()
    exif[0x0112] = orientation
    return _encode(picture, "JPEG", exif=exif, quality=95)


def fallback_images() -> dict[str, bytes]:
    """One image of every kind the fast path hands to Pillow."""
    picture = _picture()
    sixteen = Image.fromarray(np.asarray(picture.convert("L"), dtype=np.uint16) * 257)
    return {
        "png": _encode(picture, "PNG"),
        "png-rgba": _encode(picture.convert("RGBA"), "PNG"),
        "png-palette": _encode(picture.convert("P"), "PNG"),
        "png-16-bit": _encode(sixteen, "PNG"),
        "gif": _encode(picture.convert("P"), "GIF"),
        "webp": _encode(picture, "WEBP", lossless=True),
        "bmp": _encode(picture, "BMP"),
        "jpeg-cmyk": _encode(picture.convert("CMYK"), "JPEG", quality=95),
        "jpeg-greyscale": _encode(picture.convert("L"), "JPEG", quality=95),
        "jpeg-exif-rotated": _with_exif_orientation(_encode(picture, "JPEG", quality=95), 6),
    }


def test_the_test_images_take_the_fast_path_and_agree_with_pillow() -> None:
    tensor, pil = _pipelines()
    images = [(EXAMPLE / f"{name}.jpg").read_bytes() for name in TEST_IMAGES]
    assert all(is_plain_jpeg(data, open_header(data)) for data in images)

    fast = tensor.load(images)
    exact = pil.load(images)

    assert all(t.dtype == torch.uint8 and t.shape == (3, 224, 224) for t in fast)
    difference = (tensor.batch(fast) - pil.batch(exact)).abs()
    assert difference.max().item() <= INPUT_TOLERANCE
    assert difference.mean().item() < 1e-3


@pytest.mark.parametrize("kind", sorted(fallback_images()))
def test_every_other_image_goes_to_pillow_and_agrees_with_the_pil_path(kind: str) -> None:
    data = fallback_images()[kind]
    tensor, pil = _pipelines()
    assert not is_plain_jpeg(data, open_header(data))

    (fast,) = tensor.load([data])
    (exact,) = pil.load([data])

    assert isinstance(fast, torch.Tensor) and fast.shape == (3, 224, 224)
    difference = (tensor.batch([fast]) - pil.batch([exact])).abs()
    assert difference.max().item() <= INPUT_TOLERANCE


def test_a_mixed_batch_keeps_its_order_and_only_bad_images_fail() -> None:
    tensor, pil = _pipelines()
    good = (EXAMPLE / "dog.jpg").read_bytes()
    truncated = good[: len(good) // 2]  # libjpeg-turbo refuses it; so does Pillow
    not_image = b"this is not an image at all"
    fake_jpeg = b"\xff\xd8\xff\xe0" + b"\x00" * 200
    batch: list[bytes | InvalidInput] = [
        good, truncated, fallback_images()["png"], not_image, fake_jpeg,
        InvalidInput("no image in the request"), (EXAMPLE / "croco.jpg").read_bytes()]

    loaded = tensor.load(batch)

    kinds = [type(item).__name__ for item in loaded]
    assert kinds == ["Tensor", "InvalidInput", "Tensor", "InvalidInput", "InvalidInput",
                     "InvalidInput", "Tensor"]
    assert "truncated" in str(loaded[1]) or "corrupt" in str(loaded[1])
    assert "not an image" in str(loaded[3])
    assert str(loaded[5]) == "no image in the request"
    # The good images are the same as alone.
    alone = [tensor.load([data])[0] for data in (batch[0], batch[2], batch[6])]
    for together, single in zip((loaded[0], loaded[2], loaded[6]), alone, strict=True):
        assert torch.equal(together, single)  # type: ignore[arg-type]
    assert [type(item).__name__ for item in pil.load(batch)] == kinds


def _with_thumbnail(jpeg: bytes, thumbnail: bytes) -> bytes:
    """``jpeg`` with an APP1 segment right after its SOI holding ``thumbnail`` whole (as an
    EXIF thumbnail is held): a complete JPEG, SOS and EOI markers included, inside it."""
    payload = b"Exif\x00\x00" + thumbnail
    return jpeg[:2] + b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload + jpeg[2:]


@pytest.mark.parametrize("progressive", [False, True])
def test_a_jpeg_is_complete_only_with_its_end_of_image_marker(progressive: bool) -> None:
    picture = Image.open(EXAMPLE / "dog.jpg")
    whole = _encode(picture, "JPEG", quality=90, progressive=progressive)
    thumbnail = _encode(picture.resize((32, 24)), "JPEG")
    assert jpeg_is_complete(whole)
    assert jpeg_is_complete(whole + b"trailing bytes after the image")
    assert jpeg_is_complete(_with_thumbnail(whole, thumbnail))
    # Cut anywhere after the header (mid-scan, between progressive scans, right before
    # EOI): incomplete, also when a whole thumbnail's EOI comes earlier in the data.
    for cut in (len(whole) // 3, len(whole) // 2, len(whole) - 2, len(whole) - 1):
        assert not jpeg_is_complete(whole[:cut])
        assert not jpeg_is_complete(_with_thumbnail(whole[:cut], thumbnail))
    assert not jpeg_is_complete(b"\xff\xd8\xff\xe0" + b"\x00" * 200)
    assert not jpeg_is_complete(b"\xff\xd8")


def test_a_truncated_jpeg_skips_the_fast_path_and_fails_alone() -> None:
    # nvJPEG decodes a truncated JPEG without an error (the missing rows black): the fast
    # path takes only a JPEG whose data is all there, Pillow refuses the rest.
    good = (EXAMPLE / "dog.jpg").read_bytes()
    header = open_header(good)
    assert is_plain_jpeg(good, header)
    for cut in (2000, len(good) // 2, len(good) - 2):
        assert not is_plain_jpeg(good[:cut], open_header(good[:cut]))
        tensor, pil = _pipelines()
        for pipeline in (tensor, pil):
            [failed] = pipeline.load([good[:cut]])
            assert isinstance(failed, InvalidInput), cut


def test_the_pixel_limit_is_checked_from_the_header_on_both_paths(
        monkeypatch: pytest.MonkeyPatch) -> None:
    data = (EXAMPLE / "kitten.jpg").read_bytes()  # 720x720
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100 * 100)
    for pipeline in _pipelines():
        (refused,) = pipeline.load([data])
        assert isinstance(refused, InvalidInput) and "too many pixels" in str(refused)


def test_threads_give_the_same_results() -> None:
    from concurrent.futures import ThreadPoolExecutor

    images = [(EXAMPLE / f"{name}.jpg").read_bytes() for name in TEST_IMAGES] * 2
    with ThreadPoolExecutor(3) as pool:
        threaded = ImagePipeline(torch.device("cpu"), TENSOR, pool).load(images)
    serial = ImagePipeline(torch.device("cpu"), TENSOR).load(images)
    assert all(torch.equal(a, b) for a, b in zip(threaded, serial, strict=True))  # type: ignore[arg-type]


def test_channels_last_batches() -> None:
    pipeline = ImagePipeline(torch.device("cpu"), TENSOR, channels_last=True)
    batch = pipeline.batch(pipeline.load([(EXAMPLE / "dog.jpg").read_bytes()] * 2))
    assert batch.shape == (2, 3, 224, 224) and batch.dtype == torch.float32
    assert batch.is_contiguous(memory_format=torch.channels_last)


def test_an_unknown_decode_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="image_decode"):
        ImagePipeline(torch.device("cpu"), "magic")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvjpeg_on_the_gpu_agrees_with_the_cpu_and_isolates_bad_images() -> None:
    gpu, _ = _pipelines("cuda")
    cpu, _ = _pipelines()
    images = [(EXAMPLE / f"{name}.jpg").read_bytes() for name in TEST_IMAGES]
    corrupt = images[1][: len(images[1]) // 2]
    loaded = gpu.load([images[0], corrupt, fallback_images()["png"], images[2]])
    assert isinstance(loaded[1], InvalidInput)
    assert all(t.device.type == "cuda" for i, t in enumerate(loaded) if i != 1)  # type: ignore[union-attr]
    on_gpu = gpu.batch([loaded[0], loaded[3]]).cpu()  # type: ignore[list-item]
    on_cpu = cpu.batch(cpu.load([images[0], images[2]]))  # type: ignore[arg-type]
    # nvJPEG and libjpeg-turbo are two decoders (IDCT rounding, chroma upsampling): pixels
    # mostly agree to a uint8 step or two, and a few at sharp edges differ by more (0.244
    # normalised, about 14 steps, the largest an H200 showed).
    difference = (on_gpu - on_cpu).abs()
    assert difference.mean().item() <= 1.5 * INPUT_TOLERANCE
    assert difference.max().item() <= 0.5
