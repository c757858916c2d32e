"""Workflows (``/wfpredict``) under load: batchserve against TorchServe 0.12, same ``.war``.

TorchServe's users report its workflows going unresponsive at about 100 requests/s
(pytorch/serve#1581) and stuck beyond 14 concurrent requests (#3069). This benchmark drives
both servers with the same archives, built once by TorchServe's own tools
(``torch-model-archiver`` 0.12, ``torch-workflow-archiver`` 0.2.15), at and beyond those
loads, and reports per server and load: successful requests/s, p50/p99 latency, errors and
timeouts, and batchserve's mean batch size at every node; then the batchserve/TorchServe
ratios.

The workflows (``benchmarks/handlers/``): a small MLP classifier over 64 features (seeded
random weights, the archive's serialized file) in

* ``wf_seq``, sequential: ``pre`` (function) -> ``classifier`` (model) -> ``post`` (function)
* ``wf_par``, parallel: ``pre`` -> (``classifier_a``, ``classifier_b``) -> ``ensemble``

each node with batch-size 8, max-batch-delay 10 ms, one worker, timeout-ms 10000. Before any
load, the same requests go to both servers one at a time and their answers are compared: a
difference is reported (and fails the run).

Loads, each run for every server back to back (the order rotates from load to load, so that
the machine's drift favours no one): closed loops of ``--clients`` concurrent clients (each
sends its next request on its answer), then open-loop Poisson arrivals at ``--rates`` per
second (at most ``--max-in-flight`` outstanding; arrivals past that are *skipped*). A request
unanswered after ``--request-timeout`` seconds counts as a timeout. Both servers log quietly
(TorchServe: log4j2 at WARN, access/model/metrics logs off; batchserve: no access log).

``--torchserve-pool N`` adds a second TorchServe whose JVM runs its workflow DAGs on a common
fork-join pool of N threads, as it does on a host with N+1 cores (on a 2-core machine the JVM
gives each workflow request a thread of its own instead); pytorch/serve#3069's stall at ~14
concurrent requests is that pool's size on a 16-core host.

    .venv/bin/python -m benchmarks.workflow                        # about 10 minutes
    .venv/bin/python -m benchmarks.workflow --quick                # about 3 minutes
    .venv/bin/python -m benchmarks.workflow --servers torchserve   # TorchServe alone
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import loadgen
from benchmarks import torchserve as ts

HANDLERS = Path(__file__).resolve().parent / "handlers"
SERVERS = ("batchserve", "torchserve")
#: Node settings of both workflows (the spec's global model settings).
BATCH_SIZE, MAX_BATCH_DELAY_MS, TIMEOUT_MS = 8, 10, 10_000
FEATURES = 64
#: Requests sent to both servers before the load, whose answers must be the same.
CHECKED_REQUESTS = 24
#: How many times a request of that check that failed is sent again.
ANSWER_RETRIES = 2
#: Between two runs, the server just measured is given this long to finish its backlog (a
#: TorchServe past its limit goes on working for requests already answered with an error),
#: until its processes use less than IDLE_CORES: the next server is measured on a quiet machine.
SETTLE_TIMEOUT_S, IDLE_CORES = 30.0, 0.1

#: The global settings both workflows' specs start with.
GLOBAL_SETTINGS = """\
models:
  min-workers: 1
  max-workers: 1
  batch-size: {batch}
  max-batch-delay: {delay}
  retry-attempts: 0
  timeout-ms: {timeout}
"""

SPECS = {
    "wf_seq": GLOBAL_SETTINGS + """
# Sequential: pre (function) -> classifier (model) -> post (function).

  classifier:
    url: wf_classifier_a.mar

dag:
  pre: [classifier]
  classifier: [post]
""",
    "wf_par": GLOBAL_SETTINGS + """
# Parallel: pre -> (classifier_a, classifier_b) -> ensemble (gets both, keyed by node name).

  classifier_a:
    url: wf_classifier_a.mar

  classifier_b:
    url: wf_classifier_b.mar

dag:
  pre: [classifier_a, classifier_b]
  classifier_a: [ensemble]
  classifier_b: [ensemble]
