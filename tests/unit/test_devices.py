"""Device time shared by weight (frontend/serving/devices.py): the group's scheduler alone, then
two models' dispatchers on one group, driven by fake worker connections in simulated time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from frontend.errors import WorkerDied
from frontend.serving.devices import DeviceGroup, DeviceGroups, DeviceShare
from tests.unit.test_dispatch import Rig, rig


class Backlog:
    """Models that always have a batch waiting: each grant runs a batch of its model's cost,
    then the model asks again at once."""

    def __init__(self, group: DeviceGroup, costs: dict[DeviceShare, float]) -> None:
        self.group = group
        self.costs = costs
        self.running: list[DeviceShare] = []
        self.order: list[DeviceShare] = []

    def ask(self, share: DeviceShare) -> None:
        def granted() -> None:
            self.running.append(share)
            self.order.append(share)
        share.ask(granted)

    def step(self) -> None:
        """The batch on the device ends; its model's next batch asks (as a dispatcher does,
        before it gives the device back)."""
        share = self.running.pop(0)
        self.ask(share)
        share.release(self.costs[share])


def _backlogged(weights: tuple[float, float], costs: tuple[float, float], batches: int
                ) -> tuple[DeviceShare, DeviceShare, Backlog]:
    group = DeviceGroup("sim")
    a = group.join("a", "1", weights[0])
    b = group.join("b", "1", weights[1])
    backlog = Backlog(group, {a: costs[0], b: costs[1]})
    backlog.ask(a)
    backlog.ask(b)
    for _ in range(batches):
        backlog.step()
    return a, b, backlog


@pytest.mark.parametrize(("weights", "costs", "share_a"), [
    ((1, 1), (0.028, 0.028), 0.5),
    ((1, 1), (0.028, 0.010), 0.5),  # b's batches are cheap: it runs more of them, same time
    ((3, 1), (0.028, 0.028), 0.75),
    ((1, 3), (0.010, 0.028), 0.25),
])
def test_backlogged_models_share_the_device_time_by_weight(
        weights: tuple[float, float], costs: tuple[float, float], share_a: float) -> None:
    a, b, backlog = _backlogged(weights, costs, 2000)
    assert a.share == pytest.approx(share_a, abs=0.01)
    assert b.share == pytest.approx(1 - share_a, abs=0.01)
    assert backlog.group.running == 1  # one batch at a time on the device


def test_one_batch_at_a_time_and_a_lone_model_never_waits() -> None:
    group = DeviceGroup("sim")
    a = group.join("a", "1", 1.0)
    granted: list[str] = []
    a.ask(lambda: granted.append("first"))
    a.ask(lambda: granted.append("second"))
    assert granted == ["first"] and len(a.waiting) == 1  # the device holds one batch
    a.release(0.02)
    assert granted == ["first", "second"] and a.used_s == pytest.approx(0.02)


def test_a_cold_model_is_served_next_and_gets_no_burst() -> None:
    """A model that was idle while another used the device for a long time is served after the
    batch on the device, and then takes turns: no credit for the time it was away."""
    group = DeviceGroup("sim")
    hot = group.join("hot", "1", 1.0)
    cold = group.join("cold", "1", 1.0)
    backlog = Backlog(group, {hot: 0.028, cold: 0.028})
    backlog.ask(hot)
    for _ in range(500):
        backlog.step()
    assert backlog.order == [hot] * 501
    backlog.ask(cold)
    for _ in range(10):
        backlog.step()
    assert backlog.order[501:] == [cold, hot] * 5


def test_a_withdrawn_wait_is_not_granted() -> None:
    group = DeviceGroup("sim")
    a = group.join("a", "1", 1.0)
    b = group.join("b", "1", 1.0)
    granted: list[str] = []
    a.ask(lambda: granted.append("a"))

    def wants_b() -> None:
        granted.append("b")

    b.ask(wants_b)
    assert b.withdraw(wants_b) and not b.withdraw(wants_b)
    a.release(0.01)
    assert granted == ["a"] and group.running == 0


def test_groups_are_made_and_dropped_with_their_models() -> None:
    groups = DeviceGroups()
    a = groups.join("gpu0", "a", "1", 1.0)
    b = groups.join("gpu0", "b", "1", 2.0)
    assert a.group is b.group and list(groups.groups) == ["gpu0"]
    groups.leave(a)
    assert list(groups.groups) == ["gpu0"]
    groups.leave(b)
    assert groups.groups == {}
    with pytest.raises(ValueError, match="weight"):
        groups.join("gpu0", "c", "1", 0.0)


# -- two models' dispatchers on one device ------------------------------------------------------


def _pair(test: Callable[[Rig, Rig, DeviceGroup], None]) -> None:
    """Two models, one worker each (batch_size 2), whose dispatchers share one device."""
    async def run() -> None:
        loop = asyncio.get_running_loop()
        group = DeviceGroup("sim")
        rigs = []
        for name in ("a", "b"):
            r = rig(loop)
            r.dispatcher._device = group.join(name, "1", 1.0)
            rigs.append(r)
        test(rigs[0], rigs[1], group)

    asyncio.run(run())


def test_dispatchers_take_turns_on_the_device() -> None:
    def test(a: Rig, b: Rig, group: DeviceGroup) -> None:
        a.dispatcher.start()
        b.dispatcher.start()
        a.submit("a1", "a2", "a3", "a4")
        b.submit("b1", "b2")
        assert a.connection.sent == [["a1", "a2"]]  # the device holds one batch
        assert b.connection.sent == [] and b.dispatcher.waiting is not None
        assert a.dispatcher.waiting is not None  # its next batch waits for the device too
        a.clock.advance(0.02)
        a.connection.answer()
        # a used the device: b's turn, although a's next batch waited first.
        assert b.connection.sent == [["b1", "b2"]] and a.connection.sent == [["a1", "a2"]]
        b.connection.answer()
        assert a.connection.sent[-1] == ["a3", "a4"]
        a.connection.answer()
        assert group.running == 0 and a.dispatcher.waiting is None

    _pair(test)


def test_a_stopping_dispatcher_puts_its_waiting_batch_back() -> None:
    def test(a: Rig, b: Rig, group: DeviceGroup) -> None:
        a.dispatcher.start()
        b.dispatcher.start()
        a.submit("a1", "a2")
        b.submit("b1", "b2")
        assert b.dispatcher.waiting is not None
        b.dispatcher.stop()
        assert b.dispatcher.waiting is None and b.batcher.depth == 2 and b.done == [None]
        a.connection.answer()
        assert b.connection.sent == [] and group.running == 0

    _pair(test)


def test_a_dead_worker_gives_the_device_back() -> None:
    def test(a: Rig, b: Rig, group: DeviceGroup) -> None:
        a.dispatcher.start()
        b.dispatcher.start()
        jobs = a.submit("a1", "a2", "a3", "a4")
        b.submit("b1", "b2")
        a.connection.die()
        assert isinstance(jobs[0].future.exception(), WorkerDied)
        assert a.batcher.depth == 2  # its waiting batch went back to the queue
        assert b.connection.sent == [["b1", "b2"]] and group.running == 1

    _pair(test)
