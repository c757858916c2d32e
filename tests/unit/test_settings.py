"""Model settings: each source's names, checked values, and the layering of the sources."""

from __future__ import annotations

import math
import re

import pytest

from frontend.settings import (
    FIELDS,
    ModelSettings,
    PolicyName,
    SettingsLayer,
    Source,
    read_layer,
    resolve,
)

DEFAULTS = SettingsLayer(batch_size=1, max_batch_delay_ms=100, min_workers=1,
                         response_timeout_s=120, startup_timeout_s=120, job_queue_size=100,
                         device_ids=(), batch_policy=PolicyName.ADAPTIVE)


def test_each_source_reads_its_own_names() -> None:
    json = {"batchSize": 8, "maxBatchDelay": 50, "minWorkers": 2, "maxWorkers": 4,
            "responseTimeout": 9, "startupTimeout": 30, "batchPolicy": "fixed"}
    api = {"batch_size": "8", "max_batch_delay": "50", "initial_workers": "2",
           "response_timeout": "9", "startup_timeout": "30", "batch_policy": "FIXED"}
    expected = {"batch_size": 8, "max_batch_delay_ms": 50, "min_workers": 2,
                "response_timeout_s": 9, "startup_timeout_s": 30,
                "batch_policy": PolicyName.FIXED}
    assert read_layer(json, Source.JSON) == {**expected, "max_workers": 4}
    assert read_layer(json, Source.YAML) == {**expected, "max_workers": 4}
    assert read_layer(api, Source.API) == expected
    # A source never reads another's names.
    assert read_layer(api, Source.JSON) == {}
    assert read_layer(json, Source.API) == {}


def test_yaml_only_fields() -> None:
    layer = read_layer({"jobQueueSize": 7, "deviceIds": [1, 2], "useVenv": True}, Source.YAML)
    assert layer == {"job_queue_size": 7, "device_ids": (1, 2), "use_venv": True}
    # TorchServe's booleans in text (config.properties models= carries JSON text too).
    assert read_layer({"useVenv": "False"}, Source.YAML) == {"use_venv": False}
    assert read_layer({"use_venv": "true"}, Source.API) == {}  # no register parameter


def test_stateful_fields_are_model_config_yaml_keys() -> None:
    yaml = {"sequenceBatching": True, "sequenceMaxIdleMSec": 60000, "sequenceTimeoutMSec": 0,
            "maxNumSequence": 4, "maxSequenceJobQueueSize": 10}
    layer = read_layer(yaml, Source.YAML)
    assert layer == {"sequence_batching": True, "sequence_max_idle_ms": 60000,
                     "sequence_timeout_ms": 0, "max_num_sequence": 4,
                     "max_sequence_job_queue_size": 10}
    assert read_layer({"sequenceBatching": "false"}, Source.YAML) == {"sequence_batching": False}
    with pytest.raises(ValueError, match="sequenceBatching must be true or false"):
        read_layer({"sequenceBatching": "yes"}, Source.YAML)
    with pytest.raises(ValueError, match=r"maxNumSequence must be an integer in \[1, 2147483647\]"):
        read_layer({"maxNumSequence": 0}, Source.YAML)


def test_stateful_describe_fields_follow_torchserve() -> None:
    plain = resolve(DEFAULTS)
    assert plain.sequence_fields() == {
        "stateful": False, "sequenceMaxIdleMSec": 0, "sequenceTimeoutMSec": 0,
        "maxNumSequence": 0, "maxSequenceJobQueueSize": 0}
    stateful = resolve(DEFAULTS, read_layer(
        {"sequenceBatching": True, "sequenceMaxIdleMSec": 500, "maxNumSequence": 4},
        Source.YAML))
    assert stateful.sequence_fields() == {
        "stateful": True, "sequenceMaxIdleMSec": 500, "sequenceTimeoutMSec": 0,
        "maxNumSequence": 4, "maxSequenceJobQueueSize": 1}  # TorchServe's default: 1


