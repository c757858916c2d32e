"""``ts.metrics.dimension``: a metric dimension, a name and a value."""

from __future__ import annotations

from typing import Any


class Dimension:
    """One ``name:value`` dimension of a custom metric (its ``str`` is what gets recorded)."""

    def __init__(self, name: str, value: Any) -> None:
        self.name = name
        self.value = value

    def __str__(self) -> str:
        return f"{self.name}:{self.value}"

    def to_dict(self) -> dict[str, Any]:
        return {"Name": self.name, "Value": self.value}
