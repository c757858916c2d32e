"""Regenerate the protobuf/gRPC modules: ``python -m protos.generate [OUT_DIR]``.

The generated ``*_pb2.py``/``*_pb2.pyi``/``*_pb2_grpc.py`` files are committed;
tests/unit/test_layout.py checks they match the ``.proto`` files.

protoc runs with ``-I protos`` so the descriptors keep TorchServe's file names
(``inference.proto``, ``management.proto``), which gRPC reflection reports to
clients. protoc then writes sibling imports as top-level ones (``import
inference_pb2``), which only work with ``protos/`` on ``sys.path``; they are
rewritten to ``from protos import inference_pb2`` so the modules work as part
of the ``protos`` package. ``google/rpc/status.proto`` (imported by
inference.proto) comes from googleapis-common-protos, a runtime dependency
that ships both the ``.proto`` and ``google.rpc.status_pb2``.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "protos"
PROTOS = ("worker.proto",)  # messages only
GRPC_PROTOS = ("inference.proto", "management.proto", "open_inference.proto")  # + services
ALL_PROTOS = PROTOS + GRPC_PROTOS


def generated_modules() -> list[str]:
    """Every module ``generate`` writes, without the ``.py`` suffix."""
    stems = [name.removesuffix(".proto") for name in ALL_PROTOS]
    return [f"{stem}_pb2" for stem in stems] + [
        f"{name.removesuffix('.proto')}_pb2_grpc" for name in GRPC_PROTOS
    ]


def _googleapis_include() -> Path:
    """The directory holding ``google/rpc/status.proto`` (googleapis-common-protos)."""
    spec = importlib.util.find_spec("google.rpc.status_pb2")
    if spec is not None and spec.origin:
        root = Path(spec.origin).resolve().parents[2]
        if (root / "google" / "rpc" / "status.proto").is_file():
            return root
    raise SystemExit(
        "google/rpc/status.proto not found: pip install 'googleapis-common-protos>=1.75'"
    )


def _package_imports(path: Path) -> None:
    """Rewrite ``import x_pb2 as y`` for our own modules to ``from protos import x_pb2 as y``."""
    ours = "|".join(re.escape(name.removesuffix(".proto")) for name in ALL_PROTOS)
    pattern = re.compile(rf"^import ((?:{ours})_pb2) as (\w+)$", re.MULTILINE)
    text = path.read_text()
    fixed = pattern.sub(rf"from {PACKAGE} import \1 as \2", text)
    if fixed != text:
        path.write_text(fixed)


def generate(out_dir: Path = HERE) -> None:
    from grpc_tools import protoc  # dev dependency, imported only here

    well_known = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    includes = [f"-I{HERE}", f"-I{well_known}", f"-I{_googleapis_include()}"]
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ALL_PROTOS:
        args = ["protoc", *includes, f"--python_out={out_dir}", f"--pyi_out={out_dir}"]
        if name in GRPC_PROTOS:
            args.append(f"--grpc_python_out={out_dir}")
        if protoc.main([*args, str(HERE / name)]) != 0:
            raise SystemExit(f"protoc failed on {name}")
    for module in generated_modules():
        for suffix in (".py", ".pyi"):
            path = out_dir / f"{module}{suffix}"
            if path.exists():
                _package_imports(path)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
