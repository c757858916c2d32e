"""The ``context`` handed to handlers: TorchServe's ``ts.context.Context`` shape.

Unmodified TorchServe handlers read ``context.system_properties``, ``context.manifest`` and the
per-request headers, and set per-request statuses and headers through it, so the attribute and
method names (and the positional constructor) follow TorchServe.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from backend.metrics.cache import MetricCacheAbstract, MetricsCacheYamlImpl
from protos import worker_pb2

#: TorchServe's sequence headers (stateful models; frontend/serving/sequences.py sets them).
SEQUENCE_ID_HEADER = "ts_request_sequence_id"
#: TorchServe's request header: "True" asks the handler for an explanation, not a prediction.
EXPLAIN_HEADER = "explain"
SEQUENCE_START_HEADER = "ts_request_sequence_start"
SEQUENCE_END_HEADER = "ts_request_sequence_end"
CONTENT_TYPE = "content-type"


class RequestHeaders(dict[str, str]):
    """A request's headers as a dict, looked up whatever the case of the name: they reach the
    worker lower-cased (HTTP/2 and our HTTP/1 parser give them so), and handlers written for
    TorchServe, which keeps the client's case, look up ``"Content-Type"`` or
    ``"X-Amzn-SageMaker-Custom-Attributes"``."""

    def __init__(self, headers: Mapping[str, str]) -> None:
        super().__init__(headers)
        self._lowered = {key.lower(): key for key in self}

    def _key(self, key: str) -> str:
        if not super().__contains__(key):
            return self._lowered.get(key.lower(), key)
        return key

    def __getitem__(self, key: str) -> str:
        return super().__getitem__(self._key(key))

    def __contains__(self, key: object) -> bool:
        return super().__contains__(self._key(key) if isinstance(key, str) else key)

    def get(self, key: str, default: Any = None) -> Any:
        return super().get(self._key(key), default)


class RequestProcessor:
    """One request of the current batch: its headers in, its status and headers out.

    Header names are matched case-insensitively (HTTP header names are).
    """

    def __init__(self, request_header: Mapping[str, str]) -> None:
        self._request_header = RequestHeaders(request_header)
        self._lowered = {key.lower(): value for key, value in self._request_header.items()}
        self._status_code = 200
        self._reason_phrase = ""
        self._response_header: dict[str, str] = {}

    def get_request_property(self, key: str) -> str | None:
        return self._lowered.get(key.lower())

    get_request_header = get_request_property

    def get_request_properties(self) -> dict[str, str]:
        return self._request_header

    def report_status(self, code: int, reason_phrase: str | None = None) -> None:
        self._status_code = code
        self._reason_phrase = reason_phrase or ""

    def get_response_status_code(self) -> int:
        return self._status_code

    def get_response_status_phrase(self) -> str:
        return self._reason_phrase

    def add_response_property(self, key: str, value: str) -> None:
        # One entry per name whatever its case, so "Content-Type" replaces "content-type".
        for existing in [k for k in self._response_header if k.lower() == key.lower()]:
            del self._response_header[existing]
        self._response_header[key] = value

    def get_response_headers(self) -> dict[str, str]:
        return self._response_header

    def get_response_header(self, key: str) -> str | None:
        for name, value in self._response_header.items():
            if name.lower() == key.lower():
                return value
        return None


class Context:
    """What a handler knows about its model and, during ``handle``, about the current batch."""

    def __init__(
        self,
        model_name: str,
        model_dir: str,
        manifest: dict[str, Any] | None,
        batch_size: int,
        gpu: int | None,
        mms_version: str,
        limit_max_image_pixels: bool = True,
        metrics: MetricCacheAbstract | None = None,
        model_yaml_config: dict[str, Any] | None = None,
        cpu_threads: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.manifest: dict[str, Any] = manifest if manifest is not None else {}
        self._system_properties: dict[str, Any] = {
            "model_dir": model_dir,
            "gpu_id": gpu,
            "batch_size": batch_size,
            "server_name": "MMS",
            "server_version": mms_version,
            "limit_max_image_pixels": limit_max_image_pixels,
            # batchserve: this worker's share of the machine's cores (None: every core).
            "cpu_threads": cpu_threads,
        }
        #: The handler's metrics API (TorchServe's ``MetricsCacheYamlImpl``): the worker
        #: gives it the model_metrics of the server's metrics configuration.
        self._metrics: MetricCacheAbstract = (
            metrics if metrics is not None else MetricsCacheYamlImpl.without_config())
        if isinstance(self._metrics, MetricCacheAbstract) and self._metrics.model_name is None:
            self._metrics.model_name = model_name
        self.model_yaml_config: dict[str, Any] = model_yaml_config or {}
        self.request_ids: dict[int, str] = {}
        self.request_processor: list[RequestProcessor] = []
        #: Open Inference Protocol (v2) batches: each input's parameters, merged over the
        #: batch's v2 requests as MLServer does (a parameter -> the list of its values, in
        #: request order; ``content_type`` and ``headers`` keep their first value).
        self.input_parameters: dict[str, dict[str, Any]] = {}
        #: The v2 requests' own ``parameters``, merged the same way.
        self.request_parameters: dict[str, Any] = {}
        #: Set by a handler: each output's parameters, split back per v2 request (item i of a
        #: list goes to request i; any other value to every request).
        self.output_parameters: dict[str, dict[str, Any]] = {}
        #: How the model runs its batches (issue 33: its batch buckets, whether they replay
        #: CUDA graphs, why not): filled by the handler in ``initialize`` (the built-in
        #: handlers and TorchServe's BaseHandler through ``backend.handlers.graphs``; a custom
        #: handler may fill it itself); the worker sends it in ``Loaded``. Empty: any size,
        #: eagerly.
        self.execution = worker_pb2.Execution()
        # TorchServe's continuous-batching handlers look for it; unused here.
        self.stopping_criteria: Any = None
        # The sequence headers' names, where TorchServe's stateful handlers read them: the id,
        # "true" on a sequence's first request here, and the close signal ("true" from the
        # client; a handler sets it in a response, naming the sequence, to close it).
        self.header_key_sequence_id = SEQUENCE_ID_HEADER
        self.header_key_sequence_start = SEQUENCE_START_HEADER
        self.header_key_sequence_end = SEQUENCE_END_HEADER
        #: How the model runs its batches (batch buckets, CUDA graphs or eager, why not): a
        #: handler fills it in ``initialize``; the worker reports it in LOADED (empty: eager).
        self.execution = worker_pb2.Execution()

    @property
    def metrics(self) -> MetricCacheAbstract:
        """The handler's metrics API (a property, as TorchServe's ``Context.metrics``)."""
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: MetricCacheAbstract) -> None:
        self._metrics = metrics

    @property
    def system_properties(self) -> dict[str, Any]:
        return self._system_properties

    #: Installed by the worker: sends one intermediate response to the frontend at once.
    partial_sink: Callable[[str, Any, int], None] | None = None
    #: Intermediate responses sent during the current batch (a batch that streamed some
    #: cannot be re-run).
    partials_sent: int = 0

    def send_intermediate(self, idx: int, item: Any, status: int = 200) -> None:
        """Stream ``item`` to request ``idx`` now, before the batch's final results
        (HTTP: one chunk of a chunked response; gRPC StreamPredictions: one message)."""
        if self.partial_sink is None:
            raise RuntimeError("intermediate responses need a running worker")
        self.partial_sink(self.request_ids[idx], item, status)
        self.partials_sent += 1

    def begin_batch(self, request_ids: list[str], headers: list[Mapping[str, str]]) -> None:
        """Reset the per-batch state: ids, request headers, response statuses and headers."""
        self.request_ids = dict(enumerate(request_ids))
        self.request_processor = [RequestProcessor(h) for h in headers]
        self.partials_sent = 0
        self.metrics.request_ids = self.request_ids
        self.input_parameters = {}
        self.request_parameters = {}
        self.output_parameters = {}

    # --- requests -------------------------------------------------------------------------

    def get_request_id(self, idx: int = 0) -> str | None:
        return self.request_ids.get(idx)

    def get_request_header(self, idx: int, key: str) -> str | None:
        return self.request_processor[idx].get_request_property(key)

    def get_all_request_header(self, idx: int) -> dict[str, str]:
        return self.request_processor[idx].get_request_properties()

    def get_sequence_id(self, idx: int) -> str | None:
        return self.get_request_header(idx, SEQUENCE_ID_HEADER)

    # --- responses ------------------------------------------------------------------------

    def set_response_content_type(self, idx: int, value: str) -> None:
        self.set_response_header(idx, CONTENT_TYPE, value)

    def get_response_content_type(self, idx: int) -> str | None:
        return self.request_processor[idx].get_response_header(CONTENT_TYPE)

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        # Outside a batch (e.g. from initialize) there is no request to set it on.
        if not self.request_processor:
            return
        self.request_processor[idx].report_status(code, phrase)

    def set_all_response_status(self, code: int = 200, phrase: str = "") -> None:
        for processor in self.request_processor:
            processor.report_status(code, phrase)

    def get_response_status(self, idx: int) -> tuple[int, str]:
        processor = self.request_processor[idx]
        return processor.get_response_status_code(), processor.get_response_status_phrase()

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self.request_processor[idx].add_response_property(key, value)

    def get_response_headers(self, idx: int) -> dict[str, str]:
        return self.request_processor[idx].get_response_headers()


class OneRequestContext:
    """A batch's context seen as a batch of one: request ``idx`` is at index 0 (what code
    written for one request at a time reads and sets: the SageMaker toolkit's service, a
    workflow's function); everything else is the batch's context."""

    def __init__(self, context: Context, idx: int) -> None:
        self._context = context
        self._idx = idx

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    @property
    def request_processor(self) -> list[RequestProcessor]:
        return [self._context.request_processor[self._idx]]

    @property
    def request_ids(self) -> dict[int, str]:
        request_id = self._context.get_request_id(self._idx)
        return {} if request_id is None else {0: request_id}

    def get_request_id(self, idx: int = 0) -> str | None:
        return self._context.get_request_id(self._idx)

    def get_request_header(self, idx: int, key: str) -> str | None:
        return self._context.get_request_header(self._idx, key)

    def get_all_request_header(self, idx: int) -> dict[str, str]:
        return self._context.get_all_request_header(self._idx)

    def get_sequence_id(self, idx: int) -> str | None:
        return self._context.get_sequence_id(self._idx)

    def set_response_content_type(self, idx: int, value: str) -> None:
        self._context.set_response_content_type(self._idx, value)

    def get_response_content_type(self, idx: int) -> str | None:
        return self._context.get_response_content_type(self._idx)

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        self._context.set_response_status(code, phrase, self._idx)

    def set_all_response_status(self, code: int = 200, phrase: str = "") -> None:
        self._context.set_response_status(code, phrase, self._idx)

    def get_response_status(self, idx: int) -> tuple[int, str]:
        return self._context.get_response_status(self._idx)

    def set_response_header(self, idx: int, key: str, value: str) -> None:
        self._context.set_response_header(self._idx, key, value)

    def get_response_headers(self, idx: int) -> dict[str, str]:
        return self._context.get_response_headers(self._idx)

    def send_intermediate(self, idx: int, item: Any, status: int = 200) -> None:
        self._context.send_intermediate(self._idx, item, status)


def read_manifest(manifest_json: str) -> dict[str, Any]:
    """Parse LoadModel.manifest_json; an empty string means no manifest."""
    if not manifest_json.strip():
        return {}
    manifest = json.loads(manifest_json)
    if not isinstance(manifest, dict):
        raise ValueError(f"the manifest must be a JSON object, got {type(manifest).__name__}")
    return manifest


def read_model_yaml_config(model_dir: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The archive's model config YAML (manifest ``model.configFile``), or {} without one."""
    model = manifest.get("model")
    config_file = model.get("configFile") if isinstance(model, Mapping) else None
    if not config_file:
        return {}
    path = model_dir / str(config_file)
    if not path.is_file():
        return {}
    import yaml  # only archives with a config file pay for it

    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"{path.name} must hold a mapping, got {type(loaded).__name__}")
    return loaded
