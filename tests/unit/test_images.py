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


# -- the batched path: CUDA's way, run on the CPU with ``batched`` ----------------------------


def _batched(device: str = "cpu", **options: object) -> ImagePipeline:
    return ImagePipeline(torch.device(device), TENSOR, batched=True, **options)  # type: ignore[arg-type]


def _mixed_sizes() -> list[bytes]:
    """The test images (three sizes) twice, interleaved, and a PNG (Pillow's path)."""
    images = [(EXAMPLE / f"{name}.jpg").read_bytes() for name in TEST_IMAGES]
    return [images[0], images[1], fallback_images()["png"], images[2], images[0], images[1]]


def test_a_batch_is_made_where_it_is_decoded_and_agrees_with_the_image_by_image_path() -> None:
    images = _mixed_sizes()
    pipeline = _batched()
    rows = pipeline.load(images)

    assert all(isinstance(row, torch.Tensor) and row.dtype == torch.float32
               and row.shape == (3, 224, 224) for row in rows)
    batch = pipeline.batch(rows)  # type: ignore[arg-type]
    # The rows are the batch load made, in the batch's order: no copy, no stack.
    assert batch.data_ptr() == rows[0].data_ptr() and batch.shape == (6, 3, 224, 224)
    one_by_one, _ = _pipelines()
    expected = one_by_one.batch(one_by_one.load(images))  # type: ignore[arg-type]
    assert torch.allclose(batch, expected, atol=1e-5)


def test_rows_of_a_batched_load_taken_apart_are_stacked() -> None:
    pipeline = _batched(channels_last=True)
    rows = pipeline.load(_mixed_sizes())
    whole = pipeline.batch(rows)  # type: ignore[arg-type]
    assert whole.is_contiguous(memory_format=torch.channels_last)
    some = [rows[4], rows[1]]  # a request that failed later, reordered: not the whole batch
    part = pipeline.batch(some)  # type: ignore[arg-type]
    assert part.data_ptr() != whole.data_ptr()
    assert torch.equal(part, torch.stack([whole[4], whole[1]]))
    assert part.is_contiguous(memory_format=torch.channels_last)


def test_a_batched_load_fails_only_its_bad_images_and_keeps_the_order() -> None:
    good = (EXAMPLE / "dog.jpg").read_bytes()
    batch: list[bytes | InvalidInput] = [
        good, good[: len(good) // 2], b"not an image", InvalidInput("no image"),
        fallback_images()["jpeg-cmyk"], (EXAMPLE / "croco.jpg").read_bytes()]
    loaded = _batched().load(batch)
    assert [type(item).__name__ for item in loaded] == [
        "Tensor", "InvalidInput", "InvalidInput", "InvalidInput", "Tensor", "Tensor"]
    alone = _batched().load([batch[5]])[0]
    assert torch.allclose(loaded[5], alone, atol=1e-5)  # type: ignore[arg-type]
    assert [type(item).__name__ for item in _batched().load(batch[1:4])] == \
        ["InvalidInput"] * 3  # no good image: no batch, each its error


def test_the_decoding_thread_reads_no_pillow_header_for_a_plain_jpeg(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The thread preparing the next batch keeps its Python short: a plain JPEG's markers
    # are read without Pillow, which is only asked about the image they cannot vouch for.
    from backend.handlers import images as module

    opened: list[int] = []
    real = module.open_header
    monkeypatch.setattr(module, "open_header", lambda data: opened.append(len(data)) or
                        real(data))
    png = fallback_images()["png"]
    jpegs = [(EXAMPLE / f"{name}.jpg").read_bytes() for name in TEST_IMAGES]
    loaded = _batched().load([*jpegs, png])
    assert all(isinstance(item, torch.Tensor) for item in loaded)
    assert opened == [len(png)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_batch_is_prepared_on_its_own_stream_and_claimed_by_an_event() -> None:
    images = _mixed_sizes()
    gpu = ImagePipeline(torch.device("cuda"), TENSOR)
    current = torch.cuda.current_stream()
    rows = gpu.load(images)
    assert gpu._stream is not None and gpu._stream != current  # its own stream
    assert len(gpu._ready) == 1  # the batch's event, not waited for by the loading thread
    batch = gpu.batch(rows)  # type: ignore[arg-type]
    assert not gpu._ready  # claimed: the model's stream waits for the event
    assert batch.data_ptr() == rows[0].data_ptr() and batch.is_cuda  # type: ignore[union-attr]
    expected = _batched().batch(_batched().load(images))  # type: ignore[arg-type]
    difference = (batch.cpu() - expected).abs()  # two JPEG decoders: see the test above
    assert difference.mean().item() <= 1.5 * INPUT_TOLERANCE
    assert difference.max().item() <= 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_loading_the_next_batch_leaves_the_gil_to_the_launching_thread() -> None:
    # While one thread loads batches of 64 JPEGs, another runs Python: it keeps most of the
    # pace it has alone (nvJPEG's call and the device work release the GIL).
    import threading
    import time

    images = [(EXAMPLE / f"{name}.jpg").read_bytes() for name in TEST_IMAGES] * 22
    gpu = ImagePipeline(torch.device("cuda"), TENSOR)
    gpu.batch(gpu.load(images[:8]))  # type: ignore[arg-type]  # nvJPEG initialised
    torch.cuda.synchronize()

    def spin(seconds: float) -> int:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            count += 1
        return count

    alone = spin(0.5)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            gpu.batch(gpu.load(images))  # type: ignore[arg-type]
            torch.cuda.synchronize()

    loader = threading.Thread(target=load)
    loader.start()
    try:
        beside = spin(0.5)
    finally:
        stop.set()
        loader.join()
    assert beside >= 0.5 * alone
