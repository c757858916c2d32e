"""Workflows against the real server: real worker processes, .war archives laid out as
TorchServe's torch-workflow-archiver writes them, real HTTP clients.

One server serves the module (token authorization on, so every call carries its key): the
sequential workflow ``seq`` (pre -> add -> double) is loaded at start-up (``load_workflows``),
the parallel ``par`` (pre -> plus, times -> agg) and ``slow`` (pre -> double, a short
timeout-ms) are registered through the management API. The model nodes run
tests/fixtures/handlers/wf_stage.py, whose answers trace the batch each request rode in.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from model_archiver.packaging import ArchiveOptions, build_archive
from tests.conftest import HANDLERS, ROOT, RunningServer, launch_server

FUNCTIONS = ROOT / "tests" / "fixtures" / "workflows" / "core_functions.py"

SEQ = """
models:
  min-workers: 1
  max-workers: 1
  batch-size: 8
  max-batch-delay: 20
  timeout-ms: 20000
  add:
    url: wf_stage.mar
  double:
    url: wf_stage.mar
dag:
  pre: [add]
  add: [double]
"""

PAR = """
models:
  batch-size: 8
  max-batch-delay: 20
  timeout-ms: 20000
  plus:
    url: wf_stage.mar
  times:
    url: wf_stage.mar
  agg:
    batch-size: 8
dag:
  pre: [plus, times]
  plus: [agg]
  times: [agg]
"""

# Two workers on double: a request that sleeps there holds one, the others use the other.
SLOW = """
models:
  batch-size: 4
  max-batch-delay: 5
  double:
    url: wf_stage.mar
    max-workers: 2
    timeout-ms: 700
    retry-attempts: 0
dag:
  pre: [double]
"""

BAD_DAG = """
models:
  add:
    url: wf_stage.mar
dag:
  pre: [add]
  other: [add]
"""

BAD_NODE = """
models:
  add:
    url: wf_stage.mar
  gone:
    url: missing.mar
dag:
  pre: [add]
  add: [gone]
"""


def build_war(store: Path, name: str, spec: str, handler: Path | None = FUNCTIONS) -> Path:
    """A .war as TorchServe's torch-workflow-archiver writes it: the spec, the handler file
    and WAR-INF/MANIFEST.json, flat in a zip."""
    workflow: dict[str, str] = {"workflowName": name, "specFile": f"{name}.yaml"}
    path = store / f"{name}.war"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as war:
        war.writestr(f"{name}.yaml", spec)
        if handler is not None:
            war.write(handler, handler.name)
            workflow["handler"] = handler.name
        war.writestr("WAR-INF/MANIFEST.json", json.dumps(
            {"createdOn": "01/01/2025 00:00:00", "archiverVersion": "0.2.1",
             "workflow": workflow}))
    return path


@dataclass
class Served:
    server: RunningServer
    store: Path
    keys: dict[str, str]

    def auth(self, kind: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[kind]}"}

    def manage(self, method: str, path: str, **params: object) -> requests.Response:
        return requests.request(method, f"{self.server.management}{path}", params=params,
                                headers=self.auth("management"), timeout=120)

    def predict(self, workflow: str, document: dict[str, object]) -> requests.Response:
        return requests.post(f"{self.server.inference}/wfpredict/{workflow}",
                             json=document, headers=self.auth("inference"), timeout=60)

    def describe(self, workflow: str) -> dict[str, object]:
        response = self.manage("GET", f"/workflows/{workflow}")
        assert response.status_code == 200, response.text
        return response.json()[0]  # type: ignore[no-any-return]

    def models(self) -> list[str]:
        return [m["modelName"] for m in self.manage("GET", "/models", limit=100).json()["models"]]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("workflows")
    store = root / "model_store"
    store.mkdir()
    build_archive(ArchiveOptions(model_name="wf_stage", version="1.0",
                                 handler=str(HANDLERS / "wf_stage.py"), export_path=store,
                                 force=True))
    for name, spec in (("seq", SEQ), ("par", PAR), ("slow", SLOW), ("bad_dag", BAD_DAG),
                       ("bad_node", BAD_NODE)):
        build_war(store, name, spec)
    build_war(store, "no_handler", SEQ, handler=None)
    key_file = root / "key_file.json"
    server = launch_server(store, load_workflows=("seq.war",), disable_token_authorization=False,
                           key_file=key_file, job_queue_size=1000, batches_in_flight=1,
                           log_location=root / "logs")
    keys = {kind: entry["key"] for kind, entry in json.loads(key_file.read_text()).items()}
    served = Served(server, store, keys)
    for name in ("par", "slow"):
        response = served.manage("POST", "/workflows", url=f"{name}.war")
        assert response.status_code == 200, response.text
    try:
        yield served
    finally:
        server.stop()


# ---- a raw HTTP client: many requests at once, each answer checked to come exactly once ----

@dataclass
class Answer:
    status: int
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


async def _exchange(port: int, path: str, body: bytes, headers: dict[str, str]) -> Answer:
    """One request on its own connection (Connection: close); the bytes that come back must be
    exactly one complete response."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = "".join(f"{name}: {value}\r\n" for name, value in headers.items())
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
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


