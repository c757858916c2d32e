"""The owner's side of its front processes: their links (a Unix socket in the run directory,
0600), starting them, replacing one that dies, stopping them first at a stop. (The gRPC ports
they share are the gRPC servers', ``api/grpc/servers.py``: the fronts are told where.)

A front that exits while the server runs is started again, with a warning naming its exit
status, after a pause that doubles while it keeps dying (``RESTART_DELAYS_S``); its clients'
connections drop with it, and its calls still open are cancelled as hang-ups
(``LinkedPredictions.lost``). At a stop the fronts are sent SIGTERM: they stop accepting, finish
their open requests within ``drain_timeout`` and exit; one still there after that is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from frontend.api.grpc.servers import SharedPort
from frontend.api.http.linked import LinkedPredictions, OwnerLink
from frontend.processes import python_module

logger = logging.getLogger(__name__)

#: The pauses before a front that keeps dying is started again (then the last, each time).
RESTART_DELAYS_S = (0.0, 0.5, 1.0, 2.0, 5.0)
#: A front that ran this long before it died is started again at once.
STABLE_S = 30.0
#: How long the fronts may take to link up at start before the server goes on without them.
START_TIMEOUT_S = 30.0
#: After drain_timeout, how long a front has to exit before it is killed.
EXIT_GRACE_S = 2.0


class Fronts:
    """``count`` - 1 front processes (numbered 1..count-1) beside this one."""

    def __init__(self, count: int, run_dir: Path, settings: dict[str, Any],
                 served: Callable[[], LinkedPredictions]) -> None:
        self.count = count
        self.link_path = run_dir / "front.sock"
        self._settings = {**settings, "link": str(self.link_path)}
        self._served = served
        self._server: asyncio.AbstractServer | None = None
        self._processes: dict[int, asyncio.subprocess.Process] = {}
        self._watchers: list[asyncio.Task[None]] = []
        self._links: dict[int, OwnerLink] = {}
        #: Requests each front brought over its links that are gone.
        self._past: dict[int, int] = dict.fromkeys(range(1, count), 0)
        self._linked = asyncio.Event()
        self._stopping = False

    @staticmethod
    def inner_path(run_dir: Path) -> Path:
        """Where the owner's inner listener is, for the connections the fronts splice."""
        return run_dir / "inner.sock"

    def share_grpc(self, ports: list[SharedPort]) -> None:
        """Before ``start``: the gRPC ports the fronts accept on too, relaying each call to
        its inner server (``frontend/front/relay.py``)."""
        self._settings["grpc"] = [
            {"target": port.target, "inner": port.inner, "tls": port.tls,
             "options": port.options} for port in ports]

    def pids(self) -> list[int]:
        """The fronts' processes now."""
        return [process.pid for process in self._processes.values()
                if process.returncode is None]

    def requests(self) -> dict[int, int]:
        """Requests each front sent over its link (``batchserve_front_requests_total``)."""
        counts = dict(self._past)
        for number, link in self._links.items():
            if link.predictions is not None:
                counts[number] += link.predictions.requests
        return counts

    async def start(self) -> None:
        """Open the link socket, start the fronts, wait until each has linked up."""
        loop = asyncio.get_running_loop()
        self.link_path.unlink(missing_ok=True)
        self._server = await loop.create_unix_server(
            lambda: OwnerLink(self._served, self._hello, self._lost), str(self.link_path))
        self.link_path.chmod(0o600)
        self._watchers = [loop.create_task(self._keep(number))
                          for number in range(1, self.count)]
        try:
            await asyncio.wait_for(self._linked.wait(), START_TIMEOUT_S)
        except TimeoutError:
            logger.warning("front processes: %d of %d linked up within %g s; serving on",
                           len(self._links), self.count - 1, START_TIMEOUT_S)
        else:
            logger.info("front processes: %d beside this one accept on the inference port "
                        "(number_of_netty_threads=%d), pids %s", self.count - 1, self.count,
                        " ".join(map(str, self.pids())))

    def _hello(self, link: OwnerLink, number: int, pid: int) -> None:
        if number not in self._past:
            link.transport.close()
            return
        self._links[number] = link
        if len(self._links) == self.count - 1:
            self._linked.set()

    def _lost(self, link: OwnerLink) -> None:
        if self._links.get(link.front) is link:
            del self._links[link.front]
            if link.predictions is not None:
                self._past[link.front] += link.predictions.requests

    async def _keep(self, number: int) -> None:
        """Run front ``number``, and again whenever it exits, until the stop."""
        deaths = 0
        while not self._stopping:
            started = time.monotonic()
            process = await asyncio.create_subprocess_exec(
                *python_module(sys.executable, "frontend.front"), stdin=asyncio.subprocess.PIPE)
            self._processes[number] = process
            assert process.stdin is not None
            process.stdin.write(json.dumps({**self._settings, "number": number}).encode())
            process.stdin.close()
            status = await process.wait()
            if self._stopping:
                return
            deaths = 0 if time.monotonic() - started > STABLE_S else deaths + 1
            delay_s = RESTART_DELAYS_S[min(deaths, len(RESTART_DELAYS_S)) - 1] if deaths else 0
            logger.warning("front process %d (pid %d) exited with status %s: started again "
                           "in %g s; its clients' connections dropped", number, process.pid,
                           status, delay_s)
            await asyncio.sleep(delay_s)

    async def stop(self, drain_s: float) -> None:
        """SIGTERM each front; wait for them (``drain_s`` and a grace), kill what is left."""
        self._stopping = True
        for process in self._processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        waiting = [process.wait() for process in self._processes.values()]
        if waiting:
            _, pending = await asyncio.wait([asyncio.ensure_future(w) for w in waiting],
                                            timeout=drain_s + EXIT_GRACE_S)
            if pending:
                logger.warning("%d front process(es) did not finish within drain_timeout: "
                               "killed", len(pending))
                self.kill()
                await asyncio.wait(pending)

    def kill(self) -> None:
        self._stopping = True
        for process in self._processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()

    async def close(self) -> None:
        """After the stop: no fronts, no links, no socket."""
        self.kill()
        for watcher in self._watchers:
            watcher.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        await asyncio.gather(*(process.wait() for process in self._processes.values()),
                             return_exceptions=True)
        if self._server is not None:
            self._server.close()
            for link in list(self._links.values()):
                link.transport.close()
            self._server = None
        self.link_path.unlink(missing_ok=True)
