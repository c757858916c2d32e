"""Workflows without a server: the spec, the DAG, the .war archive, the management routes'
statuses, start-up entries, and a function node's one-request-per-call worker."""

from __future__ import annotations

import json
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest

from backend.service.model_service import load_service
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
from frontend.workflows.spec import dag_text, read_spec
from protos import worker_pb2
from tests.conftest import server_config
from tests.unit.imports import restore_import_state  # noqa: F401 (a fixture)
from tests.unit.services import call, run_with_services


def test_a_spec_error_is_answered_400_naming_what_is_wrong() -> None:
    """The spec is read by workflow_archiver.spec (its own tests cover TorchServe's rules);
    the server answers its errors 400, a bad DAG as TorchServe types it."""
    with pytest.raises(InvalidDag, match="only one start node") as dag:
        read_spec("models: {}\ndag: {a: [c], b: [c]}\n", "wf", None)
    assert (dag.value.http_status, dag.value.type_name) == (400, "InvalidDAGException")
    with pytest.raises(InvalidWorkflow, match="batch-size") as bad:
        read_spec("models: {batch-size: two}\ndag: {a: [b]}\n", "wf", None)
    assert (bad.value.http_status, bad.value.type_name) == (400, "InvalidWorkflowException")
    with pytest.raises(InvalidWorkflow, match="unknown node"):
        read_spec("models: {}\ndag: {pre: [post]}\n", "wf", "def pre(d, c): pass\n")
    spec = read_spec("models: {}\ndag: {pre: [post]}\n", "wf",
                     "def pre(d, c): pass\ndef post(d, c): pass\n")
    assert (spec.root, spec.leaves, spec["post"].model_name) == ("pre", ("post",), "wf__post")


def test_describe_shows_the_dag_as_torchserve_prints_it() -> None:
    assert dag_text("dag:\n  pre: [m1, m2]\n  m1: [agg]\n  m2: [agg, null]\n") == \
        "{pre=[m1, m2], m1=[agg], m2=[agg, null]}"
    assert dag_text("not: [yaml") == "{}"


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
FILES = {"wf.yaml": "models: {}\ndag:\n  pre: [post]\n",
         "wf.py": "def pre(d, c): return d\ndef post(d, c): return d\n"}


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
    assert archive.spec["post"].model_name == "wf__post"
    assert (archive.directory / "wf.py").is_file()
    renamed = archives.unpack("wf.war", source, work, "other")
    assert (renamed.name, renamed.spec["pre"].model_name) == ("other", "other__pre")
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
    ({**MANIFEST, "workflow": {"workflowName": "wf", "specFile": "wf.yaml"}}, FILES,
     'no "handler"'),
    (MANIFEST, {"wf.py": ""}, "no specFile 'wf.yaml'"),
    (MANIFEST, {"wf.yaml": "dag: {a: [b]}\n"}, "no handler 'wf.py'"),
    (MANIFEST, {**FILES, "wf.yaml": "models: {}\ndag: 3\n"}, "'dag' must be a mapping"),
    (MANIFEST, {**FILES, "wf.yaml": "models: {}\ndag: {pre: [other]}\n"}, "unknown node"),
])
def test_an_archive_that_cannot_be_served_says_why(tmp_path: Path, manifest: dict | None,
                                                    files: dict[str, str], says: str) -> None:
    source = _war(tmp_path / "wf.war", manifest, files)
    work = tmp_path / "work"
    with pytest.raises(InvalidWorkflow, match=says):
        archives.unpack("wf.war", source, work, None)
    assert not list(work.iterdir())  # nothing left behind


@pytest.mark.parametrize(("raw_manifest", "files", "says"), [
    ("[" * 60_000, FILES, "manifest is not valid JSON: it nests too deeply"),
    (json.dumps({**MANIFEST, "pad": "x" * 70_000}), FILES,
     r"the WAR-INF/MANIFEST\.json is over 65536 bytes"),
    (json.dumps(MANIFEST), {**FILES, "wf.yaml": "#" * 70_000},
     r"the specFile 'wf\.yaml' is over 65536 bytes"),
    (json.dumps({**MANIFEST, "workflow": {**MANIFEST["workflow"],  # type: ignore[dict-item]
                                          "specFile": "/" + "\x1b" * 5000}}), FILES,
     r"must name a file inside the archive, got '/(\\x1b){99}'\.\.\. \(5001 characters\)$"),
])
def test_what_an_archive_holds_is_read_within_bounds(
        tmp_path: Path, raw_manifest: str, files: dict[str, str], says: str) -> None:
    source = _war(tmp_path / "wf.war", None, {**files, archives.MANIFEST_PATH: raw_manifest})
    work = tmp_path / "work"
    with pytest.raises(InvalidWorkflow, match=says):
        archives.unpack("wf.war", source, work, None)
    assert not list(work.iterdir())


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

