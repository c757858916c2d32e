"""What a ``.pt2`` file holds, read from its zip entries without torch (the archiver never
imports it; the server's loader asks the same question: ``backend.weights.pt2``).

PyTorch saves two kinds of program as ``.pt2``, both zips of one top folder:

* an **ExportedProgram** (``torch.export.save``): ``<folder>/models/<name>.json`` (the graph)
  with ``data/weights/`` beside it;
* an **AOTInductor package** (``torch._inductor.aoti_compile_and_package``):
  ``<folder>/data/aotinductor/<name>/`` holding the compiled ``.so`` (and its sources).

A package holding both runs as AOTInductor (the compiled form of the same program).
"""

from __future__ import annotations

import enum
import zipfile
from pathlib import Path

__all__ = ["Pt2Error", "Pt2Kind", "pt2_kind", "pt2_note"]

SUFFIX = ".pt2"


class Pt2Error(ValueError):
    """The file is not a ``.pt2`` program this server loads; the message says why."""


class Pt2Kind(enum.Enum):
    EXPORTED_PROGRAM = "exported_program"
    AOTINDUCTOR = "aotinductor"

    @property
    def title(self) -> str:
        """How the logs and describe name it."""
        return _TITLES[self]


_TITLES = {
    Pt2Kind.EXPORTED_PROGRAM: "a torch.export ExportedProgram (torch.export.save)",
    Pt2Kind.AOTINDUCTOR: "an AOTInductor package (torch._inductor.aoti_compile_and_package)",
}


def pt2_kind(path: Path) -> Pt2Kind:
    """The kind of program ``path`` holds. Raises Pt2Error (not a zip, a damaged one, or a
    zip holding neither kind) or OSError (unreadable)."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            damaged = archive.testzip()
    except zipfile.BadZipFile as exc:
        raise Pt2Error(f"{path.name} is not a .pt2 archive (not a zip file: {exc})") from None
    except (EOFError, ValueError, NotImplementedError) as exc:  # truncated, odd compression
        raise Pt2Error(f"{path.name} is a damaged .pt2 archive ({exc})") from None
    if damaged is not None:
        raise Pt2Error(f"{path.name} is a damaged .pt2 archive: {damaged} fails its CRC check")
    parts = [name.split("/") for name in names]
    if any(len(p) > 4 and p[1:3] == ["data", "aotinductor"] and p[-1].endswith(".so")
           for p in parts):
        return Pt2Kind.AOTINDUCTOR
    if any(len(p) == 3 and p[1] == "models" and p[2].endswith(".json") for p in parts):
        return Pt2Kind.EXPORTED_PROGRAM
    raise Pt2Error(f"{path.name} is a zip but holds neither a torch.export program "
                   f"(<folder>/models/*.json) nor an AOTInductor package "
                   f"(<folder>/data/aotinductor/*/*.so)")


def pt2_note(path: str | Path | None) -> str | None:
    """What the archiver says of its ``--serialized-file`` (None: not a ``.pt2``)."""
    if path is None or Path(path).suffix.lower() != SUFFIX:
        return None
    path = Path(path)
    try:
        kind = pt2_kind(path)
    except (Pt2Error, OSError) as exc:
        return (f"warning: {exc}; the server will refuse to load it (make one with "
                f"batchserve-export, torch.export.save or aoti_compile_and_package)")
    note = f"{path.name} holds {kind.title}"
    if kind is Pt2Kind.AOTINDUCTOR:
        note += (": it runs only on the device kind and CPU/CUDA build it was compiled "
                 "for, with the torch that compiled it")
    return note
