"""Load a ``.pt2`` program: a torch.export ExportedProgram or an AOTInductor package
(``model_archiver.pt2`` tells them apart), as an ``nn.Module`` the handlers call as they call
any model, with the range of its batch dimension (``BatchLimits``).

* **ExportedProgram** (``torch.export.load``, then ``ExportedProgram.module()``): on CUDA
  moved there with ``torch.export.passes.move_to_device_pass``. On the CPU its parameters and
  buffers are pointed back at the archive's pages (``backend.weights.script``: the archive
  keeps each weight as one uncompressed, aligned record), so the workers of a host share one
  copy, as for TorchScript; ``share_weights: false`` keeps a copy per worker; on CUDA each
  worker holds its own GPU copy (``cuda_ipc`` does not apply to programs).
* **AOTInductor** (``torch._inductor.aoti_load_package``): runs on the device kind it was
  compiled for (its ``AOTI_DEVICE_KEY``; another is refused at load). Its runtime copies the
  constants into a blob of its own, so each worker holds its own copy of the weights: not
  shared (torch 2.14). Its inputs are made contiguous first (it was compiled for those
  strides: a ``channels_last`` input would be misread).

The batch dimension: an ExportedProgram's first input's first dimension (a symbol with its
range in ``range_constraints``, or a fixed size); a list input's length, which export fixes
(a detector's images: a list of another length runs in chunks of that length, the last one
padded with its last image).
An AOTInductor package does not keep its input shapes where they can be read, so
``batchserve-export`` records the range in its metadata (``BATCH_METADATA``); a package
without it runs batches at their own size, and says so.
"""

from __future__ import annotations

import json
import logging
import math
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from backend.errors import ModelLoadError, describe
from backend.weights.script import map_onto_archive
from backend.weights.sharing import Sharing
from model_archiver.pt2 import Pt2Error, Pt2Kind, pt2_kind

__all__ = ["BATCH_METADATA", "BatchLimits", "Pt2Program", "is_pt2", "load_pt2"]

logger = logging.getLogger(__name__)

