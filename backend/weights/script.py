"""Put a TorchScript module's tensors back into its archive's pages.

``torch.jit.load`` has no ``mmap`` (torch 2.14): it reads every tensor into memory of its own.
A TorchScript archive is a zip whose ``data/N`` records each hold one storage, stored
uncompressed and aligned, so the records can be mapped: after the load, each parameter's and
buffer's storage is compared byte for byte with the records of its size, and on a match the
tensor is pointed (``Tensor.set_``, same offset, size and strides) at a private
(copy-on-write) mapping of that record; its private copy is freed. The workers of the model
then share the file's pages, as with ``torch.load(mmap=True)``. A storage that matches no
record (one the model computed at load, a frozen module's constants folded into its code)
keeps its own copy. Each record backs at most one storage, so two storages never alias.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import torch


def map_onto_archive(module: torch.nn.Module, path: Path) -> tuple[int, int]:
    """Point the CPU parameters and buffers of ``module`` (loaded from the TorchScript
    archive ``path``) at the archive's pages; how many storages were mapped, of how many."""
    reader = torch._C.PyTorchFileReader(str(path))
    records: dict[int, list[int]] = defaultdict(list)  # size in bytes -> record offsets
    for name in reader.get_all_records():
        if name.startswith("data/"):
            offset = reader.get_record_offset(name)  # type: ignore[attr-defined]
            records[reader.get_record_size(name)].append(offset)
    whole = torch.UntypedStorage.from_file(str(path), False, os.path.getsize(path))

    by_storage: dict[tuple[int, int], list[torch.Tensor]] = defaultdict(list)
    for tensor in (*module.parameters(), *module.buffers()):
        storage = tensor.untyped_storage()
        if tensor.device.type == "cpu" and storage.nbytes():
            by_storage[(storage.data_ptr(), storage.nbytes())].append(tensor)

    mapped = 0
    for (_, nbytes), tensors in by_storage.items():
        own = _bytes(tensors[0].untyped_storage())
        offsets = records.get(nbytes, [])
        for index, offset in enumerate(offsets):
            record = whole[offset:offset + nbytes]
            if torch.equal(_bytes(record), own):
                del offsets[index]
                with torch.no_grad():
                    for tensor in tensors:
                        tensor.set_(record, tensor.storage_offset(), tensor.size(),
                                    tensor.stride())
                mapped += 1
                break
    return mapped, len(by_storage)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage)
