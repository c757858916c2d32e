"""A batch's encoded images turned into the model's input, where the model runs.

``image_decode`` in the ``handler`` section of model-config.yaml picks the way:

* ``tensor`` (the default): JPEGs are decoded by ``torchvision.io.decode_jpeg`` on the model's
  device (nvJPEG on CUDA, all of a batch's JPEGs in one call; libjpeg-turbo on the CPU, one
  image per decode thread), then resized (short side 256, bilinear with antialiasing),
  centre-cropped (224) and normalised as tensor ops on that device; the batch is normalised
  once, after stacking. An image the fast path does not take (PNG, GIF, WebP and the other
  formats, CMYK or greyscale JPEGs, an EXIF orientation, 12-bit data, or anything
  ``decode_jpeg`` refuses) is decoded by Pillow, converted to RGB, and joins the same tensor
  ops: one image's format never costs the others their fast path.
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
import io
import logging
import re
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torchvision.transforms.v2.functional as F
from PIL import Image, UnidentifiedImageError
from torchvision.io import ImageReadMode, decode_jpeg

from backend.errors import InvalidInput, describe

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
_EXIF_ORIENTATION = 0x0112
_JPEG_START = b"\xff\xd8\xff"
#: In entropy-coded data 0xFF is followed by 0x00 (a stuffed byte) or a restart marker
#: (0xD0-0xD7); anything else after it is the next marker (or a fill byte before one).
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7]")
_EOI, _SOS = 0xD9, 0xDA


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


def is_plain_jpeg(data: bytes, header: Image.Image) -> bool:
    """A JPEG ``decode_jpeg`` gives the same pixels for as Pillow: 8-bit colour (YCbCr or
    RGB), no EXIF orientation to honour or ignore, and all of its data there."""
    if not data.startswith(_JPEG_START) or header.format != "JPEG" or header.mode != "RGB":
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

    ``load`` gives each image as a ``[3, 224, 224]`` tensor (uint8 on the model's device for
    ``tensor``; normalised float on the CPU for ``pil``), or the InvalidInput of an image that
    cannot be read; ``batch`` stacks the good ones into the model's input.
    """

    def __init__(self, device: torch.device, mode: str = TENSOR,
                 pool: ThreadPoolExecutor | None = None, channels_last: bool = False,
                 pil_transform: Callable[[Image.Image], torch.Tensor] | None = None) -> None:
        if mode not in DECODE_MODES:
            raise ValueError(f"image_decode must be one of {', '.join(DECODE_MODES)}, "
                             f"got {mode!r}")
        self.device = device
        self.mode = mode
        self._pool = pool
        self._channels_last = channels_last
        self._pil_transform = pil_transform
        self._cuda = device.type == "cuda"
        # Decoding and resizing run on a stream of their own, so a batch can be prepared
        # while the previous one computes (``load`` returns once its work is done).
        self._stream = (torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # unannotated
                        if self._cuda else None)
        scale = 255.0
        self._mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * scale
        self._std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * scale

    # -- one image at a time ----------------------------------------------------------------

    def _map(self, function: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        if self._pool is None or len(items) < 2:
            return [function(item) for item in items]
        return list(self._pool.map(function, items))

    def _resize_crop(self, image: torch.Tensor) -> torch.Tensor:
        image = F.resize(image, [RESIZE], antialias=True)
        cropped: torch.Tensor = F.center_crop(image, [CROP, CROP])  # torchvision: untyped
        return cropped

    def _pillow(self, data: bytes, header: Image.Image | None = None) -> torch.Tensor:
        """The slow path of one image: Pillow decodes it to RGB (InvalidInput if it cannot)."""
        rgb = decode_rgb(data, header)
        if self.mode == PIL:
            assert self._pil_transform is not None
            return self._pil_transform(rgb)
        pixels = F.pil_to_tensor(rgb)
        if self._cuda:  # from pinned memory the copy runs asynchronously on the stream
            pixels = pixels.pin_memory().to(self.device, non_blocking=True)
        return self._resize_crop(pixels)

    def _cpu_jpeg(self, data: bytes) -> torch.Tensor:
        try:
            pixels = decode_jpeg(_as_tensor(data), mode=ImageReadMode.RGB)
        except RuntimeError:  # libjpeg-turbo refused it: Pillow says why, or decodes it
            return self._pillow(data)
        return self._resize_crop(pixels)

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
        stream = torch.cuda.stream(self._stream) if self._stream is not None \
            else contextlib.nullcontext()
        with stream:
            if fast:
                jpegs = [images[index] for index in fast]
                decoded = (self._cuda_jpegs(jpegs) if self._cuda  # type: ignore[arg-type]
                           else self._map(_guard(self._cpu_jpeg), jpegs))
                for index, tensor in zip(fast, decoded, strict=True):
                    results[index] = tensor
            done = self._map(_guard(lambda item: self._pillow(item[1], item[2])), slow)
            for (index, _, _), tensor in zip(slow, done, strict=True):
                results[index] = tensor
        if self._stream is not None:
            # Ready when returned: the thread that prepares a batch ahead waits here, not the
            # model's stream (which would also wait for the next batch's decoding).
            self._stream.synchronize()
        assert all(result is not None for result in results), "an image got no result"
        return results  # type: ignore[return-value]

    def _cuda_jpegs(self, jpegs: list[bytes]) -> list[torch.Tensor | InvalidInput]:
        """nvJPEG: the batch's JPEGs in one call; when it refuses, one by one, and what it
        cannot decode goes to Pillow."""
        tensors = [_as_tensor(data) for data in jpegs]
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
                results.append(self._pillow(data) if pixels is None
                               else self._resize_crop(pixels))
            except InvalidInput as exc:
                results.append(exc)
        return results

    def batch(self, images: list[torch.Tensor]) -> torch.Tensor:
        """The loaded images stacked into the model's input: ``[N, 3, 224, 224]`` float on
        the device (channels-last when asked)."""
        if self._stream is not None:  # made on the side stream, used on the model's
            current = torch.cuda.current_stream(self.device)
            for image in images:  # not to be reused before the model's stream is done
                image.record_stream(current)
        if self.mode == PIL:
            stacked = torch.stack(images)
            if self._cuda:
                stacked = stacked.pin_memory().to(self.device, non_blocking=True)
        else:
            stacked = torch.stack(images).float().sub_(self._mean).div_(self._std)
        if self._channels_last:
            stacked = stacked.contiguous(memory_format=torch.channels_last)
        return stacked


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
