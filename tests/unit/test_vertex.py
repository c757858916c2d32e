"""Vertex AI's ``AIP_*`` environment read into the config (frontend/config/vertex.py), its
model storage (frontend/models/storage.py), its routes in the route table, and the command
line's rule: no ``AIP_*`` (or ``--models`` given), nothing changes."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from frontend import cli
from frontend.api.http.routes import KSERVE_V1, RouteTable, vertex_routes
from frontend.config import load_config
from frontend.config.vertex import (
    DEFAULT_HEALTH_ROUTE,
    DEFAULT_PREDICT_ROUTE,
    VERTEX_MAX_REQUEST_SIZE,
    vertex_env,
)
from frontend.errors import ConfigError
from frontend.models.storage import model_folder

HEALTH = "/v1/endpoints/1/deployedModels/2"
PREDICT = HEALTH + ":predict"


def test_no_aip_variable_is_no_vertex_mode() -> None:
    assert vertex_env({"PATH": "/bin", "AIP_MODE": "  "}) is None


def test_the_variables_and_their_defaults() -> None:
    env = vertex_env({"AIP_STORAGE_URI": "gs://b/m", "AIP_ENDPOINT_ID": "1"})
    assert env is not None
    assert (env.http_port, env.health_route, env.predict_route, env.storage_uri) == (
        8080, DEFAULT_HEALTH_ROUTE, DEFAULT_PREDICT_ROUTE, "gs://b/m")
    assert env.recorded == {"AIP_ENDPOINT_ID": "1"}
    assert env.overrides("/models") == {
        "inference_address": "http://0.0.0.0:8080", "service_envelope": "json",
        "model_store": "/models", "load_models": "model=model.mar",
        "vertex_health_route": "/ping", "vertex_predict_route": "/predictions/model"}


@pytest.mark.parametrize(("variables", "message"), [
    ({"AIP_MODE": "TRAINING", "AIP_STORAGE_URI": "/m"}, "AIP_MODE='TRAINING'"),
    ({"AIP_HTTP_PORT": "8080"}, "AIP_STORAGE_URI is not set"),
    ({"AIP_HTTP_PORT": "80a", "AIP_STORAGE_URI": "/m"}, "AIP_HTTP_PORT='80a'"),
    ({"AIP_HTTP_PORT": "70000", "AIP_STORAGE_URI": "/m"}, "1 to 65535"),
    ({"AIP_PREDICT_ROUTE": "predict", "AIP_STORAGE_URI": "/m"}, "AIP_PREDICT_ROUTE='predict'"),
    ({"AIP_HEALTH_ROUTE": "/h?x=1", "AIP_STORAGE_URI": "/m"}, "without a query"),
    ({"AIP_HEALTH_ROUTE": "/r", "AIP_PREDICT_ROUTE": "/r", "AIP_STORAGE_URI": "/m"},
     "both '/r'"),
])
def test_a_value_vertex_would_not_set_is_a_config_error(variables: dict[str, str],
                                                        message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        vertex_env(variables)


def vertex_config(tmp_path: Path, file: str = "") -> tuple[Path, dict[str, str]]:
    env = vertex_env({"AIP_HTTP_PORT": "7080", "AIP_HEALTH_ROUTE": HEALTH,
                      "AIP_PREDICT_ROUTE": PREDICT, "AIP_STORAGE_URI": str(tmp_path)})
    assert env is not None
    path = tmp_path / "config.properties"
    path.write_text(file)
    return path, env.overrides(str(tmp_path))


def test_vertex_mode_config(tmp_path: Path) -> None:
    path, overrides = vertex_config(tmp_path, "inference_address=http://127.0.0.1:9000\n")
    config = load_config(path, {}, environ={}, vertex=overrides)
    assert (config.inference_address.host, config.inference_address.port) == ("0.0.0.0", 7080)
    assert (config.service_envelope, config.load_models) == ("json", ("model=model.mar",))
    assert (config.vertex_health_route, config.vertex_predict_route) == (HEALTH, PREDICT)
    assert config.max_request_size_bytes == VERTEX_MAX_REQUEST_SIZE == 1572864
    assert config.disable_token_authorization
    assert "Vertex AI" in config.token_authorization_off_by


def test_the_config_file_keeps_its_size_limit_and_tokens(tmp_path: Path) -> None:
    path, overrides = vertex_config(
        tmp_path, "max_request_size=10000000\ndisable_token_authorization=false\n")
    config = load_config(path, {}, environ={}, vertex=overrides)
    assert config.max_request_size_bytes == 10_000_000
    assert not config.disable_token_authorization


def test_without_vertex_nothing_changes(tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text("")
    config = load_config(path, {}, environ={})
    assert (config.vertex_health_route, config.vertex_predict_route) == ("", "")
    assert (config.service_envelope, config.max_request_size_bytes) == ("", 6553500)
    assert not any(route.name.startswith("vertex") for route in RouteTable.of(["inference"])
                   .routes)


def test_the_command_line_serves_aip_storage_and_models_win(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model.mar").write_bytes(b"PK")
    other = tmp_path / "store"
    other.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AIP_STORAGE_URI", str(tmp_path))
    monkeypatch.setenv("AIP_HTTP_PORT", "7080")
    config = cli.resolve_config(cli.build_parser().parse_args(
        ["--start", "--model-store", str(other)]))
    assert (config.model_store, config.load_models) == (tmp_path, ("model=model.mar",))
    assert config.inference_address.port == 7080
    # --models names the models: AIP_* changes nothing.
    plain = cli.resolve_config(cli.build_parser().parse_args(
        ["--start", "--model-store", str(other), "--models", "a=a.mar"]))
    assert (plain.model_store, plain.load_models, plain.service_envelope) == (
        other, ("a=a.mar",), "")
    assert plain.inference_address.port == 8080 and not plain.vertex_predict_route


def test_a_local_storage_folder_or_file_uri(tmp_path: Path) -> None:
    (tmp_path / "model.mar").write_bytes(b"PK")
    assert model_folder(str(tmp_path)) == tmp_path
    assert model_folder(tmp_path.as_uri()) == tmp_path
    with pytest.raises(ConfigError, match=r"no model\.mar in"):
        model_folder(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="expected gs://bucket/folder or a local folder"):
        model_folder("s3://bucket/m")


def test_gs_without_google_storage_library(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "google.cloud.storage", None)  # import fails
    with pytest.raises(ConfigError, match=r"pip install 'batchserve\[vertex\]'"):
        model_folder("gs://bucket/models/m")


class FakeBlob:
    """google-cloud-storage's Blob, as far as model_folder uses it."""

    def __init__(self, bucket: str, name: str, objects: dict[str, bytes]) -> None:
        self.key, self.objects = f"{bucket}/{name}", objects

    def download_to_filename(self, filename: str) -> None:
        if self.key not in self.objects:
            raise LookupError(f"404 No such object: {self.key}")
        Path(filename).write_bytes(self.objects[self.key])


