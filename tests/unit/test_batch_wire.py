"""The PredictBatch the frontend writes by hand (protos/batch_wire.py) is protobuf's own."""

from __future__ import annotations

import pytest

from protos import worker_pb2
from protos.batch_wire import predict_batch_bytes


def _request(index: int, body_size: int) -> worker_pb2.Request:
    request = worker_pb2.Request(request_id=f"r{index}", describe=index % 2 == 1,
                                 tensor_format=worker_pb2.TENSOR_FORMAT_REST if index else 0)
    request.headers["content-type"] = "image/jpeg"
    request.inputs["body"] = bytes(range(256)) * (body_size // 256) + b"x" * (body_size % 256)
    request.content_types["body"] = "image/jpeg"
    return request


@pytest.mark.parametrize("batch_id", [0, 1, 127, 128, 16_383, 16_384, 2**40])
@pytest.mark.parametrize("body_size", [0, 1, 90, 127, 128, 16_000, 16_384, 70_000, 3 << 20])
def test_the_bytes_are_protobufs_own(batch_id: int, body_size: int) -> None:
    requests = [_request(index, body_size + index) for index in range(3)]
    expected = worker_pb2.PredictBatch(batch_id=batch_id, requests=requests)
    written = predict_batch_bytes(batch_id, requests)
    assert written == expected.SerializeToString()
    assert worker_pb2.PredictBatch.FromString(written) == expected


def test_an_empty_batch() -> None:
    assert predict_batch_bytes(5, []) == worker_pb2.PredictBatch(batch_id=5).SerializeToString()


def test_the_writer_knows_every_field_of_the_message() -> None:
    """A field added to PredictBatch must be written here too."""
    assert set(worker_pb2.PredictBatch.DESCRIPTOR.fields_by_name) == {"batch_id", "requests"}
