"""Module boundaries and generated code: the frontend and backend meet only in protos/, no
module imports itself through others, each of the frontend's and the backend's modules imports
only from its own floor and those below, the backend's modules and functions keep within their
sizes, and generated code matches the .proto files. And the test folders' one rule:
everything in tests/e2e is marked slow (tests/__init__.py)."""

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
    and inside functions too), relative imports (the ``ts`` shim's) as well as absolute ones."""
    paths = {}
    for package in ("frontend", "backend", "model_archiver", "workflow_archiver", "protos"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            paths[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(node, package)
                for alias in node.names:
                    full = f"{module}.{alias.name}"
                    found.add(full if full in paths else module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {module for module in found if module in paths and module != name}
    return graph


def _absolute(node: ast.ImportFrom, package: str) -> str:
    """The module a ``from ... import`` statement of a module of ``package`` imports from."""
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[:len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


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


#: The imports allowed to close a cycle, each with why; the cycle check leaves them out.
ALLOWED_CYCLE_IMPORTS: dict[tuple[str, str], str] = {
    # The ``ts`` shim's one cycle, from TorchServe's own API: its ``ts.handler_utils.utils``
    # imports ``create_predict_response`` from ``ts.protocol.otf_message_handler``, whose
    # deprecated ``send_intermediate_predict_response`` names the one in
    # ``ts.handler_utils.utils`` as its replacement. (TorchServe's deprecated function sends
    # the frame itself, so its own package has no cycle; ours calls its replacement, imported
    # inside the function, so that it streams through batchserve's worker as well.)
    ("backend.compat.ts.protocol.otf_message_handler", "backend.compat.ts.handler_utils.utils"):
        "a deprecated ts function calls its replacement",
}


def test_no_import_cycles() -> None:
    graph = _module_imports()
    assert "frontend.models.registry" in graph and graph["frontend.models.loader"]
    for (module, imported), reason in ALLOWED_CYCLE_IMPORTS.items():
        assert imported in graph[module], f"stale allowance ({reason}): {module} -> {imported}"
        graph[module] = graph[module] - {imported}
    cycles = [cycle for module in sorted(graph) if (cycle := _cycle_from(module, graph))]
    assert not cycles, "import cycle: " + " -> ".join(cycles[0])


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycle_from("a", {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle_from("a", {"a": {"b"}, "b": set()}) is None


def test_relative_imports_are_read() -> None:
    """The ``ts`` shim imports its own modules relatively: they count, resolved from where
    the importing module lies (a package's ``__init__`` is its own package)."""
    graph = _module_imports()
    # `from ..context import Context` in ts/handler_utils/utils.py
    assert "backend.compat.ts.context" in graph["backend.compat.ts.handler_utils.utils"]
    # `from .version import __version__` in ts/__init__.py
    assert "backend.compat.ts.version" in graph["backend.compat.ts"]
    relative = ast.parse("from ..a import b\nfrom . import c\nfrom .d import e").body
    assert [_absolute(node, "p.q.r") for node in relative
            if isinstance(node, ast.ImportFrom)] == ["p.q.a", "p.q.r", "p.q.r.d"]


#: The frontend's floors, top down: a module may import its own floor and those below it,
#: never one above (docs/architecture.md, "The frontend's folders", draws the same table).
#: A floor is a list of module prefixes.
FRONTEND_FLOORS: list[tuple[str, ...]] = [
    ("frontend.__main__", "frontend.cli", "frontend.server"),  # start, assemble
    ("frontend.front",),  # the front processes (number_of_netty_threads), and their owner's side
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


#: The backend's floors, the same way (docs/architecture.md, "The backend's folders").
BACKEND_FLOORS: list[tuple[str, ...]] = [
    # the processes: `python -m backend`'s worker loop and its protocol, the fork server, the
    # weights owner
    ("backend.__main__", "backend.process"),
    ("backend.compat",),  # TorchServe's `ts` package, written against the floors below
    ("backend.service",),  # one loaded model: its handler loaded and adapted, batches run
    ("backend.codecs",),  # a request's shapes through a handler: rows in, its response out
    ("backend.handlers",),  # the built-in handlers, their device and speed switches
    ("backend.weights",),  # a model's weights, loaded once per host
    ("backend.context", "backend.errors", "backend.imports", "backend.optional",
     "backend.streaming", "backend.metrics", "backend"),  # the ground: what a handler is handed
]
FLOORS = {"frontend": FRONTEND_FLOORS, "backend": BACKEND_FLOORS}


def _floor(module: str) -> int:
    floors = FLOORS[module.partition(".")[0]]
    matches = [(len(prefix), index) for index, prefixes in enumerate(floors)
               for prefix in prefixes if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is on no floor: add it to the floors and the docs' table"
    return max(matches)[1]


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_no_module_imports_from_a_floor_above_its_own(package: str) -> None:
    """TYPE_CHECKING imports, imports inside functions and relative imports count too."""
    graph = _module_imports()
    ours = [module for module in graph if module.partition(".")[0] == package]
    assert len(ours) > 20
    upward = [f"{module} (floor {_floor(module)}) imports {imported} (floor {_floor(imported)})"
              for module in sorted(ours) for imported in sorted(graph[module])
              if imported.partition(".")[0] == package and _floor(imported) < _floor(module)]
    assert not upward, "\n".join(upward)


def test_the_floor_check_finds_an_upward_import() -> None:
    assert _floor("frontend.serving.workers") > _floor("frontend.ops.plane")
    assert _floor("frontend.errors") == len(FRONTEND_FLOORS) - 1
    assert _floor("frontend.api.http.fast") < _floor("frontend.observe.logs")
    assert _floor("backend.service.model_service") > _floor("backend.process.worker")
    assert _floor("backend.compat.ts.context") < _floor("backend.codecs.envelopes")
    assert _floor("backend.metrics.cache") == _floor("backend.context") == len(BACKEND_FLOORS) - 1
    assert _floor("backend.__main__") == 0


#: The most lines a module may have, and a function (its decorators aside).
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
#: The packages held to those sizes: every hand-written module of the server and its tools
#: (issue 32; generated ``*_pb2*`` modules aside).
SIZED_PACKAGES = ("backend", "frontend", "model_archiver", "workflow_archiver", "protos")
#: Modules allowed past MAX_MODULE_LINES, and why (their functions are still held to theirs).
LONG_MODULES = {"frontend/api/http/openapi.py": "the OpenAPI documents: data, not logic"}


def _oversized(source: str, name: str) -> list[str]:
    """What of ``source`` (module ``name``) is longer than it may be."""
    found = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES and name not in LONG_MODULES:
        found.append(f"{name}: {lines} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return found


@pytest.mark.parametrize("package", SIZED_PACKAGES)
def test_modules_and_functions_stay_within_their_sizes(package: str) -> None:
    paths = sorted(path for path in (ROOT / package).rglob("*.py")
                   if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")))
    assert paths
    oversized = [found for path in paths
                 for found in _oversized(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert not oversized, "\n".join(oversized)


def test_the_size_check_finds_a_long_module_and_a_long_function() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert _oversized(f"def f():\n{body}", "m") == [f"m:1 f: {MAX_FUNCTION_LINES + 1} lines"]
    fits = "".join(body.splitlines(keepends=True)[1:])
    assert _oversized(f"async def g():\n{fits}", "m") == []
    module = "x = 1\n" * (MAX_MODULE_LINES + 1)
    assert _oversized(module, "m") == [f"m: {MAX_MODULE_LINES + 1} lines"]
    assert _oversized("x = 1\n" * MAX_MODULE_LINES, "m") == []
    long_module = next(iter(LONG_MODULES))
    assert (ROOT / long_module).is_file()
    assert _oversized(module, long_module) == []


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
