"""How many workers one server may run: a cap per model version and one for the whole server,
so that no registration, scale request, archive, config or snapshot can make the server fork
itself to death (each worker is a process and holds open files of the frontend's).

``max_workers_per_model`` and ``max_workers_per_server`` in config.properties set them; by
default they are what the host allows (``worker_caps``):

* per server: the smaller of the open-file limit (RLIMIT_NOFILE, soft) / 2 /
  ``FDS_PER_WORKER`` (half the descriptors stay for clients, listeners, logs and archives)
  and the memory this process may use (the host's, or its cgroup's limit when lower) /
  ``MEMORY_PER_WORKER_BYTES``;
* per model: ``WORKERS_PER_CORE`` x the CPU cores this process may use (or the GPUs, when
  there are more), at least ``default_workers_per_model``, within the server's cap.

A request over a cap is refused whole (400, ``TooManyWorkers``), before any worker starts.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

import psutil

from frontend.config import ServerConfig
from frontend.errors import TooManyWorkers

#: The frontend's descriptors per worker: its socket, its stdout and stderr pipes, and one
#: more (measured with forked workers).
FDS_PER_WORKER = 4
#: What one worker is taken to need: a Python interpreter with torch imported, before any
#: weights (a forked worker shares part of it with the fork server).
MEMORY_PER_WORKER_BYTES = 256 * 1024 * 1024
#: Workers per CPU core (or GPU) one model may have by default: more than one keeps a core
#: busy while another worker waits on I/O.
WORKERS_PER_CORE = 4
#: Memory limits of a cgroup (v2, then v1): a container's.
CGROUP_MEMORY_LIMITS = (Path("/sys/fs/cgroup/memory.max"),
                        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


@dataclass(frozen=True, slots=True)
class HostLimits:
    """What bounds the workers of this process."""

    #: RLIMIT_NOFILE's soft limit (None: unlimited).
    open_files: int | None
    memory_bytes: int
    cores: int
    gpus: int

    @classmethod
    def detect(cls, cores: int, gpus: int) -> HostLimits:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return cls(None if soft == resource.RLIM_INFINITY else soft, _memory_bytes(),
                   cores, gpus)

    def server_workers(self) -> int:
        """The default per-server cap (see the module's docstring)."""
        by_memory = self.memory_bytes // MEMORY_PER_WORKER_BYTES
        by_files = by_memory if self.open_files is None \
            else self.open_files // 2 // FDS_PER_WORKER
        return max(1, min(by_files, by_memory))

    def explain(self) -> str:
        files = "unlimited" if self.open_files is None else str(self.open_files)
        return (f"open files {files} / 2 / {FDS_PER_WORKER}, memory "
                f"{self.memory_bytes >> 20} MiB / {MEMORY_PER_WORKER_BYTES >> 20} MiB, "
                f"{self.cores} cores x {WORKERS_PER_CORE}")


def _memory_bytes() -> int:
    """The host's memory, or this process's cgroup limit when that is lower."""
    total = int(psutil.virtual_memory().total)
    for path in CGROUP_MEMORY_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


@dataclass(frozen=True, slots=True)
class WorkerCaps:
    """The most workers one model version, and the whole server, may have."""

    per_model: int
    per_server: int
    #: Where they come from, for the log.
    basis: str = ""

    def admit(self, model: str, min_workers: int, max_workers: int, adding: int,
              running: int) -> None:
        """Raise TooManyWorkers unless model ``model`` may have ``min_workers`` to
        ``max_workers`` workers, ``adding`` of them new while ``running`` run on the server
        (its own included)."""
        most = max(min_workers, max_workers)
        if most > self.per_model:
            raise TooManyWorkers(
                f"model {model}: {most} workers is more than max_workers_per_model allows "
                f"({self.per_model} workers per model on this server)")
        if adding > 0 and running + adding > self.per_server:
            raise TooManyWorkers(
                f"model {model}: {adding} more workers would make {running + adding} on this "
                f"server, more than max_workers_per_server allows ({self.per_server}); "
                f"{running} run now")


def worker_caps(config: ServerConfig, host: HostLimits) -> WorkerCaps:
    """The caps in force: config.properties' where it sets them, else the host's (see the
    module's docstring); the per-model cap never exceeds the server's."""
    per_server = config.max_workers_per_server or host.server_workers()
    per_model = config.max_workers_per_model or max(
        WORKERS_PER_CORE * max(host.cores, host.gpus), config.default_workers_per_model)
    per_model = min(per_model, per_server)
    basis = (f"at most {per_model} per model (max_workers_per_model"
             f"{'' if config.max_workers_per_model else ', by default'}) and {per_server} on "
             f"this server (max_workers_per_server"
             f"{'' if config.max_workers_per_server else ', by default: ' + host.explain()})")
    return WorkerCaps(per_model, per_server, basis)
