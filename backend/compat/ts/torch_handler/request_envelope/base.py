"""``ts.torch_handler.request_envelope.base``: the envelope interface: ``handle`` unwraps the
batch (``parse_input``), calls the wrapped handler, and wraps its results
(``format_output``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any


class BaseEnvelope(ABC):
    """Wraps ``handle_fn(data, context)``; subclasses define the two conversions."""

    def __init__(self, handle_fn: Callable[[Any, Any], Any]) -> None:
        self._handle_fn = handle_fn
        self.context: Any = None

    def handle(self, data: Any, context: Any) -> Any:
        """Unwrapped data in, wrapped results out (an empty batch or result passes as it
        is)."""
        self.context = context
        if data:
            data = self.parse_input(data)
        results = self._handle_fn(data, context)
        if results:
            results = self.format_output(results)
        return results

    @abstractmethod
    def parse_input(self, data: Any) -> Any:
        """The batch's requests -> the handler's rows."""

    @abstractmethod
    def format_output(self, data: Any) -> Any:
        """The handler's results -> one answer per request."""
