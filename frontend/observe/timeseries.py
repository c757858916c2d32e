"""What the live page's history is made of: a bounded ring of per-second samples, and the
arithmetic that turns two readings of a counter or a histogram into a rate, a mean or a
percentile.

Histograms and counters are read from metric families (``exposition.Family``), whatever
module keeps them: a family is found by its name, a model's series by its labels
(``model_name`` or ``model``, and ``model_version`` where there is one). A percentile is
estimated from bucket counts as Prometheus' ``histogram_quantile`` does: linearly within the
bucket it falls in, and the highest finite bound when it falls above them all.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from frontend.observe.exposition import Family

#: A series' labels, in the family's order, without ``le``.
Labels = tuple[tuple[str, str], ...]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Buckets:
    """One histogram series read at one moment: its finite bucket bounds, the cumulative
    count at each bound and above them all (one more than the bounds), and the sum."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def since(self, before: Buckets | None) -> Buckets:
        """What was observed between ``before`` and this reading (all of it without one; a
        series that was reset or rebucketed counts from zero)."""
        if before is None or before.bounds != self.bounds or before.count > self.count:
            return self
        return Buckets(self.bounds, tuple(now - then for now, then in
                                          zip(self.cumulative, before.cumulative, strict=True)),
                       self.total - before.total)

    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) of what was observed, or None when nothing was."""
        count = self.count
        if count <= 0 or not self.bounds:
            return None
        rank = q * count
        index = bisect.bisect_left(self.cumulative, rank)
        if index >= len(self.bounds):  # above every finite bound
            return self.bounds[-1]
        upper = self.bounds[index]
        lower = self.bounds[index - 1] if index > 0 else min(0.0, upper)
        below = self.cumulative[index - 1] if index > 0 else 0.0
        inside = self.cumulative[index] - below
        if inside <= 0:
            return upper
        return lower + (upper - lower) * (rank - below) / inside


def read_histograms(family: Family) -> dict[Labels, Buckets]:
    """Each series of a histogram family, by its labels."""
    bounds: dict[Labels, list[tuple[float, float]]] = {}
    totals: dict[Labels, float] = {}
    for name, label_names, values, value in family.samples:
        pairs = tuple(zip(label_names, values, strict=True))
        if name.endswith("_bucket"):
            le = next((text for label, text in pairs if label == "le"), None)
            if le is None:
                continue
            key = tuple(pair for pair in pairs if pair[0] != "le")
            try:
                bounds.setdefault(key, []).append((float(le), value))
            except ValueError:
                continue
        elif name.endswith("_sum"):
            totals[pairs] = value
    series = {}
    for key, points in bounds.items():
        points.sort()
        finite = tuple(bound for bound, _ in points if math.isfinite(bound))
        cumulative = tuple(count for _, count in points)
        if len(cumulative) == len(finite):  # no +Inf bucket: the last bound holds everything
            cumulative = (*cumulative, cumulative[-1] if cumulative else 0.0)
        series[key] = Buckets(finite, cumulative, totals.get(key, 0.0))
    return series


class _KeptSeries(Protocol):
    @property
    def counts(self) -> Sequence[int]: ...

    @property
    def total(self) -> float: ...


class KeptHistogram(Protocol):
    """A histogram as the server's metrics keep theirs (``metrics._Histogram``): a count per
    bucket (the last above every bound) and a sum per label values."""

    @property
    def name(self) -> str: ...

    @property
    def bounds(self) -> tuple[float, ...]: ...

    @property
    def labels(self) -> tuple[str, ...]: ...

    @property
    def series(self) -> Mapping[tuple[str, ...], _KeptSeries]: ...


def read_kept_histogram(histogram: KeptHistogram) -> dict[Labels, Buckets]:
    """Each series of a kept histogram, by its labels (what ``read_histograms`` reads from
    its family, without writing the family first)."""
    return {tuple(zip(histogram.labels, key, strict=True)):
            Buckets(histogram.bounds, tuple(itertools.accumulate(series.counts)), series.total)
            for key, series in list(histogram.series.items())}


def read_counters(family: Family) -> dict[Labels, float]:
    """Each series of a counter (or gauge) family, by its labels."""
    return {tuple(zip(labels, values, strict=True)): value
            for name, labels, values, value in family.samples
            if not name.endswith(("_created", "_bucket", "_sum", "_count"))}


#: Series grouped by model version: (model, version; None where they have no version label)
#: -> each series' other labels and value.
ByModel = dict[tuple[str, str | None], list[tuple[dict[str, str], T]]]


def by_model(series: Mapping[Labels, T]) -> ByModel[T]:
    """``series`` grouped by their model (labelled ``model_name`` or ``model``) and version
    (``model_version``, where they have it); series of no model are left out. One pass, so
    that each model's are then found at once."""
    grouped: ByModel[T] = {}
    for labels, value in series.items():
        named = dict(labels)
        name = named.pop("model_name", None)
        if name is None:
            name = named.pop("model", None)
        if name is not None:
            version = named.pop("model_version", None)
            grouped.setdefault((name, version), []).append((named, value))
    return grouped


def of_model(grouped: ByModel[T], model: str, version: str) -> list[tuple[dict[str, str], T]]:
    """The series of one model version: those of its version, and those of its name without a
    version label."""
    return [*grouped.get((model, version), ()), *grouped.get((model, None), ())]


def by_label(series: Iterable[tuple[dict[str, str], T]], label: str) -> dict[str, T]:
    """Series keyed by one label's value (those without it left out)."""
    return {labels[label]: value for labels, value in series if label in labels}


class Ring(Generic[T]):
    """The last ``size`` samples, each with its time; older ones fall off (bounded memory)."""

    def __init__(self, size: int) -> None:
        self._items: collections.deque[tuple[float, T]] = collections.deque(maxlen=size)

    def append(self, time_s: float, item: T) -> None:
        self._items.append((time_s, item))

    def __len__(self) -> int:
        return len(self._items)

    def since(self, time_s: float | None) -> list[tuple[float, T]]:
        """The samples taken after ``time_s`` (all of them for None), oldest first."""
        if time_s is None:
            return list(self._items)
        out: list[tuple[float, T]] = []
        for item in reversed(self._items):
            if item[0] <= time_s:
                break
            out.append(item)
        out.reverse()
        return out
