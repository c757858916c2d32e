"""Image decoding shared by the vision handlers, and VisionHandler, which keeps bad images apart.

A request carries its image under TorchServe's ``data`` (form field) or ``body`` input: raw
bytes, base64 text, or a JSON object whose ``data`` (or ``body``) is base64 text. An input that
is not a usable image fails only its own request (``InvalidInput``, status 400); the model runs
once, on the batch's good images.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from torchvision import transforms

from backend.context import Context
from backend.errors import InvalidInput, describe
from backend.handlers.base import BaseHandler

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Resize the short side to 256, crop the middle 224x224: what ImageNet classifiers expect.
IMAGENET_TRANSFORM = transforms.Compose(
    [
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
    ]
)

_DATA_URL_MARK = ";base64,"


def image_bytes(row: Any) -> bytes:
    """The encoded image one request carries. Raises InvalidInput when there is none."""
    value = (row.get("data") or row.get("body")) if isinstance(row, Mapping) else row
    if isinstance(value, Mapping):  # a JSON body: {"data": "<base64>"}
        value = value.get("data") or value.get("body")
    if value is None or (isinstance(value, (bytes, bytearray, str)) and not value):
        raise InvalidInput(
            "empty body: the request carries no image (send the image bytes as the request "
            "body or in a form field named 'data')"
        )
    if isinstance(value, str):
        return decode_base64(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise InvalidInput(
        f"expected an image as bytes or base64 text, got a JSON {type(value).__name__}"
    )


def decode_base64(text: str) -> bytes:
    """Base64 text (line breaks and a ``data:image/...;base64,`` prefix allowed) to bytes."""
    _, mark, payload = text.partition(_DATA_URL_MARK)
    compact = "".join((payload if mark else text).split())
    try:
        data = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(
            "the input is text, not an image: send the image bytes, or base64-encode them"
        ) from None
    if not data:
        raise InvalidInput("empty body: the base64 text decodes to no bytes")
    return data


def decode_image(data: bytes) -> Image.Image:
    """Decode an encoded image fully and convert it to RGB. Raises InvalidInput."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            check_pixel_limit(image)
            image.load()  # decode it all now, so that truncated data fails here
            return image.convert("RGB")
    except InvalidInput:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # NOTE: Pillow only warns between MAX_IMAGE_PIXELS and twice that; where warnings are
        # errors (the test suite) the warning arrives here as an exception.
        raise InvalidInput(
            f"image has too many pixels, more than the limit of {Image.MAX_IMAGE_PIXELS}: {exc}"
        ) from None
    except UnidentifiedImageError:
        raise InvalidInput(
            f"not an image: {len(data)} bytes in no format Pillow can read "
            f"(they start with {data[:12]!r})"
        ) from None
    except Exception as exc:  # anything the decoder raises means the data is damaged
        raise InvalidInput(f"corrupt or truncated image: {describe(exc)}") from None


def check_pixel_limit(image: Image.Image) -> None:
    """Enforce ``Image.MAX_IMAGE_PIXELS`` (None: no limit) before decoding any pixel."""
    limit = Image.MAX_IMAGE_PIXELS
    pixels = image.width * image.height
    if limit is not None and pixels > limit:
        raise InvalidInput(
            f"image has too many pixels: {image.width}x{image.height} = {pixels}, more than "
            f"the limit of {limit}"
        )


def usable_cpus() -> int:
    """How many CPUs this process may run on (a worker can be pinned to a few)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _one_torch_thread() -> None:
    """A decode thread's torch ops run on that thread alone. Otherwise each decode thread
    gets an OpenMP team of its own on its first parallel op, and those teams' threads compete
    with the model's forward pass for the cores: measured here, a lone ResNet-152 request took
    130 ms instead of 80 ms once batches had been decoded in parallel."""
    torch.set_num_threads(1)


class VisionHandler(BaseHandler):
    """Decodes and transforms each request's image, runs the model on the good ones only.

    ``image_processing`` turns one RGB PIL image into the model's input tensor; ``preprocess``
    gathers those tensors into the model's batch input (one stacked tensor by default).
    """

    image_processing: Callable[[Image.Image], torch.Tensor] = IMAGENET_TRANSFORM

    def __init__(self) -> None:
        super().__init__()
        self._pool: ThreadPoolExecutor | None = None

    def initialize(self, context: Context) -> None:
        super().initialize(context)
        properties = context.system_properties
        if not properties.get("limit_max_image_pixels", True):
            # As TorchServe does: the limit is Pillow's process-wide setting.
            Image.MAX_IMAGE_PIXELS = None
        # Decoding and resizing spend their time in Pillow and torch, which release the GIL,
        # so the images of one batch are prepared in parallel.
        threads = min(usable_cpus(), max(1, int(properties.get("batch_size") or 1)))
        if threads > 1:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="image-decode",
                                            initializer=_one_torch_thread)

    def handle(self, data: list[Any], context: Context) -> list[Any]:
        """One result per request: a prediction, or the InvalidInput of a bad image."""
        return self.handle_valid(self.load_images(data), context)

    def load_images(self, data: list[Any]) -> list[torch.Tensor | InvalidInput]:
        """Each request's image as a tensor, or the InvalidInput saying what is wrong with it."""
        if self._pool is None or len(data) < 2:
            return [self._load_image(row) for row in data]
        return list(self._pool.map(self._load_image, data))

    def _load_image(self, row: Any) -> torch.Tensor | InvalidInput:
        try:
            image = decode_image(image_bytes(row))
        except InvalidInput as exc:
            return exc
        return self.image_processing(image)

    def preprocess(self, data: list[Any]) -> Any:
        return torch.stack(data).to(self.device)
