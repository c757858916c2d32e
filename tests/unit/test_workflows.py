"""Workflows without a server: the spec, the DAG, the .war archive, the management routes'
statuses, start-up entries, and a function node's one-request-per-call worker."""

from __future__ import annotations

import json
import textwrap
import zipfile
from pathlib import Path

import pytest

from backend.service import load_service
from frontend.api.http.management import ManagementApp
from frontend.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    InvalidDag,
    InvalidWorkflow,
    WorkflowNotFound,
)
from frontend.ops.services import Services
from frontend.server import startup_workflows
from frontend.workflows import archive as archives
from frontend.workflows.dag import build_dag
from frontend.workflows.spec import NodeSettings, parse_spec
from protos import worker_pb2
from tests.conftest import server_config
from tests.unit.imports import restore_import_state  # noqa: F401 (a fixture)
from tests.unit.services import call, run_with_services

SPEC = """
models:
    min-workers: 1
    max-workers: 4
    batch-size: 3
    max-batch-delay : 5000
    retry-attempts : 3
    timeout-ms : 5000
    m1:
       url : model1.mar
       max-workers: 2
       batch-size: 4
    m2:
       url : model2.mar
    m3:
       url : model3.mar
       timeout-ms: 100
    spare:
       url : spare.mar
dag:
  pre_processing : [m1]
  m1 : [m2]
  m2 : [m3]
  m3 : [postprocessing]
"""


# ---- the spec ----------------------------------------------------------------------------------

def test_a_spec_gives_each_node_the_global_settings_and_its_own() -> None:
    spec = parse_spec(SPEC)
    assert spec.defaults == NodeSettings(1, 4, 3, 5000, 3, 5000)
    assert list(spec.nodes) == ["pre_processing", "m1", "m2", "m3", "postprocessing"]
    assert spec.nodes["m1"].settings == NodeSettings(1, 2, 4, 5000, 3, 5000)
    assert spec.nodes["m2"].url == "model2.mar"
    assert spec.nodes["m3"].settings.timeout_ms == 100
    # A function: one worker, no batch delay, the global retries and timeout (TorchServe's).
    pre = spec.nodes["pre_processing"]
    assert pre.is_function and not pre.batched
    assert pre.settings == NodeSettings(1, 1, 3, 0, 3, 5000)
    # Only the DAG's nodes are served.
    assert "spare" not in spec.nodes
    assert spec.dag_text() == ("{pre_processing=[m1], m1=[m2], m2=[m3], "
                               "m3=[postprocessing]}")


def test_torchserve_defaults_and_a_function_that_takes_batches() -> None:
    spec = parse_spec("""
models:
  m: {url: m.mar}
  agg: {batch-size: 16, max-batch-delay: 10}
dag:
  pre: [m, other]
  m: [agg]
  other: [agg]
""")
    assert spec.defaults == NodeSettings(1, 1, 1, 50, 1, 10000)
    agg = spec.nodes["agg"]
    assert agg.is_function and agg.batched
    assert (agg.settings.batch_size, agg.settings.max_batch_delay_ms) == (16, 10)
    assert not spec.nodes["other"].batched


@pytest.mark.parametrize(("text", "says"), [
    ("models: [\n", "Failed to parse yaml"),
    ("- a\n- b\n", "must be a mapping"),
    ("models: {}\n", "has no 'dag'"),
    ("models: {batch-size: two}\ndag: {a: [b]}\n", "batch-size must be an integer"),
    ("models: {batch-size: 0}\ndag: {a: [b]}\n", "batch-size must be >= 1"),
    ("models: {m: {url: 3}}\ndag: {a: [m]}\n", "url must be a string"),
    ("models: {m: m.mar}\ndag: {a: [m]}\n", "must be a mapping"),
    ("dag: {a: b}\n", "must list the nodes it feeds"),
    ("models: {m: {url: m.mar, min-workers: 3, max-workers: 2}}\ndag: {a: [m]}\n",
     "below min-workers"),
])
def test_a_spec_that_cannot_be_served_says_why(text: str, says: str) -> None:
    with pytest.raises(InvalidWorkflow, match=says):
        parse_spec(text)


def test_empty_dag_entries_are_skipped_as_torchserve_does() -> None:
    spec = parse_spec("dag:\n  a: [b, '', null]\n  b: []\n  c:\n")
    assert spec.edges == {"a": ("b",), "b": (), "c": ()}


# ---- the DAG -----------------------------------------------------------------------------------

