"""config.properties parsing: TorchServe keys, defaults, precedence and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend.config import Address, ServerConfig, build_config, load_config
from frontend.errors import ConfigError


def test_defaults_are_torchserve_defaults_and_local_only() -> None:
    config, unknown = build_config({})
    assert unknown == []
    assert config.inference_address == Address("127.0.0.1", 8080)
    assert config.management_address == Address("127.0.0.1", 8081)
    assert config.metrics_address == Address("127.0.0.1", 8082)
    assert (config.grpc_inference_port, config.grpc_management_port) == (7070, 7071)
    assert config.job_queue_size == 100
    assert config.default_response_timeout_s == 120
    assert config.max_request_size_bytes == config.max_response_size_bytes == 6553500
    assert config.enable_model_api is False
    assert config.allowed_urls == ()
    # Installing an archive's requirements runs its code: off unless asked for.
    assert config.install_py_dep_per_model is False


def test_properties_file_is_parsed_with_torchserve_keys(tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text(
        "# a comment\n"
        "inference_address=http://0.0.0.0:9080\n"
        "management_address = 127.0.0.1:9081\n"
        "grpc_inference_port=9070\n"
        "model_store=/models\n"
        "load_models=a.mar,b=b.mar\n"
        "default_workers_per_model=3\n"
        "job_queue_size=7\n"
        "number_of_gpu=2\n"
        "enable_model_api=true\n"
        "install_py_dep_per_model=true\n"
        "install_py_dep_timeout=90\n"
        'models={"noop": {"1.0": {"marName": "noop.mar", "batchSize": 4, '
        '"maxBatchDelay": 25, "minWorkers": 2, "defaultVersion": true}}}\n'
        "vmargs=-Xmx4g\n")
    config = load_config(path, {}, environ={})
    assert config.inference_address == Address("0.0.0.0", 9080)
    assert config.management_address == Address("127.0.0.1", 9081)
    assert config.grpc_inference_port == 9070
    assert config.model_store == Path("/models")
    assert config.load_models == ("a.mar", "b=b.mar")
    assert (config.default_workers_per_model, config.job_queue_size) == (3, 7)
    assert config.number_of_gpu == 2
    assert config.enable_model_api is True
    assert config.install_py_dep_per_model is True and config.install_py_dep_timeout_s == 90
    noop = config.models["noop"]["1.0"]
    assert noop.settings == {"batch_size": 4, "max_batch_delay_ms": 25, "min_workers": 2}
    assert noop.is_default_version


def test_later_sources_win_and_env_needs_enable_envvars_config(tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text("job_queue_size=5\n")
    env = {"TS_JOB_QUEUE_SIZE": "9"}
    assert load_config(path, {}, environ=env).job_queue_size == 5
    path.write_text("job_queue_size=5\nenable_envvars_config=true\n")
    assert load_config(path, {}, environ=env).job_queue_size == 9
    assert load_config(path, {"job_queue_size": "11"}, environ=env).job_queue_size == 11


@pytest.mark.parametrize(("key", "value"), [
    ("job_queue_size", "many"),
    ("job_queue_size", "0"),
    ("inference_address", "http://127.0.0.1"),
    ("inference_address", "ftp://127.0.0.1:21"),
    ("grpc_inference_port", "70000"),
    ("enable_model_api", "maybe"),
    ("install_py_dep_per_model", "sometimes"),
    ("install_py_dep_timeout", "0"),
    ("models", "{not json"),
    ("models", '{"m": {"1.0": {"batchSize": "eight"}}}'),
    ("allowed_urls", "file://(unclosed"),
    ("metrics_mode", "carrier-pigeon"),
])
def test_bad_values_name_the_key(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build_config({key: value})


def test_unknown_keys_are_reported_not_silently_dropped(caplog: pytest.LogCaptureFixture,
                                                        tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text("job_queue_sise=5\nnumber_of_netty_threads=4\n")
    load_config(path, {}, environ={})
    assert "job_queue_sise" in caplog.text
    assert "number_of_netty_threads" not in caplog.text


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.properties", {}, environ={})


def test_server_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        ServerConfig().job_queue_size = 3  # type: ignore[misc]
