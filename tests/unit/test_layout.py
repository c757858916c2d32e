"""Module boundaries and generated code: the frontend and backend meet only in protos/."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
BANNED = {"frontend": {"backend", "torch", "torchvision"}, "backend": {"frontend"}}


@pytest.mark.parametrize("package", sorted(BANNED))
def test_frontend_and_backend_only_meet_in_protos(package: str) -> None:
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in BANNED[package], f"{path} imports {name}"


def test_generated_protobuf_modules_match_the_proto_files(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    from protos import generate

    generate.generate(tmp_path)
    for proto in generate.PROTOS:
        module = proto.removesuffix(".proto") + "_pb2"
        committed = importlib.import_module(f"protos.{module}")
        fresh_source = (tmp_path / f"{module}.py").read_text()
        committed_source = (ROOT / "protos" / f"{module}.py").read_text()
        # Compare the embedded descriptors, not the text: protoc versions format differently.
        marker = "AddSerializedFile("
        fresh = fresh_source[fresh_source.index(marker):].split("\n", 1)[0]
        kept = committed_source[committed_source.index(marker):].split("\n", 1)[0]
        assert fresh == kept, f"protos/{module}.py is stale: run python -m protos.generate"
        assert committed.DESCRIPTOR.name == proto
