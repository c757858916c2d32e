"""Frontend processes (issue 34): batchserve with 1, 2, 4, 8 processes on the inference port
against TorchServe 0.12 at its default thread count, in one run.

    .venv/bin/python -m benchmarks.fronts                       # N = 1 2 4 8, 3 rounds of 10 s
    .venv/bin/python -m benchmarks.fronts --fronts 1 2 --rounds 2
    .venv/bin/python -m benchmarks.fronts --smoke --no-torchserve  # seconds: does it still run

Each configuration is one server, all up at once on free loopback ports: batchserve with
``frontend_processes=N`` in its config.properties for each N of ``--fronts``: exactly N
processes, whatever the cores (TorchServe's ``number_of_netty_threads=N`` runs as many only
where there are 2 cores a process: frontend/config/server.py ``netty_fronts``) (otherwise
its defaults: adaptive batching, access log on), and TorchServe 0.12 with
``number_of_netty_threads`` unset (Netty's default, a thread per logical CPU) and quiet logging
(benchmarks/torchserve.py). Each serves two models, ``--workers`` workers each, batch_size 8,
max_batch_delay 5 ms:

* ``echo``: examples/echo/echo_handler.py, driven by wrk with 100-byte POSTs as
  benchmarks/wrk_echo.py drives it (its archive, its script, its ``wrk``);
* ``upload``: benchmarks/handlers/byte_count.py (answers each request with its body's length;
  nothing decoded, the point is ingestion), driven by wrk with 64 KiB JPEG uploads
  (``Content-Type: image/jpeg``; real JPEGs made with Pillow from seeded noise, a few of them
  sent in turn).

Every server first answers one upload of each JPEG with its length (a wrong answer stops the
run), then every (server, load) pair gets a ``--warmup`` run, then ``--rounds`` rounds, each
running every pair once for ``--duration`` seconds in a new seeded shuffled order, so that a
noisy neighbour on a shared machine hits every configuration alike. Per run: wrk's requests/s
and the p50/p99 of its latency distribution, and the CPU seconds the server's whole process
tree used meanwhile (the server, its front processes, its workers: psutil's ``cpu_times`` of
every process under the server, children that exited included), as CPU seconds per 1,000
requests and as requests per CPU second (the per-core efficiency: requests/s per
CPU-second-per-second used). Each figure is the median over the rounds; the ratios are to
TorchServe's and to N=1's medians. The rounds end early (and say so) once ``--time-limit``
seconds have passed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import os
import random
import shutil
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import torchserve
from benchmarks.management import ManagementClient
from benchmarks.servers import Batchserve
from benchmarks.wrk_echo import BATCH_SIZE, HANDLER, MAX_BATCH_DELAY_MS, WrkRun, echo_setup, wrk
from model_archiver.packaging import ArchiveOptions, build_archive

ROOT = Path(__file__).resolve().parent.parent
UPLOAD_HANDLER = ROOT / "benchmarks" / "handlers" / "byte_count.py"
JPEG_BYTES = 64 * 1024
JPEG_COUNT = 4
LOADS = ("echo", "upload")
TORCHSERVE = "TorchServe 0.12"


def make_jpegs(count: int = JPEG_COUNT, target: int = JPEG_BYTES, seed: int = 0,
               size: tuple[int, int] = (448, 336)) -> list[bytes]:
    """``count`` different real JPEGs (seeded: the same bytes on every machine), each the one of
    its image's qualities 50-95 whose length is nearest ``target``: smooth colour blobs under
    fine noise, which JPEG cannot squeeze to nothing."""
    from PIL import Image

    width, height = size
    rng = random.Random(seed)
    images = []
    for _ in range(count):
        blobs = Image.frombytes("RGB", (width // 16, height // 16),
                                rng.randbytes(width // 16 * (height // 16) * 3))
        noise = Image.frombytes("RGB", size, rng.randbytes(width * height * 3))
        picture = Image.blend(blobs.resize(size, Image.Resampling.BICUBIC), noise, 0.3)
        encoded = []
        for quality in range(50, 96):
            buffer = io.BytesIO()
            picture.save(buffer, "JPEG", quality=quality)
            encoded.append(buffer.getvalue())
        images.append(min(encoded, key=lambda data: abs(len(data) - target)))
    return images


def upload_script(work: Path, jpegs: Sequence[bytes]) -> Path:
    """wrk's script for the uploads: each JPEG in ``work``, read once per wrk thread into a
    ready request, the requests sent in turn."""
    names = []
    for index, data in enumerate(jpegs):
        path = work / f"upload-{index}.jpg"
        path.write_bytes(data)
        names.append(json.dumps(str(path)))  # a quoted string Lua reads as is
    script = work / "upload.lua"
    script.write_text(f"""wrk.method = "POST"
