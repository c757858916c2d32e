"""GPU discovery (without initialising CUDA in the frontend) and round-robin assignment."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

_DEVICE = re.compile(r"^nvidia\d+$")


def visible_gpu_count(dev: Path = Path("/dev")) -> int:
    """Count NVIDIA GPU device nodes; reading /dev never initialises CUDA."""
    try:
        return sum(1 for entry in dev.iterdir() if _DEVICE.match(entry.name))
    except OSError:
        return 0


class GpuAssigner:
    """Hands out GPU ids round robin across every worker of every model, as TorchServe does."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._next = itertools.count()

    @classmethod
    def detect(cls, number_of_gpu: int | None) -> GpuAssigner:
        visible = visible_gpu_count()
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
