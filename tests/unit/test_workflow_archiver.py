"""The workflow archive (.war): our workflow-archiver's output read back and compared with
TorchServe's torch-workflow-archiver 0.2.15 (in ``.venv-torchserve-archiver``), and workflow
specs read as TorchServe 0.12 reads them (tests/fixtures/workflows), with their errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import zipfile
from datetime import datetime
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from workflow_archiver.cli import main
from workflow_archiver.errors import (
    InvalidDAGError,
    SpecError,
    WorkflowArchiverError,
    WorkflowManifestError,
)
from workflow_archiver.manifest import (
    CREATED_ON_FORMAT,
    MANIFEST_PATH,
    WorkflowManifest,
    read_manifest,
)
from workflow_archiver.packaging import WorkflowOptions, build_workflow_archive
from workflow_archiver.spec import (
    FUNCTION_NODE_SETTINGS,
    NodeKind,
    NodeSettings,
    handler_names,
    load_spec,
    parse_spec,
)

ROOT = Path(__file__).resolve().parent.parent.parent
WORKFLOWS = ROOT / "tests" / "fixtures" / "workflows"
SEQUENTIAL = (WORKFLOWS / "sequential" / "sequential.yaml",
              WORKFLOWS / "sequential" / "sequential_handler.py")
PARALLEL = (WORKFLOWS / "parallel" / "parallel.yaml",
            WORKFLOWS / "parallel" / "parallel_handler.py")
TS_ARCHIVER = ROOT / ".venv-torchserve-archiver" / "bin" / "torch-workflow-archiver"


def build(export: Path, name: str, spec: Path, handler: Path, *extra: Path,
          force: bool = False) -> Path:
    return build_workflow_archive(WorkflowOptions(
        workflow_name=name, spec_file=str(spec), handler=str(handler), export_path=export,
        extra_files=tuple(map(str, extra)), force=force)).path


def members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as archive:
        return {info.filename: archive.read(info) for info in archive.infolist()}


def key_paths(value: object, prefix: str = "") -> list[str]:
    """Every key of a JSON object, nested ones as a.b, in their order."""
    if not isinstance(value, dict):
        return []
    return [path for key, item in value.items()
            for path in (f"{prefix}{key}", *key_paths(item, f"{prefix}{key}."))]


# --- our archiver, read back -------------------------------------------------------------

@pytest.mark.parametrize(("name", "files"), [("seq", SEQUENTIAL), ("par", PARALLEL)])
def test_archive_holds_the_spec_the_handler_and_the_manifest(
        tmp_path: Path, name: str, files: tuple[Path, Path]) -> None:
    spec, handler = files
    war = build(tmp_path, name, spec, handler)
    assert war == tmp_path / f"{name}.war"
    content = members(war)
    assert sorted(content) == sorted([MANIFEST_PATH, spec.name, handler.name])
    assert content[spec.name] == spec.read_bytes()
    assert content[handler.name] == handler.read_bytes()
    with zipfile.ZipFile(war) as archive:
        assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_DEFLATED}

    raw = json.loads(content[MANIFEST_PATH])
    assert key_paths(raw) == ["createdOn", "workflow", "workflow.workflowName",
                              "workflow.specFile", "workflow.handler", "archiverVersion"]
    assert raw["workflow"] == {"workflowName": name, "specFile": spec.name,
                               "handler": handler.name}
    datetime.strptime(raw["createdOn"], CREATED_ON_FORMAT)  # TorchServe's format, or raises
    manifest = read_manifest(war)
    assert (manifest.workflow_name, manifest.spec_file, manifest.handler) == (
        name, spec.name, handler.name)
    # What the server will do: read the spec inside the archive under the workflow's name.
    parsed = parse_spec(content[manifest.spec_file], manifest.workflow_name)
    assert parsed.model_names[0] == f"{name}__pre"


def test_extra_files_and_folders_land_at_the_root(tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    (extra / "sub").mkdir(parents=True)
    (extra / "labels.json").write_text("{}")
    (extra / "sub" / "words.txt").write_text("w")
    (extra / "__pycache__").mkdir()
    (extra / "__pycache__" / "x.pyc").write_bytes(b"")
    (extra / ".git").mkdir()
    (extra / ".git" / "HEAD").write_text("ref")
    single = tmp_path / "single.txt"
    single.write_text("s")
    out = tmp_path / "out"
    out.mkdir()
    war = build(out, "seq", *SEQUENTIAL, extra, single, SEQUENTIAL[1])  # the handler twice
    assert sorted(members(war)) == sorted([MANIFEST_PATH, "sequential.yaml",
                                           "sequential_handler.py", "labels.json",
                                           "sub/words.txt", "single.txt"])


def test_cli_writes_the_archive_and_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    args = ["--workflow-name", "seq", "--spec-file", str(SEQUENTIAL[0]),
            "--handler", str(SEQUENTIAL[1]), "--export-path", str(tmp_path)]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    assert first.output.strip() == str(tmp_path / "seq.war")
    before = (tmp_path / "seq.war").read_bytes()

    again = CliRunner().invoke(main, args)
    assert again.exit_code == 1
    assert "already exists" in again.output and "--force" in again.output
    assert (tmp_path / "seq.war").read_bytes() == before

    forced = CliRunner().invoke(main, [*args, "-f"])
    assert forced.exit_code == 0, forced.output
    assert sorted(members(tmp_path / "seq.war")) == sorted(members_of_seq())
    assert [p.name for p in tmp_path.iterdir()] == ["seq.war"]  # no temporary file left


def members_of_seq() -> list[str]:
    return [MANIFEST_PATH, SEQUENTIAL[0].name, SEQUENTIAL[1].name]


def test_cli_requires_torchserves_flags() -> None:
    missing_spec = CliRunner().invoke(main, ["--workflow-name", "x", "--handler", "h.py"])
    assert missing_spec.exit_code == 2 and "--spec-file" in missing_spec.output
    missing_handler = CliRunner().invoke(main, ["--workflow-name", "x", "--spec-file", "s"])
    assert missing_handler.exit_code == 2 and "--handler" in missing_handler.output


def test_cli_prints_the_specs_warnings(tmp_path: Path) -> None:
    spec = tmp_path / "late.yaml"
    spec.write_text("models:\n  m1: {url: m1.mar, batch_size: 4}\n  batch-size: 2\n"
                    "dag:\n  pre: [m1]\n")
    handler = tmp_path / "h.py"
    handler.write_text("def pre(data, context):\n    return data\n")
    result = CliRunner().invoke(main, ["--workflow-name", "late", "--spec-file", str(spec),
                                       "--handler", str(handler), "--export-path",
                                       str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "warning: models.m1.batch_size is ignored" in result.output
    assert "warning: models.batch-size comes after model 'm1'" in result.output


def test_both_command_names_are_installed() -> None:
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("workflow-archiver") == "workflow_archiver.cli:main"
    assert scripts.get("torch-workflow-archiver") == "workflow_archiver.cli:main"


# --- our archiver refuses what is unsafe or would not serve -------------------------------

def write_workflow(folder: Path, spec: str = "models: {}\ndag:\n  pre: []\n",
                   handler: str = "def pre(data, context):\n    return data\n"
                   ) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.yaml").write_text(spec)
    (folder / "handler.py").write_text(handler)
    return folder / "spec.yaml", folder / "handler.py"


def test_a_link_out_of_an_extra_folder_is_refused(tmp_path: Path) -> None:
    spec, handler = write_workflow(tmp_path / "src")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the archive")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "inside.txt").write_text("ok")
    (extra / "alias.txt").symlink_to(extra / "inside.txt")  # inside the tree: followed
    out = tmp_path / "out"
    out.mkdir()
    war = build(out, "ok", spec, handler, extra)
    assert members(war)["alias.txt"] == b"ok"

    (extra / "leak.txt").symlink_to(secret)
    with pytest.raises(WorkflowArchiverError, match="outside"):
        build(out, "leak", spec, handler, extra)
    (extra / "leak.txt").unlink()
    (extra / "up").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(WorkflowArchiverError, match="outside"):
        build(out, "leak", spec, handler, extra)
    assert not (out / "leak.war").exists()


@pytest.mark.parametrize(("change", "message"), [
    ({"workflow_name": "bad/name"}, "invalid workflow name"),
    ({"workflow_name": "-dash"}, "invalid workflow name"),
    ({"spec_file": "missing.yaml"}, "--spec-file: missing.yaml does not exist"),
    ({"handler": "missing.py"}, "--handler: missing.py does not exist"),
    # A workflow's handler is a file, always (as torch-workflow-archiver 0.2.15, which
    # refuses these three too): no built-in names, no module name, no ":function".
    ({"handler": "image_classifier"}, "--handler: image_classifier does not exist"),
    ({"handler": "handler"}, "--handler: handler does not exist"),
    ({"handler": "handler.py:pre"}, "--handler: handler.py:pre does not exist"),
    ({"export_path": Path("no/such/folder")}, "is not an existing directory"),
])
def test_bad_options_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 change: dict[str, object], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    spec, handler = write_workflow(tmp_path)
    values: dict[str, object] = {"workflow_name": "wf", "spec_file": str(spec),
                                 "handler": str(handler), "export_path": tmp_path, **change}
    with pytest.raises(WorkflowArchiverError, match=message):
        build_workflow_archive(WorkflowOptions(**values))  # type: ignore[arg-type]
    assert not list(tmp_path.glob("*.war"))


def test_a_handler_that_is_not_python_is_refused(tmp_path: Path) -> None:
    spec, _ = write_workflow(tmp_path)
    text = tmp_path / "handler.txt"
    text.write_text("def pre(data, context): ...\n")
    with pytest.raises(WorkflowArchiverError, match=r"not a \.py file"):
        build(tmp_path, "wf", spec, text)
    broken = tmp_path / "broken.py"
    broken.write_text("def pre(:\n")
    with pytest.raises(WorkflowArchiverError, match="not valid Python"):
        build(tmp_path, "wf", spec, broken)


def test_a_spec_the_server_would_refuse_writes_nothing(tmp_path: Path) -> None:
    spec, handler = write_workflow(tmp_path, spec="models: {}\ndag:\n  pre: [post]\n")
    with pytest.raises(SpecError, match="unknown node 'post'"):
        build(tmp_path, "wf", spec, handler)
    spec.write_text("models: {}\ndag:\n  a: [pre]\n  b: [pre]\n")
    with pytest.raises(InvalidDAGError, match="only one start node"):
        build(tmp_path, "wf", spec, handler)
    assert list(tmp_path.iterdir()) == [spec, handler]


def test_two_files_for_one_name_and_the_reserved_folder_are_refused(tmp_path: Path) -> None:
    spec, handler = write_workflow(tmp_path / "src")
    other = tmp_path / "other"
    other.mkdir()
    (other / "handler.py").write_text("something else\n")
    with pytest.raises(WorkflowArchiverError, match=r"would both be stored as 'handler\.py'"):
        build(tmp_path, "wf", spec, handler, other / "handler.py")
    reserved = tmp_path / "reserved"
    (reserved / "WAR-INF").mkdir(parents=True)
    (reserved / "WAR-INF" / "MANIFEST.json").write_text("{}")
    with pytest.raises(WorkflowArchiverError, match="reserved"):
        build(tmp_path, "wf", spec, handler, reserved)


# --- TorchServe's own torch-workflow-archiver --------------------------------------------

needs_ts_archiver = pytest.mark.skipif(
    not TS_ARCHIVER.exists(),
    reason="run `make test`: it installs torch-workflow-archiver 0.2.15 into "
           ".venv-torchserve-archiver")


def torchserve_archive(export: Path, name: str, spec: Path, handler: Path, *extra: Path
                       ) -> Path:
    # Without PYTHONPATH (our workflow_archiver shares TorchServe's package name), and with a
    # TMPDIR of the test's own: the tool copies its inputs into $TMPDIR/<workflow-name>.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["TMPDIR"] = str(export.parent)
    args = [str(TS_ARCHIVER), "--workflow-name", name, "--spec-file", str(spec),
            "--handler", str(handler), "--export-path", str(export)]
    if extra:
        args += ["--extra-files", ",".join(map(str, extra))]
    subprocess.run(args, check=True, capture_output=True, timeout=60, cwd=export, env=env)
    return export / f"{name}.war"


@needs_ts_archiver
@pytest.mark.parametrize(("name", "files"), [("seq", SEQUENTIAL), ("par", PARALLEL)])
def test_torchserves_archive_and_ours_hold_the_same(tmp_path: Path, name: str,
                                                    files: tuple[Path, Path]) -> None:
    extra = tmp_path / "labels.json"
    extra.write_text('{"0": "zero"}')
    theirs_dir, ours_dir = tmp_path / "theirs", tmp_path / "ours"
    theirs_dir.mkdir()
    ours_dir.mkdir()
    theirs = members(torchserve_archive(theirs_dir, name, *files, extra))
    ours = members(build(ours_dir, name, *files, extra))
    assert sorted(theirs) == sorted(ours)
    for member in theirs:
        if member != MANIFEST_PATH:
            assert theirs[member] == ours[member], member
    their_manifest, our_manifest = (json.loads(content[MANIFEST_PATH])
                                    for content in (theirs, ours))
    assert key_paths(their_manifest) == key_paths(our_manifest)
    assert their_manifest["workflow"] == our_manifest["workflow"]
    assert their_manifest["archiverVersion"] == "0.2.15"
    # The same formatting: only the two values that differ by nature may differ.
    for manifest in (their_manifest, our_manifest):
        manifest["createdOn"] = manifest["archiverVersion"] = ""
    assert (json.dumps(their_manifest, indent=2) == json.dumps(our_manifest, indent=2))
    text = theirs[MANIFEST_PATH].decode()
    assert text == WorkflowManifest.from_json(text).to_json()


@needs_ts_archiver
def test_torchserves_archive_reads_here(tmp_path: Path) -> None:
    war = torchserve_archive(tmp_path, "par", *PARALLEL)
    manifest = read_manifest(war)
    assert manifest.archiver_version == "0.2.15"
    assert (manifest.spec_file, manifest.handler) == ("parallel.yaml", "parallel_handler.py")
    spec = parse_spec(members(war)[manifest.spec_file], manifest.workflow_name)
    assert spec.model_names == ("par__pre", "par__m1", "par__m2", "par__aggregate")


# --- manifests ---------------------------------------------------------------------------

@pytest.mark.parametrize(("data", "message"), [
    ({"createdOn": "x", "archiverVersion": "0.2.15"}, "Missing Workflow entry in manifest"),
    ({"createdOn": "x", "archiverVersion": "0.2.15",
      "workflow": {"specFile": "s.yaml", "handler": "h.py"}}, "Workflow name is not defined"),
    ({"createdOn": "x", "workflow": {"workflowName": "w", "specFile": "s.yaml",
                                     "handler": "h.py"}},
     "Workflow archive version is not defined"),
    ({"archiverVersion": "0.2.15", "workflow": {"workflowName": "w", "specFile": "s.yaml",
                                                "handler": "h.py"}},
     "Workflow archive createdOn is not defined"),
    ({"createdOn": "x", "archiverVersion": "1", "workflow": {"workflowName": "w",
                                                             "handler": "h.py"}},
     'no "specFile"'),
    ({"createdOn": "x", "archiverVersion": "1", "workflow": {
        "workflowName": "w", "specFile": "../../etc/passwd", "handler": "h.py"}},
     "must name a file inside the archive"),
    ({"createdOn": "x", "archiverVersion": "1", "workflow": {
        "workflowName": "w", "specFile": "s.yaml", "handler": "/abs/h.py"}},
     "must name a file inside the archive"),
])
def test_manifests_torchserve_refuses_are_refused(data: dict[str, object], message: str
                                                  ) -> None:
    with pytest.raises(WorkflowManifestError, match=message):
        WorkflowManifest.from_dict(data)


def test_the_register_apis_name_replaces_the_manifests(tmp_path: Path) -> None:
    data = {"createdOn": "x", "archiverVersion": "1",
            "workflow": {"specFile": "s.yaml", "handler": "h.py"}}
    assert WorkflowManifest.from_dict(data, workflow_name="given").workflow_name == "given"
    war = tmp_path / "w.war"
    with zipfile.ZipFile(war, "w") as archive:
        archive.writestr(MANIFEST_PATH, json.dumps(data))
    assert read_manifest(war, workflow_name="renamed").workflow_name == "renamed"
    with pytest.raises(WorkflowManifestError, match="Workflow name is not defined"):
        read_manifest(war)
    not_zip = tmp_path / "x.war"
    not_zip.write_bytes(b"plain")
    with pytest.raises(WorkflowManifestError, match="not a workflow archive"):
        read_manifest(not_zip)


# --- specs -------------------------------------------------------------------------------

def test_sequential_spec() -> None:
    spec = load_spec(SEQUENTIAL[0], "seq")
    assert spec.order == ("pre", "m1", "post")
    assert (spec.root, spec.leaves) == ("pre", ("post",))
    assert [node.kind for node in spec] == [NodeKind.FUNCTION, NodeKind.MODEL,
                                            NodeKind.FUNCTION]
    assert spec.model_names == ("seq__pre", "seq__m1", "seq__post")
    m1 = spec["m1"]
    assert (m1.url, m1.parents, m1.children) == ("m1.mar", ("pre",), ("post",))
    assert m1.settings == NodeSettings(min_workers=1, max_workers=1, batch_size=8,
                                       max_batch_delay_ms=50, retry_attempts=1,
                                       timeout_ms=10000)
    assert spec["post"].input_name("m1") == "body"
    assert spec["pre"].settings == FUNCTION_NODE_SETTINGS  # retry 1, timeout 10000: globals
    assert (spec.unused_models, spec.warnings) == ((), ())


def test_parallel_spec() -> None:
    spec = load_spec(PARALLEL[0], "par", functions={"pre", "aggregate"})
    assert spec.order == ("pre", "m1", "m2", "aggregate")
    assert spec["pre"].children == ("m1", "m2")
    aggregate = spec["aggregate"]
    assert aggregate.parents == ("m1", "m2") and aggregate.is_function
    # Several parents: each output arrives under its node's name (TorchServe's DagExecutor).
    assert [aggregate.input_name(p) for p in aggregate.parents] == ["m1", "m2"]
    with pytest.raises(ValueError, match="not a parent"):
        aggregate.input_name("pre")
    assert spec["m2"].settings.batch_size == 4 and spec["m2"].settings.max_batch_delay_ms == 20
    assert spec["m1"].settings.batch_size == 8
    # Function nodes: TorchServe's fixed one worker, no batching, with the global retries.
    assert aggregate.settings == NodeSettings(min_workers=1, max_workers=1, batch_size=1,
                                              max_batch_delay_ms=0, retry_attempts=0,
                                              timeout_ms=10000)
    assert [n.name for n in spec.models] == ["m1", "m2"]
    assert [n.name for n in spec.functions] == ["pre", "aggregate"]


def test_defaults_are_torchserves_and_globals_apply_to_the_models_after_them() -> None:
    spec = parse_spec("""
