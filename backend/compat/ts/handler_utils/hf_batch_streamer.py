"""``ts.handler_utils.hf_batch_streamer``: Hugging Face's ``TextIteratorStreamer`` for a
batch: ``generate(..., streamer=...)`` feeds it token ids ``[batch, n]``, and iterating it
gives, step by step, one ``{"text": ...}`` per sequence of the batch.

Needs ``transformers`` at import, as TorchServe's module does.
"""

from __future__ import annotations

from typing import Any

from backend.optional import require

_streamers = require("transformers.generation.streamers", "ts.handler_utils.hf_batch_streamer",
                     "pip install transformers")


class TextIteratorStreamerBatch(_streamers.BaseStreamer):  # type: ignore[misc,name-defined]
    """One ``TextIteratorStreamer`` per sequence of a batch of ``batch_size``."""

    def __init__(self, tokenizer: Any, batch_size: int, skip_prompt: bool = False,
                 timeout: float | None = None, **decode_kwargs: Any) -> None:
        self.batch_size = batch_size
        self.streamers = [
            _streamers.TextIteratorStreamer(tokenizer, skip_prompt, timeout, **decode_kwargs)
            for _ in range(batch_size)]
        self.streamer_iterators = [iter(streamer) for streamer in self.streamers]

    def put(self, value: Any) -> None:
        """New token ids, one row per sequence."""
        if value.shape[0] != self.batch_size:
            raise ValueError(f"TextIteratorStreamerBatch batch size is set to "
                             f"{self.batch_size} but got input tensor of shape {value.shape}")
        for index, streamer in enumerate(self.streamers):
            streamer.put(value[index:index + 1])

    def end(self) -> None:
        for streamer in self.streamers:
            streamer.end()

    def __iter__(self) -> TextIteratorStreamerBatch:
        return self

    def __next__(self) -> list[dict[str, str]]:
        """The next text of every sequence (each is advanced); stops when any has ended."""
        texts: list[dict[str, str] | None] = []
        for iterator in self.streamer_iterators:
            try:
                texts.append({"text": next(iterator)})
            except StopIteration:
                texts.append(None)
        if None in texts:
            raise StopIteration
        return [text for text in texts if text is not None]
