"""A model version's settings: one frozen ``ModelSettings`` whose fields each declare, once,
the names every source uses for them, their parser and where their default comes from
(``setting``; ``FIELDS`` is derived from them), and how the sources layer.

Sources, lowest priority first: the server's defaults, ``models=`` in config.properties,
the archive's model-config.yaml, then the register API (or a snapshot, which replays one).
Each source is read into a ``SettingsLayer`` (only the fields it sets, already checked, so a
bad value is reported under the name the user wrote), and ``resolve`` stacks the layers.

Names per field: TorchServe's JSON name (config.properties ``models=``, model-config.yaml,
describe bodies, snapshots), TorchServe's register parameter, and the batch-setting aliases
of MLServer (model-settings.json) and KServe (the ``batcher`` section), which
model-config.yaml and the register API accept too. Within one source TorchServe's name wins
over an alias; two aliases that disagree are an error.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, TypeAlias

from frontend.errors import quoted


class PolicyName(str, enum.Enum):
    """Values of the per-model ``batch_policy`` setting (frontend/serving/policies.py has the
    policies)."""

    FIXED = "fixed"
    ADAPTIVE = "adaptive"



class Source(enum.Enum):
    """Where a layer comes from: decides which names are read and how a bad value is told."""

    #: config.properties ``models=`` and snapshots: TorchServe's JSON names.
    JSON = "json"
    #: the archive's model-config.yaml: TorchServe's JSON names and the aliases.
    YAML = "yaml"
    #: the register API's query parameters: TorchServe's parameter names and the aliases.
    API = "api"


# ---- parsing one value ----------------------------------------------------------------------

#: The largest count or duration (in its unit) a setting may take: protobuf's int32, what the
#: gRPC API's fields and the LOAD message's batch_size hold (and Java's int, TorchServe's).
INT32_MAX = 2**31 - 1
#: The longest ``response_timeout`` and ``startup_timeout`` in seconds: the LOAD message
#: carries the response timeout in milliseconds as a uint32 (about 49.7 days).
MAX_TIMEOUT_S = (2**32 - 1) // 1000

Parse = Callable[[str, object], Any]


def _number(value: object) -> object:
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return value


@dataclass(frozen=True, slots=True)
class Integer:
    """Whole numbers in [``minimum``, ``maximum``]; TorchServe's names take ints or their
    decimal text. Also the range ``ModelSettings`` holds the field to, whatever set it."""

    minimum: int
    maximum: int = INT32_MAX

    def __call__(self, key: str, value: object) -> int:
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                raise self._refusal(key, value) from None
        if isinstance(value, bool) or not isinstance(value, int) \
                or not self.minimum <= value <= self.maximum:
            raise self._refusal(key, value)
        return value

    def _refusal(self, key: str, value: object) -> ValueError:
        return ValueError(f"{key} must be an integer in [{self.minimum}, {self.maximum}], "
                          f"got {quoted(value)}")


def integer(minimum: int, maximum: int = INT32_MAX) -> Integer:
    """The parser of whole numbers in [``minimum``, ``maximum``]."""
    return Integer(minimum, maximum)


def _alias_integer(minimum: int) -> Parse:
    """MLServer and KServe counts: JSON numbers, so 4.0 is 4 (but 2.5 is refused)."""
    def parse(key: str, value: object) -> int:
        number = _number(value)
        if isinstance(number, bool) or not isinstance(number, int | float) \
                or not math.isfinite(number) or number != int(number) \
                or not minimum <= number <= INT32_MAX:
            raise ValueError(f"{key} must be an integer in [{minimum}, {INT32_MAX}], got "
                             f"{quoted(value)}")
        return int(number)
    return parse


def _mlserver_batch_size(key: str, value: object) -> int:
    count: int = _alias_integer(0)(key, value)
    return max(1, count)  # MLServer: 0 or 1 turns batching off


def _duration_ms(unit_ms: float) -> Parse:
    """MLServer's and KServe's delays (seconds, milliseconds: any JSON number) as whole
    milliseconds, at most INT32_MAX of them (the unit's own maximum is named)."""
    unit = "seconds" if unit_ms == 1000 else "milliseconds"
    most = INT32_MAX // 1000 if unit_ms == 1000 else INT32_MAX

    def parse(key: str, value: object) -> int:
        number = _number(value)
        if isinstance(number, bool) or not isinstance(number, int | float) \
                or not math.isfinite(number) or not 0 <= number <= most:
            raise ValueError(f"{key} must be a number of {unit} in [0, {most}], got "
                             f"{quoted(value)}")
        ms = round(number * unit_ms)
        # NOTE: a positive delay never rounds down to 0, which would mean "never wait".
        return max(ms, 1) if number > 0 else 0
    return parse


def policy(key: str, value: object) -> PolicyName:
    """``fixed`` or ``adaptive``, in any case."""
    try:
        return PolicyName(value.strip().lower() if isinstance(value, str) else value)
    except ValueError:
        choices = ", ".join(p.value for p in PolicyName)
        raise ValueError(f"{key} must be one of {choices}, got {quoted(value)}") from None


def _boolean(key: str, value: object) -> bool:
    """true or false; TorchServe's names take booleans or their text."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {quoted(value)}")
    return value


def _device_ids(key: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= INT32_MAX
            for i in value):
        raise ValueError(f"{key} must be a list of GPU ids (integers in [0, {INT32_MAX}]), "
                         f"got {quoted(value)}")
    return tuple(value)


def _choice(*choices: str) -> Parse:
    """One of ``choices``, in any case (TorchServe's enum names), as its lower-case name; ""
    is TorchServe's "none"."""
    def parse(key: str, value: object) -> str:
        if not isinstance(value, str) or value.strip().lower() not in ("", *choices):
            raise ValueError(f"{key} must be one of {', '.join(choices)}, got {quoted(value)}")
        return value.strip().lower()
    return parse


#: The largest ``deviceWeight``.
MAX_DEVICE_WEIGHT = 1000.0
_GROUP_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-")


def _device_weight(key: str, value: object) -> float:
    """A model's weight in its device group: a number in (0, MAX_DEVICE_WEIGHT]."""
    number = _number(value)
    if isinstance(number, bool) or not isinstance(number, int | float) \
            or not math.isfinite(number) or not 0 < number <= MAX_DEVICE_WEIGHT:
        raise ValueError(f"{key} must be a number in (0, {MAX_DEVICE_WEIGHT:g}], got "
                         f"{quoted(value)}")
    return float(number)


def _device_group(key: str, value: object) -> str:
    """A device group's name (a metric label: letters, digits and ``_.:-``, at most 64);
    "" names none."""
    if not isinstance(value, str) or len(value.strip()) > 64 \
            or not set(value.strip()) <= _GROUP_CHARACTERS:
        raise ValueError(f"{key} must be a name of at most 64 letters, digits, '_', '.', ':' "
                         f"or '-', got {quoted(value)}")
    return value.strip()


def _torchrun_processes(key: str, value: object) -> int:
    """model-config.yaml's ``torchrun`` section: its ``nproc-per-node`` (TorchServe's default
    1), which TorchServe takes for the model's ``parallelLevel``."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a mapping of torchrun's options, got {quoted(value)}")
    processes: int = integer(1)(f"{key}.nproc-per-node", value.get("nproc-per-node", 1))
    return processes


#: The most priority levels a model may have (Triton allows more; 100 is plenty here).
MAX_PRIORITY_LEVELS = 100


def _level_policies(key: str, value: object) -> tuple[tuple[int, int, int], ...]:
    """``priorityQueuePolicy`` (Triton's ``priority_queue_policy``): a mapping of level to
    ``{maxQueueSize, timeoutMs}`` (0: no limit), or its JSON text; as (level, max queue size,
    timeout ms), by level."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{key} must be a mapping (or its JSON text) of level to "
                             f"{{maxQueueSize, timeoutMs}}, got {quoted(value)}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a mapping of level to {{maxQueueSize, timeoutMs}}, "
                         f"got {quoted(value)}")
    policies = []
    for level, limits in value.items():
        number = integer(1, MAX_PRIORITY_LEVELS)(f"{key} level", level)
        if not isinstance(limits, Mapping) or set(limits) - {"maxQueueSize", "timeoutMs"}:
            raise ValueError(f"{key}.{number} must be a mapping with maxQueueSize and/or "
                             f"timeoutMs, got {quoted(limits)}")
        policies.append((number,
                         integer(0)(f"{key}.{number}.maxQueueSize", limits.get("maxQueueSize", 0)),
                         integer(0)(f"{key}.{number}.timeoutMs", limits.get("timeoutMs", 0))))
    return tuple(sorted(policies))


# ---- the fields ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Field:
    """One setting and its names (derived from ModelSettings' declarations: ``FIELDS``)."""

    name: str
    #: TorchServe's JSON name (properties ``models=``, model-config.yaml, describe, snapshot).
    json: str
    #: TorchServe's register API parameter; None: not settable at registration.
    param: str | None
    parse: Parse
    #: MLServer's and KServe's names, each with its own units.
    aliases: tuple[tuple[str, Parse], ...] = ()
    #: in TorchServe's describe body and snapshot.
    shown: bool = True
    #: The ServerConfig field that holds the server's default (None: the field's default).
    server_default: str | None = None


def setting(json: str, parse: Parse, *, param: str | None = None,
            aliases: tuple[tuple[str, Parse], ...] = (), shown: bool = True,
            server_default: str | None = None, default: Any = MISSING) -> Any:
    """A ModelSettings field with its names, parser and where its default comes from (see
    ``Field``): each setting is declared once, and the tables are derived."""
    return field(default=default, metadata={"names": (json, param, parse, aliases, shown,
                                                      server_default)})


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """The batching and worker settings in force for one model version, in TorchServe's
    describe order."""

    min_workers: int = setting("minWorkers", integer(0), param="initial_workers")
    max_workers: int = setting("maxWorkers", integer(0))
    batch_size: int = setting(
        "batchSize", integer(1), param="batch_size", server_default="default_batch_size",
        aliases=(("max_batch_size", _mlserver_batch_size), ("maxBatchSize", _alias_integer(1))))
    max_batch_delay_ms: int = setting(
        "maxBatchDelay", integer(0), param="max_batch_delay",
        server_default="default_max_batch_delay_ms",
        aliases=(("max_batch_time", _duration_ms(1000.0)), ("maxLatency", _duration_ms(1.0))))
    response_timeout_s: int = setting("responseTimeout", integer(1, MAX_TIMEOUT_S),
                                      param="response_timeout",
                                      server_default="default_response_timeout_s")
    startup_timeout_s: int = setting("startupTimeout", integer(1, MAX_TIMEOUT_S),
                                     param="startup_timeout",
                                     server_default="default_startup_timeout_s")
    job_queue_size: int = setting("jobQueueSize", integer(1), shown=False,
                                  server_default="job_queue_size")
    #: GPUs this model's workers may use (model-config.yaml ``deviceIds``); empty: any.
    device_ids: tuple[int, ...] = setting("deviceIds", _device_ids, shown=False, default=())
    #: The device whose time this model's workers share by weight with the other models of
    #: the group ("": none; frontend/serving/devices.py, docs/devices.md), and its weight.
    device_group: str = setting("deviceGroup", _device_group, param="device_group",
                                shown=False, default="")
    device_weight: float = setting("deviceWeight", _device_weight, param="device_weight",
                                   shown=False, default=1.0)
    #: ADAPTIVE (default) or FIXED (TorchServe's behaviour).
    batch_policy: PolicyName = setting("batchPolicy", policy, param="batch_policy",
                                       shown=False, server_default="default_batch_policy",
                                       default=PolicyName.ADAPTIVE)
    #: A request's deadline when its client sets none (model-config.yaml
    #: ``clientTimeoutInMills``); 0: ``response_timeout`` alone.
    client_timeout_ms: int = setting("clientTimeoutInMills", integer(0), shown=False, default=0)
    #: model-config.yaml ``maxRetryTimeoutInSec``, shown by describe (TorchServe's default);
    #: batchserve restarts a failing worker with capped backoff for as long as it fails.
    max_retry_timeout_s: int = setting("maxRetryTimeoutInSec", integer(0), shown=False,
                                       default=300)
    #: model-config.yaml ``useVenv``: the workers run in a venv of the model's own
    #: (frontend/models/dependencies.py). TorchServe reads it from model-config.yaml only and
    #: shows it in describe, not snapshots.
    use_venv: bool = setting("useVenv", _boolean, shown=False, default=False)
    #: model-config.yaml ``workerStart`` (fork, spawn; "": the server's): how this model's
    #: workers start, the server's ``worker_start`` by default (docs/workers.md).
    worker_start: str = setting("workerStart", _choice("fork", "spawn"), shown=False,
                                server_default="worker_start", default="fork")
    #: A stateful model (TorchServe's ``sequenceBatching``): each sequence's requests run in
    #: order on one worker (frontend/serving/sequences.py). The limits below are TorchServe's
    #: model-config.yaml keys and defaults (model-config.yaml only, as in TorchServe; describe
    #: shows them through ``sequence_fields``).
    sequence_batching: bool = setting("sequenceBatching", _boolean, shown=False, default=False)
    #: A sequence with no request for this long is forgotten (0: not stateful, TorchServe's
    #: reading: a stateful model must set it).
    sequence_max_idle_ms: int = setting("sequenceMaxIdleMSec", integer(0), shown=False,
                                        default=0)
    #: A sequence ends this long after it opened, once idle (0: never).
    sequence_timeout_ms: int = setting("sequenceTimeoutMSec", integer(0), shown=False,
                                       default=0)
    #: Sequences open at once; a new one beyond is refused (503).
    max_num_sequence: int = setting("maxNumSequence", integer(1), shown=False, default=1)
    #: Requests one sequence may have waiting behind the one it is running.
    max_sequence_job_queue_size: int = setting("maxSequenceJobQueueSize", integer(1),
                                               shown=False, default=1)

    #: model-config.yaml ``deviceType`` (cpu, gpu; "": not set): cpu keeps the model's workers
    #: off the GPUs.
    device_type: str = setting("deviceType", _choice("cpu", "gpu"), shown=False, default="")
    #: TorchServe's model parallelism (``parallelType``: pp, tp, pptp, custom;
    #: ``parallelLevel``; ``torchrun``'s nproc-per-node): shown in describe as TorchServe
    #: shows them; batchserve runs one process per worker, so they change nothing else.
    parallel_type: str = setting("parallelType", _choice("pp", "tp", "pptp", "custom"),
                                 shown=False, default="")
    parallel_level: int = setting("parallelLevel", integer(0), shown=False, default=0)
    torchrun_processes: int = setting("torchrun", _torchrun_processes, shown=False, default=0)
    #: Shown in describe; what each does here is logged at registration
    #: (frontend/models/loader.py, ``MODEL_CONFIG_KEYS``).
    continuous_batching: bool = setting("continuousBatching", _boolean, shown=False,
                                        default=False)
    async_communication: bool = setting("asyncCommunication", _boolean, shown=False,
                                        default=False)
    use_job_ticket: bool = setting("useJobTicket", _boolean, shown=False, default=False)
    #: Priority levels (Triton's ``priority_levels``; 0: none), 1 the highest; the level of a
    #: request that names none (0: the lowest); each level's limits (docs/scheduling.md).
    priority_levels: int = setting("priorityLevels", integer(0, MAX_PRIORITY_LEVELS),
                                   param="priority_levels", shown=False, default=0)
    default_priority_level: int = setting("defaultPriorityLevel",
                                          integer(0, MAX_PRIORITY_LEVELS),
                                          param="default_priority_level", shown=False,
                                          default=0)
    priority_queue_policy: tuple[tuple[int, int, int], ...] = setting(
        "priorityQueuePolicy", _level_policies, param="priority_queue_policy", shown=False,
        default=())
    #: With residency limits on (``max_loaded_models``, ``max_loaded_memory``,
    #: ``gpu_memory_budget``): always loaded, never paged out (docs/residency.md).
    pinned: bool = setting("pinned", _boolean, param="pinned", shown=False, default=False)

    def __post_init__(self) -> None:
        """Every count and duration is in its range, whichever source or code set it: what
        the LOAD message, the gRPC API and the timers hold (ValueError naming the field)."""
        for declared in FIELDS:
            if isinstance(declared.parse, Integer):
                declared.parse(declared.json, getattr(self, declared.name))
        levels = self.priority_levels
        if self.default_priority_level > levels or any(
                level > levels for level, _, _ in self.priority_queue_policy):
            raise ValueError(f"defaultPriorityLevel and priorityQueuePolicy's levels must be "
                             f"within priorityLevels (1 to {levels})")

    def torchserve_fields(self) -> dict[str, int]:
        """The settings TorchServe shows under its JSON names (describe bodies, snapshots)."""
        return {item.json: getattr(self, item.name) for item in FIELDS if item.shown}

    def sequence_fields(self) -> dict[str, object]:
        """TorchServe's describe fields of a stateful model. As in TorchServe, the limits are
        in force (and shown) only with a positive sequenceMaxIdleMSec, else they read 0."""
        active = self.sequence_max_idle_ms > 0
        return {
            "stateful": self.sequence_batching,
            "sequenceMaxIdleMSec": self.sequence_max_idle_ms if active else 0,
            "sequenceTimeoutMSec": self.sequence_timeout_ms if active else 0,
            "maxNumSequence": self.max_num_sequence if active else 0,
            "maxSequenceJobQueueSize": self.max_sequence_job_queue_size if active else 0,
        }

    def parallel_fields(self) -> dict[str, object]:
        """TorchServe's describe fields of model parallelism: as its Model, the type and level
        only when both are set (torchrun's nproc-per-node is the level when parallelLevel is
        not given), else "" and 0."""
        level = self.parallel_level or self.torchrun_processes
        if not (self.parallel_type and level):
            return {"parallelType": "", "parallelLevel": 0}
        return {"parallelType": self.parallel_type, "parallelLevel": level}

    def with_workers(self, min_workers: int, max_workers: int) -> ModelSettings:
        if not 0 <= min_workers <= max_workers:
            raise ValueError(f"need 0 <= min_workers <= max_workers, got {min_workers} and "
                             f"{max_workers}")
        return replace(self, min_workers=min_workers, max_workers=max_workers)




#: Every setting and its names, in ModelSettings' order.
FIELDS: tuple[Field, ...] = tuple(Field(item.name, *item.metadata["names"])
                                  for item in fields(ModelSettings))

#: The settings one source sets (field name -> checked value): a partial ModelSettings.
SettingsLayer: TypeAlias = dict[str, Any]


def read_layer(mapping: Mapping[str, object], source: Source) -> SettingsLayer:
    """The settings ``mapping`` sets, under the names ``source`` uses; other keys are ignored.

    Raises ValueError naming the key of a bad value, or the aliases that disagree. A value
    of None (JSON null), or an empty query parameter, counts as not set.
    """
    if source is Source.API:  # an empty query parameter is an absent one
        mapping = {key: value for key, value in mapping.items() if value != ""}
    layer: dict[str, object] = {}
    for declared in FIELDS:
        name = declared.param if source is Source.API else declared.json
        if name is not None and mapping.get(name) is not None:
            layer[declared.name] = declared.parse(name, mapping[name])
            continue
        if source is Source.JSON:
            continue
        given = [(key, parse(key, mapping[key])) for key, parse in declared.aliases
                 if key in mapping]
        if len({value for _, value in given}) > 1:
            listed = ", ".join(f"{key}={value}" for key, value in given)
            raise ValueError(f"conflicting batch settings: {listed} (both set {declared.name})")
        if given:
            layer[declared.name] = given[0][1]
    return layer


def resolve(*layers: SettingsLayer) -> ModelSettings:
    """Stack ``layers`` (later ones win) into complete settings: a field no layer sets takes
    its declared default (the server's defaults layer, ``ModelLoader.server_defaults``, sets
    those declared with ``server_default`` and ``min_workers``); ``max_workers`` defaults to
    ``min_workers`` and is never below it."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer)
    merged["max_workers"] = max(merged["min_workers"],
                                merged.get("max_workers", merged["min_workers"]))
    return ModelSettings(**merged)
