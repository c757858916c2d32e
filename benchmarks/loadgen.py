"""An asyncio load generator for batchserve (and TorchServe): keep-alive HTTP/1.1 and gRPC.

Two modes:

* **closed loop**: ``clients`` concurrent clients, each sending its next request as soon as it
  has its answer (what `hey`, `wrk` and most benchmarks do). It measures capacity.
* **open loop**: requests arrive as a Poisson process at ``rate`` per second whatever the
  server does, with at most ``max_in_flight`` requests outstanding; an arrival that finds the
  limit reached is not sent and is counted as ``skipped``. It measures latency at a given load.
  Arrivals never wait for answers, so latency is measured from the moment a request leaves;
  how late it left against its Poisson schedule (timer resolution, a busy client) is reported
  apart as the send lag.

Each run has a warm-up (sent, not recorded) and then a measured window of ``duration_s``.
Every request sent in the window is awaited after the window closes (up to the request
timeout) and its latency and status counted: late responses are not dropped. Throughput counts
the successful responses that arrived inside the window, whenever they were sent. Latency
percentiles are over successful responses; failures are counted by status (HTTP code, gRPC
code name, or ``connect``/``reset``/``protocol``/``timeout``).

The batch-size distribution comes from the server's Prometheus metrics (batchserve's
``batchserve_batch_size`` histogram, scraped before and after a run) and, for handlers that
send it, from an ``X-Batch-Size`` response header.

Only loopback addresses may be targeted, and every run is bounded in time.

    .venv/bin/python -m benchmarks.loadgen http://127.0.0.1:8080/predictions/echo \\
        --clients 16 --duration 10
    .venv/bin/python -m benchmarks.loadgen http://127.0.0.1:8080/predictions/echo \\
        --rate 500 --duration 10 --metrics http://127.0.0.1:8082/metrics --model echo
    .venv/bin/python -m benchmarks.loadgen grpc://127.0.0.1:7070/echo --clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import math
import random
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import httptools

#: Timestamps: uvloop's loop.time() has millisecond resolution, too coarse for latencies.
clock = time.perf_counter
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
#: Seconds a request may take before it counts as a ``timeout`` failure.
REQUEST_TIMEOUT_S = 60.0
#: Slack, past warm-up + window + one request timeout, before a run is cut short.
DRAIN_S = 30.0
#: Hard bounds on one run, whatever the arguments say.
MAX_DURATION_S = 3600.0
MAX_CLIENTS = 4096
MAX_REQUESTS = 10_000_000
#: Outcomes with no answer from the server; a closed-loop client pauses after one.
CONNECTION_FAILURES = frozenset({"connect", "reset", "protocol"})
FAILURE_PAUSE_S = 0.01


def check_loopback(host: str | None) -> str:
    if host not in LOOPBACK:
        raise ValueError(f"load is only sent to loopback addresses, not {host!r}")
    return host


# -- results ----------------------------------------------------------------------------------


@dataclass
class BatchSizes:
    """How many batches of each size a server dispatched during a run.

    ``buckets`` maps a label ("1", "2", "3-4", "5-8", ... for histogram buckets, or exact
    sizes) to a number of batches; ``mean`` is requests per batch.
    """

    batches: int = 0
    requests: int = 0
    buckets: dict[str, int] = field(default_factory=dict)
    source: str = ""

    @property
    def mean(self) -> float:
        return self.requests / self.batches if self.batches else math.nan

    def describe(self) -> str:
        if not self.batches:
            return ""
        shares = ((label, 100 * count / self.batches) for label, count in self.buckets.items())
        return " ".join(f"{label}:{share:.0f}%" if share >= 0.5 else f"{label}:<1%"
                        for label, share in shares if share > 0)


@dataclass
class LoadResult:
    """What one run measured."""

    mode: str  # "closed" or "open"
    duration_s: float
    clients: int = 0  # closed loop
    offered_rate: float = 0.0  # open loop, requests per second asked for
    sent: int = 0  # requests sent in the window
    completed_in_window: int = 0  # successful answers that arrived inside the window
    skipped: int = 0  # open loop: arrivals not sent because max_in_flight were outstanding
    latencies_s: list[float] = field(default_factory=list)  # successful requests only
    lags_s: list[float] = field(default_factory=list)  # open loop: sent later than scheduled
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    header_batch_sizes: collections.Counter[int] = field(default_factory=collections.Counter)
    batch_sizes: BatchSizes | None = None
    client_cpu: float = 0.0  # CPU seconds the generator used per second of the run

    @property
    def ok(self) -> int:
        return sum(count for status, count in self.statuses.items() if _is_ok(status))

    @property
    def errors(self) -> dict[str, int]:
        return {status: count for status, count in sorted(self.statuses.items())
                if not _is_ok(status)}

    @property
    def throughput(self) -> float:
        """Successful answers per second, counted inside the window."""
        return self.completed_in_window / self.duration_s if self.duration_s else 0.0

    @property
    def achieved_rate(self) -> float:
        """Requests per second actually sent in the window (open loop: compare with offered)."""
        return self.sent / self.duration_s if self.duration_s else 0.0

    def percentile_ms(self, q: float) -> float:
        """The q-th percentile of the successful requests' latency, in ms."""
        return percentile(self.latencies_s, q) * 1000

    def lag_ms(self, q: float) -> float:
        """Open loop: the q-th percentile of how late requests left, against the schedule."""
        return percentile(self.lags_s, q) * 1000

    def batch_sizes_from_headers(self) -> BatchSizes | None:
        """Batch sizes from ``X-Batch-Size``: a batch of n is seen by n requests."""
        if not self.header_batch_sizes:
            return None
        sizes = BatchSizes(source="header")
        for size in sorted(self.header_batch_sizes):
            batches = self.header_batch_sizes[size] / size
            sizes.buckets[str(size)] = round(batches)
            sizes.batches += round(batches)
            sizes.requests += self.header_batch_sizes[size]
        return sizes

    def best_batch_sizes(self) -> BatchSizes | None:
        return self.batch_sizes if self.batch_sizes and self.batch_sizes.batches \
            else self.batch_sizes_from_headers()

    def summary(self) -> str:
        load = (f"{self.clients} clients" if self.mode == "closed"
                else f"offered {self.offered_rate:.1f}/s achieved {self.achieved_rate:.1f}/s")
        text = (f"{load}: {self.throughput:.1f} ok/s  p50 {self.percentile_ms(50):.2f} ms  "
                f"p90 {self.percentile_ms(90):.2f} ms  p99 {self.percentile_ms(99):.2f} ms  "
                f"statuses {dict(sorted(self.statuses.items()))}")
        if self.skipped:
            text += f"  skipped {self.skipped}"
        if self.lags_s:
            text += f"  send lag p99 {self.lag_ms(99):.2f} ms"
        sizes = self.best_batch_sizes()
        if sizes is not None:
            text += f"  batches mean {sizes.mean:.2f} [{sizes.describe()}] ({sizes.source})"
        return text + f"  client CPU {self.client_cpu:.0%}"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile by nearest rank (a value that was measured); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def _is_ok(status: str) -> bool:
    return status == "OK" or (status.isdigit() and 200 <= int(status) < 300)


