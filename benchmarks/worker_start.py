"""How fast workers come up: forked from the fork server (``worker_start=fork``, the default)
against a fresh interpreter each (``worker_start=spawn``, how workers started before).

With the ResNet-152 example (examples/image_classifier/resnet_152_batch, seeded random
weights), for each mode and round, one server started with ``torchserve --start``:

* ``torchserve --start`` to the first answer (one worker, loaded at start);
* scaling 1 -> 4 workers until all four are READY (``synchronous=true`` answers then);
* a SIGKILL of the only worker until the model answers again;
* the whole server's proportional set size (the frontend, the fork server and the workers,
  from /proc/PID/smaps_rollup: shared pages count once) with 1 and 4 workers;
* with ``--throughput S``: the restarted worker's throughput and p99 over S seconds (8
  clients, batch_size 8, max_batch_delay 10 ms), forked against fresh.

    .venv/bin/python -m benchmarks.worker_start --rounds 2 --throughput 10

The machine this ran on is small and shared: numbers are noisy; compare modes of one run.
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
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import psutil

from benchmarks.load import run_load
from benchmarks.resnet152 import EXAMPLE, IMAGES, MODEL, ROOT, build_archive
from benchmarks.servers import Batchserve

IMAGE = (EXAMPLE / "kitten.jpg").read_bytes()
MODES = ("spawn", "fork")
SCALE_TO = 4
TIMEOUT_S = 300.0


def predict(server: Batchserve, timeout_s: float = 120.0) -> int:
    """One prediction's status (0: no answer, the connection failed)."""
    request = urllib.request.Request(f"{server.inference}/predictions/{MODEL}", data=IMAGE,
                                     method="POST", headers={"Content-Type": "image/jpeg"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def until_answered(server: Batchserve, since: float) -> float:
    """Seconds from ``since`` until a prediction is answered 200."""
    while time.monotonic() - since < TIMEOUT_S:
        status = predict(server)
        if status == 200:
            return time.monotonic() - since
        if 400 <= status < 500:
            raise AssertionError(f"the prediction was refused ({status})")
        time.sleep(0.02)
    raise TimeoutError("the model never answered")


def scale(server: Batchserve, workers: int) -> None:
    query = urllib.parse.urlencode({"min_worker": workers, "max_worker": workers,
                                    "synchronous": "true"})
    request = urllib.request.Request(f"{server.management}/models/{MODEL}?{query}",
                                     method="PUT")
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        response.read()


def workers(server: Batchserve) -> list[dict[str, object]]:
    return list(server.describe(MODEL)["workers"])  # type: ignore[call-overload]


def pss_mib(root_pid: int) -> float:
    """The proportional set size of ``root_pid`` and all its descendants, in MiB."""
    total_kib = 0
    processes = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    for process in processes:
        try:
            text = Path(f"/proc/{process.pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Pss:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024


def one_round(store: Path, mode: str, throughput_s: float) -> dict[str, object]:
    properties = (f"worker_start={mode}\nload_models={MODEL}.mar\n"
                  "default_workers_per_model=1\nbatch_size=8\nmax_batch_delay=10\n")
    server = Batchserve(store, properties)
    started = time.monotonic()
    with server:
        first_answer_s = until_answered(server, started)
        pid = int(server.state["pid"])  # type: ignore[call-overload]
        pss_1 = pss_mib(pid)
        [first] = workers(server)
        since = time.monotonic()
        scale(server, SCALE_TO)
        scale_s = time.monotonic() - since
        described = workers(server)
        assert [w["status"] for w in described] == ["READY"] * SCALE_TO, described
        pss_4 = pss_mib(pid)
        scale(server, 1)
        [only] = workers(server)
        since = time.monotonic()
        os.kill(int(only["pid"]), signal.SIGKILL)  # type: ignore[call-overload]
        recover_s = until_answered(server, since)
        [back] = workers(server)
        served: dict[str, float] = {}
        if throughput_s:
            load = run_load(f"{server.inference}/predictions/{MODEL}", IMAGES, concurrency=8,
                            duration_s=throughput_s, warmup_s=3.0, content_type="image/jpeg")
            served = {"req_per_s": round(load.throughput, 2),
                      "p99_ms": round(load.percentile_ms(99), 1)}
    return {
        "mode": mode,
        "start_to_first_answer_s": round(first_answer_s, 2),
        "scale_1_to_4_s": round(scale_s, 2),
        "sigkill_to_answer_s": round(recover_s, 2),
        "pss_1_worker_mib": round(pss_1),
        "pss_4_workers_mib": round(pss_4),
        "start_modes": sorted({str(w.get("startMode")) for w in described}),
        "throughput_after_kill": served,
        "load_time_ms": {"first": first.get("loadTimeMs"),
                         "scaled": [w.get("loadTimeMs") for w in described[1:]],
                         "after_kill": back.get("loadTimeMs")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--model-store", type=Path, default=ROOT / "model_store")
    parser.add_argument("--throughput", type=float, default=0.0,
                        help="seconds of load on the restarted worker (0: none)")
    parser.add_argument("--out", type=Path, default=None, help="also write the rounds as JSON")
    args = parser.parse_args()
    build_archive(args.model_store)
    rows = []
    for round_number in range(args.rounds):
        for mode in args.modes.split(","):  # alternated: load drifts hit both alike
            row = one_round(args.model_store, mode, args.throughput)
            row["round"] = round_number + 1
            rows.append(row)
            print(json.dumps(row), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT, check=False).stdout.strip()
    print(f"\nload average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}, commit {commit}")
    print("| measure | " + " | ".join(args.modes.split(",")) + " |")
    print("| --- |" + " --- |" * len(args.modes.split(",")))
    for key in ("start_to_first_answer_s", "scale_1_to_4_s", "sigkill_to_answer_s",
                "pss_1_worker_mib", "pss_4_workers_mib"):
        cells = []
        for mode in args.modes.split(","):
            values = [float(row[key]) for row in rows if row["mode"] == mode]  # type: ignore[arg-type]
            cells.append(f"{statistics.median(values):g} ({', '.join(f'{v:g}' for v in values)})")
        print(f"| {key} | " + " | ".join(cells) + " |")
    for key in ("req_per_s", "p99_ms"):
        cells = []
        for mode in args.modes.split(","):
            values = [float(row["throughput_after_kill"][key])  # type: ignore[index]
                      for row in rows if row["mode"] == mode and row["throughput_after_kill"]]
            cells.append(f"{statistics.median(values):g} ({', '.join(f'{v:g}' for v in values)})"
                         if values else "-")
        print(f"| {key} (restarted worker) | " + " | ".join(cells) + " |")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
