"""config.properties parsing: TorchServe keys, defaults, precedence and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from frontend.config import Address, ServerConfig, build_config, load_config
from frontend.errors import ConfigError

KSERVE_CONFIG = Path(__file__).resolve().parents[1] / "fixtures" / "kserve" / "config.properties"


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
    # Issue 26's phases and reasons are kept unless turned off; Server-Timing is asked for.
    assert config.request_phases is True and config.dispatch_stats is True
    assert config.server_timing == "off"


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
        "request_phases=false\n"
        "dispatch_stats=false\n"
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
    assert config.request_phases is False and config.dispatch_stats is False
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
    ("inference_address", "http://127.0.0.1:99999"),
    ("inference_address", "ftp://127.0.0.1:21"),
    ("grpc_inference_port", "70000"),
    ("enable_model_api", "maybe"),
    ("install_py_dep_per_model", "sometimes"),
    ("install_py_dep_timeout", "0"),
    ("models", "{not json"),
    ("models", '{"m": {"1.0": {"batchSize": "eight"}}}'),
    ("allowed_urls", "file://(unclosed"),
    ("metrics_mode", "carrier-pigeon"),
    ("service_envelope", "seldon"),
    ("kserve_protocol", "v3"),
    ("kserve_grpc_port", "99999"),
    ("drain_timeout", "-1"),
    ("worker_start", "thread"),
    ("fork_preload", "torch, not a module"),
    # The server's defaults of model settings, within the settings' ranges (issue 31).
    ("batch_size", "2147483648"),
    ("max_batch_delay", "1e300"),
    ("default_response_timeout", "4294968"),
    ("default_startup_timeout", "nan"),
    ("default_workers_per_model", "99999999999"),
    ("models", '{"m": {"1.0": {"batchSize": 2147483648}}}'),
    ("max_workers_per_model", "0"),
    ("max_workers_per_server", "-1"),
])
def test_bad_values_name_the_key(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build_config({key: value})


def test_workers_are_forked_unless_the_config_says_spawn() -> None:
    assert build_config({})[0].worker_start == "fork"
    config, _ = build_config({"worker_start": " Spawn ", "fork_preload": "transformers, a.b"})
    assert config.worker_start == "spawn"
    assert config.fork_preload == ("transformers", "a.b")
    # A model's model-config.yaml says workerStart, over the server's worker_start.
    from frontend.settings import Source, read_layer
    assert read_layer({"workerStart": "spawn"}, Source.YAML) == {"worker_start": "spawn"}
    with pytest.raises(ValueError, match="workerStart"):
        read_layer({"workerStart": "clone"}, Source.YAML)


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


# ---- KServe's TorchServe runtime ----------------------------------------------------------------

#: What KServe's kserve-torchserve runtime passes: its args' model store, its env.
RUNTIME_ARGS = {"model_store": "/mnt/models/model-store"}


def test_kserves_documented_config_and_env_are_read_verbatim(
        caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(KSERVE_CONFIG, RUNTIME_ARGS, environ={
        "TS_SERVICE_ENVELOPE": "kservev2", "PROTOCOL_VERSION": "grpc-v2"})
    assert "unknown key" not in caplog.text
    assert config.inference_address == config.management_address == Address("0.0.0.0", 8085)
    assert (config.service_envelope, config.kserve_protocol) == ("kservev2", "grpc-v2")
    assert (config.kserve_rest_port, config.kserve_grpc_port) == (8080, 8081)
    assert config.metrics_mode == "prometheus"  # metrics_format is metrics_mode
    assert config.model_snapshot is not None and list(config.model_snapshot["models"]) == ["mnist"]
    # KServe's clients send no token: under KServe tokens are off unless the config says so.
    assert config.disable_token_authorization


def test_the_envelope_variable_needs_enable_envvars_config_as_in_torchserve(
        tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text("job_queue_size=10\n")
    assert load_config(path, {}, environ={"TS_SERVICE_ENVELOPE": "kserve"}).service_envelope == ""


def test_tokens_stay_on_under_kserve_when_the_config_says_so(tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text(KSERVE_CONFIG.read_text() + "disable_token_authorization=false\n")
    config = load_config(path, RUNTIME_ARGS, environ={"PROTOCOL_VERSION": "v1"})
    assert not config.disable_token_authorization
    assert not load_config(KSERVE_CONFIG, RUNTIME_ARGS, environ={}).disable_token_authorization


def test_a_bad_protocol_version_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="PROTOCOL_VERSION='v3'"):
        load_config(KSERVE_CONFIG, RUNTIME_ARGS, environ={"PROTOCOL_VERSION": "v3"})


def test_protocol_version_needs_enable_envvars_config(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A stray PROTOCOL_VERSION outside KServe opens no listener and leaves tokens on."""
    path = tmp_path / "config.properties"
    path.write_text("management_address=http://127.0.0.1:8085\n")
    config = load_config(path, {}, environ={"PROTOCOL_VERSION": "v1"})
    assert config.kserve_protocol == "" and not config.disable_token_authorization
    assert "PROTOCOL_VERSION=v1 ignored" in caplog.text
    path.write_text("management_address=http://127.0.0.1:8085\nenable_envvars_config=true\n")
    config = load_config(path, {}, environ={"PROTOCOL_VERSION": "v1"})
    assert config.kserve_protocol == "v1" and config.disable_token_authorization


