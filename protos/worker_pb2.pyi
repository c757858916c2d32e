from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_FORMAT_NONE: _ClassVar[TensorFormat]
    TENSOR_FORMAT_REST: _ClassVar[TensorFormat]
    TENSOR_FORMAT_GRPC: _ClassVar[TensorFormat]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    INTERNAL: _ClassVar[ErrorCode]
    INVALID_INPUT: _ClassVar[ErrorCode]
    OUT_OF_MEMORY: _ClassVar[ErrorCode]
    LOAD_FAILED: _ClassVar[ErrorCode]
    BATCH_SIZE_MISMATCH: _ClassVar[ErrorCode]
    PROTOCOL: _ClassVar[ErrorCode]
TENSOR_FORMAT_NONE: TensorFormat
TENSOR_FORMAT_REST: TensorFormat
TENSOR_FORMAT_GRPC: TensorFormat
ERROR_CODE_UNSPECIFIED: ErrorCode
INTERNAL: ErrorCode
INVALID_INPUT: ErrorCode
OUT_OF_MEMORY: ErrorCode
LOAD_FAILED: ErrorCode
BATCH_SIZE_MISMATCH: ErrorCode
PROTOCOL: ErrorCode

class Hello(_message.Message):
    __slots__ = ("pid",)
    PID_FIELD_NUMBER: _ClassVar[int]
    pid: int
    def __init__(self, pid: _Optional[int] = ...) -> None: ...

class LoadModel(_message.Message):
    __slots__ = ("model_name", "model_version", "model_dir", "handler", "batch_size", "gpu_id", "manifest_json", "limit_max_image_pixels", "worker_id", "envelope", "decode_input_request", "server_version", "response_timeout_ms", "cpu_threads", "dependency_dirs", "metrics_config", "workflow_function")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GPU_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_JSON_FIELD_NUMBER: _ClassVar[int]
    LIMIT_MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INPUT_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CPU_THREADS_FIELD_NUMBER: _ClassVar[int]
    DEPENDENCY_DIRS_FIELD_NUMBER: _ClassVar[int]
    METRICS_CONFIG_FIELD_NUMBER: _ClassVar[int]
    WORKFLOW_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    model_dir: str
    handler: str
    batch_size: int
    gpu_id: int
    manifest_json: str
    limit_max_image_pixels: bool
    worker_id: str
    envelope: str
    decode_input_request: bool
    server_version: str
    response_timeout_ms: int
    cpu_threads: int
    dependency_dirs: _containers.RepeatedScalarFieldContainer[str]
    metrics_config: str
    workflow_function: bool
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ..., model_dir: _Optional[str] = ..., handler: _Optional[str] = ..., batch_size: _Optional[int] = ..., gpu_id: _Optional[int] = ..., manifest_json: _Optional[str] = ..., limit_max_image_pixels: _Optional[bool] = ..., worker_id: _Optional[str] = ..., envelope: _Optional[str] = ..., decode_input_request: _Optional[bool] = ..., server_version: _Optional[str] = ..., response_timeout_ms: _Optional[int] = ..., cpu_threads: _Optional[int] = ..., dependency_dirs: _Optional[_Iterable[str]] = ..., metrics_config: _Optional[str] = ..., workflow_function: _Optional[bool] = ...) -> None: ...

class Loaded(_message.Message):
    __slots__ = ("load_time_ms", "metrics", "execution")
    LOAD_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_FIELD_NUMBER: _ClassVar[int]
    load_time_ms: float
    metrics: _containers.RepeatedCompositeFieldContainer[Metric]
    execution: Execution
    def __init__(self, load_time_ms: _Optional[float] = ..., metrics: _Optional[_Iterable[_Union[Metric, _Mapping]]] = ..., execution: _Optional[_Union[Execution, _Mapping]] = ...) -> None: ...

class Execution(_message.Message):
    __slots__ = ("batch_buckets", "mode", "fallback_reason", "graph_pool_bytes", "program")
    BATCH_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    GRAPH_POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    batch_buckets: _containers.RepeatedScalarFieldContainer[int]
    mode: str
    fallback_reason: str
    graph_pool_bytes: int
    program: str
    def __init__(self, batch_buckets: _Optional[_Iterable[int]] = ..., mode: _Optional[str] = ..., fallback_reason: _Optional[str] = ..., graph_pool_bytes: _Optional[int] = ..., program: _Optional[str] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("request_id", "headers", "inputs", "content_types", "describe", "instances", "tensor_format")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class InputsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    class ContentTypesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPES_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FORMAT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    headers: _containers.ScalarMap[str, str]
    inputs: _containers.ScalarMap[str, bytes]
    content_types: _containers.ScalarMap[str, str]
    describe: bool
    instances: bool
    tensor_format: TensorFormat
    def __init__(self, request_id: _Optional[str] = ..., headers: _Optional[_Mapping[str, str]] = ..., inputs: _Optional[_Mapping[str, bytes]] = ..., content_types: _Optional[_Mapping[str, str]] = ..., describe: _Optional[bool] = ..., instances: _Optional[bool] = ..., tensor_format: _Optional[_Union[TensorFormat, str]] = ...) -> None: ...

class PredictBatch(_message.Message):
    __slots__ = ("batch_id", "requests")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    requests: _containers.RepeatedCompositeFieldContainer[Request]
    def __init__(self, batch_id: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[Request, _Mapping]]] = ...) -> None: ...

