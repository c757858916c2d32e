"""Workflows against the real server: real worker processes, real HTTP clients, .war
archives made by our workflow-archiver and by TorchServe's torch-workflow-archiver.

One server serves the module (token authorization on, so every call carries its key): the
sequential workflow ``seq`` (pre -> m1 -> post; our archiver) is loaded at start-up
(``load_workflows``), the parallel ``par`` (pre -> m1, m2 -> aggregate; TorchServe's archiver
when installed) and ``slow`` (pre -> m1 with two workers and a short timeout-ms) are
registered through the management API. The workflows are tests/fixtures/workflows; the model
nodes run tests/fixtures/handlers/tagger.py, whose answers trace the batch each request rode
in.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from model_archiver.packaging import ArchiveOptions, build_archive
from protos import management_pb2, management_pb2_grpc
from tests.conftest import HANDLERS, RunningServer, launch_server
from tests.unit.test_workflow_archiver import PARALLEL, SEQUENTIAL, TS_ARCHIVER, WORKFLOWS
from workflow_archiver.packaging import WorkflowOptions, build_workflow_archive

# Two workers on m1: a request that sleeps there holds one, the others use the other.
SLOW = """
models:
  batch-size: 4
  max-batch-delay: 5
  m1:
    url: m1.mar
    max-workers: 2
    timeout-ms: 700
    retry-attempts: 0
dag:
  pre: [m1]
"""

BAD_DAG = """
models:
  m1:
    url: m1.mar
dag:
  pre: [m1]
  post: [m1]
"""

BAD_NODE = """
models:
  m1:
    url: m1.mar
  m2:
    url: missing.mar
dag:
  pre: [m1]
  m1: [m2]
"""


# One model node, ``m`` (m1.mar: the tagger, version 1.0).
ONE_NODE = """
models:
  m:
    url: m1.mar
dag:
  m: []
"""


def _laughs(levels: int) -> str:
    """YAML anchors each listing the one before nine times: 9**levels strings once expanded,
    from a few hundred bytes."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "laughs:\n" + "".join(f"  {line}\n" for line in lines)


# The expansion where an error message quoted it (dag children that are not node names), and
# where nothing reads it (a top-level key the spec ignores, beside a spec that is fine).
BOMB_IN_DAG = _laughs(9) + "models:\n  m1:\n    url: m1.mar\ndag:\n  pre: *l9\n"
BOMB_BESIDE = _laughs(9) + ONE_NODE


def ours(store: Path, name: str, spec: Path, handler: Path) -> Path:
    return build_workflow_archive(WorkflowOptions(
        workflow_name=name, spec_file=str(spec), handler=str(handler), export_path=store,
        force=True)).path


def torchserves(store: Path, name: str, spec: Path, handler: Path) -> Path:
    # Without PYTHONPATH: a checkout on it would shadow TorchServe's own workflow_archiver.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    subprocess.run([str(TS_ARCHIVER), "--workflow-name", name, "--spec-file", str(spec),
                    "--handler", str(handler), "--export-path", str(store), "-f"],
                   check=True, capture_output=True, timeout=60, env=env)
    return store / f"{name}.war"


def zipped(store: Path, name: str, spec: str, handler: Path) -> Path:
    """A .war laid out as the archivers lay it out, for a spec neither would accept."""
    path = store / f"{name}.war"
    with zipfile.ZipFile(path, "w") as war:
        war.writestr(f"{name}.yaml", spec)
        war.write(handler, handler.name)
        war.writestr("WAR-INF/MANIFEST.json", json.dumps(
            {"createdOn": "01/01/2025 00:00:00", "archiverVersion": "0.2.15",
             "workflow": {"workflowName": name, "specFile": f"{name}.yaml",
                          "handler": handler.name}}))
    return path


