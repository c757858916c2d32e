"""The gRPC listeners: TorchServe's services on ``grpc_inference_port`` and
``grpc_management_port`` (TorchServe's own stubs work unchanged), KServe's Open Inference
service beside the inference one (and on KServe's port under KServe); health checking and
reflection on each, for grpcurl and Kubernetes gRPC probes. Under ``enable_grpc_ssl`` the
inference and management ports speak TLS with the server's certificate, as TorchServe's do;
KServe's port stays plain (KServe's own gRPC is h2c behind its ingress; TorchServe has no such
port)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from frontend.api.grpc.inference import InferenceServicer
from frontend.api.grpc.management import ManagementServicer
from frontend.api.grpc.open_inference import OpenInferenceServicer
from frontend.config import ServerConfig
from frontend.ops.services import Services
from frontend.tls import ServerCertificate
from protos import inference_pb2, management_pb2_grpc, open_inference_pb2

#: The generated registration function, typed (grpcio-tools writes it without annotations).
_add_management: Callable[[management_pb2_grpc.ManagementAPIsServiceServicer, grpc.aio.Server],
                          None] = \
    management_pb2_grpc.add_ManagementAPIsServiceServicer_to_server

#: Prediction RPCs get their request's bytes: they are read within bounds (wire.py), never
#: decoded whole in the event loop by grpc first.
RAW_REQUEST_METHODS = frozenset({"Predictions", "StreamPredictions", "StreamPredictions2",
                                 "ModelInfer"})
_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def service_handler(service: ServiceDescriptor, servicer: object,
                    raw_requests: frozenset[str]) -> grpc.GenericRpcHandler:
    """What the generated ``add_*_to_server`` registers, from the service's descriptor, except
    that the methods named in ``raw_requests`` receive their requests undecoded (bytes)."""
    handlers = {}
    for method in service.methods:
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=None if method.name in raw_requests else request.FromString,
            response_serializer=response.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


_INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"]
_OPEN_INFERENCE = open_inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
INFERENCE_SERVICE = InferenceServicer.service
OPEN_INFERENCE_SERVICE = OpenInferenceServicer.service
MANAGEMENT_SERVICE = ManagementServicer.service


_FOREVER_MS = 2**31 - 1


def connection_age_options(config: ServerConfig, management: bool
                           ) -> list[tuple[str, int]]:
    """TorchServe's ``grpc_{inference,management}_max_connection_age[_grace]_ms`` as gRPC's
    channel options (none set: connections live for ever, TorchServe's default)."""
    if management:
        age = config.grpc_management_max_connection_age_ms
        grace = config.grpc_management_max_connection_age_grace_ms
    else:
        age = config.grpc_inference_max_connection_age_ms
        grace = config.grpc_inference_max_connection_age_grace_ms
    # gRPC's options are C ints: its largest means "for ever", as TorchServe's Long.MAX_VALUE.
    options = []
    if age is not None:
        options.append(("grpc.max_connection_age_ms", min(age, _FOREVER_MS)))
    if grace is not None:
        options.append(("grpc.max_connection_age_grace_ms", min(grace, _FOREVER_MS)))
    return options


class GrpcServers:
    """The gRPC listeners (inference, management; KServe's too under KServe): bound at
    start, stopped with a grace period."""

    def __init__(self, services: Services, certificate: ServerCertificate | None = None
                 ) -> None:
        """``certificate``: TLS on the inference and management ports (enable_grpc_ssl)."""
        self.services = services
        self._credentials = None if certificate is None else grpc.ssl_server_credentials(
            [(certificate.key_pem, certificate.chain_pem)])
        self._servers: list[grpc.aio.Server] = []
        self.ports: dict[str, int] = {}

    async def start(self) -> None:
        config = self.services.config
        def open_inference() -> grpc.GenericRpcHandler:
            return service_handler(_OPEN_INFERENCE, OpenInferenceServicer(self.services),
                                   RAW_REQUEST_METHODS)

        def add_inference(server: grpc.aio.Server) -> None:
            server.add_generic_rpc_handlers((
                service_handler(_INFERENCE, InferenceServicer(self.services),
                                RAW_REQUEST_METHODS),
                open_inference()))

        plan = [
            ("inference", config.grpc_inference_address, config.grpc_inference_port,
             (INFERENCE_SERVICE, OPEN_INFERENCE_SERVICE), add_inference),
            ("management", config.grpc_management_address, config.grpc_management_port,
             (MANAGEMENT_SERVICE,), lambda server: _add_management(
                 ManagementServicer(self.services), server)),
        ]
        if config.kserve_protocol and (config.kserve_grpc_port != config.grpc_inference_port
                                       or not config.kserve_grpc_port):
            # Where KServe sends gRPC (8081, its h2c port), on the inference address's host,
            # as TorchServe's wrapper served it: the Open Inference service alone.
            plan.append((
                "kserve", config.inference_address.host, config.kserve_grpc_port,
                (OPEN_INFERENCE_SERVICE,),
                lambda server: server.add_generic_rpc_handlers((open_inference(),))))
        for name, host, port, service_names, add in plan:
            server = grpc.aio.server(options=[
                ("grpc.max_receive_message_length", config.max_request_size_bytes),
                ("grpc.max_send_message_length", config.max_response_size_bytes),
                ("grpc.so_reuseport", 0),
                *connection_age_options(config, management=name == "management"),
            ])
            add(server)
            health_servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            reflection.enable_server_reflection(
                (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
            target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            try:
                if self._credentials is not None and name != "kserve":
                    bound = server.add_secure_port(target, self._credentials)
                else:
                    bound = server.add_insecure_port(target)
            except RuntimeError as exc:
                raise OSError(f"cannot bind gRPC {name} port {target}: {exc}") from None
            if bound == 0:
                raise OSError(f"cannot bind gRPC {name} port {target}")
            await server.start()
            for service in ("", *service_names):
                await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
            self._servers.append(server)
            self.ports[name] = bound

    async def stop(self, grace_s: float) -> None:
        await asyncio.gather(*(server.stop(grace_s) for server in self._servers))
        self._servers.clear()
