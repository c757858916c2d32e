"""Tiny ``.pt2`` programs for the tests, made by ``batchserve-export`` once and cached.

AOTInductor's compile of even a tiny model takes about a minute on the 2-core development
machine (60-90 s while other suites run), so the programs are made once per torch version and
source and kept in ``$BATCHSERVE_TEST_CACHE`` (default ``~/.cache/batchserve-tests``), in a
folder named by torch's version and a hash of what shapes them (``PROGRAMS``, the model files
and the exporter); a lock keeps two test runs from making them at once.
Everything else (ExportedPrograms) takes a few seconds.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tests.conftest import ROOT

MODELS = ROOT / "tests" / "fixtures" / "models"
#: name -> (model file, one input row's shape, the exporter's batch options, kinds).
PROGRAMS: dict[str, tuple[str, str, tuple[str, ...], str]] = {
    # Batch dimension 1..4: a batch of 8 runs as two chunks.
    "tiny": ("tiny_classifier.py", "3,224,224", ("--max-batch", "4"),
             "exported_program,aotinductor"),
    # No batch dimension: one request at a time.
    "tinystatic": ("tiny_classifier.py", "3,224,224", ("--static-batch", "1"),
                   "exported_program"),
    "seg": ("tiny_segmenter.py", "3,224,224", ("--max-batch", "4"), "exported_program"),
    "reg": ("tiny_regressor.py", "2", ("--max-batch", "8"), "exported_program"),
}
#: A program of two inputs (token ids and offsets, both dynamic), which batchserve-export does
#: not make: exported by ``TEXT_EXPORT`` into ``text.export.pt2``.
TEXT_MODEL = MODELS / "tiny_text.py"
TEXT_EXPORT = """
import sys, torch
sys.path.insert(0, ".")
from tiny_text import TinyText
torch.manual_seed(0)
model = TinyText().eval()
dims = ({0: torch.export.Dim("tokens", min=1, max=4096)}, {0: torch.export.Dim("texts")})
example = (torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 2]))
program = torch.export.export(model, example, dynamic_shapes=dims, strict=False)
torch.export.save(program, "text.export.pt2")
torch.save(model.state_dict(), "text_weights.pt")
"""
#: What shapes the programs, besides PROGRAMS itself: the exporter and the models.
SOURCES = (ROOT / "backend" / "weights" / "export.py", TEXT_MODEL,
           *(MODELS / spec[0] for spec in PROGRAMS.values()))


def cache_folder() -> Path:
    digest = hashlib.sha256((repr(sorted(PROGRAMS.items())) + TEXT_EXPORT).encode())
    for source in sorted(set(SOURCES)):
        digest.update(source.name.encode() + source.read_bytes())
    root = Path(os.environ.get("BATCHSERVE_TEST_CACHE")
                or Path.home() / ".cache" / "batchserve-tests")
    return root / f"pt2-torch{torch.__version__}-{digest.hexdigest()[:16]}"


def seeded_weights(model_file: Path, into: Path) -> Path:
    """The model's state dict with torch.manual_seed(0) weights, saved in ``into``."""
    namespace: dict[str, object] = {}
    exec(compile(model_file.read_text(), str(model_file), "exec"), namespace)
    classes = [value for value in namespace.values() if isinstance(value, type)
               and issubclass(value, torch.nn.Module) and value.__module__ == "builtins"]
    torch.manual_seed(0)
    weights = into / f"{model_file.stem}.pt"
    torch.save(classes[0]().state_dict(), weights)
    return weights


def programs() -> Path:
    """The folder holding ``<name>.export.pt2`` (and ``tiny.aoti.pt2``), the models' files
    and their weights; made now unless cached."""
    folder = cache_folder()
    done = folder / "done"
    if done.exists():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # a read-only home: the temporary folder instead
        folder = Path(tempfile.gettempdir()) / "batchserve-tests" / folder.name
        done = folder / "done"
        folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            _make(folder)
    return folder


def _make(folder: Path) -> None:
    work = folder.with_name(folder.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for name, (model, shape, batch, kinds) in PROGRAMS.items():
        model_file = work / model
        shutil.copy(MODELS / model, model_file)
        weights = seeded_weights(model_file, work)
        subprocess.run([sys.executable, "-m", "backend.weights.export", "--model-file",
                        str(model_file), "--serialized-file", str(weights), "--model-name",
                        name, "--export-path", str(work), "--input-shape", shape, *batch,
                        "--kinds", kinds, "--check-batches", "1,3"],
                       check=True, env=env, cwd=work, timeout=900)
    make_text_program(work, env)
    (work / "done").write_text("")
    shutil.rmtree(folder, ignore_errors=True)
    work.rename(folder)


def make_text_program(work: Path, env: dict[str, str]) -> None:
    """``text.export.pt2`` (and its model file) in ``work``."""
    shutil.copy(TEXT_MODEL, work / TEXT_MODEL.name)
    subprocess.run([sys.executable, "-c", TEXT_EXPORT], check=True, env=env, cwd=work,
                   timeout=300)
