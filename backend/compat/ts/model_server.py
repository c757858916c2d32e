"""``ts.model_server``: the ``torchserve`` command's entry point.

TorchServe's ``start`` launches its Java frontend; here there is none, so ``start`` runs
batchserve's own ``torchserve`` command (``python -m frontend``) with the same arguments,
which accepts TorchServe's flags. ``load_properties`` reads a config.properties file as
TorchServe's launcher does (``key=value`` lines; ``#`` comments).
"""

from __future__ import annotations

import subprocess
import sys

from .arg_parser import ArgParser
from .version import __version__

__all__ = ["TS_NAMESPACE", "ArgParser", "__version__", "load_properties", "start"]

#: The Java class TorchServe's frontend runs as (how TorchServe finds its own process).
TS_NAMESPACE = "org.pytorch.serve.ModelServer"


def start() -> None:
    """``torchserve`` with this process's arguments, served by batchserve; exits with its
    status when it fails."""
    ArgParser.ts_parser().parse_args()  # TorchServe's usage errors, before anything runs
    command = [sys.executable, "-P", "-m", "frontend", *sys.argv[1:]]
    if sys.version_info < (3, 11):  # no -P: the working directory could shadow `frontend`
        command = [sys.executable, "-m", "frontend", *sys.argv[1:]]
    code = subprocess.run(command, check=False).returncode
    if code:
        sys.exit(code)


def load_properties(file_path: str) -> dict[str, str]:
    """The ``key=value`` lines of a properties file (keys and values stripped; lines that
    start with ``#`` or have no ``=`` skipped)."""
    properties: dict[str, str] = {}
    with open(file_path, encoding="utf-8") as file:
        for line in file:
            line = line.strip()
            if line.startswith("#"):
                continue
            key, separator, value = line.partition("=")
            if separator:
                properties[key.strip()] = value.strip()
    return properties


if __name__ == "__main__":
    start()
