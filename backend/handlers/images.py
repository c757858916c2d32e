"""A batch's encoded images turned into the model's input, where the model runs.

``image_decode`` in the ``handler`` section of model-config.yaml picks the way:

* ``tensor`` (the default): JPEGs are decoded by ``torchvision.io.decode_jpeg`` on the model's
  device (nvJPEG on CUDA, all of a batch's JPEGs in one call; libjpeg-turbo on the CPU, one
  image per decode thread), then resized (short side 256, bilinear with antialiasing),
  centre-cropped (224) and normalised as tensor ops on that device (on CUDA a batch's images
  of one size together, on a stream of their own: ``ImagePipeline``). An image the fast path
  does not take (PNG, GIF, WebP and the other formats, CMYK or greyscale JPEGs, an EXIF
  orientation, 12-bit data, or anything ``decode_jpeg`` refuses) is decoded by Pillow,
  converted to RGB, and joins the same tensor ops: one image's format never costs the others
  their fast path. Which JPEGs take it is read from their markers (``jpeg_markers``); Pillow
  reads the header of an image they cannot vouch for.
* ``pil``: TorchServe's way, pixel for pixel: Pillow decodes, ``torchvision.transforms`` resize,
  crop and normalise each PIL image on the CPU, and the stacked batch is copied to the device.

The two agree to within rounding: torchvision's antialiased uint8 resize follows Pillow's
filter, so on the test images (kitten 720x720, dog 640x480, croco 360x240) the largest
difference of a normalised input is 0.018 (one uint8 step of one pixel), and ResNet-152's
top-5 labels and probabilities are the same to 1e-3 (``tests/unit/test_images.py``). On the
CPU the tensor path is faster too (benchmarks/RESULTS.md), so it is the default everywhere.

A request whose image cannot be read fails alone (``InvalidInput``): when nvJPEG refuses the
batch, its JPEGs are decoded one by one, and an image no decoder can read is that request's
error. A JPEG whose data stops before its end-of-image marker never takes the fast path:
nvJPEG decodes a truncated JPEG without a word (the missing rows come out black), so such an
image goes to Pillow, which refuses it, on every device alike. Pillow's ``MAX_IMAGE_PIXELS``
is enforced from the image's header on both paths, before any pixel is decoded.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torchvision.transforms.v2.functional as F
from PIL import Image, UnidentifiedImageError
from torchvision.io import ImageReadMode, decode_jpeg

from backend.errors import InvalidInput, describe
from backend.handlers.jpeg_markers import JPEG_START, jpeg_is_complete, plain_jpeg_size

logger = logging.getLogger(__name__)

# torchvision 0.29 deprecates its image decoders in favour of TorchCodec, a dependency we do
# not take: decode_jpeg still works, and warning on every batch would only fill the model log.
warnings.filterwarnings("ignore", category=DeprecationWarning,
                        message="The image decoding and encoding capabilities of TorchVision")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
RESIZE = 256
CROP = 224
TENSOR = "tensor"
PIL = "pil"
DECODE_MODES = (TENSOR, PIL)
#: Batches ``load`` made that ``batch`` has not claimed, remembered at most (the worker holds
#: two in flight).
MAX_UNCLAIMED = 8
_EXIF_ORIENTATION = 0x0112


def open_header(data: bytes) -> Image.Image:
    """The image's header, read by Pillow without decoding a pixel; InvalidInput when it is
    not an image or has more pixels than ``Image.MAX_IMAGE_PIXELS`` allows."""
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise InvalidInput(
            f"not an image: {len(data)} bytes in no format Pillow can read "
            f"(they start with {data[:12]!r})"
        ) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidInput(f"image has too many pixels: {exc}") from None
    except Exception as exc:  # a header too damaged to parse
        raise InvalidInput(f"corrupt image: {describe(exc)}") from None
    check_pixel_limit(image)
    return image


def check_pixel_limit(image: Image.Image) -> None:
    """Enforce ``Image.MAX_IMAGE_PIXELS`` (None: no limit) before decoding any pixel."""
    limit = Image.MAX_IMAGE_PIXELS
    pixels = image.width * image.height
    if limit is not None and pixels > limit:
        raise InvalidInput(
            f"image has too many pixels: {image.width}x{image.height} = {pixels}, more than "
            f"the limit of {limit}"
        )


def decode_rgb(data: bytes, header: Image.Image | None = None) -> Image.Image:
    """Decode an encoded image fully and convert it to RGB. Raises InvalidInput."""
    image = header if header is not None else open_header(data)
    try:
        with image:
            image.load()  # decode it all now, so that truncated data fails here
            return image.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # NOTE: Pillow only warns between MAX_IMAGE_PIXELS and twice that; where warnings are
        # errors (the test suite) the warning arrives here as an exception.
        raise InvalidInput(
            f"image has too many pixels, more than the limit of {Image.MAX_IMAGE_PIXELS}: {exc}"
        ) from None
    except Exception as exc:  # anything the decoder raises means the data is damaged
        raise InvalidInput(f"corrupt or truncated image: {describe(exc)}") from None


def is_plain_jpeg(data: bytes, header: Image.Image) -> bool:
    """A JPEG ``decode_jpeg`` gives the same pixels for as Pillow: 8-bit colour (YCbCr or
    RGB), no EXIF orientation to honour or ignore, and all of its data there."""
    if not data.startswith(JPEG_START) or header.format != "JPEG" or header.mode != "RGB":
        return False
    if not jpeg_is_complete(data):  # nvJPEG would decode what is there, and say nothing
        return False
    try:
        orientation = header.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # an EXIF block too damaged to read: let Pillow judge the image
        return False
    return bool(orientation == 1)


class ImagePipeline:
    """Prepares one batch of encoded images for an ImageNet-style model on ``device``.

    ``load`` gives each image as a ``[3, 224, 224]`` tensor, or the InvalidInput of an image
    that cannot be read; ``batch`` makes the good ones the model's input. What ``load`` gives:

    * on CUDA (and on the CPU with ``batched``): the rows of one normalised float batch on
      the device, made on a stream of the pipeline's own (see "On CUDA" below);
    * on the CPU: each image resized and cropped by its decode thread, uint8, normalised by
      ``batch`` once stacked;
    * ``pil``: each image as Pillow and ``pil_transform`` make it, normalised float on the CPU.

    On CUDA ``load`` runs on the worker's thread that prepares the next batch while the
    current one computes, and that thread must not keep the GIL from the thread launching the
    current batch's kernels. So its Python work is a few microseconds per image and the rest
    is per batch: the headers are read from the markers (``jpeg_markers``, Pillow only for
    what they cannot vouch for); the batch's JPEGs are copied into one page-locked buffer and
    decoded by nvJPEG in one call (torchvision's ``decode_jpegs_cuda``, which releases the GIL
    while it works); images of one size are resized and cropped together, and the batch is
    normalised once, all on the pipeline's stream. ``load`` returns once that work is queued;
    an event ends it, and ``batch`` has the model's stream wait for that event (no thread
    waits) and tells the allocator the model's stream uses the batch (``record_stream``).
    """

    def __init__(self, device: torch.device, mode: str = TENSOR,
                 pool: ThreadPoolExecutor | None = None, channels_last: bool = False,
                 pil_transform: Callable[[Image.Image], torch.Tensor] | None = None,
                 batched: bool = False) -> None:
        if mode not in DECODE_MODES:
            raise ValueError(f"image_decode must be one of {', '.join(DECODE_MODES)}, "
                             f"got {mode!r}")
        self.device = device
        self.mode = mode
        self._pool = pool
        self._channels_last = channels_last
        self._pil_transform = pil_transform
        self._cuda = device.type == "cuda"
        #: Resize, crop and normalise the batch together (per size of image) where it is
        #: decoded. On the CPU (unless asked) each decode thread resizes its own image
        #: instead, in parallel, and ``batch`` normalises.
        self._batched = mode == TENSOR and (self._cuda or batched)
        # Decoding and resizing run on a stream of their own, so a batch can be prepared
        # while the previous one computes.
        self._stream = (torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # unannotated
                        if self._cuda else None)
        #: Batches ``load`` made on that stream that ``batch`` has not claimed yet: by the
        #: batch's id, the batch (weakly) and the event its work ends with.
        self._ready: OrderedDict[int, tuple[weakref.ref[torch.Tensor], Any]] = OrderedDict()
        self._ready_lock = threading.Lock()
        scale = 255.0
        self._mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * scale
        self._std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * scale

    # -- one image at a time ----------------------------------------------------------------

    def _map(self, function: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        if self._pool is None or len(items) < 2:
            return [function(item) for item in items]
        return list(self._pool.map(function, items))

    def _side_stream(self) -> contextlib.AbstractContextManager[Any]:
        """Work queued inside runs on the pipeline's stream (the current stream is the
        thread's own: a decode thread's copies go there too)."""
        return (torch.cuda.stream(self._stream) if self._stream is not None
                else contextlib.nullcontext())

    def _resize_crop(self, image: torch.Tensor) -> torch.Tensor:
        """``[..., 3, H, W]`` uint8: the short side to 256, the middle 224x224."""
        image = F.resize(image, [RESIZE], antialias=True)
        cropped: torch.Tensor = F.center_crop(image, [CROP, CROP])  # torchvision: untyped
        return cropped

    def _pillow_pixels(self, data: bytes, header: Image.Image | None = None) -> torch.Tensor:
        """Pillow decodes the image to RGB (InvalidInput if it cannot): ``[3, H, W]`` uint8
        on the device."""
        pixels: torch.Tensor = F.pil_to_tensor(decode_rgb(data, header))
        if self._cuda:  # from pinned memory the copy runs asynchronously on the stream
            with self._side_stream():
                pixels = pixels.pin_memory().to(self.device, non_blocking=True)
        return pixels

    def _pillow(self, data: bytes, header: Image.Image | None = None) -> torch.Tensor:
        """The slow path of one image, one image at a time."""
        if self.mode == PIL:
            assert self._pil_transform is not None
            return self._pil_transform(decode_rgb(data, header))
        return self._resize_crop(self._pillow_pixels(data, header))

    def _cpu_pixels(self, data: bytes) -> torch.Tensor:
        try:
            decoded: torch.Tensor = decode_jpeg(_as_tensor(data), mode=ImageReadMode.RGB)
        except RuntimeError:  # libjpeg-turbo refused it: Pillow says why, or decodes it
            return self._pillow_pixels(data)
        return decoded

    def _cpu_jpeg(self, data: bytes) -> torch.Tensor:
        return self._resize_crop(self._cpu_pixels(data))

    # -- a batch ------------------------------------------------------------------------------

    def load(self, images: Sequence[bytes | InvalidInput]) -> list[torch.Tensor | InvalidInput]:
        """Each image as a prepared tensor, or the InvalidInput that says what is wrong."""
        results: list[torch.Tensor | InvalidInput | None] = [None] * len(images)
        fast: list[int] = []
        slow: list[tuple[int, bytes, Image.Image]] = []
        for index, data in enumerate(images):
            if isinstance(data, InvalidInput):
                results[index] = data
                continue
            if self.mode == TENSOR and plain_jpeg_size(data) is not None:
                fast.append(index)  # its markers vouch for it: no Pillow header needed
                continue
            try:
                header = open_header(data)
            except InvalidInput as exc:
                results[index] = exc
                continue
            if self.mode == TENSOR and is_plain_jpeg(data, header):
                header.close()
                fast.append(index)
            else:
                slow.append((index, data, header))
        jpegs: list[bytes] = [images[index] for index in fast]  # type: ignore[misc]
        if self._batched:
            self._load_batched(jpegs, fast, slow, results)
        else:
            decoded = self._map(_guard(self._cpu_jpeg), jpegs)
            done = self._map(_guard(lambda item: self._pillow(item[1], item[2])), slow)
            for index, tensor in zip([*fast, *(i for i, _, _ in slow)], [*decoded, *done],
                                     strict=True):
                results[index] = tensor
        assert all(result is not None for result in results), "an image got no result"
        return results  # type: ignore[return-value]

    def _load_batched(self, jpegs: list[bytes], fast: list[int],
                      slow: list[tuple[int, bytes, Image.Image]],
                      results: list[torch.Tensor | InvalidInput | None]) -> None:
        """Decode every image, then resize, crop and normalise them together as the rows of
        one batch (the model's input once ``batch`` claims it)."""
        with self._side_stream():
            decoded = self._decode_jpegs(jpegs) if jpegs else []
            decoded += self._map(_guard(lambda item: self._pillow_pixels(item[1], item[2])),
                                 slow)
            good: list[tuple[int, torch.Tensor]] = []
            for index, item in zip([*fast, *(i for i, _, _ in slow)], decoded, strict=True):
                if isinstance(item, InvalidInput):
                    results[index] = item
                else:
                    good.append((index, item))
            if not good:
                return
            good.sort(key=lambda pair: pair[0])
            inputs = self._finish([pixels for _, pixels in good])
            for row, (index, _) in enumerate(good):
                results[index] = inputs[row]
        if self._stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated
            event.record(self._stream)
            with self._ready_lock:
                self._ready[id(inputs)] = (weakref.ref(inputs), event)
                while len(self._ready) > MAX_UNCLAIMED:
                    self._ready.popitem(last=False)

    def _decode_jpegs(self, jpegs: list[bytes]) -> list[torch.Tensor | InvalidInput]:
        """Each JPEG decoded, ``[3, H, W]`` uint8 on the device. On CUDA nvJPEG decodes the
        batch in one call; when it refuses, one by one; what it cannot decode goes to Pillow.
        """
        if not self._cuda:
            return self._map(_guard(self._cpu_pixels), jpegs)
        tensors = _pinned_views(jpegs)
        try:
            decoded: list[torch.Tensor | None] = list(
                decode_jpeg(tensors, mode=ImageReadMode.RGB, device=self.device))
        except RuntimeError as exc:
            logger.info("nvJPEG refused a batch of %d JPEGs (%s); decoding them one by one",
                        len(jpegs), describe(exc))
            decoded = []
            for tensor in tensors:
                try:
                    decoded.append(decode_jpeg(tensor, mode=ImageReadMode.RGB,
                                               device=self.device))
                except RuntimeError:
                    decoded.append(None)
        results: list[torch.Tensor | InvalidInput] = []
        for data, pixels in zip(jpegs, decoded, strict=True):
            try:
                results.append(self._pillow_pixels(data) if pixels is None else pixels)
            except InvalidInput as exc:
                results.append(exc)
        return results

    def _finish(self, pixels: list[torch.Tensor]) -> torch.Tensor:
        """Decoded ``[3, H, W]`` uint8 images as the model's input: resized and cropped one
        stack per size (a kernel per op and size, not per op and image), back in their order,
        normalised once; ``[N, 3, 224, 224]`` float (channels-last when asked)."""
        sizes: dict[tuple[int, ...], list[int]] = {}
        for position, image in enumerate(pixels):
            sizes.setdefault(tuple(image.shape), []).append(position)
        parts: list[torch.Tensor] = []
        order: list[int] = []
        for positions in sizes.values():
            same = [pixels[position] for position in positions]
            parts.append(self._resize_crop(torch.stack(same) if len(same) > 1
                                           else same[0].unsqueeze(0)))
            order += positions
        cropped = parts[0] if len(parts) == 1 else torch.cat(parts)
        if len(parts) > 1:  # rows grouped by size: put them back in the batch's order
            rows = [0] * len(order)
            for row, position in enumerate(order):
                rows[position] = row
            where = torch.tensor(rows)
            if self._cuda:
                where = where.pin_memory().to(self.device, non_blocking=True)
            cropped = cropped.index_select(0, where)
        return self._normalise(cropped)

    def _normalise(self, stacked: torch.Tensor) -> torch.Tensor:
        normalised = stacked.float().sub_(self._mean).div_(self._std)
        if self._channels_last:
            normalised = normalised.contiguous(memory_format=torch.channels_last)
        return normalised

    def batch(self, images: list[torch.Tensor]) -> torch.Tensor:
        """The loaded images as the model's input: ``[N, 3, 224, 224]`` float on the device
        (channels-last when asked). The rows of one batch ``load`` made, all of them in
        order, are that batch, as it is."""
        whole = self._claim(images)
        if whole is not None:
            return whole
        stacked = torch.stack(images)
        if stacked.dtype == torch.uint8:
            return self._normalise(stacked)
        if self._cuda and stacked.device.type == "cpu":  # Pillow's path
            stacked = stacked.pin_memory().to(self.device, non_blocking=True)
        if self._channels_last:
            stacked = stacked.contiguous(memory_format=torch.channels_last)
        return stacked

    def _claim(self, images: list[torch.Tensor]) -> torch.Tensor | None:
        """The batch ``load`` made whose rows ``images`` are, all of them in order (None if
        they are not); on CUDA the current stream is made to wait for the batches the images
        come from, and marked as using them."""
        if not images:
            return None
        bases = {id(base): base for base in (image._base for image in images)
                 if base is not None}
        if self._stream is not None:
            current = torch.cuda.current_stream(self.device)
            for key, base in bases.items():
                if not base.is_cuda:
                    continue
                with self._ready_lock:
                    entry = self._ready.pop(key, None)
                if entry is not None and entry[0]() is base:
                    current.wait_event(entry[1])
                else:  # claimed before, or forgotten: wait for all the stream has queued
                    current.wait_stream(self._stream)
                base.record_stream(current)
        if len(bases) != 1:
            return None
        (base,) = bases.values()
        if base.dim() != 4 or base.shape[0] != len(images):
            return None
        start, step = base.storage_offset(), base.stride(0)
        for row, image in enumerate(images):
            if image.storage_offset() != start + row * step or image.shape != base.shape[1:]:
                return None
        return base


def _pinned_views(jpegs: list[bytes]) -> list[torch.Tensor]:
    """The JPEGs' bytes copied into one page-locked buffer, a view of it each: nvJPEG copies
    them to the GPU from there at full speed, and one allocation serves the batch."""
    buffer = torch.empty(sum(map(len, jpegs)), dtype=torch.uint8, pin_memory=True)
    address = buffer.data_ptr()
    views = []
    offset = 0
    for data in jpegs:
        ctypes.memmove(address + offset, data, len(data))
        views.append(buffer[offset:offset + len(data)])
        offset += len(data)
    return views


def _as_tensor(data: bytes) -> torch.Tensor:
    # bytearray: torch.frombuffer wants a writable buffer (a bytes object draws a warning).
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _guard(function: Callable[[Any], torch.Tensor]
           ) -> Callable[[Any], torch.Tensor | InvalidInput]:
    """``function``, with an unreadable image as its result instead of its exception."""

    def guarded(item: Any) -> torch.Tensor | InvalidInput:
        try:
            return function(item)
        except InvalidInput as exc:
            return exc

    return guarded
