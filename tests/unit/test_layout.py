"""Module boundaries and generated code: the frontend and backend meet only in protos/, no
module imports itself through others, and generated code matches the .proto files. And the
test folders' one rule: everything in tests/e2e is marked slow (tests/__init__.py)."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
BANNED = {"frontend": {"backend", "torch", "torchvision"}, "backend": {"frontend"}}


#: The archivers are tools of their own that the frontend imports (archive manifests, workflow
#: specs): light, and never the server's.
ARCHIVERS_BANNED = {"frontend", "backend", "torch", "torchvision"}


def _absolute_imports(package: str) -> Iterator[tuple[Path, str]]:
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                yield path, name


@pytest.mark.parametrize("package", sorted(BANNED))
def test_frontend_and_backend_only_meet_in_protos(package: str) -> None:
    for path, name in _absolute_imports(package):
        assert name.split(".")[0] not in BANNED[package], f"{path} imports {name}"


@pytest.mark.parametrize("package", ["model_archiver", "workflow_archiver"])
def test_the_archivers_import_neither_server_nor_torch(package: str) -> None:
    for path, name in _absolute_imports(package):
        assert name.split(".")[0] not in ARCHIVERS_BANNED, f"{path} imports {name}"


def _module_imports() -> dict[str, set[str]]:
    """Each of our modules -> the modules of ours it imports anywhere (under TYPE_CHECKING
    and inside functions too)."""
    paths = {}
    for package in ("frontend", "backend", "model_archiver", "workflow_archiver", "protos"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            paths[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    found.add(full if full in paths else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {module for module in found if module in paths and module != name}
    return graph


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from ``start`` back to it, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        module, path = stack.pop()
        for imported in sorted(graph[module]):
            if imported == start:
                return [*path, start]
            if imported not in seen:
                seen.add(imported)
                stack.append((imported, [*path, imported]))
    return None


def test_no_import_cycles() -> None:
    graph = _module_imports()
    assert "frontend.models.registry" in graph and graph["frontend.models.loader"]
    cycles = [cycle for module in sorted(graph) if (cycle := _cycle_from(module, graph))]
    assert not cycles, "import cycle: " + " -> ".join(cycles[0])


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle_from("a", {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle_from("a", {"a": {"b"}, "b": set()}) is None


#: The frontend's floors, top down: a module may import its own floor and those below it,
#: never one above (docs/architecture.md, "The frontend's folders", draws the same table).
#: A floor is a list of module prefixes.
FRONTEND_FLOORS: list[tuple[str, ...]] = [
    ("frontend.__main__", "frontend.cli", "frontend.server"),  # start, assemble
    ("frontend.api",),  # transports: parse and render
    ("frontend.ops",),  # the use-cases: the plane, management, auth, params, ids, KServe
    ("frontend.workflows",),  # workflow archives, specs, DAGs, their registry and loading
    ("frontend.models",),  # registry, a version at run time, archives, loading, snapshots
    ("frontend.serving",),  # batching, policies, sequences, dispatch, workers
    ("frontend.observe",),  # metrics, logs
    ("frontend.config", "frontend.settings", "frontend.errors", "frontend.processes",
     "frontend.tls", "frontend.torchserve_keys", "frontend"),  # the ground: one config (a
    # package: frontend/config/), one settings type, the errors
]


def _floor(module: str) -> int:
    matches = [(len(prefix), index) for index, prefixes in enumerate(FRONTEND_FLOORS)
               for prefix in prefixes if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is on no floor: add it to FRONTEND_FLOORS and the docs' table"
    return max(matches)[1]


def test_no_frontend_module_imports_from_a_floor_above_its_own() -> None:
    """TYPE_CHECKING imports and imports inside functions count too."""
    graph = _module_imports()
    upward = [f"{module} (floor {_floor(module)}) imports {imported} (floor {_floor(imported)})"
              for module, imported_set in sorted(graph.items()) if module.startswith("frontend")
              for imported in sorted(imported_set)
              if imported.startswith("frontend") and _floor(imported) < _floor(module)]
    assert not upward, "\n".join(upward)


def test_the_floor_check_finds_an_upward_import() -> None:
    assert _floor("frontend.serving.workers") > _floor("frontend.ops.plane")
    assert _floor("frontend.errors") == len(FRONTEND_FLOORS) - 1
    assert _floor("frontend.api.http.fast") < _floor("frontend.observe.logs")


def test_every_e2e_module_is_marked_slow() -> None:
    """``pytest -m "not slow"`` must leave out all of tests/e2e: each module says so once."""
    modules = sorted((ROOT / "tests" / "e2e").glob("test_*.py"))
    assert modules
    for path in modules:
        marks = [ast.unparse(node.value) for node in ast.parse(path.read_text()).body
                 if isinstance(node, ast.Assign)
                 and [ast.unparse(target) for target in node.targets] == ["pytestmark"]]
        assert marks and "pytest.mark.slow" in marks[0], f"{path.name}: pytestmark lacks slow"


def _version_line(source: str, prefix: str) -> str:
    return next((line for line in source.splitlines() if line.startswith(prefix)), "")


def _method_paths(source: str) -> set[str]:
    return set(re.findall(r"'(/[\w.]+/\w+)'", source))


def test_generated_protobuf_modules_match_the_proto_files(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    from protos import generate

    generate.generate(tmp_path)
    stale = "is stale: run python -m protos.generate"
    committed_files = {path.stem for path in (ROOT / "protos").glob("*_pb2*.py")}
    assert committed_files == set(generate.generated_modules()), "orphaned generated module"
    for proto in generate.ALL_PROTOS:
        module = proto.removesuffix(".proto") + "_pb2"
        committed = importlib.import_module(f"protos.{module}")
        fresh_source = (tmp_path / f"{module}.py").read_text()
        committed_source = (ROOT / "protos" / f"{module}.py").read_text()
        # Compare the embedded descriptors, not the text: protoc versions format differently.
        marker = "AddSerializedFile("
        fresh = fresh_source[fresh_source.index(marker):].split("\n", 1)[0]
        kept = committed_source[committed_source.index(marker):].split("\n", 1)[0]
        assert fresh == kept, f"protos/{module}.py {stale}"
        assert committed.DESCRIPTOR.name == proto
        # The stubs' text only means something next to the same protoc.
        version = "# Protobuf Python Version:"
        if _version_line(fresh_source, version) == _version_line(committed_source, version):
            fresh_stub = (tmp_path / f"{module}.pyi").read_text()
            kept_stub = (ROOT / "protos" / f"{module}.pyi").read_text()
            assert fresh_stub == kept_stub, f"protos/{module}.pyi {stale}"
    for proto in generate.GRPC_PROTOS:
        module = proto.removesuffix(".proto") + "_pb2_grpc"
        fresh_source = (tmp_path / f"{module}.py").read_text()
        committed_source = (ROOT / "protos" / f"{module}.py").read_text()
        # No descriptor in here: compare the text when the same grpcio-tools wrote both,
        # otherwise (templates change between releases) the RPC paths they register.
        version = "GRPC_GENERATED_VERSION ="
        if _version_line(fresh_source, version) == _version_line(committed_source, version):
            assert fresh_source == committed_source, f"protos/{module}.py {stale}"
        else:
            assert _method_paths(fresh_source) == _method_paths(committed_source), (
                f"protos/{module}.py {stale}"
            )
        assert "from protos import" in committed_source, f"protos/{module}.py: top-level import"
        assert _method_paths(committed_source), module
