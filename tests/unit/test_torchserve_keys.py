"""Every configuration key and command-line flag of TorchServe 0.12 is honoured here or
accepted with one log line that says why it has no effect; only keys TorchServe does not know
either are called misspelt."""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest

from frontend import cli
from frontend.config import ServerConfig, build_config, load_config
from frontend.torchserve_keys import NO_EFFECT

#: TorchServe 0.12's configuration keys: the key constants of its ConfigManager
#: (frontend/server/src/main/java/org/pytorch/serve/util/ConfigManager.java), the keys
#: ts/model_server.py reads from config.properties itself (vmargs, plugins_path) and the
#: one ConfigManager writes there itself (tsConfigFile), in pytorch/serve at commit
#: 62c4d6a1fdc1d071dbcf758ebd756029af20bd5e (v0.12.0 and 14 commits).
TORCHSERVE_KEYS = (
    "debug", "inference_address", "management_address", "metrics_address", "load_models",
    "blacklist_env_vars", "default_workers_per_model", "default_response_timeout",
    "default_startup_timeout", "unregister_model_timeout", "number_of_netty_threads",
    "netty_client_threads", "job_queue_size", "number_of_gpu", "metrics_config",
    "metrics_mode", "model_metrics_auto_detect", "disable_system_metrics", "ipex_enable",
    "cpu_launcher_enable", "cpu_launcher_args", "ipex_gpu_enable", "async_logging",
    "cors_allowed_origin", "cors_allowed_methods", "cors_allowed_headers",
    "decode_input_request", "keystore", "keystore_pass", "keystore_type", "certificate_file",
    "private_key_file", "max_request_size", "max_response_size", "limit_max_image_pixels",
    "default_service_handler", "service_envelope", "model_server_home", "model_store",
    "prefer_direct_buffer", "allowed_urls", "install_py_dep_per_model", "enable_metrics_api",
    "grpc_inference_address", "grpc_management_address", "grpc_inference_port",
    "grpc_management_port", "grpc_inference_max_connection_age_ms",
    "grpc_management_max_connection_age_ms", "grpc_inference_max_connection_age_grace_ms",
    "grpc_management_max_connection_age_grace_ms", "enable_grpc_ssl", "initial_worker_port",
    "initial_distribution_port", "workflow_store", "cpp_log_config",
    "ts_open_inference_protocol", "token_expiration_min", "ts_header_key_sequence_id",
    "ts_header_key_sequence_start", "ts_header_key_sequence_end",
    "disable_token_authorization", "enable_model_api", "use_native_io", "io_ratio",
    "metric_time_interval", "enable_envvars_config", "model_snapshot", "models", "version",
    "system_metrics_cmd", "use_env_allowed_urls", "python",
    # ts/model_server.py
    "vmargs", "plugins_path",
    # written by ConfigManager itself (and so in its config snapshots)
    "tsConfigFile",
)


#: A value for each key honoured here that differs from its default.
SAMPLES = {
    "inference_address": "http://127.0.0.1:9080", "management_address": "http://0.0.0.0:9081",
    "metrics_address": "http://127.0.0.1:9082", "load_models": "all",
    "blacklist_env_vars": "AWS_.*", "default_workers_per_model": "3",
    "default_response_timeout": "7", "default_startup_timeout": "8",
    "unregister_model_timeout": "9", "job_queue_size": "11", "number_of_gpu": "0",
    "number_of_netty_threads": "3",
    "cors_allowed_origin": "*", "cors_allowed_methods": "GET, POST",
    "cors_allowed_headers": "X-Custom", "decode_input_request": "false",
    "max_request_size": "1000", "max_response_size": "2000", "limit_max_image_pixels": "false",
    "default_service_handler": "image_classifier", "service_envelope": "json",
    "model_store": "/srv/models", "workflow_store": "/srv/workflows", "allowed_urls": "https://models.example/.*",
    "install_py_dep_per_model": "true", "enable_metrics_api": "false",
    "grpc_inference_address": "0.0.0.0", "grpc_management_address": "0.0.0.0",
    "grpc_inference_port": "9070", "grpc_management_port": "9071",
    "grpc_inference_max_connection_age_ms": "60000",
    "grpc_management_max_connection_age_ms": "60000",
    "grpc_inference_max_connection_age_grace_ms": "5000",
    "grpc_management_max_connection_age_grace_ms": "5000",
    "token_expiration_min": "30", "disable_token_authorization": "true",
    "enable_model_api": "true", "use_env_allowed_urls": "true",
    "model_snapshot": '{"models": {"m": {"1.0": {"marName": "m.mar"}}}}',
    "models": '{"m": {"1.0": {"batchSize": 4, "runtimeType": "python"}}}',
    "metrics_mode": "log", "metrics_config": "metrics.yaml", "model_metrics_auto_detect": "true",
    "disable_system_metrics": "true", "metric_time_interval": "30",
    "certificate_file": "cert.pem", "private_key_file": "key.pem", "keystore": "keystore.p12",
    "keystore_pass": "secret", "keystore_type": "pkcs12",
    # TLS on gRPC needs a certificate (the start refuses it without one): a second line.
    "enable_grpc_ssl": "true\nkeystore=keystore.p12",
}

