"""Where workers run: GPU discovery (without initialising CUDA in the frontend) and
round-robin GPU assignment, and optional CPU-core pinning for CPU inference."""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable
from pathlib import Path

from frontend.config import usable_cores
from frontend.serving.capacity import WorkerCaps

_DEVICE = re.compile(r"nvidia\d+")


#: TorchServe numbers its workers from port 9000 up; so does each server here.
FIRST_WORKER_ID = 9000


def visible_gpu_count(dev: Path = Path("/dev")) -> int:
    """Count GPUs without initialising CUDA: nvidia-ml-py when installed, else the NVIDIA
    device nodes in /dev."""
    try:
        import pynvml  # nvidia-ml-py: optional
    except ImportError:
        pass
    else:
        try:
            pynvml.nvmlInit()
            try:
                return int(pynvml.nvmlDeviceGetCount())
            finally:
                pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    try:
        return sum(1 for entry in dev.iterdir() if _DEVICE.fullmatch(entry.name))
    except OSError:
        return 0


class GpuAssigner:
    """Hands out GPU ids round robin across every worker of every model, as TorchServe does."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._next = itertools.count()

    @classmethod
    def detect(cls, number_of_gpu: int | None, visible: int | None = None) -> GpuAssigner:
        """All ``visible`` GPUs (None: count them), at most ``number_of_gpu``."""
        visible = visible_gpu_count() if visible is None else visible
        return cls(visible if number_of_gpu is None else min(number_of_gpu, visible))

    def next(self, device_ids: tuple[int, ...] = ()) -> int | None:
        """The GPU for the next worker: round robin over all GPUs, or over ``device_ids``
        (a model's ``deviceIds``) when given. None when there is no GPU."""
        if self.count == 0:
            return None
        turn = next(self._next)
        usable = [i for i in device_ids if i < self.count] if device_ids else None
        if usable is not None:
            if not usable:
                raise ValueError(f"deviceIds {list(device_ids)} name no visible GPU "
                                 f"(there are {self.count})")
            return usable[turn % len(usable)]
        return turn % self.count


class CpuAssigner:
    """Gives each new worker its own ``per_worker`` cores, round robin over the cores this
    process may use; workers stay disjoint while workers x per_worker <= cores."""

    def __init__(self, cores: list[int], per_worker: int) -> None:
        if not cores:
            raise ValueError("no CPU cores to assign")
        self.cores = sorted(cores)
        self.per_worker = max(1, min(per_worker, len(self.cores)))
        self._next = itertools.count()

    @classmethod
    def detect(cls, per_worker: int) -> CpuAssigner:
        return cls(sorted(os.sched_getaffinity(0)), per_worker)

    def next(self) -> tuple[int, ...]:
        start = next(self._next) * self.per_worker
        return tuple(self.cores[(start + i) % len(self.cores)] for i in range(self.per_worker))


class Placement:
    """Where one server's new workers run: their ids, GPUs, CPU cores and thread counts, and
    whether they may run at all (the worker caps)."""

    def __init__(self, gpus: GpuAssigner, cpus: CpuAssigner | None,
                 running_workers: Callable[[], int], cores: int | None = None,
                 caps: WorkerCaps | None = None) -> None:
        self.gpus = gpus
        self._cpus = cpus
        self._running = running_workers
        #: The CPU cores this process may use (its affinity, not every core of the host).
        self.cores = usable_cores() if cores is None else cores
        #: The worker caps (None: none, for tests that start no worker).
        self.caps = caps
        self._ids = itertools.count(FIRST_WORKER_ID)

    def room(self) -> int | None:
        """The most workers one more model may start now (None: no caps)."""
        if self.caps is None:
            return None
        return max(0, min(self.caps.per_model, self.caps.per_server - self._running()))

    def admit(self, model: str, min_workers: int, max_workers: int, running: int) -> None:
        """Raise TooManyWorkers unless the model ``model``, which runs ``running`` workers,
        may have ``min_workers`` (to start now) to ``max_workers``. Called with no await
        before the workers start, so that what it counted is still true then."""
        if self.caps is not None:
            self.caps.admit(model, min_workers, max_workers, min_workers - running,
                            self._running())

    def worker_id(self) -> int:
        return next(self._ids)

    def gpu(self, device_ids: tuple[int, ...]) -> int | None:
        return self.gpus.next(device_ids)

    def cpus(self) -> tuple[int, ...] | None:
        return self._cpus.next() if self._cpus is not None else None

    def threads(self, adding: int) -> int:
        """Threads for each of ``adding`` new workers: the cores this process may use, shared
        among every worker of every model on this host (the new ones included)."""
        return max(1, self.cores // max(1, self._running() + adding))
