"""Where reported metric values wait for the worker to send them.

TorchServe's worker logs each value as a ``[METRICS]`` line that its frontend parses; ours
appends it here, and the worker drains the sink into each batch's ``PredictResult`` (and into
``Loaded`` for what ``initialize`` reported), so the values reach the frontend with the
answers, in order, with nothing parsed.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

from protos import worker_pb2

logger = logging.getLogger(__name__)

#: (name, unit, type, value, dimension names, dimension values, request id)
_Value = tuple[str, str, str, float, tuple[str, ...], tuple[str, ...], str]


class MetricSink:
    """Values reported and not yet sent, oldest first.

    Bounded: a handler that reports from a thread of its own while no batch runs cannot grow
    the worker's memory; past ``MAX_VALUES`` the oldest are dropped (logged once).
    """

    MAX_VALUES = 10_000

    def __init__(self) -> None:
        self._values: collections.deque[_Value] = collections.deque(maxlen=self.MAX_VALUES)
        self._overflowed = False

    def emit(self, name: str, unit: str, type_name: str, value: float,
             dimension_names: Sequence[str], dimension_values: Sequence[str],
             request_id: str = "") -> None:
        """One value of a metric (the frontend adds it up, sets it or observes it)."""
        if len(self._values) == self.MAX_VALUES and not self._overflowed:
            self._overflowed = True
            logger.warning("more than %d metric values reported before the worker could send "
                           "them; the oldest are dropped", self.MAX_VALUES)
        self._values.append((_utf8(name), _utf8(unit), type_name, value,
                             tuple(map(_utf8, dimension_names)),
                             tuple(map(_utf8, dimension_values)), _utf8(request_id)))

    def __len__(self) -> int:
        return len(self._values)

    def drain(self) -> list[worker_pb2.Metric]:
        """The values reported so far, as messages, and forget them."""
        drained = []
        values = self._values
        while values:  # popleft, not a copy and clear: another thread may be reporting
            name, unit, type_name, value, names, dims, request_id = values.popleft()
            drained.append(worker_pb2.Metric(
                name=name, unit=unit, type=type_name, value=value, dimension_names=names,
                dimension_values=dims, request_id=request_id))
        return drained


def _utf8(value: object) -> str:
    """``value`` as a protobuf string field takes it: a lone surrogate (a client's bytes decoded
    with ``surrogateescape``, say) as ``?``; it would fail the batch's whole result frame."""
    text = value if isinstance(value, str) else str(value)
    if text.isascii():
        return text
    return text.encode("utf-8", "replace").decode("utf-8")


#: Values of metrics made outside a metrics cache (a handler's own ``CachingMetric`` or
#: legacy ``Metric``): the worker drains it with the cache's.
DEFAULT_SINK = MetricSink()
