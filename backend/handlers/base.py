"""The handler contract, and BaseHandler: preprocess -> inference -> postprocess over a batch,
or ``explain_requests`` for a batch that asks for explanations.

Device selection and weight formats live in ``backend.handlers.device`` and
``backend.weights``; this module only wires them together. It imports torch, so only
handlers that run a model load it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from backend.context import Context
from backend.errors import BatchSizeMismatch, Unsupported
from backend.handlers.device import select_device
from backend.handlers.explain import is_explanation
from backend.handlers.graphs import MODE_EAGER, BatchRunner, GraphSettings, make_runner
from backend.handlers.labels import INDEX_TO_NAME, LabelMap, load_label_mapping
from backend.handlers.tuning import (
    Tuning,
    captured_elsewhere,
    forward_context,
    read_tuning,
    tune_model,
    warm_up,
    warmup_sizes,
)
from backend.weights import load_model, read_sharing
from backend.weights.pt2 import Pt2Program
from protos import worker_pb2


class Handler(Protocol):
    """What the worker needs of a handler class (TorchServe's contract)."""

    def initialize(self, context: Context) -> None: ...

    def handle(self, data: list[Any], context: Context) -> list[Any]: ...


class BaseHandler:
    """Loads the archive's model, then runs each batch through one forward pass.

    Subclasses override ``preprocess`` (requests -> model input), ``inference`` and
    ``postprocess`` (model output -> one result per request), or ``predict_requests`` (the
    whole prediction of a batch), and ``explain_requests`` to explain. Attribute names follow
    TorchServe's BaseHandler, which custom handlers read.

    ``inference`` runs the model through ``run_model``: on CUDA, in padded batch buckets
    replaying CUDA graphs, for a handler with ``graphs_by_default`` or a model config saying
    ``cuda_graphs: true`` (``backend.handlers.graphs``).
    """

    #: On CUDA, batches replay CUDA graphs unless model-config.yaml says ``cuda_graphs:
    #: false`` (the built-in vision handlers, TorchServe's BaseHandler); a handler of one's
    #: own without it opts in with ``cuda_graphs: true``.
    graphs_by_default = False
    #: Why this handler's batches can be neither padded nor captured, said in describe on
    #: CUDA ("": they can; the text classifier's cannot).
    graphs_unfit = ""
    #: Runs the model's batches (None: the model is called as it is).
    runner: BatchRunner | None = None
    #: What ``context.execution`` says while there is no runner.
    _idle_execution = worker_pb2.Execution(mode=MODE_EAGER)
    #: The model when it is a .pt2 program (``backend.weights.pt2``), as loaded.
    _pt2_program: Pt2Program | None = None

    def __init__(self) -> None:
        self.context: Context | None = None
        self.device = torch.device("cpu")
        self.model: torch.nn.Module | None = None
        self.mapping: LabelMap | None = None
        self.initialized = False
        self.tuning = Tuning()
        #: The model before torch.compile (served instead if the compiled one fails).
        self._uncompiled: torch.nn.Module | None = None

    def initialize(self, context: Context) -> None:
        properties = context.system_properties
        model_dir = Path(properties["model_dir"])
        self.context = context
        self.device = select_device(properties.get("gpu_id"))
        self.tuning = read_tuning(context.model_yaml_config)
        self.set_model(load_model(model_dir, context.manifest, self.device,
                                  read_sharing(context.model_yaml_config)))
        self.mapping = load_label_mapping(model_dir / INDEX_TO_NAME)
        self.start_runner(context)
        self.initialized = True

    def set_model(self, model: torch.nn.Module) -> None:
        """Serve ``model``, tuned as model-config.yaml asks (``backend.handlers.tuning``)."""
        model.eval()
        self._pt2_program = model if isinstance(model, Pt2Program) else None
        tuned = tune_model(model, self.device, self.tuning)
        self._uncompiled = model if tuned is not model and self.tuning.compile_options else None
        self.model = tuned

    def start_runner(self, context: Context) -> None:
        """Run ``self.model``'s batches as the device and model-config.yaml say (a runner, or
        none), and report it in ``context.execution`` (which the worker sends in Loaded)."""
        if self.runner is not None:
            self.runner.close()
        settings = GraphSettings(
            device=self.device, batch_size=int(context.system_properties.get("batch_size") or 1),
            cuda_graphs=self.tuning.cuda_graphs, batch_buckets=self.tuning.batch_buckets,
            graphs_by_default=self.graphs_by_default, unfit=self.graphs_unfit,
            captured_elsewhere=captured_elsewhere(self.tuning, self._pt2_program),
            limits=self._pt2_program.limits if self._pt2_program is not None else None)
        if callable(self.model):
            # Any context will do (TorchServe's tests pass a MockContext, which has no name).
            name = getattr(context, "model_name", None) or "the model"
            self.runner, self._idle_execution = make_runner(
                self._forward, settings, who=f"{name} ({type(self).__name__})")
        else:  # an ONNX Runtime session, say: not ours to run
            self.runner = None
            self._idle_execution = worker_pb2.Execution(mode=MODE_EAGER)
        self.report_execution(context)

    def report_execution(self, context: Context) -> None:
        """Say in ``context.execution`` how the model runs its batches now."""
        execution = getattr(context, "execution", None)
        if execution is None:  # not the worker's Context: nobody to tell
            return
        runner = self.runner
        execution.CopyFrom(runner.execution() if runner is not None else self._idle_execution)
        if self._pt2_program is not None:
            execution.program = self._pt2_program.describe()

    def _forward(self, inputs: Any) -> Any:
        model = self.model  # looked up at each call: warm_up may replace it
        if model is None:
            raise RuntimeError(f"{type(self).__name__} was not initialised")
        return model(inputs)

    def run_model(self, inputs: Any) -> Any:
        """The model on a batch's input: through the runner when there is one."""
        runner = self.runner
        return runner(inputs) if runner is not None else self._forward(inputs)

    def warm_up(self, batch: Any, batch_size: int) -> None:
        """Run ``batch(n)`` (the requests of a batch of n, as ``handle`` takes them) through
        ``handle`` once per warm-up batch size (with buckets: each bucket, which captures its
        graph on CUDA); a compiled model that fails there is replaced by the model it was
        compiled from. ``context.execution`` then says how the batches run."""
        context = self.context
        assert context is not None
        runner = self.runner
        sizes = warmup_sizes(self.tuning, self.device, batch_size,
                             runner.buckets if runner is not None else ())
        if not warm_up(lambda size: self.handle(batch(size), context), sizes) \
                and self._uncompiled is not None:
            self.model, self._uncompiled = self._uncompiled, None
            self.start_runner(context)  # graphs captured of the compiled model are dropped
            warm_up(lambda size: self.handle(batch(size), context), sizes)
        self.report_execution(context)

    def preprocess(self, data: list[Any]) -> Any:
        return torch.as_tensor(data, device=self.device)

    def inference(self, inputs: Any) -> Any:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__} was not initialised")
        return self.run_model(inputs)

    def postprocess(self, outputs: Any) -> list[Any]:
        return list(outputs.tolist())

    def handle(self, data: list[Any], context: Context) -> list[Any]:
        """One batch in, one result per request out: predictions, or explanations when the
        batch asks for them (TorchServe's ``explain`` header)."""
        self.context = context
        if is_explanation(context):
            return self.explain_requests(data, context)
        return self.predict_requests(data, context)

    def predict_requests(self, data: list[Any], context: Context) -> list[Any]:
        """The predictions of a batch: preprocess -> inference -> postprocess."""
        inputs = self.preprocess(data)
        with forward_context(self.device, self.tuning):
            outputs = self.inference(inputs)
        return self.postprocess(outputs)

    def explain_requests(self, data: list[Any], context: Context) -> list[Any]:
        """The explanations of a batch, one per request; a handler that can explain its
        predictions overrides this. Here: none (501)."""
        raise Unsupported(
            f"{type(self).__name__} does not explain its predictions (it defines no "
            f"explain_requests); ask /predictions for them instead"
        )

    def handle_valid(self, items: list[Any], context: Context) -> list[Any]:
        """``BaseHandler.predict_requests`` on the items that are not exceptions, in one batch.

        An exception item (say the InvalidInput of a corrupt image) stays the result of its
        own request, which the service answers with that error; the others are predicted.
        """
        # The pipeline itself, not a subclass's predict_requests (which is what calls this).
        return map_valid(items, lambda valid: BaseHandler.predict_requests(self, valid, context),
                         type(self).__name__)


def map_valid(items: list[Any], function: Callable[[list[Any]], list[Any]],
              who: str) -> list[Any]:
    """``function`` on the items that are not exceptions, all in one call (one result per
    item); an exception item stays the result of its own request."""
    valid = [index for index, item in enumerate(items) if not isinstance(item, Exception)]
    results = list(items)
    if not valid:
        return results
    outputs = function([items[index] for index in valid])
    if len(outputs) != len(valid):
        raise BatchSizeMismatch(f"{who} returned {len(outputs)} results for {len(valid)} inputs")
    for index, output in zip(valid, outputs, strict=True):
        results[index] = output
    return results
