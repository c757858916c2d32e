"""A front's gRPC relay (frontend/front/relay.py) and the owner's side of it
(api/grpc/common.FrontCalls): which kind each method is relayed as, what metadata the owner
gets, whose client a relayed call is."""

from __future__ import annotations

from typing import Any

from frontend.api.grpc.common import FRONT_PEER, FrontCalls, metadata_headers
from frontend.front.relay import forwarded, method_kinds

INFERENCE = "/org.pytorch.serve.grpc.inference.InferenceAPIsService"


def test_each_method_of_the_shared_services_is_relayed_in_its_kind() -> None:
    kinds = method_kinds()
    assert kinds[f"{INFERENCE}/Predictions"] == (False, False)
    assert kinds[f"{INFERENCE}/StreamPredictions"] == (False, True)
    assert kinds[f"{INFERENCE}/StreamPredictions2"] == (True, True)
    assert kinds["/inference.GRPCInferenceService/ModelInfer"] == (False, False)
    assert kinds["/grpc.health.v1.Health/Watch"] == (False, True)
    assert kinds["/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"] == \
        (True, True)
    assert not any("ManagementAPIsService" in name for name in kinds)  # not a shared port's


def test_the_owner_gets_the_clients_metadata_and_who_the_client_is() -> None:
    sent = (("authorization", "Bearer k"), ("user-agent", "grpc-python"),
            (FRONT_PEER, "9 ipv4:10.9.9.9:1"), ("trace-bin", b"\x00\x01"))
    assert forwarded(sent, 2, "ipv4:127.0.0.1:5000") == (
        ("authorization", "Bearer k"), ("trace-bin", b"\x00\x01"),
        (FRONT_PEER, "2 ipv4:127.0.0.1:5000"))
    assert forwarded(None, 1, "ipv6:%5B::1%5D:7") == ((FRONT_PEER, "1 ipv6:%5B::1%5D:7"),)


class _Context:
    def __init__(self, metadata: tuple[tuple[str, Any], ...], peer: str = "unix:") -> None:
        self._metadata = metadata
        self._peer = peer

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer


def test_a_relayed_call_names_its_client_and_counts_for_its_front() -> None:
    calls = FrontCalls()
    relayed: Any = _Context((("a", "1"), (FRONT_PEER, "2 ipv6:%5B::1%5D:41696")))
    assert calls.client(relayed) == "/[::1]:41696"
    assert calls.client(relayed) == "/[::1]:41696"
    assert calls.counts == {2: 2}
    unnamed: Any = _Context((("a", "1"),))
    assert calls.client(unnamed) == "unix:" and calls.counts == {2: 2}
    # The server's own key never reaches a handler as a header.
    assert metadata_headers(relayed) == [(b"a", b"1")]
