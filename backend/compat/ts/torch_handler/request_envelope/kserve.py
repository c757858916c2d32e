"""``ts.torch_handler.request_envelope.kserve``: KServe v1: each request
``{"instances": [...]}``, the instances of all requests one list of rows; each request
answered ``{"predictions": [...]}`` (``{"explanations": [...]}`` for an explanation)."""

from __future__ import annotations

import logging
from itertools import chain
from typing import Any

from backend.codecs import envelopes

from .base import BaseEnvelope

__all__ = ["BaseEnvelope", "KServeEnvelope"]

logger = logging.getLogger(__name__)


class KServeEnvelope(BaseEnvelope):
    """KServe v1 around a handler, every request of a batch answered (TorchServe's reads
    the first request only)."""

    _lengths: list[int] = []  # replaced per batch, never mutated

    def parse_input(self, data: list[Any]) -> list[Any]:
        unwrap = envelopes.KServeEnvelope(self.context).unwrap
        per_request = [unwrap(row, "").rows for row in data]
        self._lengths = [len(rows) for rows in per_request]
        self._data_list = [row.get("data") or row.get("body") for row in data]
        self._inputs = list(chain.from_iterable(per_request))
        logger.debug("kserve parsed inputs %s", self._inputs)
        return self._inputs

    def format_output(self, data: list[Any]) -> list[dict[str, Any]]:
        key = "explanations" if self._is_explain() else "predictions"
        lengths = self._lengths or [len(data)]
        answers, start = [], 0
        for length in lengths:
            answers.append({key: data[start:start + length]})
            start += length
        return answers

    def _is_explain(self) -> bool:
        """Whether the batch's first request asks for an explanation (its ``explain``
        header); any context with ``get_request_header`` will do."""
        context = self.context
        if context is None or getattr(context, "request_processor", None) == []:
            return False
        return bool(context.get_request_header(0, "explain") == "True")
