"""The model registry (frontend/models/registry.py) and the loader (frontend/models/loader.py):
names, versions and defaults; the Open Inference tensors and the settings layers of a
registration; registering a real archive without starting a worker, and unregistering it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

from frontend.config import ServerConfig, parse_models_json
from frontend.errors import (
    ArchiveError,
    BadRequest,
    Conflict,
    Forbidden,
    ModelNotFound,
    ModelVersionNotFound,
)
from frontend.models.archive import UnpackedArchive
from frontend.models.loader import ModelLoader, RegisterRequest, tensor_metadata
from frontend.models.model import Model
from frontend.models.registry import ModelRegistry
from frontend.observe.events import Observers
from frontend.serving.capacity import WorkerCaps
from frontend.serving.placement import GpuAssigner, Placement
from frontend.serving.workers import Worker, WorkerLaunch
from frontend.settings import ModelSettings, PolicyName, SettingsLayer
from model_archiver.manifest import Manifest
from protos import worker_pb2
from tests.unit.services import NoWorkers

T = TypeVar("T")
SETTINGS = ModelSettings(batch_size=1, max_batch_delay_ms=100, min_workers=0, max_workers=0,
                         response_timeout_s=120, startup_timeout_s=120, job_queue_size=10)


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def _model(name: str, version: str, tmp_path: Path, workflow: str | None = None) -> Model:
    """A Model as the loader builds one, without workers (the registry only reads names,
    versions, the owning workflow and the workers list)."""
    manifest = Manifest(model_name=name, model_version=version, handler="echo.py")
    unpacked = UnpackedArchive(f"{name}.mar", tmp_path / f"{name}.mar", tmp_path / name,
                               manifest, manifest.to_json())
    launch = WorkerLaunch(worker_pb2.LoadModel(model_name=name, model_version=version),
                          tmp_path, 120, 120)
    return Model(name, version, unpacked, "echo.py", SETTINGS, launch,
                 Placement(GpuAssigner(0), None, lambda: 0, cores=1),
                 logging.getLogger(__name__), workflow=workflow)


@pytest.fixture
def model(tmp_path: Path) -> Callable[[str, str], Model]:
    return lambda name, version: _model(name, version, tmp_path)


# ---- the registry ------------------------------------------------------------------------------


def test_the_first_version_of_a_name_is_its_default(model: Callable[[str, str], Model]) -> None:
    registry = ModelRegistry()
    first, second = model("m", "1.0"), model("m", "2.0")
    registry.add(first)
    registry.add(second)
    assert registry.default_version("m") == "1.0"
    assert registry.get("m") is first
    assert registry.get("m", "2.0") is second
    assert registry.versions("m") == [first, second]


def test_make_default_moves_the_default_to_the_new_version(
        model: Callable[[str, str], Model]) -> None:
    registry = ModelRegistry()
    registry.add(model("m", "1.0"))
    newer = model("m", "2.0")
    registry.add(newer, make_default=True)
    assert registry.default_version("m") == "2.0"
    assert registry.get("m") is newer


def test_lookups_of_unknown_names_and_versions(model: Callable[[str, str], Model]) -> None:
    registry = ModelRegistry()
    registry.add(model("m", "1.0"))
    with pytest.raises(ModelNotFound, match=r"^Model not found: x$"):
        registry.get("x")
    with pytest.raises(ModelNotFound):
        registry.versions("x")
    with pytest.raises(ModelNotFound):
        registry.default_version("x")
    with pytest.raises(ModelVersionNotFound,
                       match=r"^Model version 3\.0 does not exist for model m$"):
        registry.get("m", "3.0")
    assert registry.has("m", "1.0")
    assert not registry.has("m", "3.0")
    assert not registry.has("x", "1.0")


def test_names_are_sorted_and_iteration_yields_every_version(
        model: Callable[[str, str], Model]) -> None:
    registry = ModelRegistry()
    models = [model("zeta", "1"), model("alpha", "1"), model("alpha", "2")]
    for each in models:
        registry.add(each)
    assert registry.names() == ["alpha", "zeta"]
    assert sorted(id(m) for m in registry) == sorted(id(m) for m in models)


def test_a_duplicate_version_is_a_conflict_and_keeps_the_first(
        model: Callable[[str, str], Model]) -> None:
    registry = ModelRegistry()
    first = model("m", "1.0")
    registry.add(first)
    with pytest.raises(Conflict, match=r"Model version 1\.0 is already registered for model m"):
        registry.add(model("m", "1.0"), make_default=True)
    assert registry.get("m", "1.0") is first
    assert len(registry.versions("m")) == 1


def test_a_workflows_node_name_is_its_alone(tmp_path: Path) -> None:
    """A name a workflow's node holds takes no other version, from the model API or from
    another workflow; a node cannot take a registered name; nothing is added on refusal."""
    registry = ModelRegistry()
    node = _model("wf__m", "1.0", tmp_path, workflow="wf")
    registry.add(node)
    assert registry.owner("wf__m") == "wf" and registry.holds(node)
    for intruder in (_model("wf__m", "9.0", tmp_path), _model("wf__m", "1.0", tmp_path),
                     _model("wf__m", "2.0", tmp_path, workflow="wf"),
                     _model("wf__m", "2.0", tmp_path, workflow="other")):
        with pytest.raises(Conflict, match="Model wf__m is a node of workflow wf"):
            registry.add(intruder, make_default=True)
        assert not registry.holds(intruder)
    assert registry.versions("wf__m") == [node] and registry.get("wf__m") is node
    with pytest.raises(Conflict, match="Model wf__m is a node of workflow wf"):
        registry.check_free("wf__m", None, "x")

    user = _model("x__y__z", "2.0", tmp_path)
    registry.add(user)
    assert registry.owner("x__y__z") is None
    with pytest.raises(Conflict, match="Model x__y__z is already registered: workflow x__y "
                                       "cannot serve a node under its name"):
        registry.add(_model("x__y__z", "1.0", tmp_path, workflow="x__y"))
    assert registry.versions("x__y__z") == [user]
    # The model API still adds versions of its own names.
    registry.add(_model("x__y__z", "3.0", tmp_path))
    assert len(registry.versions("x__y__z")) == 2
    # Once the node is removed, its name is free again.
    registry.remove(node)
    assert registry.owner("wf__m") is None
    registry.check_free("wf__m", "1.0", "wf")


def test_holds_is_this_very_version(model: Callable[[str, str], Model]) -> None:
    registry = ModelRegistry()
    first, twin = model("m", "1.0"), model("m", "1.0")
    registry.add(first)
    assert registry.holds(first) and not registry.holds(twin)
    registry.remove(twin)  # not this registry's: nothing removed
    assert registry.holds(first)


def test_set_default(model: Callable[[str, str], Model]) -> None:
    registry = ModelRegistry()
    registry.add(model("m", "1.0"))
    registry.add(model("m", "2.0"))
    registry.set_default("m", "2.0")
    assert registry.default_version("m") == "2.0"
    with pytest.raises(ModelVersionNotFound):
        registry.set_default("m", "9.0")
    with pytest.raises(ModelNotFound):
        registry.set_default("x", "1.0")
    assert registry.default_version("m") == "2.0"


def test_removing_the_default_promotes_the_oldest_remaining_version(
        model: Callable[[str, str], Model]) -> None:
    registry = ModelRegistry()
    v1, v2, v3 = model("m", "1.0"), model("m", "2.0"), model("m", "3.0")
    for each in (v1, v2, v3):
        registry.add(each)
    registry.set_default("m", "2.0")
    registry.remove(v2)
    assert registry.default_version("m") == "1.0"
    registry.set_default("m", "3.0")
    registry.remove(v1)  # not the default: the default stays
    assert registry.default_version("m") == "3.0"
    assert registry.versions("m") == [v3]


def test_removing_the_last_version_forgets_the_name(model: Callable[[str, str], Model]) -> None:
    registry = ModelRegistry()
    only = model("m", "1.0")
    registry.add(only)
    registry.add(model("other", "1.0"))
    registry.remove(only)
    assert registry.names() == ["other"]
    assert not registry.has("m", "1.0")
    with pytest.raises(ModelNotFound):
        registry.get("m")
    again = model("m", "2.0")
    registry.add(again)  # a new first version is the default again
    assert registry.get("m") is again


def test_removing_a_model_that_is_not_registered_is_a_no_op(
        model: Callable[[str, str], Model]) -> None:
    registry = ModelRegistry()
    registered = model("m", "1.0")
    registry.add(registered)
    registry.remove(model("absent", "1.0"))
    registry.remove(model("m", "2.0"))
    registry.remove(model("m", "1.0"))  # same name and version, another registry's object
    assert registry.get("m", "1.0") is registered
    assert registry.names() == ["m"]


def test_worker_count_sums_every_version(model: Callable[[str, str], Model]) -> None:
    registry = ModelRegistry()
    v1, v2, other = model("m", "1.0"), model("m", "2.0"), model("other", "1.0")
    for each in (v1, v2, other):
        registry.add(each)
    assert registry.worker_count() == 0
    # Only the length of each workers list counts: placeholders stand for worker processes.
    v1.workers.extend(cast(Worker, object()) for _ in range(2))
    other.workers.append(cast(Worker, object()))
    assert registry.worker_count() == 3
    registry.remove(v1)
    assert registry.worker_count() == 1


# ---- the loader: tensors and settings ---------------------------------------------------------


def test_tensor_metadata_reads_names_datatypes_and_shapes() -> None:
    config = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3], "extra": 1},
                         {"name": "mask", "datatype": "BOOL"}]}
    assert tensor_metadata(config, "inputs") == [
        {"name": "x", "datatype": "FP32", "shape": [-1, 3]},
        {"name": "mask", "datatype": "BOOL", "shape": [-1]},
    ]
    assert tensor_metadata(config, "outputs") == []


@pytest.mark.parametrize(("entries", "message"), [
    ({"name": "x"}, "model-config.yaml: outputs must be a list of tensors"),
    ([{"name": "x", "datatype": "FP32"}, {"datatype": "FP32"}],
     "model-config.yaml: outputs[1] must have a name"),
    (["x"], "model-config.yaml: outputs[0] must have a name"),
    ([{"name": 7, "datatype": "FP32"}], "model-config.yaml: outputs[0] must have a name"),
    ([{"name": "x", "datatype": "FLOAT"}],
     "model-config.yaml: outputs[0]: datatype must be one of BOOL, BYTES, FP16"),
    ([{"name": "x"}], "model-config.yaml: outputs[0]: datatype must be one of"),
    ([{"name": "x", "datatype": "FP32", "shape": [-2]}],
     "model-config.yaml: outputs[0]: shape must be a list of sizes"),
    ([{"name": "x", "datatype": "FP32", "shape": [True]}],
     "model-config.yaml: outputs[0]: shape must be a list of sizes"),
    ([{"name": "x", "datatype": "FP32", "shape": "3"}],
     "model-config.yaml: outputs[0]: shape must be a list of sizes"),
])
def test_malformed_tensor_metadata_is_a_bad_request_naming_the_key(entries: object,
                                                                   message: str) -> None:
    with pytest.raises(BadRequest) as refused:
        tensor_metadata({"outputs": entries}, "outputs")
    assert str(refused.value).startswith(message)


#: The cores the loader's placement may use (a GPU count that differs from it: GPUS, below).
CORES = 3


def _loader(tmp_path: Path, gpus: int = 0, **config: Any) -> ModelLoader:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    registry = ModelRegistry()
    # NoWorkers: a test that would start a worker process fails at once.
    return ModelLoader(ServerConfig(**config), run_dir, registry,
                       NoWorkers(GpuAssigner(gpus), None, registry.worker_count, cores=CORES),
                       Observers(), logging.getLogger(__name__))


def test_settings_layer_defaults_properties_yaml_and_request(tmp_path: Path) -> None:
    loader = _loader(
        tmp_path, default_workers_per_model=2, default_batch_size=1,
        default_max_batch_delay_ms=100, default_response_timeout_s=120,
        default_startup_timeout_s=90, job_queue_size=100,
        models=parse_models_json(
            '{"m": {"1.0": {"batchSize": 4, "maxBatchDelay": 50, "responseTimeout": 60,'
            ' "minWorkers": 3}}}'))
    model_config = {"batchSize": 8, "maxBatchDelay": 20, "batchPolicy": "fixed"}
    request = RegisterRequest(url="m.mar", settings=SettingsLayer(batch_size=16))

    settings = loader.settings("m", "1.0", request, model_config)

    assert settings == ModelSettings(
        batch_size=16,              # request
        max_batch_delay_ms=20,      # model-config.yaml
        min_workers=3,              # config.properties models=
        max_workers=3,              # follows min_workers
        response_timeout_s=60,      # config.properties models=
        startup_timeout_s=90,       # server default
        job_queue_size=100,         # server default
        batch_policy=PolicyName.FIXED)


def test_properties_models_apply_to_their_own_name_and_version_only(tmp_path: Path) -> None:
    loader = _loader(tmp_path, default_workers_per_model=1, default_batch_size=2,
                     models=parse_models_json('{"m": {"1.0": {"batchSize": 4}}}'))
    request = RegisterRequest(url="m.mar")
    assert loader.settings("m", "1.0", request, {}).batch_size == 4
    assert loader.settings("m", "2.0", request, {}).batch_size == 2
    assert loader.settings("other", "1.0", request, {}).batch_size == 2


#: A GPU count that differs from CORES, so the two rules give different answers.
GPUS = CORES + 1


@pytest.mark.parametrize(("workers", "gpus", "expected"), [
    (3, GPUS, 3),         # default_workers_per_model wins
    (0, GPUS, GPUS),      # else one per GPU
    (0, 0, CORES),        # else one per CPU core this process may use
])
def test_server_defaults_workers_rule(tmp_path: Path, workers: int, gpus: int,
                                      expected: int) -> None:
    loader = _loader(tmp_path, gpus, default_workers_per_model=workers)
    assert loader.server_defaults()["min_workers"] == expected


@pytest.mark.parametrize(("running", "expected"), [(0, 2), (4, 1), (5, 0)])
def test_server_defaults_workers_stay_within_the_caps(tmp_path: Path, running: int,
                                                      expected: int) -> None:
    """One worker per core is the server's own count, not one asked for: a pod on a big node
    with little memory gets what the caps leave (per model 2, per server 5) instead of a
    refusal."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    placement = NoWorkers(GpuAssigner(0), None, lambda: running, cores=CORES,
                          caps=WorkerCaps(per_model=2, per_server=5))
    loader = ModelLoader(ServerConfig(), run_dir, ModelRegistry(), placement,
                         Observers(), logging.getLogger(__name__))
    assert loader.server_defaults()["min_workers"] == expected
    # Asked for by the operator, it is not cut: a registration beyond the cap is refused.
    asked = ModelLoader(ServerConfig(default_workers_per_model=CORES), run_dir,
                        ModelRegistry(), placement, Observers(), logging.getLogger(__name__))
    assert asked.server_defaults()["min_workers"] == CORES