@dataclass
class Served:
    server: RunningServer
    store: Path
    keys: dict[str, str]
    #: Which archiver made par.war.
    par_archiver: str

    def auth(self, kind: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[kind]}"}

    def manage(self, method: str, path: str, **params: object) -> requests.Response:
        return requests.request(method, f"{self.server.management}{path}", params=params,
                                headers=self.auth("management"), timeout=120)

    def predict(self, workflow: str, text: str) -> requests.Response:
        return requests.post(f"{self.server.inference}/wfpredict/{workflow}", data=text,
                             headers={**self.auth("inference"), "Content-Type": "text/plain"},
                             timeout=60)

    def describe(self, workflow: str) -> dict[str, Any]:
        response = self.manage("GET", f"/workflows/{workflow}")
        assert response.status_code == 200, response.text
        return response.json()[0]  # type: ignore[no-any-return]

    def node(self, workflow: str, name: str) -> dict[str, Any]:
        return next(n for n in self.describe(workflow)["nodes"] if n["name"] == name)

    def models(self) -> list[str]:
        return [m["modelName"] for m in self.manage("GET", "/models", limit=100).json()["models"]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("workflows")
    store = root / "model_store"
    store.mkdir()
    for model in ("m1", "m2"):
        build_archive(ArchiveOptions(model_name=model, version="1.0",
                                     handler=str(HANDLERS / "tagger.py"), export_path=store,
                                     force=True))
    ours(store, "seq", *SEQUENTIAL)
    par_archiver = "torch-workflow-archiver" if TS_ARCHIVER.exists() else "workflow-archiver"
    (torchserves if TS_ARCHIVER.exists() else ours)(store, "par", *PARALLEL)
    (root / "slow.yaml").write_text(SLOW)
    ours(store, "slow", root / "slow.yaml", SEQUENTIAL[1])
    (root / "bad_node.yaml").write_text(BAD_NODE)
    ours(store, "bad_node", root / "bad_node.yaml", SEQUENTIAL[1])
    zipped(store, "bad_dag", BAD_DAG, SEQUENTIAL[1])
    key_file = root / "key_file.json"
    server = launch_server(store, load_workflows=("seq.war",), disable_token_authorization=False,
                           key_file=key_file, batches_in_flight=1,
                           # a burst of 200 is never refused, even on a loaded machine
                           job_queue_size=500,
                           log_location=root / "logs",
                           access_log_extended=True)  # a line per node call too
    keys = {kind: entry["key"] for kind, entry in json.loads(key_file.read_text()).items()}
    served = Served(server, store, keys, par_archiver)
    try:
        for name in ("par", "slow"):
            response = served.manage("POST", "/workflows", url=f"{name}.war")
            assert response.status_code == 200, response.text
        yield served
    finally:
        server.stop()


# ---- a raw HTTP client: many requests at once, each answer checked to come exactly once ----

@dataclass
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def _exchange(port: int, path: str, body: bytes, headers: dict[str, str]) -> Answer:
    """One request on its own connection (Connection: close); the bytes that come back must be
    exactly one complete response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                     f"{head}\r\n".encode() + body)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()
    head_bytes, _, rest = raw.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(int(line.split(":", 1)[1]) for line in lines[1:]
                  if line.lower().startswith("content-length:"))
    assert len(rest) == length, f"not exactly one response: {raw[:300]!r}"
    return Answer(status, rest)


async def _send_all(served: Served, calls: list[tuple[str, str]]) -> list[Answer]:
    port = urlsplit(served.server.inference).port
    assert port is not None
    headers = served.auth("inference")
    return list(await asyncio.gather(*(
        _exchange(port, f"/wfpredict/{workflow}", text.encode(), headers)
        for workflow, text in calls)))


def send_all(served: Served, calls: list[tuple[str, str]]) -> list[Answer]:
    """POST each (workflow, text) to /wfpredict at once; the answers in the same order."""
    return asyncio.run(_send_all(served, calls))


def send_in_background(served: Served, call: tuple[str, str]) -> tuple[threading.Thread,
                                                                          list[Answer]]:
    answers: list[Answer] = []
    thread = threading.Thread(target=lambda: answers.extend(send_all(served, [call])),
                              daemon=True)
    thread.start()
    return thread, answers


def _samples(served: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = requests.get(f"{served.server.metrics}/metrics", timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _batch_of(trail: list[dict[str, Any]], model: str) -> int:
    return next(step["batch"] for step in trail if step["node"] == model)


# ---- the tests ---------------------------------------------------------------------------------

def test_200_concurrent_predictions_are_right_and_batch_at_every_node(served: Served) -> None:
    calls = [("seq" if i % 2 else "par", f"r{i}") for i in range(200)]
    answers = send_all(served, calls)
    batches: dict[str, int] = {}
    for (workflow, text), answer in zip(calls, answers, strict=True):
        assert answer.status == 200, answer.body
        result = answer.json()
        if workflow == "seq":
            assert result["text"] == f"{text}|m1|post"
            trail = result["trail"]
            # m1's output reached post as its one input, "body" (TorchServe's naming).
            assert trail[-1]["inputs"] == ["body"]
        else:
            assert result["text"] == f"{text}|m1 + {text}|m2|aggregate"
            # Several parents: one input each, named by the parent node.
            assert result["trail"][-1]["inputs"] == ["m1", "m2"]
            trail = [*result["branches"]["m1"]["trail"], result["branches"]["m2"]["trail"][-1],
                     *result["trail"]]
        for step in trail:
            batches[step["node"]] = max(batches.get(step["node"], 0), step["batch"])
    # Every node took batches of several requests: the model nodes, and the functions,
    # written for batches (TorchServe gives functions batches of one).
    for node in ("seq__m1", "par__m1", "par__m2", "seq__pre", "seq__post", "par__pre",
                 "par__aggregate"):
        assert batches[node] > 1, (node, batches)
    for workflow, node in (("seq", "pre"), ("par", "aggregate")):
        assert max(served.node(workflow, node)["batching"]["recentBatchSizes"]) > 1


def test_the_same_body_forms_as_predictions(served: Served) -> None:
    url = f"{served.server.inference}/wfpredict/seq"
    auth = served.auth("inference")
    form = requests.post(url, files={"data": ("a.txt", b"multipart")}, headers=auth, timeout=60)
    assert (form.status_code, form.json()["text"]) == (200, "multipart|m1|post"), form.text
    assert form.json()["trail"][0]["inputs"] == ["data"]  # the start node got the form field
    raw = requests.put(url, data=b"raw bytes", headers=auth, timeout=60)
    assert raw.json()["text"] == "raw bytes|m1|post"
    urlencoded = requests.post(url, data={"data": "urlencoded"}, headers=auth, timeout=60)
    assert urlencoded.json()["text"] == "urlencoded|m1|post"


def test_a_clients_deadline_bounds_the_whole_workflow(served: Served) -> None:
    url = f"{served.server.inference}/wfpredict/slow"
    headers = served.auth("inference")
    late = requests.post(url, data=b"sleep@m1=0.4", timeout=60,
                         headers={**headers, "X-Request-Timeout": "0.2"})
    assert late.status_code == 504, late.text
    assert late.json()["message"].startswith("Error executing m1 (workflow slow")
    assert "X-Request-Timeout passed" in late.json()["message"]
    bad = requests.post(url, data=b"x", timeout=60,
                        headers={**headers, "X-Request-Timeout": "soon"})
    assert bad.status_code == 400
    # The worker still sleeps out its batch: let it, before the next test counts on m1.
    served.server.wait_for(lambda: served.node("slow", "m1")["batching"]["inFlightBatches"]
                           == 0, "slow's m1 to be idle")


def test_par_was_archived_by_torchserves_own_archiver(served: Served) -> None:
    """``par`` (served by the other tests) was made by TorchServe's torch-workflow-archiver."""
    if served.par_archiver != "torch-workflow-archiver":
        pytest.skip(f"{TS_ARCHIVER} is missing: `make test` installs torch-workflow-archiver "
                    "0.2.15 (the other tests served par.war made by our archiver instead)")
    with zipfile.ZipFile(served.store / "par.war") as war:
        manifest = json.loads(war.read("WAR-INF/MANIFEST.json"))
    assert manifest["archiverVersion"] == "0.2.15"
    assert served.describe("par")["workflowUrl"] == "par.war"


def test_a_failing_and_a_timing_out_node_fail_only_their_requests(served: Served) -> None:
    timeouts = ("batchserve_workflow_node_calls_total",
                (("node", "m1"), ("outcome", "timeout"), ("workflow", "slow")))
    errors = ("batchserve_workflow_node_calls_total",
              (("node", "m1"), ("outcome", "error"), ("workflow", "seq")))
    before = _samples(served)
    # The slow request first, alone, so that it holds one of m1's two workers.
    thread, slow = send_in_background(served, ("slow", "sleep@m1=2"))
    served.server.wait_for(
        lambda: sum(w["status"] == "READY" for w in served.node("slow", "m1")["workers"]) == 2
        and served.node("slow", "m1")["batching"]["inFlightBatches"] == 1,
        "the slow request to reach m1")
    calls = [("slow", f"s{i}") for i in range(6)] + [("seq", f"q{i}") for i in range(6)]
    calls.append(("seq", "fail@m1"))
    answers = send_all(served, calls)
    for (workflow, text), answer in zip(calls, answers, strict=True):
        if text == "fail@m1":
            assert answer.status == 500
            error = answer.json()
            assert error["type"] == "InternalServerException"
            assert error["message"].startswith("Error executing m1 (workflow seq, model "
                                               "seq__m1) after 2 attempts: "), error
            assert "m1 was asked to fail" in error["message"]
        else:
            assert answer.status == 200, answer.body
            assert answer.json()["text"] == (f"{text}|m1|post" if workflow == "seq"
                                             else f"{text}|m1")
    thread.join(30)
    assert len(slow) == 1 and slow[0].status == 500
    message = slow[0].json()["message"]
    assert message.startswith("Error executing m1 (workflow slow, model slow__m1) after 1 "
                              "attempt: no answer within 0.7 s"), message
    after = _samples(served)
    assert after[timeouts] - before.get(timeouts, 0) == 1
    assert after[errors] - before.get(errors, 0) == 2  # retry-attempts: 1, so two calls


def test_a_function_written_for_one_request_answers_each_request_its_own(
        served: Served) -> None:
    """TorchServe calls a workflow's functions with one request at a time. Here their calls
    batch; a function written for one request answers a batch of several with one result, so
    it is called once per request from then on, each call's context that request's: every
    request gets its own answer, and the one the function fails on fails alone."""
    folder = WORKFLOWS / "one_at_a_time"
    ours(served.store, "single", folder / "one_at_a_time.yaml",
         folder / "one_at_a_time_handler.py")
    response = served.manage("POST", "/workflows", url="single.war")
    assert response.status_code == 200, response.text
    try:
        calls = [("single", f"r{i}") for i in range(40)] + [("single", "fail@pre")]
        answers = send_all(served, calls)
        assert answers[-1].status == 500, answers[-1].body
        assert "pre was asked to fail" in answers[-1].json()["message"]
        steps = []
        for (_, text), answer in zip(calls[:-1], answers[:-1], strict=True):
            assert answer.status == 200, answer.body
            assert answer.json()["text"] == f"{text}|m1"
            steps.append(answer.json()["trail"][0])
        assert {step["batch"] for step in steps} == {1}
        # Each call's request 0 was its own request.
        assert len({step["request"] for step in steps}) == len(steps)
        # ... though the node took batches of several.
        assert max(served.node("single", "pre")["batching"]["recentBatchSizes"]) > 1
    finally:
        assert served.manage("DELETE", "/workflows/single").status_code == 200


def test_management_bodies_and_statuses(served: Served) -> None:
    # Loaded at start-up, its nodes as TorchServe names their models; GET /models lists the
    # model nodes only, as TorchServe's (a function's url is the server's own copy), and
    # describe knows them all.
    listed_models = set(served.models())
    assert {"seq__m1", "par__m1", "par__m2"} <= listed_models
    assert not {"seq__pre", "seq__post", "par__pre", "par__aggregate"} & listed_models
    for function in ("seq__pre", "par__aggregate"):
        assert served.manage("GET", f"/models/{function}").status_code == 200
    listed = served.manage("GET", "/workflows", limit=1)
    assert listed.json() == {"nextPageToken": "1",
                             "workflows": [{"workflowName": "par", "workflowUrl": "par.war"}]}
    assert [w["workflowName"] for w in served.manage("GET", "/workflows").json()["workflows"]] \
        == ["par", "seq", "slow"]
    described = served.describe("par")
    assert {key: described[key] for key in ("workflowName", "workflowUrl", "minWorkers",
                                            "maxWorkers", "batchSize", "maxBatchDelay",
                                            "workflowDag")} == {
        "workflowName": "par", "workflowUrl": "par.war", "minWorkers": 1, "maxWorkers": 1,
        "batchSize": 8, "maxBatchDelay": 50,
        "workflowDag": "{pre=[m1, m2], m1=[aggregate], m2=[aggregate]}"}
    nodes = {node["name"]: node for node in described["nodes"]}
    assert (nodes["m2"]["modelName"], nodes["m2"]["type"], nodes["m2"]["url"]) == (
        "par__m2", "model", "m2.mar")
    assert (nodes["m2"]["batchSize"], nodes["m2"]["maxBatchDelay"]) == (4, 20)
    assert nodes["aggregate"]["parents"] == ["m1", "m2"]
    assert nodes["aggregate"]["type"] == "function"
    assert nodes["aggregate"]["handler"] == "parallel_handler.py:aggregate"
    assert len(nodes["m1"]["workers"]) == 1 and nodes["m1"]["workers"][0]["pid"] > 0

    duplicate = served.manage("POST", "/workflows", url="par.war")
    assert (duplicate.status_code, duplicate.json()["message"]) == (
        409, "Workflow par is already registered.")
    no_url = served.manage("POST", "/workflows")
    assert (no_url.status_code, no_url.json()["message"]) == (400, "Parameter url is required.")
    missing = served.manage("POST", "/workflows", url="nope.war")
    assert (missing.status_code, missing.json()["message"]) == (
        404, "Workflow not found in workflow store: nope.war")
    climbing = served.manage("POST", "/workflows", url="../fake.war")
    assert (climbing.status_code, climbing.json()["message"]) == (
        404, "Relative path is not allowed in url: ../fake.war")
    bad_dag = served.manage("POST", "/workflows", url="bad_dag.war")
    assert bad_dag.status_code == 400 and bad_dag.json()["type"] == "InvalidDAGException"
    assert "only one start node" in bad_dag.json()["message"]
    # A node that cannot register: 500, and what did register is removed again.
    failed = served.manage("POST", "/workflows", url="bad_node.war")
    assert failed.status_code == 500 and failed.json()["type"] == "WorkflowException"
    assert failed.json()["message"].startswith(
        "Workflow bad_node has failed to register. Failures: [Workflow Node bad_node__m2 "
        "failed to register. Details: "), failed.json()
    assert not [name for name in served.models() if name.startswith("bad_node__")]
    assert served.manage("GET", "/models/bad_node__pre").status_code == 404
    assert served.manage("GET", "/workflows/bad_node").status_code == 404
    # A node's model goes with its workflow only.
    refused = served.manage("DELETE", "/models/seq__m1")
    assert refused.status_code == 403 and "DELETE /workflows/seq" in refused.json()["message"]

    for method in ("GET", "DELETE"):
        unknown = served.manage(method, "/workflows/fake")
        assert (unknown.status_code, unknown.json()) == (404, {
            "code": 404, "type": "WorkflowNotFoundException",
            "message": "Workflow not found: fake"})
    unknown = served.predict("fake", "x")
    assert (unknown.status_code, unknown.json()["message"]) == (404, "Workflow not found: fake")


def test_token_authorization_guards_both_apis(served: Served) -> None:
    workflows = f"{served.server.management}/workflows"
    assert requests.get(workflows, timeout=10).status_code == 401
    assert requests.get(workflows, headers=served.auth("inference"), timeout=10).status_code \
        == 401
    predict = f"{served.server.inference}/wfpredict/seq"
    assert requests.post(predict, data=b"x", timeout=10).status_code == 401
    assert requests.post(predict, data=b"x", headers=served.auth("management"),
                         timeout=10).status_code == 401


def test_access_log_and_metrics_per_workflow_and_node(served: Served) -> None:
    assert served.predict("seq", "logged").json()["text"] == "logged|m1|post"
    samples = _samples(served)
    assert samples[("batchserve_workflow_requests_total",
                    (("code", "200"), ("workflow", "seq")))] >= 1
    assert samples[("batchserve_workflow_node_calls_total",
                    (("node", "post"), ("outcome", "ok"), ("workflow", "seq")))] >= 1
    # Each node call is a prediction of its model, in TorchServe's metrics.
    models = {dict(labels).get("model_name") for name, labels in samples
              if name == "ts_inference_latency_microseconds_total"}
    assert {"seq__pre", "seq__m1", "seq__post"} <= models
    log = served.server.server.config.log_location / "access_log.log"
    deadline = time.monotonic() + 10
    while True:
        text = log.read_text() if log.exists() else ""
        if re.search(r'"POST /wfpredict/seq HTTP/1\.1" 200 .* model=seq version=workflow', text) \
                and re.search(r'"POST /wfpredict/seq HTTP/1\.1" 200 .* model=seq__m1 '
                              r'version=1\.0 .* batch=\d+', text):
            break
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(0.05)


def test_a_workflow_request_is_one_call_of_the_plane_however_it_ends(served: Served) -> None:
    """Issue 32: a /wfpredict request is a call of the inference plane, as a prediction is:
    its X-Request-Timeout read as /predictions reads it, and its one access line and count
    written by the plane, whether the DAG answered it (200) or its deadline refused it (400)."""
    code = ("batchserve_workflow_requests_total", (("code", "400"), ("workflow", "seq")))
    before = _samples(served).get(code, 0.0)
    headers = {**served.auth("inference"), "X-Request-Timeout": "soon"}
    refused = requests.post(f"{served.server.inference}/wfpredict/seq?probe=refused",
                            data=b"x", headers=headers, timeout=60)
    direct = requests.post(f"{served.server.inference}/predictions/seq__m1", data=b"x",
                           headers=headers, timeout=60)
    assert refused.status_code == direct.status_code == 400, refused.text
    assert refused.json()["message"] == direct.json()["message"] == \
        "x-request-timeout must be a number of seconds, got 'soon'"
    assert served.predict("seq", "counted").json()["text"] == "counted|m1|post"
    assert _samples(served)[code] == before + 1
    log = served.server.server.config.log_location / "access_log.log"
    line = r'"POST /wfpredict/seq\?probe=refused HTTP/1\.1" 400 .* model=seq version=workflow'
    served.server.wait_for(lambda: log.exists() and re.search(line, log.read_text()) is not None,
                           "the refused request's line")
    assert len(re.findall(r"/wfpredict/seq\?probe=refused ", log.read_text())) == 1


def _one_node_war(served: Served, name: str, spec: str = ONE_NODE) -> None:
    spec_path = served.store.parent / f"{name}.yaml"
    spec_path.write_text(spec)
    ours(served.store, name, spec_path, SEQUENTIAL[1])


def _intruder(served: Served, version: str) -> str:
    """An echo model archive of ``version`` (registered under a node's name, it would answer
    the text back, untagged)."""
    name = f"intruder-{version}"
    build_archive(ArchiveOptions(model_name=name, version=version,
                                 handler=str(HANDLERS / "echo.py"), export_path=served.store,
                                 force=True))
    return f"{name}.mar"


def _message(response: requests.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return str(response.json()["message"])


def _grpc_management(served: Served) -> tuple[Any, tuple[tuple[str, str], ...]]:
    port = served.server.grpc_management_port
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return (management_pb2_grpc.ManagementAPIsServiceStub(channel),  # type: ignore[no-untyped-call]
            (("authorization", f"Bearer {served.keys['management']}"),))


def test_a_workflow_cannot_take_a_registered_models_name(served: Served) -> None:
    """Issue 31: with ``wfc__m`` v2.0 registered, workflow ``wfc`` (node ``m``) registered as
    one more version of it, and its node calls were answered by the model already there."""
    registered = served.manage("POST", "/models", url=_intruder(served, "2.0"),
                               model_name="wfc__m", initial_workers=1)
    assert registered.status_code == 200, registered.text
    _one_node_war(served, "wfc")
    try:
        refused = served.manage("POST", "/workflows", url="wfc.war")
        assert _message(refused, 409) == ("Model wfc__m is already registered: workflow wfc "
                                          "cannot serve a node under its name")
        assert served.predict("wfc", "hello").status_code == 404
        assert served.manage("GET", "/workflows/wfc").status_code == 404
        # The model is untouched: one version, its own answers.
        versions = served.manage("GET", "/models/wfc__m/all").json()
        assert [v["modelVersion"] for v in versions] == ["2.0"]
        answer = requests.post(f"{served.server.inference}/predictions/wfc__m", data=b"hello",
                               headers=served.auth("inference"), timeout=60)
        assert (answer.status_code, answer.content) == (200, b"hello")
    finally:
        assert served.manage("DELETE", "/models/wfc__m").status_code == 200
    # Its name free again, the workflow registers and its node answers.
    assert served.manage("POST", "/workflows", url="wfc.war").status_code == 200
    try:
        assert served.predict("wfc", "hello").json()["text"] == "hello|m"
    finally:
        assert served.manage("DELETE", "/workflows/wfc").status_code == 200


def test_no_registration_or_change_reaches_a_workflows_node(served: Served) -> None:
    """Issue 31: registering ``wfh__m`` v9.0 and making it the default took over a running
    workflow. Now nothing but the workflow registers, replaces, rescales, re-defaults or
    removes its node, over REST or gRPC, and its calls keep reaching the node."""
    _one_node_war(served, "wfh")
    assert served.manage("POST", "/workflows", url="wfh.war").status_code == 200
    try:
        node = "Model wfh__m is a node of workflow wfh"
        intruder = _intruder(served, "9.0")
        for url in (intruder, "m1.mar"):  # the node's own archive and version, too
            registered = served.manage("POST", "/models", url=url, model_name="wfh__m")
            assert _message(registered, 409).startswith(node)
        changes: tuple[tuple[str, str, dict[str, object]], ...] = (
            ("PUT", "/models/wfh__m/1.0/set-default", {}),
            ("PUT", "/models/wfh__m", {"min_worker": 3}),
            ("PUT", "/models/wfh__m/1.0", {"min_worker": 0}),
            ("DELETE", "/models/wfh__m", {}),
            ("DELETE", "/models/wfh__m/1.0", {}))
        for method, path, params in changes:
            assert _message(served.manage(method, path, **params), 403).startswith(node)
        stub, admin = _grpc_management(served)
        calls = (
            (stub.RegisterModel, management_pb2.RegisterModelRequest(
                url=intruder, model_name="wfh__m"), grpc.StatusCode.ALREADY_EXISTS),
            (stub.SetDefault, management_pb2.SetDefaultRequest(
                model_name="wfh__m", model_version="1.0"), grpc.StatusCode.PERMISSION_DENIED),
            (stub.ScaleWorker, management_pb2.ScaleWorkerRequest(
                model_name="wfh__m", min_worker=4), grpc.StatusCode.PERMISSION_DENIED),
            (stub.UnregisterModel, management_pb2.UnregisterModelRequest(
                model_name="wfh__m"), grpc.StatusCode.PERMISSION_DENIED))
        for call, request, code in calls:
            with pytest.raises(grpc.RpcError) as refused:
                call(request, metadata=admin, timeout=30)
            assert refused.value.code() == code
            assert str(refused.value.details()).startswith(node)
        described = served.manage("GET", "/models/wfh__m/all").json()
        assert [(d["modelVersion"], d["minWorkers"]) for d in described] == [("1.0", 1)]
        answer = served.predict("wfh", "hello").json()
        assert (answer["text"], answer["trail"][-1]["node"]) == ("hello|m", "wfh__m")
    finally:
        assert served.manage("DELETE", "/workflows/wfh").status_code == 200
    assert served.manage("GET", "/models/wfh__m").status_code == 404


def test_two_workflows_cannot_share_a_node_name(served: Served) -> None:
    """Issue 31: workflow ``x`` with node ``y__z`` and workflow ``x__y`` with node ``z`` both
    registered (model ``x__y__z`` twice), and ``/wfpredict/x__y`` was answered by x's node.
    Whichever registers second is refused, and the first keeps its node."""
    build_archive(ArchiveOptions(model_name="tagger2", version="2.0",
                                 handler=str(HANDLERS / "tagger.py"), export_path=served.store,
                                 force=True))
    _one_node_war(served, "x", ONE_NODE.replace("m:", "y__z:"))
    # Another version: TorchServe would add it beside x's, under the same name.
    _one_node_war(served, "x__y", ONE_NODE.replace("m:", "z:").replace("m1.mar", "tagger2.mar"))
    for first, second in (("x", "x__y"), ("x__y", "x")):
        assert served.manage("POST", "/workflows", url=f"{first}.war").status_code == 200
        try:
            assert _message(served.manage("POST", "/workflows", url=f"{second}.war"), 409) == (
                f"Model x__y__z is a node of workflow {first}: its name is the workflow's alone "
                f"(it is registered and removed with the workflow)")
            assert served.predict(second, "hello").status_code == 404
            answer = served.predict(first, "hello").json()
            assert answer["text"] == "hello|z" and answer["trail"][-1]["node"] == "x__y__z"
        finally:
            assert served.manage("DELETE", f"/workflows/{first}").status_code == 200


@pytest.mark.parametrize("spec", [BOMB_IN_DAG, BOMB_BESIDE], ids=["in-dag", "beside"])
def test_a_spec_that_expands_by_aliases_is_refused_small(served: Served, spec: str) -> None:
    """Issue 31: a 1,892-byte .war whose spec expands by YAML aliases got a 34.7 MB answer
    (the expansion quoted in it) and grew the frontend by 100 MiB. Now: a short 400, no
    growth, the server serving on."""
    path = zipped(served.store, "bomb", spec, SEQUENTIAL[1])
    assert path.stat().st_size < 4096
    process = psutil.Process()
    before = process.memory_info().rss
    refused = served.manage("POST", "/workflows", url="bomb.war")
    grown = process.memory_info().rss - before
    assert len(refused.content) < 1024, len(refused.content)
    message = _message(refused, 400)
    assert refused.json()["type"] == "InvalidWorkflowException"
    assert message.startswith("Failed to parse yaml: the document expands to more than "), \
        message
    assert grown < 30 << 20, f"the server grew by {grown >> 20} MiB"
    assert served.manage("GET", "/workflows/bomb").status_code == 404
    assert served.predict("seq", "still").json()["text"] == "still|m1|post"


def test_a_war_that_unpacks_beyond_its_bound_is_refused_before_unpacking(
        served: Served) -> None:
    """A zip bomb: a .war of a few hundred kB whose extra file unpacks to 257 MiB."""
    path = zipped(served.store, "zipbomb", ONE_NODE, SEQUENTIAL[1])
    with zipfile.ZipFile(path, "a", zipfile.ZIP_DEFLATED) as war, \
            war.open("zeros.bin", "w", force_zip64=True) as member:
        chunk = bytes(1 << 20)
        for _ in range(257):
            member.write(chunk)
    assert path.stat().st_size < 1 << 20
    work_dir = served.server.server.services.workflows.work_dir  # type: ignore[union-attr]
    before = set(work_dir.iterdir()) if work_dir.exists() else set()
    refused = served.manage("POST", "/workflows", url="zipbomb.war")
    assert re.fullmatch(r"zipbomb\.war unpacks to 2694\d{5} bytes, over the limit of "
                        r"268435456 for a \.war archive", _message(refused, 400)), refused.text
    assert set(work_dir.iterdir()) == before  # nothing was unpacked


def test_a_model_config_that_expands_is_refused_small(served: Served) -> None:
    """The same bound on a .mar's model-config.yaml (the one YAML reader for what archives
    carry), and nesting beyond it refused as well."""
    for name, text in (("laughs", _laughs(9)), ("nested", "a: " + "[" * 5000 + "]" * 5000)):
        config = served.store.parent / f"{name}-config.yaml"
        config.write_text(text)
        build_archive(ArchiveOptions(model_name=f"cfg-{name}", handler=str(HANDLERS / "echo.py"),
                                     config_file=str(config), export_path=served.store,
                                     force=True))
        refused = served.manage("POST", "/models", url=f"cfg-{name}.mar")
        assert len(refused.content) < 1024, len(refused.content)
        assert _message(refused, 400).startswith(f"invalid {config.name}: the document "), \
            refused.text
        assert served.manage("GET", f"/models/cfg-{name}").status_code == 404


def test_torchserves_access_log_has_one_line_per_workflow_request(
        served: Served, tmp_path: Path) -> None:
    """Without access_log_extended: the /wfpredict request's line alone, as TorchServe logs a
    request; its node calls are no lines of their own."""
    server = launch_server(served.store, load_workflows=("seq.war",),
                           log_location=tmp_path / "logs")
    try:
        answer = requests.post(f"{server.inference}/wfpredict/seq", data="once", timeout=60,
                               headers={"Content-Type": "text/plain"})
        assert answer.json()["text"] == "once|m1|post"
        log = tmp_path / "logs" / "access_log.log"
        server.wait_for(lambda: log.exists() and "/wfpredict/seq" in log.read_text(),
                        "the request's line")
    finally:
        server.stop()  # flushes the log: a node call's line would be there by now
    lines = log.read_text().splitlines()
    assert len(lines) == 1, lines
    assert re.fullmatch(r'\S+ - /127\.0\.0\.1:\d+ "POST /wfpredict/seq HTTP/1\.1" 200 \d+',
                        lines[0]), lines


def test_unregister_under_traffic_answers_every_request_once(served: Served) -> None:
    """The last test: it removes ``slow``."""
    services = served.server.server.services
    assert services is not None
    workflow_dir = services.workflows.registry.get("slow").archive.directory

    async def main() -> tuple[list[Answer], requests.Response]:
        first = asyncio.ensure_future(_send_all(served, [("slow", f"a{i}") for i in range(60)]))
        await asyncio.sleep(0.05)
        removal = asyncio.ensure_future(asyncio.to_thread(served.manage, "DELETE",
                                                          "/workflows/slow"))
        later = []
        for i in range(60):
            later.append(asyncio.ensure_future(_send_all(served, [("slow", f"b{i}")])))
            await asyncio.sleep(0.002)
        answers = [*await first, *(answer for batch in await asyncio.gather(*later)
                                   for answer in batch)]
        return answers, await removal

    answers, removal = asyncio.run(main())
    assert removal.status_code == 200
    assert removal.json() == {"status": 'Workflow "slow" unregistered'}
    statuses = [answer.status for answer in answers]
    assert set(statuses) <= {200, 404, 503}, statuses
    assert statuses.count(200) >= 1 and statuses.count(404) + statuses.count(503) >= 1
    for index, answer in enumerate(answers):
        if answer.status == 200:
            text = f"a{index}" if index < 60 else f"b{index - 60}"
            assert answer.json()["text"] == f"{text}|m1"
    assert not [name for name in served.models() if name.startswith("slow__")]
    assert served.manage("GET", "/models/slow__pre").status_code == 404
    assert not workflow_dir.exists()
    assert served.manage("GET", "/workflows/slow").status_code == 404
