"""The batching benchmark suite (issue 6): adaptive vs fixed vs batching off, and TorchServe.

    .venv/bin/python -m benchmarks.suite --scenario accelerator|echo|resnet152|all \\
        [--with-torchserve] [--duration S] [--quick] [--out RESULTS.md]

For each scenario, one batchserve serves the same handler three times, one worker each:
``adaptive`` and ``fixed`` (batch_size B, max_batch_delay D, the ``batch_policy`` register
parameter) and ``off`` (batch_size 1). With ``--with-torchserve``, two TorchServe 0.12 servers
serve the same handler file with the same B and D: one with its default logging, one quiet.

1. **Capacity**: a closed-loop run of ``adaptive`` at the scenario's saturation concurrency
   (64 clients; 16 for echo and resnet152, the issue's echo target). Offered loads are
   fractions of this batched capacity, so the curves cover the range where batching decides
   the latency; batching off saturates at a small fraction of it, which the curves show.
2. **Points**, each run for every server back to back (the order rotates from point to point,
   so that the machine's drift does not favour one server): ``low`` (one client at a time),
   ``saturation`` (the concurrency above, closed loop), then open-loop Poisson arrivals at
   5 % ... 120 % of the capacity.

It prints a markdown table per scenario and the ratios the issue's targets name, appends them
to ``--out`` when given, and writes ``benchmarks/latency_vs_load_<scenario>.png`` (p50 solid,
p99 dashed, against the offered load). The load generator runs on the same 2 cores as the
servers: its CPU share is in the table; compare servers within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import loadgen
from benchmarks.servers import Batchserve

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
ECHO_HANDLER = ROOT / "examples" / "echo" / "echo_handler.py"
ACCELERATOR_HANDLER = HERE / "handlers" / "accelerator.py"
RESNET_EXAMPLE = ROOT / "examples" / "image_classifier" / "resnet_152_batch"
RESNET_MODEL = "resnet-152-batch_v2"
BODY_100 = b"0123456789" * 10

FRACTIONS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.2)
QUICK_FRACTIONS = (0.05, 0.5, 1.0)
#: Sequential requests each model gets once its server is up (first inferences are slow).
PRIME_REQUESTS = 3


# -- scenarios --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    name: str
    batch_size: int
    max_batch_delay_ms: int
    saturation_clients: int
    duration_s: float  # measured seconds per point, unless --duration
    warmup_s: float
    quick_duration_s: float  # the same for --quick
    quick_warmup_s: float
    content_type: str
    about: str

    def bodies(self) -> list[bytes]:
        if self.name == "resnet152":
            return [(RESNET_EXAMPLE / f"{name}.jpg").read_bytes()
                    for name in ("kitten", "dog", "croco")]
        return [BODY_100]


SCENARIOS = {
    "accelerator": Scenario(
        "accelerator", 8, 50, 64, 10.0, 2.0, 3.0, 1.0, "application/octet-stream",
        "benchmarks/handlers/accelerator.py: a batch of n sleeps a + b*n ms, 100-byte bodies"),
    "echo": Scenario(
        "echo", 8, 5, 16, 10.0, 2.0, 3.0, 1.0, "application/octet-stream",
        "examples/echo/echo_handler.py: each request answered with its 100-byte body"),
    "resnet152": Scenario(
        "resnet152", 8, 50, 16, 30.0, 10.0, 10.0, 5.0, "image/jpeg",
        "examples/image_classifier/resnet_152_batch (image_classifier, seeded random weights),"
        " kitten/dog/croco JPEGs"),
}


def build_batchserve_archive(scenario: Scenario, store: Path) -> str:
    """The scenario's ``.mar`` made by batchserve's archiver; returns its file name."""
    if scenario.name == "resnet152":
        # In a subprocess: the weights are made with torch, which this process need not load.
        subprocess.run([sys.executable, str(RESNET_EXAMPLE / "build_mar.py"), "--model-store",
                        str(store)], cwd=ROOT, check=True, timeout=1800,
                       stdout=subprocess.DEVNULL)
        return f"{RESNET_MODEL}.mar"
    from model_archiver.packaging import ArchiveOptions, build_archive

    handler = ECHO_HANDLER if scenario.name == "echo" else ACCELERATOR_HANDLER
    build_archive(ArchiveOptions(model_name=scenario.name, version="1.0", handler=str(handler),
                                 export_path=store, force=True))
    return f"{scenario.name}.mar"


def build_torchserve_archive(scenario: Scenario, store: Path, bin_dir: Path) -> str:
    """The same model packed by TorchServe's ``torch-model-archiver``."""
    from benchmarks import torchserve

    if scenario.name == "resnet152":
        with tempfile.TemporaryDirectory(prefix="bench-resnet-") as tmp:
            weights = Path(tmp) / "resnet152.pt"
            subprocess.run([sys.executable, str(RESNET_EXAMPLE / "make_weights.py"),
                            "--output", str(weights)], cwd=ROOT, check=True, timeout=1800,
                           stdout=subprocess.DEVNULL)
            return torchserve.archive(
                bin_dir, store, RESNET_MODEL, Path("image_classifier"), version="2.0",
                model_file=RESNET_EXAMPLE / "model.py", serialized_file=weights,
                extra_files=[RESNET_EXAMPLE / "index_to_name.json"])
    handler = ECHO_HANDLER if scenario.name == "echo" else ACCELERATOR_HANDLER
    return torchserve.archive(bin_dir, store, scenario.name, handler)


