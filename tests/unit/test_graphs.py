"""The graph runner on the CPU: bucket choice, padding, slicing and chunking, nested outputs,
the fallbacks (a capture that fails, a graph that does not give the model's outputs, an input
or output the buckets cannot take) and what is reported; the CUDA capture itself is in
tests/unit/test_cuda_graphs.py (marked gpu). A capture is simulated by ``FakeGraphs``: like a
CUDA graph, its program writes into static outputs that the next replay overwrites, and CPU
syncs (``.item()``, ``if tensor:``) are refused while it captures."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend.errors import ModelLoadError
from backend.handlers import buckets
from backend.handlers.graphs import (
    MODE_CUDA_GRAPHS,
    MODE_EAGER,
    MODE_PADDED,
    BatchRunner,
    EagerReplay,
    GraphSettings,
    make_runner,
)
from backend.handlers.tuning import captured_elsewhere, read_tuning
from backend.process.worker import Load, WorkerSession
from protos import worker_pb2
from protos.framing import Kind
from tests.unit import test_handlers as handlers
from tests.unit.test_handlers import restore_import_state  # noqa: F401 (autouse here too)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)  # only looked at, never used, by make_runner


# --- buckets -------------------------------------------------------------------------------


def test_default_buckets_are_the_powers_of_two_then_the_batch_size() -> None:
    assert buckets.default_buckets(1) == (1,)
    assert buckets.default_buckets(6) == (1, 2, 4, 6)
    assert buckets.default_buckets(8) == (1, 2, 4, 8)
    assert buckets.default_buckets(128) == (1, 2, 4, 8, 16, 32, 64, 128)


def test_a_batch_runs_in_the_smallest_bucket_that_holds_it() -> None:
    sizes = (1, 2, 4, 8)
    assert [buckets.bucket_for(size, sizes) for size in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert buckets.bucket_for(3, (4, 16)) == 4
    with pytest.raises(ValueError, match="larger than the largest bucket"):
        buckets.bucket_for(9, sizes)


def test_a_batch_larger_than_the_largest_bucket_is_split_into_chunks() -> None:
    assert buckets.plan_chunks(3, (1, 2, 4)) == [(0, 3, 4)]
    assert buckets.plan_chunks(11, (1, 2, 4)) == [(0, 4, 4), (4, 8, 4), (8, 11, 4)]
    assert buckets.plan_chunks(9, (1, 2, 4)) == [(0, 4, 4), (4, 8, 4), (8, 9, 1)]
    assert buckets.buckets_run([1, 3, 9], (1, 2, 4)) == [1, 4]
    assert buckets.buckets_run([8], (1, 2, 4)) == [4]


def test_padding_repeats_the_last_row_and_slicing_takes_the_batch_back() -> None:
    inputs = torch.arange(6.0).reshape(3, 2)
    padded = buckets.pad_rows(inputs, 5)
    assert padded.tolist() == [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]]
    assert buckets.pad_rows(inputs, 3) is inputs
    outputs = {"out": padded * 2, "aux": (padded, None), "rows": [padded.sum(1)]}
    taken = buckets.take_rows(outputs, 3, copy=True)
    assert taken["out"].tolist() == (inputs * 2).tolist()
    assert taken["aux"][1] is None and taken["rows"][0].tolist() == [1, 5, 9]
    assert taken["out"].untyped_storage().data_ptr() != padded.untyped_storage().data_ptr()
    joined = buckets.join_rows([buckets.take_rows(outputs, 2, copy=False),
                                buckets.take_rows(outputs, 1, copy=False)])
    assert joined["out"].tolist() == [[0, 2], [4, 6], [0, 2]] and joined["aux"][1] is None


def test_an_output_without_the_rows_first_cannot_be_sliced() -> None:
    assert buckets.row_problem((torch.zeros(4, 2), {"x": torch.zeros(4)}), 4) is None
    assert "first dimension is not the batch's rows" in str(
        buckets.row_problem(torch.zeros(2, 4), 4))
    assert "holds a str" in str(buckets.row_problem([torch.zeros(4), "label"], 4))
    assert "shape ()" in str(buckets.row_problem(torch.tensor(1.0), 4))


@pytest.mark.parametrize(("handler", "message"), [
    ({"batch_buckets": [0, 2]}, "batch_buckets must be a list of positive batch sizes"),
    ({"batch_buckets": "1,2"}, "batch_buckets must be a list"),
    ({"batch_buckets": [True]}, "batch_buckets must be a list"),
    ({"batch_buckets": list(range(1, buckets.MAX_BUCKETS + 2))},
     f"at most {buckets.MAX_BUCKETS} sizes"),
    ({"cuda_graphs": "yes"}, "cuda_graphs must be true or false"),
])
def test_bad_bucket_settings_fail_the_load_naming_the_key(handler: dict[str, Any],
                                                          message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        read_tuning({"handler": handler})


def test_bucket_settings_are_read_sorted_and_without_repeats() -> None:
    tuning = read_tuning({"handler": {"batch_buckets": [8, 1, 4, 4], "cuda_graphs": False}})
    assert tuning.batch_buckets == (1, 4, 8) and tuning.cuda_graphs is False
    assert read_tuning({"handler": {"batch_buckets": []}}).batch_buckets == ()
    assert read_tuning({}).batch_buckets is None and read_tuning({}).cuda_graphs is None


# --- the runner, with eager buckets ----------------------------------------------------------


class Recorder:
    """A model (rows -> rows): each row's outputs depend on that row alone; the batch sizes
    it ran at are kept."""

    def __init__(self, output: Callable[[torch.Tensor], Any] | None = None) -> None:
        self.sizes: list[int] = []
        self._output = output or (lambda x: x * 2 + 1)

    def __call__(self, inputs: Any) -> Any:
        self.sizes.append(len(inputs))
        return self._output(inputs)


def test_padded_buckets_run_the_model_at_bucket_sizes_and_give_its_outputs() -> None:
    model = Recorder()
    runner = BatchRunner(model, (1, 2, 4), EagerReplay())
    for size in (1, 2, 3, 4):
        inputs = torch.randn(size, 5)
        assert torch.equal(runner(inputs), inputs * 2 + 1)
    assert model.sizes == [1, 2, 4, 4]
    inputs = torch.randn(11, 5)
    assert torch.equal(runner(inputs), inputs * 2 + 1)
    assert model.sizes[4:] == [4, 4, 4]  # 4 + 4 + 3 (padded to 4)
    assert runner.execution() == worker_pb2.Execution(batch_buckets=[1, 2, 4], mode=MODE_PADDED)


def test_nested_outputs_are_sliced_and_joined_per_tensor() -> None:
    model = Recorder(lambda x: {"out": x.sum(1), "parts": (x, [x * 3]), "none": None})
    runner = BatchRunner(model, (4,), EagerReplay())
    inputs = torch.randn(6, 3)
    outputs = runner(inputs)
    assert torch.allclose(outputs["out"], inputs.sum(1))
    assert torch.equal(outputs["parts"][0], inputs)
    assert torch.equal(outputs["parts"][1][0], inputs * 3)
    assert outputs["none"] is None
    assert model.sizes == [4, 4]


def test_an_input_that_is_not_one_batch_tensor_turns_the_buckets_off(
        caplog: pytest.LogCaptureFixture) -> None:
    model = Recorder(lambda images: [image.sum() for image in images])
    runner = BatchRunner(model, (1, 2, 4), EagerReplay(), who="detector")
    images = [torch.ones(3, 5, 5), torch.ones(3, 7, 6)]
    with caplog.at_level(logging.WARNING):
        assert len(runner(images)) == 2
        assert len(runner(images[:1])) == 1
    execution = runner.execution()
    assert execution.mode == MODE_EAGER and not execution.batch_buckets
    assert "input is a list of 2, not one tensor" in execution.fallback_reason
    assert model.sizes == [2, 1]  # as they came
    assert len([r for r in caplog.records if "detector" in r.getMessage()]) == 1


def test_an_output_without_the_rows_first_turns_the_buckets_off() -> None:
    model = Recorder(lambda x: x.sum(0))  # a reduction over the batch: no rows to slice
    runner = BatchRunner(model, (4,), EagerReplay())
    inputs = torch.randn(3, 2)
    assert torch.allclose(runner(inputs), inputs.sum(0))  # the batch's own, unpadded
    assert model.sizes == [4, 3]
    assert runner.execution().mode == MODE_EAGER
    assert "first dimension is not the batch's rows" in runner.execution().fallback_reason
    inputs = torch.randn(9, 2)
    assert torch.allclose(runner(inputs), inputs.sum(0)) and model.sizes[-1] == 9


# --- the runner, with simulated graphs --------------------------------------------------------


class _RefuseSyncs(TorchDispatchMode):
    """A CUDA capture's rule on the CPU: no value may be read back while capturing."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("operation not permitted when stream is capturing")
        return func(*args, **(kwargs or {}))


