"""``ts.utils.setup_model_venv``: a virtual environment for one model that also sees the
packages of the environment it is made from (TorchServe's per-model venvs).

batchserve installs a model's ``requirements.txt`` with ``pip install --target`` into a
folder of its own instead (``frontend/models/dependencies.py``); this module is here for
scripts that call it. Run as ``python -m ts.utils.setup_model_venv VENV_PATH``.
"""

from __future__ import annotations

import site
import sys
import venv
from pathlib import Path

#: The file, in the new venv's site-packages, that lists the inherited package folders.
INHERITED = "inherited-site-packages.pth"


def create_venv(venv_path: str) -> None:
    """A fresh venv (cleared if it exists) at ``venv_path``, with pip."""
    venv.create(venv_path, clear=True, with_pip=True)


def inherit_site_packages(venv_path: str) -> None:
    """Let the venv at ``venv_path`` import this interpreter's packages (user and global
    site-packages) through a ``.pth`` file; its own packages still come first."""
    python = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    matches = list(Path(venv_path).glob(f"lib/{python}/site-packages"))
    if len(matches) != 1:
        raise RuntimeError(f"expected one site-packages for {python} in the venv {venv_path}, "
                           f"found {[str(m) for m in matches]}")
    folders = []
    if site.ENABLE_USER_SITE and Path(site.getusersitepackages()).exists():
        folders.append(site.getusersitepackages())
    folders += [folder for folder in site.getsitepackages() if Path(folder).exists()]
    (matches[0] / INHERITED).write_text("".join(f"{folder}\n" for folder in folders),
                                        encoding="utf-8")
    for folder in folders:
        print(folder)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} VENV_PATH (got {sys.argv[1:]})")
    create_venv(sys.argv[1])
    inherit_site_packages(sys.argv[1])
