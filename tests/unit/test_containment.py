"""One rule for every path from an archive, a url or a spec (``model_archiver.paths``), and
one suite of hostile paths run against every caller, each through its public entry point.

The suite (``test_every_caller_refuses_every_hostile_path``) crosses the cases of
tests/hostile_paths.py (zip-slip ``..``, absolute names, Windows' separators and drives,
NUL, names too long, links pointing out, a folder link with a file through it, a link loop,
a hard link; and Unicode look-alikes of ``..`` and ``/``, which are ordinary names) with
``CALLERS`` (.mar, .tar.gz and .war extraction, a folder model's manifest and config file,
a manifest's handler and weights, the register urls of models and workflows, a download's
file name, a requirements file, both archivers' ``--extra-files``, a .war's manifest, a
spec's urls). Every hostile case a caller can meet is refused with that caller's own error,
and nothing is ever written outside: the sandbox's other folders are the same after as
before. The real server's answers (400, nothing left in the run directory) are in
tests/integration/test_containment.py.
"""

from __future__ import annotations

import ast
import json
import os
import stat
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from frontend.errors import (
    ArchiveError,
    BadRequest,
    DependencyInstallError,
    Forbidden,
    InvalidWorkflow,
    WorkflowNotFound,
)
from frontend.models import archive as models
from frontend.models.dependencies import requirements_path
from frontend.models.download import archive_name, check_allowed
from frontend.workflows import archive as workflows
from model_archiver.errors import ModelArchiverError
from model_archiver.packaging import ArchiveOptions, build_archive
from model_archiver.paths import MAX_NAME_BYTES, Unsafe, UnsafePath, climbs, contained
from tests.hostile_paths import (
    BY_ID,
    EVIL,
    FILE_NAMES,
    IN_TAR,
    IN_ZIP,
    LINKS,
    LOOKALIKES,
    PARENT,
    SECRET,
    TEXT,
    Case,
    add_to_tar,
    add_to_zip,
    plant,
)
from workflow_archiver import SpecError, WorkflowArchiverError, WorkflowManifestError
from workflow_archiver.manifest import WorkflowManifest
from workflow_archiver.packaging import WorkflowOptions, build_workflow_archive
from workflow_archiver.spec import parse_spec

ROOT = Path(__file__).resolve().parent.parent.parent
ECHO = ROOT / "tests" / "fixtures" / "handlers" / "echo.py"
SPEC = "models:\n  m1:\n    url: m1.mar\ndag:\n  pre: [m1]\n"
FUNCTIONS = "def pre(data, context):\n    return data\n"


# ---- contained itself ----------------------------------------------------------------------

@pytest.mark.parametrize(("name", "absolute", "why"), [
    ("../x", False, Unsafe.PARENT),
    ("a/../../x", False, Unsafe.PARENT),
    ("a/b/..", False, Unsafe.PARENT),
    ("..", False, Unsafe.PARENT),
    ("/srv/../etc/passwd", True, Unsafe.PARENT),
    ("..\\x", False, Unsafe.PARENT),
    ("a\\..\\..\\x", False, Unsafe.PARENT),
    ("../a\x00b", False, Unsafe.PARENT),  # '..' is what a reader sees first
    ("/etc/passwd", False, Unsafe.ABSOLUTE),
    ("\\x", False, Unsafe.ABSOLUTE),
    ("\\x", True, Unsafe.ABSOLUTE),  # Windows' absolute names are never anyone's url path
    ("C:\\x", True, Unsafe.ABSOLUTE),
    ("c:x", False, Unsafe.ABSOLUTE),
    ("a\x00b", False, Unsafe.CHARACTER),
    ("a\ud800b", False, Unsafe.CHARACTER),  # a lone surrogate: no file name holds it
    ("x" * (MAX_NAME_BYTES + 1), False, Unsafe.LENGTH),
    ("é" * 128, False, Unsafe.LENGTH),  # 256 bytes in UTF-8: bytes count, not characters
    ("/".join(["d" * 200] * 25), False, Unsafe.LENGTH),
])
def test_a_name_is_judged_by_its_text_first(name: str, absolute: bool, why: Unsafe) -> None:
    with pytest.raises(UnsafePath) as refused:
        contained(name, absolute=absolute)
    assert refused.value.why is why
    assert refused.value.name == name


