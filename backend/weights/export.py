"""``batchserve-export`` (``python -m backend.weights.export``): a model leaving TorchScript
turned into both ``.pt2`` kinds the server loads, each checked against the model it came from.

The source is an eager model (``--model-file model.py``, its one ``nn.Module`` class built
with no arguments, and ``--serialized-file`` its state dict, as an archive's are loaded) or a
TorchScript file alone (``--serialized-file model.pt``: converted with torch's
``TS2EPConverter``, then exported again). It is exported with ``torch.export.export`` with a
dynamic batch dimension (``--min-batch``..``--max-batch``; ``--static-batch N`` for a model
that cannot have one) and written as

* ``<name>.export.pt2``: the ExportedProgram (``torch.export.save``), and
* ``<name>.aoti.pt2``: its AOTInductor package (``aoti_compile_and_package``), for the
  device of ``--device``, with the batch range in its metadata (``BATCH_METADATA``: the
  package keeps no readable input shapes of its own).

Each file is then loaded as the server loads it (``backend.weights.pt2``) and run on sample
batches (``--check-batches``; rows of ``--example FILE``, a tensor saved with ``torch.save``
whose first dimension is rows, cycled; else seeded random rows of ``--input-shape`` and
``--input-dtype``), and its outputs are compared with the source model's: the largest
absolute difference, and for ``[rows, classes]`` outputs whether each row's top-5 classes
are the same. Exit status 1 when a kind could not be made or differs by more than
``--tolerance``; ``--report FILE`` writes the whole report as JSON.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click
import torch
from torch.utils import _pytree as pytree

from backend.errors import describe
from backend.weights import load_eager, load_torchscript
from backend.weights.pt2 import BATCH_METADATA, BatchLimits, load_pt2
from backend.weights.sharing import Sharing
from model_archiver.pt2 import Pt2Kind

__all__ = ["Check", "Made", "compile_aoti", "export_program", "main", "make_both"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int64": torch.int64, "int32": torch.int32}
SUFFIXES = {Pt2Kind.EXPORTED_PROGRAM: ".export.pt2", Pt2Kind.AOTINDUCTOR: ".aoti.pt2"}
TOP_K = 5


@dataclass(frozen=True, slots=True)
class Check:
    """One sample batch through the program against the source model."""

    batch: int
    largest_difference: float
    #: Rows whose top-5 classes (of a [rows, classes] output) are the source's, of ``rows``.
    same_top5: int | None
    rows: int


@dataclass(slots=True)
class Made:
    """One ``.pt2`` file: where, how long it took, how it answers (``error``: why not)."""

    kind: str
    path: str
    seconds: float = 0.0
    program: str = ""
    checks: list[Check] = field(default_factory=list)
    error: str = ""

    def worst(self) -> float:
        return max((check.largest_difference for check in self.checks), default=0.0)


def load_source(model_file: Path | None, weights: Path | None,
                device: torch.device) -> torch.nn.Module:
    """The model to export, as an archive's would load (eager, or TorchScript)."""
    if model_file is not None:
        model = load_eager(model_file, weights, device, Sharing.COPY)
    elif weights is not None:
        model = load_torchscript(weights, device, Sharing.COPY)
    else:
        raise click.UsageError("give --model-file (with --serialized-file for its weights) "
                               "or a TorchScript --serialized-file")
    return model.eval()


def export_program(source: torch.nn.Module, example: torch.Tensor,
                   limits: BatchLimits) -> torch.export.ExportedProgram:
    """``source`` exported on ``example`` (its rows a size the limits allow; at least 2 for
    a dynamic dimension, which export would otherwise fix at 0 or 1)."""
    if isinstance(source, torch.jit.ScriptModule):
        from torch._export.converter import TS2EPConverter

        source = TS2EPConverter(source, (example,)).convert().module()
    dynamic = None
    if limits.dynamic:
        batch = torch.export.Dim("batch", min=limits.low, max=limits.high)
        dynamic = ({0: batch},)  # positional: a converted module renames its inputs
    with torch.no_grad():
        return torch.export.export(source, (example,), dynamic_shapes=dynamic, strict=False)