class FakeGraphs:
    """``CUDAGraphCapture`` on the CPU: the capture runs the model once on a static input
    (refusing CPU syncs), and a replay writes the model's outputs on the static input into
    the same static output tensors. ``bake``: a replay ignores its input (as a graph that
    captured a copy of it would); ``fail_at``: the capture of that bucket raises."""

    mode = MODE_CUDA_GRAPHS
    copies_outputs = True
    verifies = True

    def __init__(self, *, bake: bool = False, fail_at: int | None = None) -> None:
        self.bake = bake
        self.fail_at = fail_at
        self.captured: list[int] = []
        self.released = 0
        self.replays = 0
        self.active = 0
        self.most_active = 0

    def prepare(self, forward: Callable[[torch.Tensor], Any], example: torch.Tensor) -> Any:
        rows = example.shape[0]
        if rows == self.fail_at:
            raise RuntimeError(f"capture of {rows} rows failed")
        static_input = example.clone()
        with _RefuseSyncs():
            static_outputs = forward(static_input)
        frozen = static_input.clone()

        def replay(inputs: torch.Tensor) -> Any:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            static_input[:inputs.shape[0]].copy_(inputs)
            static_input[inputs.shape[0]:].copy_(inputs[-1:].expand_as(
                static_input[inputs.shape[0]:]))
            fresh = forward(frozen if self.bake else static_input)
            static_outputs.copy_(fresh)
            self.replays += 1
            self.active -= 1
            return static_outputs

        self.captured.append(rows)
        return replay

    def pool_bytes(self) -> int:
        return 1000 * len(self.captured)

    def release(self) -> None:
        self.released += 1
        self.captured.clear()


