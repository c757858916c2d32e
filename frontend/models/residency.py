"""More models than fit: residency limits, page-in on demand, least-recently-used eviction
(docs/residency.md).

With ``max_loaded_models``, ``max_loaded_memory`` or ``gpu_memory_budget`` set, the loader
hands every model version it registers to ``Residency.admit``: a pinned one is loaded at once
(idle models are paged out to make room for it), another is loaded when it fits as things are,
else it is registered paged out (no workers). A request to a model that is not loaded waits in
its queue (within its deadline and ``job_queue_size``) and asks for a page-in (``want``): one
per model however many requests come. A page-in waits until room can be made, pages out the
least recently used idle models (nothing queued, nothing in a worker, no open sequence, not
pinned) as a scale-down does, waits until their workers are gone, then starts the model's
workers (forked from the warm fork server, the weights mapped from the page cache). A page-in
that fails answers the requests waiting for it and leaves every other model as it was; one
that can never fit (the pinned models leave no room) is answered 503 at once.

A model's memory is its weights' size: the archive's serialized file (else all its files), on
the host once (its workers map the same pages), and on the GPUs once per worker there plus the
CUDA graphs' pools its workers report.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from frontend.config import ServerConfig
from frontend.errors import InternalError, OutOfResources, ServeError, ServiceUnavailable
from frontend.models.model import Model
from frontend.models.registry import ModelRegistry
from frontend.models.residence import EVICTING, LOADED, LOADING, PAGED_OUT, Residence
from frontend.observe.events import Observers
from frontend.serving.placement import Placement
from frontend.serving.workers import Worker, start_failures

logger = logging.getLogger(__name__)

#: How often a page-in that waits for room looks again (beyond each change it is told of:
#: a page-in or an eviction ended, a model was removed).
RECHECK_S = 0.02
#: A model with this many requests lately (each counting half as much every
#: ``HEAT_HALF_LIFE_S``: frontend/models/residence.py) is hot: a page-in for a model less hot
#: than it does not page it out while another page-in or eviction is under way
#: nor for its first ``PATIENCE_S``, but waits for a colder model to be idle (the hot models
#: stay while the cold ones take turns in the rest).
HOT_HEAT = 2.0
PATIENCE_S = 0.2


@dataclass(frozen=True, slots=True)
class ResidencyLimits:
    """The server's residency limits (0 and None: none)."""

    max_models: int = 0
    max_memory_bytes: int | None = None
    #: Per GPU.
    gpu_budget_bytes: int | None = None

    @property
    def on(self) -> bool:
        return bool(self.max_models) or self.max_memory_bytes is not None \
            or self.gpu_budget_bytes is not None


def residency_limits(config: ServerConfig) -> ResidencyLimits:
    return ResidencyLimits(config.max_loaded_models, config.max_loaded_memory_bytes,
                           config.gpu_memory_budget_bytes)


def weights_bytes(model_dir: Path, serialized_file: str | None) -> int:
    """What a model's weights take, before it is loaded: its serialized file's size, else the
    size of every file of its archive."""
    if serialized_file:
        path = model_dir / serialized_file
        if path.is_file():
            return path.stat().st_size
    return sum(path.stat().st_size for path in model_dir.rglob("*")
               if path.is_file() and not path.is_symlink())