def test_kserves_grpc_port_must_not_be_another_listeners(tmp_path: Path) -> None:
    # TorchServe's default management port is KServe's gRPC port.
    path = tmp_path / "config.properties"
    path.write_text("enable_envvars_config=true\n")
    with pytest.raises(ConfigError, match="management_address"):
        load_config(path, {}, environ={"PROTOCOL_VERSION": "v2"})
    with pytest.raises(ConfigError, match="grpc_management_port"):
        build_config({"kserve_protocol": "v1", "management_address": "http://127.0.0.1:8085",
                      "grpc_management_port": "8081"})
    with pytest.raises(ConfigError, match="grpc_inference_port"):
        build_config({"kserve_protocol": "v1", "management_address": "http://127.0.0.1:8085",
                      "grpc_inference_port": "8080"})
    # The same port as the listener that serves the same protocol is shared, not a clash.
    config, _ = build_config({"kserve_protocol": "v1", "management_address":
                              "http://127.0.0.1:8085", "grpc_inference_port": "8081"})
    assert config.kserve_rest_port == config.inference_address.port == 8080


def test_a_model_snapshot_in_the_config_wins_over_load_models(tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text(KSERVE_CONFIG.read_text() + "load_models=all\n")
    assert load_config(path, RUNTIME_ARGS, environ={}).load_models == ()
    with_models = load_config(path, {**RUNTIME_ARGS, "load_models": "x.mar"}, environ={})
    assert with_models.load_models == ("x.mar",)


def test_metrics_format_is_metrics_mode() -> None:
    assert build_config({"metrics_format": "log"})[0].metrics_mode == "log"
    with pytest.raises(ConfigError, match="metrics_mode"):
        build_config({"metrics_format": "graphite"})


def test_what_turned_token_authorization_off_is_named(tmp_path: Path) -> None:
    properties = tmp_path / "config.properties"
    properties.write_text("enable_envvars_config=true\n")
    assert load_config(properties, {}, {}).token_authorization_off_by == ""
    assert load_config(properties, {"disable_token_authorization": "true"}, {}) \
        .token_authorization_off_by == "--disable-token-auth"
    assert load_config(properties, {}, {"TS_DISABLE_TOKEN_AUTHORIZATION": "true"}) \
        .token_authorization_off_by == "TS_DISABLE_TOKEN_AUTHORIZATION=true"
    properties.write_text("enable_envvars_config=true\nmanagement_address=http://127.0.0.1:8085\n")
    assert "PROTOCOL_VERSION" in load_config(properties, {}, {"PROTOCOL_VERSION": "v2"}) \
        .token_authorization_off_by
    properties.write_text("disable_token_authorization=true\n")
    assert load_config(properties, {}, {}).token_authorization_off_by == \
        f"disable_token_authorization=true in {properties}"
    assert load_config(properties, {"disable_token_authorization": "true"}, {}) \
        .token_authorization_off_by == "--disable-token-auth"


def test_torchserve_metrics_keys() -> None:
    config, unknown = build_config({
        "metrics_mode": " Prometheus ", "metrics_config": "conf/metrics.yaml",
        "model_metrics_auto_detect": "true", "disable_system_metrics": "true",
        "metric_time_interval": "5"})
    assert unknown == []
    assert config.metrics_mode == "prometheus"  # TorchServe ignores case and spaces
    # Relative to the working directory, as TorchServe resolves it.
    assert config.metrics_config == Path("conf/metrics.yaml").resolve()
    assert (config.model_metrics_auto_detect, config.disable_system_metrics,
            config.metric_time_interval_s) == (True, True, 5)
    defaults = ServerConfig()
    assert (defaults.metrics_config, defaults.model_metrics_auto_detect,
            defaults.disable_system_metrics, defaults.metric_time_interval_s) == (
        None, False, False, 60)
    with pytest.raises(ConfigError, match="metric_time_interval"):
        build_config({"metric_time_interval": "0"})


# ---- files as the SageMaker toolkit writes them ----------------------------------------------


def test_a_line_glued_to_the_next_reads_as_the_two_lines_it_meant(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The toolkit appends to a default file that has no final newline."""
    path = tmp_path / "ts.properties"
    path.write_text("disable_token_authorization=true\n"
                    "enable_model_api=truedefault_response_timeout=60\n"
                    "default_workers_per_model=3number_of_gpu=0\n")
    config = load_config(path, {}, environ={})
    assert config.enable_model_api is True
    assert config.default_response_timeout_s == 60
    assert config.default_workers_per_model == 3
    assert config.number_of_gpu == 0
    assert "reads as two lines" in caplog.text


def test_a_value_is_split_only_where_its_key_refuses_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "ts.properties"
    # A string key takes the whole value; an unknown key glued on is not split off.
    path.write_text("default_service_handler=service.py:handledefault_response_timeout=60\n")
    assert load_config(path, {}, environ={}).default_service_handler == \
        "service.py:handledefault_response_timeout=60"
    path.write_text("enable_model_api=truenot_a_key=1\n")
    with pytest.raises(ConfigError, match="enable_model_api"):
        load_config(path, {}, environ={})
    # The glued key set on a line of its own too: which one was meant is unclear, so no split.
    path.write_text("enable_model_api=truedefault_response_timeout=60\n"
                    "default_response_timeout=30\n")
    with pytest.raises(ConfigError, match="enable_model_api"):
        load_config(path, {}, environ={})


def test_a_variables_value_is_never_split_into_keys(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Glued lines are split as the file is written: a variable's value that holds
    ``key=value`` stays its own key's value, which then refuses it, naming the key."""
    path = tmp_path / "ts.properties"
    cases = [
        ("enable_model_api=$$FLAG$$\n", {"FLAG": "trueallowed_urls=.*"}, "enable_model_api"),
        ("default_workers_per_model=$$WORKERS$$\n", {"WORKERS": "3allowed_urls=.*"},
         "default_workers_per_model"),
        # Two references side by side: the split would fall between the variables' values.
        ("enable_model_api=$$FLAG$$$$REST$$\n",
         {"FLAG": "true", "REST": "allowed_urls=.*"}, "enable_model_api"),
        # A line glued in the file's text, the variable after it holding a third line.
        ("enable_model_api=$$FLAG$$default_response_timeout=$$TIMEOUT$$\n",
         {"FLAG": "true", "TIMEOUT": "60allowed_urls=.*"}, "default_response_timeout"),
        # Read before the rest of the file: a clear error too, not a traceback.
        ("enable_envvars_config=$$FLAG$$\n", {"FLAG": "truedefault_workers_per_model=9"},
         "enable_envvars_config"),
    ]
    for text, environ, key in cases:
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"config key {key}="):
            load_config(path, {}, environ=environ)
    # The one split logged is the file's own glued line; no variable's value is in the log.
    assert caplog.text.count("reads as two lines") == 1
    assert "allowed_urls" not in caplog.text and "=9" not in caplog.text


def test_a_line_glued_in_the_files_own_text_is_split_around_its_references(
        tmp_path: Path) -> None:
    path = tmp_path / "ts.properties"
    path.write_text("enable_model_api=$$FLAG$$default_response_timeout=$$TIMEOUT$$\n"
                    "default_workers_per_model=$$WORKERS$$number_of_gpu=0\n")
    config = load_config(path, {}, environ={"FLAG": "true", "TIMEOUT": "60", "WORKERS": "3"})
    assert config.enable_model_api is True and config.default_response_timeout_s == 60
    assert config.default_workers_per_model == 3 and config.number_of_gpu == 0
    assert config.allowed_urls == ()


def test_a_variables_value_is_put_in_as_it_is(tmp_path: Path) -> None:
    """Never searched for references itself, nor read as a replacement pattern (TorchServe's
    Java ``appendReplacement`` reads ``$1`` and ``\\`` in it)."""
    path = tmp_path / "ts.properties"
    path.write_text("default_service_handler=$$HANDLER$$:handle\n")
    for value in ("$$SECRET$$", "a$1b", "C:\\h\\x", "svc.pyallowed_urls=.*"):
        config = load_config(path, {}, environ={"HANDLER": value, "SECRET": "leaked"})
        assert config.default_service_handler == f"{value}:handle"
        assert config.allowed_urls == ()


def test_a_variable_in_a_json_value_never_changes_its_shape(tmp_path: Path) -> None:
    """``models=`` JSON: a variable in a string is that string's text (quotes and backslashes
    included); elsewhere it must be one JSON value; the whole value may come from one."""
    path = tmp_path / "ts.properties"
    path.write_text('models={"m": {"1.0": {"marName": "$$MAR$$", "batchSize": $$BATCH$$, '
                    '"defaultVersion": true}}}\n')
    injected = 'm.mar", "minWorkers": 64, "x": "C:\\models\\m'
    config = load_config(path, {}, environ={"MAR": injected, "BATCH": "4"})
    assert config.models["m"]["1.0"].settings == {"batch_size": 4}
    for batch in ('4, "minWorkers": 64', "4}}, \"n\": {\"1.0\": {", "[1"):
        with pytest.raises(ConfigError, match="config key models: environment variable "
                                              "BATCH is not one JSON value"):
            load_config(path, {}, environ={"MAR": "m.mar", "BATCH": batch})
    whole = '{"m": {"1.0": {"batchSize": 8, "minWorkers": 2}}}'
    path.write_text("models=$$MODELS$$\n")
    config = load_config(path, {}, environ={"MODELS": whole})
    assert config.models["m"]["1.0"].settings == {"batch_size": 8, "min_workers": 2}


def test_a_ts_variable_is_its_one_keys_value(tmp_path: Path) -> None:
    """``TS_<KEY>`` (enable_envvars_config=true) sets its key alone: a value that holds
    ``key=value`` is refused by that key, never read as a second key."""
    path = tmp_path / "ts.properties"
    path.write_text("enable_envvars_config=true\n")
    with pytest.raises(ConfigError, match="config key enable_model_api="):
        load_config(path, {}, environ={"TS_ENABLE_MODEL_API": "trueallowed_urls=.*"})
    config = load_config(path, {}, environ={"TS_DEFAULT_SERVICE_HANDLER": "h.pyallowed_urls=.*"})
    assert config.default_service_handler == "h.pyallowed_urls=.*"
    assert config.allowed_urls == ()


def test_environment_references_in_values_are_resolved(tmp_path: Path) -> None:
    path = tmp_path / "ts.properties"
    path.write_text("default_service_handler=$$SAGEMAKER_HANDLER$$:handle\n")
    config = load_config(path, {}, environ={"SAGEMAKER_HANDLER": "/opt/service.py"})
    assert config.default_service_handler == "/opt/service.py:handle"
    with pytest.raises(ConfigError, match="SAGEMAKER_HANDLER"):
        load_config(path, {}, environ={})


# ---- residency limits (docs/residency.md) ---------------------------------------------------


@pytest.mark.parametrize(("text", "size"), [
    ("8GiB", 8 * 1024**3), ("500MB", 500 * 10**6), ("1048576", 1048576), (" 1.5 gib ", 3 << 29),
    ("64k", 65536), ("2TB", 2 * 10**12), ("", None)])
def test_residency_budgets_read_sizes_with_units(text: str, size: int | None) -> None:
    config, _ = build_config({"max_loaded_memory": text, "gpu_memory_budget": text,
                              "max_loaded_models": "6"})
    assert config.max_loaded_memory_bytes == config.gpu_memory_budget_bytes == size
    assert config.max_loaded_models == 6


@pytest.mark.parametrize(("key", "value"), [
    ("max_loaded_memory", "8 furlongs"), ("max_loaded_memory", "-1GiB"),
    ("gpu_memory_budget", "0"), ("max_loaded_models", "-1"), ("max_loaded_models", "two")])
def test_residency_limits_refuse_bad_values_naming_the_key(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=key):
        build_config({key: value})


def test_no_residency_limits_by_default() -> None:
    config, _ = build_config({})
    assert (config.max_loaded_models, config.max_loaded_memory_bytes,
            config.gpu_memory_budget_bytes) == (0, None, None)
