"""The fork server: ``python -P -m backend.process.forkserver --control-fd N --frontend-pid P``.

One per server, started by the frontend as it starts workers (frontend/serving/forkserver.py):
a process that has imported what workers import (the worker loop, the ``ts`` shim, and, as
models ask, torch, torchvision and their handlers' modules: ``backend.process.preload``) and forks a
new worker on request, so that a worker is up in milliseconds instead of importing torch
again. docs/workers.md has the design and where forking is not used.

Fork safety rests on what this process never does: it runs no torch operation, starts no
thread and opens no GPU context (``unsafe_to_fork`` checks the last two before every fork and
refuses with the reason), and holds no descriptor but its control socket, a wake-up pipe and
a pidfd of the frontend. The child (``backend.process.forked``) resets what it inherited before it
becomes an ordinary worker, and forgets the modules its archive shadows
(``backend.process.shadowing``); where forgetting them cannot make it what a fresh worker would be
(a module it keeps holds one, or one's native code is loaded), the fork server refuses.

Protocol on the control socket (SOCK_SEQPACKET, one frame of ``protos.framing`` a packet)::

    fork server -> HELLO(Hello)                 once its imports are done
    frontend -> FORK(ForkRequest) + 2 fds       fork server -> FORKED(Forked) + the child's pidfd
                                                (or FORKED with ``refused`` and no descriptor)
    fork server -> EXITED(ChildExited)          whenever a child it forked has exited
    frontend -> SHUTDOWN, or closes its end: the fork server exits
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

# NOTE: what every worker imports, imported once here for every worker forked later.
import backend.process.worker
from backend.compat import install_torchserve_shim
from backend.errors import describe
from backend.process import forked, preload, shadowing
from protos import worker_pb2
from protos.framing import Frame, FrameDecoder, Kind, ProtocolError, encode

logger = logging.getLogger("backend.process.forkserver")

#: The largest control packet read (a ForkRequest is a few kilobytes: its environment).
MAX_PACKET_BYTES = 1 << 20
#: As a worker's (backend/process/worker.py): the message alone, on stdout.
LOG_FORMAT = "%(message)s"


@dataclass(frozen=True, slots=True)
class Exit:
    """What a forked child returns up the fork server's stack: the worker's exit status (it
    leaves through the interpreter's normal exit, as a fresh worker does)."""

    code: int


def unsafe_to_fork() -> str:
    """Why this process must not fork a worker now ("" when it may): a child inherits only
    the forking thread, so another thread's locks would stay locked in it forever, and a CUDA
    context does not survive a fork at all."""
    threads = threading.active_count()
    if threads > 1:
        names = ", ".join(sorted(thread.name for thread in threading.enumerate()))
        return f"{threads} threads run in the fork server ({names})"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the fork server"
    device = open_gpu_device()
    if device:
        return f"the fork server holds a GPU device open ({device}): its CUDA driver is initialised"
    return ""


def open_gpu_device() -> str:
    """A GPU device file this process holds open ("" when none): what initialising the CUDA
    driver leaves behind even where torch does not say it is initialised."""
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:
        return ""
    for entry in entries:
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue
        if target.startswith(("/dev/nvidia", "/dev/dri/")):
            return target
    return ""


class ForkServer:
    """The fork server's loop: answer FORK requests, report exited children."""

    def __init__(self, control: socket.socket, frontend_pidfd: int, frontend_pid: int,
                 signals: dict[int, Any]) -> None:
        self._control = control
        self._frontend_pidfd = frontend_pidfd
        self._frontend_pid = frontend_pid
        #: The signal handlers this process had before it changed any (its children's).
        self._signals = signals
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        #: Modules imported (or failed to import) for earlier requests: not tried again.
        self._tried: set[str] = set()
        self._children: set[int] = set()

    def preload(self, names: Sequence[str]) -> None:
        """Import ``names`` (each once): a module that fails to import is the worker's to
        import, and report, itself."""
        for name in names:
            if name in self._tried:
                continue
            self._tried.add(name)
            try:
                importlib.import_module(name)
            except Exception as exc:  # the worker will meet (and report) the same error
                logger.info("not preloaded: %s (%s)", name, describe(exc))
            else:
                logger.info("preloaded %s", name)

    def serve(self) -> int:
        """Answer requests until the frontend says SHUTDOWN or goes; a forked child returns
        from here with its worker's exit status."""
        signal.set_wakeup_fd(self._wake_w)
        signal.signal(signal.SIGCHLD, _ignore)
        self._send(Frame(Kind.HELLO, worker_pb2.Hello(pid=os.getpid()).SerializeToString()))
        while True:
            control = self._control.fileno()
            readable, _, _ = select.select([control, self._wake_r], [], [])
            if self._wake_r in readable:
                self._drain_wakeups()
                self._reap()
            if control not in readable:
                continue
            data, fds, flags, _ = socket.recv_fds(self._control, MAX_PACKET_BYTES, 4)
            if not data:
                logger.info("the frontend closed the control socket; exiting")
                return 0
            outcome = self._obey(data, fds, flags)
            if isinstance(outcome, Exit):
                return outcome.code
            if outcome is None:
                return 0

    def _obey(self, data: bytes, fds: list[int], flags: int) -> Exit | bool | None:
        """One packet: True to go on, None to stop, Exit in a forked child."""
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ProtocolError("a control packet was truncated")
            frames = FrameDecoder().feed(data)
            if len(frames) != 1:
                raise ProtocolError(f"a control packet holds {len(frames)} frames")
            [frame] = frames
        except ProtocolError as exc:
            _close_all(fds)
            logger.error("bad control packet: %s", exc)
            return True
        if frame.kind is Kind.SHUTDOWN:
            _close_all(fds)
            logger.info("shutdown requested; exiting")
            return None
        if frame.kind is not Kind.FORK:
            _close_all(fds)
            logger.error("unexpected frame %s", frame.kind.name)
            return True
        try:
            request = worker_pb2.ForkRequest.FromString(frame.payload)
        except Exception as exc:  # protobuf's DecodeError
            _close_all(fds)
            self._refuse(f"bad FORK payload: {describe(exc)}", lasting=False)
            return True
        if len(fds) != 2:
            _close_all(fds)
            self._refuse(f"a FORK carries 2 descriptors, this one {len(fds)}", lasting=False)
            return True
        return self._fork(request, fds[0], fds[1])

    def _fork(self, request: worker_pb2.ForkRequest, stdout: int, stderr: int) -> Exit | bool:
        try:
            self.preload(preload.modules_for(request.handler, request.model_dir))
            problem = unsafe_to_fork()
            if problem:
                logger.warning("refusing to fork %s: %s", request.name, problem)
                self._refuse(problem, lasting=True)
                return True
            # What of ours its archive shadows: the child drops it, or cannot (it starts fresh).
            shadowed = shadowing.assess(request.model_dir, request.handler,
                                        backend.process.worker.STARTUP_MODULES)
            if shadowed.refusal:
                logger.info("not forking %s: %s", request.name, shadowed.refusal)
                self._refuse(shadowed.refusal, lasting=False)
                return True
            # Nothing buffered may be written twice, once by each process.
            sys.stdout.flush()
            sys.stderr.flush()
            # What exists now is never collected here, nor traversed by the child's collector,
            # whose reference counting would otherwise copy the pages it shares with us.
            gc.freeze()
            pid = os.fork()
        except Exception as exc:  # a failed fork (EAGAIN, ENOMEM): this one starts fresh
            _close_all([stdout, stderr])
            self._refuse(f"fork failed: {describe(exc)}", lasting=False)
            return True
        if pid == 0:
            return Exit(self._become_worker(request, stdout, stderr, shadowed.names))
        _close_all([stdout, stderr])
        self._children.add(pid)
        # Opened before this process reaps the child (only _reap does), so it names this
        # child and no other process that could get its pid later.
        pidfd = os.pidfd_open(pid)
        try:
            self._send(Frame(Kind.FORKED, worker_pb2.Forked(pid=pid).SerializeToString()),
                       [pidfd])
        finally:
            os.close(pidfd)
        logger.info("forked %s as pid %d", request.name, pid)
        return True

    def _become_worker(self, request: worker_pb2.ForkRequest, stdout: int, stderr: int,
                       shadowed: tuple[str, ...]) -> int:
        """In the child: leave the fork server behind and run the worker; its exit status."""
        try:
            inherited = forked.Inherited(
                closing=(self._control.fileno(), self._wake_r, self._wake_w),
                frontend_pidfd=self._frontend_pidfd, frontend_pid=self._frontend_pid,
                signals=self._signals, shadowed=shadowed)
            self._control.detach()  # closed by number in the child, with the others
            return forked.become_worker(request, stdout, stderr, inherited)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
            return 1

    def _refuse(self, reason: str, lasting: bool) -> None:
        self._send(Frame(Kind.FORKED, worker_pb2.Forked(refused=reason, lasting=lasting)
                         .SerializeToString()))

    def _reap(self) -> None:
        while self._children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self._children.clear()
                return
            if pid == 0:
                return
            self._children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            self._send(Frame(Kind.EXITED, worker_pb2.ChildExited(pid=pid, returncode=code)
                             .SerializeToString()))

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _send(self, frame: Frame, fds: Sequence[int] = ()) -> None:
        try:
            socket.send_fds(self._control, [encode(frame)], list(fds))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the frontend is gone: the next read says so


def _ignore(signum: int, frame: object) -> None:
    """SIGCHLD's handler: the wake-up pipe, not this, tells the loop to reap."""


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m backend.process.forkserver",
                                     description="Fork batchserve workers on request.")
    parser.add_argument("--control-fd", type=int, required=True,
                        help="the inherited SOCK_SEQPACKET socket to the frontend")
    parser.add_argument("--frontend-pid", type=int, required=True)
    parser.add_argument("--preload", action="append", default=[],
                        help="a module to import at start (fork_preload); repeatable")
    parser.add_argument("--preload-archive", action="append", default=[], type=Path,
                        help="a model archive (.mar or folder) whose handler's modules to "
                             "import at start (the startup models'); repeatable")
    return parser.parse_args(argv)