#: The AOTInductor metadata key ``batchserve-export`` writes: "low:high" ("low:" unbounded).
BATCH_METADATA = "batchserve.batch_dim"


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The batch sizes a program runs: ``low`` to ``high`` rows (``high`` None: no bound);
    ``dynamic`` False: exactly ``low`` (== ``high``)."""

    low: int = 1
    high: int | None = None
    dynamic: bool = True
    #: Why the range is not known ("" when it was read from the program).
    unknown: str = ""

    def text(self) -> str:
        if self.unknown:
            return f"batch dimension unknown ({self.unknown}): batches run at their own size"
        if not self.dynamic:
            one = " (one request at a time)" if self.low == 1 else ""
            return (f"no dynamic batch dimension: batches run in chunks of {self.low}{one}")
        return f"batch dimension {self.low}..{self.high if self.high is not None else 'any'}"

    def constrains(self, batch_size: int) -> bool:
        """Whether a batch of up to ``batch_size`` may not run as it comes."""
        return self.low > 1 or (self.high is not None and self.high < batch_size)

    @classmethod
    def parse(cls, text: str) -> BatchLimits:
        """``"low:high"`` (``"low:"``: no upper bound) as BATCH_METADATA holds it."""
        low, _, high = text.partition(":")
        try:
            lo, hi = int(low), (int(high) if high else None)
        except ValueError:
            raise ValueError(f"{BATCH_METADATA} must be low:high, got {text!r}") from None
        if lo < 1 or (hi is not None and hi < lo):
            raise ValueError(f"{BATCH_METADATA} must be low:high with 1 <= low <= high, "
                             f"got {text!r}")
        return cls(lo, hi, dynamic=lo != hi)

    def metadata(self) -> str:
        return f"{self.low}:{self.high if self.high is not None else ''}"


class Pt2Program(torch.nn.Module):
    """A loaded ``.pt2`` program, called as the model (its callable is kept out of the
    module tree: ``eval()``/``to()`` never reach it; ExportedProgram modules refuse
    ``eval()``)."""

    def __init__(self, run: Callable[..., Any], kind: Pt2Kind, limits: BatchLimits,
                 name: str, *, contiguous: bool = False) -> None:
        super().__init__()
        self.__dict__["_run"] = run
        self.kind = kind
        self.limits = limits
        self.name = name
        self._contiguous = contiguous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._contiguous:
            args = tuple(_contiguous(arg) for arg in args)
        run = self.__dict__["_run"]
        limits = self.limits
        if len(args) == 1 and not kwargs and isinstance(args[0], list) \
                and not limits.dynamic and len(args[0]) != limits.low:
            return _in_chunks(run, args[0], limits.low)
        return run(*args, **kwargs)

    def describe(self) -> str:
        """What describe and the log say of it."""
        return f"{self.name}: {self.kind.title}, {self.limits.text()}"


def _contiguous(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, list):
        return [_contiguous(item) for item in value]
    return value


def _in_chunks(run: Callable[..., Any], items: list[Any], size: int) -> list[Any]:
    """A list input (a detector's images) through a program exported for lists of ``size``:
    in chunks of ``size``, the last one padded with its last item; one output per item."""
    outputs: list[Any] = []
    for start in range(0, len(items), size):
        chunk = items[start:start + size]
        outputs.extend(list(run(chunk + [chunk[-1]] * (size - len(chunk))))[:len(chunk)])
    return outputs


def is_pt2(path: Path) -> bool:
    return path.suffix.lower() == ".pt2"


def load_pt2(path: Path, device: torch.device, sharing: Sharing = Sharing.MMAP) -> Pt2Program:
    """The program of ``path`` on ``device``. Raises ModelLoadError saying what is wrong."""
    try:
        kind = pt2_kind(path)
    except (Pt2Error, OSError) as exc:
        raise ModelLoadError(f"cannot load {path.name}: {exc}") from None
    try:
        if kind is Pt2Kind.AOTINDUCTOR:
            program = _load_aoti(path, device)
        else:
            program = _load_exported(path, device, sharing)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load {path.name} ({kind.title}): {describe(exc)}") \
            from exc
    logger.info("%s", program.describe())
    return program


def _load_exported(path: Path, device: torch.device, sharing: Sharing) -> Pt2Program:
    program = torch.export.load(str(path))
    limits = exported_limits(program)
    if device.type != "cpu":
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, device)
    module = program.module()
    if device.type == "cpu" and sharing is not Sharing.COPY:
        try:
            mapped, total = map_onto_archive(module, path)
        except Exception as exc:  # a layout this torch does not read: keep the copy
            logger.warning("cannot map %s's weights onto its pages (%s): this worker keeps "
                           "its own copy", path.name, describe(exc))
        else:
            logger.info("%s: %d of %d storages mapped from the archive", path.name, mapped,
                        total)
    return Pt2Program(module, Pt2Kind.EXPORTED_PROGRAM, limits, path.name)


def exported_limits(program: torch.export.ExportedProgram) -> BatchLimits:
    """The batch dimension of ``program``'s first input (see the module's docstring)."""
    args_spec = program.call_spec.in_spec
    first = _children(args_spec)[0] if args_spec is not None and _children(args_spec) else None
    arguments = _children(first) if first is not None else []
    if not arguments:
        return BatchLimits(unknown="the program takes no positional input")
    if arguments[0].type in (list, tuple):  # a list of images: its length is fixed
        count = len(_children(arguments[0]))
        return BatchLimits(count, count, dynamic=False)
    inputs = program.graph_signature.user_inputs
    if len(arguments) > 1:  # a text model's tokens and offsets, say: no one batch dimension
        return BatchLimits(unknown=f"the program takes {len(arguments)} inputs")
    nodes = {node.name: node for node in program.graph.nodes if node.op == "placeholder"}
    value = nodes[inputs[0]].meta.get("val") if inputs and inputs[0] in nodes else None
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return BatchLimits(unknown="its first input is not a tensor with rows")
    rows = value.shape[0]
    if isinstance(rows, int):
        return BatchLimits(rows, rows, dynamic=False)
    bounds = program.range_constraints.get(rows.node.expr)
    if bounds is None:
        return BatchLimits()
    low = max(1, int(bounds.lower))
    upper = float(bounds.upper)  # int_oo: inf
    return BatchLimits(low, None if math.isinf(upper) else int(upper), dynamic=True)


def _compiled_for(path: Path) -> str:
    """The device kind an AOTInductor package was compiled for, from its metadata files
    ("" when none says)."""
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            if "/data/aotinductor/" in name and name.endswith("metadata.json"):
                try:
                    key = json.loads(archive.read(name)).get("AOTI_DEVICE_KEY")
                except (ValueError, AttributeError):
                    continue
                if isinstance(key, str) and key:
                    return key
    return ""


def _check_device(path: Path, compiled_for: str, device: torch.device) -> None:
    if compiled_for and compiled_for != device.type:
        raise ModelLoadError(
            f"{path.name} was compiled by AOTInductor for {compiled_for} and this worker runs "
            f"on {device}: compile it for {device.type} (batchserve-export --device "
            f"{device.type}), or serve it where it was compiled for")


def _children(spec: Any) -> list[Any]:
    """A pytree spec's children (``children()`` since torch 2.10; ``children_specs`` before)."""
    children = getattr(spec, "children", None)
    return list(children() if callable(children) else spec.children_specs)


def _load_aoti(path: Path, device: torch.device) -> Pt2Program:
    import torch._inductor

    _check_device(path, _compiled_for(path), device)  # before torch tries
    runner = torch._inductor.aoti_load_package(
        str(path), device_index=device.index if device.index is not None else -1)
    metadata: dict[str, str] = dict(runner.get_metadata())
    _check_device(path, metadata.get("AOTI_DEVICE_KEY", ""), device)
    text = metadata.get(BATCH_METADATA)
    if text is None:
        limits = BatchLimits(unknown=f"the package has no {BATCH_METADATA} metadata; "
                                     f"batchserve-export records it")
    else:
        try:
            limits = BatchLimits.parse(text)
        except ValueError as exc:
            raise ModelLoadError(f"{path.name}: {exc}") from None
    return Pt2Program(runner, Pt2Kind.AOTINDUCTOR, limits, path.name, contiguous=True)