def test_a_dag_knows_parents_children_order_and_leaves() -> None:
    dag = build_dag({"pre": ("m1", "m2"), "m1": ("agg",), "m2": ("agg",), "agg": ()})
    assert dag.start == "pre"
    assert dag.order == ("pre", "m1", "m2", "agg")
    assert dag.parents["agg"] == ("m1", "m2")
    assert dag.leaves == ("agg",)
    two_leaves = build_dag({"pre": ("a", "b")})
    assert two_leaves.leaves == ("a", "b")
    assert build_dag({"only": ()}).leaves == ("only",)


@pytest.mark.parametrize(("edges", "says"), [
    ({"a": ("a",)}, "Self loop exception"),
    ({"a": ("b",), "b": ("a",)}, "loop exception"),
    ({"a": ("c",), "b": ("c",)}, r"only one start node, found 2 \(a, b\)"),
    ({"s": ("a",), "a": ("b",), "b": ("c",), "c": ("a",)}, "Not a valid DAG: a cycle"),
])
def test_what_is_not_a_dag_is_refused(edges: dict[str, tuple[str, ...]], says: str) -> None:
    with pytest.raises(InvalidDag, match=says) as raised:
        build_dag(edges)
    assert raised.value.http_status == 400


# ---- the archive -------------------------------------------------------------------------------

