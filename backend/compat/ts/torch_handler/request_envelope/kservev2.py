"""``ts.torch_handler.request_envelope.kservev2``: KServe v2 (the Open Inference Protocol):
each request ``{"id", "inputs": [...]}``, one row per input (the input object with its
``data`` reshaped to its ``shape``; for BYTES its first element as it came); each request
answered ``{"id", "model_name", "model_version", "outputs": [...]}``, output i named after
input i, its data flattened, its datatype numpy's for it.

As TorchServe's, it sets ``context.input_names`` (the first request's) for the handler;
every request of a batch is answered (TorchServe's reads the first request only).
"""

from __future__ import annotations

import logging
from typing import Any

from backend.codecs import envelopes

from .base import BaseEnvelope

__all__ = ["BaseEnvelope", "KServev2Envelope"]

logger = logging.getLogger(__name__)


class KServev2Envelope(BaseEnvelope):
    """KServe v2 around a handler."""

    def parse_input(self, data: list[Any]) -> list[Any]:
        inputs = self._batch_from_json(data)
        logger.debug("KServev2 parsed inputs %s", inputs)
        return inputs

    def _codec(self) -> envelopes.KServeV2Envelope:
        return envelopes.KServeV2Envelope(self.context)

    def _batch_from_json(self, rows: list[Any]) -> list[Any]:
        """Every request's rows, in order; remembers each request's input names and id."""
        return self._from_json(rows)

    def _from_json(self, body_list: list[Any]) -> list[Any]:
        codec = self._codec()
        self._unwrapped = [codec.unwrap(row, self._request_id(index))
                           for index, row in enumerate(body_list)]
        if self._unwrapped and self.context is not None:
            self.context.input_names = self._unwrapped[0].input_names
        return [item for unwrapped in self._unwrapped for item in unwrapped.rows]

    def _request_id(self, index: int) -> str:
        get = getattr(self.context, "get_request_id", None)
        found = get(index) if callable(get) else None
        return str(found or "")

    def format_output(self, data: list[Any]) -> list[Any]:
        """One v2 response per request, from its share of the results."""
        return self._batch_to_json(data)

    def _batch_to_json(self, data: list[Any]) -> list[Any]:
        codec, answers, start = self._codec(), [], 0
        for unwrapped in getattr(self, "_unwrapped", []):
            count = len(unwrapped.rows)
            answers.append(codec.wrap(data[start:start + count], unwrapped, False))
            start += count
        return answers

    def _to_json(self, data: Any, input_name: str) -> dict[str, Any]:
        """One output: ``data`` flattened, named ``input_name``, with its v2 datatype."""
        return self._codec()._output(data, input_name)