@pytest.mark.parametrize(("name", "absolute", "posix"), [
    ("a/b.txt", False, "a/b.txt"),
    ("./a//b/./c", False, "a/b/c"),
    ("a\\b.txt", False, "a/b.txt"),  # the parts a Windows-made archive means
    ("", False, "."),  # the root itself: a tar's "./" member
    ("...", False, "..."),
    ("..a/b..", False, "..a/b.."),
    ("\u2025/x", False, "\u2025/x"),  # look-alikes of '..' and '/' are ordinary characters
    ("\uff0e\uff0e/x", False, "\uff0e\uff0e/x"),
    ("a\u2215..\u2215x", False, "a\u2215..\u2215x"),
    ("http://host/m.mar", True, "http:/host/m.mar"),
    ("/srv/models/m.mar", True, "/srv/models/m.mar"),
    ("x" * MAX_NAME_BYTES, False, "x" * MAX_NAME_BYTES),
])
def test_a_plain_name_passes_as_its_posix_parts(name: str, absolute: bool, posix: str) -> None:
    assert str(contained(name, absolute=absolute)) == posix


def test_with_a_root_links_are_followed_and_must_stay_inside(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_bytes(SECRET)
    (root / "sub" / "file").write_text("x")
    (root / "out").symlink_to(outside / "secret")
    (root / "up").symlink_to("../outside")
    (root / "alias").symlink_to("sub", target_is_directory=True)
    (root / "loop").symlink_to("loop")
    assert contained("sub/file", root) == (root / "sub" / "file").resolve()
    assert contained("alias/file", root) == (root / "sub" / "file").resolve()
    assert contained("not/there/yet", root) == (root / "not" / "there" / "yet").resolve()
    assert contained(".", root) == root.resolve()
    assert contained(str(root / "sub"), root, absolute=True) == (root / "sub").resolve()
    for name, why in [("out", Unsafe.OUTSIDE), ("up/secret", Unsafe.OUTSIDE),
                      ("loop/x", Unsafe.UNRESOLVABLE)]:
        with pytest.raises(UnsafePath) as refused:
            contained(name, root)
        assert refused.value.why is why, name
    with pytest.raises(UnsafePath) as refused:
        contained(str(outside / "secret"), root, absolute=True)
    assert refused.value.why is Unsafe.OUTSIDE
    assert refused.value.target == (outside / "secret").resolve()
    assert (outside / "secret").read_bytes() == SECRET


def test_the_text_is_judged_before_the_file_system_is_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No link planted between the check and the use can make a refused name pass: the text
    rules run first, without touching the file system."""

    def no_file_system(self: Path, strict: bool = False) -> Path:
        raise AssertionError(f"the file system was asked about {self}")

    monkeypatch.setattr(Path, "resolve", no_file_system)
    for name in ["../x", "/etc/passwd", "a\\..\\x", "a\x00b", "x" * 300]:
        with pytest.raises(UnsafePath):
            contained(name, tmp_path)


def test_climbs_reads_parts_as_contained_does() -> None:
    assert climbs("../x") and climbs("http://h/a/../b") and climbs("a\\..\\b")
    assert climbs("/srv/..") and climbs("../\x00")
    assert not climbs("a..b.mar") and not climbs("/etc/passwd") and not climbs("\u2025/x")


# ---- the callers, each through its public entry point --------------------------------------

@dataclass
class Sandbox:
    """``inside``: where a caller works (its store, its folder, its extraction); ``outside``:
    a folder with a secret, beside it, which no case may reach."""

    inside: Path
    outside: Path

    @classmethod
    def make(cls, tmp_path: Path) -> Sandbox:
        sandbox = cls(tmp_path / "inside", tmp_path / "outside")
        sandbox.inside.mkdir()
        sandbox.outside.mkdir()
        (sandbox.outside / "secret").write_bytes(SECRET)
        return sandbox

    def tree(self) -> dict[str, bytes | None]:
        """Everything but ``inside``: each path and a file's bytes."""
        root = self.inside.parent
        found: dict[str, bytes | None] = {}
        for directory, dirs, files in os.walk(root):
            if Path(directory) == self.inside:
                dirs.clear()
                continue
            for name in dirs + files:
                path = Path(directory) / name
                found[str(path)] = path.read_bytes() if path.is_file() and not \
                    path.is_symlink() else None
        return found

    def plant(self, folder: Path, case: Case) -> None:
        plant(folder, case, self.outside)


def _zip(path: Path, case: Case, sandbox: Sandbox, members: dict[str, str] | None = None
         ) -> Path:
    """A zip holding ``members`` and ``case``."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in (members or {}).items():
            archive.writestr(name, text)
        add_to_zip(archive, case, sandbox.outside, sandbox.inside)
    return path


def _tar(path: Path, case: Case, sandbox: Sandbox) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        add_to_tar(archive, case, sandbox.outside, sandbox.inside)
    return path


def _kept_inside(folder: Path) -> None:
    """What a caller unpacked or wrote: no link, and every path inside ``folder``."""
    real = folder.resolve()
    for path in folder.rglob("*"):
        assert not path.is_symlink(), path
        assert real in path.resolve().parents, path


def _mar_folder(sandbox: Sandbox, **manifest: str) -> Path:
    folder = sandbox.inside / "model"
    (folder / "MAR-INF").mkdir(parents=True)
    model = {"modelName": "m", "modelVersion": "1.0", "handler": "echo.py", **manifest}
    (folder / "MAR-INF" / "MANIFEST.json").write_text(json.dumps(
        {"createdOn": "01/01/2025 00:00:00", "runtime": "python", "model": model,
         "archiverVersion": "0.12.0"}))
    return folder


def _work(sandbox: Sandbox) -> Path:
    work = sandbox.inside / "work"
    work.mkdir()
    return work


def mar(case: Case, sandbox: Sandbox) -> None:
    work = _work(sandbox)
    unpacked = models.unpack("evil.mar", _zip(sandbox.inside / "evil.mar", case, sandbox),
                             work)
    _kept_inside(unpacked.model_dir)


def tar_gz(case: Case, sandbox: Sandbox) -> None:
    work = _work(sandbox)
    unpacked = models.unpack("evil.tar.gz",
                             _tar(sandbox.inside / "evil.tar.gz", case, sandbox), work)
    _kept_inside(unpacked.model_dir)


def war(case: Case, sandbox: Sandbox) -> None:
    members = {"WAR-INF/MANIFEST.json": json.dumps(
        {"createdOn": "01/01/2025 00:00:00", "archiverVersion": "0.2.15",
         "workflow": {"workflowName": "wf", "specFile": "wf.yaml", "handler": "h.py"}}),
               "wf.yaml": SPEC, "h.py": FUNCTIONS}
    work = _work(sandbox)
    archive = workflows.unpack("evil.war", _zip(sandbox.inside / "evil.war", case, sandbox,
                                                members), work, None)
    _kept_inside(archive.directory)


def folder_config_file(case: Case, sandbox: Sandbox) -> None:
    """A folder model (used in place) whose manifest names ``case`` as its config file,
    which the server reads itself."""
    folder = _mar_folder(sandbox, configFile=case.name)
    if case.link is not None or case.lookalike:
        sandbox.plant(folder, case)
    models.unpack("model", folder, _work(sandbox))


def folder_handler(case: Case, sandbox: Sandbox) -> None:
    models.unpack("model", _mar_folder(sandbox, handler=f"{case.name}:handle"), _work(sandbox))


def mar_serialized_file(case: Case, sandbox: Sandbox) -> None:
    manifest = {"createdOn": "01/01/2025 00:00:00", "runtime": "python",
                "archiverVersion": "0.12.0",
                "model": {"modelName": "m", "handler": "echo.py", "serializedFile": case.name}}
    plain = Case("manifest", "echo.py")
    archive = _zip(sandbox.inside / "m.mar", plain, sandbox,
                   {"MAR-INF/MANIFEST.json": json.dumps(manifest)})
    unpacked = models.unpack("m.mar", archive, _work(sandbox))
    _kept_inside(unpacked.model_dir)


def requirements(case: Case, sandbox: Sandbox) -> None:
    folder = sandbox.inside / "model"
    folder.mkdir()
    if case.link is not None or case.lookalike:
        sandbox.plant(folder, case)
    assert folder.resolve() in requirements_path(folder, case.name).parents


def model_url(case: Case, sandbox: Sandbox) -> None:
    """A register url: the case itself, or (links, look-alikes) a path in the store."""
    if case.link is None and not case.lookalike:
        models.resolve_url(case.name, sandbox.inside, ())
        return
    sandbox.plant(sandbox.inside, case)
    path = models.resolve_url(f"{sandbox.inside}/{case.name}", sandbox.inside, ())
    assert sandbox.inside.resolve() in path.resolve().parents


def workflow_url(case: Case, sandbox: Sandbox) -> None:
    if case.link is None and not case.lookalike:
        workflows.locate(case.name, sandbox.inside, (), 1)
        return
    sandbox.plant(sandbox.inside, case)
    path, _ = workflows.locate(f"{sandbox.inside}/{case.name}", sandbox.inside, (), 1)
    assert sandbox.inside.resolve() in path.resolve().parents


def download(case: Case, sandbox: Sandbox) -> None:
    """What a download is judged by before anything is fetched: its url, its file name."""
    url = check_allowed(f"http://models.example/m/{case.name}.mar", (".*",))
    name = archive_name(url)
    assert sandbox.inside.resolve() in (sandbox.inside / name).resolve().parents


def _extra_folder(case: Case, sandbox: Sandbox) -> Path:
    extra = sandbox.inside / "extra"
    extra.mkdir()
    if case.link is not None:
        sandbox.plant(extra, case)
    else:
        (extra / case.name).parent.mkdir(parents=True, exist_ok=True)
        (extra / case.name).write_text("x")
    return extra


def model_archiver(case: Case, sandbox: Sandbox) -> None:
    """``--extra-files``: links are followed (a Hugging Face snapshot is links into its
    cache), so a link out is packed as the file it leads to; no link lands in the archive."""
    export = sandbox.inside / "export"
    export.mkdir()
    built = build_archive(ArchiveOptions(
        model_name="m", handler=str(ECHO), export_path=export,
        extra_files=(str(_extra_folder(case, sandbox)),)))
    with zipfile.ZipFile(built) as archive:
        for info in archive.infolist():
            assert not stat.S_ISLNK(info.external_attr >> 16), info.filename
            contained(info.filename)
    (sandbox.inside / "unpacked").mkdir()
    mar_dir = models.unpack("m.mar", built, sandbox.inside / "unpacked").model_dir
    _kept_inside(mar_dir)


def workflow_archiver(case: Case, sandbox: Sandbox) -> None:
    spec, handler = sandbox.inside / "wf.yaml", sandbox.inside / "h.py"
    spec.write_text(SPEC)
    handler.write_text(FUNCTIONS)
    export = sandbox.inside / "export"
    export.mkdir()
    build_workflow_archive(WorkflowOptions(
        workflow_name="wf", spec_file=str(spec), handler=str(handler), export_path=export,
        extra_files=(str(_extra_folder(case, sandbox)),)))


def war_manifest(case: Case, sandbox: Sandbox) -> None:
    WorkflowManifest.from_json(json.dumps({
        "createdOn": "01/01/2025 00:00:00", "archiverVersion": "0.2.15",
        "workflow": {"workflowName": "wf", "specFile": case.name, "handler": "h.py"}}))


def spec_url(case: Case, sandbox: Sandbox) -> None:
    parse_spec(f"models:\n  m1:\n    url: {json.dumps(case.name)}\ndag:\n  m1: []\n", "wf")


@dataclass(frozen=True)
class Caller:
    id: str
    run: Callable[[Case, Sandbox], None]
    #: What it raises when it refuses.
    errors: tuple[type[Exception], ...]
    #: The cases it can meet: each is refused, but look-alikes and ``accepts``.
    cases: frozenset[str]
    #: Cases it takes by design, keeping everything inside.
    accepts: frozenset[str] = field(default_factory=frozenset)


def _ids(*groups: set[str] | frozenset[str], but: set[str] = frozenset()) -> frozenset[str]:
    return frozenset(set().union(*groups) - but)


CALLERS = [
    Caller("mar", mar, (ArchiveError,), IN_ZIP),
    Caller("tar.gz", tar_gz, (ArchiveError,), IN_TAR),
    Caller("war", war, (InvalidWorkflow,), IN_ZIP),
    Caller("folder-configFile", folder_config_file, (ArchiveError,),
           _ids(TEXT, LINKS, LOOKALIKES, but={"hardlink"})),
    # The handler's file is the part before ':' (so no drive), read by the worker, which
    # follows the folder's own links.
    Caller("folder-handler", folder_handler, (ArchiveError,),
           _ids(TEXT, LOOKALIKES, but={"drive"})),
    Caller("mar-serializedFile", mar_serialized_file, (ArchiveError,), _ids(TEXT, LOOKALIKES)),
    Caller("requirements", requirements, (DependencyInstallError,),
           _ids(TEXT, LINKS, LOOKALIKES, but={"hardlink"})),
    Caller("model-url", model_url, (ArchiveError, Forbidden),
           _ids(TEXT, LINKS, LOOKALIKES, but={"hardlink"})),
    Caller("workflow-url", workflow_url, (WorkflowNotFound, Forbidden, BadRequest),
           _ids(TEXT, LINKS, LOOKALIKES, but={"hardlink"})),
    # An absolute path, or a long one, inside a url's path is only a url's path.
    Caller("download", download, (ArchiveError, Forbidden),
           _ids(TEXT, LOOKALIKES, but={"absolute", "long-path"})),
    Caller("model-archiver", model_archiver, (ModelArchiverError,),
           _ids(FILE_NAMES, LINKS, LOOKALIKES, but={"hardlink"}),
           accepts=frozenset({"link-out", "link-dotdot", "dir-link-then-file"})),
    Caller("workflow-archiver", workflow_archiver, (WorkflowArchiverError,),
           _ids(FILE_NAMES, LINKS, LOOKALIKES, but={"hardlink"})),
    Caller("war-manifest", war_manifest, (WorkflowManifestError,), _ids(TEXT, LOOKALIKES)),
    # A spec's url may be absolute, or an http(s) url: only '..' is refused there.
    Caller("spec-url", spec_url, (SpecError,), _ids(PARENT, LOOKALIKES)),
]

PAIRS = [pytest.param(caller, BY_ID[case], id=f"{caller.id}-{case}")
         for caller in CALLERS for case in sorted(caller.cases)]


@pytest.mark.parametrize(("caller", "case"), PAIRS)
def test_every_caller_refuses_every_hostile_path(caller: Caller, case: Case,
                                                 tmp_path: Path) -> None:
    sandbox = Sandbox.make(tmp_path)
    before = sandbox.tree()
    if case.lookalike or case.id in caller.accepts:
        caller.run(case, sandbox)
    else:
        with pytest.raises(caller.errors):
            caller.run(case, sandbox)
    assert sandbox.tree() == before, "something was written outside"
    for folder in (Path("/tmp"), *tmp_path.parents):
        assert not os.path.lexists(folder / EVIL), folder


def test_every_case_meets_a_caller_and_every_caller_meets_each_kind() -> None:
    met = {case for caller in CALLERS for case in caller.cases}
    assert met == set(BY_ID)
    for caller in CALLERS:
        assert caller.cases & LOOKALIKES == LOOKALIKES, caller.id
        assert caller.cases - LOOKALIKES - caller.accepts, caller.id


# ---- no other guard ------------------------------------------------------------------------

#: Where a path judged on its own would be a second guard: the packages that meet paths from
#: archives, urls and specs (the backend's reading of a manifest's files relies on the
#: frontend's check at registration).
GUARDED_PACKAGES = ("frontend", "model_archiver", "workflow_archiver")
#: Functions that compare with ``..`` or a folder's ``parents`` and judge no path from
#: outside: (module path, function) -> why.
NOT_GUARDS = {
    ("frontend/models/download.py", "remove_dot_segments"):
        "RFC 3986's dot-segment removal, of a url already refused for any '..'",
    ("frontend/models/archive.py", "remove_unpacked"): "our own extraction's folders",
    ("workflow_archiver/spec.py", "input_name"): "a DAG node's parents",
}
_GUARD_CALLS = frozenset({"is_relative_to", "commonpath", "realpath"})


def _guards(tree: ast.AST) -> list[tuple[str, int]]:
    """(enclosing function, line) of each comparison with ``'..'`` or ``x.parents`` and each
    call of a containment helper in ``tree``."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        if isinstance(node, ast.Compare):
            dots = any(isinstance(item, ast.Constant) and item.value == ".."
                       for item in [node.left, *node.comparators])
            in_parents = any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) and any(
                isinstance(item, ast.Attribute) and item.attr == "parents"
                for item in node.comparators)
            if dots or in_parents:
                found.append((function, node.lineno))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _GUARD_CALLS:
            found.append((function, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_no_path_is_judged_but_by_contained() -> None:
    """A second guard is the one the next fix misses: every path from outside is judged by
    ``model_archiver.paths.contained`` only."""
    allowed, seen = dict(NOT_GUARDS), set()
    stray = []
    for package in GUARDED_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            if module == "model_archiver/paths.py":
                continue
            for function, line in _guards(ast.parse(path.read_text(), module)):
                if (module, function) in allowed:
                    seen.add((module, function))
                else:
                    stray.append(f"{module}:{line} ({function})")
    assert not stray, "judge these paths with model_archiver.paths.contained: " + ", ".join(
        stray)
    assert seen == set(allowed), f"stale NOT_GUARDS entries: {set(allowed) - seen}"


def test_the_guard_finder_finds_guards() -> None:
    source = ("def f(p, root):\n    if '..' in p.parts or root in p.resolve().parents:\n"
              "        return p.is_relative_to(root)\n")
    assert sorted(_guards(ast.parse(source))) == [("f", 2), ("f", 2), ("f", 3)]
    assert _guards(ast.parse("for parent in node.parents:\n    pass\n")) == []
