"""Batch buckets: the padded batch sizes a worker runs its model's batches in (issue 33).

A worker that pads (``Execution.mode`` "padded", or "cuda_graphs": a CUDA graph captured per
bucket) runs a batch of n items in the smallest bucket that holds it, the extra rows padding;
a batch larger than the largest bucket runs in chunks of it, the last chunk padded
(protos/worker.proto, ``Execution``). This module holds that arithmetic, for the batcher's
policy (which prefers batches that need no padding), the exchange (which notes each batch's
rows on its facts) and the simulation; and the rule that gives a model its buckets when its
workers report theirs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

#: No buckets: the worker runs a batch of any size as it is.
NO_BUCKETS: tuple[int, ...] = ()


def normalise(sizes: Iterable[int]) -> tuple[int, ...]:
    """The bucket sizes a worker reported, ascending, each once; sizes below 1 dropped."""
    return tuple(sorted({int(size) for size in sizes if size >= 1}))


def padded_rows(items: int, buckets: Sequence[int]) -> int:
    """The rows a batch of ``items`` runs as on a worker with ``buckets`` (ascending): the
    smallest bucket that holds it, or chunks of the largest with the last one padded to the
    smallest bucket that holds what is left. Without buckets: ``items``."""
    if not buckets or items <= 0:
        return items
    largest = buckets[-1]
    chunks, rest = divmod(items, largest)
    if rest == 0:
        return items
    return chunks * largest + buckets[bisect.bisect_left(buckets, rest)]


def in_effect(reported: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """A model's buckets from those its workers report: the sizes every padding worker has
    (the intersection). A worker that reports none runs any size (it fell back to eager, or
    never pads), so it agrees with every size and leaves the others' buckets in effect; when
    the padding workers share no size, or none pads, the model has no buckets."""
    common: set[int] | None = None
    for buckets in reported:
        if buckets:
            common = set(buckets) if common is None else common & set(buckets)
    return tuple(sorted(common)) if common else NO_BUCKETS


class BucketTable:
    """The bucket arithmetic for every batch size up to ``max_items``, looked up in O(1) by a
    policy on each decision: ``rows[n]`` (``padded_rows``) and ``fits[n]``, the largest
    m <= n that needs no padding (0: none does)."""

    __slots__ = ("buckets", "fits", "rows")

    def __init__(self, buckets: Sequence[int], max_items: int) -> None:
        self.buckets = tuple(buckets)
        self.rows = [padded_rows(n, self.buckets) for n in range(max_items + 1)]
        self.fits = [0] * (max_items + 1)
        for n in range(1, max_items + 1):
            self.fits[n] = n if self.rows[n] == n else self.fits[n - 1]

    def rows_of(self, items: int) -> int:
        """``padded_rows`` for any size (an oversized KServe request is larger than the
        table)."""
        return self.rows[items] if 0 <= items < len(self.rows) else padded_rows(
            items, self.buckets)