@pytest.mark.parametrize(("model_config", "message"), [
    ({"batchSize": "many"}, "model-config.yaml: batchSize must be an integer"),
    ({"responseTimeout": 0},
     "model-config.yaml: responseTimeout must be an integer in [1, 4294967], got 0"),
    ({"max_batch_size": 4, "maxBatchSize": 8}, "model-config.yaml: conflicting batch settings"),
])
def test_a_bad_model_config_value_is_a_bad_request(tmp_path: Path, model_config: dict[str, Any],
                                                   message: str) -> None:
    loader = _loader(tmp_path, default_workers_per_model=1)
    with pytest.raises(BadRequest) as refused:
        loader.settings("m", "1.0", RegisterRequest(url="m.mar"), model_config)
    assert str(refused.value).startswith(message)


# ---- the loader: registering a real archive, no worker started ---------------------------------


NO_WORKERS = SettingsLayer(min_workers=0)


def _store_loader(tmp_path: Path, model_store: Path, **config: Any) -> ModelLoader:
    return _loader(tmp_path, model_store=model_store, default_workers_per_model=1, **config)


def _unpacked(loader: ModelLoader) -> list[Path]:
    return sorted(loader.archive_dir.iterdir())


def test_register_unpacks_and_adds_then_unregister_removes(
        tmp_path: Path, model_store: Path, build_mar: Callable[..., Path]) -> None:
    config_file = tmp_path / "model-config.yaml"
    config_file.write_text("batchSize: 4\ninputs:\n  - {name: x, datatype: BYTES}\n")
    build_mar("echo", "echo", config_file=config_file)
    loader = _store_loader(tmp_path, model_store)

    async def scenario() -> None:
        model = await loader.register(RegisterRequest(url="echo.mar", settings=NO_WORKERS))
        assert loader.registry.get("echo") is model
        assert (model.name, model.version, model.workers) == ("echo", "1.0", [])
        assert model.settings.batch_size == 4
        assert model.tensors.inputs == [{"name": "x", "datatype": "BYTES", "shape": [-1]}]
        [unpacked] = _unpacked(loader)
        assert unpacked.name.startswith("echo-")
        assert (model.archive.model_dir / "echo.py").is_file()
        assert model.launch.load.model_dir == str(model.archive.model_dir)
        assert model.launch.load.batch_size == 4

        removed = await loader.unregister("echo")
        assert removed is model
        assert loader.registry.names() == []
        assert _unpacked(loader) == []

    run(scenario())