def compile_aoti(program: torch.export.ExportedProgram, path: Path,
                 limits: BatchLimits) -> None:
    """``program`` compiled by AOTInductor into the package ``path``, its batch range in
    the package's metadata."""
    import torch._inductor

    torch._inductor.aoti_compile_and_package(
        program, package_path=str(path),
        inductor_configs={"aot_inductor.metadata": {BATCH_METADATA: limits.metadata()}})


def sample_rows(example: Path | None, shape: tuple[int, ...], dtype: torch.dtype,
                count: int) -> torch.Tensor:
    """``count`` input rows: ``example``'s rows cycled, or seeded random ones."""
    if example is not None:
        rows = torch.load(example, map_location="cpu", weights_only=True)
        if not isinstance(rows, torch.Tensor) or rows.dim() == 0 or not len(rows):
            raise click.BadParameter(f"{example} must hold a tensor with rows first",
                                     param_hint="--example")
        return rows[torch.arange(count) % len(rows)]
    generator = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(count, *shape, generator=generator).to(dtype)
    return torch.randint(0, 100, (count, *shape), generator=generator, dtype=dtype)


def compare(program: torch.nn.Module, source: torch.nn.Module, inputs: torch.Tensor) -> Check:
    """The program's outputs on ``inputs`` against the source model's."""
    with torch.inference_mode():
        got = pytree.tree_leaves(program(inputs))
        want = pytree.tree_leaves(source(inputs))
    largest, same = 0.0, None
    for a, b in zip(got, want, strict=True):
        if not isinstance(b, torch.Tensor) or not isinstance(a, torch.Tensor):
            continue
        if a.shape != b.shape:
            return Check(len(inputs), float("inf"), None, len(inputs))
        if b.numel():
            largest = max(largest, float((a.double() - b.double()).abs().max()))
        if same is None and b.dim() == 2 and b.is_floating_point():
            k = min(TOP_K, b.shape[1])
            tops = zip(a.topk(k, dim=1).indices.tolist(), b.topk(k, dim=1).indices.tolist(),
                       strict=True)
            same = sum(x == y for x, y in tops)
    return Check(len(inputs), largest, same, len(inputs))


def make_both(source: torch.nn.Module, rows: torch.Tensor, limits: BatchLimits, out: Path,
              name: str, kinds: tuple[Pt2Kind, ...], check_batches: tuple[int, ...],
              device: torch.device) -> list[Made]:
    """Export ``source``, write the ``kinds`` asked for, check each (see the docstring)."""
    size = max(2, limits.low) if limits.dynamic else limits.low
    example = rows[:min(size, limits.high) if limits.high is not None else size].to(device)
    made: list[Made] = []
    try:
        started = time.perf_counter()
        program = export_program(source, example, limits)
        export_s = time.perf_counter() - started
    except Exception as exc:
        return [Made(kind.value, "", error=f"torch.export failed: {describe(exc)}")
                for kind in kinds]
    for kind in kinds:
        path = out / f"{name}{SUFFIXES[kind]}"
        record = Made(kind.value, str(path))
        made.append(record)
        try:
            started = time.perf_counter()
            if kind is Pt2Kind.AOTINDUCTOR:
                compile_aoti(program, path, limits)
            else:
                torch.export.save(program, str(path))
            record.seconds = round(export_s + time.perf_counter() - started, 2)
            loaded = load_pt2(path, device, Sharing.COPY)
            record.program = loaded.describe()
            for batch in check_batches:
                record.checks.append(compare(loaded, source, rows[:batch].to(device)))
        except Exception as exc:
            record.error = describe(exc)
    return made


