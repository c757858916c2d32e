"""ManagementOps (frontend/ops/management.py) on a server's real services, without workers:
every model is registered or scaled with 0 workers, so no process starts and nothing listens.

What both transports answer (TorchServe's message texts, describe's names, the refusals and
the parameter they name) and that every change is in the next snapshot.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from frontend.errors import BadRequest, Forbidden, MethodNotAllowed, ModelNotFound, ServeError
from frontend.models.loader import RegisterRequest
from frontend.models.snapshot import SUFFIX, restore_requests
from frontend.ops.management import ManagementOps
from frontend.ops.services import Services
from frontend.settings import PolicyName
from tests.unit.services import run_with_services

#: Settings as restore_requests() reads them from a snapshot, by ModelSettings field name.
RESTORED = ("min_workers", "max_workers", "batch_size", "max_batch_delay_ms",
            "response_timeout_s", "startup_timeout_s", "batch_policy")


def _refusal(error: type[ServeError], status: int, match: str) -> Any:
    """pytest.raises for ``error``, whose message contains ``match``, and whose class answers
    HTTP ``status``."""
    assert error.http_status == status
    return pytest.raises(error, match=re.escape(match))


async def _register(ops: ManagementOps, url: str, **params: str) -> tuple[int, Any]:
    return await ops.register({"url": url, "initial_workers": "0", **params})


def test_register_without_workers_answers_torchserve_text(build_mar, model_store: Path,
                                                           tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        status, body = await _register(ManagementOps(services), "echo.mar")
        assert status == 200
        assert body == {"status": 'Model "echo" Version: 1.0 registered with 0 initial '
                                  "workers. Use scale workers API to add workers for the "
                                  "model."}
        model = services.registry.get("echo")
        assert model.workers == [] and model.settings.min_workers == 0

    run_with_services(tmp_path, model_store, test)


def test_an_asynchronous_registration_with_no_worker_to_start_is_200(
        build_mar, model_store: Path, tmp_path: Path) -> None:
    """TorchServe's rule: 202 only while workers start in the background."""
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        status, body = await _register(ManagementOps(services), "echo.mar",
                                       synchronous="false")
        assert status == 200
        assert "registered with 0 initial workers" in body["status"]

    run_with_services(tmp_path, model_store, test)


