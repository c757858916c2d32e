"""Regenerate the protobuf/gRPC modules: ``python -m protos.generate``.

The generated ``*_pb2.py`` files are committed; tests/unit/test_protos.py checks they match.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("worker.proto",)
GRPC_PROTOS: tuple[str, ...] = ()


def generate(out_dir: Path = HERE) -> None:
    from grpc_tools import protoc  # dev dependency, imported only here

    include = Path(protoc.__file__).parent / "_proto"
    for name in PROTOS + GRPC_PROTOS:
        args = ["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={out_dir}",
                f"--pyi_out={out_dir}"]
        if name in GRPC_PROTOS:
            args.append(f"--grpc_python_out={out_dir}")
        if protoc.main([*args, str(HERE / name)]) != 0:
            raise SystemExit(f"protoc failed on {name}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