# -- what is compared -------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    key: str  # adaptive, fixed, off, torchserve, torchserve-quiet
    label: str
    server: str  # batchserve, torchserve, torchserve-quiet
    model: str
    batch_size: int
    policy: str | None = None


def variants(scenario: Scenario, with_torchserve: bool) -> list[Variant]:
    b, d, name = scenario.batch_size, scenario.max_batch_delay_ms, scenario.name
    model = RESNET_MODEL if name == "resnet152" else name
    found = [
        Variant("adaptive", f"batchserve adaptive (B={b}, D={d} ms)", "batchserve",
                f"{name}_adaptive", b, "adaptive"),
        Variant("fixed", f"batchserve fixed (B={b}, D={d} ms)", "batchserve", f"{name}_fixed",
                b, "fixed"),
        Variant("off", "batchserve batching off (B=1)", "batchserve", f"{name}_off", 1),
    ]
    if with_torchserve:
        found += [
            Variant("torchserve", f"TorchServe 0.12 (B={b}, D={d} ms), default logging",
                    "torchserve", model, b),
            Variant("torchserve-quiet", f"TorchServe 0.12 (B={b}, D={d} ms), quiet logging",
                    "torchserve-quiet", model, b),
        ]
    return found


@dataclass(frozen=True)
class Point:
    key: str
    clients: int | None = None  # closed loop
    fraction: float | None = None  # open loop, of the capacity

    def describe(self) -> str:
        if self.clients is not None:
            return f"{self.key} ({self.clients} client{'s' if self.clients > 1 else ''})"
        return f"{100 * (self.fraction or 0):g}% of capacity"


def points(scenario: Scenario, fractions: Sequence[float]) -> list[Point]:
    return [Point("low", clients=1), Point("saturation", clients=scenario.saturation_clients),
            *(Point(f"{100 * f:g}%", fraction=f) for f in fractions)]


@dataclass
class ScenarioRun:
    scenario: Scenario
    variants: list[Variant]
    points: list[Point]
    capacity: float = 0.0
    capacity_result: loadgen.LoadResult | None = None
    results: dict[tuple[str, str], loadgen.LoadResult] = field(default_factory=dict)
    offered: dict[str, float] = field(default_factory=dict)  # open points: req/s asked
    elapsed_s: float = 0.0


# -- servers ----------------------------------------------------------------------------------


@dataclass
class Endpoint:
    inference: str
    metrics: str | None  # batchserve's Prometheus endpoint; TorchServe has no batch sizes
    grpc_port: int | None


