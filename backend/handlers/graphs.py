"""The graph runner: a model's batches run in padded buckets, on CUDA each replaying a CUDA
graph captured once per bucket (docs/cuda_graphs.md).

``BatchRunner`` does what is the same on every device: pick the bucket, pad, run, slice the
outputs back, split a batch larger than the largest bucket into chunks, fall back to eager,
and report it all (``Execution``, sent in ``Loaded``). How a bucket is run is its strategy's:
``EagerReplay`` runs the model on the padded batch (mode "padded": on the CPU, or graphs
turned off), ``CUDAGraphCapture`` captures the model's forward at the bucket's size, with a
static input and static outputs in one private memory pool shared by every bucket's graph,
and replays it (mode "cuda_graphs").

A bucket is prepared at its first batch (the warm-up's, at load): its input's per-row shape,
dtype and device are learned from that batch. A graph is checked once, at capture: it is
replayed on a probe input other than the one captured, and its outputs must match the model
run eagerly on the same probe (``VERIFY_TOLERANCE``), which catches a graph that baked in its
capture's input or took a branch the probe would not. Where the model cannot be captured (it
syncs with the CPU, as ``.item()`` or ``if tensor:`` do; an op capture refuses; a capture
error; a failed check) while it runs eagerly on the same batch, the runner falls back for good
to the padded eager path, the reason logged once and reported; where the model fails eagerly
too, the batch fails as it would have and nothing changes. An input that is not one tensor
with the batch's rows first (a detector's list of images, a text model's tokens and offsets),
or an output whose tensors do not have them, turns the runner off: eager, unpadded, with the
reason. Replays are serialised (one lock per runner): static buffers are shared by every batch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from backend.errors import describe
from backend.handlers.buckets import (
    default_buckets,
    fit_buckets,
    join_rows,
    pad_rows,
    plan_chunks,
    row_problem,
    take_rows,
)
from backend.weights.pt2 import BatchLimits
from protos import worker_pb2

logger = logging.getLogger(__name__)

MODE_CUDA_GRAPHS = "cuda_graphs"
MODE_PADDED = "padded"
MODE_EAGER = "eager"
#: Eager runs of a bucket's input on a side stream before its capture (PyTorch's CUDA graphs
#: notes: lazy initialisation, cuDNN's autotuning, TorchScript's profiling runs, compilation).
CAPTURE_WARMUP_RUNS = 3
#: A graph's outputs may differ from the eager model's on the same probe by this much,
#: relative to the largest eager value (float32; half types get ten times as much).
VERIFY_TOLERANCE = 1e-3

Forward = Callable[[torch.Tensor], Any]


class Program(Protocol):
    """One bucket's run: a batch of at most the bucket's rows in, the bucket's outputs out."""

    def __call__(self, inputs: torch.Tensor) -> Any: ...


class CaptureStrategy(Protocol):
    """How a runner runs a bucket (what differs between the CPU and CUDA)."""

    #: The Execution mode it gives: "padded" or "cuda_graphs".
    mode: str
    #: Its outputs are buffers the next run overwrites (copied out before being returned).
    copies_outputs: bool
    #: Its programs are checked against the model run eagerly (``BatchRunner._check``).
    verifies: bool

    def prepare(self, forward: Forward, example: torch.Tensor) -> Program:
        """The program of the bucket of ``example``'s rows. Raises when it cannot be made."""
        ...

    def pool_bytes(self) -> int:
        """Device memory held by what it prepared."""
        ...

    def release(self) -> None:
        """Forget every program it prepared, and their memory."""
        ...


class EagerReplay:
    """A bucket runs the model eagerly on the batch padded to the bucket's size."""

    mode = MODE_PADDED
    copies_outputs = False
    verifies = False

    def prepare(self, forward: Forward, example: torch.Tensor) -> Program:
        rows = example.shape[0]
        return lambda inputs: forward(pad_rows(inputs, rows))

    def pool_bytes(self) -> int:
        return 0

    def release(self) -> None:
        pass


