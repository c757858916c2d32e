"""``ts.async_service``: TorchServe's worker mode for handlers whose ``handle`` is a coroutine
(``asyncCommunication: true``; its vLLM and TensorRT-LLM handlers): requests are read,
batched (one at a time, as TorchServe 0.12 does) and answered concurrently on one event
loop, each batch with its own copy of the context.

Part of TorchServe's own worker protocol (``ts.model_service_worker --async``); batchserve's
worker (``backend.process.worker``) does not use it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
import traceback
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from queue import Empty, Queue
from typing import Any

from .handler_utils.utils import create_predict_response
from .protocol.otf_message_handler import retrieve_msg
from .service import (
    PREDICTION_METRIC,
    PredictionException,
    Service,
    _failed_prediction,
    _prediction_answer,
)

__all__ = ["PREDICTION_METRIC", "AsyncService", "PredictionException", "Service",
           "create_predict_response", "predict", "retrieve_msg"]

logger = logging.getLogger(__name__)

#: How long to wait for more requests to join a batch, and how many may.
MAX_WAIT_S = 0.1
BATCH_SIZE = 1


async def predict(self: Service, batch: Any) -> bytearray | None:
    """``Service.predict`` for a coroutine entry point: the same answers and errors, with a
    copy of the context per batch (batches run concurrently)."""
    headers, inputs, ids = Service.retrieve_data_for_inference(batch)
    context = copy.deepcopy(self.context)
    context.request_ids = ids
    context.request_processor = headers
    context.cl_socket = self.cl_socket  # type: ignore[attr-defined]
    metrics = context.metrics
    metrics.request_ids = ids
    start = time.time()
    try:
        results = await self._entry_point(inputs, context)
    except Exception as exc:
        return _failed_prediction(exc, ids)
    return _prediction_answer(results, len(inputs), ids, context, start)


class AsyncService:
    """Serves a loaded Service whose entry point is a coroutine: a thread reads requests, a
    thread batches them onto the event loop, a thread writes the answers."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.service.predict = types.MethodType(predict, self.service)  # type: ignore[method-assign]
        self.in_queue: Queue[Any] = Queue()
        self.out_queue: asyncio.Queue[Any] | None = None
        self.exception_queue: Queue[str] = Queue()
        self.loop: asyncio.AbstractEventLoop | None = None

    def receive_requests(self) -> None:
        """Queue every PREDICT message from the frontend (ignoring other commands)."""
        while True:
            command, message = retrieve_msg(self.service.cl_socket)
            if command == b"I":
                self.in_queue.put(message)
            else:
                logger.debug("Unexpected request: %r", command)

    async def call_predict(self, batch: Any) -> None:
        response = await self.service.predict(batch)  # type: ignore[misc]
        assert self.out_queue is not None
        await self.out_queue.put(response)

    def fetch_batches(self) -> None:
        """Gather up to BATCH_SIZE requests within MAX_WAIT_S and run them on the loop."""
        while True:
            started = time.monotonic()
            batch = list(self.in_queue.get())
            try:
                while len(batch) < BATCH_SIZE:
                    left = MAX_WAIT_S - (time.monotonic() - started)
                    if left <= 0:
                        break
                    batch += self.in_queue.get(timeout=left)
            except Empty:
                pass
            assert self.loop is not None
            asyncio.run_coroutine_threadsafe(self.call_predict(batch), self.loop)

    def send_responses(self) -> None:
        """Write each answer to the frontend as it is ready."""
        while True:
            assert self.loop is not None and self.out_queue is not None
            response = asyncio.run_coroutine_threadsafe(self.out_queue.get(), self.loop).result()
            if response is not None:
                self.service.cl_socket.sendall(response)

    def run(self) -> str | None:
        """Serve until one of the threads fails; the failure's traceback, or None."""

        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.out_queue = asyncio.Queue()
            threads = [threading.Thread(target=self._guarded(step), daemon=True)
                       for step in (self.fetch_batches, self.receive_requests,
                                    self.send_responses)]
            for thread in threads:
                thread.start()

            def wait_for_a_failure() -> None:
                while all(thread.is_alive() for thread in threads):
                    for thread in threads:
                        thread.join(timeout=1.0)
                        if not thread.is_alive():
                            return

            with ThreadPoolExecutor(1) as executor:
                await self.loop.run_in_executor(executor, wait_for_a_failure)

        asyncio.run(main())
        return None if self.exception_queue.empty() else self.exception_queue.get()

    def _guarded(self, step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                step()
            except Exception:  # a frontend that disconnects exits the thread (SystemExit)
                self.exception_queue.put(traceback.format_exc())

        return run
