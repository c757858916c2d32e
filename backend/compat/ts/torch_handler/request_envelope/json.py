"""``ts.torch_handler.request_envelope.json``: TensorFlow Serving's JSON: each request
``{"instances": [...]}`` (``{"b64": ...}`` values decoded), the instances of all requests one
list of rows; each request answered with the text ``{"predictions": [...]}`` of its rows."""

from __future__ import annotations

import json
from itertools import chain
from typing import Any

from backend.codecs import envelopes

from .base import BaseEnvelope

__all__ = ["BaseEnvelope", "JSONEnvelope"]


class JSONEnvelope(BaseEnvelope):
    """Joins the requests' instances; splits the results back per request."""

    _lengths: list[int] = []  # replaced per batch, never mutated

    def parse_input(self, data: list[Any]) -> list[Any]:
        lengths, batch = self._batch_from_json(data)
        self._lengths = lengths
        return batch

    def format_output(self, data: list[Any]) -> list[str]:
        return self._batch_to_json(data, self._lengths)

    def _batch_from_json(self, data_rows: list[Any]) -> tuple[list[int], list[Any]]:
        """How many instances each request has, and all of them in order."""
        per_request = [self._from_json(row) for row in data_rows]
        return [len(rows) for rows in per_request], list(chain.from_iterable(per_request))

    def _from_json(self, data: Any) -> list[Any]:
        """One request's instances (InvalidInput when it has none)."""
        return envelopes.JsonEnvelope(self.context).unwrap(data, "").rows

    def _batch_to_json(self, batch: list[Any], lengths: list[int]) -> list[str]:
        answers, start = [], 0
        for length in lengths:
            answers.append(self._to_json(batch[start:start + length]))
            start += length
        return answers

    def _to_json(self, output: Any) -> str:
        return json.dumps({"predictions": output})
