"""The gRPC listeners: TorchServe's services on ``grpc_inference_port`` and
``grpc_management_port`` (TorchServe's own stubs work unchanged), KServe's Open Inference
service beside the inference one (and on KServe's port under KServe); health checking and
reflection on each, for grpcurl and Kubernetes gRPC probes. Under ``enable_grpc_ssl`` the
inference and management ports speak TLS with the server's certificate, as TorchServe's do;
KServe's port stays plain (KServe's own gRPC is h2c behind its ingress; TorchServe has no such
port).

With front processes (``number_of_netty_threads`` > 1, frontend/front/), the inference port
(and KServe's) is shared with them (SO_REUSEPORT), and the same services are served on an
inner Unix socket in the run directory (0600) for the calls the fronts relay: only there is a
call's ``FRONT_PEER`` metadata believed (common.FrontCalls)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from frontend.api.grpc.common import FrontCalls
from frontend.api.grpc.inference import InferenceServicer
from frontend.api.grpc.management import ManagementServicer
from frontend.api.grpc.open_inference import OpenInferenceServicer
from frontend.config import ServerConfig
from frontend.ops.services import Services
from frontend.tls import ServerCertificate
from protos import inference_pb2, management_pb2, open_inference_pb2

#: Prediction RPCs get their request's bytes: they are read within bounds (wire.py), never
#: decoded whole in the event loop by grpc first.
RAW_REQUEST_METHODS = frozenset({"Predictions", "StreamPredictions", "StreamPredictions2",
                                 "ModelInfer"})
HANDLER_KINDS = {
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
        kind = HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=None if method.name in raw_requests else request.FromString,
            response_serializer=response.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


_INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["InferenceAPIsService"]
_OPEN_INFERENCE = open_inference_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
_MANAGEMENT = management_pb2.DESCRIPTOR.services_by_name["ManagementAPIsService"]
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


#: A port's services, made for its public server (None) or its inner one (the fronts' calls).
Handlers = Callable[[FrontCalls | None], Sequence[grpc.GenericRpcHandler]]


@dataclass(frozen=True, slots=True)
class SharedPort:
    """A gRPC port the front processes accept on too, and where they relay its calls."""

    name: str
    #: ``host:port`` as bound (the port a 0 became).
    target: str
    #: The inner Unix socket (its path) serving the same services for the fronts' calls.
    inner: str
    tls: bool
    #: The port's channel options (message sizes, connection ages, SO_REUSEPORT).
    options: list[tuple[str, int]]


class GrpcServers:
    """The gRPC listeners (inference, management; KServe's too under KServe): bound at
    start, stopped with a grace period. With ``inner_dir`` (front processes), the inference
    and KServe ports bind with SO_REUSEPORT and have inner servers on Unix sockets in
    ``inner_dir`` (``shared``: what the fronts are told)."""

    def __init__(self, services: Services, certificate: ServerCertificate | None = None,
                 inner_dir: Path | None = None) -> None:
        """``certificate``: TLS on the inference and management ports (enable_grpc_ssl)."""
        self.services = services
        self._credentials = None if certificate is None else grpc.ssl_server_credentials(
            [(certificate.key_pem, certificate.chain_pem)])
        self._servers: list[grpc.aio.Server] = []
        self._inner_dir = inner_dir
        self._inner_servers: list[grpc.aio.Server] = []
        self.ports: dict[str, int] = {}
        #: The ports shared with the front processes, once started.
        self.shared: list[SharedPort] = []
        #: The calls the fronts relayed (``batchserve_front_grpc_requests_total``).
        self.front_calls = FrontCalls()

    async def start(self) -> None:
        config = self.services.config
        services = self.services

        def open_inference(fronts: FrontCalls | None) -> grpc.GenericRpcHandler:
            return service_handler(_OPEN_INFERENCE, OpenInferenceServicer(services, fronts),
                                   RAW_REQUEST_METHODS)

        plan: list[tuple[str, str, int, tuple[str, ...], Handlers]] = [
            ("inference", config.grpc_inference_address, config.grpc_inference_port,
             (INFERENCE_SERVICE, OPEN_INFERENCE_SERVICE), lambda fronts: (
                 service_handler(_INFERENCE, InferenceServicer(services, fronts),
                                 RAW_REQUEST_METHODS),
                 open_inference(fronts))),
            ("management", config.grpc_management_address, config.grpc_management_port,
             (MANAGEMENT_SERVICE,), lambda fronts: (
                 service_handler(_MANAGEMENT, ManagementServicer(services), frozenset()),)),
        ]
        if config.kserve_protocol and (config.kserve_grpc_port != config.grpc_inference_port
                                       or not config.kserve_grpc_port):
            # Where KServe sends gRPC (8081, its h2c port), on the inference address's host,
            # as TorchServe's wrapper served it: the Open Inference service alone.
            plan.append(("kserve", config.inference_address.host, config.kserve_grpc_port,
                         (OPEN_INFERENCE_SERVICE,), lambda fronts: (open_inference(fronts),)))
        for name, host, port, service_names, handlers in plan:
            shared = self._inner_dir is not None and name != "management"
            sizes = [("grpc.max_receive_message_length", config.max_request_size_bytes),
                     ("grpc.max_send_message_length", config.max_response_size_bytes)]
            options = [*sizes, ("grpc.so_reuseport", int(shared)),
                       *connection_age_options(config, management=name == "management")]
            tls = self._credentials is not None and name != "kserve"
            target = _target(host, port)

            def bind(server: grpc.aio.Server, name: str = name, target: str = target,
                     tls: bool = tls) -> int:
                try:
                    if tls:
                        assert self._credentials is not None
                        return server.add_secure_port(target, self._credentials)
                    return server.add_insecure_port(target)
                except RuntimeError as exc:
                    raise OSError(f"cannot bind gRPC {name} port {target}: {exc}") from None

            server, bound = await _serve(options, handlers(None), service_names, bind)
            if bound == 0:
                raise OSError(f"cannot bind gRPC {name} port {target}")
            self._servers.append(server)
            self.ports[name] = bound
            if shared:
                assert self._inner_dir is not None
                path = self._inner_dir / f"grpc-{name}.sock"
                path.unlink(missing_ok=True)
                inner, _ = await _serve(sizes, handlers(self.front_calls), service_names,
                                        _unix_port(path))
                path.chmod(0o600)
                self._inner_servers.append(inner)
                self.shared.append(SharedPort(name, _target(host, bound), str(path), tls,
                                              options))

    async def stop(self, grace_s: float, inner: bool = True) -> None:
        """Stop the public servers; and the inner ones, unless ``inner`` is False (at a stop
        they stay until the fronts, whose open calls they answer, are gone)."""
        servers = self._servers + (self._inner_servers if inner else [])
        await asyncio.gather(*(server.stop(grace_s) for server in servers))
        self._servers.clear()
        if inner:
            self._inner_servers.clear()
            for port in self.shared:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(port.inner)


def _unix_port(path: Path) -> Callable[[grpc.aio.Server], int]:
    return lambda server: server.add_insecure_port(f"unix:{path}")


def _target(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _serve(options: list[tuple[str, int]], handlers: Sequence[grpc.GenericRpcHandler],
                 service_names: tuple[str, ...], bind: Callable[[grpc.aio.Server], int]
                 ) -> tuple[grpc.aio.Server, int]:
    """A started server with ``handlers``, health checking and reflection; ``bind``: its
    port, the port bound (0: none; the server is not started)."""
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers(tuple(handlers))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = bind(server)
    if bound == 0:
        return server, 0
    await server.start()
    for service in ("", *service_names):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
