"""More models than fit (issue 36): 24 models of 33 MB weights served by one batchserve that
keeps at most 6 loaded, under Zipf(1.0) traffic from 8 clients, against the same traffic with
all 24 resident, in one run; and TorchServe 0.12's time to first answer for a model registered
on demand (its only way to serve more models than it holds).

    .venv/bin/python -m benchmarks.residency                      # the issue's figures
    .venv/bin/python -m benchmarks.residency --no-torchserve --requests 100
    .venv/bin/python -m benchmarks.residency --smoke --no-torchserve   # seconds: does it run

The models are one handler (benchmarks/handlers/weights_reader.py: its load reads its whole
weights file, so a page-in costs a real read) with a weights file each of seeded random bytes
(``--weights-mb``), in a model store as unpacked archives. Model ``m00`` is the hottest: a
request goes to the model of rank k with probability proportional to 1/k^s (``--zipf``).

Two batchserves serve the same models, one after the other, each with
``default_workers_per_model=1`` and every model in ``load_models``: ``paged`` adds
``max_loaded_models`` (``--max-loaded``), ``resident`` has no limit (all loaded). Each gets the
same traffic: every client (``--clients``, closed loop: its next request leaves on its answer)
sends its own seeded sequence of ``--requests`` requests, after ``--warmup`` requests of
another sequence that are not counted. Every answer is checked: 200, from the model it named
(the model's name and its weights' checksum in the answer) and to the request it answers (its
body echoed); anything else is counted as wrong and shown.

Meanwhile the models whose workers run are sampled from the operating system every
``--sample-ms`` (a process under the server holding a model's weights file open; the handler
keeps it open for its life), and at the end the server's own account is read: its page-in and
eviction counters and page-in time by step (the metrics page) and each model's residency
(describe). With residency in the server, a few paged-out models are then asked one at a time
on the quiet server (page-in to first answer). On the resident server the last
``--on-demand`` models are unregistered, then each registered again with one worker and asked
once: the same operation TorchServe 0.12 is timed on (its quiet logging, benchmarks/
torchserve.py; its own archiver's archives of the same handler and weights).

A server that ignores ``max_loaded_models`` (before issue 36) serves all models in both runs:
the report says so (its describe has no ``residency``) and its figures are provisional.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import requests

from benchmarks import torchserve
from benchmarks.fronts import started
from benchmarks.loadgen import percentile
from benchmarks.residency_watch import (
    OnDemand,
    PageInMetrics,
    ResidencyWatch,
    on_demand,
    page_in_metrics,
    residency_of,
    scrape,
)
from benchmarks.servers import Batchserve
from model_archiver.packaging import ArchiveFormat, ArchiveOptions, build_archive

ROOT = Path(__file__).resolve().parent.parent
HANDLER = ROOT / "benchmarks" / "handlers" / "weights_reader.py"
MB = 1_000_000
TORCHSERVE = "TorchServe 0.12"


@dataclass(frozen=True)
class Plan:
    """The run's shape (the issue's figures by default)."""

    models: int = 24
    weights_mb: float = 33.0
    max_loaded: int = 6
    clients: int = 8
    requests: int = 300
    warmup: int = 20
    zipf: float = 1.0
    hot: int = 3
    seed: int = 0
    rounds: int = 4
    sample_ms: float = 50.0
    request_timeout_s: float = 120.0
    probes: int = 4
    on_demand: int = 4

    @property
    def names(self) -> list[str]:
        """The models, hottest first."""
        return [f"m{index:02d}" for index in range(self.models)]


def weights_file(name: str) -> str:
    return f"residency-{name}.bin"


def make_models(store: Path, plan: Plan, work: Path) -> dict[str, str]:
    """The models' unpacked archives in ``store``, each with its own seeded weights; returns
    each model's weights checksum (as the handler computes it)."""
    words = int(plan.weights_mb * MB) // 8
    checksums = {}
    for index, name in enumerate(plan.names):
        weights = np.random.default_rng([plan.seed, index]).integers(
            0, 2**64, size=words, dtype=np.uint64, endpoint=False)
        checksums[name] = f"{int(weights.sum(dtype=np.uint64)):016x}"
        path = work / weights_file(name)
        weights.tofile(path)
        build_archive(ArchiveOptions(model_name=name, version="1.0", handler=str(HANDLER),
                                     serialized_file=str(path), export_path=store, force=True,
                                     archive_format=ArchiveFormat.NO_ARCHIVE))
        path.unlink()
    return checksums