class Residency:
    """Which model versions are loaded, within the limits (see the module's text)."""

    def __init__(self, limits: ResidencyLimits, registry: ModelRegistry, placement: Placement,
                 observers: Observers | None = None) -> None:
        self.limits = limits
        self._registry = registry
        self._placement = placement
        #: Told of each page-in, eviction and page-in's time (the metrics).
        self._observers = observers or Observers()
        #: Set whenever room may have been made (a page-in or eviction ended, a model left).
        self._changed = asyncio.Event()
        self._page_ins: dict[Model, asyncio.Task[None]] = {}
        self._evictions: dict[Model, asyncio.Future[list[None]]] = {}

    # ---- what the models take -------------------------------------------------------------

    def workers_for(self, model: Model) -> int:
        """The workers it runs when loaded: its min_workers, at least one."""
        return max(1, model.settings.min_workers)

    def gpu_bytes(self, model: Model) -> int:
        """What it takes (or would take, loaded) on the GPUs together."""
        if not model.uses_gpus or model.residence is None:
            return 0
        workers = len(model.workers) or self.workers_for(model)
        graphs = sum(worker.execution.graph_pool_bytes for worker in model.workers
                     if worker.execution is not None)
        return model.residence.memory_bytes * workers + graphs

    def over(self, models: Iterable[Model]) -> str:
        """The limit ``models`` loaded together would exceed ("" for none)."""
        chosen = [model for model in models if model.residence is not None]
        limits = self.limits
        if limits.max_models and len(chosen) > limits.max_models:
            return f"max_loaded_models={limits.max_models}"
        if limits.max_memory_bytes is not None and sum(
                m.residence.memory_bytes for m in chosen if m.residence is not None
        ) > limits.max_memory_bytes:
            return f"max_loaded_memory={limits.max_memory_bytes} bytes"
        gpus = self._placement.gpus.count
        if limits.gpu_budget_bytes is not None and gpus and sum(
                self.gpu_bytes(m) for m in chosen) > limits.gpu_budget_bytes * gpus:
            return f"gpu_memory_budget={limits.gpu_budget_bytes} bytes on each of {gpus} GPU(s)"
        return ""

    def _counted(self, but: Model) -> list[Model]:
        """The models that hold their room: loaded or being loaded (an evicting one is
        leaving), ``but`` aside."""
        return [model for model in self._registry if model is not but
                and model.residence is not None and model.residence.state in (LOADED, LOADING)]

    def _making_room(self, model: Model) -> bool:
        """Another page-in or eviction is under way: soon a colder model is idle, or room
        is free, without paging out a hot one."""
        return any(other is not model and other.residence is not None
                   and other.residence.state in (LOADING, EVICTING) for other in self._registry)

    def _victims(self, model: Model, *, spare_hot: bool = False) -> list[Model] | None:
        """The models to page out so that ``model`` fits, least recently used first ([]: it
        fits); None: not now (the others are busy, or, with ``spare_hot``, hotter than it).
        OutOfResources when nothing ever could make room: the pinned models leave none."""
        counted = self._counted(model)
        if not self.over([*counted, model]):
            return []
        fixed = [other for other in counted if other.residence is not None
                 and other.residence.pinned]
        reason = self.over([*fixed, model])
        if reason:
            raise OutOfResources(
                f'Model "{model.name}" version {model.version} cannot be loaded: with the '
                f"pinned models it exceeds {reason}")
        idle = sorted((other for other in counted
                       if other.residence is not None and not other.residence.pinned
                       and other.residence.state == LOADED and other.is_idle()
                       and not (spare_hot and _hotter(other, model))),
                      key=functools.partial(_coldest_first, time.time()))
        left, victims = list(counted), []
        for other in idle:
            left.remove(other)
            victims.append(other)
            if not self.over([*left, model]):
                return victims
        return None

    # ---- registration -----------------------------------------------------------------------

    def enroll(self, model: Model, pinned: bool) -> None:
        """Take a model version on (paged out until ``admit``); OutOfResources when it could
        never be loaded."""
        manifest = model.archive.manifest
        model.residence = Residence(pinned, weights_bytes(model.archive.model_dir,
                                                          manifest.serialized_file))
        model.residence.page_in = functools.partial(self.want, model)
        fixed = [other for other in self._counted(model)
                 if other.residence is not None and other.residence.pinned]
        reason = self.over([*fixed, model])
        if reason:
            raise OutOfResources(
                f'Model "{model.name}" version {model.version} cannot be loaded: '
                f"{'with the pinned models ' if fixed else ''}it exceeds {reason}")

    async def admit(self, model: Model, wait_s: float) -> list[Worker]:
        """Load a model version just registered when it is pinned (making room, waiting at
        most ``wait_s`` for the loaded models to be idle) or fits as things are; else it stays
        paged out. Its workers started (none: paged out)."""
        residence = model.residence
        assert residence is not None, "enroll first"
        if residence.pinned:
            deadline = time.monotonic() + wait_s
            victims = await self._room(model, lambda: time.monotonic() < deadline)
            if victims is None:
                raise OutOfResources(
                    f'Model "{model.name}" is pinned and no idle model could be paged out '
                    f"for it within {wait_s:g} s")
        elif self._victims(model) != []:
            logger.info("model %s version %s is registered paged out: loaded, it would "
                        "exceed %s", model.name, model.version,
                        self.over([*self._counted(model), model]))
            return []
        else:
            residence.state = LOADING
        await self._evicted()
        workers = self._start(model)
        asyncio.get_running_loop().create_task(self._watch(model, workers))
        return workers

    async def _watch(self, model: Model, workers: list[Worker]) -> None:
        """A registration's workers: loaded, or paged out again when they fail to load."""
        failures = await start_failures(workers)
        residence = model.residence
        if residence is None or residence.state != LOADING:
            return
        if failures:
            residence.state = PAGED_OUT
            await model.page_out(0)
        else:
            residence.state = LOADED  # resident since it was registered (in their order)
        self._changed.set()

    def forget(self, model: Model) -> None:
        """The model is being removed: its page-in (if any) stops here."""
        task = self._page_ins.pop(model, None)
        if task is not None:
            task.cancel()
        self._changed.set()

    async def close(self) -> None:
        tasks = list(self._page_ins.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self._evictions.values(), return_exceptions=True)

    # ---- page-in ----------------------------------------------------------------------------

    def want(self, model: Model, answer: asyncio.Future[Any]) -> None:
        """A request (answered through ``answer``) waits for ``model``, which has no workers:
        page it in, unless that is under way."""
        if model in self._page_ins or not self._registry.holds(model):
            return
        task = asyncio.get_running_loop().create_task(
            self._page_in(model, answer, time.monotonic()))
        self._page_ins[model] = task
        task.add_done_callback(lambda _: self._page_ins.pop(model, None)
                               if self._page_ins.get(model) is task else None)

    async def _page_in(self, model: Model, answer: asyncio.Future[Any], asked_at: float
                       ) -> None:
        residence = model.residence
        assert residence is not None
        try:
            eviction = self._evictions.get(model)
            if eviction is not None:  # its own: it is paged in once its workers are gone
                await asyncio.shield(eviction)
            if residence.state == LOADING:
                return  # a registration loads it
            residence.state = PAGED_OUT
            if await self._room(model, lambda: bool(model.batcher.depth), asked_at) is None:
                return  # nobody waits for it any more (deadlines passed, clients left)
            await self._evicted()
            made_room = time.monotonic()
            workers = self._start(model)
            failures = await start_failures(workers)
            if failures:
                raise InternalError(f'Model "{model.name}" version {model.version} failed to '
                                    f"load on demand: {failures[0]}")
        except ServeError as error:
            await self._failed(model, error)
            return
        finally:
            self._changed.set()
        residence.state = LOADED
        residence.resident_since = time.time()
        residence.page_ins += 1
        for subscriber in self._observers.paged_in:
            subscriber(model.key)
        ready = time.monotonic()
        worker = workers[0]
        logger.info("paged in model %s version %s in %.0f ms (%.0f ms making room)",
                    model.name, model.version, (ready - asked_at) * 1000,
                    (made_room - asked_at) * 1000)
        answer.add_done_callback(functools.partial(
            self._answered, model, residence, asked_at, made_room, ready,
            worker.hello_ms or 0.0, worker.load_time_ms or 0.0))

    def _answered(self, model: Model, residence: Residence, asked_at: float, made_room: float,
                  ready: float, hello_ms: float, load_ms: float, _: object) -> None:
        """The request that asked for a page-in was answered: the page-in's time, by step."""
        answered = max(time.monotonic(), ready)
        residence.last_page_in_ms = (answered - asked_at) * 1000
        steps = {"evict": made_room - asked_at, "fork": hello_ms / 1000,
                 "load": max(0.0, load_ms - hello_ms) / 1000, "first_batch": answered - ready,
                 "total": answered - asked_at}
        for subscriber in self._observers.page_in_timed:
            subscriber(model.key, steps)

    async def _room(self, model: Model, wanted: Any, asked_at: float | None = None
                    ) -> list[Model] | None:
        """Wait until room can be made for ``model`` while ``wanted()`` holds (None once it
        does not), then take it: the model is LOADING, its victims EVICTING. OutOfResources
        when no eviction could ever make room. A page-in (asked for at ``asked_at``) spares
        the models hotter than its own for its first ``PATIENCE_S``."""
        residence = model.residence
        assert residence is not None
        while True:
            patient = asked_at is not None and (time.monotonic() - asked_at < PATIENCE_S
                                                or self._making_room(model))
            victims = self._victims(model, spare_hot=patient)
            if victims is not None:
                residence.state = LOADING
                for victim in victims:
                    self._evict(victim)
                return victims
            if not wanted():
                return None
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), RECHECK_S)

    def _evict(self, victim: Model) -> None:
        """Page ``victim`` out: its workers leave it now and stop after what they hold."""
        residence = victim.residence
        assert residence is not None
        residence.state = EVICTING
        logger.info("paging out model %s version %s (least recently used idle model)",
                    victim.name, victim.version)
        stopped = self._evictions[victim] = victim.page_out(None)
        stopped.add_done_callback(functools.partial(self._paged_out, victim, stopped))

    def _paged_out(self, victim: Model, stopped: asyncio.Future[list[None]], _: object) -> None:
        if self._evictions.get(victim) is stopped:
            del self._evictions[victim]
        residence = victim.residence
        assert residence is not None
        if residence.state == EVICTING:
            residence.state = PAGED_OUT
        residence.evictions += 1
        for subscriber in self._observers.evicted:
            subscriber(victim.key)
        self._changed.set()
        if victim.batcher.depth and self._registry.holds(victim):
            # A request came while it was leaving: it comes back for it.
            self.want(victim, asyncio.get_running_loop().create_future())

    async def _evicted(self) -> None:
        """Wait until every eviction under way is done: no more models' workers run than the
        limits allow, even for a moment."""
        while self._evictions:
            await asyncio.gather(*(asyncio.shield(stop) for stop in
                                   list(self._evictions.values())), return_exceptions=True)

    def _start(self, model: Model) -> list[Worker]:
        count = self.workers_for(model) - len(model.workers)
        settings = model.settings
        self._placement.admit(model.name, count, max(count, settings.max_workers), 0)
        return model.start_workers(count)

    async def _failed(self, model: Model, error: ServeError) -> None:
        """A page-in failed: the requests waiting for it are answered with why, its workers
        stop, and it is paged out as before."""
        if not isinstance(error, InternalError | ServiceUnavailable):
            error = ServiceUnavailable(f'Model "{model.name}" version {model.version} cannot '
                                       f"be paged in: {error}")
        logger.error("%s", error)
        residence = model.residence
        assert residence is not None
        model.batcher.fail_queued(error)
        residence.state = PAGED_OUT
        await model.page_out(0)


def _hotter(other: Model, model: Model) -> bool:
    """``other`` is hot (``HOT_HEAT`` requests lately or more: ``Residence.heat``) and hotter
    than ``model``."""
    if other.residence is None or model.residence is None:
        return False
    now = time.time()
    theirs = other.residence.heat(now)
    return theirs >= HOT_HEAT and theirs > model.residence.heat(now)


def _coldest_first(now: float, model: Model) -> tuple[float, float, float]:
    """The eviction order: the coldest first (its requests lately: ``Residence.heat``), then
    the least recently used by its request before last, then by its last."""
    residence = model.residence
    if residence is None:
        return 0.0, 0.0, 0.0
    return (residence.heat(now), *residence.recency)
