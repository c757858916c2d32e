"""The batcher's timer seam: ``call_later`` on the event loop, or on a simulated clock
(frontend/serving/simulation.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol


class Timer(Protocol):
    """A pending callback (asyncio's TimerHandle, or a simulated one)."""

    def cancel(self) -> None: ...


#: ``call_later(delay_s, callback)``: runs ``callback`` ``delay_s`` seconds from now, on the
#: clock the caller reads.
CallLater = Callable[[float, Callable[[], None]], Timer]


def loop_call_later(delay_s: float, callback: Callable[[], None]) -> Timer:
    """The running event loop's ``call_later``: the production timer."""
    return asyncio.get_running_loop().call_later(delay_s, callback)