@contextlib.contextmanager
def started_servers(scenario: Scenario, chosen: Sequence[Variant], env: dict[str, str],
                    log: Callable[[str], None]) -> Iterator[dict[str, Endpoint]]:
    """Start every server the variants need, register their models, stop them all after."""
    stores: list[Path] = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [shutil.rmtree(path, ignore_errors=True) for path in stores])
        endpoints: dict[str, Endpoint] = {}
        store = Path(tempfile.mkdtemp(prefix=f"bench-{scenario.name}-"))
        stores.append(store)
        log(f"building the {scenario.name} archive")
        mar = build_batchserve_archive(scenario, store)
        server = Batchserve(store, env=env)

        def remove_logs(kind: type[BaseException] | None, *_: object) -> bool:
            if kind is None:  # a failed run keeps its logs (an access log line per request)
                shutil.rmtree(server.work, ignore_errors=True)
            return False

        stack.push(remove_logs)
        stack.enter_context(server)
        for variant in chosen:
            if variant.server != "batchserve":
                continue
            params: dict[str, object] = {
                "model_name": variant.model, "batch_size": variant.batch_size,
                "max_batch_delay": scenario.max_batch_delay_ms, "initial_workers": 1}
            if variant.policy is not None:
                params["batch_policy"] = variant.policy
            server.register(mar, **params)
        grpc_port = server.state.get("grpc_inference_port")
        endpoints["batchserve"] = Endpoint(
            server.inference, f"{server.metrics}/metrics" if server.metrics else None,
            int(grpc_port) if isinstance(grpc_port, int | str) else None)
        log(f"batchserve is up at {server.inference}")
        torchserves = [v for v in chosen if v.server.startswith("torchserve")]
        if torchserves:
            from benchmarks import torchserve

            bin_dir = torchserve.ensure_venv()
            ts_store = Path(tempfile.mkdtemp(prefix=f"bench-ts-{scenario.name}-"))
            stores.append(ts_store)
            ts_mar = build_torchserve_archive(scenario, ts_store, bin_dir)
            for variant in torchserves:
                ts = stack.enter_context(torchserve.TorchServe(
                    ts_store, quiet=variant.server == "torchserve-quiet", env=env))
                ts.register(ts_mar, batch_size=variant.batch_size,
                            max_batch_delay=scenario.max_batch_delay_ms, initial_workers=1)
                endpoints[variant.server] = Endpoint(ts.inference, None, ts.grpc_inference_port)
                log(f"{variant.label} is up at {ts.inference}")
        yield endpoints


def make_target(scenario: Scenario, variant: Variant, endpoint: Endpoint,
                transport: str, grpc_channels: int) -> loadgen.Target:
    if transport == "grpc":
        if endpoint.grpc_port is None:
            raise SystemExit(f"no gRPC port known for {variant.label}")
        return loadgen.GrpcTarget("127.0.0.1", endpoint.grpc_port, variant.model,
                                  scenario.bodies(), channels=grpc_channels)
    return loadgen.HttpTarget(f"{endpoint.inference}/predictions/{variant.model}",
                              scenario.bodies(), scenario.content_type)


# -- running ----------------------------------------------------------------------------------


def prime(scenario: Scenario, variant: Variant, endpoint: Endpoint) -> None:
    """A few sequential requests, so that no measurement pays for a model's first inference."""
    url = f"{endpoint.inference}/predictions/{variant.model}"
    for body in (scenario.bodies() * PRIME_REQUESTS)[:PRIME_REQUESTS]:
        request = urllib.request.Request(url, data=body,
                                         headers={"Content-Type": scenario.content_type})
        with urllib.request.urlopen(request, timeout=300) as response:
            response.read()


@dataclass(frozen=True)
class Settings:
    quick: bool
    duration_s: float | None
    warmup_s: float | None
    fractions: tuple[float, ...]
    transport: str
    grpc_channels: int
    max_in_flight: int
    repeat: int
    progress: bool
    env: dict[str, str]

    def timing(self, scenario: Scenario) -> tuple[float, float]:
        """Measured and warm-up seconds per point."""
        duration = self.duration_s or (scenario.quick_duration_s if self.quick
                                       else scenario.duration_s)
        warmup = self.warmup_s if self.warmup_s is not None else (
            scenario.quick_warmup_s if self.quick else scenario.warmup_s)
        return duration, warmup