def _function_service(tmp_path: Path, source: str) -> Any:
    model_dir = tmp_path / "wf"
    model_dir.mkdir()
    (model_dir / "wf.py").write_text(textwrap.dedent(source))
    return load_service(worker_pb2.LoadModel(
        model_name="wf__pre", model_version="1.0", model_dir=str(model_dir),
        handler="wf.py:pre", batch_size=4, gpu_id=-1, manifest_json="{}",
        decode_input_request=True, workflow_function=True))


def _batch(service: Any, batch_id: int, count: int) -> list[bytes]:
    requests = [worker_pb2.Request(request_id=f"{batch_id}.{i}",
                                   inputs={"body": f"r{i}".encode()}) for i in range(count)]
    result = service.predict(worker_pb2.PredictBatch(batch_id=batch_id, requests=requests))
    return [r.body for r in result.responses]


@pytest.mark.usefixtures("restore_import_state")
def test_a_function_node_that_takes_batches_gets_them_whole(tmp_path: Path) -> None:
    service = _function_service(tmp_path, """
        def pre(data, context):
            if data is None:
                return None
            return [f"{len(data)}:{row['body'].decode()}" for row in data]
    """)
    assert _batch(service, 1, 3) == [b"3:r0", b"3:r1", b"3:r2"]
    assert _batch(service, 2, 2) == [b"2:r0", b"2:r1"]


@pytest.mark.usefixtures("restore_import_state")
def test_a_function_written_for_one_request_is_called_one_request_at_a_time(
        tmp_path: Path) -> None:
    """TorchServe calls a workflow's functions with a list of one request; one that answers
    a batch with a single result is called per request from then on, every request answered
    with its own result."""
    service = _function_service(tmp_path, """
        calls = []

        def pre(data, context):
            if data is None:
                return None
            calls.append(len(data))
            return [f"{len(data)}:{data[0]['body'].decode()}"]
    """)
    assert _batch(service, 1, 3) == [b"1:r0", b"1:r1", b"1:r2"]
    assert _batch(service, 2, 2) == [b"1:r0", b"1:r1"]
    assert service.entry_point.handle.per_request
    module = service.entry_point.handle.__module__
    import sys
    assert sys.modules[module].calls == [3, 1, 1, 1, 1, 1]


@pytest.mark.usefixtures("restore_import_state")
def test_a_function_called_one_request_at_a_time_sees_its_request_and_fails_alone(
        tmp_path: Path) -> None:
    """Called per request, the function's context is that request's (its index 0: its id,
    headers and response status), and a request it fails on fails alone."""
    service = _function_service(tmp_path, """
        def pre(data, context):
            if data is None:
                return None
            body = data[0]["body"].decode()
            if body == "bad":
                raise ValueError("pre was asked to fail")
            context.set_response_status(201, "Made", 0)
            tag = context.get_request_header(0, "tag")
            return [f"{context.get_request_id()}:{tag}:{len(context.request_ids)}"]
    """)
    bodies = [b"a", b"bad", b"c"]
    requests = [worker_pb2.Request(request_id=f"id{i}", headers={"tag": f"t{i}"},
                                   inputs={"body": body}) for i, body in enumerate(bodies)]
    result = service.predict(worker_pb2.PredictBatch(batch_id=1, requests=requests))
    answers = [(r.request_id, r.status, r.body, r.error) for r in result.responses]
    assert answers == [("id0", 201, b"id0:t0:1", ""),
                       ("id1", 500, b"", "ValueError: pre was asked to fail"),
                       ("id2", 201, b"id2:t2:1", "")]
    assert service.entry_point.handle.per_request


@pytest.mark.usefixtures("restore_import_state")
def test_only_a_workflows_function_is_called_one_request_at_a_time(tmp_path: Path) -> None:
    """The same function as an ordinary model's handler: a batch answered with one result
    fails as the handler's error (no request could be told apart), as any handler's would."""
    model_dir = tmp_path / "plain"
    model_dir.mkdir()
    (model_dir / "plain.py").write_text(textwrap.dedent("""
        def pre(data, context):
            if data is None:
                return None
            return [data[0]["body"]]
    """))
    service = load_service(worker_pb2.LoadModel(
        model_name="plain", model_version="1.0", model_dir=str(model_dir),
        handler="plain.py:pre", batch_size=4, gpu_id=-1, manifest_json="{}",
        decode_input_request=True))
    requests = [worker_pb2.Request(request_id=f"id{i}", inputs={"body": b"x"})
                for i in range(3)]
    result = service.predict(worker_pb2.PredictBatch(batch_id=1, requests=requests))
    assert [r.status for r in result.responses] == [200, 200, 200]
    assert not hasattr(service.entry_point.handle, "per_request")
