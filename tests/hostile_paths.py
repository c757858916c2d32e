"""Hostile paths, as archives, manifests, urls and specs write them: the one list that
tests/unit/test_containment.py runs against every caller of ``model_archiver.paths`` and
tests/integration/test_containment.py against the real server.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

#: The name hostile members try to write (unique: a stray one from elsewhere cannot count).
EVIL = f"evil-{uuid.uuid4().hex[:8]}"
#: What the folder outside holds, which nothing may change or pack.
SECRET = b"the outside's secret"


@dataclass(frozen=True)
class Case:
    id: str
    #: The path as the hostile side writes it (a member's name, a manifest's value, a url's
    #: path). For a link case: the path through the link.
    name: str
    #: A link case: the link's name, and where it points: "abs" (the outside secret, by an
    #: absolute path), "rel" (the same, relative), "dir" (the outside folder), "self" (itself),
    #: "hard" (a tar hard link to the outside secret).
    link: tuple[str, str] | None = None
    #: A Unicode look-alike of '..' or '/': an ordinary name, accepted and kept inside.
    lookalike: bool = False


CASES = [
    Case("dotdot", f"../{EVIL}"),
    Case("inner-dotdot", f"a/../../{EVIL}"),
    Case("deep-dotdot", "../" * 8 + f"tmp/{EVIL}"),
    Case("absolute", f"/tmp/{EVIL}"),
    Case("backslash-dotdot", f"..\\..\\{EVIL}"),
    Case("backslash-inner", f"a\\..\\..\\{EVIL}"),
    Case("backslash-absolute", f"\\{EVIL}"),
    Case("drive", f"C:\\{EVIL}"),
    Case("nul", "a\x00b"),
    Case("long-name", "x" * 300),
    Case("long-path", "/".join(["d" * 200] * 25)),
    Case("link-out", EVIL, link=(EVIL, "abs")),
    Case("link-dotdot", EVIL, link=(EVIL, "rel")),
    Case("dir-link-then-file", "d/secret", link=("d", "dir")),
    Case("link-loop", "loop/x", link=("loop", "self")),
    Case("hardlink", EVIL, link=(EVIL, "hard")),
    Case("two-dot-leader", f"\u2025/{EVIL}", lookalike=True),
    Case("fullwidth-dots", f"\uff0e\uff0e/{EVIL}", lookalike=True),
    Case("division-slash", f"a\u2215..\u2215{EVIL}", lookalike=True),
]
BY_ID = {case.id: case for case in CASES}
TEXT = frozenset(case.id for case in CASES if case.link is None and not case.lookalike)
LINKS = frozenset(case.id for case in CASES if case.link is not None)
LOOKALIKES = frozenset(case.id for case in CASES if case.lookalike)
#: The ``..`` cases, in every spelling.
PARENT = frozenset({"dotdot", "inner-dotdot", "deep-dotdot", "backslash-dotdot",
                    "backslash-inner"})
#: Names a Linux file can have (one part, under NAME_MAX): Windows' traversals among them.
FILE_NAMES = frozenset({"backslash-dotdot", "backslash-inner", "backslash-absolute", "drive"})
#: What an archive member can be: a zip member's name ends at a NUL byte (zipfile reads
#: "a\x00b" as "a"), and a zip has no hard links.
IN_ZIP = (TEXT | LINKS | LOOKALIKES) - {"nul", "hardlink"}
IN_TAR = (TEXT | LINKS | LOOKALIKES) - {"nul"}


def link_target(kind: str, at: Path, outside: Path) -> str:
    """Where a link ``at`` of ``kind`` points: the secret in ``outside``, ``outside`` itself,
    or the link."""
    secret = outside / "secret"
    return {"abs": str(secret), "rel": os.path.relpath(secret, at.parent),
            "hard": os.path.relpath(secret, at.parent), "dir": str(outside),
            "self": at.name}[kind]


def plant(folder: Path, case: Case, outside: Path, text: str = "minWorkers: 1\n") -> None:
    """``case`` on disk in ``folder``: its link, or its file (holding ``text``)."""
    if case.link is not None:
        name, kind = case.link
        (folder / name).symlink_to(link_target(kind, folder / name, outside))
    else:
        (folder / case.name).parent.mkdir(parents=True, exist_ok=True)
        (folder / case.name).write_text(text)


def add_to_zip(archive: zipfile.ZipFile, case: Case, outside: Path, at: Path) -> None:
    """``case``'s members (a link member, then a file through it), the link as if it sat
    in ``at``."""
    if case.link is not None:
        name, kind = case.link
        info = zipfile.ZipInfo(name)
        info.external_attr = (stat.S_IFLNK | 0o777) << 16
        archive.writestr(info, link_target(kind, at / name, outside))
    if case.link is None or case.name != case.link[0]:
        archive.writestr(case.name, b"payload")


def add_to_tar(archive: tarfile.TarFile, case: Case, outside: Path, at: Path) -> None:
    if case.link is not None:
        name, kind = case.link
        info = tarfile.TarInfo(name)
        info.type = tarfile.LNKTYPE if kind == "hard" else tarfile.SYMTYPE
        info.linkname = link_target(kind, at / name, outside)
        archive.addfile(info)
    if case.link is None or case.name != case.link[0]:
        info = tarfile.TarInfo(case.name)
        info.size = 7
        archive.addfile(info, io.BytesIO(b"payload"))