def test_register_under_another_name(tmp_path: Path, model_store: Path,
                                     build_mar: Callable[..., Path]) -> None:
    build_mar("echo", "echo")
    loader = _store_loader(tmp_path, model_store)
    model = run(loader.register(RegisterRequest(url="echo.mar", model_name="parrot",
                                                settings=NO_WORKERS)))
    assert model.name == "parrot"
    assert loader.registry.names() == ["parrot"]


def test_properties_models_can_make_a_later_version_the_default(
        tmp_path: Path, model_store: Path, build_mar: Callable[..., Path]) -> None:
    loader = _store_loader(tmp_path, model_store, models=parse_models_json(
        '{"echo": {"2.0": {"defaultVersion": true, "batchSize": 3}}}'))

    async def scenario() -> None:
        build_mar("echo", "echo", version="1.0")
        await loader.register(RegisterRequest(url="echo.mar", settings=NO_WORKERS))
        build_mar("echo", "echo", version="2.0")  # the same file name: a new archive
        newer = await loader.register(RegisterRequest(url="echo.mar", settings=NO_WORKERS))
        assert loader.registry.default_version("echo") == "2.0"
        assert newer.settings.batch_size == 3
        assert len(_unpacked(loader)) == 2
        with pytest.raises(Forbidden, match=r"Cannot remove default version 2\.0"):
            await loader.unregister("echo", "2.0")
        await loader.unregister("echo", "1.0")
        assert [m.version for m in loader.registry.versions("echo")] == ["2.0"]
        assert len(_unpacked(loader)) == 1

    run(scenario())