def zipf_traffic(plan: Plan, seed: int, count: int) -> list[list[str]]:
    """Each client's sequence of ``count`` models, Zipf(``plan.zipf``) over the ranks."""
    weights = [1 / rank**plan.zipf for rank in range(1, plan.models + 1)]
    return [random.Random(f"{seed}/{client}").choices(plan.names, weights, k=count)
            for client in range(plan.clients)]


@dataclass
class Answer:
    model: str
    latency_s: float
    ok: bool
    problem: str = ""


def ask(session: requests.Session, inference: str, model: str, body: str, checksum: str,
        timeout_s: float) -> Answer:
    """One request, checked: 200, from ``model`` (its name and weights), answering ``body``."""
    started = time.perf_counter()
    try:
        response = session.post(f"{inference}/predictions/{model}", data=body.encode(),
                                timeout=timeout_s)
    except requests.RequestException as error:
        return Answer(model, time.perf_counter() - started, False, f"{type(error).__name__}")
    latency_s = time.perf_counter() - started
    if response.status_code != 200:
        return Answer(model, latency_s, False, f"{response.status_code} {response.text[:200]}")
    try:
        said = response.json()
    except ValueError:
        said = {}
    if said != {"model": model, "checksum": checksum, "echo": body}:
        return Answer(model, latency_s, False, f"wrong answer {response.text[:200]}")
    return Answer(model, latency_s, True)


def drive(inference: str, traffic: list[list[str]], checksums: dict[str, str],
          timeout_s: float) -> tuple[list[Answer], float]:
    """The clients, closed loop, each through its sequence; the answers and the wall time."""
    answers: list[list[Answer]] = [[] for _ in traffic]
    go = threading.Barrier(len(traffic) + 1)

    def client(index: int) -> None:
        with requests.Session() as session:
            go.wait()
            for turn, model in enumerate(traffic[index]):
                answers[index].append(ask(session, inference, model, f"{index}:{turn}",
                                          checksums[model], timeout_s))

    threads = [threading.Thread(target=client, args=(index,), daemon=True)
               for index in range(len(traffic))]
    for thread in threads:
        thread.start()
    go.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    return [answer for mine in answers for answer in mine], time.perf_counter() - started


@dataclass
class Run:
    """One server's run: its answers and what was seen of it."""

    name: str
    limit: int | None
    pid: int = 0
    answers: list[Answer] = field(default_factory=list)
    wall_s: float = 0.0
    most_models: int = 0
    most_processes: int = 0
    samples: int = 0
    samples_over: int = 0
    metrics: PageInMetrics = field(default_factory=PageInMetrics)
    residency: dict[str, dict[str, object]] = field(default_factory=dict)
    probes_ms: list[float] = field(default_factory=list)
    on_demand: list[OnDemand] = field(default_factory=list)
    #: models running (sampled) over time: (seconds since the traffic began, count)
    timeline: list[tuple[float, int]] = field(default_factory=list)

    def latencies_ms(self, models: Sequence[str] | None = None) -> list[float]:
        return [answer.latency_s * 1000 for answer in self.answers
                if answer.ok and (models is None or answer.model in models)]

    def p(self, q: float, models: Sequence[str] | None = None) -> float:
        return percentile(self.latencies_ms(models), q)

    @property
    def wrong(self) -> list[Answer]:
        return [answer for answer in self.answers if not answer.ok]


