"""The pure pieces of frontend/serving/workers.py and exchange.py: restart backoff, the
response size bound, how an error is told (the processes themselves:
test_worker_supervision.py)."""

from __future__ import annotations

import pytest

from frontend.errors import GatewayTimeout
from frontend.serving.exchange import bounded
from frontend.serving.workers import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    WorkerStartError,
    backoff_s,
    describe_error,
)
from protos import worker_pb2


@pytest.mark.parametrize("failures", [0, -1, -100])
def test_no_failure_means_no_wait(failures: int) -> None:
    assert backoff_s(failures) == 0.0


def test_a_first_death_restarts_at_once() -> None:
    assert backoff_s(1) == 0.0


def test_backoff_doubles_from_half_a_second_after_the_first_restart() -> None:
    assert BACKOFF_FIRST_S == 0.5
    assert [backoff_s(n) for n in range(2, 7)] == [0.5, 1.0, 2.0, 4.0, 8.0]


def test_backoff_is_capped() -> None:
    waits = [backoff_s(n) for n in range(1, 200)]  # 2.0 ** 198 must not overflow the cap
    assert max(waits) == BACKOFF_MAX_S
    assert waits == sorted(waits)
    assert backoff_s(8) == BACKOFF_MAX_S  # 0.5 * 64 = 32 > 30


def test_a_response_at_the_limit_passes_through_unchanged() -> None:
    response = worker_pb2.Response(request_id="r1", status=201, body=b"x" * 10,
                                   content_type="text/plain", headers={"a": "b"})
    assert bounded(response, 10) is response


def test_a_response_over_the_limit_becomes_a_500_naming_the_limit() -> None:
    response = worker_pb2.Response(request_id="r1", status=200, body=b"x" * 11,
                                   content_type="text/plain", headers={"a": "b"})
    replaced = bounded(response, 10)
    assert replaced.request_id == "r1"
    assert replaced.status == 500
    assert replaced.body == b"" and replaced.content_type == "" and not replaced.headers
    assert replaced.error == \
        "the response of 11 bytes exceeds max_response_size (10 bytes)"


def test_an_empty_response_passes_a_zero_limit() -> None:
    response = worker_pb2.Response(request_id="r1")
    assert bounded(response, 0) is response


def test_describe_error_names_the_type_and_the_message() -> None:
    assert describe_error(WorkerStartError("load failed")) == "WorkerStartError: load failed"
    assert describe_error(GatewayTimeout("no answer in 2s")) == \
        "GatewayTimeout: no answer in 2s"


def test_describe_error_without_a_message_is_the_type_alone() -> None:
    assert describe_error(ConnectionResetError()) == "ConnectionResetError"
    assert describe_error(TimeoutError("")) == "TimeoutError"
