"""The function nodes of the workflow benchmark (one handler file for both of its workflows).

* sequential: ``pre`` -> ``classifier`` (a model) -> ``post``
* parallel: ``pre`` -> (``classifier_a``, ``classifier_b``) -> ``ensemble``

TorchServe's function contract: ``function(data, context)`` gets a batch (a list of input
dicts; ``None`` once at load time) and answers one item per input. ``pre`` takes the request
(``{"features": [64 numbers]}``, JSON) and hands on the standardised features; ``post`` turns
the classifier's probabilities into the top label and its score; ``ensemble`` gets one input
per parent, named after the parent node (TorchServe's naming), averages their probabilities
and answers the top label, its score and each branch's vote. Scores are rounded to 4 places,
so that the answer does not depend on the batch a request shared (float sums can differ in
their last bits from one batch size to another).
"""

from __future__ import annotations

import json
import math
from typing import Any

LABELS = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
          "truck")
FEATURES = 64


def _decoded(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8")
    if isinstance(value, str):
        value = json.loads(value)
    return value


def _request(row: dict[str, Any]) -> list[float]:
    value = _decoded(row.get("data") if row.get("data") is not None else row.get("body"))
    features = value.get("features") if isinstance(value, dict) else value
    if not isinstance(features, list) or len(features) != FEATURES:
        raise ValueError(f'expected {{"features": [{FEATURES} numbers]}}')
    return [float(x) for x in features]


def _top(probabilities: list[float]) -> tuple[str, float]:
    best = max(range(len(probabilities)), key=probabilities.__getitem__)
    return LABELS[best], round(probabilities[best], 4)


def pre(data: list[dict[str, Any]] | None, context: Any) -> list[list[float]] | None:
    if data is None:
        return None
    out = []
    for row in data:
        features = _request(row)
        mean = sum(features) / len(features)
        deviation = math.sqrt(sum((x - mean) ** 2 for x in features) / len(features)) or 1.0
        out.append([round((x - mean) / deviation, 6) for x in features])
    return out


def post(data: list[dict[str, Any]] | None, context: Any) -> list[dict[str, Any]] | None:
    if data is None:
        return None
    out = []
    for row in data:
        label, score = _top(_decoded(row["body"]))
        out.append({"label": label, "score": score})
    return out


def ensemble(data: list[dict[str, Any]] | None, context: Any) -> list[dict[str, Any]] | None:
    if data is None:
        return None
    out = []
    for row in data:
        branches = {parent: _decoded(value) for parent, value in sorted(row.items())}
        mean = [sum(column) / len(branches) for column in zip(*branches.values(), strict=True)]
        label, score = _top(mean)
        out.append({"label": label, "score": score,
                    "votes": {parent: _top(p)[0] for parent, p in branches.items()}})
    return out
