"""Overload you can promise (issue 35): a light tenant beside a heavy one, and two models on one
device, under open-loop load, on batchserve and on TorchServe 0.12.

    .venv/bin/python -m benchmarks.tenants --out benchmarks/RESULTS.md   # both servers, ~3 min
    .venv/bin/python -m benchmarks.tenants --smoke                       # batchserve, ~12 s

The simulated accelerator (benchmarks/handlers/accelerator.py): a batch of n costs a + b·n ms
(20 + 1 ms, batch_size 8, max_batch_delay 50 ms, one worker: about 270 requests/s), on a
device that runs one batch at a time for every worker of the server (``BENCH_ACCEL_DEVICE``,
a lock file). Arrivals are open-loop (Poisson, or fixed-rate with ``--fixed``) per stream,
bounded in count (rate x duration) and in time (the answers of the last ones are awaited at
most ``--drain`` s), sent only to 127.0.0.1. Each server runs three phases:

1. ``alone``: the light tenant (``X-Tenant: light``) offers 40 requests/s;
2. ``overload``: the same, beside the heavy tenant (``X-Tenant: heavy``) offering 1.75x capacity;
3. ``devices``: two models, each offered 1.0x capacity, on the one device; batchserve's are a
   ``deviceGroup`` with weights 1:1 (``--device-weights``), TorchServe's share the lock as
   the kernel hands it out.

Per stream: sent, answered 200, refused 503 (and how fast: p99 of the refusals' latency), other
errors, p50/p99 of the 200s, goodput (200s per second), the deadline hit rate (of the requests
not refused, those answered 200 within ``--deadline`` s, sent as ``X-Request-Timeout``), and,
for the devices phase, each model's share of the device's time, estimated alike on both servers
from the ``X-Batch-Size`` header of each answer (a request's part of its batch's cost) and, on
batchserve, read from ``batchserve_device_time_seconds_total``. TorchServe has no tenants: it
is the first-come-first-served baseline, as batchserve is without ``tenant_header``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.loadgen import HttpConnection, HttpError, check_loopback, http_request, percentile
from benchmarks.management import ManagementClient
from model_archiver.packaging import ArchiveOptions, build_archive

ROOT = Path(__file__).resolve().parent.parent
HANDLER = ROOT / "benchmarks" / "handlers" / "accelerator.py"
OVERHEAD_MS, PER_ITEM_MS, BATCH, DELAY_MS = 20.0, 1.0, 8, 50
LIGHT_RATE = 40.0
HEAVY_FACTOR = 1.75
BODY = b"x" * 100


@dataclass(frozen=True)
class Stream:
    """One tenant's open-loop arrivals at one model."""

    name: str
    model: str
    rate: float
    tenant: str = ""


@dataclass
class Tally:
    """What one stream's requests got."""

    sent: int = 0
    statuses: collections.Counter[str] = field(default_factory=collections.Counter)
    ok_ms: list[float] = field(default_factory=list)
    refused_ms: list[float] = field(default_factory=list)
    #: Answered 200 within the deadline.
    in_time: int = 0
    #: Device seconds its 200s cost, from each answer's X-Batch-Size.
    device_s: float = 0.0

    def admitted(self) -> int:
        return self.sent - self.statuses["503"]


def schedule(rate: float, duration_s: float, poisson: bool, rng: random.Random) -> list[float]:
    """Arrival offsets in [0, duration_s): at most rate x duration_s of them."""
    times: list[float] = []
    limit = int(rate * duration_s)
    at = rng.expovariate(rate) if poisson else 0.0
    while at < duration_s and len(times) < limit:
        times.append(at)
        at += rng.expovariate(rate) if poisson else 1.0 / rate
    return times


#: A kept-alive connection idle longer than this is closed rather than used again: well within
#: any server's keep-alive timeout (batchserve's default is 5 s).
IDLE_REUSE_S = 2.0


