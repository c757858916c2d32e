"""What a model version and its workers are doing now, as plain facts: what the metrics page's
gauges and the live page read each time they look (``Model.status()`` makes one; the server
hands the observers a function that lists them)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExecutionStatus:
    """How a worker runs its model's batches, as it reported when it loaded (``Execution`` in
    protos/worker.proto; the worker's word, never the frontend's guess)."""

    #: "cuda_graphs", "padded" or "eager" (a handler that says nothing runs eagerly).
    mode: str = "eager"
    #: The padded batch sizes, ascending (empty: any size).
    buckets: tuple[int, ...] = ()
    #: Why CUDA graphs were asked for and not used ("" otherwise).
    fallback_reason: str = ""
    #: Device memory of the graphs' pool and their static buffers.
    graph_pool_bytes: int = 0
    #: A .pt2 program's kind and batch dimension ("" for any other model).
    program: str = ""

    def fields(self) -> dict[str, object]:
        """As describe and the live page show it (``program`` only for a .pt2 program)."""
        return {"mode": self.mode, "batchBuckets": list(self.buckets),
                "fallbackReason": self.fallback_reason, "graphPoolBytes": self.graph_pool_bytes,
                **({"program": self.program} if self.program else {})}


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker slot now."""

    id: str
    #: Its state's name (READY, STARTING, RESTARTING, ...).
    state: str
    is_up: bool
    #: Batches sent to it and not answered yet.
    in_flight: int
    restarts: int
    pid: int | None
    gpu_id: int | None
    #: time.monotonic() since when it has been on the batch it is on (None: idle).
    working_since: float | None = None
    #: How it runs batches, as its life now (or its last) reported (None: not loaded yet).
    execution: ExecutionStatus | None = None


@dataclass(frozen=True, slots=True)
class DeviceStatus:
    """A model version's share of a device's time (its ``deviceGroup``: docs/devices.md)."""

    group: str
    weight: float
    #: Device seconds its batches took (their measured service times) since it joined.
    device_time_s: float
    #: Its fraction of the device time the group's models used (0 before any).
    share: float
    #: Batches of it on the device now, and its workers' batches waiting for the device.
    running: int = 0
    waiting: int = 0

    def fields(self) -> dict[str, object]:
        """As describe and the live page show it."""
        return {"group": self.group, "weight": self.weight,
                "deviceTimeS": round(self.device_time_s, 6), "share": round(self.share, 4),
                "running": self.running, "waiting": self.waiting}


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """One model version now."""

    name: str
    version: str
    #: TorchServe's words: Healthy, Partial Healthy or Unhealthy.
    health: str
    policy: str
    batch_size: int
    max_batch_delay_ms: int
    queue_depth: int
    queue_capacity: int
    workers: tuple[WorkerStatus, ...] = ()
    #: The batch buckets in effect for its batcher (empty: none; ``Model.buckets``).
    buckets: tuple[int, ...] = ()
    #: Its share of a device group's time (None: it names no ``deviceGroup``).
    device: DeviceStatus | None = None
    #: Whether its workers are up to serve it (issue 36's residency): "loaded", "loading",
    #: "evicting" or "paged_out" (registered, no workers: its next request pages it in). A
    #: server without residency limits keeps every model "loaded".
    residency: str = "loaded"
    #: When a request last used it (``time.time()``; None: not since it was registered).
    last_used: float | None = None

    @property
    def restarts(self) -> int:
        return sum(worker.restarts for worker in self.workers)

    @property
    def in_flight(self) -> int:
        return sum(worker.in_flight for worker in self.workers)


#: Lists the model versions now (the registry's, by the server).
Statuses = Callable[[], Iterable[ModelStatus]]


def no_models() -> Iterable[ModelStatus]:
    """A server without models (the observers' default)."""
    return ()
