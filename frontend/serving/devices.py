"""One device's time shared by weight among the model versions whose workers run on it.

Models that name the same ``deviceGroup`` (model-config.yaml) share one device: a
``DeviceGroup``. Each model version joined to it holds a ``DeviceShare`` with its
``deviceWeight``; its workers' dispatchers (frontend/serving/dispatch.py) ask the share for a
grant before each batch goes to a worker, and give the grant back, with the batch's measured
service time, when its reply is read (or the batch is lost).

A group lets ``slots`` batches be on its device at once: one by default, so that the batches of
a group never overlap and each batch's service time is the device's time, measured exactly (a
serialising accelerator; on a GPU, kernels of several processes are time-sliced anyway). When
the device is busy and several models wait, the next grant goes to the model with the least
*virtual time*: the device seconds it used divided by its weight (start-time fair queuing over
models, costs charged as measured). A model that comes back from idle starts at the group's
virtual time (the virtual time of the last grant): it gets no burst for the time it was away,
and waits for at most the batches already on the device before it is served.

No model that names no group has a share: its dispatchers test one attribute per batch and
nothing else.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

#: Called when a grant is given: the batch may go to its worker now.
Granted = Callable[[], None]


class DeviceShare:
    """One model version's share of a group's device: its weight, its device time, and its
    dispatchers waiting for a grant."""

    __slots__ = ("group", "last_release", "model_name", "model_version", "running", "used_s",
                 "vtime", "waiting", "weight")

    def __init__(self, group: DeviceGroup, model_name: str, model_version: str,
                 weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"a device weight must be > 0, got {weight}")
        self.group = group
        self.model_name = model_name
        self.model_version = model_version
        self.weight = weight
        #: Device seconds its batches took (measured service times).
        self.used_s = 0.0
        #: ``used_s / weight``, caught up to the group's virtual time when it comes back idle.
        self.vtime = 0.0
        #: Batches of it on the device now.
        self.running = 0
        #: The group's ``releases`` after its last batch left the device.
        self.last_release = group.releases
        #: Its dispatchers waiting for a grant, first come first served.
        self.waiting: collections.deque[Granted] = collections.deque()

    @property
    def share(self) -> float:
        """Its fraction of the device time its group's models used (0 before any)."""
        total = self.group.used_s
        return self.used_s / total if total > 0 else 0.0

    def ask(self, granted: Granted) -> None:
        """A batch of this model would go to its worker: ``granted`` is called (at once, or
        when the device has room and this model's turn comes). Each grant is given back with
        ``release``."""
        self.group.ask(self, granted)

    def withdraw(self, granted: Granted) -> bool:
        """A waiting dispatcher no longer wants its grant; False if it was not waiting."""
        if granted in self.waiting:
            self.waiting.remove(granted)
            return True
        return False

    def release(self, service_s: float) -> None:
        """A granted batch left the device after ``service_s`` seconds (0: it never ran)."""
        self.group.release(self, service_s)


class DeviceGroup:
    """The models sharing one device (see the module docstring)."""

    def __init__(self, name: str, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"a device group needs at least 1 slot, got {slots}")
        self.name = name
        self.slots = slots
        self.shares: list[DeviceShare] = []
        #: Batches on the device now.
        self.running = 0
        #: The virtual time of the last grant: where a model coming back from idle starts.
        self.vtime = 0.0
        #: Device seconds of every batch its models ran (the models gone included).
        self.used_s = 0.0
        #: Batches that left the device.
        self.releases = 0
        self._granting = False

    def join(self, model_name: str, model_version: str, weight: float) -> DeviceShare:
        share = DeviceShare(self, model_name, model_version, weight)
        share.vtime = self.vtime
        self.shares.append(share)
        return share

    def leave(self, share: DeviceShare) -> None:
        if share in self.shares:
            self.shares.remove(share)
        share.waiting.clear()

    def ask(self, share: DeviceShare, granted: Granted) -> None:
        if not share.waiting and not share.running and share.last_release < self.releases \
                and share.vtime < self.vtime:
            # Back from idle (another model's batch ended since its own last one: it asks
            # again later than at once): no credit for the time away.
            share.vtime = self.vtime
        share.waiting.append(granted)
        self._grant()

    def release(self, share: DeviceShare, service_s: float) -> None:
        share.running -= 1
        self.running -= 1
        self.releases += 1
        share.last_release = self.releases
        share.used_s += service_s
        self.used_s += service_s
        share.vtime += service_s / share.weight
        self._grant()

    def _grant(self) -> None:
        """Give the free slots to the waiting models, least virtual time first. A grant's
        callback may ask or release again: that call returns at once, and this loop looks
        again."""
        if self._granting:
            return
        self._granting = True
        try:
            while self.running < self.slots:
                waiting = [share for share in self.shares if share.waiting]
                if not waiting:
                    return
                share = min(waiting, key=_virtual_time)
                granted = share.waiting.popleft()
                share.running += 1
                self.running += 1
                if share.vtime > self.vtime:
                    self.vtime = share.vtime
                try:
                    granted()
                except Exception:  # one dispatcher's bug must not stop the device
                    logger.exception("a device grant's callback failed")
                    share.running -= 1
                    self.running -= 1
        finally:
            self._granting = False


def _virtual_time(share: DeviceShare) -> float:
    return share.vtime


class DeviceGroups:
    """The device groups of one server, by name: made when a first model joins one, dropped
    when its last model leaves."""

    def __init__(self) -> None:
        self.groups: dict[str, DeviceGroup] = {}

    def join(self, group: str, model_name: str, model_version: str, weight: float
             ) -> DeviceShare:
        found = self.groups.get(group)
        if found is None:
            found = self.groups[group] = DeviceGroup(group)
        return found.join(model_name, model_version, weight)

    def leave(self, share: DeviceShare) -> None:
        """The model version of ``share`` is gone: it takes no more grants."""
        group = share.group
        group.leave(share)
        if not group.shares and self.groups.get(group.name) is group:
            del self.groups[group.name]
