"""A front's gRPC ports: the inference port (and KServe's, when it is a port of its own),
shared with the owner (SO_REUSEPORT), each call relayed whole to the owner's inner gRPC server
on a Unix socket (``api/grpc/servers.py``).

The relay knows no message: requests and answers pass as bytes (no deserializer, no
serializer). It forwards the call's metadata, its deadline (the time left) and its
cancellation, and names the client in ``FRONT_PEER`` (a client's own is dropped); it answers
with the owner's initial metadata, messages, status, details and trailing metadata as they
came. A method of the owner's services is relayed in its kind (unary or streamed, each way);
any other is relayed as a stream both ways, which carries every kind on the wire, and the owner
answers it (UNIMPLEMENTED, say): health checking and reflection are the owner's too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from frontend.api.grpc.common import FRONT_PEER, Context
from frontend.api.grpc.servers import HANDLER_KINDS
from protos import inference_pb2, open_inference_pb2

#: The files of the services the owner serves on its shared ports.
_FILES = (inference_pb2.DESCRIPTOR, open_inference_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR,
          reflection_pb2.DESCRIPTOR)
#: A client's metadata not forwarded: ours to set, and gRPC's own (each channel sets it).
_DROPPED = frozenset({FRONT_PEER, "user-agent"})
#: The channel's call of each kind (client streaming, server streaming).
_CALLS = {(False, False): "unary_unary", (False, True): "unary_stream",
          (True, False): "stream_unary", (True, True): "stream_stream"}
#: The owner's inner socket is this process's own host: no size limits on it (the front's
#: port has the owner's, and the owner checks again).
_UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]

Metadata = tuple[tuple[str, str | bytes], ...]


def method_kinds() -> dict[str, tuple[bool, bool]]:
    """``/<service>/<method>`` of each method the owner serves on a shared port: whether its
    requests, and its answers, stream."""
    return {f"/{service.full_name}/{method.name}":
            (method.client_streaming, method.server_streaming)
            for file in _FILES for service in file.services_by_name.values()
            for method in service.methods}


def forwarded(metadata: Any, front: int, peer: str) -> Metadata:
    """A call's ``metadata`` as the owner gets it: the client's own, and who the client is."""
    return (*((key, value) for key, value in metadata or () if key not in _DROPPED),
            (FRONT_PEER, f"{front} {peer}"))


class Relay(grpc.GenericRpcHandler):
    """Every call to a shared port, relayed over ``channel`` (the owner's inner server)."""

    def __init__(self, front: int, channel: grpc.aio.Channel) -> None:
        self._front = front
        self._channel = channel
        self._kinds = method_kinds()
        self._handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    def service(self, handler_call_details: grpc.HandlerCallDetails
                ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None:
            handler = self._handler(method)
            if method in self._kinds:  # (not a name a client made up: those are not kept)
                self._handlers[method] = handler
        return handler

    def _handler(self, method: str) -> grpc.RpcMethodHandler[Any, Any]:
        kind = self._kinds.get(method, (True, True))
        start: Callable[..., Any] = getattr(self._channel, _CALLS[kind])(method)
        relay: Callable[[Any, Context], Awaitable[Any]] = _answers if kind[1] else _answer
        front = self._front

        async def handle(request: Any, context: Context) -> Any:
            call = start(request, metadata=forwarded(
                context.invocation_metadata(), front, context.peer()),
                timeout=context.time_remaining())
            try:
                return await relay(call, context)
            except asyncio.CancelledError:  # the client cancelled, or left: so does the call
                call.cancel()
                raise

        return HANDLER_KINDS[kind](handle)


async def _answer(call: grpc.aio.UnaryUnaryCall[Any, Any], context: Context) -> Any:
    """A unary answer: its message, then its metadata."""
    try:
        response = await call
    except grpc.aio.AioRpcError as error:
        await _fail(context, error)
    await _headers(call, context)
    context.set_trailing_metadata(tuple(await call.trailing_metadata()))
    return response


async def _answers(call: grpc.aio.UnaryStreamCall[Any, Any], context: Context) -> None:
    """A streamed answer: its metadata first, its messages as they come, its trailers."""
    try:
        await _headers(call, context)
        async for response in call:
            await context.write(response)
    except grpc.aio.AioRpcError as error:
        await _fail(context, error)
    context.set_trailing_metadata(tuple(await call.trailing_metadata()))


async def _headers(call: grpc.aio.Call, context: Context) -> None:
    initial = await call.initial_metadata()
    if initial:
        await context.send_initial_metadata(tuple(initial))


async def _fail(context: Context, error: grpc.aio.AioRpcError) -> NoReturn:
    """End the client's call as the owner ended the relayed one."""
    await context.abort(error.code(), error.details() or "",
                        tuple(error.trailing_metadata() or ()))
    raise AssertionError("unreachable: abort raises")


async def serve(ports: list[dict[str, Any]], front: int, credentials: Any
                ) -> list[tuple[grpc.aio.Server, grpc.aio.Channel]]:
    """Accept on each shared gRPC port (its owner's options, SO_REUSEPORT among them),
    relaying to its inner server; ``credentials``: the server's certificate, for a TLS port."""
    served = []
    for port in ports:
        channel = grpc.aio.insecure_channel(f"unix:{port['inner']}", options=_UNLIMITED)
        server = grpc.aio.server(options=[tuple(option) for option in port["options"]])
        server.add_generic_rpc_handlers((Relay(front, channel),))
        target = port["target"]
        try:
            bound = server.add_secure_port(target, credentials) if port["tls"] \
                else server.add_insecure_port(target)
        except RuntimeError as exc:
            raise OSError(f"cannot bind gRPC port {target}: {exc}") from None
        if bound == 0:
            raise OSError(f"cannot bind gRPC port {target}")
        await server.start()
        served.append((server, channel))
    return served


async def stop(served: list[tuple[grpc.aio.Server, grpc.aio.Channel]], grace_s: float
               ) -> None:
    """Stop accepting; the calls open finish within ``grace_s``; then the channels close."""
    await asyncio.gather(*(server.stop(grace_s) for server, _ in served))
    await asyncio.gather(*(channel.close() for _, channel in served))