def test_graphs_replay_per_bucket_and_their_outputs_are_copied_out() -> None:
    weight = torch.randn(5, 3)
    strategy = FakeGraphs()
    runner = BatchRunner(lambda x: x @ weight, (1, 2, 4), strategy)
    first_inputs = torch.randn(3, 5)
    first = runner(first_inputs)
    second = runner(torch.randn(4, 5))  # the same bucket: a replay over the static outputs
    assert torch.allclose(first, first_inputs @ weight)  # still the first batch's
    assert second.shape == (4, 3)
    assert strategy.captured == [4]
    runner(torch.randn(1, 5))
    execution = runner.execution()
    assert execution == worker_pb2.Execution(batch_buckets=[1, 2, 4], mode=MODE_CUDA_GRAPHS,
                                             graph_pool_bytes=2000)


def test_a_model_that_syncs_with_the_cpu_falls_back_to_eager_once(
        caplog: pytest.LogCaptureFixture) -> None:
    def data_dependent(x: torch.Tensor) -> torch.Tensor:
        # Reads a value back (a capture refuses it); repeated rows do not change the answer.
        if (x > 0).any():
            return x * 2
        return -x

    strategy = FakeGraphs()
    runner = BatchRunner(data_dependent, (1, 2, 4), strategy, who="branchy")
    with caplog.at_level(logging.WARNING):
        for size in (3, 1, 4, 2):
            inputs = torch.randn(size, 4)
            assert torch.equal(runner(inputs), data_dependent(inputs))
    execution = runner.execution()
    assert execution.mode == MODE_PADDED and list(execution.batch_buckets) == [1, 2, 4]
    assert execution.fallback_reason == ("bucket 4 could not be prepared: RuntimeError: "
                                         "operation not permitted when stream is capturing")
    assert execution.graph_pool_bytes == 0 and strategy.released >= 1
    assert len([r for r in caplog.records if "branchy" in r.getMessage()]) == 1


