"""Explanations, as TorchServe's handlers give them: Captum's IntegratedGradients over the
preprocessed input.

A request asks for an explanation instead of a prediction through TorchServe's ``explain``
request header (``True``), which the frontend sets for ``/explanations``, KServe v1's
``:explain`` and v2's ``/explain``. Captum is an optional dependency (``batchserve[explain]``),
imported on the first explanation only: without it an explanation answers 501
(``Unsupported``) and predictions are unaffected.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from backend.context import EXPLAIN_HEADER, Context
from backend.errors import InvalidInput, Unsupported

#: Integration steps, as TorchServe's vision handler takes them.
N_STEPS = 15


def is_explanation(context: Context | None) -> bool:
    """Whether the batch asks for explanations (its first request's header, as TorchServe
    reads it; the worker never mixes explanations and predictions in one batch)."""
    if context is None or not context.request_processor:
        return False
    return context.get_request_header(0, EXPLAIN_HEADER) == "True"


def explanation_target(row: Any) -> int:
    """The class a request wants explained: its ``target`` (a form field, or a key of its JSON
    body or KServe instance), 0 when it names none, as in TorchServe."""
    value = None
    if isinstance(row, Mapping):
        value = row.get("target")
        body = row.get("data") or row.get("body")
        if value is None and isinstance(body, Mapping):
            value = body.get("target")
    if isinstance(value, (bytes, bytearray)):  # a form field
        value = bytes(value).decode("ascii", "replace")
    if value is None or value == "":
        return 0
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"target must be a class index, got {value!r}")
    return value


def integrated_gradients(model: torch.nn.Module, inputs: torch.Tensor,
                         target: int | Sequence[int]) -> torch.Tensor:
    """IntegratedGradients attributions of ``model``'s ``target`` class(es) over ``inputs``
    (``[N, ...]``; one target for all rows or one per row): a tensor of the inputs' shape.

    The steps run in chunks of at least one batch, so a large batch does not hold every
    step's activations at once. Raises ``Unsupported`` when Captum is not installed, and
    ``InvalidInput`` for a target the model has no class for.
    """
    try:
        from captum.attr import IntegratedGradients
    except ImportError:
        raise Unsupported(
            "explanations need Captum, which is not installed where this model's workers "
            "run: pip install captum (or batchserve[explain]), then restart the server"
        ) from None
    rows = int(inputs.shape[0])
    targets = [target] * rows if isinstance(target, int) else list(target)
    classes = _class_count(model, inputs[:1])
    wrong = [t for t in targets if not 0 <= t < classes]
    if wrong:
        raise InvalidInput(f"target {wrong[0]} is not a class of this model (it has "
                           f"{classes}: 0..{classes - 1})")
    attributions: torch.Tensor = IntegratedGradients(model).attribute(
        inputs, target=targets, n_steps=N_STEPS, internal_batch_size=max(rows, N_STEPS))
    return attributions.detach()


def _class_count(model: torch.nn.Module, sample: torch.Tensor) -> int:
    with torch.inference_mode():
        output = model(sample)
    if not isinstance(output, torch.Tensor) or output.dim() != 2:
        raise Unsupported("IntegratedGradients explains models that return [N, classes] "
                          "scores; this one does not")
    return int(output.shape[1])
