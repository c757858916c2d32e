"""A metric dimension (TorchServe's ``ts.metrics.dimension.Dimension``)."""

from __future__ import annotations

from typing import Any


class Dimension:
    """One ``name:value`` pair of a metric; its ``str`` is how TorchServe writes it."""

    def __init__(self, name: str, value: Any) -> None:
        self.name = name
        self.value = value

    def __str__(self) -> str:
        return f"{self.name}:{self.value}"

    def to_dict(self) -> dict[str, Any]:
        return {"Name": self.name, "Value": self.value}


def as_dimension(item: Any) -> Dimension:
    """A dimension from what a handler passed: a Dimension (ours or any object with ``name``
    and ``value``, such as a real TorchServe's), a (name, value) pair, or ``"name:value"``."""
    if isinstance(item, Dimension):
        return item
    if hasattr(item, "name") and hasattr(item, "value"):
        return Dimension(str(item.name), item.value)
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return Dimension(str(item[0]), item[1])
    name, sep, value = str(item).partition(":")
    return Dimension(name, value) if sep else Dimension("Dimension", name)