#: Honoured, though not as a ServerConfig field: each has its own test below.
READ_BY_LOAD_CONFIG = {"enable_envvars_config"}


def _config_fields() -> dict[str, str]:
    return {key: item.name for item in fields(ServerConfig)
            for key in item.metadata.get("keys", ())}


def _load(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> ServerConfig:
    path = tmp_path / "config.properties"
    path.write_text(text)
    return load_config(path, {}, environ or {})


def test_the_key_list_is_checked_whole() -> None:
    keys = set(TORCHSERVE_KEYS)
    assert len(keys) == len(TORCHSERVE_KEYS) == 76
    # Every key is honoured or has a reason: nothing left over.
    assert not set(NO_EFFECT) & set(_config_fields())
    assert set(NO_EFFECT) - keys == {"NUM_WORKERS"}  # KServe's sample config's


@pytest.mark.parametrize("key", sorted(set(TORCHSERVE_KEYS)))
def test_each_torchserve_key_is_honoured_or_says_why_not(
        key: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="frontend.config")
    value = SAMPLES.get(key, "true")
    config = _load(tmp_path, f"{key}={value}\n")
    messages = [record.getMessage() for record in caplog.records]
    assert not [m for m in messages if "unknown key" in m], messages
    explained = [m for m in messages if m.startswith(f"config: {key} has no effect here: ")]
    field = _config_fields().get(key)
    if field is not None:
        assert key in SAMPLES, f"add a sample value for {key}"
        assert getattr(config, field) != getattr(ServerConfig(), field), key
        assert explained == []
    elif key in READ_BY_LOAD_CONFIG:
        assert explained == []
    else:
        assert len(explained) == 1 and len(explained[0]) > len(f"config: {key} has no effect "
                                                               "here: ") + 20, messages


def test_a_key_torchserve_does_not_know_is_called_misspelt(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="frontend.config")
    _load(tmp_path, "inference_adress=http://127.0.0.1:1\n")
    assert "config: unknown key 'inference_adress' ignored (check the spelling)" in \
        caplog.messages


def test_environment_variables_use_torchserve_names_and_its_allowed_urls_rule(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    environ = {"TS_TOKEN_EXPIRATION_TIME_MIN": "5", "TS_CORS_ALLOWED_ORIGIN": "*",
               "TS_ALLOWED_URLS": "https://anywhere.example/.*"}
    off = _load(tmp_path, "token_expiration_min=9\n", environ)
    assert (off.token_expiration_min, off.cors_allowed_origin) == (9, "")  # envvars off
    on = _load(tmp_path, "enable_envvars_config=true\n", environ)
    assert (on.token_expiration_min, on.cors_allowed_origin, on.allowed_urls) == (5, "*", ())
    assert any("TS_ALLOWED_URLS ignored" in m for m in caplog.messages)
    trusted = _load(tmp_path, "enable_envvars_config=true\nuse_env_allowed_urls=true\n",
                    environ)
    assert trusted.allowed_urls == ("https://anywhere.example/.*",)


def test_bad_values_of_new_keys_are_refused_by_name() -> None:
    from frontend.errors import ConfigError

    for key, value in (("blacklist_env_vars", "(unclosed"),
                       ("grpc_inference_max_connection_age_ms", "0"),
                       ("grpc_management_max_connection_age_grace_ms", "-1")):
        with pytest.raises(ConfigError, match=key):
            build_config({key: value})


def test_grpc_connection_age_keys_become_grpc_options() -> None:
    from frontend.api.grpc.servers import connection_age_options

    config, _ = build_config({"grpc_inference_max_connection_age_ms": "60000",
                              "grpc_management_max_connection_age_grace_ms": "99999999999"})
    assert connection_age_options(config, management=False) == [
        ("grpc.max_connection_age_ms", 60000)]
    # gRPC's options are C ints: a longer time is its "for ever", as TorchServe's Long.MAX.
    assert connection_age_options(config, management=True) == [
        ("grpc.max_connection_age_grace_ms", 2**31 - 1)]
    assert connection_age_options(ServerConfig(), management=False) == []


# ---- the command line -----------------------------------------------------------------------


def _parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


def test_torchserve_flags_and_aliases_parse() -> None:
    args = _parse("--start", "--dt", "--ncs", "--model-store", "s")
    assert (args.disable_token_auth, args.ncs) == (True, True)
    assert cli.cli_overrides(args)["disable_token_authorization"] == "true"
    assert _parse("-v").version and _parse("--version").version
    assert _parse("--ppath", "p").plugins_path == "p"
    # As TorchServe, no action at all starts the server.
    bare = _parse("--model-store", "s")
    assert not (bare.start or bare.stop or bare.version)


def test_flags_without_effect_are_accepted_with_their_reason() -> None:
    args = _parse("--start", "--plugins-path", "p", "--workflow-store", "w",
                  "--cpp-log-config", "c", "--sock-type", "unix", "--sock-name", "n",
                  "--host", "h", "--port", "1", "--async")
    ignored = cli.ignored_flags(args)
    assert set(ignored) == {"--plugins-path", "--cpp-log-config",
                            "--sock-type", "--sock-name", "--host", "--port", "--async"}
    # Workflows are served: --workflow-store is a setting, as is --workflows (ours).
    assert cli.cli_overrides(args)["workflow_store"] == "w"
    startup = _parse("--start", "--workflows", "a=a.war", "b.war")
    assert cli.cli_overrides(startup)["load_workflows"] == "a=a.war,b.war"
    assert all(len(reason) > 30 for reason in ignored.values())
    assert cli.ignored_flags(_parse("--start")) == {}
    assert "--metrics-config" not in cli.IGNORED_FLAGS  # another part's flag


def test_version_flag_prints_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["-v"]) == 0
    assert re.match(r"batchserve \S+ \(TorchServe-compatible\)", capsys.readouterr().out)


def test_a_log4j_log_config_is_not_read_as_python_logging(tmp_path: Path) -> None:
    """TorchServe's --log-config is log4j2 XML: mapped (tests/unit/test_log4j.py), not given
    to Python's fileConfig, which would fail on it."""
    log4j = tmp_path / "log4j2.xml"
    log4j.write_text('<?xml version="1.0"?>\n<Configuration></Configuration>\n')
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    factory = logging.getLogRecordFactory()
    try:
        assert cli.setup_logging(log4j, __import__("io").StringIO()) is True
        assert root.level == logging.ERROR  # log4j2's default root, as the file has none
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
        logging.setLogRecordFactory(factory)


# ---- model-config.yaml ------------------------------------------------------------------------


def test_model_config_parallel_and_device_keys_read_as_torchserve() -> None:
    from frontend.settings import PolicyName, Source, read_layer, resolve

    defaults = {"batch_size": 1, "max_batch_delay_ms": 100, "min_workers": 1,
                "response_timeout_s": 120, "startup_timeout_s": 120, "job_queue_size": 100,
                "batch_policy": PolicyName.ADAPTIVE}

    def settings(yaml: dict[str, object]) -> dict[str, object]:
        resolved = resolve(defaults, read_layer(yaml, Source.YAML))
        return {**resolved.parallel_fields(), "device": resolved.device_type,
                "continuous": resolved.continuous_batching, "ticket": resolved.use_job_ticket,
                "async": resolved.async_communication}

    assert settings({}) == {"parallelType": "", "parallelLevel": 0, "device": "",
                            "continuous": False, "ticket": False, "async": False}
    both = settings({"parallelType": "TP", "parallelLevel": 4, "deviceType": "GPU",
                     "continuousBatching": True, "useJobTicket": True,
                     "asyncCommunication": True})
    assert both == {"parallelType": "tp", "parallelLevel": 4, "device": "gpu",
                    "continuous": True, "ticket": True, "async": True}
    # torchrun's nproc-per-node is the level; a type without a level (or the reverse) is
    # none at all, as TorchServe's Model reads them.
    assert settings({"parallelType": "pp", "torchrun": {"nproc-per-node": 2}})[
        "parallelLevel"] == 2
    assert settings({"parallelType": "pp", "torchrun": {}})["parallelLevel"] == 1
    assert settings({"parallelType": "custom"})["parallelType"] == ""
    assert settings({"parallelLevel": 2})["parallelLevel"] == 0
    for yaml, message in (({"parallelType": "zz"}, "parallelType must be one of pp, tp"),
                          ({"deviceType": "tpu"}, "deviceType must be one of cpu, gpu"),
                          ({"torchrun": 4}, "torchrun must be a mapping"),
                          ({"torchrun": {"nproc-per-node": 0}}, "nproc-per-node must be"),
                          ({"continuousBatching": "maybe"}, "must be true or false")):
        with pytest.raises(ValueError, match=message):
            read_layer(yaml, Source.YAML)