models:
  early: {url: early.mar}
  batch-size: 4
  timeout-ms: 500
  late: {url: late.mar, max-workers: 3}
  unused: {max-workers: 2}
dag:
  start: [early, late]
  early: [end]
  late: [end, '', null]
""", "wf")
    assert spec["early"].settings == NodeSettings()  # 1, 1, 1, 50 ms, 1, 10000 ms
    assert spec["late"].settings == NodeSettings(batch_size=4, timeout_ms=500, max_workers=3)
    assert spec["end"].settings.timeout_ms == 500  # functions: the final global values
    assert spec.settings == NodeSettings(batch_size=4, timeout_ms=500)
    assert spec.unused_models == ("unused",)  # TorchServe never registers it: no url needed
    assert any("comes after model 'early'" in w for w in spec.warnings)
    assert any("'unused'" in w and "not register" in w for w in spec.warnings)
    assert spec["late"].children == ("end",)  # blank and null children are skipped


def test_a_diamond_orders_every_node_after_all_its_parents() -> None:
    spec = parse_spec("models: {}\ndag:\n  a: [c, b]\n  b: [d]\n  c: [b, d]\n", "wf")
    assert spec.order == ("a", "c", "b", "d")
    assert spec["b"].parents == ("a", "c") and spec["d"].parents == ("b", "c")
    assert spec.leaves == ("d",)


def test_several_leaves() -> None:
    spec = parse_spec("models: {m: {url: m.mar}}\ndag:\n  pre: [m, side]\n", "wf")
    assert spec.leaves == ("m", "side")


GOOD_DAG = "dag:\n  pre: [m1]\n"


@pytest.mark.parametrize(("text", "error", "message"), [
    ("models: [unclosed\n", SpecError, "Failed to parse yaml"),
    ("- a list\n", SpecError, "must be a mapping with 'models' and 'dag'"),
    (GOOD_DAG, SpecError, "no 'models' section"),
    ("models: [m1]\n" + GOOD_DAG, SpecError, "'models' must be a mapping"),
    ("models:\n  batch-size: '4'\n" + GOOD_DAG, SpecError, "models.batch-size must be an int"),
    ("models:\n  timeout-ms: 1.5\n" + GOOD_DAG, SpecError, "models.timeout-ms must be an int"),
    ("models:\n  max-workers: true\n" + GOOD_DAG, SpecError, "must be an integer"),
    ("models:\n  max-batch-delay:\n" + GOOD_DAG, SpecError, "must be an integer, got nothing"),
    ("models:\n  batch-size: 4294967296\n" + GOOD_DAG, SpecError, "out of range"),
    ("models:\n  batch-size: 0\n" + GOOD_DAG, SpecError, "must be at least 1"),
    ("models:\n  retry-attempts: -1\n" + GOOD_DAG, SpecError, "must be at least 0"),
    ("models:\n  retry-attempts: 101\n" + GOOD_DAG, SpecError,
     "models.retry-attempts = 101 is out of range: it must be from 0 to 100"),
    ("models:\n  m1: {url: m1.mar, timeout-ms: 0}\n" + GOOD_DAG, SpecError,
     "models.m1.timeout-ms = 0: it must be at least 1"),
    ("models:\n  m1: m1.mar\n" + GOOD_DAG, SpecError, "models.m1 must be a mapping"),
    ("models:\n  m1: {batch-size: 2}\n" + GOOD_DAG, SpecError, "models.m1 has no 'url'"),
    ("models:\n  m1: {url: 3}\n" + GOOD_DAG, SpecError, "models.m1.url must be a string"),
    ("models:\n  m1: {url: ../../m1.mar}\n" + GOOD_DAG, SpecError,
     "Relative path is not allowed"),
    ("models: {}\n", SpecError, "no 'dag' section"),
    ("models: {}\ndag: [pre]\n", SpecError, "'dag' must be a mapping"),
    ("models: {}\ndag:\n  pre:\n", SpecError, "dag.pre has no list of children"),
    ("models: {}\ndag:\n  pre: post\n", SpecError, r"write \[post\] for one child"),
    ("models: {}\ndag:\n  pre: [1]\n", SpecError, "1 is not a node name"),
    ("models: {}\ndag:\n  1: [pre]\n", SpecError, "1 is not a node name"),
    ("models: {}\ndag:\n  pre: [pre]\n", InvalidDAGError, "Self loop exception"),
    ("models: {}\ndag:\n  pre: [post, post]\n", InvalidDAGError, "loop exception: the edge"),
    ("models: {}\ndag:\n  a: [c]\n  b: [c]\n", InvalidDAGError,
     r"DAG should have only one start node \(found a, b\)"),
    ("models: {}\ndag:\n  a: [b]\n  b: [a]\n", InvalidDAGError,
     "only one start node .found none"),
    ("models: {}\ndag:\n  pre: [a]\n  a: [b]\n  b: [a]\n", InvalidDAGError,
     "Not a valid DAG: a cycle runs through a, b"),
    ("models: {}\ndag:\n  pre: [post-process]\n", SpecError, "not a Python identifier"),
    ("models: {}\ndag:\n  pre: [class]\n", SpecError, "not a Python identifier"),
    ("models: {}\ndag:\n  pre: [" + "x" * 130 + "]\n", SpecError, "at most 128 characters"),
])
def test_specs_that_torchserve_would_not_serve_are_refused(
        text: str, error: type[SpecError], message: str) -> None:
    with pytest.raises(error, match=message) as raised:
        parse_spec(text, "wf")
    if error is InvalidDAGError:
        assert raised.value.torchserve_type == "InvalidDAGException"


def test_unknown_function_nodes_and_workflow_names() -> None:
    text = "models: {m1: {url: m1.mar}}\ndag:\n  pre: [m1]\n  m1: [post]\n"
    with pytest.raises(SpecError, match="unknown node 'post': neither a model"):
        parse_spec(text, "wf", functions={"pre"})
    assert parse_spec(text, "wf", functions={"pre", "post"}).root == "pre"
    with pytest.raises(SpecError, match="invalid workflow name"):
        parse_spec(text, "w f")
    with pytest.raises(SpecError, match="over"):
        parse_spec(b"#" * (2 << 20), "wf")


def test_handler_names_sees_what_a_module_binds_without_running_it() -> None:
    source = """