async def drive(url: str, streams: Sequence[Stream], duration_s: float, *, deadline_s: float,
                poisson: bool = True, seed: int = 35, drain_s: float = 30.0
                ) -> dict[str, Tally]:
    """Send every stream's arrivals on its schedule (each request on an idle keep-alive
    connection of its stream, or a new one), and tally the answers."""
    parts = urlsplit(url)
    host, port = check_loopback(parts.hostname), parts.port or 80
    rng = random.Random(seed)
    tallies = {stream.name: Tally() for stream in streams}
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    pending: set[asyncio.Task[None]] = set()
    opened: list[HttpConnection] = []

    async def one(stream: Stream, payload: bytes, idle: list[tuple[HttpConnection, float]],
                  at: float) -> None:
        tally = tallies[stream.name]
        tally.sent += 1
        try:
            connection = None
            while idle and connection is None:
                connection, since = idle.pop()
                if loop.time() - since > IDLE_REUSE_S:
                    # The server may close it any moment now (keep_alive_timeout): a POST sent
                    # as it does would be lost to the race, which no server can answer.
                    connection.close()
                    connection = None
            if connection is None:
                connection = await HttpConnection.open(host, port)
                opened.append(connection)
            response = await connection.request(payload)
        except HttpError as error:
            tally.statuses[error.kind] += 1
            return
        except asyncio.CancelledError:  # not answered within the drain
            tally.statuses["unanswered"] += 1
            raise
        spent_ms = (time.perf_counter() - at) * 1000
        status = str(response.status)
        tally.statuses[status] += 1
        if not connection.closed:
            idle.append((connection, loop.time()))
        if status == "200":
            tally.ok_ms.append(spent_ms)
            tally.in_time += spent_ms <= deadline_s * 1000
            size = response.batch_size or 1
            tally.device_s += (OVERHEAD_MS + PER_ITEM_MS * size) / 1000 / size
        elif status == "503":
            tally.refused_ms.append(spent_ms)

    async def feed(stream: Stream, offsets: list[float]) -> None:
        headers = {"X-Request-Timeout": f"{deadline_s:g}"}
        if stream.tenant:
            headers["X-Tenant"] = stream.tenant
        payload = http_request(host, port, f"/predictions/{stream.model}", BODY,
                               "application/octet-stream", headers)
        idle: list[tuple[HttpConnection, float]] = []
        for offset in offsets:
            delay = start + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            # Latency counts from the scheduled arrival: a late sender does not hide queueing.
            scheduled = time.perf_counter() - max(0.0, loop.time() - start - offset)
            task = asyncio.ensure_future(one(stream, payload, idle, scheduled))
            pending.add(task)
            task.add_done_callback(pending.discard)

    await asyncio.gather(*(feed(stream, schedule(stream.rate, duration_s, poisson, rng))
                           for stream in streams))
    if pending:
        _, late = await asyncio.wait(set(pending), timeout=drain_s)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)
    for connection in opened:
        connection.close()
    return tallies


def run_phase(url: str, streams: Sequence[Stream], duration_s: float, *, deadline_s: float,
              poisson: bool, drain_s: float) -> dict[str, Tally]:
    import uvloop

    return uvloop.run(drive(url, streams, duration_s, deadline_s=deadline_s, poisson=poisson,
                            drain_s=drain_s))


