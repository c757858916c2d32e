"""Where a handler's time on a batch goes: its preprocess, inference and postprocess steps.

A handler with the three steps (a BaseHandler-style class: ours, TorchServe's ``ts`` ones, a
user's subclass of either, or any class that has them) has each step timed where its own
``handle`` calls it: ``instrument`` puts a timing wrapper on the handler *instance* for each
step, so ``self.preprocess(data)`` inside ``handle`` goes through it, while the class, its
methods, the data and the results stay what they were (``super().preprocess`` and
``type(self).preprocess`` are not wrapped, so a step that calls its parent's is counted once).
A step that calls another step through ``self`` counts as the outer step only. A handler
without the three steps (a function, a class with only ``handle``, coroutine steps) is not
touched: its whole time is reported instead (``HandlerPhases.steps`` false).

On a GPU the inference step ends when its kernels have (the current stream is synchronised,
which the postprocess's copy to the host would wait for anyway), so that inference holds the
model's time rather than the postprocess that reads its output.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

STEPS = ("preprocess", "inference", "postprocess")


class StepClock:
    """Seconds spent in each step since the last ``reset`` (the outermost step call only)."""

    __slots__ = ("_depth", "called", "seconds")

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        #: A step was called since the last reset.
        self.called = False
        self._depth = 0

    def reset(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.called = False
        self._depth = 0

    def wrap(self, index: int, step: Callable[..., Any]) -> Callable[..., Any]:
        """``step`` (a bound method), timed into ``seconds[index]``."""
        clock = self
        synchronize = index == 1

        @functools.wraps(step)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if clock._depth:
                return step(*args, **kwargs)
            clock._depth = 1
            start = time.perf_counter()
            try:
                result = step(*args, **kwargs)
                if synchronize:
                    _synchronize()
                return result
            finally:
                clock.seconds[index] += time.perf_counter() - start
                clock.called = True
                clock._depth = 0

        return timed


def instrument(handler: object) -> StepClock | None:
    """Time ``handler``'s three steps (see the module docstring); None when it has not all
    three as plain methods, or they cannot be wrapped on the instance."""
    if handler is None:
        return None
    steps: list[Callable[..., Any]] = []
    for name in STEPS:
        step = getattr(handler, name, None)
        if not inspect.ismethod(step) or inspect.iscoroutinefunction(step):
            return None
        steps.append(step)
    clock = StepClock()
    try:
        for index, (name, step) in enumerate(zip(STEPS, steps, strict=True)):
            setattr(handler, name, clock.wrap(index, step))
    except (AttributeError, TypeError):  # __slots__ without __dict__, a read-only property
        if hasattr(handler, "__dict__"):
            for name in STEPS:
                vars(handler).pop(name, None)
        logger.info("%s: its steps cannot be timed one by one", type(handler).__name__)
        return None
    return clock


def _synchronize() -> None:
    """Wait for the current CUDA stream, where CUDA is in use (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
