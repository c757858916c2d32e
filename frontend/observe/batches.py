"""What is kept of each registered model version's batches, from their events: why they left
the queue and how full they were (``DispatchStats``: ``batchserve_dispatch_total``,
``batchserve_batch_fill``, describe's ``dispatchReasons`` and ``batchFill``, the live page's
reasons and fill), the recent batches' sizes with the totals (describe's
``recentBatchSizes``, ``batchesTotal``, ``requestsTotal``), and how the batches fitted their
workers' batch buckets (``BucketCounts``: the ``batchserve_batch_bucket_*`` and
``batchserve_batch_padding_rows_total`` counters, describe's ``buckets``, the live page's hits
and padding). docs/batches.md says how to read them.

The reasons are counted when a batch leaves the queue (``batch_formed``, subscribed only while
``dispatch_stats`` is on); the sizes and the buckets when its answer comes back
(``batch_ended``). A version's records start afresh when it is registered and go when it is
removed.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterator, Sequence

from frontend.observe.events import REASONS, Batch, JobFacts, ModelKey
from frontend.observe.exposition import Family, java_double
from frontend.observe.histograms import MODEL_LABELS, add_histogram_series
from protos import worker_pb2

#: Bounds of the batch fill histogram (size / batch_size).
FILL_BUCKETS = (0.125, 0.25, 0.5, 0.75, 1.0)
#: Batches whose reason and fill ``DispatchStats.recent`` keeps, and whose sizes
#: ``ModelBatches.recent_sizes`` keeps (describe's).
RECENT_BATCHES = 64
DISPATCH_LABELS = (*MODEL_LABELS, "reason")
FILL_LABELS = MODEL_LABELS
_FILL_LE = [*map(java_double, FILL_BUCKETS), "+Inf"]


class DispatchStats:
    """Why a model's batches left and how full they were: totals since it was registered (for
    the metrics page) and the last ``RECENT_BATCHES`` (for describe). A stateful model's lanes
    count as one."""

    __slots__ = ("batches", "enabled", "fill_counts", "fill_sum", "reasons", "recent")
    #: The fill histogram's bucket bounds.
    bounds = FILL_BUCKETS

    def __init__(self, enabled: bool = True) -> None:
        #: False (``dispatch_stats=false``): nothing is counted, every count stays 0.
        self.enabled = enabled
        self.reasons: dict[str, int] = dict.fromkeys(REASONS, 0)
        #: Batches per fill bucket (``FILL_BUCKETS``, then above the last: an oversized
        #: KServe request), their count and the sum of their fills.
        self.fill_counts = [0] * (len(FILL_BUCKETS) + 1)
        self.batches = 0
        self.fill_sum = 0.0
        #: (reason, fill) of the last batches.
        self.recent: collections.deque[tuple[str, float]] = collections.deque(
            maxlen=RECENT_BATCHES)

    def add(self, reason: str, fill: float) -> None:
        if not self.enabled:
            return
        self.reasons[reason] += 1
        self.fill_counts[bisect.bisect_left(FILL_BUCKETS, fill)] += 1
        self.batches += 1
        self.fill_sum += fill
        self.recent.append((reason, fill))

    def recent_summary(self) -> tuple[dict[str, int], dict[str, object]]:
        """Describe's ``dispatchReasons`` (reason -> batches, of the recent ones) and
        ``batchFill`` (their mean fill, and how many fell in each fill bucket: "le" bounds as
        the metrics page's)."""
        recent = list(self.recent)
        reasons = {reason: 0 for reason in REASONS}
        buckets = {f"{bound:g}": 0 for bound in FILL_BUCKETS}
        labels = list(buckets)
        over = 0
        for reason, fill in recent:
            reasons[reason] += 1
            index = bisect.bisect_left(FILL_BUCKETS, fill)
            if index < len(labels):
                buckets[labels[index]] += 1
            else:
                over += 1
        fills = [fill for _, fill in recent]
        summary: dict[str, object] = {
            "batches": len(recent),
            "mean": round(sum(fills) / len(fills), 3) if fills else 0.0,
            "buckets": buckets,
        }
        if over:
            summary["over"] = over
        return {reason: count for reason, count in reasons.items() if count}, summary


class BucketCounts:
    """How a model version's batches fitted the batch buckets of the workers that ran them
    (``Batch.rows``): the batches that ran padded to buckets, those of them that needed no
    padding row (hits), the rows run and, of those, the padding."""

    __slots__ = ("batches", "hits", "padded_rows", "rows")

    def __init__(self) -> None:
        self.batches = self.hits = self.rows = self.padded_rows = 0

    def add(self, items: int, rows: int) -> None:
        self.batches += 1
        self.rows += rows
        padding = rows - items
        if padding:
            self.padded_rows += padding
        else:
            self.hits += 1

    def fields(self) -> dict[str, object]:
        """Describe's and the live page's: the totals, and the padding's share of the rows."""
        return {"batches": self.batches, "hits": self.hits, "rows": self.rows,
                "paddedRows": self.padded_rows,
                "paddingShare": round(self.padded_rows / self.rows, 3) if self.rows else 0.0}


class ModelBatches:
    """One model version's batches: why they left (``dispatch``), the sizes of the recent
    ones, how many batches and requests came back in all, and how they fitted their workers'
    batch buckets (``buckets``)."""

    __slots__ = ("batches_total", "buckets", "dispatch", "recent_sizes", "requests_total")

    def __init__(self, dispatch_stats: bool = True) -> None:
        self.dispatch = DispatchStats(enabled=dispatch_stats)
        self.buckets = BucketCounts()
        self.recent_sizes: collections.deque[int] = collections.deque(maxlen=RECENT_BATCHES)
        self.batches_total = 0
        self.requests_total = 0


class BatchRecords:
    """``ModelBatches`` per registered model version (see the module docstring)."""

    def __init__(self, dispatch_stats: bool = True) -> None:
        #: ``dispatch_stats``: the reasons and fills are counted (``batch_formed`` is
        #: subscribed); off, each version's ``DispatchStats`` is disabled and stays empty.
        self.dispatch_stats = dispatch_stats
        self._models: dict[ModelKey, ModelBatches] = {}

    def of(self, name: str, version: str) -> ModelBatches | None:
        """A registered version's records (None: it is not registered)."""
        return self._models.get((name, version))

    def registered(self, key: ModelKey) -> None:
        self._models[key] = ModelBatches(self.dispatch_stats)

    def removed(self, key: ModelKey) -> None:
        self._models.pop(key, None)

    def batch_formed(self, key: ModelKey, batch: Batch) -> None:
        """A batch left the queue: its reason and its fill."""
        model = self._models.get(key)
        if model is not None:
            model.dispatch.add(batch.reason, batch.items / batch.limit)

    def batch_ended(self, key: ModelKey, batch: Batch, jobs: Sequence[JobFacts],
                    result: worker_pb2.PredictResult | None) -> None:
        """A batch's reply came back (answered or failed as a whole): its size, and how it
        fitted its worker's batch buckets."""
        model = self._models.get(key)
        if model is None or not batch.replied:
            return
        model.recent_sizes.append(len(jobs))
        model.batches_total += 1
        model.requests_total += len(jobs)
        if batch.rows:
            model.buckets.add(batch.items, batch.rows)

    def families(self) -> Iterator[Family]:
        """Why each version's batches left, and how full they were (read when scraped)."""
        reasons = Family("batchserve_dispatch_total",
                         "Batches dispatched, by why they left the queue: full, max_delay, "
                         "adaptive, deadline, slot_free, sequence (docs/batches.md)", "counter")
        fill = Family("batchserve_batch_fill",
                      "Fill of each dispatched batch: its size / batch_size", "histogram")
        for key, model in list(self._models.items()):
            stats = model.dispatch
            if not stats.enabled:  # dispatch_stats=false: no zeros that would read as counts
                continue
            for reason, count in list(stats.reasons.items()):
                reasons.add(DISPATCH_LABELS, (*key, reason), float(count))
            add_histogram_series(fill, FILL_LABELS, key, _FILL_LE, list(stats.fill_counts),
                                 stats.fill_sum)
        yield from (reasons, fill)
        yield from self._bucket_families()

    def _bucket_families(self) -> Iterator[Family]:
        """How each version's batches fitted its workers' batch buckets: a version has these
        series once a batch of it ran padded to buckets (docs/batches.md)."""
        families = [(Family(name, text, "counter"), field) for name, text, field in (
            ("batchserve_batch_bucket_batches_total",
             "Batches run by a worker that pads them to its batch buckets", "batches"),
            ("batchserve_batch_bucket_hits_total",
             "Of those, batches that needed no padding row (their size fills their buckets)",
             "hits"),
            ("batchserve_batch_bucket_rows_total",
             "Rows those batches ran as: their items and the padding", "rows"),
            ("batchserve_batch_padding_rows_total",
             "Rows of padding added to those batches to reach a bucket", "padded_rows"))]
        for key, model in list(self._models.items()):
            if model.buckets.batches:
                for family, field in families:
                    family.add(MODEL_LABELS, key, float(getattr(model.buckets, field)))
        yield from (family for family, _ in families)
