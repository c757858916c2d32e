"""``ts.utils.util``: PredictionException and the label helpers custom handlers use.

Label files are read by ``backend.handlers.labels`` (same layouts as TorchServe). Not provided:
TorchServe's pt2 backend checks and its ``deprecated`` decorator. Importing this module does
not import torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from backend.handlers.labels import LabelMap, label_of
from backend.handlers.labels import load_label_mapping as _load_label_mapping


class PredictionException(Exception):
    """Fails every request of the batch with ``error_code`` as its HTTP status.

    Our service recognises it by name and ``error_code`` (``backend.errors``), so this class
    and a real TorchServe's behave the same: the response carries ``message`` with that status.
    """

    def __init__(self, message: str, error_code: int = 500) -> None:
        self.message = message
        self.error_code = error_code
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message} : {self.error_code}"


def list_classes_from_module(module: ModuleType, parent_class: type | None = None) -> list[type]:
    """The classes ``module`` itself defines (not those it imports), sorted by name;
    only subclasses of ``parent_class`` when one is given."""
    classes = sorted(
        (
            value
            for value in vars(module).values()
            if isinstance(value, type) and value.__module__ == module.__name__
        ),
        key=lambda cls: cls.__name__,
    )
    if parent_class is None:
        return classes
    return [cls for cls in classes if issubclass(cls, parent_class)]


def load_label_mapping(mapping_file_path: str | os.PathLike[str]) -> LabelMap | None:
    """The ``{class index: label}`` map of an ``index_to_name.json``; None without the file.

    Raises ``backend.errors.ModelLoadError`` for a file that is not such a map.
    """
    return _load_label_mapping(Path(mapping_file_path))


def map_class_to_label(
    probs: list[Any],
    mapping: Mapping[str, str] | None = None,
    lbl_classes: Sequence[Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """Per row, ``{label: probability}`` for the classes ``lbl_classes`` names (all classes
    ``0..n-1`` when None). A class the mapping does not name keeps its number as label."""
    if not isinstance(probs, list):
        raise TypeError("map_class_to_label needs probs as a list (call .tolist() first)")
    if mapping is not None and not isinstance(mapping, Mapping):
        raise TypeError(f"the label mapping must be a dict, not {type(mapping).__name__}")
    labels = dict(mapping) if mapping is not None else None
    if lbl_classes is None:
        lbl_classes = [range(len(row)) for row in probs]
    return [
        {label_of(labels, int(index)): prob for index, prob in zip(classes, row, strict=False)}
        for classes, row in zip(lbl_classes, probs, strict=False)
    ]


def get_yaml_config(yaml_file_path: str | os.PathLike[str]) -> dict[str, Any]:
    """A YAML file as a dict (an empty file gives {})."""
    import yaml  # only handlers that read YAML pay for it

    with open(yaml_file_path, encoding="utf-8") as file:
        config = yaml.safe_load(file)
    return config if isinstance(config, dict) else {}