def _properties(plan: Plan, run: Run) -> str:
    properties = f"default_workers_per_model=1\nload_models={','.join(plan.names)}\n"
    if run.limit is not None:
        properties += f"max_loaded_models={run.limit}\n"
    return properties


def serve(runs: Sequence[Run], store: Path, plan: Plan, checksums: dict[str, str]) -> None:
    """Start a batchserve for each run and send it the warm-up; then the measured traffic in
    ``plan.rounds`` rounds, each round's share of every client's sequence to each server in
    turn (the order alternating: the machine's drift favours neither), each server's workers
    sampled throughout; then read each server's account, probe it, stop it."""
    names = plan.names
    warmup = zipf_traffic(plan, plan.seed + 1, plan.warmup)
    traffic = zipf_traffic(plan, plan.seed, plan.requests)
    servers = [Batchserve(store, extra_properties=_properties(plan, run)) for run in runs]
    with started(servers):
        for run, server in zip(runs, servers, strict=True):
            if plan.warmup:
                drive(server.inference, warmup, checksums, plan.request_timeout_s)
            run.pid = int(server.state["pid"])  # type: ignore[call-overload]
        watches = [ResidencyWatch(run.pid, {weights_file(name): name for name in names},
                                  plan.sample_ms / 1000) for run in runs]
        with contextlib.ExitStack() as watching:
            for watch in watches:
                watching.enter_context(watch)
            for turn in range(plan.rounds):
                share = slice(turn * plan.requests // plan.rounds,
                              (turn + 1) * plan.requests // plan.rounds)
                pairs = list(zip(runs, servers, strict=True))
                for run, server in pairs if turn % 2 == 0 else reversed(pairs):
                    answers, wall_s = drive(server.inference, [mine[share] for mine in traffic],
                                            checksums, plan.request_timeout_s)
                    run.answers += answers
                    run.wall_s += wall_s
        for run, server, watch in zip(runs, servers, watches, strict=True):
            account(run, server, watch, plan, checksums)


def account(run: Run, server: Batchserve, watch: ResidencyWatch, plan: Plan,
            checksums: dict[str, str]) -> None:
    """What was seen of ``run``'s server and what it says of itself; then its probes: the
    paged server's paged-out models asked one at a time, the resident server's coldest
    models unregistered and registered again on demand."""
    names = plan.names
    run.samples, run.most_models = len(watch.samples), watch.most_models
    run.most_processes = watch.most_processes
    if watch.samples:
        began = watch.samples[0].at_s
        run.timeline = [(round(s.at_s - began, 3), len(s.models)) for s in watch.samples]
    run.samples_over = watch.over(plan.max_loaded)
    run.metrics = page_in_metrics(scrape(server.metrics))
    run.residency = residency_of(server.describe, names)
    if run.limit is not None and run.residency:
        run.probes_ms = probe_page_ins(server, run, plan, checksums)
    if run.limit is None and plan.on_demand:
        chosen = names[-plan.on_demand:]
        for name in chosen:
            server.unregister(name)
        run.on_demand = on_demand(server, chosen, _asker(server.inference, checksums, plan),
                                  suffix="")


def _asker(inference: str, checksums: dict[str, str], plan: Plan) -> Callable[[str], bool]:
    """Asks a model at ``inference`` once: answered right?"""

    def asked(name: str) -> bool:
        with requests.Session() as session:
            return ask(session, inference, name, "first", checksums[name],
                       plan.request_timeout_s).ok

    return asked


def probe_page_ins(server: Batchserve, run: Run, plan: Plan, checksums: dict[str, str]
                   ) -> list[float]:
    """On the quiet server, the coldest paged-out models asked one at a time: each request's
    time from sending to its (checked) answer, in ms."""
    paged_out = [name for name in reversed(plan.names)
                 if run.residency.get(name, {}).get("state") == "paged_out"]
    times = []
    with requests.Session() as session:
        for name in paged_out[:plan.probes]:
            answer = ask(session, server.inference, name, "probe", checksums[name],
                         plan.request_timeout_s)
            if not answer.ok:
                run.answers.append(answer)  # counted as wrong with the rest
            times.append(answer.latency_s * 1000)
    return times


def torchserve_on_demand(plan: Plan, checksums: dict[str, str], work: Path
                         ) -> list[OnDemand]:
    """TorchServe 0.12 with the last ``plan.on_demand`` models in its store (its own
    archiver's archives, the same handler and weights), none registered: each registered on
    demand, asked once, unregistered."""
    chosen = plan.names[-plan.on_demand:]
    bin_dir = torchserve.ensure_venv()
    store = work / "ts-store"
    store.mkdir()
    words = int(plan.weights_mb * MB) // 8
    for name in chosen:
        index = plan.names.index(name)
        path = work / weights_file(name)
        np.random.default_rng([plan.seed, index]).integers(
            0, 2**64, size=words, dtype=np.uint64, endpoint=False).tofile(path)
        torchserve.archive(bin_dir, store, name, HANDLER, serialized_file=path,
                           archive_format="zip-store")
        path.unlink()
    with torchserve.TorchServe(store, quiet=True) as server:
        return on_demand(server, chosen, _asker(server.inference, checksums, plan))


# ---- the report -------------------------------------------------------------------------------


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.1f}"  # NaN: nothing measured


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(plan: Plan, runs: Sequence[Run], theirs: list[OnDemand], header: str) -> str:
    paged, resident = runs
    hot = plan.names[:plan.hot]
    in_effect = bool(paged.residency)
    lines = [header, ""]
    if not in_effect:
        lines += ["**PROVISIONAL: this server has no residency (its describe shows none; "
                  "`max_loaded_models` was ignored): both runs served every model loaded.**",
                  ""]
    lines += ["| server | requests | wrong or failed | req/s | p50 ms | p99 ms | "
              f"hottest {plan.hot} p99 ms | others p99 ms | most models running (sampled) | "
              "samples over the limit | page-ins | evictions |", "|---" * 12 + "|"]
    for run in runs:
        others = plan.names[plan.hot:]
        rate = len(run.answers) / run.wall_s if run.wall_s else float("nan")
        paging = (f"{run.metrics.page_ins:.0f} | {run.metrics.evictions:.0f}"
                  if run.metrics.present else "- | -")
        lines.append(
            f"| {run.name} | {len(run.answers)} | {len(run.wrong)} | {rate:.1f} | "
            f"{_ms(run.p(50))} | {_ms(run.p(99))} | {_ms(run.p(99, hot))} | "
            f"{_ms(run.p(99, others))} | {run.most_models} of {plan.models} "
            f"({run.samples} samples) | {run.samples_over if run.limit else '-'} | {paging} |")
    lines += ["", f"**The {plan.hot} hottest models** (ms; ratio = paged p99 / resident p99)",
              "", "| model | share of requests | paged p50 | paged p99 | resident p50 | "
              "resident p99 | ratio |", "|---" * 7 + "|"]
    for label, models in [*((name, [name]) for name in hot), (f"the {plan.hot} together", hot)]:
        share = sum(1 for a in paged.answers if a.model in models) / max(1, len(paged.answers))
        ratio = paged.p(99, models) / resident.p(99, models)
        lines.append(f"| {label} | {share:.0%} | {_ms(paged.p(50, models))} | "
                     f"{_ms(paged.p(99, models))} | {_ms(resident.p(50, models))} | "
                     f"{_ms(resident.p(99, models))} | {ratio:.2f}x |")
    if paged.metrics.steps:
        lines += ["", "**Page-in time by step** (the paged server's "
                  "`batchserve_model_page_in_seconds`; quantiles within its buckets)", "",
                  "| step | count | mean ms | p50 ms | p99 ms |", "|---" * 5 + "|"]
        for step, spent in paged.metrics.steps.items():
            lines.append(f"| {step} | {spent.count:.0f} | {_ms(spent.mean_ms)} | "
                         f"{_ms(spent.quantile_ms(0.5))} | {_ms(spent.quantile_ms(0.99))} |")
    last = [float(r["lastPageInMs"]) for r in paged.residency.values()  # type: ignore[arg-type]
            if isinstance(r.get("lastPageInMs"), (int, float)) and r.get("pageIns")]
    if last:
        lines += ["", f"describe's lastPageInMs over the {len(last)} models paged in: median "
                  f"{_ms(_median(last))}, max {_ms(max(last))}"]
    if paged.probes_ms:
        lines += ["", "Paged-out models asked one at a time on the quiet server (page-in to "
                  f"first answer, ms): {', '.join(_ms(v) for v in paged.probes_ms)}; median "
                  f"{_ms(_median(paged.probes_ms))}"]
    demand = [("batchserve (resident server)", resident.on_demand), (TORCHSERVE, theirs)]
    if any(results for _, results in demand):
        lines += ["", "**A model registered on demand** (`POST /models` with one worker, "
                  "synchronous, then one request; then `DELETE`), seconds", "",
                  "| server | models | register median | first answer median | unregister "
                  "median | each first answer |", "|---" * 6 + "|"]
        for server, results in demand:
            if results:
                lines.append(
                    f"| {server} | {len(results)} | "
                    f"{_median([r.register_s for r in results]):.3f} | "
                    f"{_median([r.first_answer_s for r in results]):.3f} | "
                    f"{_median([r.unregister_s for r in results]):.3f} | "
                    f"{', '.join(f'{r.first_answer_s:.3f}' for r in results)} |")
    lines += ["", "Goals: " + "; ".join(verdicts(plan, runs))]
    for run in runs:
        for answer in run.wrong[:5]:
            lines.append(f"- {run.name}: {answer.model}: {answer.problem}")
    return "\n".join(lines)