wrk.headers["Content-Type"] = "image/jpeg"
local files = {{{", ".join(names)}}}
local ready = {{}}
local turn = 0
function init(args)  -- called by wrk.init, once Host is set
  for i, name in ipairs(files) do
    local file = assert(io.open(name, "rb"))
    ready[i] = wrk.format(nil, nil, nil, file:read("*a"))
    file:close()
  end
end
function request()
  turn = turn % #ready + 1
  return ready[turn]
end
""")
    return script


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and every process under it,
    with those of their children that exited and were waited for."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for process in (root, *root.children(recursive=True)):
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:  # gone since the listing: its parent has its time now
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


@dataclass
class Sample:
    """One measured run of one load on one server."""

    rate: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int
    wall_s: float
    cpu_s: float

    @property
    def cpu_per_1000(self) -> float:
        return self.cpu_s / self.requests * 1000 if self.requests else float("nan")

    @property
    def per_core(self) -> float:
        """Requests/s per CPU-second-per-second used: requests per CPU second."""
        return self.requests / self.cpu_s if self.cpu_s > 0 else float("nan")

    @property
    def cores(self) -> float:
        return self.cpu_s / self.wall_s


@dataclass
class Config:
    """One server under test and its samples per load."""

    name: str
    server: ManagementClient
    fronts: int | None  # None: TorchServe
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {load: [] for load in LOADS})

    @property
    def pid(self) -> int:
        if isinstance(self.server, torchserve.TorchServe):
            assert self.server.pid is not None, "TorchServe's pid file was not found"
            return self.server.pid
        assert isinstance(self.server, Batchserve)
        return int(self.server.state["pid"])  # type: ignore[call-overload]

    def url(self, load: str) -> str:
        return f"{self.server.inference}/predictions/{load}"

    def median(self, load: str, name: str) -> float:
        return statistics.median(getattr(sample, name) for sample in self.samples[load])


def measure(config: Config, load: str, duration_s: float, script: Path, threads: int,
            connections: int) -> Sample:
    """One wrk run against ``config``'s ``load`` with the CPU its process tree used meanwhile."""
    before, started = tree_cpu_s(config.pid), time.monotonic()
    run: WrkRun = wrk(config.url(load), connections, duration_s, script, threads)
    wall_s, after = time.monotonic() - started, tree_cpu_s(config.pid)
    return Sample(run.rate, run.p50_ms, run.p99_ms, run.errors, run.requests, wall_s,
                  after - before)


def prepare(config: Config, workers: int, jpegs: Sequence[bytes]) -> None:
    """Register both models on ``config``'s server, then send each JPEG once, one at a time:
    the upload model must answer its length."""
    for load in LOADS:
        config.server.register(f"{load}.mar", batch_size=BATCH_SIZE,
                               max_batch_delay=MAX_BATCH_DELAY_MS, initial_workers=workers)
    for data in jpegs:
        request = urllib.request.Request(config.url("upload"), data=data,
                                         headers={"Content-Type": "image/jpeg"})
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = response.read().decode().strip()
        if answer != str(len(data)):
            raise SystemExit(f"{config.name}: an upload of {len(data)} bytes was answered "
                             f"{answer[:200]!r}")


