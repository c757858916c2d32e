"""Soak: HTTP and gRPC load for N minutes while workers are killed and the model is scaled.

    .venv/bin/python -m benchmarks.soak --minutes 10
    .venv/bin/python -m benchmarks.soak --minutes 0.5 --clients 8 --json soak.json

The long form of tests/e2e/test_soak.py. A background batchserve
(``torchserve --start``, benchmarks/servers.py) serves the echo example with ``--workers``
workers and ``--batch-size``; ``--clients`` threads (half HTTP, half gRPC) send unique
payloads and check that each answer carries its own. Every ``--kill-every`` seconds (on
average) a random worker gets SIGKILL; every ``--scale-every`` seconds the model is scaled up
by one worker, and back down the next time. Every ``--report-every`` seconds one line gives
the requests answered, the errors by kind and the frontend's resource use (RSS, open file
descriptors, threads), the workers described and the worker processes really running.

The run stops after ``--minutes``; the exit status is 1 when some request got no answer, a
wrong answer, or an error other than the kills explain ("Worker died"), or when the frontend
ends with more worker processes than it describes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from pathlib import Path

import grpc
import psutil
import requests

from benchmarks.echo import build_echo
from benchmarks.servers import Batchserve
from protos import inference_pb2, inference_pb2_grpc

CLIENT_TIMEOUT_S = 60.0
#: Error kinds a kill explains; any other non-200 answer fails the run.
EXPECTED = {"worker died", "unavailable (503)"}


class Tally:
    """Answers by kind, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kinds: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def add(self, kind: str, example: str = "") -> None:
        with self.lock:
            self.kinds[kind] += 1
            if example and kind not in self.examples:
                self.examples[kind] = example[:300]

    def snapshot(self) -> Counter[str]:
        with self.lock:
            return Counter(self.kinds)


def _classify(status: int, message: str) -> str:
    if status == 500 and "Worker died" in message:
        return "worker died"
    if status == 503:
        return "unavailable (503)"
    if status == 504:
        return "timeout (504)"
    return f"HTTP {status}"


def _payload(client: int, number: int) -> bytes:
    return f"soak-{client}-{number}-{uuid.uuid4().hex}".encode()


def http_client(index: int, url: str, stop: threading.Event, tally: Tally) -> None:
    with requests.Session() as session:
        number = 0
        while not stop.is_set():
            number += 1
            payload = _payload(index, number)
            try:
                answer = session.post(url, data=payload, timeout=CLIENT_TIMEOUT_S)
            except requests.RequestException as exc:
                tally.add("no answer", repr(exc))
                continue
            if answer.status_code == 200:
                tally.add("ok" if answer.content == payload else "wrong answer",
                          f"sent {payload!r}, got {answer.content[:80]!r}")
                continue
            try:
                message = str(answer.json()["message"])
            except (ValueError, KeyError):
                message = answer.text
            tally.add(_classify(answer.status_code, message), message)


def grpc_client(index: int, port: int, stop: threading.Event, tally: Tally) -> None:
    codes = {grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNAVAILABLE: 503,
             grpc.StatusCode.DEADLINE_EXCEEDED: 504}
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        number = 0
        while not stop.is_set():
            number += 1
            payload = _payload(index, number)
            request = inference_pb2.PredictionsRequest(model_name="echo", input={"body": payload})
            try:
                reply = stub.Predictions(request, timeout=CLIENT_TIMEOUT_S)
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
                if code in codes:
                    tally.add(_classify(codes[code], details), details)
                else:
                    tally.add(f"gRPC {code.name}", details)
                continue
            tally.add("ok" if reply.prediction == payload else "wrong answer",
                      f"sent {payload!r}, got {reply.prediction[:80]!r}")


def _describe(server: Batchserve) -> dict[str, object]:
    return server.describe("echo")


def _ready_pids(server: Batchserve) -> list[int]:
    workers = _describe(server)["workers"]
    return [int(w["pid"]) for w in workers  # type: ignore[union-attr]
            if w["status"] == "READY" and int(w["pid"]) > 0]


def _scale(server: Batchserve, workers: int) -> None:
    query = urllib.parse.urlencode({"min_worker": workers, "max_worker": workers,
                                    "synchronous": "true"})
    answer = requests.put(f"{server.management}/models/echo?{query}", timeout=300)
    answer.raise_for_status()


def chaos(server: Batchserve, args: argparse.Namespace, stop: threading.Event,
          events: list[str], rng: random.Random) -> None:
    """Kill a random worker about every kill_every s; scale up/down every scale_every s."""
    started = time.monotonic()
    next_kill = started + rng.uniform(0.5, 1.5) * args.kill_every
    next_scale = started + args.scale_every
    scaled_up = False
    while not stop.wait(0.2):
        now = time.monotonic()
        try:
            if args.kill_every > 0 and now >= next_kill:
                pids = _ready_pids(server)
                if pids:
                    pid = rng.choice(pids)
                    os.kill(pid, signal.SIGKILL)
                    events.append(f"{now - started:7.1f} s  killed worker pid {pid}")
                next_kill = now + rng.uniform(0.5, 1.5) * args.kill_every
            if args.scale_every > 0 and now >= next_scale:
                target = args.workers if scaled_up else args.workers + 1
                _scale(server, target)
                scaled_up = not scaled_up
                events.append(f"{now - started:7.1f} s  scaled to {target} workers")
                next_scale = time.monotonic() + args.scale_every
        except (requests.RequestException, ProcessLookupError) as exc:
            events.append(f"{now - started:7.1f} s  chaos step failed: {exc!r}")