def device_seconds(metrics_url: str) -> dict[str, float]:
    """batchserve's device time per model (``batchserve_device_time_seconds_total``)."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=10) as answer:
        page = answer.read().decode()
    found = re.findall(r'^batchserve_device_time_seconds_total\{[^}]*model_name="([^"]+)"[^}]*\}'
                       r" (\S+)$", page, re.MULTILINE)
    return {model: float(value) for model, value in found}


# -- the report -------------------------------------------------------------------------------

HEADER = ("| server | phase | stream | offered/s | sent | 200 | 503 | other | p50 ms | p99 ms "
          "| 503 p99 ms | goodput/s | deadline hit | device share |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def rows(server: str, phase: str, streams: Sequence[Stream], tallies: dict[str, Tally],
         duration_s: float, shares: dict[str, str] | None = None) -> list[str]:
    lines = []
    for stream in streams:
        tally = tallies[stream.name]
        other = ", ".join(f"{count} {status}" for status, count in tally.statuses.items()
                          if status not in ("200", "503")) or "0"
        hit = tally.in_time / tally.admitted() if tally.admitted() else 0.0

        def ms(values: list[float], q: float) -> str:
            return f"{percentile(values, q):.0f}" if values else "-"

        lines.append(
            f"| {server} | {phase} | {stream.name} | {stream.rate:.0f} | {tally.sent} | "
            f"{tally.statuses['200']} | {tally.statuses['503']} | {other} | "
            f"{ms(tally.ok_ms, 50)} | {ms(tally.ok_ms, 99)} | {ms(tally.refused_ms, 99)} | "
            f"{tally.statuses['200'] / duration_s:.0f} | {hit:.2%} | "
            f"{(shares or {}).get(stream.name, '')} |")
    return lines


def header_shares(streams: Sequence[Stream], tallies: dict[str, Tally]) -> dict[str, str]:
    total = sum(tallies[stream.name].device_s for stream in streams)
    return {stream.name: f"{tallies[stream.name].device_s / total:.1%} (hdr)" if total else "-"
            for stream in streams}


# -- the servers ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    duration_s: float
    capacity: float
    deadline_s: float
    poisson: bool
    drain_s: float
    device_weights: tuple[float, float]


def phases(server: str, url: str, metrics_url: str | None, settings: Settings) -> list[str]:
    duration = settings.duration_s
    light = Stream("light", "accel", LIGHT_RATE, "light")
    heavy = Stream("heavy", "accel", HEAVY_FACTOR * settings.capacity, "heavy")
    devices = [Stream("dev1", "dev1", settings.capacity), Stream("dev2", "dev2",
                                                                  settings.capacity)]
    options = {"deadline_s": settings.deadline_s, "poisson": settings.poisson,
               "drain_s": settings.drain_s}
    lines: list[str] = []
    for phase, streams in (("alone", [light]), ("overload", [light, heavy])):
        tallies = run_phase(url, streams, duration, **options)  # type: ignore[arg-type]
        lines += rows(server, phase, streams, tallies, duration)
        print("\n".join(lines[-len(streams):]), flush=True)
    before = device_seconds(metrics_url) if metrics_url else {}
    tallies = run_phase(url, devices, duration, **options)  # type: ignore[arg-type]
    shares = header_shares(devices, tallies)
    if metrics_url:
        after = device_seconds(metrics_url)
        used = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in ("dev1", "dev2")}
        total = sum(used.values())
        for name, seconds in used.items():
            if total:
                shares[name] += f", {seconds / total:.1%} (metric)"
    lines += rows(server, "devices", devices, tallies, duration, shares)
    print("\n".join(lines[-2:]), flush=True)
    return lines


def build(store: Path) -> None:
    for name in ("accel", "dev1", "dev2"):
        build_archive(ArchiveOptions(model_name=name, version="1.0", handler=str(HANDLER),
                                     export_path=store, force=True))


def register(server: ManagementClient, *, batchserve: bool, weights: tuple[float, float],
             packed: dict[str, str]) -> None:
    for name in ("accel", "dev1", "dev2"):
        extra: dict[str, object] = {}
        if batchserve and name != "accel":
            extra = {"device_group": "sim",
                     "device_weight": weights[0] if name == "dev1" else weights[1]}
        server.register(packed.get(name, f"{name}.mar"), model_name=name, batch_size=BATCH,
                        max_batch_delay=DELAY_MS, initial_workers=1, **extra)


def accelerator_env(work: Path) -> dict[str, str]:
    return {"BENCH_ACCEL_OVERHEAD_MS": f"{OVERHEAD_MS:g}",
            "BENCH_ACCEL_PER_ITEM_MS": f"{PER_ITEM_MS:g}",
            "BENCH_ACCEL_DEVICE": str(work / "device.lock")}


def run_batchserve(settings: Settings) -> list[str]:
    from benchmarks.servers import Batchserve

    work = Path(tempfile.mkdtemp(prefix="bench-tenants-"))
    store = work / "store"
    store.mkdir()
    build(store)
    with Batchserve(store, "tenant_header=X-Tenant\n", env=accelerator_env(work)) as server:
        register(server, batchserve=True, weights=settings.device_weights, packed={})
        return phases("batchserve", server.inference, server.metrics, settings)


def run_torchserve(settings: Settings) -> list[str]:
    from benchmarks import torchserve

    work = Path(tempfile.mkdtemp(prefix="bench-tenants-ts-"))
    store = work / "store"
    store.mkdir()
    bin_dir = torchserve.ensure_venv()
    packed = {name: torchserve.archive(bin_dir, store, name, HANDLER)
              for name in ("accel", "dev1", "dev2")}
    with torchserve.TorchServe(store, quiet=True, env=accelerator_env(work)) as server:
        register(server, batchserve=False, weights=settings.device_weights, packed=packed)
        return phases("TorchServe 0.12", server.inference, None, settings)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per phase")
    parser.add_argument("--capacity", type=float, default=270.0,
                        help="the model's capacity in requests/s (the heavy tenant offers "
                             f"{HEAVY_FACTOR}x, each device model 1x)")
    parser.add_argument("--deadline", type=float, default=2.0,
                        help="each request's X-Request-Timeout, in seconds")
    parser.add_argument("--fixed", action="store_true", help="fixed-rate arrivals, not Poisson")
    parser.add_argument("--drain", type=float, default=30.0,
                        help="seconds to await the last answers of a phase")
    parser.add_argument("--device-weights", type=float, nargs=2, default=(1.0, 1.0))
    parser.add_argument("--no-torchserve", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="batchserve only, 0.8 s phases: checks that it all still runs")
    parser.add_argument("--out", type=Path, help="append the report to this file")
    args = parser.parse_args(argv)
    settings = Settings(0.8 if args.smoke else args.duration, args.capacity, args.deadline,
                        not args.fixed, 5.0 if args.smoke else args.drain,
                        tuple(args.device_weights))  # type: ignore[arg-type]
    print(HEADER, flush=True)
    began = time.monotonic()
    lines = run_batchserve(settings)
    if not (args.smoke or args.no_torchserve):
        lines += run_torchserve(settings)
    command = " ".join(["python -m benchmarks.tenants", *(argv if argv is not None
                                                          else sys.argv[1:])])
    report = "\n".join([f"`{command}` ({time.monotonic() - began:.0f} s)", "", HEADER, *lines])
    if args.out is not None:
        with args.out.open("a") as out:
            out.write("\n" + report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
