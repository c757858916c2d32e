"""``ts.utils.timeit_decorator``: print how long a function takes, in wall and CPU time.

TorchServe's used ``time.clock``, which Python 3.8 removed; this one measures with
``time.perf_counter`` and ``time.process_time``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def timeit(func: Callable[..., T]) -> Callable[..., T]:
    """Decorate ``func`` so each call prints its wall-clock and CPU seconds."""

    @functools.wraps(func)
    def time_and_log(*args: Any, **kwargs: Any) -> T:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return func(*args, **kwargs)
        finally:
            print(f"func: {func.__name__!r} took a total of {time.perf_counter() - wall:2.4f} "
                  f"sec to run and {time.process_time() - cpu:2.4f} sec of CPU time")

    return time_and_log
