"""What the residency benchmark (benchmarks/residency.py) watches from outside the server: the
models whose workers are running (from the operating system, sampled), the server's page-in
metrics and its describe's residency, and TorchServe 0.12's only way to serve a model on
demand (register it, then ask it).

Which model a process serves is read from the files it holds open (``/proc/PID/fd``): the
benchmark's handler (benchmarks/handlers/weights_reader.py) keeps its weights file open for
as long as it lives, so a worker counts from the moment its weights are read until its
process is gone, a stopping one included.
"""

from __future__ import annotations

import math
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import psutil
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.management import ManagementClient

#: The server's residency families (DESIGN36.md's names); page-in time may carry a ``step``
#: label or come as families of their own (``..._page_in_<step>_seconds``).
PAGE_INS = "batchserve_model_page_ins"
EVICTIONS = "batchserve_model_evictions"
PAGE_IN_PREFIX = "batchserve_model_page_in"
MODELS_LOADED = "batchserve_models_loaded"


def weights_open(pid: int, weights: dict[str, str]) -> set[str]:
    """The models (by name) whose weights file process ``pid`` holds open; ``weights`` maps a
    weights file's name to its model (the file's name: the server may serve a model from a
    copy of its folder). Empty when the process is gone."""
    found: set[str] = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        model = weights.get(os.path.basename(target))
        if model is not None:
            found.add(model)
    return found


@dataclass
class Sample:
    at_s: float
    #: Models with at least one process holding their weights open.
    models: frozenset[str]
    #: Processes holding some model's weights open.
    processes: int


@dataclass
class ResidencyWatch:
    """Samples, every ``interval_s`` in a thread of its own, which models have a running
    worker under the server process ``pid`` (the server itself not counted)."""

    pid: int
    weights: dict[str, str]
    interval_s: float = 0.05
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> Sample:
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        models: set[str] = set()
        processes = 0
        for child in children:
            held = weights_open(child.pid, self.weights)
            if held:
                processes += 1
                models |= held
        return Sample(time.monotonic(), frozenset(models), processes)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> ResidencyWatch:
        self._thread = threading.Thread(target=self._run, name="residency-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def most_models(self) -> int:
        return max((len(sample.models) for sample in self.samples), default=0)

    @property
    def most_processes(self) -> int:
        return max((sample.processes for sample in self.samples), default=0)

    def over(self, limit: int) -> int:
        """How many samples saw more than ``limit`` models' workers running."""
        return sum(1 for sample in self.samples if len(sample.models) > limit)


# ---- the server's own account ----------------------------------------------------------------


def scrape(metrics_url: str, timeout_s: float = 30.0) -> str:
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=timeout_s) as response:
        return bytes(response.read()).decode()


def bucket_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float:
    """The ``q`` quantile (0..1) of a histogram's cumulative ``(le, count)`` buckets, linear
    within the bucket that holds it (as Prometheus' histogram_quantile); NaN when empty."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return math.nan
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


@dataclass
class StepTime:
    """One step of a page-in (or the whole: ``total``), summed over models."""

    count: float = 0.0
    sum_s: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)

    @property
    def mean_ms(self) -> float:
        return self.sum_s / self.count * 1000 if self.count else math.nan

    def quantile_ms(self, q: float) -> float:
        return bucket_quantile(list(self.buckets.items()), q) * 1000


@dataclass
class PageInMetrics:
    """The server's page-in account: counters summed over models, page-in time by step."""

    page_ins: float = 0.0
    evictions: float = 0.0
    models_loaded: float | None = None
    steps: dict[str, StepTime] = field(default_factory=dict)
    #: Whether the server exports the families at all (a server without residency does not).
    present: bool = False


def page_in_metrics(text: str) -> PageInMetrics:
    """Read the residency families from a metrics page's text (any labels summed over)."""
    found = PageInMetrics()
    for family in text_string_to_metric_families(text):
        if family.name == PAGE_INS:
            found.page_ins += sum(s.value for s in family.samples if s.name.endswith("_total"))
            found.present = True
        elif family.name == EVICTIONS:
            found.evictions += sum(s.value for s in family.samples if s.name.endswith("_total"))
            found.present = True
        elif family.name == MODELS_LOADED:
            found.models_loaded = sum(s.value for s in family.samples)
            found.present = True
        elif family.name.startswith(PAGE_IN_PREFIX) and family.type == "histogram":
            found.present = True
            own = family.name[len(PAGE_IN_PREFIX):].removesuffix("_seconds").strip("_")
            for sample in family.samples:
                step = sample.labels.get("step") or own or "total"
                time_of = found.steps.setdefault(step, StepTime())
                if sample.name.endswith("_count"):
                    time_of.count += sample.value
                elif sample.name.endswith("_sum"):
                    time_of.sum_s += sample.value
                elif sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    time_of.buckets[bound] = time_of.buckets.get(bound, 0.0) + sample.value
    return found


def residency_of(describe: Callable[[str], dict[str, object]], names: Iterable[str]
                 ) -> dict[str, dict[str, object]]:
    """Each model's describe ``residency`` (DESIGN36.md), for those whose describe has one."""
    found = {}
    for name in names:
        residency = describe(name).get("residency")
        if isinstance(residency, dict):
            found[name] = residency
    return found


# ---- TorchServe 0.12: register on demand -----------------------------------------------------


@dataclass
class OnDemand:
    """One model served on demand by TorchServe: registered (synchronously, one worker), asked
    once, unregistered (what makes room again)."""

    model: str
    register_s: float
    first_answer_s: float
    unregister_s: float
    ok: bool


def on_demand(server: ManagementClient, names: Sequence[str], ask: Callable[[str], bool],
              suffix: str = ".mar") -> list[OnDemand]:
    """For each model of ``names`` in turn (its archive: the name and ``suffix``, in the
    server's model store): ``POST /models`` with ``initial_workers=1`` and
    ``synchronous=true``, then one request (``ask``: answered right?), timed together from the
    registration's start (the time to first answer), then ``DELETE /models/{name}``."""
    results = []
    for name in names:
        started = time.perf_counter()
        server.register(f"{name}{suffix}", initial_workers=1)
        registered = time.perf_counter()
        ok = ask(name)
        answered = time.perf_counter()
        server.unregister(name)
        results.append(OnDemand(name, registered - started, answered - started,
                                time.perf_counter() - answered, ok))
    return results