def test_a_capture_that_fails_for_one_bucket_gives_up_every_graph() -> None:
    strategy = FakeGraphs(fail_at=4)
    runner = BatchRunner(lambda x: x + 1, (1, 2, 4), strategy)
    assert torch.equal(runner(torch.zeros(1, 2)), torch.ones(1, 2))
    assert strategy.captured == [1]
    assert torch.equal(runner(torch.zeros(3, 2)), torch.ones(3, 2))
    assert strategy.captured == [] and runner.mode == MODE_PADDED
    assert runner.execution().fallback_reason.startswith("bucket 4 could not be prepared: "
                                                         "RuntimeError: capture of 4 rows")
    replays = strategy.replays
    assert torch.equal(runner(torch.zeros(1, 2)), torch.ones(1, 2))  # eager now
    assert strategy.replays == replays


def test_a_graph_that_does_not_give_the_models_outputs_is_not_used() -> None:
    strategy = FakeGraphs(bake=True)
    runner = BatchRunner(lambda x: x * 3, (2,), strategy)
    inputs = torch.randn(2, 3)
    assert torch.allclose(runner(inputs), inputs * 3)
    other = torch.randn(2, 3)
    assert torch.allclose(runner(other), other * 3)  # eager: the baked graph was dropped
    reason = runner.execution().fallback_reason
    assert reason.startswith("bucket 2's graph does not give the model's outputs: output 0 "
                             "differs by")
    assert runner.mode == MODE_PADDED


def test_a_batch_the_model_fails_on_fails_alone_and_graphs_stay() -> None:
    def picky(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != 4:
            raise ValueError(f"expected 4 features, got {x.shape[1]}")
        return x + 1

    strategy = FakeGraphs()
    runner = BatchRunner(picky, (1, 2), strategy)
    with pytest.raises(ValueError, match="expected 4 features"):
        runner(torch.zeros(2, 3))
    assert runner.execution().fallback_reason == "" and runner.mode == MODE_CUDA_GRAPHS
    assert torch.equal(runner(torch.zeros(2, 4)), torch.ones(2, 4))
    assert strategy.captured == [2]


def test_a_batch_of_another_row_shape_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    model = Recorder(lambda x: x.mean(1))
    strategy = FakeGraphs()
    runner = BatchRunner(model, (2, 4), strategy)
    runner(torch.randn(2, 5))
    replays = strategy.replays
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            inputs = torch.randn(2, 7)
            assert torch.allclose(runner(inputs), inputs.mean(1))
    assert strategy.replays == replays and runner.mode == MODE_CUDA_GRAPHS
    assert len([r for r in caplog.records if "does not fit" in r.getMessage()]) == 1


def test_replays_of_one_runner_never_overlap() -> None:
    weight = torch.randn(512, 512)
    strategy = FakeGraphs()

    def model(x: torch.Tensor) -> torch.Tensor:
        return (x @ weight) @ weight.T  # matmuls release the GIL: other threads run meanwhile

    runner = BatchRunner(model, (1, 2, 4), strategy)
    inputs = [torch.randn(1 + index % 4, 512) for index in range(48)]
    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(runner, inputs))
    for batch_input, output in zip(inputs, outputs, strict=True):
        assert torch.allclose(output, model(batch_input), rtol=1e-4, atol=1e-3)
    assert strategy.most_active == 1 and strategy.replays >= 45


# --- who gets a runner -----------------------------------------------------------------------