def _war(path: Path, manifest: dict[str, object] | None, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as war:
        for name, text in files.items():
            war.writestr(name, text)
        if manifest is not None:
            war.writestr(archives.MANIFEST_PATH, json.dumps(manifest))
    return path


MANIFEST = {"createdOn": "29/12/2020 16:05:51", "archiverVersion": "0.2.0",
            "workflow": {"workflowName": "wf", "specFile": "wf.yaml", "handler": "wf.py"}}
FILES = {"wf.yaml": "dag:\n  pre: [post]\n", "wf.py": "def pre(d, c): return d\n"}


def test_a_war_is_found_in_the_store_and_unpacked(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    _war(store / "wf.war", MANIFEST, FILES)
    source, fetched = archives.locate("wf.war", store, (), 1 << 20)
    assert (source, fetched) == (store / "wf.war", None)
    work = tmp_path / "work"
    archive = archives.unpack("wf.war", source, work, None)
    assert (archive.name, archive.handler, list(archive.spec.nodes)) == ("wf", "wf.py",
                                                                         ["pre", "post"])
    assert (archive.directory / "wf.py").is_file()
    renamed = archives.unpack("wf.war", source, work, "other")
    assert renamed.name == "other"
    archive.remove()
    assert not archive.directory.exists() and source.exists()


def test_where_a_url_may_point(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    outside = _war(tmp_path / "outside.war", MANIFEST, FILES)
    with pytest.raises(BadRequest, match=r"^Parameter url is required\.$"):
        archives.locate("", store, (), 1)
    with pytest.raises(WorkflowNotFound, match=r"^Workflow store has not been configured"):
        archives.locate("wf.war", None, (), 1)
    with pytest.raises(WorkflowNotFound, match=r"^Workflow not found in workflow store: x\.war$"):
        archives.locate("x.war", store, (), 1)
    with pytest.raises(WorkflowNotFound, match=r"^Relative path is not allowed in url: \.\./"):
        archives.locate("../outside.war", store, (), 1)
    # Outside the store only where allowed_urls admits it; a file:// archive is copied in.
    with pytest.raises(Forbidden):
        archives.locate(str(outside), store, (), 1)
    with pytest.raises(Forbidden):
        archives.locate(f"file://{outside}", store, (), 1)
    with pytest.raises(Forbidden):
        archives.locate("https://example.com/wf.war", store, (), 1)
    allowed = (f"(file://)?{tmp_path}/.*",)
    assert archives.locate(str(outside), store, allowed, 1) == (outside, None)
    copied, fetched = archives.locate(f"file://{outside}", store, allowed, 1)
    assert copied == fetched == store / "outside.war" and copied.read_bytes() == \
        outside.read_bytes()
    with pytest.raises(Conflict):
        archives.locate(f"file://{outside}", store, allowed, 1)


@pytest.mark.parametrize(("manifest", "files", "says"), [
    (None, FILES, "has no WAR-INF/MANIFEST.json"),
    ({**MANIFEST, "workflow": None}, FILES, "Missing Workflow entry"),
    ({**MANIFEST, "workflow": {"specFile": "wf.yaml"}}, FILES, "Workflow name is not defined"),
    ({"createdOn": "x", "workflow": MANIFEST["workflow"]}, FILES, "version is not defined"),
    ({"archiverVersion": "x", "workflow": MANIFEST["workflow"]}, FILES,
     "createdOn is not defined"),
    (MANIFEST, {"wf.py": ""}, "no specFile 'wf.yaml'"),
    (MANIFEST, {"wf.yaml": "dag: {a: [b]}\n"}, "no handler 'wf.py'"),
    (MANIFEST, {**FILES, "wf.yaml": "dag: 3\n"}, "has no 'dag'"),
])
def test_an_archive_that_cannot_be_served_says_why(tmp_path: Path, manifest: dict | None,
                                                    files: dict[str, str], says: str) -> None:
    source = _war(tmp_path / "wf.war", manifest, files)
    work = tmp_path / "work"
    with pytest.raises(InvalidWorkflow, match=says):
        archives.unpack("wf.war", source, work, None)
    assert not list(work.iterdir())  # nothing left behind


def test_a_file_that_is_not_a_zip_is_not_a_workflow(tmp_path: Path) -> None:
    (tmp_path / "wf.war").write_bytes(b"not a zip")
    with pytest.raises(InvalidWorkflow, match=r"not a valid \.war"):
        archives.unpack("wf.war", tmp_path / "wf.war", tmp_path / "work", None)


def test_startup_entries(tmp_path: Path) -> None:
    (tmp_path / "b.war").write_bytes(b"")
    (tmp_path / "a.war").write_bytes(b"")
    (tmp_path / "m.mar").write_bytes(b"")
    config = server_config(tmp_path)
    assert startup_workflows(config, ("all",)) == [(None, "a.war"), (None, "b.war")]
    assert startup_workflows(config, ("x=b.war", "a.war")) == [("x", "b.war"), (None, "a.war")]


# ---- the management routes ---------------------------------------------------------------------

def test_the_model_api_switch_and_statuses_without_workers(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()

    async def closed(services: Services) -> None:
        app = ManagementApp(services)
        for method, path in (("POST", "/workflows"), ("DELETE", "/workflows/wf")):
            reply = await call(app, method, path, b"url=wf.war")
            assert reply.status == 405, reply.body
            assert "Model API is disabled" in reply.json()["message"]
        listed = await call(app, "GET", "/workflows")
        assert (listed.status, listed.json()) == (200, {"workflows": []})
        assert (await call(app, "GET", "/workflows/wf")).status == 404
        assert (await call(app, "PUT", "/workflows/wf")).status == 405

    run_with_services(tmp_path, store, closed, enable_model_api=False)

    async def opened(services: Services) -> None:
        app = ManagementApp(services)
        # TorchServe's JSON body, as well as the query.
        reply = await call(app, "POST", "/workflows", body=b'{"workflow_name": "x"}',
                           headers=[(b"content-type", b"application/json")])
        assert (reply.status, reply.json()["message"]) == (400, "Parameter url is required.")
        bad = await call(app, "POST", "/workflows", body=b"[1]",
                         headers=[(b"content-type", b"application/json")])
        assert bad.status == 400
        missing = await call(app, "POST", "/workflows", b"url=nope.war")
        assert missing.json() == {"code": 404, "type": "WorkflowNotFoundException",
                                  "message": "Workflow not found in workflow store: nope.war"}

    run_with_services(tmp_path, store, opened)


# ---- a function node's worker ------------------------------------------------------------------

@pytest.mark.usefixtures("restore_import_state")
def test_a_function_node_is_called_one_request_at_a_time(tmp_path: Path) -> None:
    model_dir = tmp_path / "wf"
    model_dir.mkdir()
    (model_dir / "wf.py").write_text(textwrap.dedent("""
        def pre(data, context):
            if data is None:
                return None
            return [f"{len(data)}:{data[0]['body'].decode()}"]
    """))
    message = worker_pb2.LoadModel(model_name="wf__pre", model_version="1.0",
                                   model_dir=str(model_dir), handler="wf.py:pre", batch_size=1,
                                   gpu_id=-1, manifest_json="{}", decode_input_request=True,
                                   one_request_per_call=True)
    service = load_service(message)
    requests = [worker_pb2.Request(request_id=str(i), inputs={"body": f"r{i}".encode()})
                for i in range(3)]
    result = service.predict(worker_pb2.PredictBatch(batch_id=1, requests=requests))
    assert [r.body for r in result.responses] == [b"1:r0", b"1:r1", b"1:r2"]
