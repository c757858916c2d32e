"""``ts.torch_handler.trt_llm_handler``: TorchServe's TRTLLMHandler: text generation with a
TensorRT-LLM engine (model-config.yaml ``handler``: ``engine_dir``, ``tokenizer_dir``,
``kv_cache_config``). A request is a JSON object: ``prompt``, optional ``streaming``, and
sampling parameters; one request per batch. Streamed tokens go out as intermediate responses.

Needs ``tensorrt_llm`` and ``transformers`` at import, as TorchServe's module does. Its
``handle`` is a coroutine; batchserve's worker runs it on the worker's event loop.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from backend.context import Context
from backend.optional import require

from ..handler_utils.utils import send_intermediate_predict_response
from .base_handler import BaseHandler

_hlapi = require("tensorrt_llm.hlapi", "ts.torch_handler.trt_llm_handler",
                 "pip install tensorrt_llm (see NVIDIA's TensorRT-LLM installation guide)")
_transformers = require("transformers", "ts.torch_handler.trt_llm_handler")

__all__ = ["BaseHandler", "TRTLLMHandler", "send_intermediate_predict_response"]

logger = logging.getLogger(__name__)


class TRTLLMHandler(BaseHandler):
    """One prompt per batch through the TensorRT-LLM engine."""

    def __init__(self) -> None:
        super().__init__()
        self.trt_llm_engine: Any = None
        self.tokenizer: Any = None
        self.model = None
        self.model_dir: str | None = None
        self.initialized = False

    def initialize(self, ctx: Context) -> None:
        self.model_dir = ctx.system_properties.get("model_dir")
        handler = ctx.model_yaml_config.get("handler") or {}
        self.tokenizer = _transformers.AutoTokenizer.from_pretrained(
            handler.get("tokenizer_dir"), legacy=False, padding_side="left",
            truncation_side="left", trust_remote_code=True, use_fast=True)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token_id = self.tokenizer.eos_token_id
        self.trt_llm_engine = _hlapi.LLM(
            model=handler.get("engine_dir"), tokenizer=self.tokenizer,
            kv_cache_config=_hlapi.KvCacheConfig(**handler.get("kv_cache_config", {})))
        self.initialized = True

    async def handle(self, data: list[Any], context: Context) -> list[Any]:  # type: ignore[override]
        start = time.time()
        output = await self.postprocess(
            await self.inference(await self.preprocess(data), context))
        context.metrics.add_time("HandlerTime", round((time.time() - start) * 1000, 2), None,
                                 "ms")
        return list(output)

    async def preprocess(self, requests: list[Any]) -> Any:
        """The one request's JSON object (a text body is decoded)."""
        if len(requests) != 1:
            raise ValueError(f"TRTLLMHandler takes one request per batch (batch_size 1), got "
                             f"{len(requests)}")
        data = requests[0].get("data") or requests[0].get("body")
        if isinstance(data, (bytes, bytearray)):
            data = bytes(data).decode("utf-8")
        if isinstance(data, str):
            data = json.loads(data)
        return data

    async def inference(self, data: Any, context: Context) -> list[Any]:  # type: ignore[override]
        """Generate; with ``streaming``, each new token is sent as an intermediate response
        (``{"text": token}``) and the final answer is empty."""
        data = dict(data)
        prompt = data.pop("prompt")
        streaming = data.pop("streaming", False)
        params = {"end_id": self.tokenizer.eos_token_id,
                  "pad_id": self.tokenizer.pad_token_id, **data}
        outputs = self.trt_llm_engine.generate_async(
            prompt, streaming=streaming, sampling_params=_hlapi.SamplingParams(**params))
        async for output in outputs:
            text, token_ids = output.outputs[0].text, output.outputs[0].token_ids
            if not streaming:
                return [text]
            send_intermediate_predict_response(
                [json.dumps({"text": self.tokenizer.decode([token_ids[-1]])})],
                context.request_ids, "Result", 200, context)
        return [""]

    async def postprocess(self, outputs: Any) -> Any:  # type: ignore[override]
        return outputs