""",
}
#: The model nodes of each workflow (batchserve's metrics name them <workflow>__<node>).
NODES = {"wf_seq": ("pre", "classifier", "post"),
         "wf_par": ("pre", "classifier_a", "classifier_b", "ensemble")}
#: Seeds of the two classifiers' random weights.
WEIGHT_SEEDS = {"wf_classifier_a": 1, "wf_classifier_b": 2}


@dataclass
class Point:
    """One load on one workflow, measured on every server."""

    workflow: str
    load: str  # "8 clients", "100/s"
    clients: int | None = None
    rate: float | None = None
    results: dict[str, loadgen.LoadResult] = field(default_factory=dict)
    batches: dict[str, dict[str, float]] = field(default_factory=dict)  # server -> node -> mean


# -- archives ---------------------------------------------------------------------------------


def build_archives(bin_dir: Path, model_store: Path, workflow_store: Path, scratch: Path) -> None:
    """The classifiers' .mar files (seeded random weights) and the two .war files, all made
    by TorchServe's own archivers."""
    import torch

    spec = importlib.util.spec_from_file_location("wf_classifier", HANDLERS / "wf_classifier.py")
    assert spec is not None and spec.loader is not None
    classifier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(classifier)
    for name, seed in WEIGHT_SEEDS.items():
        torch.manual_seed(seed)
        weights = scratch / f"{name}.pt"
        torch.save(classifier.build().state_dict(), weights)
        ts.archive(bin_dir, model_store, name, HANDLERS / "wf_classifier.py",
                   serialized_file=weights)
    for name, text in SPECS.items():
        spec_file = scratch / f"{name}.yaml"
        spec_file.write_text(text.format(batch=BATCH_SIZE, delay=MAX_BATCH_DELAY_MS,
                                         timeout=TIMEOUT_MS))
        ts.workflow_archive(bin_dir, workflow_store, name, spec_file,
                            HANDLERS / "wf_functions.py")


def bodies(count: int, seed: int) -> list[bytes]:
    """Requests: ``{"features": [64 numbers]}``."""
    rng = random.Random(seed)
    return [json.dumps({"features": [round(rng.gauss(0, 1), 4) for _ in range(FEATURES)]})
            .encode() for _ in range(count)]