@dataclass(slots=True)
class _GraphProgram:
    graph: torch.cuda.CUDAGraph
    static_input: torch.Tensor
    static_outputs: Any

    def __call__(self, inputs: torch.Tensor) -> Any:
        count = inputs.shape[0]
        static = self.static_input
        with torch.inference_mode():  # the static buffers are inference tensors
            static[:count].copy_(inputs)
            if count < static.shape[0]:  # the padding rows: the last row repeated
                static[count:].copy_(inputs[-1:].expand(static.shape[0] - count,
                                                        *inputs.shape[1:]))
            self.graph.replay()
        return self.static_outputs


class CUDAGraphCapture:
    """Each bucket's forward captured as a CUDA graph (``torch.cuda.graph``), in one private
    memory pool (``torch.cuda.graph_pool_handle``) shared by the buckets' graphs: safe
    because a runner never replays two at once, and a graph's static outputs stay allocated,
    so a later capture never reuses them."""

    mode = MODE_CUDA_GRAPHS
    copies_outputs = True
    verifies = True

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._pool: Any = None
        self._programs: list[_GraphProgram] = []
        self._bytes = 0

    def prepare(self, forward: Forward, example: torch.Tensor) -> Program:
        with torch.inference_mode():  # graphs of inference only: autograd records nothing
            return self._capture(forward, example)

    def _capture(self, forward: Forward, example: torch.Tensor) -> _GraphProgram:
        device = self._device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        static_input = example.clone()  # the example's memory format (channels-last) kept
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # unannotated
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP_RUNS):
                forward(static_input)
        current.wait_stream(side)
        # What the pool takes: the device memory reserved by the capture (the freed blocks
        # of the warm-up runs given back first, so that they are not counted).
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's reader thread may decode the next batch on the GPU
        # meanwhile, which a global capture would forbid (and be invalidated by).
        with _uncached_autocast(), torch.cuda.graph(graph, pool=self._pool,
                                                    capture_error_mode="thread_local"):
            static_outputs = forward(static_input)
        torch.cuda.synchronize(device)
        self._bytes += (max(0, torch.cuda.memory_reserved(device) - before)
                        + static_input.untyped_storage().nbytes())
        program = _GraphProgram(graph, static_input, static_outputs)
        self._programs.append(program)
        return program

    def pool_bytes(self) -> int:
        return self._bytes

    def release(self) -> None:
        if self._pool is None:  # nothing captured: CUDA left untouched
            return
        for program in self._programs:
            program.graph.reset()
        self._programs.clear()
        self._pool = None
        self._bytes = 0
        with contextlib.suppress(Exception):  # a failed capture may leave an error behind
            torch.cuda.synchronize(self._device)
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _uncached_autocast() -> Iterator[None]:
    """Autocast as it is, but without its cache of cast weights, which a captured graph must
    not use (PyTorch's CUDA graphs notes: the cache is freed when autocast exits)."""
    if not torch.is_autocast_enabled("cuda"):
        yield
        return
    with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
        yield


