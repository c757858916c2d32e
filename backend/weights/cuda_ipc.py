"""One copy of a model's weights per GPU, shared by the model's workers through CUDA IPC.

On the CPU the workers of a model share the weights file's pages (``torch.load(mmap=True)``);
GPU memory has no page cache, so each worker would hold its own copy. With ``share_weights:
cuda_ipc`` (model-config.yaml's ``handler`` section; off by default) a worker asks an
**owner** process for the weights instead:

* One owner per (weights file, GPU): its address is an abstract Unix socket named after the
  user, the file's identity (device, inode, size, modification time) and the GPU's UUID, so
  the workers of one model on one GPU find the same owner, and a changed file or another GPU
  gets another. Binding that address is the lock: of two owners started at once, one binds,
  the other says ``busy`` and exits.
* The first worker that finds no owner starts one (``python -P -m backend.process.weights_owner``,
  in a session of its own so that it outlives that worker's crash). The owner binds, says ``bound``
  on its standard output, reads the file (memory-mapped) and moves each storage to the GPU once,
  then answers every connection with one message: per storage its CUDA IPC handle
  (``UntypedStorage._share_cuda_()``), per tensor its name, dtype, size, strides, offset and
  storage. A connection is accepted only from a process of the same user (``SO_PEERCRED``), and the
  worker checks the same of the owner.
* The worker opens each handle (``UntypedStorage._new_shared_cuda``: the owner's memory,
  mapped into this process, no copy), builds its tensors on it, and keeps the connection open
  for its whole life: the connection is how the owner knows the memory is in use. The model
  takes the tensors as its parameters (``load_state_dict(assign=True)``); buffers are copied,
  since a model may update its buffers in place and these tensors are shared, writable memory.
* When its last worker has gone the owner waits ``linger`` seconds (a restarted worker comes
  back within them) and exits, freeing the GPU memory.

Each worker still has its CUDA context and its activations; the owner has one context more.
A worker that cannot get the weights from an owner (it cannot start, the file does not load)
logs why and loads its own copy.

On the CPU the same protocol carries POSIX shared-memory handles (``_share_filename_cpu_``):
the server never uses it (the file's pages are shared already), but the tests run the whole
path with it on a machine without a GPU; only the two CUDA calls differ.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

#: How long an owner stays up once its last worker has gone.
LINGER_S = 5.0
#: How long a worker waits for an owner to start, and then for its weights.
START_TIMEOUT_S = 60.0
LOAD_TIMEOUT_S = 600.0
OWNER_MODULE = "backend.process.weights_owner"
_LENGTH = struct.Struct(">I")
_PEERCRED = struct.Struct("3i")
_MAX_MESSAGE = 1 << 30

#: The connections to owners this process uses: kept open for its whole life.
_held: list[socket.socket] = []
#: The state dicts this process has from owners, by owner address: a handle is opened once
#: per process (CUDA refuses a second opening of the same memory in one process).
_opened: dict[str, dict[str, torch.Tensor]] = {}
_opening = threading.Lock()


class OwnerError(Exception):
    """No weights from an owner; the message says why."""


class Handles(Protocol):
    """How a storage is handed to another process: exported by the owner, opened by a
    worker. Handles are JSON values."""

    def export(self, storage: torch.UntypedStorage) -> list[Any]: ...

    def open(self, handle: list[Any]) -> torch.UntypedStorage: ...


class CudaHandles:
    """CUDA IPC: ``_share_cuda_`` in the owner, ``_new_shared_cuda`` in the worker."""

    def export(self, storage: torch.UntypedStorage) -> list[Any]:
        (device, handle, size, offset, counter, counter_offset, event,
         sync) = storage._share_cuda_()  # type: ignore[no-untyped-call]
        return [device, _text(handle), size, offset, _text(counter), counter_offset,
                _text(event), sync]

    def open(self, handle: list[Any]) -> torch.UntypedStorage:
        device, memory, size, offset, counter, counter_offset, event, sync = handle
        torch.cuda.init()  # type: ignore[no-untyped-call]
        storage = torch.UntypedStorage._new_shared_cuda(
            device, _bytes(memory), size, offset, _bytes(counter), counter_offset,
            _bytes(event), sync)
        assert isinstance(storage, torch.UntypedStorage)
        return storage


class SharedMemoryHandles:
    """POSIX shared memory through torch's shm manager: the CPU stand-in for CUDA IPC."""

    def export(self, storage: torch.UntypedStorage) -> list[Any]:
        manager, name, size = storage._share_filename_cpu_()
        return [_text(manager), _text(name), size]

    def open(self, handle: list[Any]) -> torch.UntypedStorage:
        manager, name, size = handle
        storage = torch.UntypedStorage._new_shared_filename_cpu(
            _bytes(manager), _bytes(name), size)
        assert isinstance(storage, torch.UntypedStorage)
        return storage