def leave(code: int) -> NoReturn:
    """End this process (the fork server, or a worker it forked) after its exit handlers and
    with its output flushed, but without the interpreter's teardown: in a forked worker that
    would touch, and so copy, every page it shares with the fork server, and with torch
    imported it takes seconds."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    # Before this process changes any: what a fresh interpreter's handlers are.
    signals: dict[int, Any] = {int(number): signal.getsignal(number)
                               for number in signal.valid_signals()}
    # Objects made from here on stay until the fork server exits (see gc.freeze in _fork):
    # no collection may leave holes in pages the workers share.
    gc.disable()
    args = parse_args(argv)
    # Only stdio and the control socket are ours: whatever else the frontend's process had
    # open (an event loop's spawn does not close everything) must not reach the workers.
    os.closerange(3, args.control_fd)
    os.closerange(args.control_fd + 1, os.sysconf("SC_OPEN_MAX"))
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stdout)
    if os.getppid() != args.frontend_pid:
        logger.error("started by pid %d, not by the frontend %d", os.getppid(),
                     args.frontend_pid)
        return 2
    frontend_pidfd = os.pidfd_open(args.frontend_pid)
    control = socket.socket(fileno=args.control_fd)
    install_torchserve_shim()
    server = ForkServer(control, frontend_pidfd, args.frontend_pid, signals)
    server.preload(args.preload)
    for archive in args.preload_archive:
        server.preload(preload.modules_for_archive(archive))
    logger.info("ready (worker module %s)", backend.process.worker.__name__)
    return server.serve()


if __name__ == "__main__":
    leave(main())