class Response(_message.Message):
    __slots__ = ("request_id", "status", "reason", "content_type", "body", "headers", "error", "error_type")
    class HeadersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: int
    reason: str
    content_type: str
    body: bytes
    headers: _containers.ScalarMap[str, str]
    error: str
    error_type: str
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[int] = ..., reason: _Optional[str] = ..., content_type: _Optional[str] = ..., body: _Optional[bytes] = ..., headers: _Optional[_Mapping[str, str]] = ..., error: _Optional[str] = ..., error_type: _Optional[str] = ...) -> None: ...

class Metric(_message.Message):
    __slots__ = ("name", "unit", "type", "value", "dimension_names", "dimension_values", "request_id", "hostname")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_NAMES_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_VALUES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    unit: str
    type: str
    value: float
    dimension_names: _containers.RepeatedScalarFieldContainer[str]
    dimension_values: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    hostname: str
    def __init__(self, name: _Optional[str] = ..., unit: _Optional[str] = ..., type: _Optional[str] = ..., value: _Optional[float] = ..., dimension_names: _Optional[_Iterable[str]] = ..., dimension_values: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., hostname: _Optional[str] = ...) -> None: ...

class PredictResult(_message.Message):
    __slots__ = ("batch_id", "responses", "handler_time_ms", "metrics", "phases")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    HANDLER_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    PHASES_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    responses: _containers.RepeatedCompositeFieldContainer[Response]
    handler_time_ms: float
    metrics: _containers.RepeatedCompositeFieldContainer[Metric]
    phases: HandlerPhases
    def __init__(self, batch_id: _Optional[int] = ..., responses: _Optional[_Iterable[_Union[Response, _Mapping]]] = ..., handler_time_ms: _Optional[float] = ..., metrics: _Optional[_Iterable[_Union[Metric, _Mapping]]] = ..., phases: _Optional[_Union[HandlerPhases, _Mapping]] = ...) -> None: ...

class HandlerPhases(_message.Message):
    __slots__ = ("steps", "preprocess_ms", "inference_ms", "postprocess_ms")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_MS_FIELD_NUMBER: _ClassVar[int]
    POSTPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    steps: bool
    preprocess_ms: float
    inference_ms: float
    postprocess_ms: float
    def __init__(self, steps: _Optional[bool] = ..., preprocess_ms: _Optional[float] = ..., inference_ms: _Optional[float] = ..., postprocess_ms: _Optional[float] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "batch_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    batch_id: int
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., batch_id: _Optional[int] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("socket_path", "environment", "cpu_threads", "cpus", "handler", "model_dir", "name")
    class EnvironmentEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    CPU_THREADS_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    HANDLER_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    socket_path: str
    environment: _containers.ScalarMap[str, str]
    cpu_threads: int
    cpus: _containers.RepeatedScalarFieldContainer[int]
    handler: str
    model_dir: str
    name: str
    def __init__(self, socket_path: _Optional[str] = ..., environment: _Optional[_Mapping[str, str]] = ..., cpu_threads: _Optional[int] = ..., cpus: _Optional[_Iterable[int]] = ..., handler: _Optional[str] = ..., model_dir: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Forked(_message.Message):
    __slots__ = ("pid", "refused", "lasting")
    PID_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    LASTING_FIELD_NUMBER: _ClassVar[int]
    pid: int
    refused: str
    lasting: bool
    def __init__(self, pid: _Optional[int] = ..., refused: _Optional[str] = ..., lasting: _Optional[bool] = ...) -> None: ...

class ChildExited(_message.Message):
    __slots__ = ("pid", "returncode")
    PID_FIELD_NUMBER: _ClassVar[int]
    RETURNCODE_FIELD_NUMBER: _ClassVar[int]
    pid: int
    returncode: int
    def __init__(self, pid: _Optional[int] = ..., returncode: _Optional[int] = ...) -> None: ...