def handles_for(device: torch.device) -> Handles:
    return CudaHandles() if device.type == "cuda" else SharedMemoryHandles()


def owner_address(weights: Path, device: torch.device) -> str:
    """The abstract socket name of the owner of ``weights`` on ``device`` (without the
    leading NUL)."""
    stat = weights.stat()
    identity = (f"{os.getuid()}:{stat.st_dev}:{stat.st_ino}:{stat.st_size}:"
                f"{stat.st_mtime_ns}:{_device_identity(device)}")
    return "batchserve-weights-" + hashlib.sha256(identity.encode()).hexdigest()[:40]


def _device_identity(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda-{torch.cuda.get_device_properties(index).uuid}"


def shared_state_dict(weights: Path, device: torch.device, *, linger_s: float = LINGER_S,
                      start_timeout_s: float = START_TIMEOUT_S,
                      load_timeout_s: float = LOAD_TIMEOUT_S) -> dict[str, torch.Tensor]:
    """The state dict in ``weights``, its tensors in the owner's memory on ``device``
    (started now when there is none). Raises OwnerError (or OSError)."""
    address = owner_address(weights, device)
    with _opening:
        if address not in _opened:
            _opened[address] = _from_owner(address, weights, device, linger_s,
                                           start_timeout_s, load_timeout_s)
        return dict(_opened[address])


def _from_owner(address: str, weights: Path, device: torch.device, linger_s: float,
                start_timeout_s: float, load_timeout_s: float) -> dict[str, torch.Tensor]:
    sock = _connect(address)
    if sock is None:
        _start_owner(address, weights, device, linger_s, start_timeout_s)
        sock = _connect_until(address, time.monotonic() + start_timeout_s)
    try:
        if peer_uid(sock) != os.getuid():
            raise OwnerError(f"the process at {address} belongs to another user")
        message = receive(sock, time.monotonic() + load_timeout_s)
        if "error" in message:
            raise OwnerError(f"the weights owner could not load {weights.name}: "
                             f"{message['error']}")
        state = rebuild(message, device, handles_for(device))
    except BaseException:
        sock.close()
        raise
    _held.append(sock)
    return state


def release_all() -> None:
    """Close this process's connections to owners (the tests' way of ending a worker's
    use; a worker never calls it: its tensors would outlive the memory)."""
    _opened.clear()
    while _held:
        _held.pop().close()


def rebuild(message: Mapping[str, Any], device: torch.device,
            handles: Handles) -> dict[str, torch.Tensor]:
    """The tensors an owner's message describes, on the storages its handles open."""
    storages = [handles.open(handle) for handle in message["storages"]]
    state: dict[str, torch.Tensor] = {}
    for entry in message["tensors"]:
        dtype = getattr(torch, entry["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise OwnerError(f"unknown dtype {entry['dtype']!r} for {entry['name']!r}")
        if entry["storage"] is None:
            state[entry["name"]] = torch.empty(entry["size"], dtype=dtype, device=device)
            continue
        tensor = torch.empty(0, dtype=dtype, device=storages[entry["storage"]].device)
        tensor.set_(storages[entry["storage"]], entry["offset"], entry["size"],
                    entry["stride"])
        state[entry["name"]] = tensor
    return state


def describe_state(state: Mapping[str, Any], device: torch.device,
                   handles: Handles) -> tuple[dict[str, Any], list[torch.UntypedStorage]]:
    """The owner's side: each storage of ``state`` moved to ``device`` once, and the message
    that describes them; the caller keeps the storages alive while workers use them."""
    index: dict[tuple[int, int], int] = {}
    moved: list[torch.UntypedStorage] = []
    tensors: list[dict[str, Any]] = []
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            continue
        source = tensor.untyped_storage()
        key = (source.data_ptr(), source.nbytes())
        storage: int | None = None
        if source.nbytes():
            if key not in index:
                index[key] = len(moved)
                moved.append(_moved(source, device))
            storage = index[key]
        tensors.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                        "size": list(tensor.size()), "stride": list(tensor.stride()),
                        "offset": tensor.storage_offset(), "storage": storage})
    message = {"storages": [handles.export(storage) for storage in moved],
               "tensors": tensors}
    return message, moved


def _moved(storage: torch.UntypedStorage, device: torch.device) -> torch.UntypedStorage:
    data = torch.empty(0, dtype=torch.uint8).set_(storage)
    copy = data.to(device) if device.type == "cuda" else data.clone()
    return copy.untyped_storage()


def encode(message: Mapping[str, Any]) -> bytes:
    body = json.dumps(message).encode()
    return _LENGTH.pack(len(body)) + body


def receive(sock: socket.socket, deadline: float) -> dict[str, Any]:
    """One length-prefixed JSON message; OwnerError when the owner closes first or the
    deadline passes."""
    (length,) = _LENGTH.unpack(_read_exactly(sock, _LENGTH.size, deadline))
    if length > _MAX_MESSAGE:
        raise OwnerError(f"an owner's message of {length} bytes is too long")
    message = json.loads(_read_exactly(sock, length, deadline))
    if not isinstance(message, dict):
        raise OwnerError("an owner's message is not a JSON object")
    return message


def _read_exactly(sock: socket.socket, size: int, deadline: float) -> bytes:
    chunks: list[bytes] = []
    while size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise OwnerError("the weights owner did not answer in time")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(size, 1 << 20))
        except TimeoutError:
            continue
        if not chunk:
            raise OwnerError("the weights owner closed the connection")
        chunks.append(chunk)
        size -= len(chunk)
    sock.settimeout(None)
    return b"".join(chunks)


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket."""
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                 _PEERCRED.size))
    return int(uid)


def peer_pid(sock: socket.socket) -> int:
    pid, _, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                 _PEERCRED.size))
    return int(pid)


def _connect(address: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect("\0" + address)
    except OSError:  # ECONNREFUSED: nobody has bound the name
        sock.close()
        return None
    return sock


def _connect_until(address: str, deadline: float) -> socket.socket:
    while True:
        sock = _connect(address)
        if sock is not None:
            return sock
        if time.monotonic() > deadline:
            raise OwnerError(f"no weights owner at {address}")
        time.sleep(0.01)


def _start_owner(address: str, weights: Path, device: torch.device, linger_s: float,
                 timeout_s: float) -> None:
    """Start an owner and wait until it has bound ``address`` (or found another there)."""
    process = subprocess.Popen(
        [sys.executable, "-P", "-m", OWNER_MODULE, "--weights", str(weights),
         "--device", str(device), "--address", address, "--linger", str(linger_s)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, close_fds=True)
    # Reaped when it exits (it outlives this call, and may outlive this process).
    threading.Thread(target=process.wait, name="weights-owner-reaper", daemon=True).start()
    assert process.stdout is not None
    said = _owner_says(process.stdout, time.monotonic() + timeout_s)
    process.stdout.close()
    if said not in ("bound", "busy"):
        raise OwnerError(f"the weights owner did not start: {said.strip()[-2000:]}")


def _owner_says(stream: Any, deadline: float) -> str:
    """The owner's first word (``bound``/``busy``), or everything it wrote before it ended."""
    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)
    output = b""
    try:
        while time.monotonic() < deadline:
            if not selector.select(max(0.0, deadline - time.monotonic())):
                continue
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                return output.decode(errors="replace") or "it exited without a word"
            output += chunk
            for line in output.decode(errors="replace").splitlines(keepends=True):
                if line.endswith("\n") and line.strip() in ("bound", "busy"):
                    return line.strip()
        return "it did not say it had bound its address in time"
    finally:
        selector.close()


def _text(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode("ascii")


def _bytes(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)
