"""``ts.utils.util``: PredictionException, the label helpers custom handlers use, the
torch.compile backends TorchServe knows, and its ``deprecated`` decorator.

Label files are read by ``backend.handlers.labels`` (same layouts as TorchServe). Importing
this module does not import torch.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from backend.handlers.labels import LabelMap, label_of
from backend.handlers.labels import load_label_mapping as _load_label_mapping

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: HTML tags and character entities, which the text handlers strip.
CLEANUP_REGEX = re.compile(r"<.*?>|&([a-z0-9]+|#[0-9]{1,6}|#x[0-9a-f]{1,6});")


class PT2Backend(str, enum.Enum):
    """The ``torch.compile`` backends TorchServe accepts in model-config.yaml's ``pt2``."""

    EAGER = "eager"
    AOT_EAGER = "aot_eager"
    INDUCTOR = "inductor"
    NVFUSER = "nvfuser"
    AOT_NVFUSER = "aot_nvfuser"
    AOT_CUDAGRAPHS = "aot_cudagraphs"
    OFI = "ofi"
    FX2TRT = "fx2trt"
    ONNXRT = "onnxrt"
    IPEX = "ipex"
    TORCHXLA_TRACE_ONCE = "torchxla_trace_once"
    OPENVINO = "openvino"
    TENSORRT = "tensorrt"
    HPU_BACKEND = "hpu_backend"


def check_valid_pt2_backend(backend: str) -> bool:
    """Whether ``backend`` is one of PT2Backend's values (a warning is logged if not)."""
    if backend in {member.value for member in PT2Backend}:
        return True
    logger.warning("%s is not a supported backend", backend)
    return False


def deprecated(version: Any, replacement: str = "",
               klass: type[Warning] = PendingDeprecationWarning
               ) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorate a function so that each call warns (``klass``) that it goes away in
    ``version`` and names its ``replacement``."""

    def decorate(func: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(func)
        def warned(*args: Any, **kwargs: Any) -> T:
            warnings.warn(f"{func.__name__} is deprecated in {version} and moved to "
                          f"{replacement}", klass, stacklevel=2)
            return func(*args, **kwargs)

        return warned

    return decorate


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
