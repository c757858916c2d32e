"""Issue 25's numbers in one run: how fast workers come up and how much memory they take,
for batchserve with workers forked from its fork server (``worker_start=fork``, the default),
batchserve with a fresh interpreter each (``worker_start=spawn``, how workers started before)
and TorchServe 0.12, all serving the same ResNet-152 archive file.

    .venv/bin/python -m benchmarks.worker_start            # 2 rounds, 20 s of load: ~8 min
    .venv/bin/python -m benchmarks.worker_start --rounds 1 --throughput 0   # no load phase
    .venv/bin/python -m benchmarks.worker_start --servers batchserve-fork,torchserve

The archive is the example's (examples/image_classifier/resnet_152_batch/build_mar.py:
built-in ``image_classifier`` handler, seeded random weights; built once into
``--model-store``). TorchServe 0.12 (in ``.venv-torchserve``, see benchmarks/torchserve.py)
loads that same ``.mar`` file. In each round each server (``--servers``; the order rotates
from round to round so that the machine's drift favours none) is started once with
``torchserve --start`` and ``load_models`` naming the archive (one worker, batch_size 1;
quiet logging on both), and measured in this order:

* ``start_to_first_answer_s``: ``torchserve --start`` to the first prediction answered 200;
* ``pss_1_worker_mib``: the whole server's proportional set size: the server process and
  every process under it (batchserve's frontend, fork server and workers; TorchServe's Java
  process and its Python workers), from /proc/PID/smaps_rollup, so that pages shared between
  processes count once. Read 1 s after every worker has served requests: bursts of 2 x N
  concurrent predictions until each worker's CPU time (its process and its children's) has
  grown by a prediction's worth since it was READY (``workers_served_before_pss``);
* ``scale_1_to_4_s``: ``PUT /models/{name}?min_worker=4&max_worker=4&synchronous=true``, then
  describe polled until it shows four workers, all READY; then ``pss_4_workers_mib`` and
  ``pss_4_over_1``;
* ``pss_2_workers_mib``: scaled down to 2 (synchronously, then until the two stopped
  workers' processes are gone), so two workers that have served requests;
* ``sigkill_to_ready_s`` and ``sigkill_to_answer_s``: scaled down to 1, SIGKILL of that
  worker (its pid from describe) until describe shows a READY worker in another process, and
  until a prediction is answered 200;
* with ``--throughput S`` (default 20; 0 skips it): the model unregistered and the archive
  registered again under another name with batch_size 8, max_batch_delay 10 and one worker
  (forked, or fresh, as the server starts its workers); ``--clients`` (8) closed-loop clients
  for 5 s of warm-up and S seconds measured: ``req_per_s`` over whole batch cycles (from the
  first batch's answers inside the window to the last answer in it: ``steady_rate``) and
  ``p99_ms`` over every request sent inside the window.

It prints one JSON row per server and round (with the parts of each PSS reading, describe's
``startMode`` and ``loadTimeMs`` where the server has them), then a markdown table of the
medians (each round's value in brackets) with the issue's goals and the ratios fork/spawn
and batchserve fork/TorchServe. Every wait has a deadline; every server is stopped even on an
error, and whatever of its processes outlives the stop is killed by pid. A server that fails
in a round gets an error row, the others go on, and the run exits 1. ``--out FILE`` also
writes the rows as JSON.

The machine this ran on is small and shared: numbers are noisy; compare servers within one
run, and read ``req_per_s`` against the batches it rests on (``bursts_in_window``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import psutil

from benchmarks.load import LoadResult, run_load
from benchmarks.memory import server_pss
from benchmarks.resnet152 import EXAMPLE, IMAGES, MODEL, ROOT, build_archive
from benchmarks.servers import Batchserve
from benchmarks.torchserve import TorchServe

IMAGE = (EXAMPLE / "kitten.jpg").read_bytes()
SERVERS = ("batchserve-fork", "batchserve-spawn", "torchserve")
#: The name the throughput phase registers the archive under (batch_size 8).
BATCHED = f"{MODEL}-batch8"
SCALE_TO = 4
MIB = 1 << 20
#: Deadlines: a start, a scale or a restart of ResNet-152 workers on a small machine.
TIMEOUT_S = 300.0
POLL_S = 0.02
#: CPU seconds a worker spends on one ResNet-152 prediction, at the least: more than an idle
#: worker spends in a burst's time, less than the forward pass (about 0.3-1 s here).
SERVED_CPU_S = 0.15
MAX_BURSTS = 20
#: The throughput phase: warm-up before the window (the new worker's first batch of 8 is
#: slower than the next), and the gap between two answers that parts two bursts of answers.
WARMUP_S = 5.0
BURST_GAP_S = 0.25

Server = Batchserve | TorchServe


def predict(server: Server, model: str, timeout_s: float = 120.0) -> int:
    """One prediction's status (0: no answer, the connection failed)."""
    request = urllib.request.Request(f"{server.inference}/predictions/{model}", data=IMAGE,
                                     method="POST", headers={"Content-Type": "image/jpeg"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def until_answered(server: Server, model: str, since: float) -> float:
    """Seconds from ``since`` until a prediction is answered 200. Refusals other than 404 (a
    model not registered yet) and 5xx (no worker yet) end the wait."""
    status = 0
    while time.monotonic() - since < TIMEOUT_S:
        status = predict(server, model)
        if status == 200:
            return time.monotonic() - since
        if 400 <= status < 500 and status != 404:
            raise AssertionError(f"the prediction was refused ({status})")
        time.sleep(POLL_S)
    raise TimeoutError(f"the model never answered in {TIMEOUT_S:.0f} s (last status {status})")


def scale(server: Server, model: str, workers: int) -> None:
    query = urllib.parse.urlencode({"min_worker": workers, "max_worker": workers,
                                    "synchronous": "true"})
    request = urllib.request.Request(f"{server.management}/models/{model}?{query}",
                                     method="PUT")
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        response.read()


def workers(server: Server, model: str) -> list[dict[str, object]]:
    return list(server.describe(model)["workers"])  # type: ignore[call-overload]


def until_ready(server: Server, model: str, count: int) -> list[dict[str, object]]:
    """Describe's workers once there are ``count`` of them, all READY."""
    deadline = time.monotonic() + TIMEOUT_S
    described: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        described = workers(server, model)
        if len(described) == count and all(w.get("status") == "READY" for w in described):
            return described
        time.sleep(POLL_S)
    raise TimeoutError(f"not {count} READY workers in {TIMEOUT_S:.0f} s: {described}")


def until_replaced(server: Server, model: str, killed: int) -> dict[str, object]:
    """Describe's only worker once it is READY in a process other than ``killed``."""
    deadline = time.monotonic() + TIMEOUT_S
    described: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        described = workers(server, model)
        if (len(described) == 1 and described[0].get("status") == "READY"
                and described[0].get("pid") not in (killed, -1, None)):
            return described[0]
        time.sleep(POLL_S)
    raise TimeoutError(f"no new READY worker in {TIMEOUT_S:.0f} s: {described}")


def pids(described: list[dict[str, object]]) -> list[int]:
    return [int(w["pid"]) for w in described]  # type: ignore[call-overload]


def cpu_s(pid: int) -> float:
    """CPU seconds of a process and of the processes under it (0 when it has gone)."""
    try:
        process = psutil.Process(pid)
        total = 0.0
        for each in (process, *process.children(recursive=True)):
            times = each.cpu_times()
            total += times.user + times.system
        return total
    except (psutil.Error, ValueError):  # ValueError: no pid (describe's -1)
        return 0.0


def serve_every_worker(server: Server, model: str, worker_pids: list[int]) -> int:
    """Bursts of 2 x N concurrent predictions (batch_size 1) until every worker has spent a
    prediction's CPU time since now; returns how many did (all, unless the bursts ran out)."""
    before = {pid: cpu_s(pid) for pid in worker_pids}

    def served() -> int:
        return sum(cpu_s(pid) - before[pid] >= SERVED_CPU_S for pid in worker_pids)

    with ThreadPoolExecutor(2 * len(worker_pids)) as pool:
        for _ in range(MAX_BURSTS):
            statuses = list(pool.map(lambda _: predict(server, model),
                                     range(2 * len(worker_pids))))
            if any(status != 200 for status in statuses):
                raise AssertionError(f"predictions failed: {statuses}")
            if served() == len(worker_pids):
                break
    count = served()
    if count < len(worker_pids):
        print(f"warning: only {count} of {len(worker_pids)} workers served a prediction",
              file=sys.stderr)
    return count


def read_pss(server_pid: int) -> tuple[int, dict[str, object]]:
    """The whole server's Pss in MiB, and its parts: the server process and each process
    under it."""
    time.sleep(1)  # the last answers' buffers freed before reading
    total, own, others = server_pss(server_pid)
    return round(total / MIB), {"server_mib": round(own / MIB),
                                "others_mib": sorted(round(value / MIB) for value in others)}


def until_gone(worker_pids: set[int]) -> None:
    processes = []
    for pid in worker_pids:
        try:
            processes.append(psutil.Process(pid))
        except (psutil.NoSuchProcess, ValueError):  # gone, or no pid (describe's -1)
            pass
    _, alive = psutil.wait_procs(processes, timeout=60)
    if alive:
        raise TimeoutError(f"stopped workers still running: {[p.pid for p in alive]}")


@contextmanager
def started(kind: str, store: Path) -> Iterator[tuple[Server, int, float]]:
    """The server ``kind`` started with the archive loaded (one worker, batch_size 1): the
    server, its root process's pid, and when ``torchserve --start`` was called."""
    server: Server
    if kind == "torchserve":
        server = TorchServe(store, quiet=True, ready_poll_s=POLL_S,
                            extra_properties=[f"load_models={MODEL}.mar"])
    else:
        mode = kind.removeprefix("batchserve-")
        server = Batchserve(store, f"worker_start={mode}\nload_models={MODEL}.mar\n"
                            "default_workers_per_model=1\nenable_access_log=false\n")
    since = time.monotonic()
    with server:  # stops it, even on an error, and kills what is left of it by pid
        if isinstance(server, TorchServe):
            if server.pid is None:
                raise RuntimeError("TorchServe wrote no pid file")
            pid = server.pid
        else:
            pid = int(server.state["pid"])  # type: ignore[call-overload]
        yield server, pid, since


def one_round(kind: str, store: Path, throughput_s: float, clients: int) -> dict[str, object]:
    row: dict[str, object] = {"server": kind}
    with started(kind, store) as (server, server_pid, since):
        row["start_to_first_answer_s"] = round(until_answered(server, MODEL, since), 2)
        [first] = until_ready(server, MODEL, 1)
        served = [serve_every_worker(server, MODEL, pids([first]))]
        pss = {1: read_pss(server_pid)}

        since = time.monotonic()
        scale(server, MODEL, SCALE_TO)
        scaled = until_ready(server, MODEL, SCALE_TO)
        row["scale_1_to_4_s"] = round(time.monotonic() - since, 2)
        served.append(serve_every_worker(server, MODEL, pids(scaled)))
        pss[SCALE_TO] = read_pss(server_pid)

        scale(server, MODEL, 2)
        two = until_ready(server, MODEL, 2)
        until_gone(set(pids(scaled)) - set(pids(two)))
        pss[2] = read_pss(server_pid)

        scale(server, MODEL, 1)
        [only] = until_ready(server, MODEL, 1)
        until_gone(set(pids(two)) - set(pids([only])))
        [victim] = pids([only])
        descendants = {p.pid for p in psutil.Process(server_pid).children(recursive=True)}
        if victim not in descendants:  # never signal a pid that is not this server's worker
            raise AssertionError(f"describe's worker pid {victim} is not under the server")
        since = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        back = until_replaced(server, MODEL, victim)
        row["sigkill_to_ready_s"] = round(time.monotonic() - since, 2)
        row["sigkill_to_answer_s"] = round(until_answered(server, MODEL, since), 2)

        for count in (1, 2, SCALE_TO):
            row[f"pss_{count}_worker{'s' if count > 1 else ''}_mib"] = pss[count][0]
        row["pss_4_over_1"] = round(pss[SCALE_TO][0] / pss[1][0], 2)
        row["pss_detail"] = {str(count): pss[count][1] for count in sorted(pss)}
        row["workers_served_before_pss"] = {"1": served[0], str(SCALE_TO): served[1]}
        row["start_modes"] = sorted({str(w.get("startMode")) for w in [first, *scaled, back]})
        row["load_time_ms"] = {"first": first.get("loadTimeMs"),
                               "scaled": [w.get("loadTimeMs") for w in scaled],
                               "after_kill": back.get("loadTimeMs")}

        if throughput_s:
            server.unregister(MODEL)
            server.register(f"{MODEL}.mar", model_name=BATCHED, batch_size=8,
                            max_batch_delay=10, initial_workers=1)
            [worker] = until_ready(server, BATCHED, 1)
            row["throughput_worker"] = {key: worker.get(key) for key in
                                        ("startMode", "loadTimeMs", "cpuThreads", "cpus")}
            load = run_load(f"{server.inference}/predictions/{BATCHED}", IMAGES,
                            concurrency=clients, duration_s=throughput_s, warmup_s=WARMUP_S,
                            content_type="image/jpeg")
            row.update(steady_rate(load))
    return row


def steady_rate(load: LoadResult) -> dict[str, object]:
    """Throughput and p99 of a closed loop whose answers come in bursts seconds apart (a
    batch of 8 answered at once, every few seconds): answers per second from the first burst
    inside the window to the last answer in it, the first burst's own answers left out, so
    that the rate is over whole batch cycles rather than whichever part of a cycle the window
    cut (counting the answers inside a 10 s window gives a rate off by up to a batch's worth,
    ±30 % here). p99 is over every successful request sent inside the window, answered in it
    or after. ``bursts`` counts the bursts (about the batches) inside the window."""
    start, stop = load.window
    times = sorted(t for t in load.answered_at if start <= t <= stop)
    starts = [i for i in range(len(times)) if i == 0 or times[i] - times[i - 1] > BURST_GAP_S]
    rate = None
    if len(starts) >= 2:  # starts[1]: the first answer after the first burst
        rate = (len(times) - starts[1]) / (times[-1] - times[0])
    ordered = sorted(load.sent_latencies_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] if ordered else None
    return {"req_per_s": round(rate, 2) if rate is not None else None,
            "p99_ms": round(p99 * 1000, 1) if p99 is not None else None,
            "answers_in_window": len(times), "bursts_in_window": len(starts),
            "statuses": {str(k): v for k, v in sorted(load.statuses.items())}}


#: The table's rows: (key, what, the issue's goal).
MEASURES = (
    ("start_to_first_answer_s", "`torchserve --start` to the first answer (s)", "≤ 5 s"),
    ("pss_1_worker_mib", "whole-server PSS, 1 worker (MiB)", ""),
    ("pss_2_workers_mib", "whole-server PSS, 2 workers (MiB)", ""),
    ("pss_4_workers_mib", "whole-server PSS, 4 workers (MiB)", ""),
    ("pss_4_over_1", "PSS 4 workers / 1 worker", "≤ 1.5"),
    ("scale_1_to_4_s", "scale 1 → 4 workers until all READY (s)", "≤ 2 s"),
    ("sigkill_to_ready_s", "SIGKILL of the only worker until a new one is READY (s)", ""),
    ("sigkill_to_answer_s", "SIGKILL of the only worker until answered (s)", "≤ 1 s"),
    ("req_per_s", "req/s, 1 worker, batch_size 8, {clients} clients", "fork = spawn ± 5 %"),
    ("p99_ms", "p99 (ms), same load", "fork = spawn ± 5 %"),
)


def medians(rows: list[dict[str, object]], servers: list[str]
            ) -> dict[str, dict[str, list[float]]]:
    """For each measure and server, the values of its rounds (failed rounds left out)."""
    values: dict[str, dict[str, list[float]]] = {}
    for key, _, _ in MEASURES:
        values[key] = {server: [float(row[key]) for row in rows  # type: ignore[arg-type]
                                if row["server"] == server and row.get(key) is not None]
                       for server in servers}
    return values


def table(rows: list[dict[str, object]], servers: list[str], clients: int) -> str:
    values = medians(rows, servers)
    ratios = [(a, b) for a, b in (("batchserve-fork", "batchserve-spawn"),
                                  ("batchserve-fork", "torchserve"))
              if a in servers and b in servers]
    header = ["measure", *(f"{server}: median (rounds)" for server in servers),
              *(f"{a.removeprefix('batchserve-')} / {b.removeprefix('batchserve-')}"
                for a, b in ratios), "goal"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for key, what, goal in MEASURES:
        cells = [what.format(clients=clients)]
        for server in servers:
            found = values[key][server]
            cells.append(f"{statistics.median(found):g} ({', '.join(f'{v:g}' for v in found)})"
                         if found else "-")
        for a, b in ratios:
            over = statistics.median(values[key][b]) if values[key][b] else 0.0
            cells.append(f"{statistics.median(values[key][a]) / over:.2f}"
                         if values[key][a] and over else "-")
        cells.append(goal)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rotated(servers: list[str], round_number: int) -> list[str]:
    shift = round_number % len(servers)
    return servers[shift:] + servers[:shift]


def run(servers: list[str], rounds: int, store: Path, throughput_s: float, clients: int,
        emit: Callable[[str], None]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for round_number in range(rounds):
        for kind in rotated(servers, round_number):  # load drifts hit every server alike
            try:
                row = one_round(kind, store, throughput_s, clients)
            except Exception as error:  # the other servers still run
                traceback.print_exc()
                row = {"server": kind, "error": f"{type(error).__name__}: {error}"}
            row["round"] = round_number + 1
            rows.append(row)
            emit(json.dumps(row))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"comma-separated, of {', '.join(SERVERS)}")
    parser.add_argument("--model-store", type=Path, default=ROOT / "model_store")
    parser.add_argument("--throughput", type=float, default=20.0,
                        help="seconds of load, 1 worker with batch_size 8 (0: none; a batch "
                        "of 8 takes seconds on a small CPU, so 10 at least)")
    parser.add_argument("--clients", type=int, default=8, help="closed-loop clients")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    servers = args.servers.split(",")
    unknown = set(servers) - set(SERVERS)
    if unknown or not servers or args.rounds < 1:
        parser.error(f"--servers takes some of {', '.join(SERVERS)}; --rounds at least 1")
    build_archive(args.model_store)
    started_at = time.strftime("%Y-%m-%d %H:%M")
    rows = run(servers, args.rounds, args.model_store, args.throughput, args.clients,
               lambda line: print(line, flush=True))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, check=False).stdout.strip()
    command = " ".join(["python -m benchmarks.worker_start", *sys.argv[1:]])
    print(f"\n`{command}` — {started_at}, commit {commit}; load average "
          f"{os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}\n")
    print(table(rows, servers, args.clients))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    failed = [row for row in rows if "error" in row]
    for row in failed:
        print(f"round {row['round']}, {row['server']} failed: {row['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
