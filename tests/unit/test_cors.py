"""CORS (frontend/api/http/cors.py): the policy of TorchServe's three keys, the ASGI wrapper,
and the fast path's protocol class; the integration tests drive them over real connections
and from a browser (tests/integration/test_cors_and_legacy.py)."""

from __future__ import annotations

import asyncio

import pytest

from frontend.api.http import common
from frontend.api.http.cors import CorsApp, CorsPolicy, with_cors
from frontend.api.http.fast import CorsPredictionsProtocol, PredictionsProtocol, protocol_for
from frontend.config import ServerConfig, build_config
from tests.unit.services import call

SITE = b"https://site.example"


def _policy(**keys: str) -> CorsPolicy | None:
    config, unknown = build_config(keys)
    assert unknown == []
    return CorsPolicy.from_config(config)


def test_no_key_set_means_no_policy() -> None:
    assert CorsPolicy.from_config(ServerConfig()) is None
    assert _policy(cors_allowed_origin="  ") is None


def test_a_star_allows_every_origin_with_the_configured_headers() -> None:
    policy = _policy(cors_allowed_origin="*", cors_allowed_methods="GET, POST",
                     cors_allowed_headers="X-Custom")
    assert policy is not None
    expected = ((b"access-control-allow-origin", b"*"),
                (b"access-control-allow-methods", b"GET, POST"),
                (b"access-control-allow-headers", b"X-Custom"))
    assert policy.headers_for(SITE) == expected
    assert policy.headers_for(None) == expected


def test_named_origins_are_answered_with_themselves_and_others_with_nothing() -> None:
    policy = _policy(cors_allowed_origin="https://site.example, http://127.0.0.1:3000")
    assert policy is not None
    assert policy.headers_for(SITE) == ((b"access-control-allow-origin", SITE),
                                        (b"vary", b"Origin"))
    assert policy.headers_for(b"http://127.0.0.1:3000")[0][1] == b"http://127.0.0.1:3000"  # type: ignore[index]
    assert policy.headers_for(b"https://evil.example") is None
    assert policy.headers_for(b"https://site.example.evil.example") is None
    # No Origin (curl, a server): TorchServe's header, the key as written.
    assert policy.headers_for(None) == ((b"access-control-allow-origin",
                                         b"https://site.example, http://127.0.0.1:3000"),)
    assert policy.for_request([(b"host", b"x"), (b"origin", SITE)]) == \
        policy.headers_for(SITE)


def test_methods_or_headers_alone_are_sent_as_torchserve_sends_them() -> None:
    policy = _policy(cors_allowed_methods="PUT")
    assert policy is not None
    assert policy.headers_for(SITE) == ((b"access-control-allow-methods", b"PUT"),)


def test_a_header_the_response_sets_itself_is_kept() -> None:
    cors = ((b"access-control-allow-origin", b"*"), (b"access-control-allow-methods", b"GET"))
    merged = with_cors([(b"Access-Control-Allow-Origin", b"https://mine.example")], cors)
    assert merged == [(b"Access-Control-Allow-Origin", b"https://mine.example"),
                      (b"access-control-allow-methods", b"GET")]


def _recording_app(seen: list[common.Scope]) -> common.AsgiApp:
    async def app(scope: common.Scope, receive: common.Receive, send: common.Send) -> None:
        seen.append(scope)
        await common.send_bytes(send, 401, b"{}", common.JSON, [(b"x-own", b"1")])

    return app


@pytest.mark.parametrize("origin", [SITE, None])
def test_the_asgi_wrapper_answers_preflights_and_adds_headers(origin: bytes | None) -> None:
    policy = _policy(cors_allowed_origin="https://site.example", cors_allowed_methods="PUT",
                     cors_allowed_headers="Authorization")
    assert policy is not None
    seen: list[common.Scope] = []
    app = CorsApp(_recording_app(seen), policy)
    sent = [(b"origin", origin)] if origin is not None else []

    async def main() -> None:
        preflight = await call(app, "OPTIONS", "/predictions/m", headers=[
            *sent, (b"access-control-request-method", b"PUT")])
        assert (preflight.status, preflight.body) == (200, b"")
        assert preflight.headers[b"access-control-allow-methods"] == b"PUT"
        assert preflight.headers[b"access-control-allow-headers"] == b"Authorization"
        assert seen == []  # answered before any route (and its token check)
        answer = await call(app, "POST", "/predictions/m", headers=sent)
        assert answer.status == 401 and answer.headers[b"x-own"] == b"1"
        assert answer.headers[b"access-control-allow-origin"] == SITE
        # An OPTIONS that is no preflight is the app's to answer.
        await call(app, "OPTIONS", "/", headers=sent)
        assert [scope["method"] for scope in seen] == ["POST", "OPTIONS"]

    asyncio.run(main())


def test_the_asgi_wrapper_gives_an_origin_not_allowed_nothing() -> None:
    policy = _policy(cors_allowed_origin="https://site.example", cors_allowed_methods="PUT")
    assert policy is not None
    seen: list[common.Scope] = []
    app = CorsApp(_recording_app(seen), policy)
    other = [(b"origin", b"https://evil.example")]

    async def main() -> None:
        preflight = await call(app, "OPTIONS", "/predictions/m",
                               headers=[*other, (b"access-control-request-method", b"PUT")])
        answer = await call(app, "GET", "/models", headers=other)
        for reply in (preflight, answer):
            assert reply.status == 401  # the app's own answer, without CORS
            assert not [name for name in reply.headers if name.startswith(b"access-control")]

    asyncio.run(main())


def test_only_a_server_with_cors_gets_the_cors_fast_path() -> None:
    """No key set: the listener's protocol is the plain fast path (nothing per request)."""
    class Inference:
        plane = object()

    plain = protocol_for(Inference(), 30.0, lambda status: None)  # type: ignore[arg-type]
    assert issubclass(plain, PredictionsProtocol)
    assert not issubclass(plain, CorsPredictionsProtocol)
    policy = _policy(cors_allowed_origin="*")
    with_policy = protocol_for(Inference(), 30.0, lambda status: None, policy)  # type: ignore[arg-type]
    assert issubclass(with_policy, CorsPredictionsProtocol)
    assert with_policy.cors is policy  # type: ignore[attr-defined]
