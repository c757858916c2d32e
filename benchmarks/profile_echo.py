"""The frontend's µs of Python per echo request, under cProfile: this tree against another
revision, in one run.

    .venv/bin/python -m benchmarks.profile_echo --baseline REV --rounds 2 --duration 10

Each tree's frontend runs in the foreground, in a process of its own, under a small driver
that profiles its event loop (the main thread: all of the frontend's Python) only while wrk
measures: SIGUSR1 starts cProfile, SIGUSR2 stops it and writes its stats. The echo model
(examples/echo, 100-byte bodies) with batch_size 8, max_batch_delay 5 ms, one worker and the
server's defaults otherwise (adaptive policy, access log on, request phases and dispatch
reasons kept), driven by ``wrk -t1 -c16`` for ``--duration`` seconds after a 3-second
warm-up. The trees take turns, round by round, so that a noisy neighbour hits both alike.

Printed per tree and round: the requests wrk counted in the window, the seconds of Python
(cProfile's ``tottime`` summed over every function, C builtins included) and their µs per
request, of which the event path's (every function of frontend/observe/: the metrics, logs,
phases, traces, the facts; and the plane's end, with what was the batcher's and the
exchange's timing before issue 32: ``_EVENT_PATH``) and its share of the window (a window on a
slow minute of the machine is slow everywhere alike); the trees' ratio round by round; then the
functions whose µs per request differ most between the trees (by module and name). cProfile
inflates small calls: compare the trees with each other, not with wrk's throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from benchmarks.wrk_echo import _source_at, echo_setup

ROOT = Path(__file__).resolve().parent.parent
#: Run by each tree's server process: the profiled foreground server.
DRIVER = """
import cProfile, signal, sys
tree, out, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path.insert(0, tree)
profiles = []
def start(*_):
    profiles.append(cProfile.Profile())
    profiles[-1].enable()
def stop(*_):
    profiles[-1].disable()
    profiles[-1].dump_stats(out)
signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
from frontend.cli import main
sys.exit(main(argv))
"""
PROPERTIES = ("inference_address=http://127.0.0.1:0\nmanagement_address=http://127.0.0.1:0\n"
              "metrics_address=http://127.0.0.1:0\ngrpc_inference_port=0\n"
              "grpc_management_port=0\n")


@dataclass
class Window:
    requests: int
    python_s: float
    stats: pstats.Stats

    @property
    def us_per_request(self) -> float:
        return self.python_s / self.requests * 1e6


class ProfiledServer:
    """One tree's frontend in the foreground under the driver, serving the echo model."""

    def __init__(self, label: str, tree: Path, store: Path, work: Path) -> None:
        self.label = label
        self.work = work
        work.mkdir()
        (work / "config.properties").write_text(PROPERTIES)
        env = {**os.environ, "PYTHONPATH": str(tree),
               "BATCHSERVE_STATE_DIR": str(work / "state")}
        self.process = subprocess.Popen(
            [sys.executable, "-c", DRIVER, str(tree), str(work / "window.prof"), "--start",
             "--foreground", "--model-store", str(store), "--ts-config", "config.properties",
             "--enable-model-api", "--disable-token-auth"],
            cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        state = work / "state" / "server.json"
        deadline = time.monotonic() + 120
        while not state.exists():
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise SystemExit(f"{label}: the server did not start")
            time.sleep(0.2)
        self.state = json.loads(state.read_text())
        requests.post(f"{self.state['management']}/models", params={
            "url": "echo.mar", "model_name": "echo", "batch_size": "8",
            "max_batch_delay": "5", "initial_workers": "1", "synchronous": "true"},
            timeout=120).raise_for_status()
        self.url = f"{self.state['inference']}/predictions/echo"

    def window(self, script: Path, duration_s: float) -> Window:
        """wrk for ``duration_s`` while the frontend is profiled."""
        _wrk(self.url, script, 3)  # warm-up, not profiled
        self.process.send_signal(signal.SIGUSR1)
        time.sleep(0.2)  # the driver has started profiling
        served = _wrk(self.url, script, duration_s)
        self.process.send_signal(signal.SIGUSR2)
        profile = self.work / "window.prof"
        deadline = time.monotonic() + 30
        while not profile.exists() or profile.stat().st_size == 0:
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.label}: no profile written")
            time.sleep(0.1)
        time.sleep(0.5)  # written whole
        stats = pstats.Stats(str(profile))
        profile.unlink()
        return Window(served, stats.total_tt, stats)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _wrk(url: str, script: Path, duration_s: float) -> int:
    """Requests wrk -t1 -c16 completed in ``duration_s``."""
    output = subprocess.run(
        ["wrk", "-t1", "-c16", f"-d{duration_s:g}s", "-s", str(script), url],
        check=True, capture_output=True, text=True, timeout=duration_s + 60).stdout
    found = re.search(r"(\d+) requests in", output)
    if found is None:
        raise SystemExit(f"wrk said:\n{output}")
    return int(found.group(1))