@pytest.mark.parametrize(("model_name", "model_config"), [
    ("bad name!", "{}\n"),
    ("-leading-dash", "{}\n"),
    (None, "maxBatchDelay: -5\n"),
    (None, "inputs: {name: x}\n"),
], ids=["name-with-space", "name-with-leading-dash", "bad-setting", "bad-tensors"])
def test_a_refused_registration_leaves_nothing_unpacked(
        tmp_path: Path, model_store: Path, build_mar: Callable[..., Path],
        model_name: str | None, model_config: str) -> None:
    config_file = tmp_path / "model-config.yaml"
    config_file.write_text(model_config)
    build_mar("echo", "echo", config_file=config_file)
    loader = _store_loader(tmp_path, model_store)
    with pytest.raises(BadRequest):
        run(loader.register(RegisterRequest(url="echo.mar", model_name=model_name,
                                            settings=NO_WORKERS)))
    assert _unpacked(loader) == []
    assert loader.registry.names() == []


def test_a_duplicate_version_is_refused_and_leaves_only_the_first_unpacked(
        tmp_path: Path, model_store: Path, build_mar: Callable[..., Path]) -> None:
    build_mar("echo", "echo")
    loader = _store_loader(tmp_path, model_store)

    async def scenario() -> None:
        first = await loader.register(RegisterRequest(url="echo.mar", settings=NO_WORKERS))
        with pytest.raises(Conflict, match=r"Model version 1\.0 is already registered"):
            await loader.register(RegisterRequest(url="echo.mar", settings=NO_WORKERS))
        assert _unpacked(loader) == [first.archive.model_dir]
        assert loader.registry.versions("echo") == [first]

    run(scenario())


def test_an_archive_missing_from_the_store_is_refused(tmp_path: Path,
                                                      model_store: Path) -> None:
    loader = _store_loader(tmp_path, model_store)
    with pytest.raises(ArchiveError, match="not found in the model store"):
        run(loader.register(RegisterRequest(url="absent.mar", settings=NO_WORKERS)))
    assert _unpacked(loader) == []