class BatchRunner:
    """Runs a model's batches in buckets (see the module's docstring)."""

    def __init__(self, forward: Forward, buckets: tuple[int, ...], strategy: CaptureStrategy,
                 *, who: str = "the model", reason: str = "") -> None:
        if not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"buckets must be positive sizes, ascending, got {buckets}")
        self.buckets = buckets
        self._forward = forward
        self._strategy = strategy
        self._who = who
        self._programs: dict[int, Program] = {}
        #: Per-row shape, dtype and device of the inputs the programs were prepared for.
        self._signature: tuple[Any, ...] | None = None
        self._warned_signature = False
        #: Why graphs (or buckets) are not used ("" while they are, or were never asked for).
        self.fallback_reason = reason
        #: True once the runner is off: batches run eagerly at their own size.
        self.is_off = False
        self._lock = threading.Lock()

    @property
    def mode(self) -> str:
        return MODE_EAGER if self.is_off else self._strategy.mode

    def close(self) -> None:
        """Forget every prepared program (a captured graph's memory given back)."""
        with self._lock:
            self._strategy.release()
            self._programs.clear()

    def execution(self) -> worker_pb2.Execution:
        """What the worker reports in ``Loaded``."""
        if self.is_off:
            return worker_pb2.Execution(mode=MODE_EAGER, fallback_reason=self.fallback_reason)
        return worker_pb2.Execution(batch_buckets=self.buckets, mode=self._strategy.mode,
                                    fallback_reason=self.fallback_reason,
                                    graph_pool_bytes=self._strategy.pool_bytes())

    def __call__(self, inputs: Any) -> Any:
        """The model's outputs for ``inputs`` (a batch), as the model would give them."""
        if self.is_off:
            return self._forward(inputs)
        if not isinstance(inputs, torch.Tensor) or inputs.dim() == 0:
            self._turn_off(f"the model's input is a {_kind(inputs)}, not one tensor with the "
                           f"batch's rows first: nothing to pad or capture")
            return self._forward(inputs)
        if inputs.shape[0] == 0:
            return self._forward(inputs)
        with self._lock:
            chunks = plan_chunks(inputs.shape[0], self.buckets)
            parts = []
            for start, stop, bucket in chunks:
                parts.append(self._run(inputs[start:stop] if len(chunks) > 1 else inputs,
                                       bucket))
                if self.is_off:  # its outputs cannot be sliced: the batch as it is, eagerly
                    return parts[0] if len(chunks) == 1 else self._forward(inputs)
            return join_rows(parts)

    def _run(self, inputs: torch.Tensor, bucket: int) -> Any:
        """One chunk's outputs, sliced back to its rows."""
        program = self._programs.get(bucket)
        if program is None:
            return self._prepare(inputs, bucket)
        if not self._fits(inputs):
            return self._eager(inputs, bucket)
        return take_rows(program(inputs), inputs.shape[0], copy=self._strategy.copies_outputs)

    def _eager(self, inputs: torch.Tensor, bucket: int) -> Any:
        """The model run eagerly on the chunk padded to ``bucket``, sliced back (the chunk
        unpadded, and the runner off, when its outputs cannot be sliced)."""
        outputs = self._forward(pad_rows(inputs, bucket))
        problem = row_problem(outputs, bucket)
        if problem is None:
            return take_rows(outputs, inputs.shape[0], copy=False)
        self._turn_off(problem)
        return self._forward(inputs)

    def _prepare(self, inputs: torch.Tensor, bucket: int) -> Any:
        """Prepare ``bucket``'s program on this chunk (padded), and the chunk's outputs."""
        if self._signature is not None and not self._fits(inputs):
            return self._eager(inputs, bucket)
        padded = pad_rows(inputs, bucket)
        try:
            program = self._strategy.prepare(self._forward, padded)
            outputs = program(padded)
            problem = row_problem(outputs, bucket)
            result = None if problem else take_rows(outputs, inputs.shape[0],
                                                    copy=self._strategy.copies_outputs)
            wrong = (self._check(program, padded, bucket)
                     if problem is None and self._strategy.verifies else None)
        except Exception as exc:
            # The model eagerly on the same chunk: an error there is the batch's (raised,
            # nothing changes), else the preparation's, and graphs are given up.
            result = self._eager(inputs, bucket)
            if not self.is_off:
                self._fall_back(f"bucket {bucket} could not be prepared: {describe(exc)}")
            return result
        if problem is not None:
            self._turn_off(problem)
            return self._forward(inputs)
        self._signature = _signature(inputs)
        if wrong is not None:
            self._fall_back(wrong)
        else:
            self._programs[bucket] = program
        return result

    def _check(self, program: Program, padded: torch.Tensor, bucket: int) -> str | None:
        """Why ``program`` cannot stand for the model (None: it can): replayed on a probe
        input, its outputs must be the model's on the probe."""
        probe = _probe(padded)
        replayed = take_rows(program(probe), bucket, copy=True)
        difference = _difference(replayed, self._forward(probe))
        if difference is None:
            return None
        return (f"bucket {bucket}'s graph does not give the model's outputs: {difference} "
                f"(replayed on an input other than the captured one, against the model run "
                f"eagerly on it)")

    def _fits(self, inputs: torch.Tensor) -> bool:
        """Whether ``inputs`` have the per-row shape, dtype and device the programs were
        prepared for; a batch that has not runs eagerly at its bucket's size (said once)."""
        if _signature(inputs) == self._signature:
            return True
        if not self._warned_signature:
            self._warned_signature = True
            logger.warning("%s: a batch of %s %s on %s does not fit the buckets prepared for "
                           "rows of %s; such batches run eagerly", self._who,
                           tuple(inputs.shape), inputs.dtype, inputs.device, self._signature)
        return False

    def _fall_back(self, reason: str) -> None:
        """Graphs no more: every bucket runs eagerly, padded (said once)."""
        with contextlib.suppress(Exception):
            self._strategy.release()
        self._programs.clear()
        self.fallback_reason = reason
        self._strategy = EagerReplay()
        logger.warning("%s: CUDA graphs are not used, batches run eagerly in their buckets: %s",
                       self._who, reason)

    def _turn_off(self, reason: str) -> None:
        """No buckets: every batch runs eagerly, at its own size (said once)."""
        with contextlib.suppress(Exception):
            self._strategy.release()
        self._programs.clear()
        self.is_off = True
        self.fallback_reason = reason
        logger.warning("%s: batches run eagerly at their own size: %s", self._who, reason)


