"""TorchServe's ``text_classifier``, without torchtext: ``{label: probability}`` for each text.

The model is TorchServe's text-classification shape, ``model(tokens, offsets) -> [N, classes]``
(an ``nn.EmbeddingBag`` over token ids, then a linear layer), and the vocabulary is the
archive's ``source_vocab.pt`` (or the manifest's ``sourceVocab``). Unlike TorchServe's, which
reads only the first request, the whole batch goes through one forward pass.

Text is normalised as TorchServe does (HTML tags dropped, lower case, English contractions
expanded, accents and punctuation removed, split on white space; words plus their bigrams).
Differences: the vocabulary must be a plain ``{token: index}`` dict or a list of tokens saved
with ``torch.save`` (a torchtext ``Vocab`` object needs torchtext to load; save its
``get_stoi()`` instead), unknown tokens map to ``<unk>`` or are skipped, and contractions are
expanded by rule rather than from TorchServe's table.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from backend.context import Context
from backend.errors import InvalidInput, ModelLoadError, describe
from backend.handlers.base import BaseHandler
from backend.handlers.labels import label_of

SOURCE_VOCAB = "source_vocab.pt"
UNKNOWN = "<unk>"

_HTML = re.compile(r"<.*?>|&([a-z0-9]+|#[0-9]{1,6}|#x[0-9a-f]{1,6});")
_IRREGULAR = {"can't": "cannot", "won't": "will not", "shan't": "shall not", "ain't": "is not"}
_IS_PRONOUNS = "he|she|it|that|what|where|there|who|how|here"
_SUFFIXES = (
    (re.compile(r"n't\b"), " not"),
    (re.compile(r"'re\b"), " are"),
    (re.compile(r"'ve\b"), " have"),
    (re.compile(r"'ll\b"), " will"),
    (re.compile(r"'d\b"), " would"),
    (re.compile(r"'m\b"), " am"),
    (re.compile(rf"\b({_IS_PRONOUNS})'s\b"), r"\1 is"),
    (re.compile(r"\blet's\b"), "let us"),
)
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalise(text: str) -> list[str]:
    """TorchServe's text clean-up, then the words of the text."""
    text = _HTML.sub("", text).lower().replace("\u2019", "'")
    for word, expansion in _IRREGULAR.items():
        text = text.replace(word, expansion)
    for pattern, replacement in _SUFFIXES:
        text = pattern.sub(replacement, text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    return text.translate(_PUNCTUATION).split()


def with_ngrams(words: list[str], n: int) -> list[str]:
    """The words, then every run of 2..n consecutive words joined by a space."""
    grams = list(words)
    for size in range(2, n + 1):
        grams.extend(" ".join(words[i : i + size]) for i in range(len(words) - size + 1))
    return grams


def load_vocab(path: Path) -> dict[str, int]:
    """A ``{token: index}`` vocabulary saved with torch.save (a dict, or a list of tokens)."""
    if not path.is_file():
        raise ModelLoadError(
            f"the text classifier needs its vocabulary, {path.name}, in the model directory "
            f"(archive it with --extra-files)"
        )
    try:
        vocab = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelLoadError(
            f"cannot load {path.name}: {describe(exc)}; save the vocabulary as a plain "
            f"{{token: index}} dict (for a torchtext Vocab: torch.save(vocab.get_stoi(), path))"
        ) from exc
    if isinstance(vocab, list) and all(isinstance(token, str) for token in vocab):
        return {token: index for index, token in enumerate(vocab)}
    if isinstance(vocab, Mapping) and all(
        isinstance(k, str) and isinstance(v, int) for k, v in vocab.items()
    ):
        return dict(vocab)
    raise ModelLoadError(
        f"{path.name} holds a {type(vocab).__name__}, not a {{token: index}} dict or a list "
        f"of tokens"
    )


class TextClassifier(BaseHandler):
    """Per text, the probability of every class, named through ``index_to_name.json``."""

    ngrams = 2
    graphs_unfit = ("text_classifier: a batch is its texts' token ids in one flat tensor and "
                    "their offsets, whose length varies with the texts: no static input to "
                    "capture a graph of, nor rows to pad")

    def __init__(self) -> None:
        super().__init__()
        self.source_vocab: dict[str, int] = {}

    def initialize(self, context: Context) -> None:
        super().initialize(context)
        model = context.manifest.get("model")
        named = model.get("sourceVocab") if isinstance(model, Mapping) else None
        model_dir = Path(context.system_properties["model_dir"])
        self.source_vocab = load_vocab(model_dir / str(named or SOURCE_VOCAB))

    def predict_requests(self, data: list[Any], context: Context) -> list[Any]:
        """One result per request: class probabilities, or the InvalidInput of a bad text."""
        return self.handle_valid([self.token_ids(row) for row in data], context)

    def token_ids(self, row: Any) -> list[int] | InvalidInput:
        """The vocabulary indices of one request's text, or what is wrong with it."""
        text = (row.get("data") or row.get("body")) if isinstance(row, Mapping) else row
        if isinstance(text, (bytes, bytearray)):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as exc:
                return InvalidInput(f"the text is not UTF-8: {exc}")
        if not isinstance(text, str):
            return InvalidInput(f"expected text, got a JSON {type(text).__name__}")
        if not text.strip():
            return InvalidInput("empty body: the request carries no text")
        unknown = self.source_vocab.get(UNKNOWN)
        ids = (
            self.source_vocab.get(gram, unknown)
            for gram in with_ngrams(normalise(text), self.ngrams)
        )
        return [index for index in ids if index is not None]

    def preprocess(self, data: list[Any]) -> Any:
        # One flat tensor of token ids and the offset where each text starts (EmbeddingBag).
        lengths = [len(ids) for ids in data]
        tokens = torch.tensor([i for ids in data for i in ids], dtype=torch.long)
        offsets = torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(dim=0)
        return tokens.to(self.device), offsets.to(self.device)

    def inference(self, inputs: Any) -> Any:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__} was not initialised")
        tokens, offsets = inputs
        return self.model(tokens, offsets)  # never through the runner: see graphs_unfit

    def postprocess(self, outputs: Any) -> list[Any]:
        return [
            {label_of(self.mapping, index): p for index, p in enumerate(row)}
            for row in torch.softmax(outputs, dim=1).tolist()
        ]