# -- HTTP/1.1 client --------------------------------------------------------------------------


class HttpError(Exception):
    """A failure with no HTTP status: the ``kind`` is what the result counts it as."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class _Response:
    __slots__ = ("batch_size", "body_bytes", "status")

    def __init__(self, status: int, batch_size: int | None, body_bytes: int) -> None:
        self.status = status
        self.batch_size = batch_size
        self.body_bytes = body_bytes


class HttpConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time, responses parsed by httptools.

    httptools (llhttp) frames the body by Content-Length or chunked encoding; interim (1xx)
    responses are skipped; a response framed by the connection's end is completed on EOF. The
    body is counted, not kept.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[_Response] | None = None
        self._batch_size: int | None = None
        self._header_name = b""
        self._body_bytes = 0
        self._framed = False
        self._headers_done = False
        self.closed = False

    @classmethod
    async def open(cls, host: str, port: int) -> HttpConnection:
        loop = asyncio.get_running_loop()
        try:
            _, protocol = await loop.create_connection(cls, check_loopback(host), port)
        except OSError as error:
            raise HttpError("connect", str(error)) from None
        return protocol

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(HttpError("protocol", "unexpected upgrade"))
        except httptools.HttpParserError as error:
            self._fail(HttpError("protocol", str(error)))

    def eof_received(self) -> bool:
        if self._headers_done and not self._framed and self._waiter is not None:
            self.on_message_complete()  # a body that ends with the connection
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(HttpError("reset", str(exc) if exc else "connection closed"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._batch_size = None
        self._body_bytes = 0
        self._framed = False
        self._headers_done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"x-batch-size":
            with contextlib.suppress(ValueError):
                self._batch_size = int(value)
        elif lowered in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            return  # an interim response (100 Continue): the real one follows
        if not self._parser.should_keep_alive():
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(_Response(status, self._batch_size, self._body_bytes))

    def _fail(self, error: HttpError) -> None:
        self.closed = True
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        if self.transport is not None:
            self.transport.close()

    async def request(self, payload: bytes) -> _Response:
        """Send one complete request (head and body) and wait for its response."""
        if self.closed or self.transport is None:
            raise HttpError("reset", "connection closed")
        if self._waiter is not None:
            raise RuntimeError("one request at a time per connection")
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(payload)
        return await self._waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def http_request(host: str, port: int, path: str, body: bytes, content_type: str,
                 headers: dict[str, str] | None = None) -> bytes:
    """The bytes of one keep-alive POST."""
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# -- targets ----------------------------------------------------------------------------------


Outcome = tuple[str, int | None]  # (status, X-Batch-Size or None)


class Sender(Protocol):
    """One client's way of sending one request at a time."""

    async def send(self) -> Outcome: ...

    def close(self) -> None: ...


