"""Worker caps against the real server: no registration, scale request, archive, config,
snapshot or workflow can ask for more workers than ``max_workers_per_model`` allows for one
model or ``max_workers_per_server`` for all of them (400 naming the cap, gRPC
INVALID_ARGUMENT), nothing is started in part, and the server stays healthy.

Issue 31: a .war with ``max-workers: 100000`` took the whole server down within 10 s, and
``PUT /models/m?min_worker=100000`` answered 202 and then forked until /ping died.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import requests

from protos import management_pb2, management_pb2_grpc
from tests.conftest import RunningServer
from tests.integration.test_workflows import zipped
from tests.unit.test_workflow_archiver import SEQUENTIAL

PER_MODEL = 2
PER_SERVER = 3
CAPS = {"max_workers_per_model": PER_MODEL, "max_workers_per_server": PER_SERVER}


def _refused(answer: requests.Response, cap: str) -> str:
    assert answer.status_code == 400, (answer.status_code, answer.text[:300])
    message = str(answer.json()["message"])
    assert cap in message, message
    return message


def _register(server: RunningServer, **params: object) -> requests.Response:
    return requests.post(f"{server.management}/models", timeout=120,
                         params={"url": "echo.mar", "synchronous": "true", **params})


def _scale(server: RunningServer, name: str, **params: object) -> requests.Response:
    return requests.put(f"{server.management}/models/{name}", timeout=120,
                        params={"synchronous": "true", **params})


def _workers(server: RunningServer) -> dict[str, int]:
    """Each model's workers, and the processes the server holds for them."""
    listed = requests.get(f"{server.management}/models", timeout=30).json()["models"]
    counts = {m["modelName"]: len(server.describe(m["modelName"])["workers"])  # type: ignore[arg-type]
              for m in listed}
    assert sum(counts.values()) == server.server.services.registry.worker_count()  # type: ignore[union-attr]
    return counts


def _healthy(server: RunningServer) -> None:
    ping = requests.get(f"{server.inference}/ping", timeout=10)
    assert (ping.status_code, ping.json()) == (200, {"status": "Healthy"})
    assert server.predict("echo", b"alive").content == b"alive"


def test_the_caps_hold_for_registrations_and_scaling(build_mar, start_server) -> None:
    build_mar("echo", "echo")
    server = start_server("echo.mar", **CAPS)
    assert _workers(server) == {"echo": 1}

    # Per model, whoever asks: initial_workers, min_worker, max_worker.
    _refused(_register(server, model_name="big", initial_workers=PER_MODEL + 1),
             "max_workers_per_model")
    _refused(_scale(server, "echo", min_worker=PER_MODEL + 1), "max_workers_per_model")
    _refused(_scale(server, "echo", min_worker=1, max_worker=100_000), "max_workers_per_model")
    assert _workers(server) == {"echo": 1}

    # The server's total: 1 + 2 = 3 is at the cap; one more is refused whole.
    assert _register(server, model_name="two", initial_workers=2).status_code == 200
    message = _refused(_register(server, model_name="three", initial_workers=1),
                       "max_workers_per_server")
    assert "would make 4 on this server" in message
    assert _register(server, model_name="three", initial_workers=0).status_code == 200
    _refused(_scale(server, "three", min_worker=1), "max_workers_per_server")
    _refused(_scale(server, "echo", min_worker=2), "max_workers_per_server")
    described = server.describe("three")
    assert (described["minWorkers"], described["maxWorkers"]) == (0, 0)  # nothing changed
    assert _workers(server) == {"echo": 1, "two": 2, "three": 0}

    # Over gRPC the same.
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_management_port}") as channel:
        stub = management_pb2_grpc.ManagementAPIsServiceStub(channel)
        for call, cap in (
                (lambda: stub.ScaleWorker(management_pb2.ScaleWorkerRequest(
                    model_name="three", min_worker=1), timeout=60), "max_workers_per_server"),
                (lambda: stub.ScaleWorker(management_pb2.ScaleWorkerRequest(
                    model_name="echo", min_worker=100_000), timeout=60),
                 "max_workers_per_model"),
                (lambda: stub.RegisterModel(management_pb2.RegisterModelRequest(
                    url="echo.mar", model_name="g", initial_workers=100_000), timeout=60),
                 "max_workers_per_model")):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert cap in (refused.value.details() or "")

    # Scaling down is never refused, and frees room for another model.
    assert _scale(server, "two", min_worker=1).status_code == 200
    assert _scale(server, "three", min_worker=1).status_code == 200
    assert _workers(server) == {"echo": 1, "two": 1, "three": 1}
    _healthy(server)