# -- servers ----------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    inference: str
    metrics: str | None  # batchserve's Prometheus endpoint, for batch sizes
    pid: int | None  # its main process (its workers are children)

    def settle(self, timeout_s: float = SETTLE_TIMEOUT_S) -> float:
        """Wait until the server's processes use less than ``IDLE_CORES`` of a core (the
        last run's backlog is done), at most ``timeout_s``; the seconds waited."""
        import psutil

        started = time.monotonic()
        if self.pid is None:
            return 0.0
        while time.monotonic() - started < timeout_s:
            try:
                root = psutil.Process(self.pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return 0.0
            before = _cpu_seconds(tree)
            time.sleep(0.5)
            if (_cpu_seconds(tree) - before) / 0.5 < IDLE_CORES:
                break
        return time.monotonic() - started


def _cpu_seconds(processes: Sequence[Any]) -> float:
    import psutil

    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            times = process.cpu_times()
            total += times.user + times.system
    return total


@contextlib.contextmanager
def started(servers: Sequence[str], model_store: Path, workflow_store: Path, pool: int | None,
            log: Callable[[str], None]) -> Iterator[list[Server]]:
    """Start the servers, register both workflows on each, stop them all after."""
    with contextlib.ExitStack() as stack:
        up: list[Server] = []
        for name in servers:
            started_at = time.monotonic()
            if name == "batchserve":
                from benchmarks.servers import Batchserve

                bs = Batchserve(model_store, workflow_store=workflow_store,
                                extra_properties="enable_access_log=false\n"
                                                 "disable_system_metrics=true\n")

                def remove_work(kind: type[BaseException] | None, *_: object,
                                work: Path = bs.work) -> bool:
                    if kind is None:  # a failed run keeps its logs
                        shutil.rmtree(work, ignore_errors=True)
                    return False

                stack.push(remove_work)
                stack.enter_context(bs)
                for workflow in SPECS:
                    bs.register_workflow(f"{workflow}.war", workflow)
                pid = bs.state.get("pid")
                up.append(Server(name, bs.inference,
                                 f"{bs.metrics}/metrics" if bs.metrics else None,
                                 pid if isinstance(pid, int) else None))
            else:
                vmargs = (f"-Djava.util.concurrent.ForkJoinPool.common.parallelism={pool}"
                          if name == "torchserve-pool" else "")
                server = stack.enter_context(
                    ts.TorchServe(model_store, quiet=True, workflow_store=workflow_store,
                                  extra_vmargs=vmargs))
                for workflow in SPECS:
                    server.register_workflow(f"{workflow}.war", workflow)
                up.append(Server(name, server.inference, None, server.pid))
            log(f"{name} is up with {', '.join(SPECS)} in {time.monotonic() - started_at:.0f} s")
        yield up


def post(url: str, body: bytes, timeout_s: float = 30.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def check_answers(servers: Sequence[Server], requests: Sequence[bytes],
                  log: Callable[[str], None]) -> tuple[list[str], list[str]]:
    """Send the same requests to every server, one at a time; the differences found, and the
    failures (a failed request is sent again, twice at most, and compared when it succeeds)."""
    problems, failures = [], []
    for workflow in SPECS:
        answers: dict[str, list[Any]] = {}
        for server in servers:
            answers[server.name] = []
            for index, body in enumerate(requests):
                for attempt in range(1 + ANSWER_RETRIES):
                    status, text = post(f"{server.inference}/wfpredict/{workflow}", body)
                    if status == 200:
                        break
                    failures.append(f"{server.name} {workflow} request {index} (attempt "
                                    f"{attempt + 1}): {status} "
                                    f"{' '.join(text.decode(errors='replace').split())}")
                try:
                    answer: Any = json.loads(text)
                except ValueError:
                    answer = text.decode(errors="replace")
                answers[server.name].append((status, answer))
        reference_name, reference = next(iter(answers.items()))
        same = 0
        for index, expected in enumerate(reference):
            differing = [name for name, got in answers.items() if got[index] != expected]
            if differing:
                problems.append(f"{workflow} request {index}: {reference_name} answered "
                                f"{expected}, " + ", ".join(
                                    f"{name} {answers[name][index]}" for name in differing))
            else:
                same += 1
        log(f"{workflow}: {same}/{len(reference)} answers identical on "
            f"{', '.join(answers)}; first: {reference[0][1]}")
    return problems, failures


def node_batch_means(metrics: str, workflow: str) -> dict[str, tuple[float, float]]:
    """Per node of ``workflow``: batchserve's (batches, requests) so far, from its metrics."""
    histograms = loadgen.scrape_batch_sizes(metrics)
    totals = {}
    for node in NODES[workflow]:
        histogram = histograms.get(f"{workflow}__{node}", {})
        totals[node] = (histogram.get("count", 0.0), histogram.get("sum", 0.0))
    return totals


# -- the run ----------------------------------------------------------------------------------


def measure(point: Point, server: Server, requests: Sequence[bytes], args: argparse.Namespace,
            seed: int) -> None:
    target = loadgen.HttpTarget(f"{server.inference}/wfpredict/{point.workflow}", requests,
                                "application/json")
    before = node_batch_means(server.metrics, point.workflow) if server.metrics else None
    point.results[server.name] = loadgen.run(
        target, clients=point.clients, rate=point.rate, duration_s=args.duration,
        warmup_s=args.warmup, max_in_flight=args.max_in_flight, seed=seed,
        progress=not args.no_progress, label=f"{server.name} {point.workflow} {point.load}",
        request_timeout_s=args.request_timeout)
    if server.metrics and before is not None:
        after = node_batch_means(server.metrics, point.workflow)
        point.batches[server.name] = {
            node: (after[node][1] - before[node][1]) / (after[node][0] - before[node][0])
            if after[node][0] > before[node][0] else math.nan for node in NODES[point.workflow]}


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _errors(result: loadgen.LoadResult) -> str:
    text = ", ".join(f"{status}: {count}" for status, count in result.errors.items())
    if result.skipped:
        text = ", ".join(filter(None, [text, f"skipped: {result.skipped}"]))
    return text or "0"


def report(points: Sequence[Point], servers: Sequence[str], header: str) -> str:
    lines = [header, "",
             "| workflow | load | server | sent/s | ok req/s | p50 ms | p99 ms | errors, "
             "timeouts | mean batch per node |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for point in points:
        for name in servers:
            result = point.results.get(name)
            if result is None:
                continue
            batches = point.batches.get(name)
            batch_text = " ".join(f"{node} {mean:.1f}" for node, mean in batches.items()) \
                if batches else "n/a"
            lines.append(
                f"| {point.workflow} | {point.load} | {name} | {result.achieved_rate:.0f} | "
                f"{result.throughput:.1f} | {_ms(result.percentile_ms(50))} | "
                f"{_ms(result.percentile_ms(99))} | {_errors(result)} | {batch_text} |")
    others = [name for name in servers if name != "batchserve"]
    if "batchserve" in servers and others:
        lines += ["", "Ratios, batchserve / TorchServe (throughput: higher is better for "
                      "batchserve; p99: lower is better):", ""]
        for point in points:
            ours = point.results.get("batchserve")
            for name in others:
                theirs = point.results.get(name)
                if ours is None or theirs is None:
                    continue
                throughput = (ours.throughput / theirs.throughput if theirs.throughput
                              else math.inf)
                p99 = ours.percentile_ms(99) / theirs.percentile_ms(99) \
                    if theirs.latencies_s and ours.latencies_s else math.nan
                lines.append(f"- {point.workflow}, {point.load}: throughput x{throughput:.2f}, "
                             f"p99 x{p99:.2f} (vs {name}; failed or skipped: batchserve "
                             f"{_failed(ours)}, {name} {_failed(theirs)})")
    return "\n".join(lines) + "\n"


def _failed(result: loadgen.LoadResult) -> int:
    return sum(result.errors.values()) + result.skipped


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--torchserve-pool", type=int, metavar="N",
                        help="also a TorchServe whose DAG pool has N threads (a host of N+1 "
                             "cores), e.g. 15")
    parser.add_argument("--workflows", nargs="+", choices=sorted(SPECS), default=list(SPECS))
    parser.add_argument("--clients", type=int, nargs="*", default=[8, 16, 32, 64],
                        help="closed loops: concurrent clients")
    parser.add_argument("--rates", type=float, nargs="*", default=[50, 100, 200, 400],
                        help="open loops: Poisson arrivals per second")
    parser.add_argument("--duration", type=float, default=10.0,
                        help="measured seconds a point (default 10: a node's timeout-ms, "
                             "after which a request whose answer TorchServe lost fails)")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    parser.add_argument("--max-in-flight", type=int, default=256)
    parser.add_argument("--request-timeout", type=float, default=15.0,
                        help="seconds before an unanswered request counts as a timeout")
    parser.add_argument("--quick", action="store_true",
                        help="16 and 64 clients, 100/s; 1 + 4 s a point")
    parser.add_argument("--out", type=Path, help="append the markdown report to this file")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.rates, args.warmup, args.duration = [16, 64], [100.0], 1.0, 4.0
    servers = list(dict.fromkeys(args.servers))
    if args.torchserve_pool:
        servers.append("torchserve-pool")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    command = "python -m benchmarks.workflow " + " ".join(
        argv if argv is not None else sys.argv[1:])
    scratch = Path(tempfile.mkdtemp(prefix="bench-wf-"))
    model_store, workflow_store = scratch / "model_store", scratch / "wf_store"
    model_store.mkdir()
    workflow_store.mkdir()
    points: list[Point] = []
    problems: list[str] = []
    failures: list[str] = []
    started_at = time.monotonic()
    try:
        bin_dir = ts.ensure_venv()
        log("building the archives with TorchServe's torch-model-archiver and "
            "torch-workflow-archiver")
        build_archives(bin_dir, model_store, workflow_store, scratch)
        requests = bodies(64, seed=0)
        with started(servers, model_store, workflow_store, args.torchserve_pool, log) as up:
            problems, failures = check_answers(up, requests[:CHECKED_REQUESTS], log)
            for problem in problems:
                log(f"DIFFERENT ANSWERS: {problem}")
            for failure in failures:
                log(f"failed, sent again: {failure}")
            for workflow in args.workflows:
                points += [Point(workflow, f"{c} clients", clients=c) for c in args.clients]
                points += [Point(workflow, f"{r:g}/s", rate=r) for r in args.rates]
            for server in up:
                server.settle()
            for index, point in enumerate(points):
                shift = index % len(up)
                for server in [*up[shift:], *up[:shift]]:
                    measure(point, server, requests, args, seed=index)
                    waited = server.settle()
                    log(f"  {server.name} {point.workflow} {point.load}: "
                        f"{point.results[server.name].summary()}  (settled in {waited:.1f} s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    header = (f"### Workflows: {', '.join(args.workflows)} ({time.strftime('%Y-%m-%d')})\n\n"
              f"`{command.strip()}` ({platform.node()}: {_cores()} cores; {args.warmup:g} + "
              f"{args.duration:g} s a point; nodes B={BATCH_SIZE}, D={MAX_BATCH_DELAY_MS} ms, "
              f"one worker each; requests time out after {args.request_timeout:g} s; "
              f"{time.monotonic() - started_at:.0f} s in all)")
    header += (f"\n\nAnswers: the same {CHECKED_REQUESTS} requests to each workflow, one at "
               f"a time, on every server: " + ("all identical." if not problems else
                                               f"{len(problems)} differ:"))
    header += "".join(f"\n- {problem}" for problem in problems)
    if failures:
        header += (f"\n\nFailed during that check (and sent again, up to {ANSWER_RETRIES} "
                   "times):" + "".join(f"\n- {failure}" for failure in failures))
    text = report(points, servers, header)
    print(text)
    if args.out:
        with args.out.open("a") as out:
            out.write("\n" + text)
    return 1 if problems else 0


def _cores() -> str:
    try:
        return subprocess.run(["nproc"], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