def run_all(served: Served, calls: list[tuple[str, dict[str, object]]],
            between: float = 0.0) -> list[Answer]:
    """POST each (workflow, document) to /wfpredict at once (``between``: seconds between
    starts); the answers in the same order."""
    port = urlsplit(served.server.inference).port
    assert port is not None
    headers = served.auth("inference")

    async def main() -> list[Answer]:
        tasks = []
        for workflow, document in calls:
            tasks.append(asyncio.ensure_future(_exchange(
                port, f"/wfpredict/{workflow}", json.dumps(document).encode(), headers)))
            if between:
                await asyncio.sleep(between)
        return list(await asyncio.gather(*tasks))

    return asyncio.run(main())


def _expected(workflow: str, x: int) -> int:
    return (x + 1) * 2 if workflow == "seq" else (x + 10) + x * 3


# ---- the tests ---------------------------------------------------------------------------------

def test_200_concurrent_predictions_are_right_and_batch_at_every_node(served: Served) -> None:
    calls: list[tuple[str, dict[str, object]]] = [
        ("seq" if i % 2 else "par", {"x": i}) for i in range(200)]
    answers = run_all(served, calls)
    batches: dict[str, int] = {}
    for (workflow, document), answer in zip(calls, answers, strict=True):
        assert answer.status == 200, answer.body
        result = answer.json()
        assert isinstance(result, dict)
        assert result["x"] == _expected(workflow, int(document["x"]))  # type: ignore[call-overload]
        for node, size in result["trace"]:
            key = f"{workflow}.{node}"
            batches[key] = max(batches.get(key, 0), size)
    # Every model node took batches; the functions: pre one request per call (TorchServe's
    # contract), agg whole batches (listed under models without a url).
    for node in ("seq.add", "seq.double", "par.plus", "par.times", "par.agg"):
        assert batches[node] > 1, (node, batches)
    assert batches["seq.pre"] == batches["par.pre"] == 1
    # ...while pre's own queue still gathered the calls into batches of several.
    pre = next(n for n in served.describe("seq")["nodes"] if n["name"] == "pre")  # type: ignore[union-attr, index]
    assert max(pre["batching"]["recentBatchSizes"]) > 1, pre["batching"]


def test_the_same_body_forms_as_predictions(served: Served) -> None:
    url = f"{served.server.inference}/wfpredict/seq"
    auth = served.auth("inference")
    form = requests.post(url, files={"data": ("x.json", b'{"x": 4}')}, headers=auth,
                         timeout=60)
    assert form.status_code == 200, form.text
    assert form.json()["x"] == 10
    raw = requests.put(url, data=b'{"x": 5}', headers=auth, timeout=60)
    assert raw.json()["x"] == 12
    urlencoded = requests.post(url, data={"data": '{"x": 6}'}, headers=auth, timeout=60)
    assert urlencoded.json()["x"] == 14


