"""What the GPU check measures with, apart from the servers: closed-loop load from several
processes, the GPU's memory and name, and py-spy on a worker.

One Python process cannot post thousands of images a second, so the clients are spread over
processes (each an asyncio load generator, ``benchmarks/loadgen.py``, uvloop and httptools)
that start their warm-up at the same moment and measure the same window; their counts and
latencies are merged.
"""

from __future__ import annotations

import multiprocessing
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import loadgen

#: Seconds the load processes get to start (spawned: they import only the load generator)
#: before their common start.
START_S = 3.0


def start_s(processes: int) -> float:
    """Seconds before the load starts: none when it runs in this process (one part)."""
    return START_S if processes > 1 else 0.0
#: py-spy's samples per second.
PROFILE_RATE = 100


@dataclass
class Load:
    """A closed-loop run's merged outcome."""

    clients: int
    duration_s: float
    completed: int = 0
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)

    @property
    def img_s(self) -> float:
        return self.completed / self.duration_s if self.duration_s else 0.0

    def percentile_ms(self, q: float) -> float:
        return loadgen.percentile(self.latencies_s, q) * 1000

    def summary(self) -> str:
        return (f"{self.clients} clients: {self.img_s:.1f} img/s  p50 "
                f"{self.percentile_ms(50):.1f} ms  p99 {self.percentile_ms(99):.1f} ms  "
                f"statuses {dict(sorted(self.statuses.items()))}")


def _part(args: tuple[str, list[bytes], str, int, float, float, float]) -> tuple[
        int, list[float], dict[str, int]]:
    url, bodies, content_type, clients, duration_s, warmup_s, begin = args
    time.sleep(max(0.0, begin - time.monotonic()))
    target = loadgen.HttpTarget(url, bodies, content_type)
    result = loadgen.run(target, clients=clients, duration_s=duration_s, warmup_s=warmup_s,
                         progress=False)
    return result.completed_in_window, result.latencies_s, dict(result.statuses)


def shares(total: int, parts: int) -> list[int]:
    """``total`` split into at most ``parts`` near-equal positive shares."""
    parts = max(1, min(parts, total))
    return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


def drive(url: str, bodies: Sequence[bytes], *, clients: int, duration_s: float,
          warmup_s: float, processes: int, content_type: str = "image/jpeg") -> Load:
    """``clients`` closed-loop clients posting ``bodies`` (cycled) to ``url``, spread over
    ``processes`` processes, warming up together for ``warmup_s`` and then measuring the
    same ``duration_s`` window."""
    split = shares(clients, processes)
    begin = time.monotonic() + start_s(len(split))
    jobs = [(url, list(bodies), content_type, share, duration_s, warmup_s, begin)
            for share in split]
    if len(jobs) == 1:  # one part: run here, no process to spawn
        parts = [_part(jobs[0])]
    else:
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        with ProcessPoolExecutor(len(jobs), mp_context=context) as pool:
            parts = list(pool.map(_part, jobs))
    merged = Load(clients, duration_s)
    for completed, latencies, statuses in parts:
        merged.completed += completed
        merged.latencies_s.extend(latencies)
        merged.statuses.update(statuses)
    return merged


# -- the GPU ----------------------------------------------------------------------------------


def _nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _smi(query: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,"
                               "nounits", "-i", "0"], capture_output=True, text=True,
                              timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def card_name(device: str) -> str:
    """The GPU's name (``cpu`` for a run on the CPU)."""
    if not device.startswith("cuda"):
        return "cpu"
    nvml = _nvml()
    if nvml is not None:
        try:
            name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0))
            return name.decode() if isinstance(name, bytes) else str(name)
        except Exception:
            pass
    return _smi("name") or "unknown-gpu"


def gpu_memory_mib() -> float | None:
    """Device memory in use on GPU 0, all processes together, in MiB (None: no GPU)."""
    nvml = _nvml()
    if nvml is not None:
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0))
            return float(info.used) / 2**20
        except Exception:
            pass
    text = _smi("memory.used")
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def per_extra_worker(memory: dict[int, float | None]) -> float | None:
    """MiB each worker adds beyond the first, from the memory in use with one worker and
    with the most workers measured (None: not both measured)."""
    first = memory.get(1)
    measured = [count for count, mib in memory.items() if mib is not None and count > 1]
    if first is None or not measured:
        return None
    most = max(measured)
    return (float(memory[most] or 0.0) - first) / (most - 1)


# -- profiles ---------------------------------------------------------------------------------


def start_profile(pid: int, delay_s: float, seconds: float,
                  out: Path) -> subprocess.Popen[bytes] | None:
    """py-spy recording every thread of ``pid`` (idle ones too) into ``out`` for ``seconds``
    after ``delay_s`` (the measured window's); None without py-spy."""
    if shutil.which("py-spy") is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    command = ["py-spy", "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r",
               str(PROFILE_RATE), "-f", "raw", "--threads", "--idle", "--nonblocking", "-o",
               str(out)]
    return subprocess.Popen(["sh", "-c", f'sleep {delay_s:.2f}; exec "$@"', "py-spy",
                             *command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