def _batches(text: str, limits: BatchLimits) -> tuple[int, ...]:
    sizes = {int(part) for part in text.split(",") if part.strip()}
    if not limits.dynamic:
        return (limits.low,)
    top = limits.high or max(sizes | {limits.low})
    return tuple(sorted({min(max(size, limits.low), top) for size in sizes}))


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="model.py defining one nn.Module class, built with no arguments.")
@click.option("--serialized-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Its state dict; alone: a TorchScript file.")
@click.option("--model-name", required=True, help="Names the files: NAME.export.pt2, "
              "NAME.aoti.pt2.")
@click.option("--export-path", type=click.Path(file_okay=False, path_type=Path), default=".",
              show_default=True)
@click.option("--input-shape", default="3,224,224", show_default=True,
              help="One input row's shape (the batch dimension left out).")
@click.option("--input-dtype", type=click.Choice(sorted(DTYPES)), default="float32",
              show_default=True)
@click.option("--example", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Sample input rows (torch.save of a tensor, rows first) instead of "
                   "random ones.")
@click.option("--min-batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--static-batch", type=click.IntRange(min=1),
              help="No dynamic batch dimension: the program takes exactly this many rows.")
@click.option("--kinds", default="exported_program,aotinductor", show_default=True,
              help="Which .pt2 kinds to write.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu",
              show_default=True, help="Where the AOTInductor package will run.")
@click.option("--check-batches", default="1,3,8", show_default=True,
              help="Sample batch sizes to compare (fitted within the batch dimension).")
@click.option("--tolerance", type=float, default=1e-3, show_default=True)
@click.option("--report", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the report as JSON.")
def main(model_file: Path | None, serialized_file: Path | None, model_name: str,
         export_path: Path, input_shape: str, input_dtype: str, example: Path | None,
         min_batch: int, max_batch: int, static_batch: int | None, kinds: str, device: str,
         check_batches: str, tolerance: float, report: Path | None) -> None:
    """Export a model (model.py and its weights, or a TorchScript file) as an ExportedProgram
    and an AOTInductor package with a dynamic batch dimension, and report how their answers
    differ from the model's on sample inputs."""
    try:
        wanted = tuple(Pt2Kind(part.strip()) for part in kinds.split(",") if part.strip())
        shape = tuple(int(part) for part in input_shape.split(",") if part.strip())
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if max_batch < min_batch:
        raise click.BadParameter(f"--max-batch {max_batch} is below --min-batch {min_batch}")
    limits = (BatchLimits(static_batch, static_batch, dynamic=False) if static_batch
              else BatchLimits(min_batch, max_batch))
    sizes = _batches(check_batches, limits)
    target = torch.device(device)
    export_path.mkdir(parents=True, exist_ok=True)
    source = load_source(model_file, serialized_file, target)
    rows = sample_rows(example, shape, DTYPES[input_dtype], max((*sizes, 2, limits.low)))
    made = make_both(source, rows, limits, export_path, model_name, wanted, sizes, target)
    failed = False
    for record in made:
        failed |= bool(record.error) or record.worst() > tolerance
        click.echo(_summary(record, tolerance))
    if report is not None:
        report.write_text(json.dumps([asdict(record) for record in made], indent=2) + "\n")
    sys.exit(1 if failed else 0)


def _summary(record: Made, tolerance: float) -> str:
    if record.error:
        return f"{record.kind}: FAILED: {record.error}"
    lines = [f"{record.kind}: {record.path} in {record.seconds:.1f} s ({record.program})"]
    for check in record.checks:
        top = (f", same top-5 in {check.same_top5}/{check.rows} rows"
               if check.same_top5 is not None else "")
        verdict = "ok" if check.largest_difference <= tolerance else "DIFFERS"
        lines.append(f"  batch {check.batch}: largest difference "
                     f"{check.largest_difference:.3g}{top} ({verdict}, tolerance {tolerance:g})")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - ``python -m backend.weights.export``
    main()
