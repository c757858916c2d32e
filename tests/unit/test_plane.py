"""The inference plane (frontend/ops/plane.py) over a real registry, real metrics, a real
access log and real Models, with the test in the place of the worker processes.

A Model is built as the loader builds it, without starting workers. ``Model.submit`` refuses
(503) a model that has no worker, so each test model gets one ``StandInWorker`` in
``model.workers``: it takes batches from the model's real batcher, as a worker does, and answers
them when the test says so. The plane's deadline timer is driven by hand (``ManualTimers``,
passed where the plane takes a loop), so no test waits for a deadline to pass but one, which
checks the real timer's wiring with a 10 ms deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

from frontend.errors import (
    BadRequest,
    GatewayTimeout,
    ModelNotFound,
    ModelVersionNotFound,
    ServeError,
    ServiceUnavailable,
)
from frontend.models.archive import UnpackedArchive
from frontend.models.model import Model
from frontend.models.registry import ModelRegistry
from frontend.observe.events import Observers
from frontend.observe.logs import AccessLog
from frontend.observe.metrics import ServerMetrics
from frontend.observe.status import ExecutionStatus
from frontend.ops.plane import (
    EXPLAIN_HEADER,
    SEQUENCE_ID_HEADER,
    Call,
    InferencePlane,
    Origin,
)
from frontend.server import observers, statuses
from frontend.serving.batching import Batcher, Job
from frontend.serving.placement import GpuAssigner, Placement
from frontend.serving.workers import Worker, WorkerLaunch, WorkerState
from frontend.settings import ModelSettings, PolicyName
from model_archiver.manifest import Manifest
from protos import worker_pb2

HTTP = Origin("127.0.0.1:5000", "POST", "/predictions/m", "HTTP/1.1")
GRPC = Origin("127.0.0.1:5001", "gRPC", "/org.pytorch.serve.grpc.inference/Predictions",
              "HTTP/2.0", count_status=True)
_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')
T = TypeVar("T")


# ---- collaborators the test plays ------------------------------------------------------------


@dataclass
class StandInWorker:
    """Takes batches from the model's batcher (``take``: one batch if the policy would send
    it now) and answers them: each request with its own "body" input. The metrics read
    what a model's status says of its workers; nothing else of a Worker is used when no
    process runs."""

    batcher: Batcher
    batches: list[list[Job]] = field(default_factory=list)
    restarts: int = 0
    id: str = "0"
    state: WorkerState = WorkerState.READY
    is_up: bool = True
    is_unhealthy: bool = False
    in_flight: int = 0
    pid: int | None = None
    gpu_id: int | None = None
    working_since: float | None = None
    #: How it runs batches, as a loaded worker reports it (None: it said nothing yet).
    execution: ExecutionStatus | None = None

    def take(self) -> list[Job]:
        jobs = self.batcher.take_ready()
        assert jobs is not None, "no batch ready"
        self.batches.append(jobs)
        return jobs

    def answer(self, jobs: list[Job]) -> None:
        for job in jobs:
            job.resolve(worker_pb2.Response(request_id=job.request.request_id, status=200,
                                            body=b"echo:" + job.request.inputs["body"]))

    def serve_next(self) -> None:
        """Park for the next batch and answer it when it comes (a free worker)."""
        def on_batch(outcome: list[Job] | ServeError) -> None:
            if isinstance(outcome, list):
                self.batches.append(outcome)
                self.answer(outcome)
        self.batcher.park(on_batch)


@dataclass
class Pending:
    delay_s: float
    callback: Callable[..., None]
    args: tuple[Any, ...]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True

    def fire(self) -> None:
        assert not self.cancelled
        self.callback(*self.args)


class ManualTimers:
    """Stands in for the event loop where the plane sets its deadline timer: the test reads
    the delay and fires the timer itself."""

    def __init__(self) -> None:
        self.pending: list[Pending] = []

    def call_later(self, delay_s: float, callback: Callable[..., None], *args: Any) -> Pending:
        handle = Pending(delay_s, callback, args)
        self.pending.append(handle)
        return handle

    def as_loop(self) -> asyncio.AbstractEventLoop:
        return cast(asyncio.AbstractEventLoop, self)


# ---- the rig ----------------------------------------------------------------------------------


@dataclass
class Rig:
    tmp_path: Path
    registry: ModelRegistry
    metrics: ServerMetrics
    access: AccessLog
    observers: Observers
    plane: InferencePlane

    def add_model(self, name: str = "m", version: str = "1.0", *, batch_size: int = 1,
                  job_queue_size: int = 100, response_timeout_s: int = 120,
                  make_default: bool = False) -> tuple[Model, StandInWorker]:
        """A Model built as the loader builds it, with a stand-in worker and no process."""
        manifest = Manifest(model_name=name, model_version=version, handler="echo.py")
        model_dir = self.tmp_path / f"{name}-{version}"
        unpacked = UnpackedArchive(f"{name}.mar", self.tmp_path / f"{name}.mar", model_dir,
                                   manifest, manifest.to_json())
        settings = ModelSettings(batch_size=batch_size, max_batch_delay_ms=0, min_workers=1,
                                 max_workers=1, response_timeout_s=response_timeout_s,
                                 startup_timeout_s=120, job_queue_size=job_queue_size,
                                 batch_policy=PolicyName.FIXED)
        launch = WorkerLaunch(worker_pb2.LoadModel(model_name=name, model_version=version),
                              self.tmp_path, 120, response_timeout_s,
                              events=self.observers.of_model(name, version))
        model = Model(name, version, unpacked, "echo.py", settings, launch,
                      Placement(GpuAssigner(0), None, self.registry.worker_count, cores=1),
                      logging.getLogger(__name__))
        worker = StandInWorker(model.batcher)
        model.workers.append(cast(Worker, worker))
        self.registry.add(model, make_default=make_default)
        return model, worker

    def samples(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """The samples of metric ``name`` on the metrics page, by their labels (no hostname)."""
        found = {}
        for line in self.metrics.exposition().decode().splitlines():
            match = _SAMPLE.match(line)
            if match and match[1] == name:
                labels = tuple((k, v) for k, v in _LABEL.findall(match[2])
                               if k not in ("hostname", "Hostname"))
                found[labels] = float(match[3])
        return found

    def requests_total(self, model: str = "m", version: str = "default") -> float | None:
        return self.samples("ts_inference_requests_total").get(
            (("model_name", model), ("model_version", version)))

    def responses(self) -> dict[str, float]:
        # As TorchServe's, a status's counter has no sample until it counts one.
        return {name: self.samples(name).get((("Level", "Host"),), 0.0)
                for name in ("Requests2XX", "Requests4XX", "Requests5XX")}

    def access_lines(self) -> list[str]:
        self.access.flush()
        assert self.access.path is not None
        return self.access.path.read_text().splitlines()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    registry = ModelRegistry()
    metrics = ServerMetrics(statuses(registry), system_metrics=False)
    access = AccessLog(tmp_path / "access_log.log", extended=True)  # the plane's fields
    access.open()
    subscribed = observers(metrics, access, None, None)
    yield Rig(tmp_path, registry, metrics, access, subscribed,
              InferencePlane(registry, subscribed, access))
    access.close()


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A loop for the jobs' futures only: it never runs."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())


async def within(awaitable: Awaitable[T], timeout_s: float = 5.0) -> T:
    """``awaitable``'s result; a plane that never answers fails the test (TimeoutError)
    instead of hanging it."""
    return await asyncio.wait_for(awaitable, timeout_s)


def _body(inputs: bytes) -> list[tuple[str, bytes, str | None]]:
    return [("body", inputs, None)]


# ---- send: the worker's request ----------------------------------------------------------------


def _sent(rig: Rig, loop: asyncio.AbstractEventLoop, headers: list[tuple[bytes, bytes]],
          inputs: list[tuple[str, bytes, str | None]], **flags: Any) -> Call:
    """A call opened for model "m" and sent (its deadline timer held by ManualTimers)."""
    call = rig.plane.begin(HTTP, loop)
    rig.plane.open(call, "m")
    rig.plane.send(call, headers, inputs, loop=ManualTimers().as_loop(), **flags)
    return call


def test_send_gives_each_call_a_fresh_request_id(rig: Rig,
                                                 loop: asyncio.AbstractEventLoop) -> None:
    rig.add_model(job_queue_size=3)
    ids = set()
    for _ in range(3):
        request_id = _sent(rig, loop, [], _body(b"x")).job.request.request_id
        assert uuid.UUID(request_id).version == 4
        ids.add(request_id)
    assert len(ids) == 3


def test_send_copies_headers_inputs_and_flags(rig: Rig, loop: asyncio.AbstractEventLoop) -> None:
    rig.add_model(response_timeout_s=5)
    call = _sent(rig, loop, [(b"x-caf\xe9", b"cr\xe8me"), (b"content-type", b"text/plain")],
                 [("body", b"payload", "text/plain"), ("extra", b"\x00\xff", None)],
                 weight=3, instances=True, tensor_format=worker_pb2.TENSOR_FORMAT_REST,
                 sequence_id="seq-7")
    request = call.job.request
    assert call.job.budget_s == 5.0  # no deadline of the client's own
    assert dict(request.headers) == {"x-caf\u00e9": "cr\u00e8me", "content-type": "text/plain",
                                     SEQUENCE_ID_HEADER: "seq-7"}
    assert dict(request.inputs) == {"body": b"payload", "extra": b"\x00\xff"}
    assert dict(request.content_types) == {"body": "text/plain"}
    assert request.instances is True
    assert request.tensor_format == worker_pb2.TENSOR_FORMAT_REST
    assert call.job.weight == 3


def test_send_defaults(rig: Rig, loop: asyncio.AbstractEventLoop) -> None:
    rig.add_model()
    call = _sent(rig, loop, [], _body(b"x"))
    request = call.job.request
    assert (request.instances, request.tensor_format, call.job.weight) == (
        False, worker_pb2.TENSOR_FORMAT_NONE, 1)
    assert SEQUENCE_ID_HEADER not in request.headers


@pytest.mark.parametrize(("explain", "client_header", "expected"), [
    (True, None, "True"),
    (True, b"False", "True"),
    (False, b"True", "False"),  # as TorchServe: a client's own header explains nothing
    (False, None, None),
])
def test_send_sets_the_explain_header_only_for_explanations(
        rig: Rig, loop: asyncio.AbstractEventLoop, explain: bool, client_header: bytes | None,
        expected: str | None) -> None:
    rig.add_model()
    headers = [] if client_header is None else [(EXPLAIN_HEADER.encode(), client_header)]
    call = _sent(rig, loop, headers, _body(b"x"), explain=explain)
    assert call.job.request.headers.get(EXPLAIN_HEADER) == expected


@pytest.mark.parametrize(("value", "seconds"), [(b"2.5", 2.5), (b"30", 30.0), (b" 1 ", 1.0)])
def test_send_takes_the_client_timeout(rig: Rig, loop: asyncio.AbstractEventLoop,
                                       value: bytes, seconds: float) -> None:
    rig.add_model(response_timeout_s=60)
    call = _sent(rig, loop, [(b"x-request-timeout", value)], _body(b"x"))
    assert call.job.budget_s == seconds
    # the handler sees the header as the client sent it
    assert call.job.request.headers["x-request-timeout"] == value.decode()


@pytest.mark.parametrize("value", [b"soon", b"", b"-1", b"0", b"nan", b"1s"])
def test_send_refuses_a_bad_client_timeout(rig: Rig, loop: asyncio.AbstractEventLoop,
                                           value: bytes) -> None:
    model, _ = rig.add_model()
    with pytest.raises(BadRequest, match="x-request-timeout must be"):
        _sent(rig, loop, [(b"x-request-timeout", value)], _body(b"x"))
    assert model.batcher.depth == 0  # refused before it was queued


# ---- open: resolve and admit ---------------------------------------------------------------------


def test_open_finds_the_default_or_the_named_version(
        rig: Rig, loop: asyncio.AbstractEventLoop) -> None:
    first, _ = rig.add_model(version="1.0")
    second, _ = rig.add_model(version="2.0")
    call = rig.plane.begin(HTTP, loop)
    assert rig.plane.open(call, "m") is first
    assert call.model is first
    assert rig.plane.open(call, "m", "") is first  # an empty version segment: the default
    assert rig.plane.open(call, "m", "2.0") is second
    assert call.model is second


def test_open_refuses_unknown_models_and_versions(
        rig: Rig, loop: asyncio.AbstractEventLoop) -> None:
    rig.add_model()
    call = rig.plane.begin(HTTP, loop)
    with pytest.raises(ModelNotFound, match="Model not found: other"):
        rig.plane.open(call, "other")
    with pytest.raises(ModelVersionNotFound, match=r"Model version 9\.0 does not exist"):
        rig.plane.open(call, "m", "9.0")
    assert call.model is None


def test_open_model_takes_that_very_version_while_it_is_registered(
        rig: Rig, loop: asyncio.AbstractEventLoop) -> None:
    """A workflow's node call holds its Model: it reaches that version whatever the default
    of its name, and none once that version is gone (even with another under its name)."""
    held, _ = rig.add_model(version="1.0")
    rig.add_model(version="2.0", make_default=True)
    call = rig.plane.begin(HTTP, loop)
    assert rig.plane.open_model(call, held) is held
    assert (call.model, call.version) == (held, None)  # labelled "default", as TorchServe's
    rig.registry.remove(held)
    rig.add_model(version="1.0")  # another Model under the same name and version
    with pytest.raises(ModelNotFound, match=r"Model m version 1\.0 is no longer registered"):
        rig.plane.open_model(rig.plane.begin(HTTP, loop), held)


def test_open_refuses_with_503_and_retry_after_when_the_queue_is_full(
        rig: Rig, loop: asyncio.AbstractEventLoop) -> None:
    model, _ = rig.add_model(job_queue_size=2)
    timers = ManualTimers()
    for _ in range(2):
        call = rig.plane.begin(HTTP, loop)
        rig.plane.open(call, "m")  # room: no error
        rig.plane.send(call, [], _body(b"x"), loop=timers.as_loop())
    with pytest.raises(ServiceUnavailable) as refused:
        rig.plane.open(rig.plane.begin(HTTP, loop), "m")
    assert refused.value.http_status == 503
    assert refused.value.headers == {"Retry-After": "1"}
    assert model.batcher.depth == 2


# ---- send: the queue and the deadline ------------------------------------------------------------


def _submitted(rig: Rig, loop: asyncio.AbstractEventLoop, timers: ManualTimers,
               client_timeout_s: float | None) -> Call:
    call = rig.plane.begin(HTTP, loop)
    rig.plane.open(call, "m")
    rig.plane.send(call, [], _body(b"x"), deadline_s=client_timeout_s, loop=timers.as_loop())
    return call


@pytest.mark.parametrize(("client_timeout_s", "budget_s"), [
    (None, 5.0), (2.0, 2.0), (10.0, 5.0), (0.25, 0.25)])
def test_send_sets_the_deadline_to_the_sooner_of_model_and_client(
        rig: Rig, loop: asyncio.AbstractEventLoop, client_timeout_s: float | None,
        budget_s: float) -> None:
    model, _ = rig.add_model(response_timeout_s=5)
    timers = ManualTimers()
    before = time.monotonic()
    call = _submitted(rig, loop, timers, client_timeout_s)
    after = time.monotonic()
    assert before + budget_s <= call.job.deadline <= after + budget_s
    assert [timer.delay_s for timer in timers.pending] == [budget_s]
    assert model.batcher.depth == 1


def test_a_job_still_queued_at_its_deadline_is_answered_504_and_never_dispatched(
        rig: Rig, loop: asyncio.AbstractEventLoop) -> None:
    model, worker = rig.add_model(response_timeout_s=5)
    timers = ManualTimers()
    call = _submitted(rig, loop, timers, None)
    timers.pending[0].fire()
    error = call.job.future.exception()
    assert isinstance(error, GatewayTimeout)
    assert error.http_status == 504
    assert str(error) == ("no answer within 5 s: the request timed out in the queue, before a "
                          "worker was free")
    assert model.batcher.depth == 0
    assert model.batcher.take_ready() is None
    assert worker.batches == []


def test_a_job_in_a_worker_at_its_deadline_is_answered_504_in_a_worker(
        rig: Rig, loop: asyncio.AbstractEventLoop) -> None:
    _, worker = rig.add_model(response_timeout_s=5)
    timers = ManualTimers()
    call = _submitted(rig, loop, timers, 0.5)
    assert worker.take() == [call.job]
    timers.pending[0].fire()
    error = call.job.future.exception()
    assert isinstance(error, GatewayTimeout)
    assert str(error) == "no answer within 0.5 s: the request timed out in a worker"
    worker.answer([call.job])  # a late answer changes nothing
    assert call.job.future.exception() is error


def test_an_answer_before_the_deadline_wins(rig: Rig, loop: asyncio.AbstractEventLoop) -> None:
    _, worker = rig.add_model()
    timers = ManualTimers()
    call = _submitted(rig, loop, timers, None)
    worker.answer(worker.take())
    timers.pending[0].fire()  # the deadline comes before end() cancelled its timer
    assert call.job.future.result().body == b"echo:x"


def test_send_to_a_model_without_workers_refuses_and_sets_no_timer(
        rig: Rig, loop: asyncio.AbstractEventLoop) -> None:
    model, _ = rig.add_model()
    model.workers.clear()
    timers = ManualTimers()
    with pytest.raises(ServiceUnavailable, match="has no worker"):
        _submitted(rig, loop, timers, None)
    assert timers.pending == []
    assert model.batcher.depth == 0


# ---- the whole sequence -----------------------------------------------------------------------


def test_predict_returns_the_worker_answer_and_records_it_once(rig: Rig) -> None:
    model, worker = rig.add_model()

    async def scenario() -> None:
        worker.serve_next()
        async with rig.plane.call(HTTP) as call:
            answer = await within(rig.plane.predict(call, "m", None, [(b"x-trace", b"t1")],
                                                    _body(b"hello")))
            call.status = 200
        assert isinstance(answer, worker_pb2.Response)
        assert answer.body == b"echo:hello"
        assert answer.request_id == call.job.request.request_id
        [batch] = worker.batches
        assert batch == [call.job]
        assert batch[0].request.headers["x-trace"] == "t1"
        rig.plane.end(call)  # a second end records nothing
        assert call.ended

    run(scenario)
    assert rig.requests_total() == 1
    assert rig.responses() == {"Requests2XX": 0, "Requests4XX": 0, "Requests5XX": 0}, \
        "an HTTP answer is counted by its connection, not by the plane"
    [line] = rig.access_lines()
    assert '127.0.0.1:5000 "POST /predictions/m HTTP/1.1" 200 ' in line
    assert "model=m version=1.0" in line
    assert " batch=1 form_ms=0.00 worker_ms=- " in line  # the stand-in worker times nothing
    assert line.endswith(" reason=full")
    assert model.batcher.depth == 0


def test_predict_with_count_status_counts_the_answer(rig: Rig) -> None:
    _, worker = rig.add_model()

    async def scenario() -> None:
        worker.serve_next()
        async with rig.plane.call(GRPC) as call:
            await within(rig.plane.predict(call, "m", "1.0", [], _body(b"x")))
            call.status = 200

    run(scenario)
    assert rig.responses() == {"Requests2XX": 1, "Requests4XX": 0, "Requests5XX": 0}
    # As TorchServe labels it: the version the request named ("default" when it named none).
    assert rig.requests_total(version="1.0") == 1
    assert rig.requests_total() is None


def test_predict_takes_the_sooner_of_the_client_and_transport_deadlines(rig: Rig) -> None:
    _, worker = rig.add_model(response_timeout_s=120)

    async def scenario() -> None:
        worker.serve_next()
        async with rig.plane.call(GRPC) as call:
            before = time.monotonic()
            await within(rig.plane.predict(call, "m", None, [(b"x-request-timeout", b"5")],
                                           _body(b"x"), deadline_s=1.0))
            after = time.monotonic()
            call.status = 200
        assert before + 1.0 <= call.job.deadline <= after + 1.0

    run(scenario)


def test_predict_answers_504_at_the_client_deadline_when_no_worker_takes_it(rig: Rig) -> None:
    # The real timer: a 10 ms deadline, nobody takes the job.
    model, worker = rig.add_model()

    async def scenario() -> None:
        with pytest.raises(GatewayTimeout, match="in the queue"):
            async with rig.plane.call(GRPC) as call:
                await within(rig.plane.predict(
                    call, "m", None, [(b"x-request-timeout", b"0.01")], _body(b"x")))
        assert call.status == 504
        assert model.batcher.take_ready() is None

    run(scenario)
    assert worker.batches == []
    assert rig.responses()["Requests5XX"] == 1
    assert rig.samples("batchserve_refused_requests_total")[
        (("model_name", "m"), ("model_version", "1.0"), ("reason", "deadline"))] == 1
    [line] = rig.access_lines()
    # gRPC's status code, as TorchServe's access log writes an RPC's: DEADLINE_EXCEEDED.
    assert '"gRPC /org.pytorch.serve.grpc.inference/Predictions HTTP/2.0" 4 ' in line


def test_a_serve_error_in_a_call_records_its_status(rig: Rig) -> None:
    rig.add_model()

    async def scenario() -> None:
        with pytest.raises(ModelNotFound):
            async with rig.plane.call(GRPC) as call:
                await rig.plane.predict(call, "nope", None, [], _body(b"x"))
        assert (call.status, call.ended, call.model) == (404, True, None)

    run(scenario)
    assert rig.responses() == {"Requests2XX": 0, "Requests4XX": 1, "Requests5XX": 0}
    assert rig.requests_total() is None  # no model: nothing per model
    [line] = rig.access_lines()
    assert " 5 " in line and "model=- version=-" in line  # NOT_FOUND


def test_a_cancelled_call_records_status_0_and_counts_no_response(rig: Rig) -> None:
    model, _ = rig.add_model()
    calls: list[Call] = []

    async def client() -> None:
        async with rig.plane.call(GRPC) as call:
            calls.append(call)
            await rig.plane.predict(call, "m", None, [], _body(b"x"))

    async def scenario() -> None:
        task = asyncio.ensure_future(client())
        deadline = time.monotonic() + 5
        while model.batcher.depth == 0:  # the job is queued, nobody takes it
            assert time.monotonic() < deadline, "the call never reached the queue"
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await within(task)
        assert calls[0].status == 0
        assert model.batcher.depth == 0, "the queue forgets a job whose client left"

    run(scenario)
    assert rig.responses() == {"Requests2XX": 0, "Requests4XX": 0, "Requests5XX": 0}
    [line] = rig.access_lines()
    assert '"gRPC /org.pytorch.serve.grpc.inference/Predictions HTTP/2.0" 1 ' in line  # CANCELLED


def test_outcome_cancels_an_abandoned_job_so_the_queue_forgets_it(rig: Rig) -> None:
    model, worker = rig.add_model()
    timers = ManualTimers()

    async def scenario() -> None:
        call = rig.plane.begin(HTTP, asyncio.get_running_loop())
        rig.plane.open(call, "m")
        rig.plane.send(call, [], _body(b"x"), loop=timers.as_loop())
        abandoned: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = asyncio.ensure_future(rig.plane.outcome(call, abandoned))
        abandoned.set_result(None)  # the client disconnected
        with pytest.raises(asyncio.CancelledError):
            await within(waiting)
        assert call.job.future.cancelled()
        assert timers.pending[0].cancelled, "the deadline timer is cancelled with it"
        assert model.batcher.depth == 0
        assert model.batcher.take_ready() is None

    run(scenario)
    assert worker.batches == []


def test_ask_is_answered_but_not_recorded(rig: Rig) -> None:
    model, worker = rig.add_model()

    async def scenario() -> None:
        worker.serve_next()
        answer = await within(rig.plane.ask(model, worker_pb2.Request(
            request_id="describe-1", describe=True, inputs={"body": b"?"})))
        assert isinstance(answer, worker_pb2.Response)
        assert (answer.request_id, answer.body) == ("describe-1", b"echo:?")
        assert worker.batches[0][0].request.describe

    run(scenario)
    assert rig.requests_total() is None
    assert rig.responses() == {"Requests2XX": 0, "Requests4XX": 0, "Requests5XX": 0}
    assert rig.access_lines() == []


# ---- why a request was refused ------------------------------------------------------------


def _refused(rig: Rig) -> dict[str, float]:
    return {dict(labels)["reason"]: value
            for labels, value in rig.samples("batchserve_refused_requests_total").items()}


def test_refusals_are_counted_by_their_reason(rig: Rig) -> None:
    rig.add_model("full", job_queue_size=1)
    idle, _ = rig.add_model("idle")
    idle.workers.clear()  # no worker: Model.submit answers 503 itself
    rig.add_model("late")

    async def ask(name: str, headers: list[tuple[bytes, bytes]]) -> int:
        with contextlib.suppress(ServeError):
            async with rig.plane.call(HTTP) as call:
                await within(rig.plane.predict(call, name, None, headers, _body(b"x")))
                call.status = 200
        return call.status

    async def scenario() -> None:
        filler = rig.plane.begin(HTTP, asyncio.get_running_loop())
        rig.plane.open(filler, "full")
        rig.plane.send(filler, [], _body(b"x"))  # the queue of one is full
        assert await ask("full", []) == 503  # queue full
        assert await ask("idle", []) == 503  # no worker
        assert await ask("none", []) == 404  # not a model: no per-model sample
        assert await ask("late", [(b"x-request-timeout", b"0.01")]) == 504  # deadline, queued
        assert filler.timer is not None
        filler.timer.cancel()

    run(scenario)
    assert _refused(rig) == {"queue_full": 1, "unavailable": 1, "deadline": 1}


def test_a_timeout_in_a_worker_is_not_a_refusal(rig: Rig,
                                                 loop: asyncio.AbstractEventLoop) -> None:
    _, worker = rig.add_model()
    timers = ManualTimers()
    call = _submitted(rig, loop, timers, 0.5)
    worker.take()
    timers.pending[0].fire()
    error = call.job.future.exception()
    assert isinstance(error, GatewayTimeout)
    call.fail(error)
    assert (call.status, call.refusal()) == (504, None)


# ---- Server-Timing: who gets it ----------------------------------------------------------------


@pytest.mark.parametrize(("mode", "asked", "wanted"), [
    ("off", True, False), ("off", False, False),
    ("request", True, True), ("request", False, False),
    ("always", False, True)])
def test_server_timing_is_given_as_the_server_key_and_the_request_say(
        rig: Rig, loop: asyncio.AbstractEventLoop, mode: str, asked: bool,
        wanted: bool) -> None:
    rig.plane = InferencePlane(rig.registry, rig.observers, rig.access, mode)
    rig.add_model()
    headers = [(b"x-server-timing", b"true")] if asked else []
    call = _sent(rig, loop, headers, _body(b"x"))
    assert call.wants_timing is wanted
    header = rig.plane.timing_header(call)
    # Not answered by a worker yet: only the total so far.
    assert (header is not None and re.fullmatch(r"total;dur=[0-9.]+", header)) if wanted \
        else header is None


def test_a_workflow_node_call_has_an_access_line_only_in_the_extended_log(rig: Rig) -> None:
    """TorchServe's access log has a line per request: a workflow's node calls (made with
    the request's origin ``for_nodes``) have their own only with access_log_extended."""
    _, worker = rig.add_model()
    plain = AccessLog(rig.tmp_path / "plain.log")
    plain.open()
    planes = [rig.plane, InferencePlane(rig.registry, observers(rig.metrics, plain, None, None),
                                        plain)]
    node = HTTP.for_nodes()
    assert (node.peer, node.method, node.uri, node.node, HTTP.node) == (
        HTTP.peer, HTTP.method, HTTP.uri, True, False)

    async def scenario() -> None:
        for plane in planes:
            worker.serve_next()
            async with plane.call(node) as call:
                await within(plane.predict(call, "m", None, [], _body(b"x")))
                call.status = 200

    run(scenario)
    [line] = rig.access_lines()
    assert "model=m version=1.0" in line
    plain.flush()
    assert (rig.tmp_path / "plain.log").read_text() == ""
    plain.close()