def test_archives_config_and_snapshots_over_the_cap_are_refused(
        build_mar, start_server, tmp_path: Path) -> None:
    build_mar("echo", "echo")
    for name, config in (("yaml_max", "maxWorkers: 100000\n"),
                         ("yaml_min", f"minWorkers: {PER_MODEL + 1}\n")):
        config_file = tmp_path / f"{name}.yaml"
        config_file.write_text(config)
        build_mar(name, "echo", config_file=config_file)
    build_mar("restored", "echo")
    snapshot = {"name": "snapshot", "modelCount": 3, "models": {
        "echo": {"1.0": {"defaultVersion": True, "marName": "echo.mar", "minWorkers": 1,
                         "maxWorkers": 1}},
        "restored": {"1.0": {"defaultVersion": True, "marName": "restored.mar",
                             "minWorkers": 100_000, "maxWorkers": 100_000}}}}
    from frontend.config import parse_models_json

    server = start_server(model_snapshot=snapshot, load_models=(),
                          models=parse_models_json('{"cfg": {"1.0": {"minWorkers": 100000}}}'),
                          **CAPS)
    # The snapshot's echo is restored; its 100,000-worker model is not (logged), and the
    # server is up.
    assert _workers(server) == {"echo": 1}
    _healthy(server)
    for name in ("yaml_max", "yaml_min"):
        _refused(_register(server, url=f"{name}.mar"), "max_workers_per_model")
    # config.properties models= sets 100,000 workers for cfg 1.0.
    _refused(_register(server, model_name="cfg"), "max_workers_per_model")
    assert _workers(server) == {"echo": 1}
    _healthy(server)


MANY_WORKERS = """
models:
  m1:
    url: echo.mar
    max-workers: 100000
dag:
  pre: [m1]
"""

#: min-workers starts nothing, as in TorchServe, but is held to the cap as max-workers is.
MANY_MIN_WORKERS = """
models:
  m1:
    url: echo.mar
    min-workers: 100000
    max-workers: 1
dag:
  pre: [m1]
"""

#: Each node within the per-model cap (2), together past the server's (4): pre takes 1.
TOO_MANY_TOGETHER = """
models:
  max-workers: 2
  m1:
    url: echo.mar
  m2:
    url: echo.mar
dag:
  pre: [m1, m2]
"""


def test_a_workflow_asking_for_too_many_workers_is_refused_whole(
        build_mar, start_server, model_store: Path) -> None:
    build_mar("echo", "echo")
    zipped(model_store, "many", MANY_WORKERS, SEQUENTIAL[1])
    zipped(model_store, "many_min", MANY_MIN_WORKERS, SEQUENTIAL[1])
    zipped(model_store, "together", TOO_MANY_TOGETHER, SEQUENTIAL[1])
    server = start_server("echo.mar", workflow_store=model_store, max_workers_per_model=2,
                          max_workers_per_server=4)
    workflows = f"{server.management}/workflows"
    for url, cap in (("many.war", "max_workers_per_model"),
                     ("many_min.war", "max_workers_per_model"),
                     ("together.war", "max_workers_per_server")):
        answer = requests.post(workflows, params={"url": url}, timeout=120)
        message = _refused(answer, cap)
        assert "has failed to register" in message
        # Nothing of it stays: no node model, no workflow, no worker.
        assert requests.get(workflows, timeout=30).json()["workflows"] == []
        assert _workers(server) == {"echo": 1}
    _healthy(server)


def test_default_caps_keep_a_server_process_alive(build_mar, server_process,
                                                 model_store: Path) -> None:
    """``torchserve --start`` with the host's caps: the issue's .war and scale request are
    refused, the server answers /ping throughout, and it never ran out of files."""
    build_mar("echo", "echo")
    zipped(model_store, "many", MANY_WORKERS, SEQUENTIAL[1])
    process = server_process("echo.mar", config={"workflow_store": model_store})
    management = process.management
    _refused(requests.post(f"{management}/workflows", params={"url": "many.war"}, timeout=120),
             "max_workers_per_model")
    _refused(requests.put(f"{management}/models/echo", params={"min_worker": 100_000},
                          timeout=60), "max_workers_per_model")
    ping = requests.get(f"{process.inference}/ping", timeout=10)
    assert (ping.status_code, ping.json()) == (200, {"status": "Healthy"})
    assert process.is_alive()
    described = requests.get(f"{management}/models/echo", timeout=30).json()[0]
    assert len(described["workers"]) == 1
    log = process.log_text()
    assert "Too many open files" not in log
    assert "workers: at most" in log and "by default" in log
    assert json.loads(requests.get(f"{management}/workflows", timeout=30).text) == {
        "workflows": []}
