"""Reading images out of requests, and VisionHandler, which keeps bad images apart.

A request carries its image under TorchServe's ``data`` (form field) or ``body`` input: raw
bytes, base64 text, or a JSON object whose ``data`` (or ``body``) is base64 text; a KServe v2 row
of one input carries it under that input's name (a BYTES tensor from JSON: base64 text, which
TorchServe's kservev2 envelope hands on as text and its vision handler decodes). An input that
is not a usable image fails only its own request (``InvalidInput``, status 400); the model runs
once, on the batch's good images. How images become the model's input (decoded on the model's
device, or by Pillow as TorchServe does) is ``backend.handlers.images``.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from PIL import Image
from torchvision import transforms

from backend.context import Context
from backend.errors import InvalidInput
from backend.handlers.base import BaseHandler
from backend.handlers.images import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    PIL,
    TENSOR,
    ImagePipeline,
    check_pixel_limit,
    decode_rgb,
)

__all__ = ["IMAGENET_TRANSFORM", "VisionHandler", "check_pixel_limit", "decode_image",
           "image_bytes"]

# Resize the short side to 256, crop the middle 224x224: what ImageNet classifiers expect.
IMAGENET_TRANSFORM = transforms.Compose(
    [
        transforms.Resize(256),
        transforms.CenterCrop(224),
        transforms.ToTensor(),
        transforms.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD),
    ]
)
#: A decoded RGB image (Pillow's path).
decode_image = decode_rgb

_DATA_URL_MARK = ";base64,"
#: How JPEG, PNG, GIF, BMP, WebP and TIFF files begin ("BM" and "MM" are base64 characters).
_IMAGE_SIGNATURES = (b"\xff\xd8", b"\x89PNG", b"GIF8", b"BM", b"RIFF", b"II*\x00", b"MM\x00*")


def image_bytes(row: Any) -> bytes:
    """The encoded image one request carries. Raises InvalidInput when there is none."""
    value = _image_value(row) if isinstance(row, Mapping) else row
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
        return _unless_base64(bytes(value))
    raise InvalidInput(
        f"expected an image as bytes or base64 text, got a JSON {type(value).__name__}"
    )


def _image_value(row: Mapping[str, Any]) -> Any:
    value = row.get("data") or row.get("body")
    if value is None and len(row) == 1:  # a v2 row: {input_name: value}
        (value,) = row.values()
    return value


def _unless_base64(data: bytes) -> bytes:
    """Base64 text that came as bytes (a v2 BYTES tensor), decoded; other bytes as they are.

    Only ASCII that decodes as base64 in full is taken for it: an encoded image starts with
    non-ASCII bytes or one of the signatures, so raw images pass as they are.
    """
    if data.startswith(_IMAGE_SIGNATURES) or not data.isascii():
        return data
    try:
        return decode_base64(data.decode("ascii"))
    except InvalidInput:
        return data


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

    ``image_processing`` turns one RGB PIL image into the model's input tensor (Pillow's path);
    a handler that keeps the ImageNet transform gets the tensor path (``image_decode``,
    ``backend.handlers.images``) unless its model config asks for ``pil``. ``preprocess``
    gathers the images into the model's batch input (one stacked tensor by default). On
    CUDA its batches run in padded buckets, each a CUDA graph captured in the warm-up
    (``backend.handlers.graphs``; ``cuda_graphs: false`` in model-config.yaml opts out).
    """

    graphs_by_default = True

    image_processing: Callable[[Image.Image], torch.Tensor] = IMAGENET_TRANSFORM

    def __init__(self) -> None:
        super().__init__()
        self._pool: ThreadPoolExecutor | None = None
        self.pipeline: ImagePipeline | None = None
        self._batch_size = 1

    def initialize(self, context: Context) -> None:
        super().initialize(context)
        properties = context.system_properties
        if not properties.get("limit_max_image_pixels", True):
            # As TorchServe does: the limit is Pillow's process-wide setting.
            Image.MAX_IMAGE_PIXELS = None
        # Decoding and resizing spend their time in Pillow and torch, which release the GIL,
        # so the images of one batch are prepared in parallel, on this worker's share of the
        # cores (``cpu_threads``, set by the frontend).
        batch_size = self._batch_size = max(1, int(properties.get("batch_size") or 1))
        threads = min(int(properties.get("cpu_threads") or usable_cpus()), batch_size)
        if threads > 1:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="image-decode",
                                            initializer=_one_torch_thread)
        default = TENSOR if type(self).image_processing is IMAGENET_TRANSFORM else PIL
        mode = self.tuning.image_decode or default
        if mode == TENSOR and default == PIL:
            mode = PIL  # a handler's own transform works on PIL images
        self.pipeline = ImagePipeline(self.device, mode, self._pool,
                                      channels_last=self.tuning.channels_last,
                                      pil_transform=self.image_processing)
        self.warm_up(lambda size: [{"body": WARMUP_JPEG}] * size, batch_size)

    def predict_requests(self, data: list[Any], context: Context) -> list[Any]:
        """One result per request: a prediction, or the InvalidInput of a bad image."""
        return self.handle_prepared(self.prepare_batch(data), context)

    def prepare_batch(self, data: list[Any]) -> list[torch.Tensor | InvalidInput]:
        """The step that can run ahead of the batch before (the worker's reader thread runs
        it while the model computes): the images decoded and moved to the model's device."""
        return self.load_images(data)

    def handle_prepared(self, images: list[torch.Tensor | InvalidInput],
                        context: Context) -> list[Any]:
        """The rest of ``handle``: the model on the good images."""
        return self.handle_valid(images, context)

    def load_images(self, data: list[Any]) -> list[torch.Tensor | InvalidInput]:
        """Each request's image as a tensor, or the InvalidInput saying what is wrong with it."""
        assert self.pipeline is not None, "initialize first"
        return self.pipeline.load([_image_or_error(row) for row in data])

    def preprocess(self, data: list[Any]) -> Any:
        assert self.pipeline is not None, "initialize first"
        return self.pipeline.batch(data)


def _image_or_error(row: Any) -> bytes | InvalidInput:
    try:
        return image_bytes(row)
    except InvalidInput as exc:
        return exc


def _warmup_jpeg() -> bytes:
    """A small JPEG, made here, for the warm-up to decode (nvJPEG initialises on first use)."""
    import io

    buffer = io.BytesIO()
    Image.new("RGB", (320, 240), (120, 80, 40)).save(buffer, format="JPEG")
    return buffer.getvalue()


WARMUP_JPEG = _warmup_jpeg()
