"""Files from TorchServe's own sources (pytorch/serve 0.12) that no package ships: its
ts_scripts (the gRPC client), its .proto files and its test resources. Read from a clone,
its git directory or a checkout: ``TORCHSERVE_SOURCES``, else the mirror beside this
repository's folder; tests that need them skip when neither is there."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [Path(os.environ["TORCHSERVE_SOURCES"])] if os.environ.get("TORCHSERVE_SOURCES") \
    else [ROOT.parent / ".mirror" / "pytorch+serve" / "repo",
          Path("/work/.mirror/pytorch+serve/repo")]
MISSING = ("TorchServe's sources are not on this machine (these files are in no package): "
           "set TORCHSERVE_SOURCES to a clone of pytorch/serve")


def torchserve_file(path: str) -> bytes | None:
    """The file at ``path`` in TorchServe's sources (HEAD of a git directory), or None."""
    for source in SOURCES:
        if (source / path).is_file():
            return (source / path).read_bytes()
        if (source / "HEAD").is_file() and shutil.which("git"):
            shown = subprocess.run(["git", f"--git-dir={source}", "show", f"HEAD:{path}"],
                                   capture_output=True, timeout=60, check=False)
            if shown.returncode == 0:
                return shown.stdout
    return None