class Target:
    """Where requests go; ``sender(i)`` makes client i's ``Sender``."""

    label = ""

    async def open(self) -> None:
        """Set up what all clients share (gRPC channels)."""

    async def close(self) -> None:
        """Release what ``open`` set up."""

    def sender(self, index: int) -> Sender:
        raise NotImplementedError


class _HttpSender:
    """A client with its own keep-alive connection, reopened when the server closes it."""

    __slots__ = ("connection", "host", "payloads", "port")

    def __init__(self, host: str, port: int, payloads: Sequence[bytes], offset: int) -> None:
        self.host, self.port = host, port
        offset %= len(payloads)
        self.payloads = itertools.cycle([*payloads[offset:], *payloads[:offset]])
        self.connection: HttpConnection | None = None

    async def send(self) -> Outcome:
        try:
            if self.connection is None or self.connection.closed:
                self.connection = await HttpConnection.open(self.host, self.port)
            response = await self.connection.request(next(self.payloads))
        except HttpError as error:
            self.close()
            return error.kind, None
        except asyncio.CancelledError:
            self.close()  # the answer may still come: this connection is out of step
            raise
        return str(response.status), response.batch_size

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()
            self.connection = None


class HttpTarget(Target):
    """POST the bodies (cycled) to a URL over keep-alive connections, one per client."""

    def __init__(self, url: str, bodies: Sequence[bytes],
                 content_type: str = "application/octet-stream",
                 headers: dict[str, str] | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"expected an http:// URL, got {url!r}")
        self.host = check_loopback(parts.hostname)
        self.port = parts.port or 80
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        self.payloads = [http_request(self.host, self.port, path, body, content_type, headers)
                         for body in bodies]
        self.label = url

    def sender(self, index: int) -> Sender:
        return _HttpSender(self.host, self.port, self.payloads, index)