@contextlib.contextmanager
def started(servers: Sequence[Any]) -> Iterator[None]:
    """Start the servers at once (threads: each start mostly waits), stop them at once."""
    with concurrent.futures.ThreadPoolExecutor(max(1, len(servers))) as pool:
        starts = [pool.submit(server.__enter__) for server in servers]
        up = [server for server, start in zip(servers, starts, strict=True)
              if start.exception() is None]
        try:
            for start in starts:
                start.result()  # the first start's error, if any
            yield
        finally:
            stops = [pool.submit(server.__exit__, None, None, None) for server in up]
            for stop in stops:
                stop.result()


def _ratio(value: float, baseline: Config | None, load: str, name: str) -> str:
    return "-" if baseline is None else f"{value / baseline.median(load, name):.2f}x"


def report(configs: Sequence[Config], header: str) -> str:
    """The markdown tables, one per load, with the ratios to TorchServe and to N=1."""
    theirs = next((config for config in configs if config.fronts is None), None)
    one = next((config for config in configs if config.fronts == 1), None)
    lines = [header]
    for load in LOADS:
        lines += ["", f"**{load}**", "",
                  "| server | req/s | vs TorchServe | vs N=1 | p50 ms | p99 ms | "
                  "CPU s / 1000 req | vs TorchServe | vs N=1 | req per CPU s | cores busy | "
                  "non-2xx |", "|---" * 12 + "|"]
        for config in configs:
            rate, cpu = config.median(load, "rate"), config.median(load, "cpu_per_1000")
            errors = sum(sample.errors for sample in config.samples[load])
            lines.append(
                f"| {config.name} | {rate:,.0f} | {_ratio(rate, theirs, load, 'rate')} | "
                f"{_ratio(rate, one, load, 'rate')} | {config.median(load, 'p50_ms'):.2f} | "
                f"{config.median(load, 'p99_ms'):.2f} | {cpu:.3f} | "
                f"{_ratio(cpu, theirs, load, 'cpu_per_1000')} | "
                f"{_ratio(cpu, one, load, 'cpu_per_1000')} | "
                f"{config.median(load, 'per_core'):,.0f} | {config.median(load, 'cores'):.2f} | "
                f"{errors} |")
    lines += ["", "rounds (req/s): " + "; ".join(
        f"{config.name} {load}: {', '.join(f'{s.rate:,.0f}' for s in config.samples[load])}"
        for config in configs for load in LOADS)]
    return "\n".join(lines)


def _rows(configs: Sequence[Config]) -> list[dict[str, Any]]:
    return [{"config": config.name, "fronts": config.fronts, "pid": config.pid, "load": load,
             **asdict(sample),
             "cpu_per_1000": sample.cpu_per_1000, "per_core": sample.per_core}
            for config in configs for load in LOADS for sample in config.samples[load]]


def _servers(args: argparse.Namespace, work: Path, store: Path) -> list[Config]:
    """The configurations, not started yet."""
    configs = [Config(f"batchserve N={n}", Batchserve(
        store, extra_properties=f"frontend_processes={n}\n"), n) for n in args.fronts]
    if not args.no_torchserve:
        bin_dir = torchserve.ensure_venv()
        ts_store = work / "ts-store"
        ts_store.mkdir()
        torchserve.archive(bin_dir, ts_store, "echo", HANDLER)
        torchserve.archive(bin_dir, ts_store, "upload", UPLOAD_HANDLER)
        configs.append(Config(TORCHSERVE, torchserve.TorchServe(ts_store, quiet=True), None))
    return configs


