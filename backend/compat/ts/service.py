"""``ts.service``: TorchServe's ``Service``: a loaded handler entry point and its context,
answering TorchServe's PREDICT frames with response frames (``ts.protocol``).

batchserve's worker runs handlers through ``backend.service.model_service.ModelService`` instead;
this is for code that drives a handler the way TorchServe's worker does (``ts.model_loader`` makes
one, ``ts.model_service_worker`` serves a TorchServe frontend with it, tests build one by hand).
Errors are mapped as TorchServe maps them: PredictionException to its own code, out of memory to
507, anything else to 503.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from backend.errors import is_out_of_memory

from . import version
from .context import Context, RequestProcessor
from .protocol.otf_message_handler import create_predict_response
from .utils.util import PredictionException, get_yaml_config

__all__ = ["PREDICTION_METRIC", "PredictionException", "Service", "create_predict_response",
           "emit_metrics", "get_yaml_config"]

PREDICTION_METRIC = "PredictionTime"
logger = logging.getLogger(__name__)


class Service:
    """A handler entry point (``entry_point(data, context)``) with the context it runs in."""

    def __init__(self, model_name: str, model_dir: str, manifest: dict[str, Any] | None,
                 entry_point: Callable[[Any, Any], Any], gpu: int | None, batch_size: int,
                 limit_max_image_pixels: bool = True, metrics_cache: Any = None) -> None:
        model_yaml_config: dict[str, Any] = {}
        model = manifest.get("model") if isinstance(manifest, dict) else None
        if isinstance(model, dict) and model.get("configFile"):
            model_yaml_config = get_yaml_config(os.path.join(model_dir, model["configFile"]))
        self._context = Context(model_name, model_dir, manifest, batch_size, gpu,
                                version.__version__, limit_max_image_pixels, metrics_cache,
                                model_yaml_config)
        self._entry_point = entry_point
        self.cl_socket: Any = None

    @property
    def context(self) -> Context:
        return self._context

    @staticmethod
    def retrieve_data_for_inference(
        batch: Iterable[Mapping[str, Any]] | None,
    ) -> tuple[list[RequestProcessor], list[dict[str, Any]], dict[int, str]]:
        """A decoded PREDICT message as the handler's view: per request its headers (the
        request's own, and each input's content type under the input's name), its inputs by
        name, and its id by position."""
        if batch is None:
            raise ValueError("Received invalid inputs")
        headers: list[RequestProcessor] = []
        inputs: list[dict[str, Any]] = []
        ids: dict[int, str] = {}
        for index, request in enumerate(batch):
            values: dict[str, Any] = {}
            request_headers: dict[str, Any] = {}
            for parameter in request["parameters"]:
                values[parameter["name"]] = parameter["value"]
                request_headers[parameter["name"]] = {"content-type": parameter["contentType"]}
            for header in request.get("headers") or ():
                request_headers[_text(header["name"])] = _text(header["value"])
            headers.append(RequestProcessor(request_headers))
            inputs.append(values)
            ids[index] = _text(request["requestId"])
        return headers, inputs, ids

    def set_cl_socket(self, cl_socket: Any) -> None:
        """The frontend's socket, where intermediate responses go."""
        self.cl_socket = cl_socket

    def predict(self, batch: Iterable[Mapping[str, Any]] | None) -> bytearray | None:
        """Run the entry point on one PREDICT message; the response frame."""
        headers, inputs, ids = Service.retrieve_data_for_inference(batch)
        context = self.context
        context.request_ids = ids
        context.request_processor = headers
        metrics = context.metrics
        metrics.request_ids = ids
        context.cl_socket = self.cl_socket  # type: ignore[attr-defined]
        start = time.time()
        try:
            results = self._entry_point(inputs, context)
        except Exception as exc:
            return _failed_prediction(exc, ids)
        return _prediction_answer(results, len(inputs), ids, context, start)


def _failed_prediction(exc: Exception, ids: dict[int, str]) -> bytearray | None:
    """TorchServe's answer to an entry point that raised: a PredictionException's message
    and code, 507 for running out of memory, else 503 "Prediction failed"."""
    if isinstance(exc, PredictionException):
        logger.error("Prediction error", exc_info=exc)
        return create_predict_response(None, ids, exc.message, exc.error_code)
    if is_out_of_memory(exc):
        logger.error("System out of memory", exc_info=exc)
        return create_predict_response(None, ids, "Out of resources", 507)
    logger.warning("Invoking custom service failed.", exc_info=exc)
    return create_predict_response(None, ids, "Prediction failed", 503)


def _prediction_answer(results: Any, size: int, ids: dict[int, str], context: Any,
                      start: float) -> bytearray | None:
    """The response frame for an entry point's ``results`` on a batch of ``size``: 503 unless
    they are a list of that length; else each result, and ``PredictionTime`` reported."""
    if not isinstance(results, list):
        logger.warning("model: %s, Invalid return type: %s.", context.model_name,
                       type(results))
        return create_predict_response(None, ids, "Invalid model predict output", 503)
    if len(results) != size:
        logger.warning("model: %s, number of batch response mismatched, expect: %d, got: "
                       "%d.", context.model_name, size, len(results))
        return create_predict_response(None, ids, "number of batch response mismatched", 503)
    context.metrics.add_time(PREDICTION_METRIC, round((time.time() - start) * 1000, 2))
    return create_predict_response(results, ids, "Prediction success", 200, context=context)


def _text(value: str | bytes | bytearray) -> str:
    return value if isinstance(value, str) else bytes(value).decode("utf-8")


def emit_metrics(metrics: Iterable[Any] | None) -> None:
    """Log each metric as ``[METRICS]<metric>`` (TorchServe's legacy metric lines)."""
    for metric in metrics or ():
        logger.info("[METRICS]%s", metric)