def run_scenario(scenario: Scenario, settings: Settings, with_torchserve: bool) -> ScenarioRun:
    chosen = variants(scenario, with_torchserve)
    run = ScenarioRun(scenario, chosen, points(scenario, settings.fractions))
    duration, warmup = settings.timing(scenario)
    runs = 1 + len(run.points) * len(chosen) * settings.repeat
    overall = _bar(runs, f"{scenario.name}", settings.progress)

    def log(text: str) -> None:
        if overall is not None:
            overall.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    log(f"{scenario.name}: {runs} runs of {warmup:g} + {duration:g} s "
        f"(about {runs * (warmup + duration + 1) / 60:.0f} min of load, plus start-up)")
    started = time.monotonic()
    try:
        with started_servers(scenario, chosen, settings.env, log) as endpoints:
            def measure(variant: Variant, label: str, **load: object) -> loadgen.LoadResult:
                endpoint = endpoints[variant.server]
                target = make_target(scenario, variant, endpoint, settings.transport,
                                     settings.grpc_channels)
                result = loadgen.run(
                    target, duration_s=duration, warmup_s=warmup,
                    max_in_flight=settings.max_in_flight, progress=settings.progress,
                    label=label, metrics_url=endpoint.metrics, model=variant.model,
                    **load)  # type: ignore[arg-type]
                log(f"  {label}: {result.summary()}")
                if overall is not None:
                    overall.update(1)
                return result

            for variant in chosen:
                prime(scenario, variant, endpoints[variant.server])
            adaptive = chosen[0]
            clients = scenario.saturation_clients
            run.capacity_result = measure(adaptive, f"{scenario.name} capacity ({clients} "
                                                    f"clients, adaptive)", clients=clients)
            run.capacity = run.capacity_result.throughput
            if not run.capacity > 0:
                raise RuntimeError(f"no successful answer while measuring capacity: "
                                   f"{run.capacity_result.summary()}")
            log(f"{scenario.name}: capacity {run.capacity:.1f} req/s")
            for index, point in enumerate(run.points):
                rate = run.capacity * (point.fraction or 0.0)
                if point.fraction is not None:
                    run.offered[point.key] = rate
                tries: dict[str, list[loadgen.LoadResult]] = {v.key: [] for v in chosen}
                for repeat in range(settings.repeat):
                    shift = (index + repeat) % len(chosen)
                    for variant in chosen[shift:] + chosen[:shift]:
                        label = f"{scenario.name} {variant.key} {point.key}"
                        if settings.repeat > 1:
                            label += f" #{repeat + 1}"
                        if point.clients is not None:
                            result = measure(variant, label, clients=point.clients)
                        else:
                            result = measure(variant, label, rate=rate, seed=index)
                        tries[variant.key].append(result)
                for key, results in tries.items():
                    run.results[(point.key, key)] = median_run(results, point)
    finally:
        if overall is not None:
            overall.close()
    run.elapsed_s = time.monotonic() - started
    return run