def verdicts(plan: Plan, runs: Sequence[Run]) -> list[str]:
    paged, resident = runs
    hot = plan.names[:plan.hot]
    ratio = paged.p(99, hot) / resident.p(99, hot)
    wrong = sum(len(run.wrong) for run in runs)
    return [f"every request answered 200 by the model it named: "
            f"{'yes' if wrong == 0 else f'NO ({wrong} not)'}",
            f"never more than {plan.max_loaded} models' workers running: "
            f"{'yes' if paged.samples_over == 0 else 'NO'} (at most {paged.most_models}, "
            f"{paged.samples} samples)",
            f"the {plan.hot} hottest models' p99 within 2x of resident: "
            f"{'yes' if ratio <= 2 else 'NO'} ({ratio:.2f}x)"]


def rows(plan: Plan, runs: Sequence[Run], theirs: list[OnDemand]) -> dict[str, Any]:
    """Everything measured, for ``--json``."""
    hot = plan.names[:plan.hot]
    return {
        "plan": asdict(plan),
        "residency_in_effect": bool(runs[0].residency),
        "runs": [{
            "name": run.name, "limit": run.limit, "pid": run.pid, "requests": len(run.answers),
            "wrong": len(run.wrong), "problems": [a.problem for a in run.wrong[:20]],
            "wall_s": run.wall_s, "p50_ms": run.p(50), "p99_ms": run.p(99),
            "hot_p99_ms": run.p(99, hot),
            "per_model": {name: {"requests": sum(1 for a in run.answers if a.model == name),
                                 "p50_ms": run.p(50, [name]), "p99_ms": run.p(99, [name])}
                          for name in plan.names},
            "most_models": run.most_models, "most_processes": run.most_processes,
            "samples": run.samples, "samples_over": run.samples_over,
            "timeline": run.timeline,
            "metrics": {"present": run.metrics.present, "page_ins": run.metrics.page_ins,
                        "evictions": run.metrics.evictions,
                        "steps": {step: {"count": spent.count, "mean_ms": spent.mean_ms}
                                  for step, spent in run.metrics.steps.items()}},
            "residency": run.residency, "probes_ms": run.probes_ms,
            "on_demand": [asdict(r) for r in run.on_demand]} for run in runs],
        "torchserve_on_demand": [asdict(r) for r in theirs],
        "hot_p99_ratio": runs[0].p(99, hot) / runs[1].p(99, hot),
        "verdicts": verdicts(plan, runs),
    }


