"""``ts.torch_handler.vision_handler``: TorchServe's VisionHandler.

``preprocess`` takes each request's image from its ``data`` or ``body`` input (bytes, base64
text, or a JSON array of pixel values), applies the class's ``image_processing`` to the PIL
image and stacks the results. As in TorchServe the image keeps its own mode (a grayscale PNG
stays single-channel) and one bad image fails the whole batch, here with ``InvalidInput``
(400; the worker then re-runs the batch without it). A class that keeps TorchServe's ImageNet
transform gets batchserve's tensor path instead (``backend.handlers.images``: decoded on the
model's device, every image as RGB) unless its model config says ``image_decode: pil``.
Reading the bytes and the pixel limit come from ``backend.handlers.vision``. ``get_insights``
explains with Captum's IntegratedGradients as TorchServe's does, with Captum imported on the
first explanation (501 without it) rather than with the module; ``self.ig`` (TorchServe's
IntegratedGradients of the model, for handlers' own ``get_insights``) is made on first use.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from backend.context import Context
from backend.errors import InvalidInput, Unsupported, describe
from backend.handlers.explain import integrated_gradients
from backend.handlers.images import TENSOR, ImagePipeline
from backend.handlers.vision import IMAGENET_TRANSFORM, check_pixel_limit, image_bytes

from ..handler_utils.timer import timed
from .base_handler import BaseHandler


class VisionHandler(BaseHandler):
    """Base of image handlers; subclasses set ``image_processing`` (PIL image -> tensor)."""

    image_processing: Callable[[Any], torch.Tensor]
    _ig: Any = None

    @property
    def ig(self) -> Any:
        """Captum's IntegratedGradients of ``self.model``, made on first use (Unsupported
        without Captum)."""
        if self._ig is None:
            self._ig = integrated_gradients_of(self.model)
        return self._ig

    @ig.setter
    def ig(self, value: Any) -> None:
        self._ig = value

    def initialize(self, context: Context) -> None:
        super().initialize(context)
        if not context.system_properties.get("limit_max_image_pixels", True):
            # As TorchServe does: the limit is Pillow's process-wide setting.
            Image.MAX_IMAGE_PIXELS = None
        self._pipeline: ImagePipeline | None = None
        if (getattr(type(self), "image_processing", None) is IMAGENET_TRANSFORM
                and (self.tuning.image_decode or TENSOR) == TENSOR):
            self._pipeline = ImagePipeline(self.device, TENSOR,
                                           channels_last=self.tuning.channels_last)

    @timed
    def preprocess(self, data: list[Any]) -> torch.Tensor:
        processing = getattr(self, "image_processing", None)
        if processing is None:
            raise TypeError(f"{type(self).__name__} must set image_processing (a transform)")
        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None and not any(isinstance(_value(row), list) for row in data):
            loaded = pipeline.load([image_bytes(row) for row in data])
            for image in loaded:
                if isinstance(image, InvalidInput):
                    raise image  # TorchServe's rule: one bad image fails the batch
            batch: torch.Tensor = pipeline.batch(
                [image for image in loaded if isinstance(image, torch.Tensor)])
            return batch
        images: list[torch.Tensor] = []
        for row in data:
            value = _value(row)
            if isinstance(value, list):  # a JSON array: the pixels themselves
                images.append(torch.as_tensor(value, dtype=torch.float32))
            else:
                images.append(processing(open_image(image_bytes(row))))
        return torch.stack(images).to(self.device)

    def get_insights(self, tensor_data: torch.Tensor, _: Any, target: Any = 0) -> Any:
        """IntegratedGradients attributions (15 steps) of class ``target`` over the batch, as
        nested lists: one ``[C, H, W]`` per request."""
        # The model as loaded: a compiled one would recompile for the steps' batch shapes.
        model = self._uncompiled or self.model
        assert model is not None, "initialize first"
        return integrated_gradients(model, tensor_data, target).tolist()


def integrated_gradients_of(model: Any) -> Any:
    """Captum's IntegratedGradients of ``model`` (Unsupported without Captum)."""
    try:
        from captum.attr import IntegratedGradients
    except ImportError:
        raise Unsupported("explanations need Captum, which is not installed where this "
                          "model's workers run: pip install captum") from None
    return IntegratedGradients(model)


def _value(row: Any) -> Any:
    return (row.get("data") or row.get("body")) if isinstance(row, Mapping) else row


def open_image(data: bytes) -> Image.Image:
    """Decode an image in its own mode (no RGB conversion). Raises InvalidInput."""
    try:
        image = Image.open(io.BytesIO(data))
        check_pixel_limit(image)
        image.load()  # decode it all now, so that truncated data fails here
    except InvalidInput:
        raise
    except UnidentifiedImageError:
        raise InvalidInput(f"not an image: {len(data)} bytes Pillow cannot read") from None
    except Exception as exc:  # a decompression bomb, truncated or corrupt data
        raise InvalidInput(f"corrupt or unreadable image: {describe(exc)}") from None
    return image
