"""Residency metrics (docs/residency.md), kept only with residency limits on: page-ins and
evictions per model version, the time of each page-in's steps, and how many models are
loaded now (read from the model versions' ``ModelStatus`` when scraped)."""

from __future__ import annotations

from collections.abc import Iterator

from frontend.observe.events import ModelKey
from frontend.observe.exposition import Family
from frontend.observe.histograms import MODEL_LABELS, TIME_BUCKETS, Histogram
from frontend.observe.status import Statuses

#: The steps of a page-in (``step`` label): making room (deciding, evicting), the worker's
#: process forked or spawned until its HELLO, its model loaded, its first answer; and the
#: whole, from the request that asked for it to that request's answer.
STEPS = ("evict", "fork", "load", "first_batch", "total")


class ResidencyMetrics:
    """Page-ins, evictions and page-in times, per model version."""

    def __init__(self) -> None:
        self.page_ins: dict[ModelKey, int] = {}
        self.evictions: dict[ModelKey, int] = {}
        self.page_in_time = Histogram(
            "batchserve_model_page_in_seconds",
            "Time of each step of a model's page-in (evict, fork, load, first_batch) and of the "
            "whole (total: from the request that asked for it to its answer)", TIME_BUCKETS,
            (*MODEL_LABELS, "step"))

    def paged_in(self, key: ModelKey) -> None:
        """``key`` was paged in: its workers are up."""
        self.page_ins[key] = self.page_ins.get(key, 0) + 1

    def timed(self, key: ModelKey, steps_s: dict[str, float]) -> None:
        """A page-in of ``key`` ended with its first answer: each step's seconds."""
        for step, seconds in steps_s.items():
            self.page_in_time.observe((*key, step), seconds)

    def evicted(self, key: ModelKey) -> None:
        self.evictions[key] = self.evictions.get(key, 0) + 1

    def families(self, models: Statuses) -> Iterator[Family]:
        page_ins = Family("batchserve_model_page_ins_total",
                          "Times a model was loaded on demand (paged in)", "counter")
        for key, count in list(self.page_ins.items()):
            page_ins.add(MODEL_LABELS, key, float(count))
        evictions = Family("batchserve_model_evictions_total",
                           "Times a model was paged out to make room for another", "counter")
        for key, count in list(self.evictions.items()):
            evictions.add(MODEL_LABELS, key, float(count))
        loaded = Family("batchserve_models_loaded",
                        "Model versions loaded now (their workers run)", "gauge")
        loaded.add((), (), float(sum(1 for model in models() if model.residency == "loaded")))
        yield from (page_ins, evictions, self.page_in_time.family(), loaded)