def _plan(device: torch.device, **settings: Any) -> tuple[str, list[int], str]:
    runner, idle = make_runner(lambda x: x, GraphSettings(device=device, batch_size=8,
                                                          **settings))
    execution = runner.execution() if runner is not None else idle
    return execution.mode, list(execution.batch_buckets), execution.fallback_reason


def test_which_handlers_get_buckets_and_graphs() -> None:
    vision = {"graphs_by_default": True}
    unfit = "text: no static shape"
    # On the CPU: today's behaviour unless batch_buckets is set.
    assert _plan(CPU, **vision) == (MODE_EAGER, [], "")
    assert _plan(CPU, cuda_graphs=True, **vision) == (MODE_EAGER, [], "")
    assert _plan(CPU, batch_buckets=(1, 2, 4), **vision) == (MODE_PADDED, [1, 2, 4], "")
    assert _plan(CPU, batch_buckets=(1, 2, 4)) == (MODE_PADDED, [1, 2, 4], "")
    # On CUDA: graphs by default for the built-in vision handlers and the ts BaseHandler.
    assert _plan(CUDA, **vision) == (MODE_CUDA_GRAPHS, [1, 2, 4, 8], "")
    assert _plan(CUDA, batch_buckets=(2, 16), **vision) == (MODE_CUDA_GRAPHS, [2, 16], "")
    assert _plan(CUDA, cuda_graphs=False, **vision) == (MODE_PADDED, [1, 2, 4, 8], "")
    assert _plan(CUDA, batch_buckets=(), **vision) == (
        MODE_EAGER, [], "batch_buckets: [] leaves no bucket to capture")
    # torch.compile's reduce-overhead mode captures graphs itself: the buckets stay, padded.
    elsewhere = captured_elsewhere(read_tuning(
        {"pt2": {"compile": {"enable": True, "mode": "reduce-overhead"}}}))
    assert "captures CUDA graphs of its own" in elsewhere
    assert captured_elsewhere(read_tuning({"pt2": {"compile": {"enable": True}}})) == ""
    assert _plan(CUDA, captured_elsewhere=elsewhere, **vision) == (
        MODE_PADDED, [1, 2, 4, 8], elsewhere)
    # A handler of one's own opts in.
    assert _plan(CUDA) == (MODE_EAGER, [], "")
    assert _plan(CUDA, cuda_graphs=True) == (MODE_CUDA_GRAPHS, [1, 2, 4, 8], "")
    assert _plan(CUDA, batch_buckets=(4,)) == (MODE_PADDED, [4], "")
    # A handler unfit for them says why where they were asked for.
    assert _plan(CUDA, unfit=unfit) == (MODE_EAGER, [], unfit)
    assert _plan(CUDA, unfit=unfit, cuda_graphs=True) == (MODE_EAGER, [], unfit)
    assert _plan(CPU, unfit=unfit) == (MODE_EAGER, [], "")
    assert _plan(CPU, unfit=unfit, batch_buckets=(1, 2)) == (MODE_EAGER, [], unfit)


# --- the handlers and the worker's Loaded frame ----------------------------------------------


def _predict(service: Any, *bodies: bytes) -> list[Any]:
    return handlers.predictions(service.predict(handlers.batch(
        *(handlers.request(body) for body in bodies))))


def _config(model_dir: Path, text: str, handler: str = "image_classifier") -> str:
    (model_dir / "model-config.yaml").write_text(text)
    value = json.loads(handlers.manifest(handler))
    value["model"]["configFile"] = "model-config.yaml"
    return json.dumps(value)


