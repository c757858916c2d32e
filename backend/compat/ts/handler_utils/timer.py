"""``ts.handler_utils.timer``: ``@timed`` records how long a handler method takes.

As in TorchServe, it only measures when the model's YAML config says
``handler: {profile: true}``; the time goes to ``context.metrics`` as ``ts_handler_<method>``,
in milliseconds.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def timed(func: Callable[..., T]) -> Callable[..., T]:
    """Decorate a handler method (``self`` first) so that profiling runs time it."""

    @functools.wraps(func)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
        context: Any = getattr(self, "context", None)
        if not is_profiling(context):
            return func(self, *args, **kwargs)
        _synchronize()
        start = time.perf_counter()
        result = func(self, *args, **kwargs)
        _synchronize()
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        context.metrics.add_time(f"ts_handler_{func.__name__}", elapsed_ms)
        return result

    return wrapper


def is_profiling(context: Any) -> bool:
    """Whether the model config asks for handler timings (``handler.profile``)."""
    config = getattr(context, "model_yaml_config", None)
    handler = config.get("handler") if isinstance(config, Mapping) else None
    return isinstance(handler, Mapping) and bool(handler.get("profile"))


def _synchronize() -> None:
    # CUDA kernels run asynchronously: without waiting, the clock would stop before the
    # method's GPU work is done. Never import torch (or start CUDA) just for this.
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()