@pytest.mark.parametrize(("mapping", "expected"), [
    ({"max_batch_size": 8, "max_batch_time": 0.05}, {"batch_size": 8, "max_batch_delay_ms": 50}),
    ({"maxBatchSize": 32, "maxLatency": 500}, {"batch_size": 32, "max_batch_delay_ms": 500}),
    ({"max_batch_size": 0}, {"batch_size": 1}),  # MLServer: 0 or 1 turns batching off
    ({"max_batch_time": 0}, {"max_batch_delay_ms": 0}),
    ({"max_batch_time": 0.0004}, {"max_batch_delay_ms": 1}),  # positive never rounds to 0
    ({"max_batch_time": "0.0125"}, {"max_batch_delay_ms": 12}),
    ({"maxBatchSize": "16", "maxLatency": 2.6}, {"batch_size": 16, "max_batch_delay_ms": 3}),
    ({"max_batch_size": 4, "maxBatchSize": 4.0}, {"batch_size": 4}),
    ({"name": "resnet", "parallel_workers": 2}, {}),
])
@pytest.mark.parametrize("source", [Source.YAML, Source.API])
def test_mlserver_and_kserve_aliases(mapping: dict[str, object], expected: dict[str, int],
                                     source: Source) -> None:
    assert read_layer(mapping, source) == expected


def test_aliases_are_not_torchserve_json() -> None:
    # config.properties models= and snapshots are TorchServe's own: no aliases there.
    assert read_layer({"maxBatchSize": 8}, Source.JSON) == {}


def test_torchserve_name_wins_over_an_alias() -> None:
    assert read_layer({"batchSize": 2, "maxBatchSize": 8}, Source.YAML) == {"batch_size": 2}
    assert read_layer({"batch_size": "2", "max_batch_size": 8}, Source.API) == {"batch_size": 2}