def test_register_is_405_while_the_model_api_is_disabled(build_mar, model_store: Path,
                                                          tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        with _refusal(MethodNotAllowed, 405, "--enable-model-api"):
            await _register(ManagementOps(services), "echo.mar")
        assert services.registry.names() == []

    run_with_services(tmp_path, model_store, test, enable_model_api=False)


@pytest.mark.parametrize(("params", "match"), [
    ({}, "Parameter url is required"),
    ({"url": ""}, "Parameter url is required"),
    ({"url": "echo.mar", "runtime": "java"}, "unsupported runtime 'java'"),
    ({"url": "echo.mar", "batch_size": "zero"},
     "batch_size must be an integer in [1, 2147483647], got 'zero'"),
    ({"url": "echo.mar", "batch_size": "0"},
     "batch_size must be an integer in [1, 2147483647], got 0"),
    ({"url": "echo.mar", "max_batch_delay": "-1"},
     "max_batch_delay must be an integer in [0, 2147483647], got -1"),
    ({"url": "echo.mar", "initial_workers": "many"}, "initial_workers must be an integer"),
    ({"url": "echo.mar", "batch_policy": "greedy"}, "batch_policy must be one of"),
    ({"url": "echo.mar", "max_batch_size": "4", "maxBatchSize": "8"},
     "conflicting batch settings: max_batch_size=4, maxBatchSize=8"),
    ({"url": "echo.mar", "max_batch_time": "0.5", "maxLatency": "20"},
     "conflicting batch settings: max_batch_time=500, maxLatency=20"),
    ({"url": "echo.mar", "synchronous": "maybe"}, "parameter synchronous must be true or false"),
])
def test_a_bad_registration_is_400_naming_the_parameter(
        build_mar, model_store: Path, tmp_path: Path, params: dict[str, str],
        match: str) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        with _refusal(BadRequest, 400, match):
            await ManagementOps(services).register(params)
        assert services.registry.names() == []

    run_with_services(tmp_path, model_store, test)


def test_agreeing_aliases_set_the_batch_settings(build_mar, model_store: Path,
                                                 tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        await _register(ManagementOps(services), "echo.mar", max_batch_size="8",
                        maxBatchSize="8", max_batch_time="0.02")
        settings = services.registry.get("echo").settings
        assert (settings.batch_size, settings.max_batch_delay_ms) == (8, 20)

    run_with_services(tmp_path, model_store, test)


def test_describe_answers_torchserve_names(build_mar, model_store: Path,
                                           tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        ops = ManagementOps(services)
        await _register(ops, "echo.mar", batch_size="4", max_batch_delay="25",
                        response_timeout="7", startup_timeout="9", batch_policy="fixed")
        [body] = await ops.describe("echo", None, customized=False)
        assert body["modelName"] == "echo"
        assert body["modelVersion"] == "1.0"
        assert body["modelUrl"] == "echo.mar"
        assert body["runtime"] == "python"
        assert (body["minWorkers"], body["maxWorkers"]) == (0, 0)
        assert (body["batchSize"], body["maxBatchDelay"]) == (4, 25)
        assert (body["responseTimeout"], body["startupTimeout"]) == (7, 9)
        assert body["loadedAtStartup"] is False
        assert body["status"] == "Healthy"
        assert body["workers"] == []
        assert body["jobQueueStatus"] == {"remainingCapacity": 100, "pendingRequests": 0}
        assert body["batching"]["policy"] == "fixed"
        assert body["batching"]["batchesTotal"] == 0
        assert body["batching"]["meanBatchSize"] == 0.0
        assert "openSequences" not in body["batching"]
        assert "deviceIds" not in body
        assert (body["stateful"], body["maxNumSequence"]) == (False, 0)

    run_with_services(tmp_path, model_store, test)


def test_a_stateful_model_describes_its_sequences_and_needs_an_idle_time(
        build_mar, model_store: Path, tmp_path: Path) -> None:
    stateful = tmp_path / "stateful.yaml"
    stateful.write_text("sequenceBatching: true\nsequenceMaxIdleMSec: 5000\n"
                        "maxNumSequence: 8\nmaxSequenceJobQueueSize: 3\n")
    build_mar("stateful", "stateful", config_file=stateful)
    forever = tmp_path / "forever.yaml"
    forever.write_text("sequenceBatching: true\n")
    build_mar("forever", "stateful", config_file=forever)

    async def test(services: Services) -> None:
        ops = ManagementOps(services)
        await _register(ops, "stateful.mar")
        [body] = await ops.describe("stateful", None, customized=False)
        assert {key: body[key] for key in ("stateful", "sequenceMaxIdleMSec",
                                           "sequenceTimeoutMSec", "maxNumSequence",
                                           "maxSequenceJobQueueSize")} == {
            "stateful": True, "sequenceMaxIdleMSec": 5000, "sequenceTimeoutMSec": 0,
            "maxNumSequence": 8, "maxSequenceJobQueueSize": 3}
        assert body["batching"]["openSequences"] == 0
        with _refusal(BadRequest, 400, "sequenceBatching needs sequenceMaxIdleMSec > 0"):
            await _register(ops, "forever.mar")

    run_with_services(tmp_path, model_store, test)


def _two_versions(build_mar: Callable[..., Path]) -> None:
    """multi-1.mar and multi-2.mar: versions 1.0 and 2.0 of the model ``multi``."""
    for number in (1, 2):
        archive = build_mar("multi", "echo", version=f"{number}.0")
        archive.rename(archive.with_name(f"multi-{number}.mar"))


def test_describe_all_versions_and_unknown_models(build_mar, model_store: Path,
                                                  tmp_path: Path) -> None:
    _two_versions(build_mar)

    async def test(services: Services) -> None:
        ops = ManagementOps(services)
        await _register(ops, "multi-1.mar")
        await _register(ops, "multi-2.mar")
        described = await ops.describe("multi", "all", customized=False)
        assert [d["modelVersion"] for d in described] == ["1.0", "2.0"]
        [default] = await ops.describe("multi", None, customized=False)
        assert default["modelVersion"] == "1.0"  # the first registered
        with _refusal(ModelNotFound, 404, "Model not found: nothing"):
            await ops.describe("nothing", None, customized=False)

    run_with_services(tmp_path, model_store, test)


def test_list_models_pages(build_mar, model_store: Path, tmp_path: Path) -> None:
    for name in ("c", "a", "b"):
        build_mar(name, "echo")

    async def test(services: Services) -> None:
        ops = ManagementOps(services)
        for name in ("c", "a", "b"):
            await _register(ops, f"{name}.mar")

        def names(params: dict[str, str]) -> tuple[list[object], object]:
            body = ops.list_models(params)
            return [m["modelName"] for m in body["models"]], body.get(  # type: ignore[attr-defined]
                "nextPageToken")

        assert ops.list_models({}) == {"models": [
            {"modelName": name, "modelUrl": f"{name}.mar"} for name in ("a", "b", "c")]}
        assert names({"limit": "2"}) == (["a", "b"], "2")
        assert names({"limit": "2", "next_page_token": "2"}) == (["c"], None)
        assert names({"limit": "1", "next_page_token": "1"}) == (["b"], "2")
        assert names({"next_page_token": "3"}) == ([], None)
        assert names({"next_page_token": "30"}) == ([], None)
        for limit in ("0", "-5", "101", ""):  # out of bounds or empty: TorchServe's 100
            assert names({"limit": limit}) == (["a", "b", "c"], None)
        assert names({"limit": "3"}) == (["a", "b", "c"], None)  # no token for an empty page

    run_with_services(tmp_path, model_store, test)


@pytest.mark.parametrize(("params", "match"), [
    ({"next_page_token": "-1"},
     "parameter next_page_token must be an integer in [0, 2147483647], got -1"),
    ({"next_page_token": "next"}, "parameter next_page_token must be an integer"),
    ({"limit": "ten"}, "parameter limit must be an integer"),
])
def test_list_models_refuses_bad_paging(tmp_path: Path, params: dict[str, str],
                                        match: str) -> None:
    async def test(services: Services) -> None:
        with _refusal(BadRequest, 400, match):
            ManagementOps(services).list_models(params)

    run_with_services(tmp_path, None, test)


@pytest.mark.parametrize(("params", "match"), [
    ({"min_worker": "2", "max_worker": "1"}, "max_worker cannot be less than min_worker."),
    ({"min_worker": "0", "number_gpu": "-1"},
     "parameter number_gpu must be an integer in [0, 2147483647], got -1"),
    ({"min_worker": "-1"}, "parameter min_worker must be an integer in [0, 2147483647], got -1"),
    ({"min_worker": "0", "timeout": "soon"}, "parameter timeout must be an integer"),
    ({"min_worker": "one"}, "parameter min_worker must be an integer"),
    ({"min_worker": "0", "synchronous": "perhaps"}, "parameter synchronous must be true"),
])
def test_scale_refusals_name_the_parameter(build_mar, model_store: Path, tmp_path: Path,
                                           params: dict[str, str], match: str) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        ops = ManagementOps(services)
        await _register(ops, "echo.mar", batch_size="2")
        before = services.registry.get("echo").settings
        with _refusal(BadRequest, 400, match):
            await ops.scale("echo", None, params)
        model = services.registry.get("echo")
        assert model.settings == before and model.workers == []

    run_with_services(tmp_path, model_store, test)


def test_scale_keeps_both_bounds_without_starting_workers(build_mar, model_store: Path,
                                                          tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        ops = ManagementOps(services)
        await _register(ops, "echo.mar")
        assert await ops.scale("echo", None, {"min_worker": "0", "max_worker": "3"}) == \
            (202, {"status": "Processing worker updates..."})
        settings = services.registry.get("echo").settings
        assert (settings.min_workers, settings.max_workers) == (0, 3)
        assert await ops.scale("echo", "1.0", {"min_worker": "0", "synchronous": "true"}) == \
            (200, {"status": "Workers scaled to 0 for model: echo, version: 1.0"})
        settings = services.registry.get("echo").settings
        assert (settings.min_workers, settings.max_workers) == (0, 0)
        assert services.registry.get("echo").workers == []
        with _refusal(ModelNotFound, 404, "Model not found: other"):
            await ops.scale("other", None, {"min_worker": "0"})

    run_with_services(tmp_path, model_store, test)


def test_set_default_and_unregister_messages(build_mar, model_store: Path,
                                             tmp_path: Path) -> None:
    _two_versions(build_mar)

    async def test(services: Services) -> None:
        ops = ManagementOps(services)
        await _register(ops, "multi-1.mar")
        await _register(ops, "multi-2.mar")
        assert ops.set_default("multi", "2.0") == {
            "status": 'Default version successfully updated for model "multi" to "2.0"'}
        assert services.registry.default_version("multi") == "2.0"
        with _refusal(Forbidden, 403, "Cannot remove default version 2.0"):
            await ops.unregister("multi", "2.0")
        assert await ops.unregister("multi", "1.0") == {
            "status": 'Model "multi" version "1.0" unregistered'}
        assert await ops.unregister("multi", None) == {"status": 'Model "multi" unregistered'}
        assert services.registry.names() == []
        assert list(services.loader.archive_dir.iterdir()) == []  # unpacked archives gone
        with _refusal(ModelNotFound, 404, "Model not found: multi"):
            await ops.unregister("multi", None)

    run_with_services(tmp_path, model_store, test)


def test_unregister_is_405_while_the_model_api_is_disabled(build_mar, model_store: Path,
                                                            tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        # Startup models register without the model API.
        await services.loader.register(RegisterRequest(url="echo.mar",
                                                       settings={"min_workers": 0}))
        with _refusal(MethodNotAllowed, 405, "Model API is disabled"):
            await ManagementOps(services).unregister("echo", None)
        assert services.registry.names() == ["echo"]

    run_with_services(tmp_path, model_store, test, enable_model_api=False)


def _restored(services: Services) -> tuple[dict[tuple[str, str], dict[str, object]],
                                            dict[str, str]]:
    """The latest snapshot as the next start would register it: (name, url) -> settings."""
    document = services.snapshots.latest()
    assert document is not None
    requests, defaults = restore_requests(document)
    return {(r.model_name or "", r.url): {**r.settings, "handler": r.handler}
            for r in requests}, defaults


def _in_force(services: Services) -> dict[tuple[str, str], dict[str, object]]:
    """The settings of every registered model, as a snapshot should carry them."""
    return {(m.name, m.archive.url): {**{f: getattr(m.settings, f) for f in RESTORED},
                                      "handler": m.handler}
            for m in services.registry}


def test_every_change_is_in_the_next_snapshot(build_mar, model_store: Path,
                                              tmp_path: Path) -> None:
    _two_versions(build_mar)

    async def test(services: Services) -> None:
        ops = ManagementOps(services)
        assert services.snapshots.latest() is None

        await _register(ops, "multi-1.mar", batch_size="4", max_batch_delay="30",
                        batch_policy="fixed", response_timeout="5", startup_timeout="6")
        restored, defaults = _restored(services)
        assert restored == _in_force(services)
        assert restored[("multi", "multi-1.mar")]["batch_policy"] is PolicyName.FIXED
        assert defaults == {"multi": "1.0"}

        await _register(ops, "multi-2.mar")
        await ops.scale("multi", "2.0", {"min_worker": "0", "max_worker": "5"})
        restored, defaults = _restored(services)
        assert restored == _in_force(services)
        assert restored[("multi", "multi-2.mar")]["max_workers"] == 5
        assert defaults == {"multi": "1.0"}

        ops.set_default("multi", "2.0")
        assert _restored(services) == (_in_force(services), {"multi": "2.0"})

        await ops.unregister("multi", "1.0")
        assert _restored(services) == (_in_force(services), {"multi": "2.0"})
        await ops.unregister("multi", None)
        assert _restored(services) == ({}, {})

        files = sorted(services.snapshots.folder.glob(f"*{SUFFIX}"))
        assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)

    run_with_services(tmp_path, model_store, test)


def test_no_snapshot_is_written_when_snapshots_are_disabled(build_mar, model_store: Path,
                                                            tmp_path: Path) -> None:
    build_mar("echo", "echo")

    async def test(services: Services) -> None:
        ops = ManagementOps(services)
        await _register(ops, "echo.mar")
        await ops.scale("echo", None, {"min_worker": "0"})
        await ops.unregister("echo", None)
        assert not services.snapshots.folder.exists()

    run_with_services(tmp_path, model_store, test, snapshot_disabled=True)