def _kind(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    if isinstance(value, torch.Tensor):
        return "tensor of no dimension"
    return type(value).__name__


def _signature(inputs: torch.Tensor) -> tuple[Any, ...]:
    return tuple(inputs.shape[1:]), inputs.dtype, inputs.device


def _probe(example: torch.Tensor) -> torch.Tensor:
    """An input other than ``example``, of its kind: for floating point, noise of its mean
    and spread; otherwise each row's values moved one place along the last dimension (token
    ids stay valid ids)."""
    if example.is_floating_point():
        spread = example.float().std().clamp_min(1e-3) if example.numel() > 1 else 1.0
        noise = torch.randn_like(example, dtype=torch.float32)  # its memory format kept
        return (noise * spread + example.float().mean()).to(example.dtype)
    return example.roll(1, dims=-1) if example.dim() > 1 else example.flip(0)


def _difference(replayed: Any, eager: Any) -> str | None:
    """How the graph's outputs differ from the eager ones beyond tolerance (None: they
    agree)."""
    got, got_spec = pytree.tree_flatten(replayed)
    want, want_spec = pytree.tree_flatten(eager)
    if got_spec != want_spec:
        return "its outputs are not nested as the model's are"
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            continue
        if a.shape != b.shape:
            return f"output {index} has shape {tuple(a.shape)}, not {tuple(b.shape)}"
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return f"output {index} differs"
            continue
        tolerance = VERIFY_TOLERANCE * (1 if b.dtype in (torch.float32, torch.float64) else 10)
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        largest = float((a.float() - b.float()).abs().max()) if b.numel() else 0.0
        if not largest <= tolerance * scale:  # NaN too
            return f"output {index} differs by {largest:.3g} (tolerance {tolerance * scale:.3g})"
    return None


# -- which handlers get a runner ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GraphSettings:
    """What decides a handler's runner: the device, the model config and the handler."""

    device: torch.device
    batch_size: int
    #: model-config.yaml's ``cuda_graphs`` and ``batch_buckets`` (None: not set).
    cuda_graphs: bool | None = None
    batch_buckets: tuple[int, ...] | None = None
    #: The handler's default on CUDA: graphs (built-in vision handlers, the ts BaseHandler).
    graphs_by_default: bool = False
    #: Why the handler's batches can be neither padded nor captured ("" when they can:
    #: text_classifier's token sequences vary in length).
    unfit: str = ""
    #: Why the model must not be captured though its batches may be padded ("" when it may:
    #: torch.compile's reduce-overhead mode captures graphs of its own).
    captured_elsewhere: str = ""
    #: A .pt2 program's batch dimension (None: any other model): the buckets fit within it,
    #: and where it cannot take a batch as it comes (a fixed batch, a floor above 1, a
    #: ceiling below batch_size) the batches run in buckets on the CPU too.
    limits: BatchLimits | None = None


def make_runner(forward: Forward, settings: GraphSettings, *, who: str = "the model"
                ) -> tuple[BatchRunner | None, worker_pb2.Execution]:
    """The handler's runner (None: batches run as they come, eagerly) and what to report
    while it has none.

    On the CPU: buckets only when ``batch_buckets`` is set (padded, eager). On CUDA: graphs
    when the handler has them by default or the config says ``cuda_graphs: true``, in
    ``batch_buckets`` or the default buckets; ``cuda_graphs: false`` on a handler that has
    them by default keeps the buckets (padded: stable shapes for cuDNN's autotuning); a
    handler without them by default gets buckets only when ``batch_buckets`` is set.
    ``batch_buckets: []``: no buckets, and no graphs. A handler unfit for them gets neither,
    and says why where they were asked for (on CUDA, or by the config); a model captured
    elsewhere gets the buckets, padded, and says why not graphs. A .pt2 program's buckets fit
    within its batch dimension (``_fitted_buckets``).
    """
    explicit = _fitted_buckets(settings)
    cuda = settings.device.type == "cuda"
    if settings.unfit:
        asked = cuda or bool(explicit) or bool(settings.cuda_graphs)
        return None, worker_pb2.Execution(mode=MODE_EAGER,
                                          fallback_reason=settings.unfit if asked else "")
    if not cuda:
        if not explicit:
            return None, worker_pb2.Execution(mode=MODE_EAGER)
        return BatchRunner(forward, explicit, EagerReplay(), who=who), worker_pb2.Execution()
    wanted = (settings.cuda_graphs if settings.cuda_graphs is not None
              else settings.graphs_by_default)
    if explicit == ():
        reason = "batch_buckets: [] leaves no bucket to capture" if wanted else ""
        return None, worker_pb2.Execution(mode=MODE_EAGER, fallback_reason=reason)
    buckets = explicit or default_buckets(settings.batch_size)
    if wanted and settings.captured_elsewhere:
        return (BatchRunner(forward, buckets, EagerReplay(), who=who,
                            reason=settings.captured_elsewhere), worker_pb2.Execution())
    if wanted:
        return (BatchRunner(forward, buckets, CUDAGraphCapture(settings.device), who=who),
                worker_pb2.Execution())
    if explicit is None and not settings.graphs_by_default:
        return None, worker_pb2.Execution(mode=MODE_EAGER)
    return BatchRunner(forward, buckets, EagerReplay(), who=who), worker_pb2.Execution()


def _fitted_buckets(settings: GraphSettings) -> tuple[int, ...] | None:
    """``batch_buckets`` as a .pt2 program can run them: fitted within its batch dimension;
    a program that cannot take every batch of up to ``batch_size`` as it comes gets the
    default buckets fitted where none (or ``[]``) are set."""
    explicit, limits = settings.batch_buckets, settings.limits
    if limits is None or limits.unknown or settings.unfit:
        return explicit
    if explicit or limits.constrains(settings.batch_size):
        return fit_buckets(explicit or default_buckets(settings.batch_size), limits.low,
                           limits.high)
    return explicit
