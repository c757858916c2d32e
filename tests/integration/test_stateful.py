"""Stateful models (sequence batching) against the real server: TorchServe's stateful example
pattern (tests/fixtures/handlers/stateful.py: a running sum per sequence in each worker's LRU
cache) over HTTP, gRPC Predictions and StreamPredictions2, with two workers, many sequences at
once, the limits, the close signal, idle expiry and a worker killed mid-sequence.

Each worker keeps its own sums, so an answer is exact only if every request of its sequence
ran on the same worker, in order, after the one before it: the sums check the routing.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import requests
import yaml

from protos import inference_pb2, inference_pb2_grpc
from tests.conftest import RunningServer

SEQUENCE = "ts_request_sequence_id"
END = "ts_request_sequence_end"
STEPS = 6


def _build(build_mar: Callable[..., Path], tmp_path: Path, name: str, **config: object) -> None:
    """An archive of the stateful handler whose model-config.yaml has ``config``."""
    settings = {"minWorkers": 2, "maxWorkers": 2, "batchSize": 4, "maxBatchDelay": 20,
                "sequenceBatching": True, "sequenceMaxIdleMSec": 60000, "maxNumSequence": 64,
                "maxSequenceJobQueueSize": 10, "handler": {"cache": {"capacity": 64}},
                **config}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    build_mar(name, "stateful", config_file=path)


def _ready(server: RunningServer, model: str, workers: int = 2) -> None:
    server.wait_for(lambda: [w["status"] for w in server.describe(model)["workers"]]  # type: ignore[union-attr]
                    == ["READY"] * workers, f"{workers} ready workers")


def _sums(values: list[int]) -> list[int]:
    return list(itertools.accumulate(values))


def _values(index: int) -> list[int]:
    return [(index + 1) * step for step in range(1, STEPS + 1)]


def _post(server: RunningServer, model: str, value: int, sequence: str | None = None,
          **headers: str) -> requests.Response:
    if sequence is not None:
        headers[SEQUENCE] = sequence
    return server.predict(model, str(value).encode(), headers=headers)


def _pending(server: RunningServer, model: str) -> int:
    return server.describe(model)["jobQueueStatus"]["pendingRequests"]  # type: ignore[index,no-any-return]


def _in_flight(server: RunningServer, model: str) -> int:
    return server.describe(model)["batching"]["inFlightBatches"]  # type: ignore[index,no-any-return]


def _open(server: RunningServer, model: str) -> int:
    return server.describe(model)["batching"]["openSequences"]  # type: ignore[index,no-any-return]


def test_http_sequences_are_exact_each_on_one_worker(build_mar, start_server,
                                                     tmp_path: Path) -> None:
    _build(build_mar, tmp_path, "stateful")
    server = start_server("stateful.mar")
    _ready(server, "stateful")

    def run(index: int) -> tuple[list[int], set[str]]:
        sequence, answers, pids = f"http-{index}", [], set()
        for value in _values(index):
            answer = _post(server, "stateful", value, sequence)
            assert answer.status_code == 200, answer.text
            assert answer.headers[SEQUENCE] == sequence
            answers.append(int(answer.text))
            pids.add(answer.headers["x-worker-pid"])
        return answers, pids

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(16)))
    for index, (answers, pids) in enumerate(results):
        assert answers == _sums(_values(index)), f"sequence {index}"
        assert len(pids) == 1, f"sequence {index} ran on {pids}"
    # The sequences were spread over both workers.
    assert len(set().union(*(pids for _, pids in results))) == 2


def test_a_batch_takes_one_request_of_each_waiting_sequence(build_mar, start_server,
                                                           tmp_path: Path) -> None:
    _build(build_mar, tmp_path, "stateful", minWorkers=1, maxWorkers=1)
    server = start_server("stateful.mar")
    _ready(server, "stateful", workers=1)
    gate = tmp_path / "open"
    with ThreadPoolExecutor(8) as pool:
        held = pool.submit(_post, server, "stateful", 1, "held", **{"x-gate": str(gate)})
        server.wait_for(lambda: _in_flight(server, "stateful") == 1, "the held request")
        # Behind it: three sequences' first requests, and a second request of one of them.
        firsts = [pool.submit(_post, server, "stateful", 10, name) for name in "abc"]
        server.wait_for(lambda: _pending(server, "stateful") == 3, "three waiting sequences")
        second = pool.submit(_post, server, "stateful", 5, "a")
        server.wait_for(lambda: _pending(server, "stateful") == 4, "a's second request")
        gate.touch()
        assert int(held.result(timeout=60).text) == 1
        answers = [future.result(timeout=60) for future in firsts]
        assert [int(a.text) for a in answers] == [10, 10, 10]
        assert {a.headers["x-batch-size"] for a in answers} == {"3"}  # one batch of three
        assert int(second.result(timeout=60).text) == 15  # after a's first, not beside it


def test_grpc_predictions_sequences_are_exact(build_mar, start_server, tmp_path: Path) -> None:
    _build(build_mar, tmp_path, "stateful")
    server = start_server("stateful.mar")
    _ready(server, "stateful")
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)

        def predict(value: int, sequence: str | None) -> inference_pb2.PredictionResponse:
            request = inference_pb2.PredictionsRequest(model_name="stateful",
                                                       input={"data": str(value).encode()})
            if sequence is not None:
                request.sequence_id = sequence
            return stub.Predictions(request, timeout=60)

        def run(index: int) -> list[int]:
            answers = []
            for value in _values(index):
                answer = predict(value, f"unary-{index}")
                assert answer.sequence_id == f"unary-{index}"
                answers.append(int(answer.prediction))
            return answers

        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(run, range(12)))
        assert results == [_sums(_values(index)) for index in range(12)]
        # No id: the server opens a sequence and says which; the client goes on with it.
        first = predict(5, None)
        assert first.sequence_id.startswith("ts-seq-") and int(first.prediction) == 5
        assert int(predict(7, first.sequence_id).prediction) == 12


def test_stream_predictions2_sequences_are_exact_and_close(build_mar, start_server,
                                                          tmp_path: Path) -> None:
    _build(build_mar, tmp_path, "stateful")
    server = start_server("stateful.mar")
    _ready(server, "stateful")
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_inference_port}") as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)

        def run(index: int) -> list[int]:
            # Every request of the sequence is sent at once, as TorchServe's client does; the
            # last carries the close signal as TorchServe's gRPC API reads it (an input).
            values = _values(index)
            outgoing = [inference_pb2.PredictionsRequest(
                model_name="stateful", sequence_id=f"stream-{index}",
                input={"data": str(value).encode()}) for value in values]
            outgoing[-1].input[END] = b"true"
            answers = list(stub.StreamPredictions2(iter(outgoing), timeout=60))
            assert [a.sequence_id for a in answers] == [f"stream-{index}"] * STEPS
            assert not any(a.HasField("status") for a in answers), answers
            return [int(a.prediction) for a in answers]

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(run, range(8)))
    assert results == [_sums(_values(index)) for index in range(8)]
    assert _open(server, "stateful") == 0  # every sequence closed by its last request


def test_limits_close_signals_and_idle_expiry(build_mar, start_server, tmp_path: Path) -> None:
    _build(build_mar, tmp_path, "limited", minWorkers=1, maxWorkers=1, maxNumSequence=2,
           maxSequenceJobQueueSize=1)
    _build(build_mar, tmp_path, "brief", minWorkers=1, maxWorkers=1, maxNumSequence=1,
           sequenceMaxIdleMSec=300)
    server = start_server("limited.mar", "brief.mar")
    _ready(server, "limited", workers=1)
    _ready(server, "brief", workers=1)
    described = server.describe("limited")
    assert {key: described[key] for key in ("stateful", "sequenceMaxIdleMSec",
                                            "sequenceTimeoutMSec", "maxNumSequence",
                                            "maxSequenceJobQueueSize")} == {
        "stateful": True, "sequenceMaxIdleMSec": 60000, "sequenceTimeoutMSec": 0,
        "maxNumSequence": 2, "maxSequenceJobQueueSize": 1}

    gate = tmp_path / "open"
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(_post, server, "limited", 1, "a", **{"x-gate": str(gate)})
        server.wait_for(lambda: _in_flight(server, "limited") == 1, "a's first request")
        waiting = pool.submit(_post, server, "limited", 2, "a")
        server.wait_for(lambda: _pending(server, "limited") == 1, "a's second request")
        refused = _post(server, "limited", 3, "a")  # maxSequenceJobQueueSize 1: full
        assert refused.status_code == 503
        assert "maxSequenceJobQueueSize" in refused.json()["message"]
        gate.touch()
        assert int(held.result(timeout=60).text) == 1
        assert int(waiting.result(timeout=60).text) == 3

    assert int(_post(server, "limited", 10, "b").text) == 10
    full = _post(server, "limited", 4, "c")  # maxNumSequence 2: a and b are open
    assert full.status_code == 503 and "maxNumSequence" in full.json()["message"]
    assert _open(server, "limited") == 2
    # The client closes b with its last request...
    assert int(_post(server, "limited", 5, "b", **{END: "true"}).text) == 15
    assert _open(server, "limited") == 1
    assert int(_post(server, "limited", 4, "c").text) == 4  # ...which makes room for c
    # ...and the handler closes a (an input of 0 names it in ts_request_sequence_end): the
    # same id then opens a new sequence, which the handler starts from 0.
    assert int(_post(server, "limited", 0, "a").text) == 3
    assert int(_post(server, "limited", 7, "a").text) == 7

    # Idle expiry (sequenceMaxIdleMSec 300): a sequence that runs is never idle...
    with ThreadPoolExecutor(1) as pool:
        gate2 = tmp_path / "open2"
        running = pool.submit(_post, server, "brief", 1, "x", **{"x-gate": str(gate2)})
        server.wait_for(lambda: _in_flight(server, "brief") == 1, "x's request")
        assert _post(server, "brief", 1, "y").status_code == 503  # maxNumSequence 1
        gate2.touch()
        assert int(running.result(timeout=60).text) == 1
    # ...and one idle for 300 ms is forgotten: y may open, and x starts afresh.
    server.wait_for(lambda: _open(server, "brief") == 0, "x to expire")
    assert int(_post(server, "brief", 2, "y").text) == 2
    server.wait_for(lambda: _open(server, "brief") == 0, "y to expire")
    assert int(_post(server, "brief", 5, "x").text) == 5


def test_http_without_an_id_is_given_one(build_mar, start_server, tmp_path: Path) -> None:
    _build(build_mar, tmp_path, "stateful", minWorkers=1, maxWorkers=1)
    server = start_server("stateful.mar")
    _ready(server, "stateful", workers=1)
    first = _post(server, "stateful", 3)
    sequence = first.headers[SEQUENCE]
    assert sequence.startswith("ts-seq-") and int(first.text) == 3
    assert int(_post(server, "stateful", 4, sequence).text) == 7


def test_a_killed_worker_ends_its_sequences_and_the_others_go_on(build_mar, start_server,
                                                                 tmp_path: Path) -> None:
    _build(build_mar, tmp_path, "stateful")
    server = start_server("stateful.mar")
    _ready(server, "stateful")
    first_a, first_b = _post(server, "stateful", 1, "a"), _post(server, "stateful", 1, "b")
    pid_a, pid_b = int(first_a.headers["x-worker-pid"]), int(first_b.headers["x-worker-pid"])
    assert pid_a != pid_b  # each worker took one of the two sequences

    gate = tmp_path / "open"
    with ThreadPoolExecutor(3) as pool:
        in_worker = pool.submit(_post, server, "stateful", 2, "a", **{"x-gate": str(gate)})
        server.wait_for(lambda: _in_flight(server, "stateful") == 1, "a's request in its worker")
        waiting = [pool.submit(_post, server, "stateful", 3, "a")]
        server.wait_for(lambda: _pending(server, "stateful") == 1, "a's next request")
        waiting.append(pool.submit(_post, server, "stateful", 4, "a"))
        server.wait_for(lambda: _pending(server, "stateful") == 2, "a's next two requests")
        os.kill(pid_a, signal.SIGKILL)
        died = in_worker.result(timeout=30)
        assert died.status_code == 500 and "Worker died" in died.json()["message"]
        for future in waiting:
            lost = future.result(timeout=30)
            assert lost.status_code == 500
            assert 'Sequence "a" of model "stateful" ended' in lost.json()["message"]
    # A request naming a is refused rather than run without its state...
    later = _post(server, "stateful", 5, "a")
    assert later.status_code == 500 and "its state" in later.json()["message"]
    # ...while b goes on where it was, on its own worker, and new sequences open.
    b = _post(server, "stateful", 2, "b")
    assert (int(b.text), int(b.headers["x-worker-pid"])) == (3, pid_b)
    assert int(_post(server, "stateful", 7, "c").text) == 7
    server.wait_for(lambda: all(w["status"] == "READY" and w["pid"] != pid_a
                                for w in server.describe("stateful")["workers"]),  # type: ignore[union-attr]
                    "the killed worker to be replaced")
    # The restarted worker takes sequences again (it has the fewest).
    d = _post(server, "stateful", 8, "d")
    assert int(d.text) == 8 and int(d.headers["x-worker-pid"]) not in (pid_a, pid_b)