#: Outside frontend/observe/, what the event path (its observers and their records) ran in,
#: before issue 32 and since: the plane's end, the batch timing and dispatch counts that were
#: the batcher's, the overhead timing that was the exchange's, the exchange's telling.
_EVENT_PATH = {("plane.py", "end"), ("batching.py", "answer"), ("batching.py", "add"),
               ("exchange.py", "_overhead"), ("exchange.py", "_end"), ("exchange.py", "lost")}


def _event_path_us(window: Window) -> float:
    """µs per request of the event path: every function of frontend/observe/ (metrics, logs,
    timing, traces, the facts' properties and notes), and ``_EVENT_PATH``. Not the facts'
    constructors (observe/events.py: who asked, the call, a batch): they replace the plane's
    own Origin and Call and the batcher's BatchTiming, which the tree before did not count."""
    spent = 0.0
    for (path, _, name), row in window.stats.stats.items():  # type: ignore[attr-defined]
        if ("/frontend/observe/" in path and not (path.endswith("/observe/events.py")
                                                  and name == "__init__")) \
                or (Path(path).name, name) in _EVENT_PATH:
            spent += row[2]
    return spent / window.requests * 1e6


def _per_function(windows: list[Window]) -> dict[str, float]:
    """µs per request of each function (tottime), over ``windows``."""
    served = sum(window.requests for window in windows)
    spent: dict[str, float] = {}
    for window in windows:
        for (path, line, name), row in window.stats.stats.items():  # type: ignore[attr-defined]
            # By module and name, not line: the trees' lines differ.
            key = f"{Path(path).name}({name})" if line else name
            spent[key] = spent.get(key, 0.0) + row[2]
    return {key: seconds / served * 1e6 for key, seconds in spent.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", metavar="REV", required=True,
                        help="the other tree: batchserve as of git revision REV")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--top", type=int, default=12, help="functions listed")
    args = parser.parse_args()
    work, script, store = echo_setup("bench-profile-")
    trees = [("this tree", ROOT), (args.baseline, _source_at(args.baseline, work))]
    servers = [ProfiledServer(label, tree, store, work / f"server{index}")
               for index, (label, tree) in enumerate(trees)]
    windows: dict[str, list[Window]] = {label: [] for label, _ in trees}
    try:
        for round_number in range(args.rounds):
            for server in servers if round_number % 2 == 0 else reversed(servers):
                window = server.window(script, args.duration)
                windows[server.label].append(window)
                print(f"round {round_number + 1}: {server.label}: {window.requests} requests, "
                      f"{window.python_s:.2f} s of Python, "
                      f"{window.us_per_request:.1f} µs/request (the event path "
                      f"{_event_path_us(window):.1f}: "
                      f"{_event_path_us(window) / window.us_per_request:.1%})", flush=True)
    finally:
        for server in servers:
            server.close()
    print()
    for label, _ in trees:
        values = [window.us_per_request for window in windows[label]]
        path = [_event_path_us(window) for window in windows[label]]
        shares = [_event_path_us(window) / window.us_per_request for window in windows[label]]
        print(f"{label}: median {statistics.median(values):.1f} µs/request "
              f"({', '.join(f'{value:.1f}' for value in values)}); the event path "
              f"{statistics.median(path):.1f} ({', '.join(f'{value:.1f}' for value in path)}), "
              f"its share of each window (the machine's speed cancels out) "
              f"{statistics.median(shares):.1%} "
              f"({', '.join(f'{share:.1%}' for share in shares)})")
    ratios = [ours.us_per_request / theirs.us_per_request
              for ours, theirs in zip(*(windows[label] for label, _ in trees), strict=True)]
    print(f"this tree / {args.baseline}, round by round: "
          f"{', '.join(f'{ratio:.2f}' for ratio in ratios)} (median "
          f"{statistics.median(ratios):.2f})")
    ours, theirs = (_per_function(windows[label]) for label, _ in trees)
    print(f"\nfunctions whose µs/request differ most (this tree - {args.baseline}):")
    changed = sorted(set(ours) | set(theirs),
                     key=lambda key: -abs(ours.get(key, 0.0) - theirs.get(key, 0.0)))
    for key in changed[:args.top]:
        print(f"  {ours.get(key, 0.0) - theirs.get(key, 0.0):+6.2f}  "
              f"({ours.get(key, 0.0):.2f} vs {theirs.get(key, 0.0):.2f})  {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