def fake_storage(objects: dict[str, bytes]) -> types.ModuleType:
    module = types.ModuleType("google.cloud.storage")

    class Client:
        def bucket(self, name: str) -> types.SimpleNamespace:
            return types.SimpleNamespace(blob=lambda blob: FakeBlob(name, blob, objects))

    module.Client = Client  # type: ignore[attr-defined]
    return module


def test_gs_downloads_model_mar_under_the_uri(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    objects = {"bucket/models/m1/model.mar": b"PK archive"}
    monkeypatch.setitem(sys.modules, "google.cloud.storage", fake_storage(objects))
    folder = model_folder("gs://bucket/models/m1/", download_root=tmp_path)
    assert folder.parent == tmp_path
    assert (folder / "model.mar").read_bytes() == b"PK archive"
    with pytest.raises(ConfigError, match=r"cannot download gs://bucket/other/model.mar .*404"):
        model_folder("gs://bucket/other", download_root=tmp_path)


def test_the_routes_come_first_and_match_their_path_exactly() -> None:
    table = RouteTable.of(["inference"], first=vertex_routes(HEALTH, PREDICT, "model"))
    predict = table.resolve("POST", PREDICT)
    assert predict is not None and predict.route.name == "vertex-predict"
    assert (predict.name, predict.route.fast) == ("model", True)
    health = table.resolve("GET", HEALTH)
    assert health is not None and health.route.name == "vertex-health"
    # Any other /v1/... path is still KServe v1's.
    other = table.resolve("GET", HEALTH + "/x")
    assert other is not None and other.route is KSERVE_V1
    assert vertex_routes("", "", "model") == ()
