"""``ts.torch_handler.text_handler``: TorchServe's TextHandler, the base of its text
handlers: the vocabulary (``source_vocab.pt``, or the manifest's ``sourceVocab``), the
``basic_english`` tokenizer, and the clean-up steps subclasses call (HTML tags, contractions,
accents, punctuation).

The vocabulary: a ``{token: index}`` dict or a list of tokens saved with ``torch.save``
becomes a ``Vocabulary`` (``vocab[token]`` is the index; an unknown token gives ``<unk>``'s
index when there is one, else a KeyError, as torchtext's Vocab does without a default); any
other saved object (a torchtext ``Vocab``, which needs torchtext installed) is loaded as it
is, since the archive's files are trusted as its handler is. Captum's
LayerIntegratedGradients (``self.lig``) is made at load when Captum is installed and the
model has an ``embedding`` layer, as TorchServe's is; without Captum, explanations answer 501.
"""

from __future__ import annotations

import logging
import os
import re
import string
import unicodedata
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from backend.context import Context
from backend.errors import ModelLoadError, Unsupported, describe

from ..handler_utils.text_utils import get_tokenizer
from ..utils.util import CLEANUP_REGEX
from .base_handler import BaseHandler
from .contractions import CONTRACTION_MAP

__all__ = ["CLEANUP_REGEX", "CONTRACTIONS_PATTERN", "CONTRACTION_MAP", "BaseHandler",
           "TextHandler", "Vocabulary", "get_tokenizer"]

logger = logging.getLogger(__name__)

#: Any contraction of CONTRACTION_MAP, whatever its case.
CONTRACTIONS_PATTERN = re.compile(
    "({})".format("|".join(re.escape(key) for key in sorted(CONTRACTION_MAP, key=len,
                                                             reverse=True))),
    flags=re.IGNORECASE | re.DOTALL)
UNKNOWN = "<unk>"
SOURCE_VOCAB = "source_vocab.pt"


class Vocabulary(Mapping[str, int]):
    """token -> index, as torchtext's Vocab answers ``vocab[token]``."""

    def __init__(self, stoi: Mapping[str, int]) -> None:
        self._stoi = dict(stoi)
        self._unknown = self._stoi.get(UNKNOWN)

    def __getitem__(self, token: str) -> int:
        index = self._stoi.get(token, self._unknown)
        if index is None:
            raise KeyError(f"token {token!r} is not in the vocabulary (which has no {UNKNOWN})")
        return index

    def __contains__(self, token: object) -> bool:
        return token in self._stoi

    def __iter__(self) -> Iterator[str]:
        return iter(self._stoi)

    def __len__(self) -> int:
        return len(self._stoi)

    def get_stoi(self) -> dict[str, int]:
        return dict(self._stoi)

    def get_itos(self) -> list[str]:
        return sorted(self._stoi, key=self._stoi.__getitem__)

    def lookup_indices(self, tokens: list[str]) -> list[int]:
        return [self[token] for token in tokens]


def load_source_vocab(path: str) -> Any:
    """The vocabulary saved at ``path`` (see the module's docstring). Raises ModelLoadError."""
    try:
        vocab = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        try:  # a pickled object such as torchtext's Vocab
            vocab = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise ModelLoadError(f"cannot load the vocabulary {os.path.basename(path)}: "
                                 f"{describe(exc)} (save a {{token: index}} dict, e.g. a "
                                 f"torchtext Vocab's get_stoi())") from exc
        return vocab
    if isinstance(vocab, list) and all(isinstance(token, str) for token in vocab):
        return Vocabulary({token: index for index, token in enumerate(vocab)})
    if isinstance(vocab, Mapping):
        return Vocabulary(vocab)
    return vocab


class TextHandler(BaseHandler):
    """Loads the model and its vocabulary; text clean-up helpers for subclasses."""

    source_vocab: Any = None
    tokenizer = staticmethod(get_tokenizer("basic_english"))
    input_text: Any = None
    lig: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.source_vocab = None
        self.tokenizer = get_tokenizer("basic_english")
        self.input_text = None
        self.lig = None
        self.initialized = False

    def initialize(self, context: Context) -> None:
        """The model (BaseHandler), the vocabulary, and Captum's LayerIntegratedGradients."""
        super().initialize(context)
        self.initialized = False
        model = (self.manifest or {}).get("model") or {}
        named = model.get("sourceVocab")
        if named:  # relative to the model directory, where TorchServe's worker runs
            path = os.path.join(str(context.system_properties.get("model_dir")), named)
        else:
            path = self.get_source_vocab_path(context)
        self.source_vocab = load_source_vocab(path)
        self.lig = self._layer_integrated_gradients()
        self.initialized = True

    def _layer_integrated_gradients(self) -> Any:
        embedding = getattr(self.model, "embedding", None)
        if embedding is None:
            return None
        try:
            from captum.attr import LayerIntegratedGradients
        except ImportError:
            return None
        return LayerIntegratedGradients(self.model, embedding)

    def _require_lig(self) -> Any:
        if self.lig is None:
            raise Unsupported(f"{type(self).__name__} cannot explain: explanations need Captum "
                              f"(pip install captum) and a model with an `embedding` layer")
        return self.lig

    def get_source_vocab_path(self, ctx: Context) -> str:
        """``source_vocab.pt`` in the model directory; ModelLoadError when it is missing."""
        path = os.path.join(str(ctx.system_properties.get("model_dir")), SOURCE_VOCAB)
        if not os.path.isfile(path):
            raise ModelLoadError(f"Missing the {SOURCE_VOCAB} file: archive the vocabulary "
                                 f"with --extra-files (see TorchServe's text handler docs)")
        return path

    def _expand_contractions(self, text: str) -> str:
        """Each contraction replaced by its expansion (keeping its first letter's case), then
        the remaining apostrophes dropped."""

        def expand(match: re.Match[str]) -> str:
            found = match.group(0)
            expansion = CONTRACTION_MAP.get(found) or CONTRACTION_MAP.get(found.lower(), found)
            return found[0] + expansion[1:]

        return CONTRACTIONS_PATTERN.sub(expand, text).replace("'", "")

    def _remove_accented_characters(self, text: str) -> str:
        return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("utf-8")

    def _remove_html_tags(self, text: str) -> str:
        return CLEANUP_REGEX.sub("", text)

    def _remove_puncutation(self, *args: Any, **kwargs: Any) -> str:
        """TorchServe's misspelt name, kept for handlers that call it."""
        return self._remove_punctuation(*args, **kwargs)

    def _remove_punctuation(self, text: str) -> str:
        return text.translate(str.maketrans("", "", string.punctuation))

    def _tokenize(self, text: str) -> list[str]:
        return list(self.tokenizer(text))

    def get_word_token(self, input_tokens: list[str]) -> list[str]:
        """The tokens without the "Ġ" a byte-level BPE tokenizer marks spaces with."""
        return [token.replace("Ġ", "") for token in input_tokens]

    def summarize_attributions(self, attributions: torch.Tensor) -> torch.Tensor:
        """Attributions softmaxed over the last dimension, scaled by the norm of their sums."""
        attributions = torch.softmax(attributions, dim=-1)
        summarized: torch.Tensor = attributions / torch.norm(attributions.sum(dim=-1))
        return summarized