def median_run(results: Sequence[loadgen.LoadResult], point: Point) -> loadgen.LoadResult:
    """Of repeated runs, the median one: by throughput in closed loop, by p50 in open loop."""
    if point.clients is not None:
        ordered = sorted(results, key=lambda r: r.throughput)
    else:
        ordered = sorted(results, key=lambda r: (math.isnan(r.percentile_ms(50)),
                                                 r.percentile_ms(50)))
    return ordered[(len(ordered) - 1) // 2]


def _bar(total: int, label: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="run", file=sys.stderr, position=0,
                dynamic_ncols=True)


# -- reporting --------------------------------------------------------------------------------


def _ms(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def table(run: ScenarioRun) -> str:
    rows = ["| load | offered req/s | server | sent req/s | ok req/s | p50 ms | p90 ms | "
            "p99 ms | mean batch | batch sizes | errors | client CPU |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for point in run.points:
        for variant in run.variants:
            result = run.results.get((point.key, variant.key))
            if result is None:
                continue
            offered = (f"closed, {point.clients}" if point.clients is not None
                       else _rate(run.offered.get(point.key, 0.0)))
            sizes = result.best_batch_sizes()
            mean = f"{sizes.mean:.2f}" if sizes and sizes.batches else "-"
            shares = sizes.describe() if sizes and sizes.batches else ""
            if sizes is not None and sizes.source == "header" and shares:
                shares += " (hdr)"
            errors = ", ".join(f"{k}: {v}" for k, v in result.errors.items())
            if result.skipped:
                errors = ", ".join(filter(None, [errors, f"skipped: {result.skipped}"]))
            rows.append(
                f"| {point.key} | {offered} | {variant.label} | {_rate(result.achieved_rate)} | "
                f"{_rate(result.throughput)} | {_ms(result.percentile_ms(50))} | "
                f"{_ms(result.percentile_ms(90))} | {_ms(result.percentile_ms(99))} | {mean} | "
                f"{shares} | {errors} | {result.client_cpu:.0%} |")
    return "\n".join(rows)


def _verdict(ok: bool | None) -> str:
    return "" if ok is None else (" — **met**" if ok else " — **not met**")


def ratios(run: ScenarioRun) -> list[str]:
    """The comparisons the issue's targets name, as sentences."""
    r = run.results
    lines: list[str] = []

    def get(point: str, variant: str) -> loadgen.LoadResult | None:
        return r.get((point, variant))

    low_a, low_f, low_off = get("low", "adaptive"), get("low", "fixed"), get("low", "off")
    if low_a and low_off:
        delta = low_a.percentile_ms(50) - low_off.percentile_ms(50)
        target = run.scenario.name == "accelerator"
        lines.append(f"- low load (1 client): adaptive p50 minus batch-off p50 = {delta:+.2f} ms "
                     f"({_ms(low_a.percentile_ms(50))} vs {_ms(low_off.percentile_ms(50))})"
                     + (" (target ≤ +2 ms)" + _verdict(delta <= 2.0) if target else ""))
    if low_f and low_off:
        delta = low_f.percentile_ms(50) - low_off.percentile_ms(50)
        lines.append(f"- low load (1 client): fixed p50 minus batch-off p50 = {delta:+.2f} ms "
                     f"(max_batch_delay {run.scenario.max_batch_delay_ms} ms)")
    sat_a, sat_f, sat_off = (get("saturation", "adaptive"), get("saturation", "fixed"),
                             get("saturation", "off"))
    clients = run.scenario.saturation_clients
    target = run.scenario.name == "accelerator"
    if sat_a and sat_f and sat_f.throughput:
        ratio = sat_a.throughput / sat_f.throughput
        lines.append(f"- saturation ({clients} clients): adaptive / fixed throughput = "
                     f"{ratio:.3f} ({_rate(sat_a.throughput)} vs {_rate(sat_f.throughput)} "
                     "req/s)" + (" (target ≥ 0.95)" + _verdict(ratio >= 0.95) if target else ""))
    if sat_a and sat_off and sat_off.throughput:
        ratio = sat_a.throughput / sat_off.throughput
        lines.append(f"- saturation ({clients} clients): adaptive / batch-off throughput = "
                     f"{ratio:.2f} ({_rate(sat_a.throughput)} vs {_rate(sat_off.throughput)} "
                     "req/s)" + (" (target ≥ 4)" + _verdict(ratio >= 4) if target else ""))
    echo = run.scenario.name == "echo"
    for ts_key in ("torchserve-quiet", "torchserve"):
        sat_ts = get("saturation", ts_key)
        if not (sat_a and sat_ts and sat_ts.throughput):
            continue
        logging = "quiet logging" if ts_key.endswith("quiet") else "default logging"
        ratio = sat_a.throughput / sat_ts.throughput
        lines.append(
            f"- {clients} clients: batchserve adaptive / TorchServe ({logging}) throughput = "
            f"{ratio:.2f} ({_rate(sat_a.throughput)} vs {_rate(sat_ts.throughput)} req/s)"
            + (" (target ≥ 1.5)" + _verdict(ratio >= 1.5) if echo else ""))
        p99_a, p99_ts = sat_a.percentile_ms(99), sat_ts.percentile_ms(99)
        lines.append(
            f"- {clients} clients: p99 batchserve adaptive {_ms(p99_a)} ms vs TorchServe "
            f"({logging}) {_ms(p99_ts)} ms"
            + (" (target ≤ TorchServe's)" + _verdict(p99_a <= p99_ts) if echo else ""))
        low_ts = get("low", ts_key)
        if low_a and low_ts:
            lines.append(f"- low load (1 client): p50 batchserve adaptive "
                         f"{_ms(low_a.percentile_ms(50))} ms vs TorchServe ({logging}) "
                         f"{_ms(low_ts.percentile_ms(50))} ms")
    if echo and sat_a:
        lines.append(f"- echo at {clients} clients: batchserve adaptive "
                     f"{_rate(sat_a.throughput)} req/s (goal ≥ 10,000)"
                     + _verdict(sat_a.throughput >= 10_000))
    return lines


def plot(run: ScenarioRun, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    open_points = [p for p in run.points if p.fraction is not None]
    figure, axes = plt.subplots(figsize=(9, 6.5), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    failed_x: list[float] = []
    failed_y: list[float] = []
    for index, variant in enumerate(run.variants):
        xs, p50, p99 = [], [], []
        for point in open_points:
            result = run.results.get((point.key, variant.key))
            if result is None or not result.latencies_s:
                continue
            xs.append(run.offered[point.key])
            p50.append(result.percentile_ms(50))
            p99.append(result.percentile_ms(99))
            failures = sum(result.errors.values()) + result.skipped
            if failures > 0.01 * max(result.sent + result.skipped, 1):
                failed_x.append(xs[-1])
                failed_y.append(p50[-1])
        if not xs:
            continue
        color = colors[index % len(colors)]
        axes.plot(xs, p50, "o-", color=color, label=variant.label)
        axes.plot(xs, p99, "x--", color=color, alpha=0.8)
    if failed_x:
        axes.scatter(failed_x, failed_y, s=160, facecolors="none", edgecolors="red",
                     linewidths=1.2, label="over 1 % of requests failed or skipped", zorder=3)
    axes.axvline(run.capacity, color="grey", linestyle=":", linewidth=1)
    axes.annotate(f"capacity {run.capacity:,.0f} req/s", (run.capacity, 1.0),
                  xycoords=("data", "axes fraction"), xytext=(-4, -12), ha="right",
                  textcoords="offset points", fontsize=8, color="grey")
    axes.set_xlim(left=0)
    axes.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
    axes.yaxis.set_major_formatter(plain)
    low, high = axes.get_ylim()
    if high / max(low, 1e-9) < 30:
        axes.yaxis.set_minor_formatter(plain)
    else:  # several decades: label 2 and 5 of each
        axes.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(
            lambda value, _: f"{value:g}" if f"{value:.0e}"[0] in "25" else ""))
    axes.set_xlabel("offered load, req/s (Poisson arrivals; capacity = adaptive at "
                    f"{run.scenario.saturation_clients} clients)")
    axes.set_ylabel("latency, ms (p50 solid, p99 dashed)")
    s = run.scenario
    axes.set_title(f"{s.name}: latency vs offered load (batch_size {s.batch_size}, "
                   f"max_batch_delay {s.max_batch_delay_ms} ms, 1 worker)", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    # Below the axes: inside, it would hide the points of an overloaded server.
    axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2,
                frameon=False)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def environment(argv: Sequence[str]) -> str:
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return (f"`{shlex.join(['python', '-m', 'benchmarks.suite', *argv])}` — "
            f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, commit {commit}, "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"load average {load[0]:.1f} at start")


def report(run: ScenarioRun, settings: Settings, plot_path: Path | None) -> str:
    s = run.scenario
    duration, warmup = settings.timing(s)
    capacity = run.capacity_result
    lines = [
        f"### {s.name}",
        "",
        f"{s.about}. batch_size {s.batch_size}, max_batch_delay {s.max_batch_delay_ms} ms, one "
        f"worker per model, {settings.transport.upper()}; {warmup:g} s warm-up + {duration:g} s "
        f"measured per point"
        + (f", median of {settings.repeat} interleaved runs" if settings.repeat > 1 else "")
        + f". Capacity (adaptive, closed loop, {s.saturation_clients} clients): "
        f"**{run.capacity:,.1f} req/s**"
        + (f" (p99 {_ms(capacity.percentile_ms(99))} ms)" if capacity else "")
        + f". Offered loads are fractions of it. Run took {run.elapsed_s / 60:.1f} min.",
    ]
    if s.name == "accelerator":
        lines[-1] += (f" Handler cost a={settings.env['BENCH_ACCEL_OVERHEAD_MS']} ms, "
                      f"b={settings.env['BENCH_ACCEL_PER_ITEM_MS']} ms per item.")
    lines += ["", table(run), "", "Targets and ratios:", "", *ratios(run), ""]
    if plot_path is not None:
        try:
            shown = plot_path.relative_to(HERE)
        except ValueError:
            shown = plot_path
        lines += [f"![{s.name}: latency vs offered load]({shown})", ""]
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], default="accelerator")
    parser.add_argument("--with-torchserve", action="store_true",
                        help="also TorchServe 0.12 (default and quiet logging), from "
                             ".venv-torchserve (made on first use)")
    parser.add_argument("--duration", type=float,
                        help="measured seconds per point (default: 10; resnet152 30)")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds before each point")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: loads {', '.join(f'{f:.0%}%' for f in QUICK_FRACTIONS)}"
                             ", 1 + 3 s per point (resnet152 5 + 10)")
    parser.add_argument("--fractions", type=float, nargs="+",
                        help=f"open-loop loads, fractions of capacity (default "
                             f"{' '.join(map(str, FRACTIONS))})")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per point and server, interleaved; the median is reported "
                             "(by throughput closed-loop, by p50 open-loop)")
    parser.add_argument("--transport", choices=["http", "grpc"], default="http")
    parser.add_argument("--grpc-channels", type=int, default=1)
    parser.add_argument("--max-in-flight", type=int, default=256,
                        help="open loop: most outstanding requests")
    parser.add_argument("--accel-overhead-ms", type=float, default=20.0,
                        help="accelerator: a, the cost of a batch")
    parser.add_argument("--accel-per-item-ms", type=float, default=1.0,
                        help="accelerator: b, the cost of each request in a batch")
    parser.add_argument("--out", type=Path, help="append the markdown report to this file")
    parser.add_argument("--plot-dir", type=Path, default=HERE,
                        help="where latency_vs_load_<scenario>.png go (default benchmarks/)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    fractions = tuple(args.fractions) if args.fractions else (
        QUICK_FRACTIONS if args.quick else FRACTIONS)
    if any(not 0 < f <= 5 for f in fractions):
        parser.error("fractions must be within (0, 5]")
    if not 1 <= args.repeat <= 9:
        parser.error("--repeat must be within 1..9")
    settings = Settings(
        quick=args.quick, duration_s=args.duration, warmup_s=args.warmup,
        fractions=fractions, transport=args.transport, grpc_channels=args.grpc_channels,
        max_in_flight=args.max_in_flight, repeat=args.repeat, progress=not args.no_progress,
        env={"BENCH_ACCEL_OVERHEAD_MS": f"{args.accel_overhead_ms:g}",
             "BENCH_ACCEL_PER_ITEM_MS": f"{args.accel_per_item_ms:g}"})
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    header = f"## Batching benchmarks{' (quick)' if args.quick else ''}\n\n{environment(argv)}\n"
    print(header, flush=True)
    if args.out:
        with args.out.open("a") as out:
            out.write("\n" + header + "\n")
    for name in names:
        run = run_scenario(SCENARIOS[name], settings, args.with_torchserve)
        plot_path = None if args.no_plot else plot(
            run, args.plot_dir / f"latency_vs_load_{name}.png")
        text = report(run, settings, plot_path)
        print(text, flush=True)
        if args.out:
            with args.out.open("a") as out:
                out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
