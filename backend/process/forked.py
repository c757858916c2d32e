"""A worker forked by the fork server (backend/process/forkserver.py): what the child resets
before it becomes an ordinary worker, so that it is one a fresh interpreter would have been.

In order: its own session (as ``start_new_session`` gives a fresh worker), the fork server's
modules its archive shadows forgotten (backend/process/shadowing.py: it imports its own, as a fresh
worker would), the fork server's signal handlers undone and its descriptors closed, stdout and
stderr on the pipes the frontend reads for this worker (its lines reach the model log under its
own name), its own environment, CPU cores and thread budget (the math libraries read theirs when
the fork server imported them, so they are told again), random state (torch's, numpy's and
Python's global generators seeded from fresh entropy, as a fresh interpreter seeds them: no two
workers share a stream), fresh log handlers, and a watchdog on the frontend (its parent is the
fork server). Then the usual worker loop (``backend.process.worker.run``).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import random
import signal
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from backend.process import shadowing, worker
from protos import worker_pb2

#: OpenBLAS's (numpy's) thread-count setters, by the names its builds export.
OPENBLAS_SETTERS = ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                    "scipy_openblas_set_num_threads", "openblas_set_num_threads64_")


@dataclass(frozen=True, slots=True)
class Inherited:
    """What the fork server leaves its child that the child must deal with."""

    #: The fork server's own descriptors: closed.
    closing: tuple[int, ...]
    #: A pidfd of the frontend: the watchdog's.
    frontend_pidfd: int
    frontend_pid: int
    #: The signal handlers a fresh interpreter has.
    signals: dict[int, Any]
    #: The fork server's modules its archive shadows: dropped, imported again as needed.
    shadowed: tuple[str, ...] = ()


def become_worker(request: worker_pb2.ForkRequest, stdout: int, stderr: int,
                  inherited: Inherited) -> int:
    """Turn this freshly forked child into the worker ``request`` describes and run it; the
    worker's exit status."""
    os.setsid()
    # First: nothing below may find (and seed, or size) a module its archive has of its own.
    shadowing.drop(inherited.shadowed)
    gc.enable()  # the fork server's objects are frozen: the collector leaves them be
    restore_signals(inherited.signals)
    for fd in inherited.closing:
        _close(fd)
    redirect_output(stdout, stderr)
    os.environ.clear()
    os.environ.update(request.environment)
    if request.cpus:
        os.sched_setaffinity(0, list(request.cpus))
    if request.cpu_threads:
        set_thread_budget(request.cpu_threads)
    reseed()
    reset_logging()
    sys.argv = [sys.argv[0], "--socket", request.socket_path]
    worker.configure_output()
    worker.start_pidfd_watchdog(inherited.frontend_pidfd, inherited.frontend_pid)
    return worker.run(request.socket_path)


def restore_signals(handlers: dict[int, Any]) -> None:
    """The handlers a fresh interpreter has (the fork server's SIGCHLD handler and wake-up
    descriptor undone)."""
    signal.set_wakeup_fd(-1)
    for number, handler in handlers.items():
        if handler is None:  # set outside Python: left as it is
            continue
        try:
            signal.signal(number, handler)
        except (OSError, ValueError):  # SIGKILL, SIGSTOP
            pass


def redirect_output(stdout: int, stderr: int) -> None:
    """stdout and stderr onto the worker's own pipes, stdin from /dev/null: the Python objects
    keep writing to descriptors 1 and 2, which now reach the frontend as this worker's."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in {null, stdout, stderr} - {0, 1, 2}:
        _close(fd)


def set_thread_budget(threads: int) -> None:
    """Size the math libraries' thread pools to ``threads``: OMP_NUM_THREADS and
    MKL_NUM_THREADS in the environment (as a fresh worker gets) were read when the fork
    server loaded those libraries, so torch (OpenMP, MKL) and numpy's OpenBLAS are told."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)  # (it starts a thread: never in the fork server)
    for library in _loaded_openblas():
        for name in OPENBLAS_SETTERS:
            setter = getattr(library, name, None)
            if setter is not None:
                setter.argtypes = [ctypes.c_int]
                setter(threads)
                break


def _loaded_openblas() -> Iterable[ctypes.CDLL]:
    """The OpenBLAS libraries loaded in this process (numpy's)."""
    try:
        with open("/proc/self/maps", "rb") as maps:  # a mapped file's name: any bytes
            paths = {os.fsdecode(line.split()[-1]) for line in maps
                     if b"openblas" in line.lower()}
    except OSError:
        return []
    libraries = []
    for path in sorted(paths):
        if path.startswith("/") and ".so" in path:
            try:
                libraries.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
            except OSError:
                continue
    return libraries


def reseed() -> None:
    """The global generators of Python, numpy and torch seeded from fresh entropy, as a fresh
    interpreter seeds them (torch's default seed is drawn at its import): forked siblings
    must not share a stream. (torch's CUDA generators take the seed when CUDA starts.)"""
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def reset_logging() -> None:
    """No handler of the fork server's: the worker configures its own (its log lines go to
    its stdout, the pipe the frontend reads under its name)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