def _parser() -> argparse.ArgumentParser:
    cores = len(os.sched_getaffinity(0))
    threads = max(1, min(4, cores // 4))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fronts", type=int, nargs="+", metavar="N",
                        help="frontend_processes values (default 1 2 4 8; --smoke: 1 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=10, help="whole seconds per wrk run")
    parser.add_argument("--warmup", type=int, default=3,
                        help="whole seconds, once per pair before the rounds (0: none)")
    parser.add_argument("--threads", type=int, default=threads,
                        help=f"wrk threads (default: cores/4 within 1..4, here {threads})")
    parser.add_argument("--connections", type=int, default=16 * threads,
                        help=f"wrk connections (default 16 per thread, here {16 * threads})")
    parser.add_argument("--workers", type=int, default=max(1, cores // 8),
                        help="workers per model, both servers (default cores/8, at least 1)")
    parser.add_argument("--no-torchserve", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="1 round of 1 s, no warm-up, N = 1 2 unless --fronts is given")
    parser.add_argument("--time-limit", type=float, default=3600.0,
                        help="seconds after which no new round starts (default 3600)")
    parser.add_argument("--seed", type=int, default=0, help="the rounds' shuffles")
    parser.add_argument("--json", type=Path, help="also write every sample to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.duration, args.warmup = 1, 1, 0
    args.fronts = args.fronts or ([1, 2] if args.smoke else [1, 2, 4, 8])
    if not 1 <= args.rounds <= 100 or not 1 <= args.duration <= 600 or args.warmup < 0:
        parser.error("--rounds 1..100, --duration 1..600 s, --warmup 0 or more s")
    if not all(1 <= n <= 64 for n in args.fronts) or len(set(args.fronts)) < len(args.fronts):
        parser.error("--fronts: distinct numbers 1..64")
    if shutil.which("wrk") is None:
        raise SystemExit("needs wrk: apt-get install -y wrk")
    began, clock = time.time(), time.monotonic()
    work, echo_script, store = echo_setup("bench-fronts-")
    build_archive(ArchiveOptions(model_name="upload", version="1.0", handler=str(UPLOAD_HANDLER),
                                 export_path=store, force=True))
    jpegs = make_jpegs()
    scripts = {"echo": echo_script, "upload": upload_script(work, jpegs)}
    configs = _servers(args, work, store)
    with started([config.server for config in configs]):
        with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
            for done in [pool.submit(prepare, config, args.workers, jpegs)
                         for config in configs]:
                done.result()
        pairs = [(config, load) for config in configs for load in LOADS]
        for config, load in pairs if args.warmup else ():  # connections, estimates, the JIT
            wrk(config.url(load), args.connections, args.warmup, scripts[load], args.threads)
        order, rounds = random.Random(args.seed), 0
        while rounds < args.rounds and time.monotonic() - clock < args.time_limit:
            rounds += 1
            for config, load in order.sample(pairs, len(pairs)):
                sample = measure(config, load, args.duration, scripts[load], args.threads,
                                 args.connections)
                config.samples[load].append(sample)
                print(f"round {rounds}: {config.name} {load}: {sample.rate:,.0f} req/s, "
                      f"p99 {sample.p99_ms:.2f} ms, {sample.cpu_per_1000:.3f} CPU s/1000, "
                      f"non-2xx {sample.errors}", file=sys.stderr, flush=True)
    cut = "" if rounds == args.rounds else ", cut short by --time-limit"
    header = (
        f"wrk -t{args.threads} -c{args.connections}, {rounds} shuffled rounds of "
        f"{args.duration} s (median round{cut}); "
        f"batch_size {BATCH_SIZE}, max_batch_delay {MAX_BATCH_DELAY_MS} ms, {args.workers} "
        f"worker(s) per model; uploads: {len(jpegs)} JPEGs of "
        f"{min(map(len, jpegs)):,}-{max(map(len, jpegs)):,} bytes; "
        f"{len(os.sched_getaffinity(0))} cores; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(began))}, "
        f"{time.monotonic() - clock:.0f} s in all")
    print("\n" + report(configs, header))
    if args.json:
        args.json.write_text(json.dumps(_rows(configs), indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
