"""The weights owner process: ``python -P -m backend.process.weights_owner --weights FILE --device
cuda:N --address NAME --linger S`` (started by a worker: ``backend.weights.cuda_ipc``).

It binds the abstract Unix socket ``NAME`` (or says ``busy`` and exits when another owner
has it), says ``bound``, loads the state dict in FILE onto the device once, then answers each
connection of its own user with the handles of those tensors, and keeps each connection until
the worker closes it (exits). ``linger`` seconds after its last worker has gone, it exits.
It never imports an archive's code: it reads tensors only (``weights_only``/safetensors).

It lives outside ``backend.weights`` so that it binds its address before importing torch: an
owner started while another has the address says ``busy`` in milliseconds.
"""

from __future__ import annotations

import argparse
import errno
import os
import selectors
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.process.weights_owner")
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--linger", type=float, default=5.0)
    args = parser.parse_args(argv)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind("\0" + args.address)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        _say("busy")
        return 0
    listener.listen(64)
    _say("bound")
    _quiet()
    import torch  # only now: see the module's docstring

    from backend.errors import describe
    from backend.weights.cuda_ipc import encode

    kept: list[torch.UntypedStorage] = []
    try:
        message, kept = load(args.weights, torch.device(args.device))
    except Exception as exc:  # every worker that asks is told why, then the owner ends
        message = {"error": describe(exc)}
    serve(listener, encode(message), args.linger, keep=("error" not in message))
    del kept  # the weights: freed only now, once no worker uses them
    return 0


def load(weights: Path, device: torch.device) -> tuple[dict[str, Any],
                                                      list[torch.UntypedStorage]]:
    """The message that hands out the weights, and the storages it describes."""
    import torch

    from backend.weights.cuda_ipc import describe_state, handles_for
    from backend.weights.files import read_state_dict

    if device.type == "cuda":
        torch.cuda.set_device(device)
    return describe_state(read_state_dict(weights), device, handles_for(device))


def serve(listener: socket.socket, payload: bytes, linger_s: float, *, keep: bool) -> None:
    """Send ``payload`` to each worker that connects and, when ``keep``, hold its connection
    until it closes; return ``linger_s`` after the last one has gone (or none came)."""
    from backend.weights.cuda_ipc import peer_uid

    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    clients: set[socket.socket] = set()
    idle_since = time.monotonic()
    while True:
        timeout = None if clients else idle_since + linger_s - time.monotonic()
        if timeout is not None and timeout <= 0:
            return
        for key, _ in selector.select(timeout):
            if key.fileobj is listener:
                connection, _ = listener.accept()
                if peer_uid(connection) != os.getuid() or not _send(connection, payload) \
                        or not keep:
                    connection.close()
                    continue
                clients.add(connection)
                selector.register(connection, selectors.EVENT_READ)
            else:
                connection = key.fileobj  # type: ignore[assignment]
                try:
                    data = connection.recv(4096)
                except OSError:
                    data = b""
                if not data:  # the worker has gone (or closed): its mappings with it
                    selector.unregister(connection)
                    connection.close()
                    clients.discard(connection)
                    idle_since = time.monotonic()


def _send(connection: socket.socket, payload: bytes) -> bool:
    try:
        connection.sendall(payload)
    except OSError:
        return False
    return True


def _say(word: str) -> None:
    """One line to the worker that started this process, written whole (it reads lines)."""
    try:
        os.write(1, f"{word}\n".encode())
    except OSError:  # it has gone: whoever needs this owner will connect
        pass


def _quiet() -> None:
    """Standard output and error to /dev/null: the worker that started this process has read
    what it needed, and may be gone."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


if __name__ == "__main__":
    sys.exit(main())
