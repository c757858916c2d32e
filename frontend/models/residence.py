"""One model version's residency, with residency limits on (docs/residency.md): whether its
workers run (its state), when it was last asked for, whether it may be paged out, what it
takes in memory, and its page-ins so far. The manager (frontend/models/residency.py) changes
it; the model (frontend/models/model.py) notes each request in it and asks for a page-in when
a request finds it without workers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Its states, as describe and the live page show them.
LOADED = "loaded"
LOADING = "loading"
PAGED_OUT = "paged_out"
EVICTING = "evicting"
STATES = (LOADED, LOADING, PAGED_OUT, EVICTING)


#: How fast a model's heat (its requests lately) cools: halved every this many seconds.
HEAT_HALF_LIFE_S = 10.0


@dataclass(slots=True, eq=False)
class Residence:
    """A model version's residency (see the module's text)."""

    #: Always loaded (``pinned: true``, or workers the operator asked for).
    pinned: bool
    #: What its weights take in host memory, and on the GPUs when its workers run there.
    memory_bytes: int
    #: Asks the manager to page it in, for the request whose answer is this future (set by
    #: the manager when it takes the model on).
    page_in: Callable[[asyncio.Future[Any]], None] = field(default=lambda _: None)
    state: str = PAGED_OUT
    #: time.time() of its last request (None: none yet), and of when it last became resident
    #: (the least recently used order counts a model never asked for from then).
    last_used: float | None = None
    #: time.time() of the request before its last (None: fewer than two so far).
    used_before: float | None = None
    resident_since: float = field(default_factory=time.time)
    page_ins: int = 0
    evictions: int = 0
    #: Milliseconds from the request that paged it in to that request's answer (None: none).
    last_page_in_ms: float | None = None
    #: Its requests lately: each adds 1, halved every ``HEAT_HALF_LIFE_S`` (``heat``).
    _heat: float = 0.0

    @property
    def is_resident(self) -> bool:
        """Its workers run or are starting or stopping: it counts in the limits."""
        return self.state != PAGED_OUT

    def used(self, now: float) -> None:
        """A request for it came at ``now`` (time.time())."""
        self._heat = self.heat(now) + 1.0
        self.used_before, self.last_used = self.last_used, now

    def heat(self, now: float) -> float:
        """Its requests lately, at ``now``: each counts 1 when it comes, half as much
        ``HEAT_HALF_LIFE_S`` later, and so on."""
        if self.last_used is None:
            return 0.0
        return float(self._heat * 0.5 ** (max(0.0, now - self.last_used) / HEAT_HALF_LIFE_S))

    @property
    def recency(self) -> tuple[float, float]:
        """Its place in the eviction order, smaller first: least recently used by its request
        before last (LRU-2, O'Neil, O'Neil and Weikum 1993), then by its last. A model asked
        once lately (paged in for one request) goes before one asked again and again, whose
        clients may just be waiting elsewhere: plain LRU would evict the hot models then."""
        last = self.last_used if self.last_used is not None else self.resident_since
        before = self.used_before if self.used_before is not None else float("-inf")
        return before, last

    def fields(self) -> dict[str, object]:
        """As describe shows it."""
        return {
            "state": self.state,
            "lastUsed": None if self.last_used is None else iso_time(self.last_used),
            "pinned": self.pinned,
            "memoryBytes": self.memory_bytes,
            "pageIns": self.page_ins,
            "evictions": self.evictions,
            "lastPageInMs": None if self.last_page_in_ms is None
            else round(self.last_page_in_ms, 3),
        }


def iso_time(seconds: float) -> str:
    """time.time() as describe writes times (UTC, milliseconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + \
        f".{int(seconds * 1000) % 1000:03d}Z"
