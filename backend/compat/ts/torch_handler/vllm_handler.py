"""``ts.torch_handler.vllm_handler``: TorchServe's VLLMHandler: vLLM's OpenAI-compatible
completions, chat completions and model list behind one model, the route chosen by the
request's ``url_path`` header (``v1/completions``, ``v1/chat/completions``, ``v1/models``).
model-config.yaml ``handler``: ``model_path`` or ``vllm_engine_config`` (vLLM's
AsyncEngineArgs), ``adapters`` (LoRA), ``chat_template``. Streamed answers go out as
intermediate responses.

Needs ``vllm`` at import, as TorchServe's module does. Its ``handle`` is a coroutine;
batchserve's worker runs it on the worker's event loop, one batch at a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import time
from typing import Any

from backend.context import Context
from backend.optional import require

from ..handler_utils.utils import send_intermediate_predict_response
from ..service import PredictionException
from .base_handler import BaseHandler

_vllm = require("vllm", "ts.torch_handler.vllm_handler")
_protocol = require("vllm.entrypoints.openai.protocol", "ts.torch_handler.vllm_handler")
_chat = require("vllm.entrypoints.openai.serving_chat", "ts.torch_handler.vllm_handler")
_completion = require("vllm.entrypoints.openai.serving_completion",
                      "ts.torch_handler.vllm_handler")
_engine = require("vllm.entrypoints.openai.serving_engine", "ts.torch_handler.vllm_handler")

__all__ = ["BaseHandler", "PredictionException", "VLLMHandler",
           "send_intermediate_predict_response"]

logger = logging.getLogger(__name__)
_DONE = "data: [DONE]\n\n"


class _RawRequest:
    """What vLLM's OpenAI servers read of a Starlette request: no headers, never
    disconnected."""

    headers: dict[str, str] = {}  # read only

    async def is_disconnected(self) -> bool:
        return False


class VLLMHandler(BaseHandler):
    """One OpenAI-style request per batch through vLLM's async engine."""

    def __init__(self) -> None:
        super().__init__()
        self.vllm_engine: Any = None
        self.model_name: str | None = None
        self.model_dir: str | None = None
        self.lora_ids: dict[str, int] = {}
        self.adapters: Any = None
        self.chat_completion_service: Any = None
        self.completion_service: Any = None
        self.raw_request: Any = None
        self.initialized = False

    def initialize(self, ctx: Context) -> None:
        self.model_dir = ctx.system_properties.get("model_dir")
        handler = ctx.model_yaml_config.get("handler") or {}
        config = self._get_vllm_engine_config(handler)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        self.vllm_engine = _vllm.AsyncLLMEngine.from_engine_args(config)
        self.adapters = handler.get("adapters", {})
        lora = [_engine.LoRAModulePath(name, path) for name, path in self.adapters.items()]
        names = config.served_model_name or [config.model]
        loop = asyncio.get_event_loop()
        model_config = loop.run_until_complete(self.vllm_engine.get_model_config())
        self.completion_service = _completion.OpenAIServingCompletion(
            self.vllm_engine, model_config, names, lora_modules=lora, prompt_adapters=None,
            request_logger=None)
        self.chat_completion_service = _chat.OpenAIServingChat(
            self.vllm_engine, model_config, names, "assistant", lora_modules=lora,
            prompt_adapters=None, request_logger=None,
            chat_template=handler.get("chat_template"))
        self.raw_request = _RawRequest()
        self.initialized = True

    async def handle(self, data: list[Any], context: Context) -> list[Any]:  # type: ignore[override]
        start = time.time()
        output = await self.postprocess(
            await self.inference(await self.preprocess(data, context), context))
        context.metrics.add_time("HandlerTime", round((time.time() - start) * 1000, 2), None,
                                 "ms")
        return list(output)

    async def preprocess(self, requests: list[Any], context: Context) -> list[Any]:  # type: ignore[override]
        if len(requests) != 1:
            raise ValueError(f"VLLMHandler takes one request per batch (batch_size 1), got "
                             f"{len(requests)}")
        data = requests[0].get("data") or requests[0].get("body")
        if isinstance(data, (bytes, bytearray)):
            data = bytes(data).decode("utf-8")
        return [data]

    async def inference(self, input_batch: list[Any], context: Context) -> list[Any]:  # type: ignore[override]
        route = context.get_request_header(0, "url_path")
        if route == "v1/models":
            models = await self.chat_completion_service.show_available_models()
            return [models.model_dump()]
        routes = {
            "v1/completions": (_protocol.CompletionRequest, self.completion_service,
                               "create_completion"),
            "v1/chat/completions": (_protocol.ChatCompletionRequest,
                                    self.chat_completion_service, "create_chat_completion"),
        }
        if route not in routes:
            raise PredictionException(f"Unknown API endpoint: {route}", 404)
        request_type, service, method = routes[route]
        request = request_type.model_validate(input_batch[0])
        answer = await getattr(service, method)(request, self.raw_request)
        if isinstance(answer, _protocol.ErrorResponse) or not request.stream:
            return [answer.model_dump()]
        last = None
        async for last in answer:
            if last != _DONE:
                send_intermediate_predict_response([last], context.request_ids, "Result", 200,
                                                   context)
        return [last]

    async def postprocess(self, inference_outputs: Any) -> Any:  # type: ignore[override]
        return inference_outputs

    def _get_vllm_engine_config(self, handler_config: dict[str, Any]) -> Any:
        """vLLM's AsyncEngineArgs: ``vllm_engine_config`` over the model, which is its
        ``model``, else ``model_path`` under the model directory, else ``model_path`` as given
        (a Hugging Face id)."""
        params = handler_config.get("vllm_engine_config", {})
        model = params.get("model")
        if not model:
            model_path = handler_config.get("model_path")
            if not model_path:
                raise ValueError("please define model in vllm_engine_config or model_path in "
                                 "handler")
            local = pathlib.Path(str(self.model_dir)).joinpath(model_path)
            model = local.as_posix() if local.exists() else model_path
        config = _vllm.AsyncEngineArgs(model=model)
        self._set_attr_value(config, params)
        return config

    def _set_attr_value(self, obj: Any, config: dict[str, Any]) -> None:
        """Set each of ``config``'s keys that ``obj`` has as an attribute."""
        known = vars(obj)
        for key, value in config.items():
            if key in known:
                setattr(obj, key, value)
