"""The Dispatcher's states and transitions, driven by a fake worker connection and simulated
time (frontend/serving/simulation.py): no process, no socket, no real time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from frontend.errors import GatewayTimeout, ServiceUnavailable, WorkerDied
from frontend.observe.dashboard import BusyTime
from frontend.observe.events import BatchEnded
from frontend.serving.batching import Batcher, Job
from frontend.serving.dispatch import Dispatcher, DispatchState
from frontend.serving.policies import FixedPolicy
from frontend.serving.simulation import SimulatedTime
from protos import worker_pb2
from protos.framing import Frame, Kind

TIMEOUT_S = 10.0


@dataclass
class FakeConnection:
    """Records what is sent; the test answers the frames in order, or kills the worker."""

    sent: list[list[str]] = field(default_factory=list)
    replies: list[Callable[[Frame | BaseException], None]] = field(default_factory=list)
    on_partial: Callable[[worker_pb2.Response], None] | None = None
    killed: bool = False
    gone: bool = False

    def send(self, frame: Frame, on_reply: Callable[[Frame | BaseException], None]) -> None:
        if self.gone:
            raise WorkerDied("Worker died: gone")
        batch = worker_pb2.PredictBatch.FromString(frame.payload)
        self.sent.append([request.request_id for request in batch.requests])
        self.replies.append(on_reply)

    def answer(self) -> None:
        """The worker answers the oldest batch: each request with its own id."""
        ids = self.sent[len(self.sent) - len(self.replies)]
        result = worker_pb2.PredictResult(responses=[
            worker_pb2.Response(request_id=i, status=200, body=i.encode()) for i in ids])
        self.replies.pop(0)(Frame(Kind.PREDICTED, result.SerializeToString()))

    def die(self) -> None:
        """The worker dies: every outstanding reply is WorkerDied (as the reader does)."""
        self.gone = True
        while self.replies:
            self.replies.pop(0)(WorkerDied("Worker died: exited with code -9"))

    def forget_replies(self) -> None:
        self.replies.clear()

    def kill(self) -> None:
        self.killed = True


class EchoExchange:
    """The rig's exchange: a batch's frame holds its requests; a reply's responses answer its
    jobs in order, and the worker's time on each batch is noted. As the real one, it notes
    which worker a batch went to, and tells ``on_ended`` of each batch that ended (answered,
    or lost with its worker)."""

    def __init__(self, service_times: list[float]) -> None:
        self.service_times = service_times
        self.on_ended: BatchEnded | None = None

    @staticmethod
    def frame(jobs: list[Job]) -> Frame:
        assert jobs[0].batch is not None
        jobs[0].batch.worker = "W-test"
        batch = worker_pb2.PredictBatch(requests=[job.request for job in jobs])
        return Frame(Kind.PREDICT, batch.SerializeToString())

    def finish(self, jobs: list[Job], reply: Frame, service_s: float) -> Callable[[], None]:
        self.service_times.append(service_s)
        result = worker_pb2.PredictResult.FromString(reply.payload)

        def deliver() -> None:
            for job, response in zip(jobs, result.responses, strict=True):
                job.resolve(response)
            self._ended(jobs)

        return deliver

    def lost(self, jobs: list[Job]) -> None:
        self._ended(jobs)

    def _ended(self, jobs: list[Job]) -> None:
        if self.on_ended is not None and jobs[0].batch is not None:
            self.on_ended(("m", "1.0"), jobs[0].batch, jobs, None)

    @staticmethod
    def bound(response: worker_pb2.Response) -> worker_pb2.Response:
        return response


@dataclass
class Rig:
    loop: asyncio.AbstractEventLoop
    clock: SimulatedTime
    batcher: Batcher
    connection: FakeConnection
    exchange: EchoExchange
    dispatcher: Dispatcher
    done: list[BaseException | None]
    service_times: list[float]

    def submit(self, *ids: str) -> list[Job]:
        jobs = []
        for request_id in ids:
            job = Job(worker_pb2.Request(request_id=request_id), self.loop.create_future())
            self.batcher.submit(job)
            jobs.append(job)
        return jobs


def rig(loop: asyncio.AbstractEventLoop, *, batch_size: int = 2, max_in_flight: int = 2
        ) -> Rig:
    clock = SimulatedTime()
    # TorchServe's policy with a long delay: a batch goes when it is full (the batcher's own
    # timer, which would send a partial batch after the delay, never fires in these tests).
    batcher = Batcher(max_batch_size=batch_size, capacity=100,
                      policy=FixedPolicy(batch_size, 100.0), clock=clock,
                      call_later=clock.call_later)
    connection = FakeConnection()
    done: list[BaseException | None] = []
    service_times: list[float] = []

    exchange = EchoExchange(service_times)
    dispatcher = Dispatcher("W-test", batcher, connection, timeout_s=TIMEOUT_S,
                            max_in_flight=max_in_flight, exchange=exchange,
                            on_done=done.append, call_later=clock.call_later, clock=clock)
    return Rig(loop, clock, batcher, connection, exchange, dispatcher, done, service_times)


def scenario(test: Callable[[Rig], None], **options: int) -> None:
    async def run() -> None:
        test(rig(asyncio.get_running_loop(), **options))

    asyncio.run(run())


def _bodies(jobs: list[Job]) -> list[bytes]:
    return [job.future.result().body for job in jobs]  # type: ignore[union-attr]


def test_idle_then_busy_then_full_then_back() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        assert r.dispatcher.state is DispatchState.IDLE
        first = r.submit("a", "b")  # a full batch for an idle worker: sent at once
        assert r.connection.sent == [["a", "b"]]
        assert r.dispatcher.state is DispatchState.BUSY
        second = r.submit("c", "d")  # full: goes as the second batch in flight
        assert r.connection.sent[-1] == ["c", "d"]
        assert r.dispatcher.state is DispatchState.FULL
        third = r.submit("e", "f")  # no room: waits in the queue
        assert len(r.connection.sent) == 2 and r.batcher.depth == 2
        r.clock.advance(3)
        r.connection.answer()  # the first batch's answers; the third batch goes at once
        assert _bodies(first) == [b"a", b"b"]
        assert r.connection.sent[-1] == ["e", "f"]
        assert r.dispatcher.state is DispatchState.FULL
        r.clock.advance(2)
        r.connection.answer()
        r.connection.answer()
        assert _bodies(second) == [b"c", b"d"] and _bodies(third) == [b"e", b"f"]
        assert r.dispatcher.state is DispatchState.IDLE
        # The second batch's time counts from the first one's reply, not from its sending.
        assert r.service_times == [3.0, 2.0, 0.0]

    scenario(test)


def test_busy_time_counts_the_worker_on_its_batches_once_with_two_in_flight() -> None:
    """The live page's utilisation: busy while a batch is on the worker (the one it is on
    counted as it goes), idle time not, and two batches in flight not counted twice. The
    dispatcher notes each batch's time on the worker (``BusyTime`` adds them up as they end)
    and since when the worker is on the batch it is on."""
    def test(r: Rig) -> None:
        busy = BusyTime()
        r.exchange.on_ended = busy.batch_ended

        def ended_s() -> float:
            return busy.seconds.get("W-test", 0.0)

        def busy_seconds() -> float:
            since = r.dispatcher.working_since
            return ended_s() + (r.clock.now - since if since is not None else 0.0)

        r.dispatcher.start()
        r.clock.advance(5)  # idle
        assert busy_seconds() == 0.0
        r.submit("a", "b", "c", "d")  # two full batches in flight
        r.clock.advance(1.5)
        assert busy_seconds() == pytest.approx(1.5)  # on the first, so far
        r.connection.answer()
        r.clock.advance(1)
        assert ended_s() == pytest.approx(1.5)
        assert busy_seconds() == pytest.approx(2.5)
        r.connection.answer()
        r.clock.advance(4)  # idle again
        assert busy_seconds() == pytest.approx(2.5)
        r.submit("e", "f")
        r.clock.advance(TIMEOUT_S)  # a batch that times out counts its time too
        assert ended_s() == pytest.approx(2.5 + TIMEOUT_S)

    scenario(test)


def test_the_second_slot_takes_only_full_batches() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        r.submit("a", "b")
        lone = r.submit("c")  # one request while a batch computes: it waits to fill up
        assert r.connection.sent == [["a", "b"]] and r.dispatcher.state is DispatchState.BUSY
        r.connection.answer()  # now idle: the policy decides (here: wait to fill up)
        assert r.dispatcher.state is DispatchState.IDLE and r.batcher.depth == 1
        r.submit("d")
        assert r.connection.sent[-1] == ["c", "d"]
        r.connection.answer()
        assert _bodies(lone) == [b"c"]

    scenario(test)


def test_with_one_in_flight_the_worker_holds_one_batch() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        r.submit("a", "b", "c", "d")
        assert r.connection.sent == [["a", "b"]] and r.dispatcher.state is DispatchState.FULL
        r.connection.answer()
        assert r.connection.sent[-1] == ["c", "d"]

    scenario(test, max_in_flight=1)


def test_a_worker_that_dies_with_two_batches_in_flight_fails_both_once() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        held = r.submit("a", "b", "c", "d")
        queued = r.submit("e")
        assert len(r.connection.sent) == 2
        r.connection.die()
        for job in held:
            assert isinstance(job.future.exception(), WorkerDied)
        assert not queued[0].future.done() and r.batcher.depth == 1  # for the next worker
        assert r.dispatcher.state is DispatchState.DONE
        assert len(r.done) == 1 and isinstance(r.done[0], WorkerDied)

    scenario(test)


def test_a_timeout_answers_its_batch_504_and_the_one_behind_it_500() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        first, second = r.submit("a", "b"), r.submit("c", "d")
        r.clock.advance(TIMEOUT_S - 1)
        assert not any(job.future.done() for job in first + second)
        r.clock.advance(1)
        assert all(isinstance(job.future.exception(), GatewayTimeout) for job in first)
        assert all(isinstance(job.future.exception(), WorkerDied) for job in second)
        assert r.connection.killed and r.connection.replies == []
        assert r.dispatcher.state is DispatchState.DONE

    scenario(test)


def test_the_second_batch_gets_its_own_full_timeout() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        r.submit("a", "b")
        second = r.submit("c", "d")
        r.clock.advance(TIMEOUT_S - 1)
        r.connection.answer()  # the first answered just in time
        r.clock.advance(TIMEOUT_S - 1)  # the second started at that reply: still in time
        assert not any(job.future.done() for job in second)
        r.connection.answer()
        assert _bodies(second) == [b"c", b"d"]

    scenario(test)


def test_stop_drains_what_is_in_flight_and_leaves_the_queue() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        held = r.submit("a", "b", "c", "d")
        r.submit("e", "f")
        r.dispatcher.stop()
        assert r.dispatcher.state is DispatchState.STOPPING
        r.connection.answer()
        r.connection.answer()
        assert _bodies(held) == [b"a", b"b", b"c", b"d"]
        assert r.batcher.depth == 2 and len(r.connection.sent) == 2
        assert r.dispatcher.state is DispatchState.DONE and r.done == [None]

    scenario(test)


def test_an_idle_worker_that_exits_ends_the_dispatcher() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        r.dispatcher.connection_lost(WorkerDied("exited while idle"))
        assert r.dispatcher.state is DispatchState.DONE
        job = r.submit("a")[0]
        assert not job.future.done() and r.batcher.depth == 1  # it is no longer parked

    scenario(test)


def test_abandon_fails_the_batches_in_flight() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        held = r.submit("a", "b", "c", "d")
        r.dispatcher.abandon(WorkerDied("stopped during a batch"))
        assert all(isinstance(job.future.exception(), WorkerDied) for job in held)
        assert r.connection.replies == [] and r.dispatcher.state is DispatchState.DONE

    scenario(test)


def test_a_closed_batcher_stops_the_dispatcher() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        r.batcher.close(ServiceUnavailable("unregistered"))
        assert r.dispatcher.state is DispatchState.DONE and r.done == [None]

    scenario(test)


def test_intermediate_parts_reach_their_request_in_either_batch() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        first, second = r.submit("a", "b"), r.submit("c", "d")
        assert r.connection.on_partial is not None
        r.connection.on_partial(worker_pb2.Response(request_id="d", body=b"part"))
        assert second[1].stream is not None and not first[0].future.done()

    scenario(test)


def test_max_in_flight_must_be_positive() -> None:
    async def run() -> None:
        with pytest.raises(ValueError, match="max_in_flight"):
            Dispatcher("W", Batcher(max_batch_size=1, capacity=1, policy=FixedPolicy(1, 0.0)),
                       FakeConnection(), timeout_s=1, max_in_flight=0,
                       exchange=EchoExchange([]), on_done=lambda e: None,
                       call_later=SimulatedTime().call_later, clock=SimulatedTime())

    asyncio.run(run())


def test_a_batch_the_dead_worker_never_got_goes_back_to_the_queue() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        r.connection.gone = True  # the socket is closed; the exit is not yet noticed
        jobs = r.submit("a", "b")
        assert not any(job.future.done() for job in jobs)
        assert r.batcher.depth == 2  # for the next worker
        assert r.dispatcher.state is DispatchState.DONE

    scenario(test)


def test_with_a_batch_in_flight_a_failed_send_stops_sending() -> None:
    def test(r: Rig) -> None:
        r.dispatcher.start()
        held = r.submit("a", "b")
        r.connection.gone = True  # closed under the batch in flight
        queued = r.submit("c", "d", "e", "f")  # full batches: the second slot would take them
        assert r.connection.sent == [["a", "b"]]  # tried once, then no more
        assert r.batcher.depth == 4 and not any(job.future.done() for job in queued)
        assert r.dispatcher.state is DispatchState.STOPPING
        r.connection.die()  # the reader fails the batch in flight; the dispatcher ends
        assert all(isinstance(job.future.exception(), WorkerDied) for job in held)
        assert r.dispatcher.state is DispatchState.DONE and r.batcher.depth == 4

    scenario(test)
