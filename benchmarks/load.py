"""A closed-loop HTTP load generator: N clients, each sending its next request on an answer.

Keep-alive connections (http.client), bounded in time and in count, loopback only.
"""

from __future__ import annotations

import http.client
import itertools
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

MAX_REQUESTS = 1_000_000


@dataclass
class LoadResult:
    concurrency: int
    duration_s: float
    latencies_s: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    #: When each successful answer arrived (time.monotonic()), whenever it was sent; and the
    #: measured window: for estimators that need more than the counts inside it.
    answered_at: list[float] = field(default_factory=list)
    window: tuple[float, float] = (0.0, 0.0)
    #: Latencies of the successful requests sent inside the window, answered in it or after
    #: (``latencies_s`` leaves out those answered after it: the slowest, when a request takes
    #: a sizeable part of the window).
    sent_latencies_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)

    @property
    def throughput(self) -> float:
        return self.ok / self.duration_s if self.duration_s else 0.0

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[index] * 1000

    def summary(self) -> str:
        return (f"{self.throughput:8.1f} req/s  p50 {self.percentile_ms(50):7.1f} ms  "
                f"p99 {self.percentile_ms(99):7.1f} ms  mean "
                f"{statistics.fmean(self.latencies_s) * 1000 if self.latencies_s else 0:7.1f} ms"
                f"  statuses {dict(sorted(self.statuses.items()))}")


def run_load(url: str, bodies: Sequence[bytes], *, concurrency: int, duration_s: float,
             warmup_s: float = 1.0, content_type: str = "application/octet-stream",
             max_requests: int = MAX_REQUESTS) -> LoadResult:
    """POST ``bodies`` (cycled) to ``url`` from ``concurrency`` clients for ``duration_s``."""
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError("load tests target loopback only")
    lock = threading.Lock()
    counter = itertools.count()
    start = time.monotonic() + warmup_s
    stop = start + duration_s
    result = LoadResult(concurrency, duration_s, window=(start, stop))

    def client(offset: int) -> None:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
        latencies: list[float] = []
        statuses: dict[int, int] = {}
        answered: list[float] = []
        sent_latencies: list[float] = []
        index = offset
        try:
            while True:
                now = time.monotonic()
                if now >= stop or next(counter) >= max_requests:
                    break
                body = bodies[index % len(bodies)]
                index += 1
                connection.request("POST", parts.path, body=body,
                                   headers={"Content-Type": content_type})
                response = connection.getresponse()
                response.read()
                done = time.monotonic()
                if response.status == 200:
                    answered.append(done)
                    if now >= start:
                        sent_latencies.append(done - now)
                if now >= start and done <= stop:
                    latencies.append(done - now)
                    statuses[response.status] = statuses.get(response.status, 0) + 1
        finally:
            connection.close()
            with lock:
                result.latencies_s.extend(latencies)
                result.answered_at.extend(answered)
                result.sent_latencies_s.extend(sent_latencies)
                for status, count in statuses.items():
                    result.statuses[status] = result.statuses.get(status, 0) + count

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return result
