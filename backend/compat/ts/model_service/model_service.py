"""``ts.model_service.model_service``: MMS's model-service classes, which very old handlers
subclass: ``ModelService`` (a signature file names the input; ``inference`` takes it) and
``SingleNodeService`` (``_preprocess`` -> ``_inference`` -> ``_postprocess``)."""

from __future__ import annotations

import ast
import json
import logging
import os
import time
from typing import Any

logger = logging.getLogger(__name__)


class ModelService:
    """A model service with a ``signature`` (the manifest's ``Model.Signature`` file).

    Not an ABC, as in TorchServe (its ``__metaclass__`` line has no effect in Python 3): a
    subclass that leaves ``ping`` or ``_inference`` out still instantiates."""

    def __init__(self, model_name: str, model_dir: str, manifest: Any, gpu: int | None = None
                 ) -> None:
        self.ctx: Any = None
        self._context: Any = None
        self._signature: dict[str, Any] | None = None

    def initialize(self, context: Any) -> None:
        """Read the signature file the manifest names (``Model.Signature``)."""
        self._context = context
        model_dir = str(context.system_properties.get("model_dir"))
        path = os.path.join(model_dir, context.manifest["Model"]["Signature"])
        if not os.path.isfile(path):
            raise ValueError("Signature file is not found.")
        with open(path, encoding="utf-8") as file:
            self._signature = json.load(file)

    def inference(self, data: list[Any]) -> Any:
        """The outputs for the batch's raw inputs (override it)."""
        return None

    def ping(self) -> Any:
        """The service's health (override it)."""
        return None

    def signature(self) -> dict[str, Any] | None:
        return self._signature

    def handle(self, data: list[Any], context: Any) -> list[Any]:
        """MMS's entry point: the first request's input (named by the signature's first
        input, else ``body`` or ``data``; a JSON input given as bytes is parsed as a Python
        literal) through ``inference``; a single output is wrapped in a list."""
        signature = self._signature or {}
        value = data[0].get(signature["inputs"][0]["data_name"])
        if value is None:
            value = data[0].get("body")
        if value is None:
            value = data[0].get("data")
        if signature.get("input_type") == "application/json" and isinstance(
                value, (bytes, bytearray)):
            value = ast.literal_eval(value.decode("utf-8"))
        output = self.inference([value])
        return output if isinstance(output, list) else [output]


class SingleNodeService(ModelService):
    """A service of one model: ``inference`` runs the three private steps and logs their
    times in milliseconds."""

    def inference(self, data: list[Any]) -> Any:
        started = time.time()
        data = self._preprocess(data)
        inferred = time.time()
        data = self._inference(data)
        postprocessed = time.time()
        data = self._postprocess(data)
        ended = time.time()
        logger.info("preprocess time: %.2f", (inferred - started) * 1000)
        logger.info("inference time: %.2f", (postprocessed - inferred) * 1000)
        logger.info("postprocess time: %.2f", (ended - postprocessed) * 1000)
        return data

    def _inference(self, data: Any) -> Any:
        """The forward computation (override it)."""
        return data

    def _preprocess(self, data: Any) -> Any:
        return data

    def _postprocess(self, data: Any) -> Any:
        return data