def test_a_failing_and_a_timing_out_node_fail_only_their_requests(served: Served) -> None:
    # The slow request first, alone, so that it holds one of double's two workers.
    slow = run_all_async_start(served, ("slow", {"x": 1, "sleep": {"double": 2.0}}))
    served.server.wait_for(
        lambda: sum(w["status"] == "READY" for n in served.describe("slow")["nodes"]  # type: ignore[union-attr]
                    if n["name"] == "double" for w in n["workers"]) == 2
        and _in_flight(served, "slow", "double") == 1, "the slow request to reach double")
    calls: list[tuple[str, dict[str, object]]] = [("slow", {"x": i}) for i in range(6)]
    calls += [("seq", {"x": i}) for i in range(6)]
    calls.append(("seq", {"x": 100, "fail": "add"}))
    answers = run_all(served, calls)
    for (workflow, document), answer in zip(calls, answers, strict=True):
        if "fail" in document:
            assert answer.status == 500
            error = answer.json()
            assert isinstance(error, dict)
            assert error["type"] == "InternalServerException"
            assert error["message"].startswith("Error executing add (workflow seq")
            assert "after 2 attempts" in error["message"]  # retry-attempts: 1 by default
            assert "asked to fail at node add" in error["message"]
        else:
            assert answer.status == 200, answer.body
            doubled = int(document["x"]) * 2  # type: ignore[call-overload]
            assert answer.json()["x"] == (doubled + 2 if workflow == "seq" else doubled)  # type: ignore[index]
    timed_out = slow.result()
    assert timed_out.status == 500
    message = timed_out.json()["message"]  # type: ignore[index]
    assert message.startswith("Error executing double (workflow slow"), message
    assert "after 1 attempt:" in message and "no answer within 0.7 s" in message
    samples = _samples(served)
    assert samples[("batchserve_workflow_node_calls_total",
                    (("node", "double"), ("outcome", "timeout"), ("workflow", "slow")))] == 1
    assert samples[("batchserve_workflow_node_calls_total",
                    (("node", "add"), ("outcome", "error"), ("workflow", "seq")))] == 2


class _Pending:
    def __init__(self) -> None:
        import threading
        self.done = threading.Event()
        self.answer: Answer | None = None

    def result(self) -> Answer:
        assert self.done.wait(60), "no answer"
        assert self.answer is not None
        return self.answer


def run_all_async_start(served: Served, call: tuple[str, dict[str, object]]) -> _Pending:
    """Start one request in the background; its answer later."""
    import threading
    pending = _Pending()

    def run() -> None:
        pending.answer = run_all(served, [call])[0]
        pending.done.set()

    threading.Thread(target=run, daemon=True).start()
    return pending


def _in_flight(served: Served, workflow: str, node: str) -> int:
    described = next(n for n in served.describe(workflow)["nodes"] if n["name"] == node)  # type: ignore[union-attr]
    return int(described["batching"]["inFlightBatches"])


def _samples(served: Served) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = requests.get(f"{served.server.metrics}/metrics", timeout=10).text
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_management_bodies_and_statuses(served: Served) -> None:
    # Loaded at start-up, its nodes as TorchServe names their models.
    assert {"seq__pre", "seq__add", "seq__double", "par__agg"} <= set(served.models())
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
        "batchSize": 8, "maxBatchDelay": 20,
        "workflowDag": "{pre=[plus, times], plus=[agg], times=[agg]}"}
    nodes = {node["name"]: node for node in described["nodes"]}  # type: ignore[union-attr]
    assert nodes["plus"]["modelName"] == "par__plus" and nodes["plus"]["type"] == "model"
    assert nodes["agg"]["parents"] == ["plus", "times"] and nodes["agg"]["type"] == "function"
    assert len(nodes["times"]["workers"]) == 1 and nodes["times"]["workers"][0]["pid"] > 0

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
    no_handler = served.manage("POST", "/workflows", url="no_handler.war")
    assert no_handler.status_code == 400, no_handler.text
    # A node that cannot register: 500, and what did register is removed again.
    failed = served.manage("POST", "/workflows", url="bad_node.war")
    assert failed.status_code == 500 and failed.json()["type"] == "WorkflowException"
    assert failed.json()["message"].startswith(
        "Workflow bad_node has failed to register. Failures: [Workflow Node bad_node__gone "
        "failed to register. Details: ")
    assert not [name for name in served.models() if name.startswith("bad_node__")]
    assert served.manage("GET", "/workflows/bad_node").status_code == 404
    # A node's model goes with its workflow only.
    refused = served.manage("DELETE", "/models/seq__add")
    assert refused.status_code == 403 and "DELETE /workflows/seq" in refused.json()["message"]

    for method in ("GET", "DELETE"):
        unknown = served.manage(method, "/workflows/fake")
        assert (unknown.status_code, unknown.json()) == (404, {
            "code": 404, "type": "WorkflowNotFoundException",
            "message": "Workflow not found: fake"})
    unknown = served.predict("fake", {"x": 1})
    assert (unknown.status_code, unknown.json()["message"]) == (404, "Workflow not found: fake")