def _backend_children(frontend: psutil.Process) -> list[int]:
    pids = []
    for child in frontend.children(recursive=True):
        try:
            if "backend" in child.cmdline():
                pids.append(child.pid)
        except psutil.Error:
            pids.append(child.pid)  # a zombie counts: nobody reaped it
    return sorted(pids)


def resources(server: Batchserve, frontend: psutil.Process) -> dict[str, object]:
    workers = _describe(server)["workers"]
    with frontend.oneshot():
        rss, fds, threads = frontend.memory_info().rss, frontend.num_fds(), frontend.num_threads()
    return {
        "rss_mib": round(rss / 2**20, 1),
        "fds": fds,
        "threads": threads,
        "workers_described": len(workers),  # type: ignore[arg-type]
        "workers_ready": sum(1 for w in workers if w["status"] == "READY"),  # type: ignore[union-attr]
        "worker_processes": len(_backend_children(frontend)),
    }


def _line(elapsed: float, counts: Counter[str], previous: int,
          interval: float, usage: dict[str, object]) -> str:
    total = sum(counts.values())
    errors = ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()) if kind != "ok")
    return (f"{elapsed:7.1f} s  {total:8d} answered ({(total - previous) / interval:7.1f}/s)  "
            f"errors: {errors or 'none':<40}  RSS {usage['rss_mib']} MiB  fds {usage['fds']}  "
            f"threads {usage['threads']}  workers {usage['workers_ready']}/"
            f"{usage['workers_described']} ready, {usage['worker_processes']} processes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, required=True, help="how long to run")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients")
    parser.add_argument("--grpc-share", type=float, default=0.5,
                        help="fraction of the clients that use gRPC")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-batch-delay", type=int, default=10, help="milliseconds")
    parser.add_argument("--kill-every", type=float, default=30.0,
                        help="mean seconds between worker kills (0: never)")
    parser.add_argument("--scale-every", type=float, default=45.0,
                        help="seconds between scaling up and back down (0: never)")
    parser.add_argument("--report-every", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the reports here too")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    rng = random.Random(seed)

    store = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    build_echo(store)
    with Batchserve(store) as server:
        server.register("echo.mar", batch_size=args.batch_size,
                        max_batch_delay=args.max_batch_delay, initial_workers=args.workers)
        frontend = psutil.Process(int(server.state["pid"]))  # type: ignore[call-overload]
        grpc_port = int(server.state["grpc_inference_port"])  # type: ignore[call-overload]
        url = f"{server.inference}/predictions/echo"
        baseline = resources(server, frontend)
        print(f"soak: {args.minutes} min, {args.clients} clients ({args.grpc_share:.0%} gRPC), "
              f"{args.workers} workers, batch_size {args.batch_size}, seed {seed}")
        print(f"baseline: {baseline}", flush=True)

        tally, events, stop = Tally(), [], threading.Event()
        grpc_clients = round(args.clients * args.grpc_share)
        threads = [threading.Thread(target=grpc_client, args=(i, grpc_port, stop, tally))
                   if i < grpc_clients else
                   threading.Thread(target=http_client, args=(i, url, stop, tally))
                   for i in range(args.clients)]
        threads.append(threading.Thread(target=chaos, args=(server, args, stop, events, rng)))
        reports: list[dict[str, object]] = []
        started = time.monotonic()
        deadline = started + args.minutes * 60
        for thread in threads:
            thread.start()
        previous, shown_events = 0, 0
        try:
            while (now := time.monotonic()) < deadline:
                stop.wait(min(args.report_every, deadline - now))
                counts, usage = tally.snapshot(), resources(server, frontend)
                for event in events[shown_events:]:
                    print(f"  event {event}")
                shown_events = len(events)
                elapsed = time.monotonic() - started
                print(_line(elapsed, counts, previous, args.report_every, usage), flush=True)
                previous = sum(counts.values())
                reports.append({"elapsed_s": round(elapsed, 1), "answers": dict(counts), **usage})
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=CLIENT_TIMEOUT_S + 30)

        # Settle: the workers described are the processes running, no more and no fewer.
        settle_deadline = time.monotonic() + 60
        while time.monotonic() < settle_deadline:
            usage = resources(server, frontend)
            if (usage["workers_ready"] == usage["workers_described"]
                    == usage["worker_processes"]):
                break
            time.sleep(0.5)  # polling a separate process, bounded by settle_deadline
        final = resources(server, frontend)
        counts = tally.snapshot()

    unexplained = {kind: n for kind, n in counts.items() if kind not in ("ok", *EXPECTED)}
    leaked = final["worker_processes"] != final["workers_described"]
    print(f"final: {final}")
    print(f"answers: {dict(counts)}")
    for kind, example in sorted(tally.examples.items()):
        if kind != "ok":
            print(f"  e.g. {kind}: {example}")
    print(f"RSS {baseline['rss_mib']} -> {final['rss_mib']} MiB, fds {baseline['fds']} -> "
          f"{final['fds']}, kills {sum('killed' in e for e in events)}")
    if args.json is not None:
        args.json.write_text(json.dumps({"seed": seed, "args": vars(args) | {"json": str(
            args.json)}, "baseline": baseline, "reports": reports, "final": final,
            "answers": dict(counts), "events": events}, indent=2))
    if unexplained or leaked:
        print(f"FAILED: unexplained answers {unexplained}, leaked worker processes: {leaked}")
        sys.exit(1)


if __name__ == "__main__":
    main()