#: Each Plan field is an option (``--weights-mb`` for ``weights_mb``); these say more of some.
HELP = {
    "max_loaded": "the paged server's max_loaded_models",
    "requests": "measured requests per client",
    "warmup": "uncounted requests per client first",
    "zipf": "the exponent s: rank k asked with probability proportional to 1/k^s",
    "hot": "how many of the hottest models' p99 are compared",
    "rounds": "the measured requests in this many rounds, the servers in turn",
    "probes": "paged-out models asked one at a time at the end",
    "on_demand": "models registered on demand on each server",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="More models than fit (issue 36): a "
                                     "residency limit against all resident, and TorchServe "
                                     "0.12's registration on demand")
    for option in dataclasses.fields(Plan):
        default = option.default
        parser.add_argument(f"--{option.name.replace('_', '-')}", type=type(default),
                            default=default, help=f"{HELP.get(option.name, '')} "
                                                  f"(default {default})".strip())
    parser.add_argument("--no-torchserve", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="6 models of 1 MB, at most 3 loaded, 8 requests per client")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.weights_mb, args.max_loaded = 6, 1.0, 3
        args.requests, args.warmup, args.probes, args.on_demand = 8, 2, 1, 1
        args.rounds = 2
    plan = Plan(**{option.name: getattr(args, option.name)
                   for option in dataclasses.fields(Plan)})
    if not (1 <= plan.max_loaded < plan.models <= 100 and 1 <= plan.hot <= plan.max_loaded
            and 0 < plan.weights_mb <= 1000 and 1 <= plan.clients <= 64
            and 1 <= plan.rounds <= plan.requests
            and 0 <= plan.on_demand <= plan.models - plan.max_loaded):
        parser.error("wanted: 1 <= --max-loaded < --models <= 100, 1 <= --hot <= --max-loaded,"
                     " 0 < --weights-mb <= 1000, 1..64 clients, --requests >= 1, "
                     "1 <= --rounds <= --requests, --on-demand <= --models - --max-loaded")
    began, clock = time.time(), time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-residency-"))
    try:
        store = work / "store"
        store.mkdir()
        checksums = make_models(store, plan, work)
        runs = [Run(f"max_loaded_models={plan.max_loaded}", plan.max_loaded),
                Run(f"all {plan.models} resident", None)]
        print(f"{plan.clients} clients x {plan.requests} requests to each of "
              f"{', '.join(run.name for run in runs)}", file=sys.stderr, flush=True)
        serve(runs, store, plan, checksums)
        theirs = [] if args.no_torchserve or not plan.on_demand else torchserve_on_demand(
            plan, checksums, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = (
        f"### Residency: {plan.models} models of {plan.weights_mb:g} MB weights, at most "
        f"{plan.max_loaded} loaded, Zipf({plan.zipf:g}) from {plan.clients} clients\n\n"
        f"{plan.clients} closed-loop clients x {plan.requests} requests (after {plan.warmup} "
        f"uncounted) to each server, in {plan.rounds} rounds taking turns; seed {plan.seed}; "
        f"one worker per model; workers sampled every "
        f"{plan.sample_ms:g} ms; {len(os.sched_getaffinity(0))} cores; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(began))}, "
        f"{time.monotonic() - clock:.0f} s in all")
    print("\n" + report(plan, runs, theirs, header))
    if args.json:
        args.json.write_text(json.dumps(rows(plan, runs, theirs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