def test_token_authorization_guards_both_apis(served: Served) -> None:
    workflows = f"{served.server.management}/workflows"
    assert requests.get(workflows, timeout=10).status_code == 401
    assert requests.get(workflows, headers=served.auth("inference"), timeout=10).status_code \
        == 401
    predict = f"{served.server.inference}/wfpredict/seq"
    assert requests.post(predict, json={"x": 1}, timeout=10).status_code == 401
    assert requests.post(predict, json={"x": 1}, headers=served.auth("management"),
                         timeout=10).status_code == 401


def test_access_log_and_metrics_per_workflow_and_node(served: Served) -> None:
    assert served.predict("seq", {"x": 2}).json()["x"] == 6
    samples = _samples(served)
    assert samples[("batchserve_workflow_requests_total",
                    (("code", "200"), ("workflow", "seq")))] >= 1
    assert samples[("batchserve_workflow_node_calls_total",
                    (("node", "double"), ("outcome", "ok"), ("workflow", "seq")))] >= 1
    # Each node call is a prediction of its model, in TorchServe's metrics.
    names = {dict(labels).get("model_name") for name, labels in samples
             if name == "ts_inference_latency_microseconds_total"}
    assert {"seq__pre", "seq__add", "seq__double"} <= names
    log = Path(served.server.server.config.log_location / "access_log.log")
    deadline = time.monotonic() + 10
    while True:
        text = log.read_text() if log.exists() else ""
        if re.search(r'"POST /wfpredict/seq HTTP/1\.1" 200 .* model=seq version=workflow', text) \
                and re.search(r'"POST /wfpredict/seq HTTP/1\.1" 200 .* model=seq__add '
                              r'version=1\.0 .* batch=\d+', text):
            break
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(0.05)


def test_unregister_under_traffic_answers_every_request_once(served: Served) -> None:
    """The last test: it removes ``slow``."""
    port = urlsplit(served.server.inference).port
    headers = served.auth("inference")
    workflow_dir = served.server.server.services.workflows.registry.get("slow").archive.directory  # type: ignore[union-attr]

    async def main() -> tuple[list[Answer], requests.Response]:
        assert port is not None
        tasks = [asyncio.ensure_future(_exchange(port, "/wfpredict/slow",
                                                 json.dumps({"x": i}).encode(), headers))
                 for i in range(60)]
        await asyncio.sleep(0.05)
        removal = asyncio.ensure_future(asyncio.to_thread(served.manage, "DELETE",
                                                          "/workflows/slow"))
        for i in range(60, 120):
            tasks.append(asyncio.ensure_future(_exchange(
                port, "/wfpredict/slow", json.dumps({"x": i}).encode(), headers)))
            await asyncio.sleep(0.002)
        return list(await asyncio.gather(*tasks)), await removal

    answers, removal = asyncio.run(main())
    assert removal.status_code == 200
    assert removal.json() == {"status": 'Workflow "slow" unregistered'}
    statuses = [answer.status for answer in answers]
    assert set(statuses) <= {200, 404, 503}, statuses
    assert statuses.count(200) >= 1 and statuses.count(404) + statuses.count(503) >= 1
    for i, answer in enumerate(answers):
        if answer.status == 200:
            assert answer.json()["x"] == 2 * i  # type: ignore[index]
    assert not [name for name in served.models() if name.startswith("slow__")]
    assert not workflow_dir.exists()
    assert served.manage("GET", "/workflows/slow").status_code == 404
