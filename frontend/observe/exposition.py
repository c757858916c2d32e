r"""Prometheus text (format 0.0.4) exactly as TorchServe's frontend writes it.

TorchServe's Java Prometheus client (simpleclient 0.9) ends every label list with a comma,
``Requests2XX{Level="Host",Hostname="h",} 1.0``, writes values as Java prints doubles
(``1.0``, ``4315280.097``, ``1.2345678E7``), a counter's samples under the family's own name (no
``_total``), and a histogram's ``_bucket`` lines then ``_count`` then ``_sum``. Dashboards and
TorchServe's own tests match those lines, so every family here, ours included, is written so;
``prometheus_client.parser`` reads it all.
"""

from __future__ import annotations

import decimal
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: The page's content type (TorchServe's: text format 0.0.4).
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
#: (sample name, label names, label values, value)
Sample = tuple[str, Sequence[str], Sequence[str], float]


@dataclass(slots=True)
class Family:
    """One metric family: its HELP, TYPE and samples."""

    name: str
    help: str
    type: str  # "counter", "gauge", "histogram" or "untyped"
    samples: list[Sample] = field(default_factory=list)

    def add(self, labels: Sequence[str], values: Sequence[str], value: float,
            suffix: str = "") -> None:
        self.samples.append((self.name + suffix, labels, values, value))

    def names(self) -> tuple[str, ...]:
        """The names a ``?name[]=`` filter finds it by (TorchServe's client: the family's
        and its samples')."""
        if self.type == "histogram":
            return (self.name, f"{self.name}_bucket", f"{self.name}_count", f"{self.name}_sum")
        return (self.name,)


def java_double(value: float) -> str:
    """``value`` as Java's ``Double.toString`` writes it (simpleclient's
    ``doubleToGoString``): ``+Inf``/``-Inf``/``NaN``; plain decimals from 0.001 up to 1e7
    (``17.0``, ``0.25``); else ``1.0E7``, ``2.5E-4``."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    magnitude = abs(value)
    if magnitude == 0.0 or 1e-3 <= magnitude < 1e7:
        return repr(float(value))  # Python's shortest repr is plain in this range
    digits_tuple, exponent = decimal.Decimal(repr(magnitude)).normalize().as_tuple()[1:]
    assert isinstance(exponent, int)
    digits = "".join(map(str, digits_tuple))
    power = len(digits) - 1 + exponent
    mantissa = f"{digits[0]}.{digits[1:] or '0'}"
    return f"{'-' if value < 0 else ''}{mantissa}E{power}"


def escape_label(value: str) -> str:
    """A label value as the page writes it between its quotes."""
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def render(families: Iterable[Family]) -> bytes:
    """The text of ``families``, in their order."""
    out: list[str] = []
    append = out.append
    for family in families:
        append(f"# HELP {family.name} {_escape_help(family.help)}\n"
               f"# TYPE {family.name} {family.type}\n")
        for name, labels, values, value in family.samples:
            if labels:
                pairs = "".join(f'{label}="{escape_label(text)}",'
                                for label, text in zip(labels, values, strict=True))
                append(f"{name}{{{pairs}}} {java_double(value)}\n")
            else:
                append(f"{name} {java_double(value)}\n")
    # A lone surrogate (no valid UTF-8) in a name or value becomes "?": the page always encodes.
    return "".join(out).encode("utf-8", "replace")
