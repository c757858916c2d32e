"""Class index -> label names, read from the archive's ``index_to_name.json`` as TorchServe does.

Accepted layouts: ``{"0": "tench"}``, ``{"0": ["n01440764", "tench"]}`` (the label is the
list's last item) and the older ``{"object_type_names": ["background", "person", ...]}``.
"""

from __future__ import annotations

import json
from pathlib import Path

from backend.errors import ModelLoadError

INDEX_TO_NAME = "index_to_name.json"

LabelMap = dict[str, str]


def load_label_mapping(path: Path) -> LabelMap | None:
    """The index -> label map in ``path``, or None when the archive has no such file."""
    if not path.is_file():
        return None
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"{path.name} is not valid JSON: {exc}") from exc
    if not isinstance(mapping, dict):
        raise ModelLoadError(
            f'{path.name} must hold a JSON object such as {{"0": "tench"}} or '
            f'{{"0": ["n01440764", "tench"]}}, not a {type(mapping).__name__}'
        )
    names = mapping.get("object_type_names")
    if isinstance(names, list):
        return {str(index): str(name) for index, name in enumerate(names)}
    labels: LabelMap = {}
    for key, value in mapping.items():
        label = value[-1] if isinstance(value, list) and value else value
        if not isinstance(label, str):
            raise ModelLoadError(
                f"{path.name}: the label of class {key!r} must be a string or a list ending "
                f"in one, not {value!r}"
            )
        labels[str(key)] = label
    return labels


def label_of(mapping: LabelMap | None, index: int) -> str:
    """The label of class ``index``; its number as text when the map does not name it."""
    key = str(index)
    return mapping.get(key, key) if mapping is not None else key
