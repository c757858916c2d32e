"""Batch buckets: the few batch sizes a model runs at, and how a batch of any size gets there.

A batch of n runs in the smallest bucket that holds it: its rows padded (the last row
repeated) up to the bucket's size, the model run, the outputs sliced back to n rows. A batch
larger than the largest bucket is split into chunks of the largest bucket, the last chunk in
the smallest bucket that holds it, and their outputs joined. Outputs may be a tensor or any
nesting of tuples, lists and dicts of tensors whose first dimension is the batch's rows (a
segmenter's ``{"out": logits}``); ``row_problem`` says why one cannot be sliced.

model-config.yaml's ``handler`` section: ``batch_buckets: [1, 2, 4, 8]`` (any positive sizes,
at most ``MAX_BUCKETS``; ``[]``: none) and ``cuda_graphs: true | false``
(``backend.handlers.graphs``). Pure logic: it runs the same on the CPU and on CUDA.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from backend.errors import ModelLoadError

#: At most this many buckets (each is warmed up, and on CUDA captured, at load).
MAX_BUCKETS = 64
#: The default buckets stop here: a larger batch runs in chunks of this many rows.
MAX_DEFAULT_BUCKET = 4096


def default_buckets(batch_size: int) -> tuple[int, ...]:
    """The powers of two below ``batch_size``, then ``batch_size``: 1, 2, 4, 8 for 8; 1, 2,
    4, 6 for 6. A batch pads at most to twice its size less one, and batch_size 128 has 8
    buckets (cuDNN's autotuning and the graphs' capture run once each). Above
    ``MAX_DEFAULT_BUCKET`` (batch_size may be as large as int32): chunks of that size."""
    top = max(1, min(batch_size, MAX_DEFAULT_BUCKET))
    sizes: list[int] = []
    size = 1
    while size < top:
        sizes.append(size)
        size *= 2
    sizes.append(top)
    return tuple(sizes)


def fit_buckets(buckets: Sequence[int], low: int, high: int | None) -> tuple[int, ...]:
    """``buckets`` moved within ``low``..``high`` (a program's batch dimension: each bucket
    raised to ``low``, lowered to ``high``), ascending, each once: (1, 2, 4, 8) within 2..4
    is (2, 4); within 1..1 (a program of one row) it is (1,)."""
    top = high if high is not None else max(max(buckets), low)
    return tuple(sorted({min(max(bucket, low), top) for bucket in buckets}))


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds a batch of ``size`` (``buckets`` ascending; ``size`` at
    most the largest)."""
    for bucket in buckets:
        if bucket >= size:
            return bucket
    raise ValueError(f"a batch of {size} is larger than the largest bucket, {buckets[-1]}")


def plan_chunks(size: int, buckets: Sequence[int]) -> list[tuple[int, int, int]]:
    """How a batch of ``size`` runs: ``(start, stop, bucket)`` per chunk of its rows, in
    order; one chunk unless it is larger than the largest bucket."""
    largest = buckets[-1]
    chunks: list[tuple[int, int, int]] = []
    for start in range(0, size, largest):
        stop = min(start + largest, size)
        chunks.append((start, stop, bucket_for(stop - start, buckets)))
    return chunks


def buckets_run(sizes: Iterable[int], buckets: Sequence[int]) -> list[int]:
    """The buckets batches of these sizes run in, ascending (what a warm-up of them runs)."""
    largest = buckets[-1]
    run: set[int] = set()
    for size in sizes:
        if size > largest:
            run.add(largest)
        if size % largest or size <= largest:
            run.add(bucket_for(size % largest or largest, buckets))
    return sorted(run)


def pad_rows(inputs: torch.Tensor, rows: int) -> torch.Tensor:
    """``inputs`` with its last row repeated up to ``rows`` rows (itself when it has them):
    a real input, so padding cannot make a model see values it never sees otherwise."""
    missing = rows - inputs.shape[0]
    if missing <= 0:
        return inputs
    return torch.cat([inputs, inputs[-1:].expand(missing, *inputs.shape[1:])])


def row_problem(outputs: Any, rows: int) -> str | None:
    """Why ``outputs`` (of a batch of ``rows`` rows) cannot be sliced back to fewer rows, or
    None when every tensor in it has the rows first (None leaves are kept as they are)."""
    leaves, _ = pytree.tree_flatten(outputs)
    for leaf in leaves:
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor):
            return (f"the model's output holds a {type(leaf).__name__}, not only tensors: it "
                    f"cannot be sliced back to the batch's rows")
        if leaf.dim() == 0 or leaf.shape[0] != rows:
            return (f"the model's output holds a tensor of shape {tuple(leaf.shape)} for a "
                    f"batch of {rows}: its first dimension is not the batch's rows")
    return None


def take_rows(outputs: Any, count: int, *, copy: bool) -> Any:
    """The first ``count`` rows of every tensor in ``outputs`` (copied when ``copy``: out of
    a static buffer the next replay overwrites)."""
    leaves, spec = pytree.tree_flatten(outputs)
    taken = [leaf if leaf is None else (leaf[:count].clone() if copy else leaf[:count])
             for leaf in leaves]
    return pytree.tree_unflatten(taken, spec)


def join_rows(parts: Sequence[Any]) -> Any:
    """The outputs of a batch's chunks as the batch's one output (rows joined, in order)."""
    if len(parts) == 1:
        return parts[0]
    flattened = [pytree.tree_flatten(part) for part in parts]
    spec = flattened[0][1]
    joined = [leaves[0] if leaves[0] is None else torch.cat(leaves)
              for leaves in zip(*(leaves for leaves, _ in flattened), strict=True)]
    return pytree.tree_unflatten(joined, spec)


def read_buckets(value: Any) -> tuple[int, ...] | None:
    """model-config.yaml's ``handler.batch_buckets``: the sizes, ascending, without
    repeats (None: not set). Raises ModelLoadError naming what is wrong."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
            isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in value):
        raise ModelLoadError("model-config.yaml: handler.batch_buckets must be a list of "
                             f"positive batch sizes, got {value!r}")
    buckets = tuple(sorted(set(value)))
    if len(buckets) > MAX_BUCKETS:
        raise ModelLoadError(f"model-config.yaml: handler.batch_buckets may hold at most "
                             f"{MAX_BUCKETS} sizes, got {len(buckets)}")
    return buckets


def read_cuda_graphs(value: Any) -> bool | None:
    """model-config.yaml's ``handler.cuda_graphs`` (None: not set, the handler's default)."""
    if value is None or isinstance(value, bool):
        return value
    raise ModelLoadError(f"model-config.yaml: handler.cuda_graphs must be true or false, "
                         f"got {value!r}")