import json
import os.path as osp
from functools import partial as make
from x import y

def pre(data, context): ...
async def post(data, context): ...
class Agg: ...
aggregate = make(pre)
if True:
    late: int = 1
try:
    import fast
except ImportError:
    fast = None
raise SystemExit("never run")
"""
    assert handler_names(source) == {"json", "osp", "make", "y", "pre", "post", "Agg",
                                     "aggregate", "late", "fast"}
    assert handler_names("from helpers import *\n") is None  # cannot tell
    with pytest.raises(WorkflowArchiverError, match="not valid Python"):
        handler_names("def (:\n")


# --- the fixture workflows, run as TorchServe passes data between nodes -------------------

def load_functions(path: Path) -> dict[str, Any]:
    module_spec = importlib.util.spec_from_file_location(f"fixture_{path.stem}", path)
    assert module_spec and module_spec.loader
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return vars(module)


def run_batch(files: tuple[Path, Path], name: str, bodies: list[bytes]) -> list[Any]:
    """One batch of requests through every node in order, each node's outputs passed on as
    bytes under ``NodeSpec.input_name`` (TorchServe's DagExecutor), the one leaf's answers
    returned as parsed JSON."""
    spec = load_spec(files[0], name)
    functions = load_functions(files[1])
    tagger = load_functions(ROOT / "tests" / "fixtures" / "handlers" / "tagger.py")["handle"]
    outputs: dict[str, list[bytes]] = {}
    for node in spec:
        if node.name == spec.root:
            rows: list[dict[str, Any]] = [{"body": body} for body in bodies]
        else:
            rows = [{node.input_name(parent): outputs[parent][i] for parent in node.parents}
                    for i in range(len(bodies))]
        handle = tagger if node.is_model else functions[node.name]
        context = SimpleNamespace(model_name=node.model_name)
        assert handle(None, context) is None  # TorchServe's call at load time
        outputs[node.name] = [json.dumps(item).encode() for item in handle(rows, context)]
    (leaf,) = spec.leaves
    return [json.loads(answer) for answer in outputs[leaf]]


def test_the_sequential_fixture_tags_its_input_at_every_node() -> None:
    answers = run_batch(SEQUENTIAL, "seq", [b"one", b"two"])
    assert [answer["text"] for answer in answers] == ["one|m1|post", "two|m1|post"]
    assert answers[0]["trail"] == [
        {"node": "seq__pre", "batch": 2, "inputs": ["body"]},
        {"node": "seq__m1", "batch": 2, "inputs": ["body"]},
        {"node": "seq__post", "batch": 2, "inputs": ["body"]}]


def test_the_parallel_fixture_joins_both_branches_by_node_name() -> None:
    (answer,) = run_batch(PARALLEL, "par", [b"hi"])
    assert answer["text"] == "hi|m1 + hi|m2|aggregate"
    assert answer["trail"] == [{"node": "par__aggregate", "batch": 1, "inputs": ["m1", "m2"]}]
    assert answer["branches"]["m2"]["trail"][-1] == {"node": "par__m2", "batch": 1,
                                                     "inputs": ["body"]}
    with pytest.raises(ValueError, match="m2 was asked to fail"):
        run_batch(PARALLEL, "par", [b"please fail@m2"])


def test_cli_takes_unique_prefixes_of_long_options_as_torchserves_tool_does(
        tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--workflow=seq", "--spec", str(SEQUENTIAL[0]),
                                       "--hand", str(SEQUENTIAL[1]), "--export", str(tmp_path),
                                       "--for"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "seq.war").is_file()
    ambiguous = CliRunner().invoke(main, ["--workflow-name", "x", "--spec-file", "s",
                                          "--handler", "h.py", "--ex", "e"])
    assert ambiguous.exit_code == 2 and (
        "ambiguous option: --ex could match --export-path, --extra-files" in ambiguous.output)
