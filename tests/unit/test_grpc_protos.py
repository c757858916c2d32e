"""The gRPC contract is TorchServe's: a client generated from TorchServe 0.12's
inference.proto / management.proto must work against ours unchanged.

What such a client depends on: the full service and method names (they are the
HTTP/2 paths), the streaming kind of each method, and each message's field
numbers and wire types. Field names are checked too, since they show through
server reflection and the JSON mapping.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from google.protobuf import empty_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from protos import inference_pb2, inference_pb2_grpc, management_pb2, management_pb2_grpc

F = FieldDescriptor
STRING, BYTES, INT32, BOOL, MESSAGE = (
    F.TYPE_STRING,
    F.TYPE_BYTES,
    F.TYPE_INT32,
    F.TYPE_BOOL,
    F.TYPE_MESSAGE,
)

INFERENCE_SERVICE = "org.pytorch.serve.grpc.inference.InferenceAPIsService"
MANAGEMENT_SERVICE = "org.pytorch.serve.grpc.management.ManagementAPIsService"

# method -> (request, response, client streaming, server streaming)
INFERENCE_METHODS = {
    "Ping": ("google.protobuf.Empty", "TorchServeHealthResponse", False, False),
    "Predictions": ("PredictionsRequest", "PredictionResponse", False, False),
    "StreamPredictions": ("PredictionsRequest", "PredictionResponse", False, True),
    "StreamPredictions2": ("PredictionsRequest", "PredictionResponse", True, True),
}
MANAGEMENT_METHODS = {
    name: (f"{name}Request", "ManagementResponse", False, False)
    for name in (
        "DescribeModel",
        "ListModels",
        "RegisterModel",
        "ScaleWorker",
        "SetDefault",
        "UnregisterModel",
    )
}

# message -> {field: (number, type)}
INFERENCE_MESSAGES = {
    "PredictionsRequest": {
        "model_name": (1, STRING),
        "model_version": (2, STRING),
        "input": (3, MESSAGE),  # map<string, bytes>, checked below
        "sequence_id": (4, STRING),
    },
    "PredictionResponse": {
        "prediction": (1, BYTES),
        "sequence_id": (2, STRING),
        "status": (3, MESSAGE),  # google.rpc.Status
    },
    "TorchServeHealthResponse": {"health": (1, STRING)},
}
MANAGEMENT_MESSAGES = {
    "ManagementResponse": {"msg": (1, STRING)},
    "DescribeModelRequest": {
        "model_name": (1, STRING),
        "model_version": (2, STRING),
        "customized": (3, BOOL),
    },
    "ListModelsRequest": {"limit": (1, INT32), "next_page_token": (2, INT32)},
    "RegisterModelRequest": {
        "batch_size": (1, INT32),
        "handler": (2, STRING),
        "initial_workers": (3, INT32),
        "max_batch_delay": (4, INT32),
        "model_name": (5, STRING),
        "response_timeout": (6, INT32),
        "runtime": (7, STRING),
        "synchronous": (8, BOOL),
        "url": (9, STRING),
        "s3_sse_kms": (10, BOOL),
        "startup_timeout": (11, INT32),
    },
    "ScaleWorkerRequest": {
        "model_name": (1, STRING),
        "model_version": (2, STRING),
        "max_worker": (3, INT32),
        "min_worker": (4, INT32),
        "number_gpu": (5, INT32),
        "synchronous": (6, BOOL),
        "timeout": (7, INT32),
    },
    "SetDefaultRequest": {"model_name": (1, STRING), "model_version": (2, STRING)},
    "UnregisterModelRequest": {"model_name": (1, STRING), "model_version": (2, STRING)},
}
# Fields declared `optional` (explicit presence); every other scalar has none.
WITH_PRESENCE = {
    ("PredictionsRequest", "sequence_id"),
    ("PredictionResponse", "sequence_id"),
    ("PredictionResponse", "status"),
    # Numbers a client may set to 0 on purpose: checked as the REST parameters are.
    *(("RegisterModelRequest", name) for name in (
        "batch_size", "initial_workers", "max_batch_delay", "response_timeout",
        "startup_timeout")),
    *(("ScaleWorkerRequest", name) for name in (
        "max_worker", "min_worker", "number_gpu", "timeout")),
}

CASES = [
    (inference_pb2, INFERENCE_SERVICE, INFERENCE_METHODS, INFERENCE_MESSAGES),
    (management_pb2, MANAGEMENT_SERVICE, MANAGEMENT_METHODS, MANAGEMENT_MESSAGES),
]
IDS = ["inference", "management"]


@pytest.mark.parametrize(("module", "service", "methods", "messages"), CASES, ids=IDS)
def test_package_and_file_match_torchserve(module, service, methods, messages) -> None:
    package = service.rsplit(".", 1)[0]
    assert module.DESCRIPTOR.package == package
    # TorchServe compiles with the proto folder as include root; reflection shows this name.
    assert module.DESCRIPTOR.name == f"{package.rsplit('.', 1)[1]}.proto"
    assert set(module.DESCRIPTOR.services_by_name) == {service.rsplit(".", 1)[1]}
    assert set(module.DESCRIPTOR.message_types_by_name) == set(messages)
    assert not module.DESCRIPTOR.enum_types_by_name


@pytest.mark.parametrize(("module", "service", "methods", "messages"), CASES, ids=IDS)
def test_services_and_methods(module, service, methods, messages) -> None:
    descriptor = module.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]]
    assert descriptor.full_name == service
    assert set(descriptor.methods_by_name) == set(methods)
    package = service.rsplit(".", 1)[0]
    for name, (request, response, client_streaming, server_streaming) in methods.items():
        method = descriptor.methods_by_name[name]
        expected_request = request if "." in request else f"{package}.{request}"
        assert method.input_type.full_name == expected_request, name
        assert method.output_type.full_name == f"{package}.{response}", name
        assert method.client_streaming is client_streaming, name
        assert method.server_streaming is server_streaming, name


@pytest.mark.parametrize(("module", "service", "methods", "messages"), CASES, ids=IDS)
def test_every_field_name_number_and_type(module, service, methods, messages) -> None:
    for message_name, fields in messages.items():
        descriptor: Descriptor = module.DESCRIPTOR.message_types_by_name[message_name]
        assert set(descriptor.fields_by_name) == set(fields), message_name
        assert not descriptor.oneofs or all(
            oneof.name.startswith("_") for oneof in descriptor.oneofs
        ), f"{message_name}: only the synthetic oneofs of `optional` fields"
        for field_name, field in descriptor.fields_by_name.items():
            where = f"{message_name}.{field_name}"
            number, field_type = fields[field_name]
            assert field.number == number, where
            assert field.type == field_type, where
            assert field.is_repeated is (field_name == "input"), where
            assert field.has_presence is ((message_name, field_name) in WITH_PRESENCE), where


def test_sequence_id_is_optional_with_presence() -> None:
    for message in (inference_pb2.PredictionsRequest, inference_pb2.PredictionResponse):
        field = message.DESCRIPTOR.fields_by_name["sequence_id"]
        assert field.has_presence
        assert field.containing_oneof is not None and field.containing_oneof.name == "_sequence_id"
        # Same JSON name as TorchServe's field (and as its older `sequenceId` spelling).
        assert field.json_name == "sequenceId"
        instance = message()
        assert not instance.HasField("sequence_id")
        instance.sequence_id = ""
        assert instance.HasField("sequence_id")


def test_input_is_a_map_of_string_to_bytes() -> None:
    field = inference_pb2.PredictionsRequest.DESCRIPTOR.fields_by_name["input"]
    entry = field.message_type
    assert entry.GetOptions().map_entry
    assert entry.fields_by_name["key"].type == STRING
    assert entry.fields_by_name["key"].number == 1
    assert entry.fields_by_name["value"].type == BYTES
    assert entry.fields_by_name["value"].number == 2
    request = inference_pb2.PredictionsRequest(model_name="m", input={"data": b"\x00\xff"})
    assert dict(request.input) == {"data": b"\x00\xff"}


def test_status_is_google_rpc_status_from_googleapis_common_protos() -> None:
    from google.rpc import status_pb2

    field = inference_pb2.PredictionResponse.DESCRIPTOR.fields_by_name["status"]
    assert field.message_type.full_name == "google.rpc.Status"
    assert field.message_type is status_pb2.Status.DESCRIPTOR
    assert [dep.name for dep in inference_pb2.DESCRIPTOR.dependencies] == [
        "google/protobuf/empty.proto",
        "google/rpc/status.proto",
    ]


def test_bytes_on_the_wire() -> None:
    # What a TorchServe client puts on the wire, spelled out field by field.
    request = inference_pb2.PredictionsRequest(
        model_name="m", model_version="2", input={"k": b"v"}, sequence_id="s"
    )
    entry = b"\x0a\x01k\x12\x01v"
    expected = b"\x0a\x01m" + b"\x12\x012" + b"\x1a" + bytes([len(entry)]) + entry + b"\x22\x01s"
    assert request.SerializeToString(deterministic=True) == expected
    register = management_pb2.RegisterModelRequest(
        batch_size=4, synchronous=True, url="a.mar", s3_sse_kms=True, startup_timeout=7
    )
    assert register.SerializeToString() == (
        b"\x08\x04" + b"\x40\x01" + b"\x4a\x05a.mar" + b"\x50\x01" + b"\x58\x07"
    )
    scale = management_pb2.ScaleWorkerRequest(model_name="m", timeout=-1)
    assert management_pb2.ScaleWorkerRequest.FromString(scale.SerializeToString()).timeout == -1


@pytest.mark.parametrize(
    ("module", "service", "messages"),
    [
        (inference_pb2_grpc, "InferenceAPIsService", inference_pb2),
        (management_pb2_grpc, "ManagementAPIsService", management_pb2),
    ],
    ids=IDS,
)
def test_grpc_modules_expose_servicer_stub_and_registration(module, service, messages) -> None:
    servicer = getattr(module, f"{service}Servicer")
    assert isinstance(servicer, type)
    assert callable(getattr(module, f"add_{service}Servicer_to_server"))
    assert isinstance(getattr(module, f"{service}Stub"), type)
    methods = INFERENCE_METHODS if service.startswith("Inference") else MANAGEMENT_METHODS
    for name in methods:
        assert callable(getattr(servicer, name)), name
    # Imported as protos.<name>_pb2 (one module, one descriptor), not as a top-level module.
    alias = messages.__name__.removeprefix("protos.").replace("_pb2", "__pb2")
    assert vars(module)[alias] is messages


def test_stub_and_servicer_talk_over_loopback() -> None:
    class Inference(inference_pb2_grpc.InferenceAPIsServiceServicer):
        def Ping(self, request, context):
            return inference_pb2.TorchServeHealthResponse(health='{"status": "Healthy"}')

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(Inference(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
            reply = stub.Ping(empty_pb2.Empty(), timeout=10)
            assert reply.health == '{"status": "Healthy"}'
            with pytest.raises(grpc.RpcError) as failure:
                stub.Predictions(inference_pb2.PredictionsRequest(model_name="m"), timeout=10)
            assert failure.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(None)


def test_health_and_reflection_packages_are_installed() -> None:
    from grpc_health.v1 import health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    assert health_pb2_grpc.HealthServicer
    assert reflection.enable_server_reflection
