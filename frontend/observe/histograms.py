"""Our histograms (``batchserve_*``): a count per bucket and the sum, per label set, kept as
plain lists (an observation is a list increment: no lock, the event loop is the only writer,
and nothing is formatted until a scrape reads them)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from frontend.observe.exposition import Family, java_double

MODEL_LABELS = ("model_name", "model_version")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0, 10.0, 30.0, 120.0)
#: Phases of a request's time are shorter than whole requests: finer buckets at the bottom.
PHASE_BUCKETS = (0.0001, 0.00025, *TIME_BUCKETS)


class Series:
    """One label set's histogram: a count per bucket (the last: above every bound) and the
    sum."""

    __slots__ = ("counts", "total")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)
        self.total = 0.0


class Histogram:
    """One of our histograms, per model version (labels ``model_name``, ``model_version``, or
    those given)."""

    def __init__(self, name: str, documentation: str, bounds: tuple[float, ...],
                 labels: tuple[str, ...] = MODEL_LABELS) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = bounds
        self.labels = labels
        self._le = [*map(java_double, bounds), "+Inf"]
        self.series: dict[tuple[str, ...], Series] = {}

    def of(self, key: tuple[str, ...]) -> Series:
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = Series(len(self.bounds))
        return series

    # NOTE: the observations look their series up themselves (``of`` only for a new one):
    # they run for every request, and a call is most of what they cost.

    def observe(self, key: tuple[str, ...], value: float) -> None:
        series = self.series.get(key) or self.of(key)
        series.counts[bisect.bisect_left(self.bounds, value)] += 1
        series.total += value

    def observe_n(self, key: tuple[str, ...], value: float, count: int) -> None:
        """Observe ``value`` ``count`` times (the requests of one batch)."""
        series = self.series.get(key) or self.of(key)
        series.counts[bisect.bisect_left(self.bounds, value)] += count
        series.total += value * count

    def observe_all(self, key: tuple[str, ...], values: Iterable[float]) -> None:
        """Observe each of ``values`` (one series lookup for them all)."""
        series, bounds = self.series.get(key) or self.of(key), self.bounds
        counts, total = series.counts, 0.0
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1
            total += value
        series.total += total

    def family(self) -> Family:
        family = Family(self.name, self.documentation, "histogram")
        for key, series in list(self.series.items()):
            add_histogram_series(family, self.labels, key, self._le, series.counts,
                                 series.total)
        return family


def add_histogram_series(family: Family, labels: tuple[str, ...], key: tuple[str, ...],
                         le: Sequence[str], counts: Iterable[int], total: float) -> None:
    """One series of a histogram ``family``: its buckets (``counts`` per bucket, the last above
    every bound, written cumulatively by their ``le``), its count and its sum."""
    bucket_labels = (*labels, "le")
    seen = 0
    for bound, count in zip(le, counts, strict=True):
        seen += count
        family.add(bucket_labels, (*key, bound), float(seen), "_bucket")
    family.add(labels, key, float(seen), "_count")
    family.add(labels, key, total, "_sum")
