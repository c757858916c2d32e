"""``ts.torch_handler.dali_handler``: TorchServe's DALIHandler, whose preprocessing is an
NVIDIA DALI pipeline (``ts.handler_utils.preprocess.dali``) on the GPU.

Needs NVIDIA DALI at import, as TorchServe's module does (through that module).
"""

from __future__ import annotations

from typing import Any

import numpy
import torch
from PIL import Image

from backend.context import Context

from ..handler_utils.preprocess.dali import get_dali_pipeline
from .base_handler import BaseHandler
from .vision_handler import integrated_gradients_of

__all__ = ["BaseHandler", "DALIHandler", "get_dali_pipeline"]


class DALIHandler(BaseHandler):
    """Images decoded and transformed by the model config's DALI pipeline."""

    pipeline: Any = None
    _ig: Any = None

    @property
    def ig(self) -> Any:
        """Captum's IntegratedGradients of the model, made on first use (as VisionHandler's)."""
        if self._ig is None:
            self._ig = integrated_gradients_of(self.model)
        return self._ig

    @ig.setter
    def ig(self, value: Any) -> None:
        self._ig = value

    def initialize(self, context: Context) -> None:
        super().initialize(context)
        if not context.system_properties.get("limit_max_image_pixels", True):
            Image.MAX_IMAGE_PIXELS = None
        self.pipeline = get_dali_pipeline(context)
        self.initialized = True

    def preprocess(self, data: list[Any]) -> torch.Tensor:
        """Each request's encoded image through the pipeline, stacked on the device."""
        images = []
        for row in data:
            image = row.get("data") or row.get("body")
            if isinstance(image, (bytes, bytearray)):
                image = numpy.frombuffer(image, dtype=numpy.uint8)
            images.append(image)
        output = self.pipeline.run(source=images)[0]
        return torch.stack([torch.tensor(output.at(index)) for index in range(len(output))]
                           ).to(self.device)

    def get_insights(self, tensor_data: torch.Tensor, _: Any, target: Any = 0) -> Any:
        """IntegratedGradients attributions of class ``target`` (15 steps)."""
        return self.ig.attribute(tensor_data, target=target, n_steps=15).tolist()