class _GrpcSender:
    __slots__ = ("requests", "stub")

    def __init__(self, stub: Any, requests: Sequence[Any], offset: int) -> None:
        self.stub = stub
        offset %= len(requests)
        self.requests = itertools.cycle([*requests[offset:], *requests[:offset]])

    async def send(self) -> Outcome:
        import grpc

        try:
            await self.stub.Predictions(next(self.requests), timeout=REQUEST_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            return error.code().name, None
        return "OK", None

    def close(self) -> None:
        pass  # the channels belong to the target


class GrpcTarget(Target):
    """TorchServe's ``InferenceAPIsService.Predictions`` over ``channels`` HTTP/2 connections."""

    def __init__(self, host: str, port: int, model_name: str, bodies: Sequence[bytes],
                 model_version: str = "", channels: int = 1) -> None:
        self.address = f"{check_loopback(host)}:{port}"
        self.model_name = model_name
        self.model_version = model_version
        self.bodies = list(bodies)
        self.channel_count = max(1, channels)
        self.channels: list[Any] = []
        self.stubs: list[Any] = []
        self.requests: list[Any] = []
        self.label = f"grpc://{self.address}/{model_name}"

    async def open(self) -> None:
        import grpc

        from protos import inference_pb2, inference_pb2_grpc

        self.requests = [inference_pb2.PredictionsRequest(
            model_name=self.model_name, model_version=self.model_version, input={"body": body})
            for body in self.bodies]
        for _ in range(self.channel_count):
            # A local subchannel pool: each channel gets its own connection.
            channel = grpc.aio.insecure_channel(
                self.address, options=[("grpc.use_local_subchannel_pool", 1)])
            self.channels.append(channel)
            self.stubs.append(inference_pb2_grpc.InferenceAPIsServiceStub(channel))

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()
        self.channels.clear()
        self.stubs.clear()

    def sender(self, index: int) -> Sender:
        return _GrpcSender(self.stubs[index % len(self.stubs)], self.requests, index)


# -- the two loops ----------------------------------------------------------------------------


class _Recorder:
    """Counts what happened to requests; shared by the clients of one run."""

    def __init__(self, result: LoadResult, start: float, stop: float) -> None:
        self.result = result
        self.start = start
        self.stop = stop
        self.total_sent = 0  # warm-up included, for the progress bar
        self.total_ok = 0

    def record(self, scheduled: float, outcome: Outcome, done: float,
               sent: float | None = None) -> None:
        status, batch_size = outcome
        ok = _is_ok(status)
        self.total_ok += ok
        result = self.result
        if ok and self.start <= done < self.stop:
            # Throughput: answers inside the window, whenever they were sent.
            result.completed_in_window += 1
        if not self.start <= scheduled < self.stop:
            return
        # Latency and statuses: requests sent inside the window, whenever answered.
        result.statuses[status] += 1
        if sent is not None:
            result.lags_s.append(sent - scheduled)
        if ok:
            result.latencies_s.append(done - (scheduled if sent is None else sent))
            if batch_size is not None:
                result.header_batch_sizes[batch_size] += 1


async def _timed(sender: Sender, timeout_s: float) -> Outcome:
    try:
        return await asyncio.wait_for(sender.send(), timeout_s)
    except asyncio.TimeoutError:
        return "timeout", None


async def _closed_loop(target: Target, recorder: _Recorder, clients: int, first: float,
                       stop: float, max_requests: int, timeout_s: float) -> None:
    budget = itertools.count()

    async def client(index: int) -> None:
        sender = target.sender(index)
        try:
            while True:
                now = clock()
                if now >= stop or next(budget) >= max_requests:
                    return
                recorder.total_sent += 1
                if recorder.start <= now:
                    recorder.result.sent += 1
                outcome = await _timed(sender, timeout_s)
                recorder.record(now, outcome, clock())
                if outcome[0] in CONNECTION_FAILURES:
                    await asyncio.sleep(FAILURE_PAUSE_S)  # no reconnection storm
        finally:
            sender.close()

    await asyncio.sleep(max(0.0, first - clock()))
    await asyncio.gather(*(client(i) for i in range(clients)))


async def _open_loop(target: Target, recorder: _Recorder, rate: float, max_in_flight: int,
                     first: float, stop: float, max_requests: int, seed: int,
                     timeout_s: float) -> None:
    rng = random.Random(seed)
    idle: list[Sender] = []  # connections with nothing outstanding, reused before new ones
    senders: list[Sender] = []
    tasks: set[asyncio.Task[None]] = set()
    in_flight = 0

    async def one(sender: Sender, scheduled: float) -> None:
        nonlocal in_flight
        try:
            sent = clock()
            outcome = await _timed(sender, timeout_s)
            recorder.record(scheduled, outcome, clock(), sent)
        finally:
            in_flight -= 1
            idle.append(sender)

    scheduled = first
    unyielded = 0
    try:
        for _ in range(max_requests):
            scheduled += rng.expovariate(rate)
            if scheduled >= stop:
                break
            delay = scheduled - clock()
            if delay > 0 or unyielded >= 32:
                # NOTE: a generator that has fallen behind its schedule still yields now and
                # then, or no answer would be read while it catches up.
                await asyncio.sleep(max(delay, 0.0))
                unyielded = 0
            else:
                unyielded += 1
            if in_flight >= max_in_flight:
                if scheduled >= recorder.start:
                    recorder.result.skipped += 1
                continue
            if idle:
                sender = idle.pop()
            else:
                sender = target.sender(len(senders))
                senders.append(sender)
            in_flight += 1
            recorder.total_sent += 1
            if scheduled >= recorder.start:
                recorder.result.sent += 1
            task = asyncio.ensure_future(one(sender, scheduled))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks))  # the late answers: bounded by the request timeout
    finally:
        for task in list(tasks):
            task.cancel()
        for sender in senders:
            sender.close()


