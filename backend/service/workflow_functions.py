"""A workflow's function node (a function of its ``.war`` handler file: ``file.py:function``),
offered whole batches until it shows it takes one request at a time.

TorchServe calls a workflow's functions with a list of one request. Here a function node is a
model like any other and its calls are batched, so ``adapt`` gives the worker a ``handle``
that offers each batch to the function whole, until the function answers a batch of several
requests with other than one result per request (a function written for TorchServe's batches
of one). That batch, and every batch after it, is then run one request per call: the function
gets a list of that request alone and a context whose request 0 is that request
(``OneRequestContext``), and each request is answered with its own result, or its own error.
A batch that has streamed intermediate responses is never run again: its answer stands as the
function gave it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from backend.context import Context, OneRequestContext
from backend.errors import BatchSizeMismatch, InvalidHandlerOutput, describe
from backend.service.loader import EntryPoint, one_result_each

logger = logging.getLogger(__name__)


def adapt(entry_point: EntryPoint) -> EntryPoint:
    """``entry_point`` (a workflow's function node) offered batches whole, then one request
    at a time if it does not take them."""
    return EntryPoint(FunctionNode(entry_point), entry_point.name)


class FunctionNode:
    """The ``handle`` of a workflow's function node (see the module's docstring)."""

    def __init__(self, entry_point: EntryPoint) -> None:
        self._handle: Callable[[Any, Any], Any] = entry_point.handle
        self._name = entry_point.name
        #: Whether the function has shown that it takes one request at a time.
        self.per_request = False
        # What the service reads of a handler (its instance, ``__self__``), and the function's
        # own name and module, as the function has them.
        self.__self__ = getattr(entry_point.handle, "__self__", None)
        functools.update_wrapper(self, entry_point.handle)

    def __call__(self, data: Any, context: Context) -> Any:
        if data is None:  # not a batch: the function's initialising call
            return self._handle(data, context)
        if self.per_request:
            return self._one_at_a_time(data, context)
        results = self._handle(data, context)
        if len(data) < 2 or context.partials_sent:
            return results
        try:
            one_result_each(results, len(data), self._name)
        except (BatchSizeMismatch, InvalidHandlerOutput) as exc:
            logger.info("%s answered a batch of %d with %s; calling it one request at a time "
                        "from now on", self._name, len(data), describe(exc))
            self.per_request = True
            return self._one_at_a_time(data, context)
        return results

    def _one_at_a_time(self, data: list[Any], context: Context) -> list[Any]:
        """One call per request; each answered with its own result or error."""
        results: list[Any] = []
        for idx, row in enumerate(data):
            try:
                answer = self._handle([row], OneRequestContext(context, idx))
                results.append(one_result_each(answer, 1, self._name)[0])
            except Exception as exc:  # this request's failure alone
                results.append(exc)
        return results