@pytest.mark.parametrize(("mapping", "message"), [
    ({"max_batch_size": -1}, "max_batch_size must be an integer in [0, 2147483647], got -1"),
    ({"max_batch_size": 2.5}, "max_batch_size must be an integer"),
    ({"max_batch_size": True}, "max_batch_size must be an integer"),
    ({"maxBatchSize": 0}, "maxBatchSize must be an integer in [1, 2147483647], got 0"),
    ({"maxBatchSize": "many"}, "maxBatchSize must be an integer"),
    ({"max_batch_time": -0.1}, "max_batch_time must be a number of seconds"),
    ({"max_batch_time": "soon"}, "max_batch_time must be a number of seconds"),
    ({"maxLatency": math.nan}, "maxLatency must be a number of milliseconds"),
    ({"maxLatency": None}, "maxLatency must be a number of milliseconds"),
    ({"max_batch_size": 8, "maxBatchSize": 16}, "conflicting batch settings"),
    ({"max_batch_time": 0.05, "maxLatency": 100}, "conflicting batch settings"),
    ({"batchSize": 0}, "batchSize must be an integer in [1, 2147483647], got 0"),
    ({"batchSize": "x"}, "batchSize must be an integer"),
    ({"batchSize": True}, "batchSize must be an integer"),
    ({"maxBatchDelay": -1}, "maxBatchDelay must be an integer in [0, 2147483647], got -1"),
    ({"responseTimeout": 0}, "responseTimeout must be an integer in [1, 4294967], got 0"),
    ({"deviceIds": "0,1"}, "deviceIds must be a list of GPU ids"),
    ({"deviceIds": [0, -1]}, "deviceIds must be a list of GPU ids"),
    ({"batchPolicy": "greedy"}, "batchPolicy must be one of fixed, adaptive"),
    ({"useVenv": "yes"}, "useVenv must be true or false"),
    ({"useVenv": 1}, "useVenv must be true or false"),
])
def test_bad_values_name_the_key_the_user_wrote(mapping: dict[str, object],
                                                message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        read_layer(mapping, Source.YAML)


@pytest.mark.parametrize(("params", "key"), [
    ({"batch_size": "1.5"}, "batch_size"), ({"batch_size": "0"}, "batch_size"),
    ({"initial_workers": "two"}, "initial_workers"), ({"initial_workers": "-1"}, "initial_workers"),
    ({"max_batch_delay": "-5"}, "max_batch_delay"), ({"response_timeout": "0"}, "response_timeout"),
    ({"batch_policy": "random"}, "batch_policy"),
])
def test_bad_api_parameters_name_the_parameter(params: dict[str, str], key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key} must be"):
        read_layer(params, Source.API)


def test_an_empty_parameter_or_a_null_is_not_set() -> None:
    assert read_layer({"batch_size": "", "batch_policy": ""}, Source.API) == {}
    assert read_layer({"batchSize": None}, Source.JSON) == {}


def test_later_layers_win_field_by_field() -> None:
    properties = read_layer({"batchSize": 2, "maxBatchDelay": 5, "responseTimeout": 3,
                             "startupTimeout": 77}, Source.JSON)
    yaml = read_layer({"batchSize": 4, "maxBatchDelay": 30, "minWorkers": 2,
                       "responseTimeout": 9}, Source.YAML)
    api = read_layer({"max_batch_delay": "11"}, Source.API)
    settings = resolve(DEFAULTS, properties, yaml, api)
    assert settings.batch_size == 4  # YAML over properties
    assert settings.max_batch_delay_ms == 11  # API over YAML
    assert settings.response_timeout_s == 9  # YAML over properties
    assert settings.startup_timeout_s == 77  # properties over the default
    assert settings.min_workers == 2 and settings.job_queue_size == 100


def test_max_workers_follows_min_workers() -> None:
    assert resolve(DEFAULTS, {"min_workers": 3}).max_workers == 3
    assert resolve(DEFAULTS, {"min_workers": 3, "max_workers": 5}).max_workers == 5
    assert resolve(DEFAULTS, {"max_workers": 5}, {"min_workers": 8}).max_workers == 8


def test_the_defaults_layer_must_be_complete() -> None:
    with pytest.raises((KeyError, TypeError)):
        resolve({"batch_size": 2})


def test_settings_are_frozen_and_change_only_by_copy() -> None:
    settings = resolve(DEFAULTS)
    with pytest.raises(AttributeError):
        settings.batch_size = 9  # type: ignore[misc]
    scaled = settings.with_workers(2, 6)
    assert (scaled.min_workers, scaled.max_workers) == (2, 6)
    assert (settings.min_workers, settings.max_workers) == (1, 1)
    with pytest.raises(ValueError):
        settings.with_workers(3, 2)


def test_torchserve_fields_use_torchserve_json_names() -> None:
    settings = ModelSettings(batch_size=8, max_batch_delay_ms=50, min_workers=1, max_workers=2,
                             response_timeout_s=9, startup_timeout_s=30, job_queue_size=10)
    assert settings.torchserve_fields() == {
        "minWorkers": 1, "maxWorkers": 2, "batchSize": 8, "maxBatchDelay": 50,
        "responseTimeout": 9, "startupTimeout": 30}
    # ... which read back as the same settings (describe bodies and snapshots round-trip).
    assert read_layer(settings.torchserve_fields(), Source.JSON) == {
        "min_workers": 1, "max_workers": 2, "batch_size": 8, "max_batch_delay_ms": 50,
        "response_timeout_s": 9, "startup_timeout_s": 30}


def test_every_field_has_a_json_name_and_the_names_are_unique() -> None:
    names = [field.name for field in FIELDS]
    assert sorted(names) == sorted(ModelSettings.__dataclass_fields__)
    for attribute in ("json", "param"):
        given = [getattr(field, attribute) for field in FIELDS if getattr(field, attribute)]
        assert len(given) == len(set(given)), attribute


# ---- ranges: every value fits what it is stored in --------------------------------------------

INT32_OVER = 2**31
#: One too many seconds for the LOAD message's response_timeout_ms (a uint32).
TIMEOUT_OVER = (2**32 - 1) // 1000 + 1


@pytest.mark.parametrize(("mapping", "source", "message"), [
    ({"batch_size": str(INT32_OVER)}, Source.API, "batch_size must be an integer in [1, "),
    ({"batchSize": INT32_OVER}, Source.JSON, "batchSize must be an integer in [1, 2147483647]"),
    ({"initial_workers": "99999999999"}, Source.API, "initial_workers must be an integer in"),
    ({"response_timeout": str(2**62)}, Source.API,
     "response_timeout must be an integer in [1, 4294967]"),
    ({"responseTimeout": TIMEOUT_OVER}, Source.YAML,
     "responseTimeout must be an integer in [1, 4294967]"),
    ({"startup_timeout": "1e300"}, Source.API, "startup_timeout must be an integer in [1, "),
    ({"maxBatchDelay": INT32_OVER}, Source.YAML, "maxBatchDelay must be an integer in [0, "),
    ({"maxBatchSize": "1e20"}, Source.API, "maxBatchSize must be an integer in [1, 2147483647]"),
    ({"maxBatchSize": 1e20}, Source.YAML, "maxBatchSize must be an integer in [1, 2147483647]"),
    ({"max_batch_size": "1e300"}, Source.API, "max_batch_size must be an integer in [0, "),
    ({"max_batch_size": "nan"}, Source.API, "max_batch_size must be an integer in [0, "),
    ({"max_batch_size": "-inf"}, Source.API, "max_batch_size must be an integer in [0, "),
    ({"max_batch_time": 1e300}, Source.YAML,
     "max_batch_time must be a number of seconds in [0, 2147483]"),
    ({"maxLatency": "inf"}, Source.API,
     "maxLatency must be a number of milliseconds in [0, 2147483647]"),
    ({"jobQueueSize": INT32_OVER}, Source.YAML, "jobQueueSize must be an integer in [1, "),
    ({"clientTimeoutInMills": 10**30}, Source.YAML, "clientTimeoutInMills must be an integer"),
    ({"maxNumSequence": -1}, Source.YAML, "maxNumSequence must be an integer in [1, "),
    ({"deviceIds": [0, INT32_OVER]}, Source.YAML, "deviceIds must be a list of GPU ids"),
    ({"torchrun": {"nproc-per-node": INT32_OVER}}, Source.YAML,
     "torchrun.nproc-per-node must be an integer in [1, "),
    ({"minWorkers": "9" * 5000}, Source.JSON, "minWorkers must be an integer in [0, "),
])
def test_out_of_range_values_are_refused_naming_the_key_and_range(
        mapping: dict[str, object], source: Source, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        read_layer(mapping, source)
    assert len(str(refused.value)) < 200, "the message quotes the value cut short"


def test_the_largest_values_in_range_are_taken() -> None:
    largest = {"batchSize": 2**31 - 1, "maxBatchDelay": 2**31 - 1,
               "responseTimeout": TIMEOUT_OVER - 1, "startupTimeout": TIMEOUT_OVER - 1}
    assert read_layer(largest, Source.YAML) == {
        "batch_size": 2**31 - 1, "max_batch_delay_ms": 2**31 - 1,
        "response_timeout_s": TIMEOUT_OVER - 1, "startup_timeout_s": TIMEOUT_OVER - 1}
    settings = resolve(DEFAULTS, read_layer(largest, Source.YAML))
    assert settings.response_timeout_s * 1000 <= 2**32 - 1


@pytest.mark.parametrize("layer", [
    {"batch_size": INT32_OVER}, {"max_batch_delay_ms": -1}, {"min_workers": INT32_OVER},
    {"response_timeout_s": TIMEOUT_OVER}, {"job_queue_size": 0},
])
def test_settings_hold_their_ranges_whatever_set_them(layer: SettingsLayer) -> None:
    """A layer no parser read (a workflow spec's, code's own) cannot make settings that the
    LOAD message or the timers cannot hold."""
    with pytest.raises(ValueError, match="must be an integer in"):
        resolve(DEFAULTS, layer)
    with pytest.raises(ValueError, match="must be an integer in"):
        resolve(DEFAULTS).with_workers(0, INT32_OVER)