async def _scrape_window(metrics_url: str, start: float, stop: float,
                         scrapes: list[dict[str, Histogram]]) -> None:
    """Scrape the batch-size histograms when the window opens and when it closes."""
    for moment in (start, stop):
        await asyncio.sleep(max(0.0, moment - clock()))
        scrapes.append(await asyncio.to_thread(scrape_batch_sizes, metrics_url))


async def run_load(target: Target, *, clients: int | None = None, rate: float | None = None,
                   duration_s: float = 10.0, warmup_s: float = 2.0, max_in_flight: int = 256,
                   max_requests: int = MAX_REQUESTS, seed: int = 0, progress: bool = True,
                   label: str = "", metrics_url: str | None = None,
                   model: str | None = None,
                   request_timeout_s: float = REQUEST_TIMEOUT_S) -> LoadResult:
    """Drive ``target`` closed-loop (``clients``) or open-loop (``rate`` per second).

    A request unanswered after ``request_timeout_s`` counts as a ``timeout``.

    With ``metrics_url`` and ``model``, the batch sizes that batchserve dispatched for
    ``model`` during the window are read from its metrics into ``result.batch_sizes``.
    """
    if (clients is None) == (rate is None):
        raise ValueError("give either clients (closed loop) or rate (open loop)")
    if not 0 < duration_s <= MAX_DURATION_S or not 0 <= warmup_s <= MAX_DURATION_S:
        raise ValueError(f"duration and warm-up must be within (0, {MAX_DURATION_S}] s")
    if clients is not None and not 1 <= clients <= MAX_CLIENTS:
        raise ValueError(f"clients must be within 1..{MAX_CLIENTS}")
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        raise ValueError("rate must be a positive number of requests per second")
    if not 0 < request_timeout_s <= REQUEST_TIMEOUT_S:
        raise ValueError(f"request_timeout_s must be within (0, {REQUEST_TIMEOUT_S:g}] s")
    if not 1 <= max_in_flight <= MAX_CLIENTS:
        raise ValueError(f"max_in_flight must be within 1..{MAX_CLIENTS}")
    max_requests = min(max_requests, MAX_REQUESTS)
    if clients is not None:
        result = LoadResult("closed", duration_s, clients=clients)
    else:
        result = LoadResult("open", duration_s, offered_rate=float(rate or 0.0))
    await target.open()
    first = clock() + 0.01
    start = first + warmup_s
    stop = start + duration_s
    recorder = _Recorder(result, start, stop)
    bar = _progress(label or target.label, warmup_s + duration_s, progress)
    ticker = asyncio.ensure_future(_tick(bar, recorder, first, stop))
    scrapes: list[dict[str, Histogram]] = []
    scraper = (asyncio.ensure_future(_scrape_window(metrics_url, start, stop, scrapes))
               if metrics_url and model else None)
    cpu_before, wall_before = time.process_time(), time.monotonic()
    try:
        if clients is not None:
            work = _closed_loop(target, recorder, clients, first, stop, max_requests,
                                request_timeout_s)
        else:
            work = _open_loop(target, recorder, float(rate or 0.0), max_in_flight, first, stop,
                              max_requests, seed, request_timeout_s)
        # Bounded: warm-up, window, then the late answers (each bounded by its own timeout).
        await asyncio.wait_for(work, warmup_s + duration_s + request_timeout_s + DRAIN_S)
        if scraper is not None:
            await asyncio.wait_for(scraper, DRAIN_S)
    finally:
        for task in (ticker, scraper):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if bar is not None:
            bar.close()
        await target.close()
    result.client_cpu = (time.process_time() - cpu_before) / max(
        time.monotonic() - wall_before, 1e-9)
    if len(scrapes) == 2 and model:
        result.batch_sizes = batch_size_delta(scrapes[0].get(model), scrapes[1].get(model))
    return result


def _progress(label: str, total_s: float, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=round(total_s, 1), desc=label[:48], unit="s", file=sys.stderr,
                leave=False, mininterval=0.5, dynamic_ncols=True,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s "
                           "{postfix}")


async def _tick(bar: Any, recorder: _Recorder, first: float, stop: float) -> None:
    if bar is None:
        return
    while True:
        now = clock()
        bar.n = round(min(max(now - first, 0.0), stop - first), 1)
        bar.set_postfix_str(f"sent {recorder.total_sent} ok {recorder.total_ok}", refresh=False)
        bar.refresh()
        await asyncio.sleep(0.5)


