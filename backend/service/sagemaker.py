"""The SageMaker inference toolkit's handler service, run per request or per batch.

SageMaker's PyTorch containers serve a user's ``inference.py`` (``model_fn``, ``input_fn``,
``predict_fn``, ``output_fn``, or ``transform_fn``) through the toolkit's handler service
(``sagemaker_inference.default_handler_service.DefaultHandlerService``, which
``sagemaker_pytorch_serving_container.handler_service.HandlerService`` subclasses): the
server's ``default_service_handler`` names it. Its ``Transformer.transform`` loops over the
batch, but reads every request's Content-Type and Accept from request 0 and sets only
response 0's content type: a batch of more than one request mixes them up.

``adapt`` recognises that service and gives the worker a ``handle`` that never mixes them:

- by default each request of a batch goes through the toolkit's own ``handle`` on its own,
  with a context whose index 0 is that request (``OneRequestContext``): the user's functions see
  one request at a time, as on SageMaker's TorchServe containers with batch size 1;
- where the user's module also defines ``batch_predict_fn(inputs, model)`` (or with a third
  argument, the context), the batch reaches it whole: ``input_fn`` decodes each request
  with its own Content-Type, ``batch_predict_fn`` gets the list of what they returned (in
  request order) and returns one prediction per request, and ``output_fn`` encodes each
  with its own Accept. ``transform_fn`` modules always run per request.

A failure in one request's ``input_fn`` or ``output_fn`` fails that request alone, answered
as the toolkit answers errors (its status and message); a failure of ``batch_predict_fn``
fails the requests that reached it. The batch path uses the toolkit's ``Transformer``
internals (its functions, model and environment, set by ``validate_and_initialize``); where
a toolkit release lacks them, the service runs per request, saying so once.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from backend.context import Context, OneRequestContext
from backend.service.loader import EntryPoint

logger = logging.getLogger(__name__)

#: The user's opt-in to whole batches, a function of their ``inference.py``.
BATCH_FUNCTION = "batch_predict_fn"
_SERVICE_CLASS = ("sagemaker_inference.default_handler_service", "DefaultHandlerService")
#: The Transformer attributes the batch path reads (set by validate_and_initialize).
_TRANSFORMER_PARTS = ("_input_fn", "_output_fn", "_model", "_environment", "_transform_fn",
                      "_run_handler_function", "validate_and_initialize")


def is_toolkit_service(handler: object) -> bool:
    """Whether ``handler`` is the SageMaker toolkit's handler service (or a subclass)."""
    return any((cls.__module__, cls.__name__) == _SERVICE_CLASS for cls in type(handler).__mro__)


def adapt(entry_point: EntryPoint, context: Context) -> EntryPoint:
    """``entry_point`` itself, unless its handler is the toolkit's service: then one whose
    ``handle`` runs requests per request or, where the user opted in, per batch."""
    service = getattr(entry_point.handle, "__self__", None)
    if service is None or not is_toolkit_service(service):
        return entry_point
    runner = _ToolkitRunner(service, context)
    logger.info("%s is the SageMaker inference toolkit's handler service: %s", entry_point.name,
                runner.mode)

    def handle(data: Any, context: Context) -> Any:
        return runner.handle(data, context)

    handle.__self__ = service  # type: ignore[attr-defined]  # as loader.run_coroutines keeps it
    return EntryPoint(handle, entry_point.name)


class _ToolkitRunner:
    def __init__(self, service: Any, context: Context) -> None:
        self.service = service
        self.transformer: Any = getattr(service, "_service", None)
        self.batch_fn = self._batch_function()
        self.mode = (f"batches reach the user's {BATCH_FUNCTION} whole" if self.batch_fn
                     else f"each request runs on its own (define {BATCH_FUNCTION}(inputs, model) "
                          "in inference.py to take whole batches)")

    def _batch_function(self) -> Any:
        """The user's ``batch_predict_fn``, where the module defines one (and no
        ``transform_fn``) and this toolkit has the internals the batch path needs."""
        transformer = self.transformer
        environment = getattr(transformer, "_environment", None)
        module = sys.modules.get(getattr(environment, "module_name", "") or "")
        function = getattr(module, BATCH_FUNCTION, None)
        if function is None:
            return None
        if getattr(module, "transform_fn", None) is not None:
            logger.warning("inference.py defines both transform_fn and %s: transform_fn runs, "
                           "per request", BATCH_FUNCTION)
            return None
        missing = [part for part in _TRANSFORMER_PARTS if not hasattr(transformer, part)]
        if missing:
            logger.warning("this SageMaker toolkit's Transformer lacks %s: %s is not used, each "
                           "request runs on its own", ", ".join(missing), BATCH_FUNCTION)
            return None
        return function

    def handle(self, data: Any, context: Context) -> Any:
        if data is None:  # not a batch (a function entry point's initialising call)
            return self.service.handle(data, context)
        if self.batch_fn is not None and len(data) > 1:
            return self._whole(data, context)
        results: list[Any] = []
        for idx, request in enumerate(data):
            answer = self.service.handle([request], OneRequestContext(context, idx))
            results.append(answer[0] if isinstance(answer, list) and len(answer) == 1
                           else answer)
        return results

    # ---- the batch path --------------------------------------------------------------------

    def _whole(self, data: Sequence[Any], context: Context) -> list[Any]:
        from sagemaker_inference import content_types, utils

        transformer = self.transformer
        run = transformer._run_handler_function
        results: list[Any] = [None] * len(data)
        decoded: list[tuple[int, Any, str]] = []  # (index, input, accept)
        for idx, request in enumerate(data):
            try:
                properties = context.request_processor[idx].get_request_properties()
                content_type = utils.retrieve_content_type_header(properties)
                accept = properties.get("Accept") or properties.get("accept")
                if not accept or accept == content_types.ANY:
                    accept = transformer._environment.default_accept
                body = request.get("body") if isinstance(request, dict) else request
                if content_type in content_types.UTF8_TYPES and isinstance(
                        body, (bytes, bytearray)):
                    body = bytes(body).decode("utf-8")
                decoded.append((idx, run(transformer._input_fn, body, content_type), accept))
            except Exception as exc:
                results[idx] = self._failed(context, idx, exc)
        if decoded:
            try:
                predictions = run(self.batch_fn, [item for _, item, _ in decoded],
                                  transformer._model)
                if len(predictions) != len(decoded):
                    raise ValueError(f"{BATCH_FUNCTION} returned {len(predictions)} predictions "
                                     f"for {len(decoded)} inputs")
            except Exception as exc:
                for idx, _, _ in decoded:
                    results[idx] = self._failed(context, idx, exc)
                return results
            for (idx, _, accept), prediction in zip(decoded, predictions, strict=True):
                try:
                    result = run(transformer._output_fn, prediction, accept)
                    content_type = accept
                    if isinstance(result, tuple):  # (response, content type), as the toolkit
                        result, content_type = result[0], result[1]
                    context.set_response_content_type(idx, content_type)
                    results[idx] = result
                except Exception as exc:
                    results[idx] = self._failed(context, idx, exc)
        return results

    def _failed(self, context: Context, idx: int, exc: Exception) -> Any:
        """The toolkit's answer to an error, for request ``idx`` alone."""
        from sagemaker_inference.errors import (
            BaseInferenceToolkitError,
            GenericInferenceToolkitError,
        )

        error = exc if isinstance(exc, BaseInferenceToolkitError) else \
            GenericInferenceToolkitError(500, str(exc))
        answer = self.transformer.handle_error(OneRequestContext(context, idx), error,
                                               traceback.format_exc())
        return answer[0] if isinstance(answer, list) and answer else answer