def test_an_image_classifier_with_buckets_on_the_cpu_answers_as_without(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "padded").mkdir()
    plain = handlers.load(handlers.eager_model_dir(tmp_path / "plain"), batch_size=4)
    model_dir = handlers.eager_model_dir(tmp_path / "padded")
    padded = handlers.load(model_dir, batch_size=4, manifest_json=_config(
        model_dir, "handler:\n  batch_buckets: [1, 2, 4]\n"))
    assert padded.context.execution == worker_pb2.Execution(batch_buckets=[1, 2, 4],
                                                            mode=MODE_PADDED)
    assert plain.context.execution == worker_pb2.Execution(mode=MODE_EAGER)
    bodies = [handlers.image(seed) for seed in range(3)]
    expected = _predict(plain, *bodies)
    answers = _predict(padded, *bodies)
    for got, want in zip(answers, expected, strict=True):
        assert list(got) == list(want)
        assert got == pytest.approx(want, abs=1e-6)
    assert handlers.handler_of(padded).runner.mode == MODE_PADDED


def test_the_text_classifier_says_why_it_takes_no_buckets(tmp_path: Path) -> None:
    model_dir = handlers.eager_model_dir(tmp_path, handlers.TINY_TEXT_CLASSIFIER, labels=None)
    torch.save({"<unk>": 0, "good": 1}, model_dir / "source_vocab.pt")
    service = handlers.load(model_dir, "text_classifier", manifest_json=_config(
        model_dir, "handler:\n  batch_buckets: [2, 4]\n", "text_classifier"))
    assert service.context.execution.mode == MODE_EAGER
    assert service.context.execution.fallback_reason.startswith("text_classifier: a batch is "
                                                                "its texts' token ids")
    assert len(_predict(service, b"good", b"bad")) == 2


def test_the_worker_sends_the_execution_in_loaded(tmp_path: Path) -> None:
    import socket

    model_dir = handlers.eager_model_dir(tmp_path)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        session = WorkerSession(ours)
        frame = session.obey(Load(worker_pb2.LoadModel(
            model_name="tiny", model_dir=str(model_dir), handler="image_classifier",
            batch_size=4, gpu_id=-1, server_version="0.1.0", decode_input_request=True,
            manifest_json=_config(model_dir, "handler:\n  batch_buckets: [4, 1, 2]\n"))))
    assert frame is not None and frame.kind is Kind.LOADED, frame
    loaded = worker_pb2.Loaded.FromString(frame.payload)
    assert loaded.execution == worker_pb2.Execution(batch_buckets=[1, 2, 4], mode=MODE_PADDED)


@pytest.mark.filterwarnings("ignore:`torch.jit.[a-z]*` is deprecated:FutureWarning")
def test_the_ts_base_handler_runs_its_batches_in_the_buckets(tmp_path: Path) -> None:
    from backend.compat.ts.torch_handler.base_handler import BaseHandler as TsBaseHandler
    from backend.context import Context

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    scripted = torch.jit.script(torch.nn.Linear(3, 2))
    scripted.save(str(model_dir / "model.pt"))
    (model_dir / "model-config.yaml").write_text("handler:\n  batch_buckets: [4]\n")
    context = Context("lin", str(model_dir), {"model": {"serializedFile": "model.pt"}}, 4,
                      None, "0.1.0", model_yaml_config={"handler": {"batch_buckets": [4]}})
    handler = TsBaseHandler()
    handler.initialize(context)
    assert context.execution == worker_pb2.Execution(batch_buckets=[4], mode=MODE_PADDED)
    sizes: list[int] = []
    forward = handler._forward
    handler.runner._forward = lambda x: sizes.append(len(x)) or forward(x)  # type: ignore[union-attr]
    data = [[1.0, 2.0, 3.0], [0.0, 1.0, 0.0]]
    with torch.inference_mode():
        expected = scripted(torch.tensor(data)).tolist()
    for got, want in zip(handler.handle(data, context), expected, strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    assert sizes == [4]


def test_a_closed_runner_prepares_its_buckets_again() -> None:
    strategy = FakeGraphs()
    runner = BatchRunner(lambda x: x - 1, (2,), strategy)
    runner(torch.zeros(2, 1))
    runner.close()
    assert strategy.captured == [] and strategy.released == 1
    assert torch.equal(runner(torch.zeros(1, 1)), -torch.ones(1, 1))
    assert strategy.captured == [2] and runner.mode == MODE_CUDA_GRAPHS