def run(target: Target, **kwargs: Any) -> LoadResult:
    """``run_load`` in a fresh event loop (uvloop for HTTP; gRPC keeps asyncio's own loop)."""
    if isinstance(target, HttpTarget):
        try:
            import uvloop

            return uvloop.run(run_load(target, **kwargs))
        except ImportError:
            pass
    return asyncio.run(run_load(target, **kwargs))


# -- batch sizes from the server's metrics ----------------------------------------------------


Histogram = dict[str, float]  # "le" bound ("1.0", ..., "+Inf") -> cumulative count; also "sum"


def scrape_batch_sizes(metrics_url: str, timeout_s: float = 10.0) -> dict[str, Histogram]:
    """``batchserve_batch_size`` per model (summed over versions) from a Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    check_loopback(urlsplit(metrics_url).hostname)
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
        text = response.read().decode()
    models: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "batchserve_batch_size":
            continue
        for sample in family.samples:
            model = sample.labels.get("model_name", "")
            histogram = models.setdefault(model, {})
            if sample.name.endswith("_bucket"):
                key = sample.labels["le"]
            elif sample.name.endswith("_sum"):
                key = "sum"
            elif sample.name.endswith("_count"):
                key = "count"
            else:
                continue
            histogram[key] = histogram.get(key, 0.0) + sample.value
    return models


def batch_size_delta(before: Histogram | None, after: Histogram | None) -> BatchSizes:
    """The batches dispatched between two scrapes, by histogram bucket ("3-4": sizes 3 and 4)."""
    before, after = before or {}, after or {}
    sizes = BatchSizes(source="metrics")
    sizes.batches = round(after.get("count", 0.0) - before.get("count", 0.0))
    sizes.requests = round(after.get("sum", 0.0) - before.get("sum", 0.0))
    bounds = sorted((float(key), key) for key in after if key not in ("sum", "count"))
    previous_bound, previous_count = 0.0, 0.0
    for bound, key in bounds:
        cumulative = after[key] - before.get(key, 0.0)
        count = round(cumulative - previous_count)
        low = math.floor(previous_bound) + 1
        if math.isinf(bound):
            label = f">{math.floor(previous_bound)}"
        elif low >= bound:
            label = f"{bound:g}"
        else:
            label = f"{low}-{bound:g}"
        if count:
            sizes.buckets[label] = count
        previous_bound, previous_count = bound, cumulative
    return sizes


# -- command line -----------------------------------------------------------------------------


def _target_from_url(url: str, bodies: Sequence[bytes], content_type: str,
                     channels: int) -> Target:
    parts = urlsplit(url)
    if parts.scheme == "grpc":
        if parts.port is None:
            raise SystemExit(f"a gRPC URL names its port: grpc://127.0.0.1:7070/MODEL, "
                             f"not {url!r}")
        model, _, version = parts.path.strip("/").partition("/")
        return GrpcTarget(parts.hostname or "", parts.port, model, bodies, version, channels)
    return HttpTarget(url, bodies, content_type)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("url", help="http://127.0.0.1:PORT/predictions/MODEL or "
                                    "grpc://127.0.0.1:PORT/MODEL[/VERSION]")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--clients", type=int, help="closed loop: concurrent clients")
    mode.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    parser.add_argument("--max-in-flight", type=int, default=256,
                        help="open loop: most outstanding requests")
    parser.add_argument("--body", type=Path, action="append",
                        help="file to send (repeat to cycle several); default 100 bytes")
    parser.add_argument("--content-type", default="application/octet-stream")
    parser.add_argument("--grpc-channels", type=int, default=1)
    parser.add_argument("--metrics", help="batchserve metrics URL, for batch sizes")
    parser.add_argument("--model", help="model name in the metrics (default: from the URL)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    bodies = [path.read_bytes() for path in args.body] if args.body else [b"0123456789" * 10]
    target = _target_from_url(args.url, bodies, args.content_type, args.grpc_channels)
    model = args.model or urlsplit(args.url).path.rstrip("/").split("/")[-1]
    result = run(target, clients=args.clients, rate=args.rate, duration_s=args.duration,
                 warmup_s=args.warmup, max_in_flight=args.max_in_flight, seed=args.seed,
                 progress=not args.no_progress, metrics_url=args.metrics, model=model)
    print(result.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
